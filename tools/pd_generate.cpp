// pd-generate: run the engine on one prompt from the command line.
//
//   pd-generate -m models/SmolLM2-135M-Instruct.Q4_1.gguf -p "text" [--chat] [-n N] [--temp T] [--seed S]
//
// Prints the continuation as it is generated, then one stats line on stderr.
//
//   pd-generate -m MODEL --batch prompts.jsonl
//
// Batch mode: one JSON object per input line, {"prompt": str, "chat": bool,
// "max_tokens": int, "ignore_eos": bool, "temperature": float, "seed": int}
// (all but "prompt" optional; the command-line values are the defaults), run
// together through one batched generate(); prints one JSON line per prompt:
// {"index", "prompt_tokens", "completion_tokens", "tokens", "text",
// "finish_reason"} — the reference the cluster tests compare against. Text
// leaves out EOS and <|im_end|>, as the server does.
// Bad flags or an unreadable model: one line on stderr, exit status 2 (usage)
// or 1 (runtime failure).
#include <CLI/CLI.hpp>

#include <fstream>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>

#include "backend/backend.h"
#include "gguf/gguf_reader.h"
#include "kv/kv_block_manager.h"
#include "model/generate.h"
#include "model/kv_cache.h"
#include "model/llama_model.h"
#include "sampling/sampler.h"
#include "tokenizer/tokenizer.h"

namespace {

int fail(const std::string& msg, int code = 1) {
  std::fprintf(stderr, "pd-generate: error: %s\n", msg.c_str());
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_path, prompt, system_prompt, backend_kind = "cpu", kv_dtype_flag = "f16";
  bool chat = false, raw_specials = false, fp32_activations = false, tf32 = false;
  int n_predict = 64, threads = 0, block_size = 16, device = 0;
  float temp = 0.0f, top_p = 1.0f, min_p = 0.0f, presence = 0.0f, frequency = 0.0f;
  int top_k = 0;
  uint64_t seed = 0;
  bool ignore_eos = false;

  CLI::App app{"pd-generate: generate text with the pdcluster engine"};
  app.add_option("-m,--model", model_path, "GGUF model file")->required();
  std::string batch_path;
  auto* prompt_opt = app.add_option("-p,--prompt", prompt, "prompt text (with --chat: the user message)");
  auto* batch_opt = app.add_option("--batch", batch_path, "JSONL file of prompts to run together (see the header)");
  prompt_opt->excludes(batch_opt);
  app.add_flag("--chat", chat, "wrap the prompt in the model's chat template");
  app.add_option("--system", system_prompt, "system message for --chat (default: the template's own)");
  app.add_option("-n,--n-predict", n_predict, "tokens to generate")->check(CLI::Range(1, 1 << 20));
  app.add_option("--temp", temp, "sampling temperature (0 = greedy)")->check(CLI::Range(0.0f, 100.0f));
  app.add_option("--top-k", top_k, "top-k (0 = off)")->check(CLI::NonNegativeNumber);
  app.add_option("--top-p", top_p, "top-p (1 = off)")->check(CLI::Range(0.0f, 1.0f));
  app.add_option("--min-p", min_p, "min-p (0 = off)")->check(CLI::Range(0.0f, 1.0f));
  app.add_option("--presence-penalty", presence, "presence penalty")->check(CLI::Range(-2.0f, 2.0f));
  app.add_option("--frequency-penalty", frequency, "frequency penalty")->check(CLI::Range(-2.0f, 2.0f));
  app.add_option("--seed", seed, "sampling seed");
  app.add_flag("--ignore-eos", ignore_eos, "keep generating past the end-of-sequence token");
  app.add_flag("--parse-special", raw_specials, "recognize special tokens written in the prompt text");
  app.add_option("-t,--threads", threads, "CPU threads (0 = all cores)")->check(CLI::NonNegativeNumber);
  app.add_option("--block-size", block_size, "KV block size in tokens")->check(CLI::Range(1, 1024));
  app.add_option("--backend", backend_kind, "compute backend: cpu or cuda");
  app.add_option("--device", device, "cuda: device ordinal")->check(CLI::Range(0, 1023));
  app.add_flag("--tf32", tf32, "cuda: GEMMs on TF32 tensor cores (changes outputs; off by default)");
  app.add_option("--kv-dtype", kv_dtype_flag, "KV cache elements: f16 (default), q8_0 or f32 (the reference)");
  app.add_flag("--fp32-activations", fp32_activations,
               "CPU: multiply fp32 activations by the weights as stored (the reference path) instead of "
               "8-bit activations with integer dot products");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return fail(e.what(), 2);
  }

  if (prompt_opt->count() == 0 && batch_opt->count() == 0) return fail("one of --prompt or --batch is required", 2);
  const auto kv_dtype = pd::parse_kv_dtype(kv_dtype_flag, "--kv-dtype");
  if (!kv_dtype.is_ok()) return fail(kv_dtype.status().message(), 2);
  if (!std::filesystem::exists(model_path)) return fail("model file not found: " + model_path + " (--model)", 2);
  auto file = pd::GgufFile::open(model_path);
  if (!file.is_ok()) return fail(file.status().to_string());
  std::shared_ptr<const pd::GgufFile> gguf(std::move(file).value());

  auto tok = pd::Tokenizer::from_gguf(*gguf);
  if (!tok.is_ok()) return fail(tok.status().to_string());
  if (!batch_path.empty()) {
    std::ifstream in(batch_path);
    if (!in) return fail("cannot read --batch file '" + batch_path + "'", 2);
    auto tmpl = pd::ChatTemplate::from_gguf(*gguf);
    const pd::TokenId eos = (*tok)->eos_id(), im_end = (*tok)->find_token("<|im_end|>");
    std::vector<pd::GenerateRequest> reqs;
    std::string line;
    for (int line_no = 1; std::getline(in, line); ++line_no) {
      if (line.empty()) continue;
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const std::exception& e) {
        return fail(batch_path + ":" + std::to_string(line_no) + ": " + e.what(), 2);
      }
      if (!j.is_object() || !j.contains("prompt") || !j["prompt"].is_string())
        return fail(batch_path + ":" + std::to_string(line_no) + ": needs a string \"prompt\"", 2);
      const bool is_chat = j.value("chat", chat);
      std::string t = j["prompt"].get<std::string>();
      if (is_chat) {
        if (!tmpl.is_ok()) return fail(tmpl.status().to_string());
        auto r = tmpl->apply({{"user", t}}, true);
        if (!r.is_ok()) return fail(r.status().to_string());
        t = *r;
      }
      pd::GenerateRequest req;
      req.prompt = (*tok)->encode(t, is_chat);
      if ((*tok)->add_bos() && (*tok)->bos_id() >= 0) req.prompt.insert(req.prompt.begin(), (*tok)->bos_id());
      req.sampling.max_tokens = j.value("max_tokens", n_predict);
      req.sampling.ignore_eos = j.value("ignore_eos", ignore_eos);
      req.sampling.temperature = j.value("temperature", temp);
      req.sampling.seed = j.value("seed", seed);
      if (is_chat && im_end >= 0 && im_end != eos) req.sampling.stop_token_ids.push_back(im_end);
      if (auto st = req.sampling.validate(); !st.is_ok())
        return fail(batch_path + ":" + std::to_string(line_no) + ": " + st.message(), 2);
      reqs.push_back(std::move(req));
    }
    pd::BackendConfig bc;
    bc.kind = backend_kind;
    bc.n_threads = threads;
    bc.int8_activations = !fp32_activations;
    bc.device = device;
    bc.cuda_tf32 = tf32;
    auto backend = pd::create_backend(bc);
    if (!backend.is_ok()) return fail(backend.status().to_string() + " (--backend)", 2);
    auto model = pd::LlamaModel::load(gguf, **backend);
    if (!model.is_ok()) return fail(model.status().to_string());
    int64_t tokens_needed = 0;
    for (const auto& r : reqs) {
      if (static_cast<int64_t>(r.prompt.size()) + r.sampling.max_tokens > (*model)->config().context)
        return fail("a --batch prompt plus its max_tokens exceeds the model's context", 2);
      tokens_needed += static_cast<int64_t>(r.prompt.size()) + r.sampling.max_tokens + block_size;
    }
    const int64_t n_blocks = tokens_needed / block_size + 1;
    auto cache = pd::KvCache::create(**backend, (*model)->config(), block_size, n_blocks, *kv_dtype);
    if (!cache.is_ok()) return fail(cache.status().to_string());
    pd::KvBlockManager blocks(pd::KvBlockManagerConfig{block_size, n_blocks, true});
    pd::GenerateOptions opt;
    opt.eos_id = eos;
    auto out = pd::generate(**model, *cache, blocks, reqs, opt, nullptr);
    if (!out.is_ok()) return fail(out.status().to_string());
    for (size_t i = 0; i < out->size(); ++i) {
      const pd::GenerateResult& r = (*out)[i];
      pd::StreamDecoder dec(**tok);
      std::string text;
      for (pd::TokenId t : r.tokens)
        if (t != eos && t != im_end) text += dec.push(t);
      text += dec.flush();
      nlohmann::json o{{"index", i},
                       {"prompt_tokens", reqs[i].prompt.size()},
                       {"completion_tokens", r.tokens.size()},
                       {"tokens", r.tokens},
                       {"text", text},
                       {"finish_reason", r.stop == pd::StopReason::kLength ? "length" : "stop"}};
      std::cout << o.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    }
    return 0;
  }

  std::string text = prompt;
  if (chat) {
    auto tmpl = pd::ChatTemplate::from_gguf(*gguf);
    if (!tmpl.is_ok()) return fail(tmpl.status().to_string());
    std::vector<pd::ChatMessage> msgs;
    if (!system_prompt.empty()) msgs.push_back({"system", system_prompt});
    msgs.push_back({"user", prompt});
    auto rendered = tmpl->apply(msgs, true);
    if (!rendered.is_ok()) return fail(rendered.status().to_string());
    text = *rendered;
  }
  // The chat template's own control tokens are always parsed; user text only with --parse-special.
  std::vector<pd::TokenId> ids = (*tok)->encode(text, chat || raw_specials);
  if (ids.empty()) return fail("the prompt encodes to zero tokens (--prompt)", 2);
  if ((*tok)->add_bos() && (*tok)->bos_id() >= 0) ids.insert(ids.begin(), (*tok)->bos_id());

  pd::BackendConfig bc;
  bc.kind = backend_kind;
  bc.n_threads = threads;
  bc.int8_activations = !fp32_activations;
  bc.device = device;
  bc.cuda_tf32 = tf32;
  auto backend = pd::create_backend(bc);
  if (!backend.is_ok()) return fail(backend.status().to_string() + " (--backend)", 2);
  auto model = pd::LlamaModel::load(gguf, **backend);
  if (!model.is_ok()) return fail(model.status().to_string());
  const pd::LlamaConfig& cfg = (*model)->config();
  if (static_cast<int64_t>(ids.size()) + n_predict > cfg.context)
    return fail("prompt (" + std::to_string(ids.size()) + " tokens) + --n-predict " + std::to_string(n_predict) +
                    " exceeds the model's context length " + std::to_string(cfg.context),
                2);

  const int64_t tokens_needed = static_cast<int64_t>(ids.size()) + n_predict;
  const int64_t n_blocks = (tokens_needed + block_size - 1) / block_size + 1;
  auto cache = pd::KvCache::create(**backend, cfg, block_size, n_blocks, *kv_dtype);
  if (!cache.is_ok()) return fail(cache.status().to_string());
  pd::KvBlockManager blocks(pd::KvBlockManagerConfig{block_size, n_blocks, true});

  pd::GenerateRequest req;
  req.prompt = ids;
  req.sampling.temperature = temp;
  req.sampling.top_k = top_k;
  req.sampling.top_p = top_p;
  req.sampling.min_p = min_p;
  req.sampling.presence_penalty = presence;
  req.sampling.frequency_penalty = frequency;
  req.sampling.seed = seed;
  req.sampling.max_tokens = n_predict;
  req.sampling.ignore_eos = ignore_eos;
  if (auto st = req.sampling.validate(); !st.is_ok()) return fail(st.message(), 2);

  pd::StreamDecoder decoder(**tok);
  pd::GenerateOptions opt;
  opt.eos_id = (*tok)->eos_id();
  if (chat) {
    // ChatML turns end with <|im_end|>, which may differ from the EOS id.
    const pd::TokenId im_end = (*tok)->find_token("<|im_end|>");
    if (im_end >= 0 && im_end != opt.eos_id) req.sampling.stop_token_ids.push_back(im_end);
  }
  opt.on_token = [&](size_t, pd::TokenId t) {
    const pd::StopReason stop = pd::check_stop(req.sampling, t, opt.eos_id, /*n_generated=*/0);
    if (stop == pd::StopReason::kEos || stop == pd::StopReason::kStopToken) return;  // not printed
    std::fputs(decoder.push(t).c_str(), stdout);
    std::fflush(stdout);
  };
  pd::GenerateStats stats;
  auto out = pd::generate(**model, *cache, blocks, std::span<const pd::GenerateRequest>(&req, 1), opt, &stats);
  if (!out.is_ok()) return fail(out.status().to_string());
  std::fputs(decoder.flush().c_str(), stdout);
  std::fputs("\n", stdout);
  std::fflush(stdout);

  const double prefill_tps = stats.prefill_seconds > 0 ? stats.prefill_tokens / stats.prefill_seconds : 0.0;
  const double decode_tps = stats.decode_seconds > 0 ? stats.decode_tokens / stats.decode_seconds : 0.0;
  std::fprintf(stderr,
               "[pd-generate] prompt tokens: %lld | generated: %zu | prefill: %.1f tok/s | decode: %.1f tok/s | "
               "KV bytes/token: %lld (%s) | backend: %s, weights %.1f MB\n",
               static_cast<long long>(stats.prompt_tokens), (*out)[0].tokens.size(), prefill_tps, decode_tps,
               static_cast<long long>(cfg.kv_geometry(*kv_dtype).bytes_per_token()), pd::kv_dtype_name(*kv_dtype),
               (*backend)->name().c_str(),
               (*model)->weight_bytes() / 1e6);
  return 0;
}
