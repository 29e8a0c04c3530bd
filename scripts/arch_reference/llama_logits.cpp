// llama.cpp's logits for given token ids: the independent reference for the
// quantized files under tests/data/arch/ (scripts/make_arch_reference.py
// compiles this against libllama from a llama.cpp build; nothing of pdcluster
// is linked).
//
//   llama_logits MODEL.gguf IDS.txt OUT.f32 [THREADS]
//
// IDS.txt holds one prompt per line, token ids separated by spaces. Each prompt
// is evaluated alone from an empty cache (one llama_decode with every
// position's logits requested); OUT.f32 receives, prompt after prompt, every
// position's logits (n_tokens x n_vocab little-endian float32). The KV cache
// is f32 and flash attention off, so what differs from an exact fp32 forward
// pass is llama.cpp's matmul arithmetic (its quantized activations), not the
// cache.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "llama.h"

static void quiet_log(ggml_log_level level, const char* text, void*) {
  if (level >= GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s MODEL.gguf IDS.txt OUT.f32 [THREADS]\n", argv[0]);
    return 2;
  }
  const int threads = argc > 4 ? std::atoi(argv[4]) : 2;
  std::vector<std::vector<llama_token>> prompts;
  {
    std::ifstream in(argv[2]);
    if (!in) {
      std::fprintf(stderr, "cannot read %s\n", argv[2]);
      return 1;
    }
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream ls(line);
      std::vector<llama_token> p;
      for (llama_token t; ls >> t;) p.push_back(t);
      if (!p.empty()) prompts.push_back(std::move(p));
    }
  }
  size_t longest = 0;
  for (const auto& p : prompts) longest = std::max(longest, p.size());
  if (prompts.empty()) {
    std::fprintf(stderr, "%s holds no prompts\n", argv[2]);
    return 1;
  }

  llama_log_set(quiet_log, nullptr);
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  llama_model* model = llama_model_load_from_file(argv[1], mp);
  if (!model) {
    std::fprintf(stderr, "llama.cpp cannot load %s\n", argv[1]);
    return 1;
  }
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = static_cast<uint32_t>((longest + 255) / 256 * 256);
  cp.n_batch = cp.n_ubatch = static_cast<uint32_t>(longest);
  cp.n_seq_max = 1;
  cp.n_threads = cp.n_threads_batch = threads;
  cp.type_k = GGML_TYPE_F32;
  cp.type_v = GGML_TYPE_F32;
  cp.flash_attn = false;
  cp.swa_full = true;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (!ctx) {
    std::fprintf(stderr, "llama.cpp cannot create a context for %s\n", argv[1]);
    return 1;
  }
  const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

  FILE* out = std::fopen(argv[3], "wb");
  if (!out) {
    std::fprintf(stderr, "cannot write %s\n", argv[3]);
    return 1;
  }
  llama_batch batch = llama_batch_init(static_cast<int32_t>(longest), 0, 1);
  for (const auto& p : prompts) {
    llama_memory_clear(llama_get_memory(ctx), true);
    batch.n_tokens = static_cast<int32_t>(p.size());
    for (size_t i = 0; i < p.size(); ++i) {
      batch.token[i] = p[i];
      batch.pos[i] = static_cast<llama_pos>(i);
      batch.n_seq_id[i] = 1;
      batch.seq_id[i][0] = 0;
      batch.logits[i] = 1;
    }
    if (llama_decode(ctx, batch) != 0) {
      std::fprintf(stderr, "llama_decode failed on %s\n", argv[1]);
      return 1;
    }
    for (size_t i = 0; i < p.size(); ++i) {
      const float* l = llama_get_logits_ith(ctx, static_cast<int32_t>(i));
      if (std::fwrite(l, sizeof(float), n_vocab, out) != static_cast<size_t>(n_vocab)) {
        std::fprintf(stderr, "short write to %s\n", argv[3]);
        return 1;
      }
    }
  }
  llama_batch_free(batch);
  std::fclose(out);
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  std::printf("%d %zu\n", n_vocab, prompts.size());
  return 0;
}
