// Paged KV block manager: see kv_block_manager.h for the contracts.
#include "kv/kv_block_manager.h"

#include <xxhash.h>

#include <algorithm>
#include <cassert>
#include <list>
#include <string>
#include <unordered_set>

namespace pd {

int64_t kv_blocks_for_budget(const KvGeometry& g, int block_size, int64_t budget_bytes) {
  const int64_t per_token = g.bytes_per_token();
  if (per_token <= 0 || block_size <= 0 || budget_bytes <= 0) return 0;
  return budget_bytes / (per_token * block_size);
}

uint64_t kv_block_hash(uint64_t parent_hash, std::span<const TokenId> block_tokens) {
  return XXH3_64bits_withSeed(block_tokens.data(), block_tokens.size_bytes(), parent_hash);
}

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

struct KvBlockManager::Impl {
  struct Block {
    int32_t ref = 0;
    // Registered in cached_ under `hash`; then `tokens` holds the block's
    // block_size tokens and `parent_hash` the chained hash of the block before.
    bool registered = false;
    uint64_t hash = 0;
    uint64_t parent_hash = 0;
    std::vector<TokenId> tokens;
    std::list<int32_t>::iterator lru_pos;  // valid iff registered && ref == 0
  };
  struct Seq {
    std::vector<BlockId> table;
    int64_t n_tokens = 0;
    uint64_t last_full_hash = kKvRootBlockHash;  // chained hash of the last full block
    std::vector<TokenId> tail;                   // tokens of the partial last block
    size_t n_reused = 0;                         // leading blocks allocate() took from the cache
    bool published = true;                       // its full blocks register (AllocateOptions::publish)
    std::vector<TokenId> tokens;                 // all its tokens while unpublished (publish() registers them)
  };
  // What allocate() would do for a prompt, computed without side effects.
  struct PromptPlan {
    int64_t total_blocks = 0;
    std::vector<uint64_t> hashes;  // chained hash of every full block (if sharing)
    std::vector<int32_t> reused;   // leading cached blocks to share
    int64_t reused_unreferenced = 0;
    int64_t free_blocks_consumed() const {
      return total_blocks - static_cast<int64_t>(reused.size()) + reused_unreferenced;
    }
  };

  // Constant after construction.
  KvBlockManagerConfig cfg;

  std::vector<Block> blocks;
  std::vector<int32_t> free_list;  // ref 0, unregistered; popped from the back
  std::list<int32_t> lru;          // ref 0, registered; front = released longest ago
  std::unordered_map<uint64_t, int32_t> cached;  // chained hash -> registered block
  std::unordered_map<SeqId, Seq> seqs;
  // KV events (enable_events): pending changes, a hash in at most one set.
  // Bounded without a cap: ev_stored holds registered hashes (<= num_blocks),
  // ev_removed only hashes registered when events were last taken (<= num_blocks).
  bool events_on = false;
  std::unordered_set<uint64_t> ev_stored, ev_removed;

  void note(uint64_t hash, bool stored) {
    if (!events_on) return;
    if (stored) {
      ev_removed.erase(hash);
      ev_stored.insert(hash);
    } else if (ev_stored.erase(hash) == 0) {  // reported before: the receiver must drop it
      ev_removed.insert(hash);
    }
  }

  explicit Impl(KvBlockManagerConfig c) : cfg(c) {
    assert(cfg.block_size >= 1 && cfg.num_blocks >= 0);
    blocks.resize(static_cast<size_t>(cfg.num_blocks));
    free_list.reserve(blocks.size());
    for (int64_t b = cfg.num_blocks - 1; b >= 0; --b) free_list.push_back(static_cast<int32_t>(b));
  }

  int64_t num_free() const { return static_cast<int64_t>(free_list.size() + lru.size()); }

  PromptPlan plan_prompt(std::span<const TokenId> tokens, bool reuse = true) const {
    const int64_t bs = cfg.block_size;
    const int64_t n = static_cast<int64_t>(tokens.size());
    PromptPlan plan;
    plan.total_blocks = ceil_div(n, bs);
    if (!cfg.enable_prefix_sharing) return plan;
    const int64_t n_full = n / bs;
    plan.hashes.reserve(static_cast<size_t>(n_full));
    uint64_t parent = kKvRootBlockHash;
    for (int64_t k = 0; k < n_full; ++k) {
      parent = kv_block_hash(parent, tokens.subspan(k * bs, bs));
      plan.hashes.push_back(parent);
    }
    // Cap rule: at least the last token is computed, so at most (n-1)/bs blocks are shared.
    const int64_t max_reuse = !reuse ? 0 : n > 0 ? (n - 1) / bs : 0;
    for (int64_t k = 0; k < max_reuse; ++k) {
      auto it = cached.find(plan.hashes[k]);
      if (it == cached.end()) break;
      const Block& blk = blocks[it->second];
      const uint64_t want_parent = k == 0 ? kKvRootBlockHash : plan.hashes[k - 1];
      auto block_tokens = tokens.subspan(k * bs, bs);
      if (!blk.registered || blk.parent_hash != want_parent ||
          !std::equal(blk.tokens.begin(), blk.tokens.end(), block_tokens.begin(), block_tokens.end())) {
        break;
      }
      plan.reused.push_back(it->second);
      if (blk.ref == 0) ++plan.reused_unreferenced;
    }
    return plan;
  }

  // Takes a block with refcount 0 out of the pool (a truly free one first,
  // else evicts the least recently released cached one) and gives it ref 1.
  // Caller has checked num_free() > 0.
  int32_t take_fresh() {
    int32_t b;
    if (!free_list.empty()) {
      b = free_list.back();
      free_list.pop_back();
    } else {
      assert(!lru.empty());
      b = lru.front();
      lru.pop_front();
      unregister(b);
    }
    assert(blocks[b].ref == 0 && !blocks[b].registered);
    blocks[b].ref = 1;
    return b;
  }

  void unregister(int32_t b) {
    Block& blk = blocks[b];
    auto it = cached.find(blk.hash);
    if (it != cached.end() && it->second == b) {
      cached.erase(it);
      note(blk.hash, false);
    }
    blk.registered = false;
    blk.tokens.clear();
    blk.tokens.shrink_to_fit();
  }

  // Registers a full private block; keeps the existing entry if the hash is taken.
  void try_register(int32_t b, uint64_t hash, uint64_t parent_hash, std::span<const TokenId> tokens) {
    if (!cfg.enable_prefix_sharing) return;
    if (!cached.emplace(hash, b).second) return;
    note(hash, true);
    Block& blk = blocks[b];
    blk.registered = true;
    blk.hash = hash;
    blk.parent_hash = parent_hash;
    blk.tokens.assign(tokens.begin(), tokens.end());
  }

  void acquire_shared(int32_t b) {
    Block& blk = blocks[b];
    if (blk.ref == 0) {
      assert(blk.registered);
      lru.erase(blk.lru_pos);
    }
    ++blk.ref;
  }

  void release(int32_t b) {
    Block& blk = blocks[b];
    assert(blk.ref > 0);
    if (--blk.ref > 0) return;
    if (blk.registered) {
      blk.lru_pos = lru.insert(lru.end(), b);
    } else {
      free_list.push_back(b);
    }
  }

  // Blocks an append of n tokens to s needs: a CoW copy of a shared partial
  // last block, plus the new blocks the tokens spill into.
  int64_t append_need(const Seq& s, int64_t n, bool* cow) const {
    *cow = false;
    if (n <= 0) return 0;
    const int64_t bs = cfg.block_size;
    if (s.n_tokens % bs != 0 && blocks[s.table.back().value].ref > 1) *cow = true;
    const int64_t grow = ceil_div(s.n_tokens + n, bs) - static_cast<int64_t>(s.table.size());
    return grow + (*cow ? 1 : 0);
  }
};

KvBlockManager::KvBlockManager(KvBlockManagerConfig cfg) : impl_(std::make_unique<Impl>(cfg)) {}
KvBlockManager::~KvBlockManager() = default;
KvBlockManager::KvBlockManager(KvBlockManager&&) noexcept = default;
KvBlockManager& KvBlockManager::operator=(KvBlockManager&&) noexcept = default;

int KvBlockManager::block_size() const { return impl_->cfg.block_size; }
int64_t KvBlockManager::num_blocks() const { return impl_->cfg.num_blocks; }
int64_t KvBlockManager::num_free_blocks() const { return impl_->num_free(); }
int64_t KvBlockManager::num_cached_blocks() const { return static_cast<int64_t>(impl_->cached.size()); }

int64_t KvBlockManager::blocks_needed_for_prompt(std::span<const TokenId> tokens, AllocateOptions opts) const {
  return impl_->plan_prompt(tokens, opts.reuse).free_blocks_consumed();
}

int64_t KvBlockManager::cached_prefix_tokens(std::span<const TokenId> tokens) const {
  return static_cast<int64_t>(impl_->plan_prompt(tokens).reused.size()) * impl_->cfg.block_size;
}

Result<int64_t> KvBlockManager::allocate(SeqId seq, std::span<const TokenId> tokens, AllocateOptions opts) {
  Impl& m = *impl_;
  if (m.seqs.count(seq)) {
    return Status::invalid_argument("allocate: seq " + std::to_string(seq.value) + " already exists");
  }
  Impl::PromptPlan plan = m.plan_prompt(tokens, opts.reuse);
  const int64_t need = plan.free_blocks_consumed();
  if (need > m.num_free()) {
    return Status::resource_exhausted("allocate seq " + std::to_string(seq.value) + " (" +
                                      std::to_string(tokens.size()) + " tokens): need " +
                                      std::to_string(need) + " blocks, " + std::to_string(m.num_free()) +
                                      " free");
  }
  // Commit: nothing below can fail.
  const int64_t bs = m.cfg.block_size;
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t n_full = n / bs;
  Impl::Seq s;
  s.table.reserve(static_cast<size_t>(plan.total_blocks));
  for (int32_t b : plan.reused) {
    m.acquire_shared(b);
    s.table.push_back(BlockId{b});
  }
  for (int64_t k = static_cast<int64_t>(plan.reused.size()); k < plan.total_blocks; ++k) {
    const int32_t b = m.take_fresh();
    s.table.push_back(BlockId{b});
    if (k < n_full && m.cfg.enable_prefix_sharing && opts.publish) {
      m.try_register(b, plan.hashes[k], k == 0 ? kKvRootBlockHash : plan.hashes[k - 1],
                     tokens.subspan(k * bs, bs));
    }
  }
  s.n_tokens = n;
  s.n_reused = plan.reused.size();
  s.published = opts.publish;
  if (!opts.publish && m.cfg.enable_prefix_sharing) s.tokens.assign(tokens.begin(), tokens.end());
  if (n_full > 0 && m.cfg.enable_prefix_sharing) s.last_full_hash = plan.hashes[n_full - 1];
  s.tail.assign(tokens.begin() + n_full * bs, tokens.end());
  m.seqs.emplace(seq, std::move(s));
  return static_cast<int64_t>(plan.reused.size()) * bs;
}

int64_t KvBlockManager::blocks_needed_to_append(SeqId seq, int n) const {
  auto it = impl_->seqs.find(seq);
  if (it == impl_->seqs.end()) return n > 0 ? ceil_div(n, impl_->cfg.block_size) : 0;
  bool cow;
  return impl_->append_need(it->second, n, &cow);
}

Status KvBlockManager::append(SeqId seq, std::span<const TokenId> tokens, std::vector<BlockCopy>* copies) {
  Impl& m = *impl_;
  auto it = m.seqs.find(seq);
  if (it == m.seqs.end()) return Status::not_found("append: unknown seq " + std::to_string(seq.value));
  Impl::Seq& s = it->second;
  bool cow = false;
  const int64_t need = m.append_need(s, static_cast<int64_t>(tokens.size()), &cow);
  if (cow && copies == nullptr) {
    return Status::invalid_argument("append seq " + std::to_string(seq.value) +
                                    ": its last block is shared and must be copied, but copies is null");
  }
  if (need > m.num_free()) {
    return Status::resource_exhausted("append seq " + std::to_string(seq.value) + " (" +
                                      std::to_string(tokens.size()) + " tokens): need " +
                                      std::to_string(need) + " blocks, " + std::to_string(m.num_free()) +
                                      " free");
  }
  // Commit: nothing below can fail.
  const int64_t bs = m.cfg.block_size;
  if (cow) {
    const int32_t src = s.table.back().value;
    const int32_t dst = m.take_fresh();
    copies->push_back(BlockCopy{BlockId{src}, BlockId{dst}});
    s.table.back() = BlockId{dst};
    m.release(src);  // still referenced by another table
  }
  if (!s.published && m.cfg.enable_prefix_sharing) s.tokens.insert(s.tokens.end(), tokens.begin(), tokens.end());
  for (TokenId t : tokens) {
    if (s.n_tokens % bs == 0) s.table.push_back(BlockId{m.take_fresh()});
    s.tail.push_back(t);
    ++s.n_tokens;
    if (static_cast<int64_t>(s.tail.size()) == bs) {
      if (!m.cfg.enable_prefix_sharing) {  // no chain to extend
        s.tail.clear();
        continue;
      }
      const uint64_t h = kv_block_hash(s.last_full_hash, s.tail);
      if (s.published) m.try_register(s.table.back().value, h, s.last_full_hash, s.tail);
      s.last_full_hash = h;
      s.tail.clear();
    }
  }
  return Status::ok();
}

Status KvBlockManager::truncate(SeqId seq, std::span<const TokenId> kept) {
  Impl& m = *impl_;
  auto it = m.seqs.find(seq);
  if (it == m.seqs.end()) return Status::not_found("truncate: unknown seq " + std::to_string(seq.value));
  Impl::Seq& s = it->second;
  const int64_t n = static_cast<int64_t>(kept.size());
  if (n > s.n_tokens) {
    return Status::invalid_argument("truncate seq " + std::to_string(seq.value) + " to " + std::to_string(n) +
                                    " tokens: it holds " + std::to_string(s.n_tokens));
  }
  if (n == s.n_tokens) return Status::ok();
  const int64_t bs = m.cfg.block_size;
  const size_t keep_blocks = static_cast<size_t>(ceil_div(n, bs));
  // The first block holding a cut token: n / bs (partial after the cut) when
  // n is not a block boundary, else the first block dropped.
  const size_t first_cut = static_cast<size_t>(n / bs);
  for (size_t i = first_cut; i < s.table.size(); ++i) {
    if (m.blocks[s.table[i].value].ref > 1) {
      return Status::invalid_argument("truncate seq " + std::to_string(seq.value) + ": block " + std::to_string(i) +
                                      " is shared with another sequence");
    }
  }
  // Commit: nothing below can fail.
  for (size_t i = s.table.size(); i-- > first_cut;) {
    const int32_t b = s.table[i].value;
    if (m.blocks[b].registered) m.unregister(b);  // its hash covers tokens cut off
    if (i >= keep_blocks) {
      m.release(b);
      s.table.pop_back();
    }
  }
  const int64_t n_full = n / bs;
  if (m.cfg.enable_prefix_sharing) {
    // The chained hash of the last full block: held by it when registered, else recomputed.
    const int32_t last_full = n_full > 0 ? s.table[static_cast<size_t>(n_full - 1)].value : -1;
    if (last_full < 0) {
      s.last_full_hash = kKvRootBlockHash;
    } else if (m.blocks[last_full].registered && m.cached.count(m.blocks[last_full].hash)) {
      s.last_full_hash = m.blocks[last_full].hash;
    } else {
      uint64_t h = kKvRootBlockHash;
      for (int64_t k = 0; k < n_full; ++k) h = kv_block_hash(h, kept.subspan(static_cast<size_t>(k * bs), bs));
      s.last_full_hash = h;
    }
  }
  s.tail.assign(kept.begin() + n_full * bs, kept.end());
  s.n_tokens = n;
  s.n_reused = std::min(s.n_reused, keep_blocks);
  if (!s.published && m.cfg.enable_prefix_sharing) s.tokens.resize(static_cast<size_t>(n));
  return Status::ok();
}

Status KvBlockManager::fork(SeqId parent, SeqId child) {
  Impl& m = *impl_;
  auto it = m.seqs.find(parent);
  if (it == m.seqs.end()) return Status::not_found("fork: unknown parent seq " + std::to_string(parent.value));
  if (m.seqs.count(child)) {
    return Status::invalid_argument("fork: child seq " + std::to_string(child.value) + " already exists");
  }
  Impl::Seq copy = it->second;
  for (BlockId b : copy.table) ++m.blocks[b.value].ref;  // each has ref >= 1: not in any pool
  m.seqs.emplace(child, std::move(copy));
  return Status::ok();
}

Status KvBlockManager::free(SeqId seq) {
  Impl& m = *impl_;
  auto it = m.seqs.find(seq);
  if (it == m.seqs.end()) return Status::not_found("free: unknown seq " + std::to_string(seq.value));
  // Last block first: the tail of a prefix reaches the LRU front before its head.
  const std::vector<BlockId>& table = it->second.table;
  for (auto b = table.rbegin(); b != table.rend(); ++b) m.release(b->value);
  m.seqs.erase(it);
  return Status::ok();
}

Status KvBlockManager::discard(SeqId seq) {
  Impl& m = *impl_;
  auto it = m.seqs.find(seq);
  if (it == m.seqs.end()) return Status::not_found("discard: unknown seq " + std::to_string(seq.value));
  const Impl::Seq& s = it->second;
  for (size_t i = s.table.size(); i-- > 0;) {
    const int32_t b = s.table[i].value;
    if (i >= s.n_reused && m.blocks[b].ref == 1 && m.blocks[b].registered) m.unregister(b);
    m.release(b);  // an unregistered block goes to the free list
  }
  m.seqs.erase(it);
  return Status::ok();
}

Status KvBlockManager::publish(SeqId seq) {
  Impl& m = *impl_;
  auto it = m.seqs.find(seq);
  if (it == m.seqs.end()) return Status::not_found("publish: unknown seq " + std::to_string(seq.value));
  Impl::Seq& s = it->second;
  s.published = true;
  if (!m.cfg.enable_prefix_sharing) return Status::ok();
  const int64_t bs = m.cfg.block_size;
  const int64_t n_full = s.n_tokens / bs;
  uint64_t parent = kKvRootBlockHash;
  for (int64_t k = 0; k < n_full; ++k) {
    const int32_t b = s.table[static_cast<size_t>(k)].value;
    const std::span<const TokenId> toks(s.tokens.data() + k * bs, static_cast<size_t>(bs));
    const uint64_t h = kv_block_hash(parent, toks);
    if (!m.blocks[b].registered) m.try_register(b, h, parent, toks);
    parent = h;
  }
  s.tokens.clear();
  s.tokens.shrink_to_fit();
  return Status::ok();
}

std::vector<uint64_t> KvBlockManager::cached_hashes() const {
  std::vector<uint64_t> out;
  out.reserve(impl_->cached.size());
  for (const auto& [h, b] : impl_->cached) out.push_back(h);
  return out;
}

void KvBlockManager::enable_events(bool on) {
  Impl& m = *impl_;
  m.events_on = on;
  m.ev_stored.clear();
  m.ev_removed.clear();
}

KvCacheEvents KvBlockManager::take_events() {
  Impl& m = *impl_;
  KvCacheEvents e;
  if (m.ev_stored.empty() && m.ev_removed.empty()) return e;  // every loop iteration asks
  e.stored.assign(m.ev_stored.begin(), m.ev_stored.end());
  e.removed.assign(m.ev_removed.begin(), m.ev_removed.end());
  m.ev_stored.clear();
  m.ev_removed.clear();
  return e;
}

bool KvBlockManager::has(SeqId seq) const { return impl_->seqs.count(seq) != 0; }

int64_t KvBlockManager::num_tokens(SeqId seq) const {
  auto it = impl_->seqs.find(seq);
  return it == impl_->seqs.end() ? 0 : it->second.n_tokens;
}

const std::vector<BlockId>& KvBlockManager::block_table(SeqId seq) const {
  static const std::vector<BlockId> kEmpty;
  auto it = impl_->seqs.find(seq);
  return it == impl_->seqs.end() ? kEmpty : it->second.table;
}

int32_t KvBlockManager::ref_count(BlockId b) const {
  if (b.value < 0 || b.value >= impl_->cfg.num_blocks) return 0;
  return impl_->blocks[b.value].ref;
}

Status KvBlockManager::check_invariants() const {
  const Impl& m = *impl_;
  const int64_t nb = m.cfg.num_blocks;
  const int64_t bs = m.cfg.block_size;
  auto fail = [](const std::string& what) { return Status::internal("kv invariant: " + what); };
  auto name = [](int64_t b) { return "block " + std::to_string(b); };

  // Refcounts recounted from the tables.
  std::vector<int32_t> refs(static_cast<size_t>(nb), 0);
  for (const auto& [id, s] : m.seqs) {
    const std::string seq_name = "seq " + std::to_string(id.value);
    if (static_cast<int64_t>(s.table.size()) != ceil_div(s.n_tokens, bs)) {
      return fail(seq_name + " has " + std::to_string(s.table.size()) + " blocks for " +
                  std::to_string(s.n_tokens) + " tokens");
    }
    if (static_cast<int64_t>(s.tail.size()) != s.n_tokens % bs) {
      return fail(seq_name + " tail holds " + std::to_string(s.tail.size()) + " tokens");
    }
    for (BlockId b : s.table) {
      if (b.value < 0 || b.value >= nb) return fail(seq_name + " holds out-of-range " + name(b.value));
      ++refs[b.value];
    }
    if (!s.tail.empty() && m.blocks[s.table.back().value].registered) {
      return fail(seq_name + " partial last " + name(s.table.back().value) + " is registered");
    }
  }
  int64_t owned = 0;
  for (int64_t b = 0; b < nb; ++b) {
    if (refs[b] != m.blocks[b].ref) {
      return fail(name(b) + " stores ref " + std::to_string(m.blocks[b].ref) + ", tables hold " +
                  std::to_string(refs[b]));
    }
    if (refs[b] > 0) ++owned;
  }
  // Free list: unreferenced, unregistered, no duplicates.
  std::vector<char> pooled(static_cast<size_t>(nb), 0);
  for (int32_t b : m.free_list) {
    if (b < 0 || b >= nb) return fail("free list holds out-of-range " + name(b));
    if (pooled[b]) return fail(name(b) + " appears twice in the free pools");
    pooled[b] = 1;
    if (m.blocks[b].ref != 0) return fail(name(b) + " is free with ref " + std::to_string(m.blocks[b].ref));
    if (m.blocks[b].registered) return fail(name(b) + " is in the free list but registered");
  }
  // Evictable cached blocks: unreferenced, registered, iterator consistent.
  for (auto it = m.lru.begin(); it != m.lru.end(); ++it) {
    const int32_t b = *it;
    if (b < 0 || b >= nb) return fail("lru holds out-of-range " + name(b));
    if (pooled[b]) return fail(name(b) + " appears twice in the free pools");
    pooled[b] = 1;
    if (m.blocks[b].ref != 0) return fail(name(b) + " is evictable with ref " + std::to_string(m.blocks[b].ref));
    if (!m.blocks[b].registered) return fail(name(b) + " is evictable but not registered");
    if (m.blocks[b].lru_pos != it) return fail(name(b) + " has a stale lru position");
  }
  for (int64_t b = 0; b < nb; ++b) {
    if (m.blocks[b].ref == 0 && !pooled[b]) return fail(name(b) + " is unreferenced but in no pool (leaked)");
  }
  if (static_cast<int64_t>(m.free_list.size() + m.lru.size()) + owned != nb) {
    return fail("free " + std::to_string(m.free_list.size()) + " + evictable " + std::to_string(m.lru.size()) +
                " + owned " + std::to_string(owned) + " != " + std::to_string(nb) + " blocks");
  }
  // Hash map: entries point at registered full blocks whose hash matches.
  int64_t registered = 0;
  for (int64_t b = 0; b < nb; ++b) registered += m.blocks[b].registered ? 1 : 0;
  if (registered != static_cast<int64_t>(m.cached.size())) {
    return fail(std::to_string(registered) + " registered blocks but " + std::to_string(m.cached.size()) +
                " hash map entries");
  }
  for (const auto& [h, b] : m.cached) {
    if (b < 0 || b >= nb) return fail("hash map points at out-of-range " + name(b));
    const Impl::Block& blk = m.blocks[b];
    if (!blk.registered || blk.hash != h) return fail("hash map entry for " + name(b) + " does not match it");
    if (static_cast<int64_t>(blk.tokens.size()) != bs) return fail("registered " + name(b) + " is not full");
    if (kv_block_hash(blk.parent_hash, blk.tokens) != h) return fail("registered " + name(b) + " hash is stale");
  }
  return Status::ok();
}

}  // namespace pd
