#include "model/kv_cache.h"

namespace pd {

Result<KvCache> KvCache::create(Backend& backend, const LlamaConfig& cfg, int block_size, int64_t num_blocks) {
  if (block_size <= 0 || num_blocks <= 0)
    return Status::invalid_argument("KvCache: block_size and num_blocks must be positive");
  KvCache c;
  c.layout.n_layers = cfg.n_layers;
  c.layout.n_kv_heads = cfg.n_kv_heads;
  c.layout.head_dim = cfg.head_dim;
  c.layout.block_size = block_size;
  c.layout.num_blocks = num_blocks;
  c.layout.dtype = GgmlType::kF32;
  PD_ASSIGN_OR_RETURN(c.buffer, backend.alloc(c.layout.total_bytes()));
  return c;
}

}  // namespace pd
