// Hyperparameters of a Llama-architecture model, read from GGUF metadata.
#pragma once

#include <cstdint>
#include <string>

#include "gguf/ggml_types.h"
#include "kv/kv_block_manager.h"
#include "util/status.h"

namespace pd {

class GgufFile;

struct LlamaConfig {
  std::string name;          // general.name (informational)
  int n_layers = 0;          // llama.block_count
  int hidden = 0;            // llama.embedding_length
  int n_heads = 0;           // llama.attention.head_count
  int n_kv_heads = 0;        // llama.attention.head_count_kv (grouped-query attention)
  int head_dim = 0;          // llama.rope.dimension_count, else hidden / n_heads
  int ffn = 0;               // llama.feed_forward_length
  int vocab = 0;             // llama.vocab_size, else the tokenizer's token count
  int context = 0;           // llama.context_length
  float rope_base = 10000.0f;  // llama.rope.freq_base
  float rms_eps = 1e-5f;       // llama.attention.layer_norm_rms_epsilon
  bool tied_embeddings = false;  // no output.weight: the LM head reuses token_embd

  // Reads and validates the metadata; refuses non-Llama architectures and
  // unsupported features (RoPE scaling, partial rotary dims) by name.
  static Result<LlamaConfig> from_gguf(const GgufFile& file);
  // The KV cache's geometry with elements of `kv_dtype` (F32, F16 or Q8_0).
  KvGeometry kv_geometry(GgmlType kv_dtype) const {
    KvGeometry g{n_layers, n_kv_heads, head_dim};
    g.row_bytes = static_cast<int64_t>(ggml_row_bytes(kv_dtype, head_dim));
    return g;
  }
  // Model fingerprint for KV compatibility checks: layers, KV heads, head dim.
  std::string describe() const;
};

}  // namespace pd
