#include "kvtransfer/kv_region.h"

#include <algorithm>

#include <xxhash.h>

#include <cstring>

namespace pd {

int kv_segments(int64_t n_blocks) {
  return static_cast<int>(std::max<int64_t>(1, (n_blocks + kKvSegmentBlocks - 1) / kKvSegmentBlocks));
}

std::span<const int32_t> kv_segment(std::span<const int32_t> table, int segment) {
  const size_t first = std::min(table.size(), static_cast<size_t>(segment) * kKvSegmentBlocks);
  return table.subspan(first, std::min<size_t>(kKvSegmentBlocks, table.size() - first));
}

KvRegion kv_layer_region(void* cache_base, const KvCacheLayout& layout, int layer, std::span<const int32_t> blocks) {
  KvRegion r;
  r.base = static_cast<uint8_t*>(cache_base);
  r.piece_bytes = static_cast<int64_t>(layout.block_bytes());
  r.offsets.reserve(blocks.size() * 2);
  for (int kind = 0; kind < 2; ++kind)
    for (int32_t b : blocks) r.offsets.push_back(static_cast<int64_t>(layout.offset(layer, kind, b)));
  return r;
}

Result<std::vector<int64_t>> kv_cache_offsets(const KvRegion& r, const uint8_t* cache_base, size_t cache_bytes,
                                              const char* who) {
  if (r.offsets.empty() || r.piece_bytes <= 0) return Status::invalid_argument(std::string(who) + ": empty KV region");
  const int64_t shift = r.base - cache_base;
  std::vector<int64_t> offsets(r.offsets.size());
  for (size_t i = 0; i < offsets.size(); ++i) {
    offsets[i] = r.offsets[i] + shift;
    if (offsets[i] < 0 || static_cast<size_t>(offsets[i] + r.piece_bytes) > cache_bytes)
      return Status::invalid_argument(std::string(who) + ": KV region piece " + std::to_string(i) +
                                      " lies outside the cache buffer");
  }
  return offsets;
}

uint64_t kv_region_checksum(const KvRegion& r) {
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  for (int64_t off : r.offsets) XXH3_64bits_update(st, r.base + off, static_cast<size_t>(r.piece_bytes));
  const uint64_t h = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return h;
}

Result<uint64_t> kv_region_checksum(Backend& backend, const BackendBuffer& cache, const KvRegion& r) {
  if (!backend.device_memory()) return kv_region_checksum(r);
  std::vector<uint8_t> host(static_cast<size_t>(r.total_bytes()));
  PD_RETURN_IF_ERROR(backend.kv_gather(cache, r.offsets, static_cast<size_t>(r.piece_bytes), host.data()));
  return XXH3_64bits(host.data(), host.size());
}

std::vector<uint8_t> KvTrailer::serialize() const {
  std::vector<uint8_t> out(serialized_size(static_cast<int>(checksums.size())));
  std::memcpy(out.data(), &request_id, 8);
  std::memcpy(out.data() + 8, &epoch, 4);
  std::memcpy(out.data() + 12, &first_token, 4);
  std::memcpy(out.data() + 16, &finished, 4);
  if (!checksums.empty()) std::memcpy(out.data() + 20, checksums.data(), checksums.size() * 8);
  return out;
}

Result<KvTrailer> KvTrailer::deserialize(std::span<const uint8_t> bytes, int n_layers) {
  if (bytes.size() != serialized_size(n_layers))
    return Status::corruption("KV trailer of " + std::to_string(bytes.size()) + " bytes, expected " +
                              std::to_string(serialized_size(n_layers)));
  KvTrailer t;
  std::memcpy(&t.request_id, bytes.data(), 8);
  std::memcpy(&t.epoch, bytes.data() + 8, 4);
  std::memcpy(&t.first_token, bytes.data() + 12, 4);
  std::memcpy(&t.finished, bytes.data() + 16, 4);
  t.checksums.resize(static_cast<size_t>(n_layers));
  if (n_layers > 0) std::memcpy(t.checksums.data(), bytes.data() + 20, static_cast<size_t>(n_layers) * 8);
  return t;
}

}  // namespace pd
