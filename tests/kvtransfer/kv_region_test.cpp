// The KV wire layout of one layer of one sequence, its checksum and the trailer.
#include <catch2/catch.hpp>

#include "kvtransfer/kv_region.h"

TEST_CASE("kv region: K blocks then V blocks of the layer, in table order", "[kvtransfer]") {
  pd::KvCacheLayout L;
  L.n_layers = 3;
  L.n_kv_heads = 2;
  L.head_dim = 4;
  L.block_size = 8;
  L.num_blocks = 10;
  std::vector<uint8_t> buf(L.total_bytes());
  const std::vector<int32_t> table{7, 2, 5};
  const pd::KvRegion r = pd::kv_layer_region(buf.data(), L, 1, table);
  REQUIRE(r.offsets.size() == 6);
  CHECK(r.piece_bytes == static_cast<int64_t>(L.block_bytes()));
  CHECK(r.total_bytes() == 6 * static_cast<int64_t>(L.block_bytes()));
  CHECK(r.offsets[0] == static_cast<int64_t>(L.offset(1, 0, 7)));
  CHECK(r.offsets[2] == static_cast<int64_t>(L.offset(1, 0, 5)));
  CHECK(r.offsets[3] == static_cast<int64_t>(L.offset(1, 1, 7)));
  CHECK(r.offsets[5] == static_cast<int64_t>(L.offset(1, 1, 5)));
  // The checksum covers the region's bytes in wire order, and only them.
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<uint8_t>(i * 31);
  const uint64_t h = pd::kv_region_checksum(r);
  buf[L.offset(1, 0, 3)] ^= 1;  // a block outside the table
  CHECK(pd::kv_region_checksum(r) == h);
  buf[L.offset(1, 1, 2) + 5] ^= 1;  // inside
  CHECK(pd::kv_region_checksum(r) != h);
}

TEST_CASE("kv trailer: round trip, a wrong size is Corruption", "[kvtransfer]") {
  pd::KvTrailer t;
  t.request_id = 0x1234567890ULL;
  t.epoch = 7;
  t.first_token = 4242;
  t.finished = 1;
  t.checksums = {1, 2, 0xFFFFFFFFFFFFFFFFULL};
  const auto bytes = t.serialize();
  REQUIRE(bytes.size() == pd::KvTrailer::serialized_size(3));
  auto back = pd::KvTrailer::deserialize(bytes, 3);
  REQUIRE(back.is_ok());
  CHECK(back->request_id == 0x1234567890ULL);
  CHECK(back->epoch == 7);
  CHECK(back->first_token == 4242);
  CHECK(back->finished == 1);
  CHECK(back->checksums == t.checksums);
  CHECK(pd::KvTrailer::deserialize(bytes, 4).status().is_corruption());
}

TEST_CASE("kv region: offsets from a cache's base, an empty region or a piece outside the cache is refused",
          "[kvtransfer]") {
  std::vector<uint8_t> cache(1000);
  pd::KvRegion r{cache.data() + 100, {0, 200, 40}, 50};  // a region described from inside the buffer
  auto off = pd::kv_cache_offsets(r, cache.data(), cache.size(), "t");
  REQUIRE(off.is_ok());
  CHECK(*off == std::vector<int64_t>{100, 300, 140});
  r.offsets.push_back(851);  // 951 + 50 > 1000
  auto past = pd::kv_cache_offsets(r, cache.data(), cache.size(), "t");
  CHECK(past.status().is_invalid_argument());
  CHECK(past.status().message() == "t: KV region piece 3 lies outside the cache buffer");
  pd::KvRegion before{cache.data(), {-1}, 1};
  CHECK(pd::kv_cache_offsets(before, cache.data(), cache.size(), "t").status().is_invalid_argument());
  CHECK(pd::kv_cache_offsets(pd::KvRegion{}, cache.data(), cache.size(), "t").status().message() ==
        "t: empty KV region");
}
