// The Llama-family transformer (RMSNorm, RoPE, grouped-query attention, a
// gated MLP, tied or separate LM head), written once against the Backend, with
// the variants of Qwen2 (Q/K/V biases), Qwen3 (Q/K norms), Gemma 3 (Q/K norms,
// post-norms, GeGLU, scaled embeddings, sliding-window layers) and Llama 3.x
// (RoPE frequency factors) as LlamaConfig describes them.
//
// One entry point runs any mix of sequences: each contributes a run of new
// tokens at consecutive positions; their K and V are written into the paged
// cache at the slots given by the sequence's block table, and each token
// attends causally over its own sequence's cache. prefill() and decode() are
// the two shapes of it the engine uses.
//
// Thread-safety: one thread at a time (it owns scratch activations).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <unordered_set>
#include <vector>

#include "backend/backend.h"
#include "model/kv_cache.h"
#include "model/llama_config.h"

namespace pd {

class GgufFile;
using TokenId = int32_t;

// One sequence's share of a forward batch.
struct SequenceBatch {
  std::span<const TokenId> tokens;       // new tokens, at positions start_pos, start_pos+1, ...
  int32_t start_pos = 0;                 // tokens before it are already in the cache
  std::span<const int32_t> block_table;  // blocks covering [0, start_pos + tokens.size())
  bool want_logits = true;               // logits of its last new token
  bool all_logits = false;               // logits of every new token, in order (prompt logprobs); implies want_logits
};

class LlamaModel {
 public:
  // Loads weights from `file` (kept alive by the model) onto `backend`.
  // Unsupported/InvalidArgument naming the tensor for missing tensors, wrong
  // shapes or types the backend can't use.
  static Result<std::unique_ptr<LlamaModel>> load(std::shared_ptr<const GgufFile> file, Backend& backend);
  ~LlamaModel();

  const LlamaConfig& config() const { return cfg_; }
  Backend& backend() { return backend_; }
  // Bytes of weights as stored (quantized).
  size_t weight_bytes() const { return weight_bytes_; }

  // Runs the batch. logits receives vocab floats for every sequence with
  // want_logits (tokens.size() rows for one with all_logits), in batch order
  // (resized). Fails without touching the cache
  // if an input is invalid (token id out of range, table too short).
  Status forward(std::span<const SequenceBatch> batch, KvCache& cache, std::vector<float>* logits);

  // Prefill: several prompts (or prompt suffixes after a cached prefix) in one pass.
  Status prefill(std::span<const SequenceBatch> prompts, KvCache& cache, std::vector<float>* logits) {
    return forward(prompts, cache, logits);
  }
  // Called on the calling thread as soon as layer `layer`'s K and V of the
  // whole batch are in the cache (before that layer's attention), so a caller
  // can start shipping a layer while the rest compute. Empty = none.
  void set_kv_written_hook(std::function<void(int layer)> hook) { kv_written_hook_ = std::move(hook); }

  // Decode: exactly one new token per sequence.
  Status decode(std::span<const SequenceBatch> steps, KvCache& cache, std::vector<float>* logits);

 private:
  struct Layer {
    Tensor attn_norm, wq, wk, wv, wo, ffn_norm, w_gate, w_up, w_down;
    Tensor bq, bk, bv;                  // qkv_bias
    Tensor q_norm, k_norm;              // qk_norm
    Tensor post_attn_norm, post_ffn_norm;  // post_norms
  };
  LlamaModel(std::shared_ptr<const GgufFile> file, Backend& backend, LlamaConfig cfg)
      : file_(std::move(file)), backend_(backend), cfg_(std::move(cfg)) {}
  Status load_weights();
  // A tensor of the file on the backend; `f32_only` for norms, biases and the like.
  Result<Tensor> weight(const std::string& name, std::vector<int64_t> expected_ne, bool f32_only = false);
  Status ensure_scratch(int64_t n_tokens, int64_t n_logits);
  // forward()'s steps: validate the batch into the index arrays, then per
  // layer the attention and FFN sub-blocks over the n tokens in x_.
  Status plan_batch(std::span<const SequenceBatch> batch, const KvCacheLayout& L);
  Status attention_block(int l, int64_t n, KvCache& cache, RopeSpec& rope);
  Status ffn_block(int l, int64_t n);

  // Constant after load.
  std::shared_ptr<const GgufFile> file_;
  Backend& backend_;
  LlamaConfig cfg_;
  Tensor tok_embd_, output_norm_, output_;
  std::vector<Layer> layers_;
  std::vector<std::unique_ptr<BackendBuffer>> weight_storage_;
  size_t weight_bytes_ = 0;
  std::unordered_set<std::string> tensors_used_;  // while loading: the file's tensors the model took
  std::vector<float> rope_factors_;  // rope_freqs.weight (host), empty when the file has none

  // Scratch activations, grown on demand.
  int64_t scratch_tokens_ = 0, scratch_logits_ = 0;
  std::unique_ptr<BackendBuffer> scratch_;
  Tensor x_, h_, q_, k_, v_, attn_, o_, gate_, up_, xsel_, hsel_, logits_;
  std::vector<int32_t> ids_, positions_, slots_, logit_rows_;
  std::vector<AttentionToken> att_tokens_;
  std::vector<std::span<const int32_t>> tables_;
  std::function<void(int)> kv_written_hook_;
};

}  // namespace pd
