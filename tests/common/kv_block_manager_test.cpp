// Tests of the paged KV block manager: sizes, exhaustion without side effects,
// prefix sharing and its cap rule, eviction, fork + copy-on-write, and a
// randomized invariant test that also simulates the KV storage.
#include "kv/kv_block_manager.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <vector>

namespace pd {
namespace {

std::vector<TokenId> iota_tokens(int n, TokenId start = 1000) {
  std::vector<TokenId> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), start);
  return t;
}

std::vector<TokenId> concat(std::vector<TokenId> a, const std::vector<TokenId>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

KvBlockManagerConfig config(int block_size, int64_t num_blocks, bool sharing = true) {
  KvBlockManagerConfig c;
  c.block_size = block_size;
  c.num_blocks = num_blocks;
  c.enable_prefix_sharing = sharing;
  return c;
}

// Everything observable about a manager, to show a failed call changed nothing.
struct Snapshot {
  int64_t free_blocks;
  int64_t cached_blocks;
  std::map<int64_t, std::vector<int32_t>> tables;
  std::map<int64_t, int64_t> tokens;
  std::vector<int32_t> refs;
  bool operator==(const Snapshot&) const = default;
};

Snapshot snapshot(const KvBlockManager& m, const std::vector<SeqId>& seqs) {
  Snapshot s{m.num_free_blocks(), m.num_cached_blocks(), {}, {}, {}};
  for (SeqId id : seqs) {
    if (!m.has(id)) continue;
    for (BlockId b : m.block_table(id)) s.tables[id.value].push_back(b.value);
    s.tokens[id.value] = m.num_tokens(id);
  }
  for (int32_t b = 0; b < m.num_blocks(); ++b) s.refs.push_back(m.ref_count(BlockId{b}));
  return s;
}

TEST_CASE("kv: allocation sizes at block boundaries", "[kv]") {
  struct Row {
    int n_tokens;
    size_t blocks;
  };
  const Row rows[] = {{0, 0}, {1, 1}, {15, 1}, {16, 1}, {17, 2}, {32, 2}, {33, 3}};
  for (bool sharing : {false, true}) {
    for (const Row& r : rows) {
      CAPTURE(sharing, r.n_tokens);
      KvBlockManager m(config(16, 8, sharing));
      const auto tokens = iota_tokens(r.n_tokens);
      CHECK(m.blocks_needed_for_prompt(tokens) == static_cast<int64_t>(r.blocks));
      auto cached = m.allocate(SeqId{1}, tokens);
      REQUIRE(cached.is_ok());
      CHECK(*cached == 0);
      CHECK(m.block_table(SeqId{1}).size() == r.blocks);
      CHECK(m.num_tokens(SeqId{1}) == r.n_tokens);
      CHECK(m.num_free_blocks() == 8 - static_cast<int64_t>(r.blocks));
      REQUIRE(m.check_invariants().is_ok());
      REQUIRE(m.free(SeqId{1}).is_ok());
      CHECK(m.num_free_blocks() == 8);
      CHECK_FALSE(m.has(SeqId{1}));
      REQUIRE(m.check_invariants().is_ok());
    }
  }
}

TEST_CASE("kv: append grows the table one block per block_size tokens", "[kv]") {
  struct Row {
    int start;
    int append;
    int64_t needed;
    size_t blocks_after;
  };
  const Row rows[] = {
      {0, 1, 1, 1}, {0, 16, 1, 1}, {0, 17, 2, 2}, {15, 1, 0, 1}, {16, 1, 1, 2},
      {17, 15, 0, 2}, {17, 16, 1, 3}, {5, 0, 0, 1}, {0, 0, 0, 0}, {1, 47, 2, 3},
  };
  for (const Row& r : rows) {
    CAPTURE(r.start, r.append);
    KvBlockManager m(config(16, 8));
    REQUIRE(m.allocate(SeqId{7}, iota_tokens(r.start)).is_ok());
    CHECK(m.blocks_needed_to_append(SeqId{7}, r.append) == r.needed);
    const int64_t free_before = m.num_free_blocks();
    std::vector<BlockCopy> copies;
    REQUIRE(m.append(SeqId{7}, iota_tokens(r.append, 5000), &copies).is_ok());
    CHECK(copies.empty());
    CHECK(m.block_table(SeqId{7}).size() == r.blocks_after);
    CHECK(m.num_tokens(SeqId{7}) == r.start + r.append);
    CHECK(m.num_free_blocks() == free_before - r.needed);
    REQUIRE(m.check_invariants().is_ok());
  }

  SECTION("token by token") {
    KvBlockManager m(config(4, 8));
    REQUIRE(m.allocate(SeqId{1}, iota_tokens(0)).is_ok());
    for (int i = 1; i <= 32; ++i) {
      const TokenId t[] = {i};
      REQUIRE(m.append(SeqId{1}, t, nullptr).is_ok());  // no copy can be needed: null is fine
      CHECK(static_cast<int>(m.block_table(SeqId{1}).size()) == (i + 3) / 4);
      REQUIRE(m.check_invariants().is_ok());
    }
    CHECK(m.num_free_blocks() == 0);
    CHECK(m.num_cached_blocks() == 8);  // every block it filled is registered
  }
}

TEST_CASE("kv: errors name the sequence and change nothing", "[kv]") {
  KvBlockManager m(config(16, 4));
  REQUIRE(m.allocate(SeqId{3}, iota_tokens(20)).is_ok());
  const std::vector<SeqId> ids = {SeqId{3}, SeqId{4}, SeqId{42}};
  const Snapshot before = snapshot(m, ids);

  Status st = m.free(SeqId{42});
  CHECK(st.is_not_found());
  CHECK_THAT(st.message(), Catch::Contains("42"));

  auto dup = m.allocate(SeqId{3}, iota_tokens(1));
  CHECK(dup.status().is_invalid_argument());
  CHECK_THAT(dup.status().message(), Catch::Contains("3"));

  std::vector<BlockCopy> copies;
  CHECK(m.append(SeqId{42}, iota_tokens(1), &copies).is_not_found());
  CHECK(m.fork(SeqId{42}, SeqId{43}).is_not_found());
  CHECK(m.fork(SeqId{3}, SeqId{3}).is_invalid_argument());

  CHECK(snapshot(m, ids) == before);
  CHECK(m.check_invariants().is_ok());

  CHECK(m.ref_count(BlockId{-1}) == 0);
  CHECK(m.ref_count(BlockId{99}) == 0);
  CHECK(m.block_table(SeqId{42}).empty());
  CHECK(m.num_tokens(SeqId{42}) == 0);
}

TEST_CASE("kv: exhaustion returns ResourceExhausted and leaves everything unchanged", "[kv]") {
  KvBlockManager m(config(16, 4));
  REQUIRE(m.allocate(SeqId{1}, iota_tokens(40)).is_ok());  // 3 blocks, 8 slots left in the last
  const std::vector<SeqId> ids = {SeqId{1}, SeqId{2}};
  const Snapshot before = snapshot(m, ids);

  SECTION("allocate") {
    const auto other = iota_tokens(40, 9000);
    CHECK(m.blocks_needed_for_prompt(other) == 3);
    auto r = m.allocate(SeqId{2}, other);
    REQUIRE(r.status().is_resource_exhausted());
    CHECK_THAT(r.status().message(), Catch::Contains("need 3 blocks, 1 free"));
    CHECK_FALSE(m.has(SeqId{2}));
  }
  SECTION("append") {
    CHECK(m.blocks_needed_to_append(SeqId{1}, 30) == 2);
    std::vector<BlockCopy> copies;
    Status st = m.append(SeqId{1}, iota_tokens(30), &copies);
    REQUIRE(st.is_resource_exhausted());
    CHECK_THAT(st.message(), Catch::Contains("need 2 blocks, 1 free"));
    CHECK(copies.empty());
  }
  SECTION("copy-on-write counts the copy") {
    REQUIRE(m.fork(SeqId{1}, SeqId{2}).is_ok());
    REQUIRE(m.allocate(SeqId{5}, iota_tokens(1, 7)).is_ok());  // takes the last free block
    const std::vector<SeqId> all = {SeqId{1}, SeqId{2}, SeqId{5}};
    const Snapshot full = snapshot(m, all);
    CHECK(m.blocks_needed_to_append(SeqId{2}, 1) == 1);
    std::vector<BlockCopy> copies;
    CHECK(m.append(SeqId{2}, iota_tokens(1), &copies).is_resource_exhausted());
    CHECK(copies.empty());
    CHECK(snapshot(m, all) == full);
    REQUIRE(m.free(SeqId{2}).is_ok());
    REQUIRE(m.free(SeqId{5}).is_ok());
  }
  CHECK(snapshot(m, ids) == before);
  CHECK(m.check_invariants().is_ok());
}

TEST_CASE("kv: prompts with a common prefix share its full blocks", "[kv]") {
  KvBlockManager m(config(16, 16));
  const auto prefix = iota_tokens(32);  // two full blocks
  const auto a = concat(prefix, iota_tokens(5, 7000));
  const auto b = concat(prefix, iota_tokens(7, 8000));

  auto ra = m.allocate(SeqId{1}, a);
  REQUIRE(ra.is_ok());
  CHECK(*ra == 0);
  CHECK(m.num_cached_blocks() == 2);

  CHECK(m.blocks_needed_for_prompt(b) == 1);  // the shared blocks are referenced: only the tail is new
  auto rb = m.allocate(SeqId{2}, b);
  REQUIRE(rb.is_ok());
  CHECK(*rb == 32);
  const auto& ta = m.block_table(SeqId{1});
  const auto& tb = m.block_table(SeqId{2});
  REQUIRE(tb.size() == 3);
  CHECK(ta[0] == tb[0]);
  CHECK(ta[1] == tb[1]);
  CHECK(ta[2] != tb[2]);
  CHECK(m.ref_count(ta[0]) == 2);
  CHECK(m.ref_count(ta[1]) == 2);
  CHECK(m.ref_count(ta[2]) == 1);
  CHECK(m.num_free_blocks() == 16 - 4);
  REQUIRE(m.check_invariants().is_ok());

  SECTION("a different first block breaks the chain even if the second matches") {
    auto c = concat(iota_tokens(16, 1), std::vector<TokenId>(prefix.begin() + 16, prefix.end()));
    c.push_back(1);
    auto rc = m.allocate(SeqId{3}, c);
    REQUIRE(rc.is_ok());
    CHECK(*rc == 0);
    CHECK(m.block_table(SeqId{3})[1] != ta[1]);
  }
  SECTION("blocks stay cached after their owners are freed") {
    REQUIRE(m.free(SeqId{1}).is_ok());
    REQUIRE(m.free(SeqId{2}).is_ok());
    CHECK(m.num_free_blocks() == 16);  // cached blocks count as free
    CHECK(m.num_cached_blocks() == 2);
    const auto c = concat(prefix, iota_tokens(3, 9000));
    CHECK(m.blocks_needed_for_prompt(c) == 3);  // 1 fresh + 2 leaving the evictable pool
    auto rc = m.allocate(SeqId{3}, c);
    REQUIRE(rc.is_ok());
    CHECK(*rc == 32);
    CHECK(m.num_free_blocks() == 13);
  }
  SECTION("cap rule: a fully cached prompt recomputes its last block in a private block") {
    auto rc = m.allocate(SeqId{3}, prefix);  // exactly the two cached blocks
    REQUIRE(rc.is_ok());
    CHECK(*rc == 16);
    const auto& tc = m.block_table(SeqId{3});
    REQUIRE(tc.size() == 2);
    CHECK(tc[0] == ta[0]);
    CHECK(tc[1] != ta[1]);
    CHECK(m.ref_count(tc[1]) == 1);
    CHECK(m.ref_count(ta[1]) == 2);
    // One token more and both blocks are shared.
    auto rd = m.allocate(SeqId{4}, concat(prefix, {5}));
    REQUIRE(rd.is_ok());
    CHECK(*rd == 32);
    // A single-block prompt never reports a cached token.
    auto re = m.allocate(SeqId{5}, std::vector<TokenId>(prefix.begin(), prefix.begin() + 16));
    REQUIRE(re.is_ok());
    CHECK(*re == 0);
  }
  SECTION("append registers blocks it fills") {
    std::vector<BlockCopy> copies;
    REQUIRE(m.append(SeqId{1}, iota_tokens(11, 7005), &copies).is_ok());  // fills block 2 of a
    CHECK(m.num_cached_blocks() == 3);
    auto rc = m.allocate(SeqId{3}, concat(a, iota_tokens(12, 7005)));
    REQUIRE(rc.is_ok());
    CHECK(*rc == 48);
    CHECK(m.block_table(SeqId{3})[2] == m.block_table(SeqId{1})[2]);
  }
  REQUIRE(m.check_invariants().is_ok());
}

TEST_CASE("kv: discard keeps unwritten blocks out of the prefix cache", "[kv]") {
  KvBlockManager m(config(16, 8));
  const auto p = iota_tokens(40);  // two full blocks + 8 tokens
  REQUIRE(m.allocate(SeqId{1}, p).is_ok());
  CHECK(m.num_cached_blocks() == 2);

  SECTION("its own blocks are dropped") {
    REQUIRE(m.discard(SeqId{1}).is_ok());
    CHECK(m.num_cached_blocks() == 0);
    CHECK(m.num_free_blocks() == 8);
    auto r = m.allocate(SeqId{2}, p);
    REQUIRE(r.is_ok());
    CHECK(*r == 0);
  }
  SECTION("blocks it reused from the cache stay cached") {
    REQUIRE(m.free(SeqId{1}).is_ok());
    auto r = m.allocate(SeqId{2}, concat(iota_tokens(32), iota_tokens(20, 600)));  // reuses 2, adds 2
    REQUIRE(r.is_ok());
    CHECK(*r == 32);
    CHECK(m.num_cached_blocks() == 3);
    REQUIRE(m.discard(SeqId{2}).is_ok());
    CHECK(m.num_cached_blocks() == 2);
    auto again = m.allocate(SeqId{3}, p);
    REQUIRE(again.is_ok());
    CHECK(*again == 32);
  }
  SECTION("blocks still shared stay registered") {
    REQUIRE(m.fork(SeqId{1}, SeqId{2}).is_ok());
    REQUIRE(m.discard(SeqId{2}).is_ok());
    CHECK(m.num_cached_blocks() == 2);
    CHECK(m.has(SeqId{1}));
  }
  CHECK(m.discard(SeqId{77}).is_not_found());
  REQUIRE(m.check_invariants().is_ok());
}

TEST_CASE("kv: prefix sharing disabled shares nothing", "[kv]") {
  KvBlockManager m(config(16, 8, /*sharing=*/false));
  const auto p = iota_tokens(40);
  REQUIRE(m.allocate(SeqId{1}, p).is_ok());
  auto r = m.allocate(SeqId{2}, p);
  REQUIRE(r.is_ok());
  CHECK(*r == 0);
  CHECK(m.num_cached_blocks() == 0);
  CHECK(m.num_free_blocks() == 2);
  REQUIRE(m.free(SeqId{1}).is_ok());
  REQUIRE(m.free(SeqId{2}).is_ok());
  CHECK(m.num_free_blocks() == 8);
  REQUIRE(m.check_invariants().is_ok());
}

TEST_CASE("kv: cached blocks are evicted tail first when the pool is tight", "[kv]") {
  KvBlockManager m(config(16, 4));
  const auto a = iota_tokens(49);  // 3 full blocks + 1 token: the whole pool
  REQUIRE(m.allocate(SeqId{1}, a).is_ok());
  const std::vector<BlockId> ta = m.block_table(SeqId{1});
  CHECK(m.num_free_blocks() == 0);
  REQUIRE(m.free(SeqId{1}).is_ok());
  CHECK(m.num_free_blocks() == 4);
  CHECK(m.num_cached_blocks() == 3);

  // An unrelated 3-block prompt takes the one truly free block, then evicts
  // the two least recently released cached blocks: a's blocks 2 and 1.
  REQUIRE(m.allocate(SeqId{2}, iota_tokens(33, 50000)).is_ok());
  CHECK(m.num_free_blocks() == 1);
  CHECK(m.num_cached_blocks() == 3);  // a's block 0 plus two of the new prompt's
  const auto& t2 = m.block_table(SeqId{2});
  CHECK(std::find(t2.begin(), t2.end(), ta[0]) == t2.end());
  REQUIRE(m.check_invariants().is_ok());

  // a's head is still there.
  REQUIRE(m.free(SeqId{2}).is_ok());
  auto r = m.allocate(SeqId{3}, concat(iota_tokens(16), {1}));
  REQUIRE(r.is_ok());
  CHECK(*r == 16);
  CHECK(m.block_table(SeqId{3})[0] == ta[0]);
  REQUIRE(m.check_invariants().is_ok());
}

TEST_CASE("kv: fork shares blocks, copy-on-write exactly for a shared partial last block", "[kv]") {
  KvBlockManager m(config(16, 8));
  std::vector<BlockCopy> copies;

  SECTION("partial last block") {
    REQUIRE(m.allocate(SeqId{1}, iota_tokens(20)).is_ok());
    REQUIRE(m.fork(SeqId{1}, SeqId{2}).is_ok());
    const std::vector<BlockId> t1 = m.block_table(SeqId{1});
    CHECK(m.block_table(SeqId{2}) == t1);
    CHECK(m.ref_count(t1[0]) == 2);
    CHECK(m.ref_count(t1[1]) == 2);
    CHECK(m.num_free_blocks() == 6);  // fork takes nothing
    CHECK(m.blocks_needed_to_append(SeqId{2}, 1) == 1);

    CHECK(m.append(SeqId{2}, iota_tokens(1), nullptr).is_invalid_argument());  // copy needed, nowhere to put it
    CHECK(m.num_tokens(SeqId{2}) == 20);

    REQUIRE(m.append(SeqId{2}, iota_tokens(1), &copies).is_ok());
    REQUIRE(copies.size() == 1);
    const auto& t2 = m.block_table(SeqId{2});
    CHECK(copies[0].src == t1[1]);
    CHECK(copies[0].dst == t2[1]);
    CHECK(t2[0] == t1[0]);
    CHECK(t2[1] != t1[1]);
    CHECK(m.ref_count(t1[1]) == 1);
    CHECK(m.ref_count(t2[1]) == 1);
    CHECK(m.ref_count(t1[0]) == 2);

    // The parent's last block is private again: no copy.
    copies.clear();
    CHECK(m.blocks_needed_to_append(SeqId{1}, 1) == 0);
    REQUIRE(m.append(SeqId{1}, iota_tokens(1), &copies).is_ok());
    CHECK(copies.empty());
    CHECK(m.block_table(SeqId{1}) == t1);
  }
  SECTION("full last block: a new block, no copy") {
    REQUIRE(m.allocate(SeqId{1}, iota_tokens(32)).is_ok());
    REQUIRE(m.fork(SeqId{1}, SeqId{2}).is_ok());
    CHECK(m.blocks_needed_to_append(SeqId{2}, 1) == 1);
    REQUIRE(m.append(SeqId{2}, iota_tokens(1), &copies).is_ok());
    CHECK(copies.empty());
    CHECK(m.block_table(SeqId{2}).size() == 3);
    CHECK(m.ref_count(m.block_table(SeqId{1})[1]) == 2);
  }
  SECTION("copy then spill into new blocks in one append") {
    REQUIRE(m.allocate(SeqId{1}, iota_tokens(10)).is_ok());
    REQUIRE(m.fork(SeqId{1}, SeqId{2}).is_ok());
    CHECK(m.blocks_needed_to_append(SeqId{2}, 30) == 3);  // copy + 2 new
    REQUIRE(m.append(SeqId{2}, iota_tokens(30), &copies).is_ok());
    CHECK(copies.size() == 1);
    CHECK(m.block_table(SeqId{2}).size() == 3);
  }
  SECTION("freeing the parent leaves the child intact") {
    REQUIRE(m.allocate(SeqId{1}, iota_tokens(20)).is_ok());
    REQUIRE(m.fork(SeqId{1}, SeqId{2}).is_ok());
    REQUIRE(m.free(SeqId{1}).is_ok());
    for (BlockId b : m.block_table(SeqId{2})) CHECK(m.ref_count(b) == 1);
    REQUIRE(m.append(SeqId{2}, iota_tokens(1), &copies).is_ok());
    CHECK(copies.empty());
  }
  REQUIRE(m.check_invariants().is_ok());
}

// Randomized: allocate (prompts from a few shared prefixes), append, fork, free,
// and allocate-then-discard (a cancelled prefill whose blocks hold garbage),
// against a shadow model of each sequence's tokens and a simulated KV storage
// that is written only where the manager says tokens must be computed. After
// every op: check_invariants(), and every sequence reads back its own tokens
// through its block table (so sharing, the cap rule, CoW and discard are all
// sound).
TEST_CASE("kv: randomized operations keep every invariant", "[kv]") {
  struct Shape {
    int block_size;
    int64_t num_blocks;
  };
  const Shape shapes[] = {{1, 48}, {4, 24}, {16, 12}};
  for (uint64_t seed : {1u, 2u, 3u}) {
    for (const Shape& shape : shapes) {
      CAPTURE(seed, shape.block_size, shape.num_blocks);
      const int bs = shape.block_size;
      KvBlockManager m(config(bs, shape.num_blocks));
      m.enable_events(true);
      std::set<uint64_t> reported;  // what a receiver of the KV events believes is cached
      std::mt19937_64 rng(seed * 7919 + static_cast<uint64_t>(bs));
      auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };

      // Few distinct tokens so appended blocks coincide and get shared too.
      std::vector<std::vector<TokenId>> prefixes;
      for (int p = 0; p < 3; ++p) {
        std::vector<TokenId> t;
        for (int i = 0; i < 4 * bs + 3; ++i) t.push_back(uniform(0, 3));
        prefixes.push_back(t);
      }
      std::map<int64_t, std::vector<TokenId>> shadow;  // seq -> tokens
      std::vector<std::vector<TokenId>> storage(static_cast<size_t>(shape.num_blocks),
                                                std::vector<TokenId>(static_cast<size_t>(bs), -1));
      auto write = [&](SeqId id, int64_t from) {  // the "forward pass" for tokens [from, n)
        const auto& table = m.block_table(id);
        const auto& toks = shadow[id.value];
        for (int64_t i = from; i < static_cast<int64_t>(toks.size()); ++i) {
          const BlockId b = table[static_cast<size_t>(i / bs)];
          REQUIRE(m.ref_count(b) == 1);  // compute never writes a shared block
          storage[static_cast<size_t>(b.value)][static_cast<size_t>(i % bs)] = toks[static_cast<size_t>(i)];
        }
      };
      int64_t next_id = 0;
      int ok_allocs = 0, exhausted = 0, cached_hits = 0, cow_copies = 0, discarded = 0, published = 0;

      for (int op = 0; op < 800; ++op) {
        const int kind = uniform(0, 10);
        if (kind <= 3 || shadow.empty()) {  // allocate
          std::vector<TokenId> prompt = prefixes[static_cast<size_t>(uniform(0, 2))];
          prompt.resize(static_cast<size_t>(uniform(0, static_cast<int>(prompt.size()))));
          for (int i = uniform(0, 2 * bs); i > 0; --i) prompt.push_back(uniform(0, 3));
          const SeqId id{next_id++};
          const int64_t need = m.blocks_needed_for_prompt(prompt);
          const int64_t free_before = m.num_free_blocks();
          auto r = m.allocate(id, prompt);
          if (need <= free_before) {
            REQUIRE(r.is_ok());
            ++ok_allocs;
            const int64_t cached = *r;
            CHECK(cached % bs == 0);
            CHECK((prompt.empty() ? cached == 0 : cached < static_cast<int64_t>(prompt.size())));
            CHECK(m.num_free_blocks() == free_before - need);
            if (cached > 0) ++cached_hits;
            shadow[id.value] = prompt;
            write(id, cached);
          } else {
            REQUIRE(r.status().is_resource_exhausted());
            CHECK(m.num_free_blocks() == free_before);
            CHECK_FALSE(m.has(id));
            ++exhausted;
          }
        } else if (kind <= 6) {  // append
          auto it = std::next(shadow.begin(), uniform(0, static_cast<int>(shadow.size()) - 1));
          const SeqId id{it->first};
          std::vector<TokenId> more;
          for (int i = uniform(1, 2 * bs); i > 0; --i) more.push_back(uniform(0, 3));
          const int64_t need = m.blocks_needed_to_append(id, static_cast<int>(more.size()));
          const int64_t free_before = m.num_free_blocks();
          std::vector<BlockCopy> copies;
          Status st = m.append(id, more, &copies);
          if (need <= free_before) {
            REQUIRE(st.is_ok());
            CHECK(m.num_free_blocks() == free_before - need);
            REQUIRE(copies.size() <= 1);
            for (const BlockCopy& c : copies) {
              storage[static_cast<size_t>(c.dst.value)] = storage[static_cast<size_t>(c.src.value)];
              ++cow_copies;
            }
            const int64_t from = static_cast<int64_t>(it->second.size());
            it->second.insert(it->second.end(), more.begin(), more.end());
            write(id, from);
          } else {
            REQUIRE(st.is_resource_exhausted());
            CHECK(copies.empty());
            CHECK(m.num_free_blocks() == free_before);
            CHECK(m.num_tokens(id) == static_cast<int64_t>(it->second.size()));
            ++exhausted;
          }
        } else if (kind == 7) {  // fork
          auto it = std::next(shadow.begin(), uniform(0, static_cast<int>(shadow.size()) - 1));
          const SeqId child{next_id++};
          REQUIRE(m.fork(SeqId{it->first}, child).is_ok());
          shadow[child.value] = it->second;
        } else if (kind <= 9) {  // free
          auto it = std::next(shadow.begin(), uniform(0, static_cast<int>(shadow.size()) - 1));
          REQUIRE(m.free(SeqId{it->first}).is_ok());
          shadow.erase(it);
        } else if (uniform(0, 1) == 0) {  // a KV transfer: fresh blocks, registered once written
          std::vector<TokenId> prompt = prefixes[static_cast<size_t>(uniform(0, 2))];
          prompt.resize(static_cast<size_t>(uniform(0, static_cast<int>(prompt.size()))));
          for (int i = uniform(1, bs); i > 0; --i) prompt.push_back(uniform(0, 3));
          const SeqId id{next_id++};
          const AllocateOptions received{.reuse = false, .publish = false};
          const int64_t need = m.blocks_needed_for_prompt(prompt, received);
          CHECK(need == static_cast<int64_t>((prompt.size() + bs - 1) / bs));
          const int64_t cached_before = m.num_cached_blocks();
          auto r = m.allocate(id, prompt, received);
          if (r.is_ok()) {
            CHECK(*r == 0);
            CHECK(m.num_cached_blocks() <= cached_before);  // nothing registered (evictions may drop some)
            shadow[id.value] = prompt;
            if (uniform(0, 3) == 0) {  // the transfer failed: discarded unwritten
              REQUIRE(m.discard(id).is_ok());
              shadow.erase(id.value);
            } else {
              write(id, 0);
              REQUIRE(m.publish(id).is_ok());
              ++published;
            }
          }
        } else {  // a prefill cancelled before it ran: allocate, write nothing, discard
          std::vector<TokenId> prompt = prefixes[static_cast<size_t>(uniform(0, 2))];
          for (int i = uniform(0, 2 * bs); i > 0; --i) prompt.push_back(uniform(0, 3));
          const SeqId id{next_id++};
          auto r = m.allocate(id, prompt);
          if (r.is_ok()) {
            // Its own blocks hold garbage (a token no sequence ever has).
            const auto& table = m.block_table(id);
            for (size_t b = static_cast<size_t>(*r / bs); b < table.size(); ++b) {
              std::fill(storage[static_cast<size_t>(table[b].value)].begin(),
                        storage[static_cast<size_t>(table[b].value)].end(), -7);
            }
            REQUIRE(m.discard(id).is_ok());
            ++discarded;
          }
        }

        Status inv = m.check_invariants();
        INFO("op " << op << ": " << inv.to_string());
        REQUIRE(inv.is_ok());
        if (uniform(0, 2) > 0) {  // the KV events replay to exactly the registered set
          const KvCacheEvents e = m.take_events();
          for (uint64_t h : e.removed) {
            CHECK(std::find(e.stored.begin(), e.stored.end(), h) == e.stored.end());
            reported.erase(h);
          }
          reported.insert(e.stored.begin(), e.stored.end());
          const std::vector<uint64_t> now = m.cached_hashes();
          REQUIRE(reported == std::set<uint64_t>(now.begin(), now.end()));
        }
        for (const auto& [sid, toks] : shadow) {
          const auto& table = m.block_table(SeqId{sid});
          REQUIRE(m.num_tokens(SeqId{sid}) == static_cast<int64_t>(toks.size()));
          size_t bad = toks.size();  // first position whose KV is not this sequence's token
          for (size_t i = 0; i < toks.size() && bad == toks.size(); ++i) {
            const BlockId b = table[i / static_cast<size_t>(bs)];
            if (storage[static_cast<size_t>(b.value)][i % static_cast<size_t>(bs)] != toks[i]) bad = i;
          }
          INFO("seq " << sid << " reads wrong KV at position " << bad);
          REQUIRE(bad == toks.size());
        }
      }
      // The run exercised what it is meant to.
      CHECK(ok_allocs > 30);
      CHECK(exhausted > 0);
      CHECK(cached_hits > 0);
      CHECK(discarded > 0);
      CHECK(published > 0);
      if (bs > 1) CHECK(cow_copies > 0);  // with block_size 1 no block is ever partial

      for (const auto& [sid, toks] : shadow) REQUIRE(m.free(SeqId{sid}).is_ok());
      REQUIRE(m.check_invariants().is_ok());
      CHECK(m.num_free_blocks() == m.num_blocks());
    }
  }
}

TEST_CASE("kv: geometry bytes per token and blocks for a budget", "[kv]") {
  KvGeometry smol;  // SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64
  smol.n_layers = 30;
  smol.n_kv_heads = 3;
  smol.head_dim = 64;
  smol.bytes_per_element = 4;
  CHECK(smol.bytes_per_token() == 46080);
  KvGeometry half = smol;
  half.bytes_per_element = 2;
  CHECK(half.bytes_per_token() == 23040);
  KvGeometry q8 = smol;  // q8_0: 34 bytes per 32 elements, a 64-wide head is 68 bytes
  q8.row_bytes = 68;
  CHECK(q8.bytes_per_token() == 2 * 30 * 3 * 68);
  CHECK(q8.bytes_per_token() == 12240);

  const int64_t block_bytes = 46080LL * 16;  // 737280
  CHECK(kv_blocks_for_budget(smol, 16, 1LL << 30) == (1LL << 30) / block_bytes);
  CHECK(kv_blocks_for_budget(smol, 16, 1LL << 30) == 1456);
  CHECK(kv_blocks_for_budget(half, 16, 1LL << 30) == 2912);
  CHECK(kv_blocks_for_budget(smol, 16, block_bytes) == 1);
  CHECK(kv_blocks_for_budget(smol, 16, block_bytes - 1) == 0);
  CHECK(kv_blocks_for_budget(smol, 16, 0) == 0);
  CHECK(kv_blocks_for_budget(smol, 16, -5) == 0);
  CHECK(kv_blocks_for_budget(smol, 0, 1LL << 30) == 0);
  CHECK(kv_blocks_for_budget(KvGeometry{}, 16, 1LL << 30) == 0);
}

TEST_CASE("kv: chained block hash depends on the parent and the tokens", "[kv]") {
  const auto t = iota_tokens(16);
  const uint64_t h = kv_block_hash(kKvRootBlockHash, t);
  CHECK(h == kv_block_hash(kKvRootBlockHash, t));
  CHECK(h != kv_block_hash(h, t));
  auto u = t;
  u[15] += 1;
  CHECK(h != kv_block_hash(kKvRootBlockHash, u));
}

}  // namespace
}  // namespace pd

namespace pd {
namespace {

TEST_CASE("kv: an unpublished sequence shares nothing until its KV is written, publish registers it", "[kv]") {
  KvBlockManager m(config(4, 16));
  const auto p = iota_tokens(10);  // 2 full blocks + 2 tokens
  REQUIRE(m.allocate(SeqId{1}, p, {.reuse = false, .publish = false}).is_ok());
  CHECK(m.num_cached_blocks() == 0);
  CHECK(m.cached_prefix_tokens(p) == 0);  // a later prompt cannot read the blocks in flight
  REQUIRE(m.append(SeqId{1}, iota_tokens(2, 1010), nullptr).is_ok());  // fills block 2: still private
  CHECK(m.num_cached_blocks() == 0);
  REQUIRE(m.publish(SeqId{1}).is_ok());
  CHECK(m.num_cached_blocks() == 3);
  CHECK(m.cached_prefix_tokens(iota_tokens(13)) == 12);
  REQUIRE(m.append(SeqId{1}, iota_tokens(4, 1012), nullptr).is_ok());  // published: appends register again
  CHECK(m.num_cached_blocks() == 4);
  CHECK(m.publish(SeqId{9}).is_not_found());
  // reuse = false places a resident prefix in fresh blocks; the cached copy stays the registered one.
  auto r = m.allocate(SeqId{2}, iota_tokens(9), {.reuse = false, .publish = true});
  REQUIRE(r.is_ok());
  CHECK(*r == 0);
  CHECK(m.block_table(SeqId{2})[0] != m.block_table(SeqId{1})[0]);
  CHECK(m.num_cached_blocks() == 4);
  REQUIRE(m.check_invariants().is_ok());
  // Discarded before publish: its blocks go back free, not to the cache.
  REQUIRE(m.allocate(SeqId{3}, iota_tokens(8, 5000), {.reuse = false, .publish = false}).is_ok());
  REQUIRE(m.discard(SeqId{3}).is_ok());
  CHECK(m.cached_prefix_tokens(iota_tokens(9, 5000)) == 0);
  REQUIRE(m.check_invariants().is_ok());
}

TEST_CASE("kv: KV events coalesce per hash and stay bounded by the pool", "[kv]") {
  KvBlockManager m(config(4, 4));
  CHECK(m.take_events().empty());  // off until enabled
  m.enable_events(true);
  REQUIRE(m.allocate(SeqId{1}, iota_tokens(8), {}).is_ok());
  KvCacheEvents e = m.take_events();
  CHECK(!e.reset);
  CHECK(e.stored.size() == 2);
  CHECK(e.removed.empty());
  CHECK(m.take_events().empty());
  // Registered then evicted before anyone took the events: reported as removed only.
  REQUIRE(m.free(SeqId{1}).is_ok());
  REQUIRE(m.allocate(SeqId{2}, iota_tokens(16, 7000), {}).is_ok());  // needs all 4 blocks: evicts both
  e = m.take_events();
  CHECK(e.removed.size() == 2);
  CHECK(e.stored.size() == 4);
  REQUIRE(m.free(SeqId{2}).is_ok());
  // Churn nobody takes: what is pending stays within twice the pool, and is exact.
  for (int i = 0; i < 40; ++i) {
    REQUIRE(m.allocate(SeqId{10 + i}, iota_tokens(16, 100 * i), {}).is_ok());
    REQUIRE(m.free(SeqId{10 + i}).is_ok());
  }
  e = m.take_events();
  CHECK(!e.reset);
  CHECK(e.removed.size() == 4);  // the blocks reported last time
  const auto now = m.cached_hashes();
  CHECK(std::set<uint64_t>(e.stored.begin(), e.stored.end()) == std::set<uint64_t>(now.begin(), now.end()));
  CHECK(m.take_events().empty());
}

}  // namespace
}  // namespace pd

namespace pd {
namespace kv_truncate_test {

KvBlockManagerConfig cfg(int block_size, int64_t num_blocks, bool sharing) {
  KvBlockManagerConfig c;
  c.block_size = block_size;
  c.num_blocks = num_blocks;
  c.enable_prefix_sharing = sharing;
  return c;
}

}  // namespace kv_truncate_test

TEST_CASE("kv: truncate rolls back appended tokens, and what they registered", "[kv]") {
  for (bool sharing : {true, false}) {
    KvBlockManager m(kv_truncate_test::cfg(4, 32, sharing));
    const SeqId a{1};
    std::vector<TokenId> kept(10);
    std::iota(kept.begin(), kept.end(), 100);
    REQUIRE(m.allocate(a, kept).is_ok());
    const int64_t free_before = m.num_free_blocks();
    const int64_t cached_before = m.num_cached_blocks();
    // Draft tokens fill blocks 2 and 3 (registered), then are cut back to 10 + 1.
    const std::vector<TokenId> draft = {7, 7, 7, 7, 7, 7, 7};
    REQUIRE(m.append(a, draft, nullptr).is_ok());
    CHECK(m.num_tokens(a) == 17);
    std::vector<TokenId> after = kept;
    after.push_back(7);  // one draft token accepted
    REQUIRE(m.truncate(a, after).is_ok());
    CHECK(m.num_tokens(a) == 11);
    CHECK(m.block_table(a).size() == 3);
    CHECK(m.num_free_blocks() == free_before);  // block 3 went back; block 2 was already held
    CHECK(m.num_cached_blocks() == cached_before);  // nothing registered by the draft stays
    REQUIRE(m.check_invariants().is_ok());
    // Appending on goes on from the right place: the blocks it fills register
    // under the tokens really there, and a prompt of those tokens reuses them.
    const std::vector<TokenId> more = {8, 9, 10, 11, 12};
    REQUIRE(m.append(a, more, nullptr).is_ok());
    std::vector<TokenId> full = after;
    full.insert(full.end(), more.begin(), more.end());
    REQUIRE(m.check_invariants().is_ok());
    const SeqId b{2};
    auto reused = m.allocate(b, full);
    REQUIRE(reused.is_ok());
    CHECK(*reused == (sharing ? 12 : 0));  // 3 full blocks of `full` (16 tokens: the 4th block is the last token's)
    // A prompt of the draft's tokens finds nothing of them.
    std::vector<TokenId> wrong = kept;
    wrong.insert(wrong.end(), draft.begin(), draft.end());
    CHECK(m.cached_prefix_tokens(wrong) == (sharing ? 8 : 0));
    REQUIRE(m.free(a).is_ok());
    REQUIRE(m.free(b).is_ok());
    REQUIRE(m.check_invariants().is_ok());
  }
}

TEST_CASE("kv: truncate refuses what it cannot do and changes nothing", "[kv]") {
  KvBlockManager m(kv_truncate_test::cfg(4, 8, true));
  std::vector<TokenId> t(8);
  std::iota(t.begin(), t.end(), 1);
  CHECK(m.truncate(SeqId{9}, t).is_not_found());
  REQUIRE(m.allocate(SeqId{1}, t).is_ok());
  std::vector<TokenId> longer = t;
  longer.push_back(3);
  CHECK(m.truncate(SeqId{1}, longer).is_invalid_argument());
  // A block shared with another sequence (a prefix reused from the cache) is not cut.
  REQUIRE(m.allocate(SeqId{2}, longer).is_ok());
  CHECK(m.truncate(SeqId{2}, std::span<const TokenId>(t).first(6)).is_invalid_argument());
  CHECK(m.num_tokens(SeqId{2}) == 9);
  CHECK(m.truncate(SeqId{2}, t).is_ok());  // at the boundary: only its own block goes
  REQUIRE(m.check_invariants().is_ok());
}

}  // namespace pd
