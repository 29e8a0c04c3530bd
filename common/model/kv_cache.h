// KvCache: the paged KV storage of one model in backend memory. Which block
// belongs to which sequence is the KvBlockManager's business; this holds bytes.
//
// Element types (KvCacheLayout::dtype):
//   f32   the reference: exactly what the model computed;
//   f16   the default (what llama.cpp and vLLM keep): half the bytes;
//   q8_0  ggml's q8_0 blocks (32 elements: one fp16 scale + 32 int8) along
//         each head's head_dim: 34 bytes per 32 elements, 0.53x of f16.
// docs/ACCURACY.md gives what each costs in perplexity and KL divergence.
#pragma once

#include <memory>
#include <string_view>

#include "backend/backend.h"
#include "model/llama_config.h"

namespace pd {

inline constexpr GgmlType kDefaultKvDtype = GgmlType::kF16;

// Whether a cache of `dtype` can hold heads of head_dim elements (q8_0 needs
// a multiple of 32).
Status check_kv_dtype(GgmlType dtype, int head_dim);

struct KvCache {
  KvCacheLayout layout;
  std::unique_ptr<BackendBuffer> buffer;

  // Allocates num_blocks blocks of block_size tokens for `cfg`, elements of `dtype`.
  static Result<KvCache> create(Backend& backend, const LlamaConfig& cfg, int block_size, int64_t num_blocks,
                                GgmlType dtype);
};

}  // namespace pd
