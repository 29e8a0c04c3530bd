// KvCache: the paged KV storage of one model in backend memory. Which block
// belongs to which sequence is the KvBlockManager's business; this holds bytes.
#pragma once

#include <memory>

#include "backend/backend.h"
#include "model/llama_config.h"

namespace pd {

struct KvCache {
  KvCacheLayout layout;
  std::unique_ptr<BackendBuffer> buffer;

  // Allocates num_blocks blocks of block_size tokens for `cfg` (F32 KV).
  static Result<KvCache> create(Backend& backend, const LlamaConfig& cfg, int block_size, int64_t num_blocks);
};

}  // namespace pd
