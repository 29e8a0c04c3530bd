// Hyperparameters of a Llama-family decoder, read from GGUF metadata: the
// architectures "llama" (Llama 1-3.x, SmolLM2, TinyLlama, ...), "qwen2"
// (Qwen2, Qwen2.5), "qwen3" (dense Qwen3) and "gemma3" (Gemma 3 text).
// They share one forward pass (RMSNorm, RoPE, grouped-query attention, a gated
// MLP, tied or separate LM head); the fields below say where they differ.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gguf/ggml_types.h"
#include "kv/kv_block_manager.h"
#include "util/status.h"

namespace pd {

class GgufFile;

struct LlamaConfig {
  std::string arch;          // general.architecture; every key below is <arch>.*
  std::string name;          // general.name (informational)
  int n_layers = 0;          // block_count
  int hidden = 0;            // embedding_length
  int n_heads = 0;           // attention.head_count
  int n_kv_heads = 0;        // attention.head_count_kv (grouped-query attention)
  int head_dim = 0;          // attention.key_length, else hidden / n_heads
  int ffn = 0;               // feed_forward_length
  int vocab = 0;             // vocab_size, else token_embd's row count
  int context = 0;           // context_length
  float rope_base = 10000.0f;  // rope.freq_base
  float rms_eps = 1e-5f;       // attention.layer_norm_rms_epsilon
  bool tied_embeddings = false;  // no output.weight: the LM head reuses token_embd

  // RoPE variants.
  bool rope_neox = false;        // pairs (i, i + d/2): qwen2, qwen3, gemma3 (llama.cpp's LLAMA_ROPE_TYPE_NEOX)
  float rope_freq_scale = 1.0f;  // rope.scaling.type "linear": 1 / rope.scaling.factor
  bool rope_freq_factors = false;  // a rope_freqs.weight tensor: Llama 3.x's per-pair frequency divisors

  // Block variants.
  bool qkv_bias = false;     // attn_q/k/v.bias (qwen2; llama files may have them too)
  bool qk_norm = false;      // attn_q_norm / attn_k_norm: per-head RMS norm of Q and K before RoPE (qwen3, gemma3)
  bool post_norms = false;   // post_attention_norm, post_ffw_norm on each sublayer's output (gemma3)
  bool gelu_ffn = false;     // gelu_tanh(gate) * up instead of silu(gate) * up (gemma3)
  float embed_scale = 1.0f;  // token embeddings times this: sqrt(hidden) for gemma3
  float attn_scale = 0.0f;   // attention score scale: 1 / sqrt(head_dim) (gemma3: see from_gguf)

  // Sliding-window attention (gemma3): local layers attend to their last
  // `sliding_window` positions, with their own RoPE base and no RoPE scaling.
  int sliding_window = 0;          // attention.sliding_window; 0 = none
  std::vector<uint8_t> swa_layers;  // per layer: 1 = local (sliding-window) layer; empty = none
  float rope_base_swa = 10000.0f;   // RoPE base of the local layers

  bool is_swa(int layer) const { return !swa_layers.empty() && swa_layers[static_cast<size_t>(layer)] != 0; }
  // Attention window of a layer (0 = the whole prefix).
  int window(int layer) const { return is_swa(layer) ? sliding_window : 0; }
  float layer_rope_base(int layer) const { return is_swa(layer) ? rope_base_swa : rope_base; }
  float layer_rope_scale(int layer) const { return is_swa(layer) ? 1.0f : rope_freq_scale; }

  // Reads and validates the metadata; refuses other architectures and
  // unsupported features (RoPE scaling other than linear, partial rotary
  // dims, logit soft-capping, ...) by name.
  static Result<LlamaConfig> from_gguf(const GgufFile& file);
  // The KV cache's geometry with elements of `kv_dtype` (F32, F16 or Q8_0).
  // Every layer keeps K and V of every position (local layers too).
  KvGeometry kv_geometry(GgmlType kv_dtype) const {
    KvGeometry g{n_layers, n_kv_heads, head_dim};
    g.row_bytes = static_cast<int64_t>(ggml_row_bytes(kv_dtype, head_dim));
    return g;
  }
  // One line for logs: the architecture, its sizes and variants.
  std::string describe() const;
};

}  // namespace pd
