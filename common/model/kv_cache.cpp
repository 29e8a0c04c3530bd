#include "model/kv_cache.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <string>

namespace pd {

Status check_kv_dtype(GgmlType dtype, int head_dim) {
  if (dtype != GgmlType::kF32 && dtype != GgmlType::kF16 && dtype != GgmlType::kQ8_0)
    return Status::invalid_argument(std::string("KV cache type ") + ggml_type_name(dtype) +
                                    " is not supported (f32, f16 or q8_0)");
  if (dtype == GgmlType::kQ8_0 && head_dim % 32 != 0)
    return Status::invalid_argument("KV cache type q8_0 needs head_dim a multiple of 32 (the model's is " +
                                    std::to_string(head_dim) + ")");
  return Status::ok();
}

Result<KvCache> KvCache::create(Backend& backend, const LlamaConfig& cfg, int block_size, int64_t num_blocks,
                                GgmlType dtype) {
  if (block_size <= 0 || num_blocks <= 0)
    return Status::invalid_argument("KvCache: block_size and num_blocks must be positive");
  PD_RETURN_IF_ERROR(check_kv_dtype(dtype, cfg.head_dim));
  KvCache c;
  c.layout.n_layers = cfg.n_layers;
  c.layout.n_kv_heads = cfg.n_kv_heads;
  c.layout.head_dim = cfg.head_dim;
  c.layout.block_size = block_size;
  c.layout.num_blocks = num_blocks;
  c.layout.dtype = dtype;
  PD_ASSIGN_OR_RETURN(c.buffer, backend.alloc(c.layout.total_bytes()));
  // Host memory: every page touched now. The kernel maps (and zeroes) a page
  // on its first write, and a pool's pages are first written far into serving
  // — by a step whose sequences reach a block no one used yet, or a KV
  // receive — where zeroing hundreds of MiB (each new block index touches a
  // page in every layer's region) stalled a decode step 0.27 s.
  if (!backend.device_memory() && c.buffer->data() != nullptr)
    std::memset(c.buffer->data(), 0, c.layout.total_bytes());
  return c;
}

}  // namespace pd
