// One layer of one sequence's KV in a paged cache, as the wire sees it: the
// sequence's K blocks in table order, then its V blocks, each block_bytes long.
// Both ends describe the same byte stream over their own (differently placed)
// blocks, so a transfer lands straight in the receiver's pages.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "backend/backend.h"

namespace pd {

struct KvRegion {
  uint8_t* base = nullptr;         // start of the cache buffer (host memory)
  std::vector<int64_t> offsets;    // byte offset of each piece from base, in wire order
  int64_t piece_bytes = 0;         // bytes per piece (one block of one layer, K or V)
  int64_t total_bytes() const { return piece_bytes * static_cast<int64_t>(offsets.size()); }
};

// The region of `layer` for a sequence holding `blocks` in a cache with `layout`.
KvRegion kv_layer_region(void* cache_base, const KvCacheLayout& layout, int layer, std::span<const int32_t> blocks);

// A handoff moves a sequence's KV in segments of kKvSegmentBlocks blocks, one
// message per (segment, layer), segment by segment: a long prompt computed in
// chunks sends a segment once every layer of it is written, behind the passes
// of its later chunks, instead of everything behind its last pass. Both ends
// split the same block count the same way (the wire header fixes the block
// size); a prompt of at most one segment is one message per layer.
inline constexpr int kKvSegmentBlocks = 16;
// Segments of a sequence of `n_blocks` blocks (at least 1).
int kv_segments(int64_t n_blocks);
// The blocks of segment `segment` of `table`.
std::span<const int32_t> kv_segment(std::span<const int32_t> table, int segment);

// The region's pieces as offsets from `cache_base` (the start of a cache of
// `cache_bytes`), each checked to lie inside it; InvalidArgument naming `who`
// for an empty region or a piece outside.
Result<std::vector<int64_t>> kv_cache_offsets(const KvRegion& r, const uint8_t* cache_base, size_t cache_bytes,
                                              const char* who);

// XXH3-64 of the region's bytes in wire order.
uint64_t kv_region_checksum(const KvRegion& r);
// The same for a region of `cache` wherever `backend` keeps it: device memory
// is gathered to the host first (waiting for the ops that wrote it), so both
// ends of any path agree on the value.
Result<uint64_t> kv_region_checksum(Backend& backend, const BackendBuffer& cache, const KvRegion& r);

// The fixed-size message that ends a transfer (same tag, after the layers):
// whose KV it is (request id and the sender's epoch, checked on arrival so a
// late transfer of another request is never decoded), the first generated
// token and a checksum per layer.
struct KvTrailer {
  uint64_t request_id = 0;
  uint32_t epoch = 0;
  int32_t first_token = -1;
  int32_t finished = 0;     // 1 = the request ended at its first token: don't decode it
  std::vector<uint64_t> checksums;  // one per layer (0s when checksums are off)

  std::vector<uint8_t> serialize() const;
  static size_t serialized_size(int n_layers) { return 20 + 8 * static_cast<size_t>(n_layers); }
  // Corruption if the size does not match n_layers.
  static Result<KvTrailer> deserialize(std::span<const uint8_t> bytes, int n_layers);
};

}  // namespace pd
