// The planner's model of a model: the shape of a Llama-family decoder
// (grouped-query attention, gated MLP, RMSNorm: Llama, Mistral, Qwen2/2.5,
// Qwen3, Gemma 3), from a built-in preset, a JSON file, or a GGUF file's
// metadata.
//
// Everything the planner computes (parameter count, FLOPs per token, KV bytes
// per token) derives from these fields; nothing else about the model is read.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "util/status.h"

namespace pd {
class GgufFile;
}

namespace pd::plan {

struct ModelSpec {
  std::string name;
  int n_layers = 0;     // decoder blocks
  int hidden = 0;       // d_model (embedding width)
  int n_heads = 0;      // query heads
  int n_kv_heads = 0;   // key/value heads (== n_heads: plain multi-head attention)
  int head_dim = 0;     // per head; usually hidden / n_heads
  int ffn = 0;          // MLP intermediate width (gate, up: hidden->ffn; down: ffn->hidden)
  int vocab = 0;
  bool tied_embeddings = false;  // LM head shares the token embedding matrix
  bool qkv_bias = false;         // Q, K, V projections carry a bias (Qwen2)
  bool qk_norm = false;          // per-head RMSNorm weights on Q and K (Qwen3, Gemma 3): 2 x head_dim per layer
  bool post_norms = false;       // RMSNorms after attention and MLP too (Gemma 3): 4 norms per layer, not 2
  int64_t max_context = 0;       // published maximum context; 0 when unknown (informational)
  // From a GGUF file only (0 otherwise): parameters and bytes of the file's tensors,
  // to compare with the count derived from the fields.
  int64_t file_params = 0;
  int64_t file_weight_bytes = 0;
};

// Parameter counts derived from the fields (one formula for all presets).
struct ParamBreakdown {
  int64_t embedding = 0;        // vocab x hidden
  int64_t attention = 0;        // per layer: Wq, Wk, Wv, Wo (+ QKV bias)
  int64_t mlp = 0;              // per layer: gate, up, down
  int64_t norms = 0;            // per layer: two RMSNorm weights (four with post_norms; + Q/K norms)
  int64_t final_norm = 0;       // hidden
  int64_t lm_head = 0;          // vocab x hidden when untied, else 0 (shared with embedding)
  // Matrix weights one token multiplies through per layer (Wq, Wk, Wv, Wo, gate,
  // up, down; no biases or norms): a forward pass costs 2 FLOPs per such weight.
  int64_t linear_per_layer = 0;
  int64_t total = 0;            // everything stored
  int64_t per_layer() const { return attention + mlp + norms; }
};

ParamBreakdown parameter_breakdown(const ModelSpec& m);
inline int64_t parameter_count(const ModelSpec& m) { return parameter_breakdown(m).total; }
// Grouped-query factor G = n_heads / n_kv_heads (1 for multi-head attention).
inline int gqa_group(const ModelSpec& m) { return m.n_kv_heads > 0 ? m.n_heads / m.n_kv_heads : 0; }

// OK when every size is positive, n_heads is a multiple of n_kv_heads, and the
// sizes are within sane bounds; otherwise InvalidArgument naming the field.
Status validate_model(const ModelSpec& m);

// Built-in presets, numbers from each model's published config.json:
// llama-3.1-8b, llama-3.1-70b, llama-3.1-405b, mistral-7b-v0.1, qwen2.5-7b,
// smollm2-135m, llama-2-7b (plain multi-head attention).
const std::vector<ModelSpec>& model_presets();
// A preset by name (case-insensitive). NotFound naming the preset and listing the known ones.
Result<ModelSpec> model_preset(std::string_view name);

// A model from JSON text. Fields (the planner's own names, or Hugging Face
// config.json names in parentheses, so a config.json loads as is):
//   name (_name_or_path; default: `source`), n_layers (num_hidden_layers),
//   hidden_size, n_heads (num_attention_heads), n_kv_heads (num_key_value_heads;
//   default n_heads), head_dim (default hidden_size / n_heads), ffn_size
//   (intermediate_size), vocab_size, tied_embeddings (tie_word_embeddings; default
//   false), qkv_bias (attention_bias; default false), max_context
//   (max_position_embeddings; optional). model_type "qwen2" implies qkv_bias,
//   "qwen3" qk_norm, "gemma3"/"gemma3_text" qk_norm and post_norms.
// InvalidArgument naming `source` and the missing or bad field.
Result<ModelSpec> model_from_json(std::string_view json_text, std::string_view source);
Result<ModelSpec> model_from_json_file(const std::string& path);

// A model from a GGUF file's metadata: <arch>.block_count, .embedding_length,
// .feed_forward_length, .attention.head_count, .attention.head_count_kv (default
// head_count), .attention.key_length or .rope.dimension_count (default
// embedding_length / head_count), .vocab_size (default: length of
// tokenizer.ggml.tokens), .context_length; tied when the file has no
// output.weight tensor; qkv_bias, qk_norm and post_norms when block 0 has the
// tensors (attn_q.bias, attn_q_norm, post_attention_norm). <arch> is
// general.architecture (llama, qwen2, qwen3, gemma3, or any with these keys:
// the planner needs only the shape).
Result<ModelSpec> model_from_gguf(const GgufFile& file);
Result<ModelSpec> model_from_gguf_file(const std::string& path);

}  // namespace pd::plan
