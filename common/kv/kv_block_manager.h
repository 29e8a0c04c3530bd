// Paged KV block manager: bookkeeping only (which block belongs to whom); the
// KV bytes themselves live in a KvCache storage owned by the backend.
//
// Fixed-size blocks of block_size tokens, a free list, per-sequence block
// tables, reference counts, copy-on-write for shared partial blocks, and prefix
// sharing by chained hashes of full blocks. Every allocation failure is a
// value (ResourceExhausted) the caller handles; a failed call changes nothing
// (plan, then commit).
//
// Thread-safety: none; one owner thread (a worker's engine loop).
//
// Prefix sharing, precisely:
//  - Block k of a sequence (tokens [k*B, (k+1)*B), B = block_size) gets, once
//    FULL, the chained hash h_k = kv_block_hash(h_{k-1}, tokens of block k),
//    h_{-1} = kKvRootBlockHash. Full blocks are registered in a map h -> block;
//    a partially filled block is never registered. A registered block whose
//    refcount drops to 0 stays resident ("cached") for reuse and counts as free;
//    it is evicted, least recently released first, when a fresh block is needed.
//    free() releases a table's blocks last-to-first, so a prefix's tail is
//    evicted before its head.
//  - A match requires the hash, the parent's hash and the block's own tokens to
//    be equal (tokens are stored per cached block). A false match would need a
//    64-bit collision of the parent chain hash on top of identical block tokens.
//  - Cap rule: allocate() never reports the whole prompt as cached, since the
//    last prompt token must be computed to give logits. It reuses at most
//    floor((n-1)/B) leading full blocks of an n-token prompt, so the cached
//    count is a multiple of B and <= n-1. When an n-token prompt (n a multiple
//    of B) is entirely resident, its last block is therefore NOT shared: the
//    sequence gets a fresh private block and recomputes those B tokens; no
//    shared block is ever written by the compute and no copy is needed.
//  - Blocks are registered when allocate()/append() places the tokens, before
//    the forward pass writes their KV. Contract for callers: a sequence that
//    reuses a block must not read it in a forward pass that runs before the
//    pass computing the block's owner's tokens (same pass is fine when each
//    layer writes the KV of every sequence in the batch before attention),
//    and a sequence whose KV was never written (cancelled before its prefill,
//    failed transfer) is released with discard(), not free(), so its
//    unwritten blocks do not stay in the prefix cache.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "util/status.h"

namespace pd {

using TokenId = int32_t;

struct BlockId {
  int32_t value = -1;
  friend bool operator==(BlockId a, BlockId b) { return a.value == b.value; }
  friend bool operator!=(BlockId a, BlockId b) { return a.value != b.value; }
};
struct SeqId {
  int64_t value = -1;
  friend bool operator==(SeqId a, SeqId b) { return a.value == b.value; }
};

// Geometry of the model's KV cache.
struct KvGeometry {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int bytes_per_element = 4;  // fp32 KV by default
  // Sub-byte element widths (int4 KV: 4). When > 0 it replaces bytes_per_element
  // (an element takes bits_per_element / 8 bytes); 0 keeps bytes_per_element.
  int bits_per_element = 0;
  // Block-quantized elements (q8_0: 34 bytes per 32): when > 0, the bytes of
  // one token's one head (head_dim elements), replacing the widths above.
  int64_t row_bytes = 0;
  // 2 (K and V) x layers x kv_heads x head_dim x bytes_per_element.
  // The one formula for KV bytes per token in the codebase.
  int64_t bytes_per_token() const {
    if (row_bytes > 0) return 2LL * n_layers * n_kv_heads * row_bytes;
    const int64_t bits = bits_per_element > 0 ? bits_per_element : 8LL * bytes_per_element;
    return 2LL * n_layers * n_kv_heads * head_dim * bits / 8;
  }
};
// Number of blocks of `block_size` tokens a byte budget holds (0 if none fits,
// or if the geometry, block_size or budget is not positive).
int64_t kv_blocks_for_budget(const KvGeometry& g, int block_size, int64_t budget_bytes);

// Chained hash of one full block: XXH3-64 of the block's token ids (host byte
// order) seeded with the parent block's hash (kKvRootBlockHash for block 0).
// Stable within a build; the router may use it for prefix-aware dispatch.
inline constexpr uint64_t kKvRootBlockHash = 0x9e3779b97f4a7c15ULL;
uint64_t kv_block_hash(uint64_t parent_hash, std::span<const TokenId> block_tokens);

struct KvBlockManagerConfig {
  int block_size = 16;        // tokens per block
  int64_t num_blocks = 0;     // pool size
  bool enable_prefix_sharing = true;
};

// How allocate() places a prompt.
struct AllocateOptions {
  // Share resident full blocks with the same chained hash (the cache rule
  // above). False: every block is fresh (the prompt's KV all arrives or is
  // computed here, e.g. a KV handoff, or prompt logprobs that need every row).
  bool reuse = true;
  // Register the fresh full blocks for later prompts now. False: they stay
  // private until publish(), for KV written later than the next pass (a KV
  // transfer, a prompt computed chunk by chunk over several steps).
  bool publish = true;
};

// What changed in the set of blocks registered for prefix sharing, by chained
// hash, since the last take_events(): `stored` became reusable, `removed` no
// longer are (evicted, discarded). A hash is in at most one of the two; apply
// `removed` first. `reset` (a snapshot, cached_hashes()): replace the
// receiver's view by `stored`.
struct KvCacheEvents {
  bool reset = false;
  std::vector<uint64_t> stored, removed;
  bool empty() const { return !reset && stored.empty() && removed.empty(); }
};

// A copy the caller must perform on the KV storage before writing (copy-on-write).
struct BlockCopy {
  BlockId src;
  BlockId dst;
};

class KvBlockManager {
 public:
  // cfg.block_size must be >= 1 and cfg.num_blocks >= 0 (asserted; the config
  // loader validates user input).
  explicit KvBlockManager(KvBlockManagerConfig cfg);
  ~KvBlockManager();
  // Movable, not copyable; a moved-from manager may only be destroyed or assigned.
  KvBlockManager(KvBlockManager&&) noexcept;
  KvBlockManager& operator=(KvBlockManager&&) noexcept;
  KvBlockManager(const KvBlockManager&) = delete;  // one owner of the pool
  KvBlockManager& operator=(const KvBlockManager&) = delete;

  int block_size() const;
  int64_t num_blocks() const;
  int64_t num_free_blocks() const;  // includes cached-but-unreferenced prefix blocks that can be evicted

  // How much num_free_blocks() would drop if a new sequence with these prompt
  // tokens were allocated now: fresh blocks plus reused cached blocks that are
  // currently unreferenced (those leave the evictable pool). allocate() succeeds
  // iff this is <= num_free_blocks() (and the seq id is new).
  int64_t blocks_needed_for_prompt(std::span<const TokenId> tokens, AllocateOptions opts = {}) const;
  // How many leading tokens allocate(seq, tokens) would report cached now (a
  // multiple of block_size, < tokens.size(); 0 with prefix sharing off).
  // Allocating only a leading part [0, k) with k > this count reports the same
  // number, so a prompt may be placed chunk by chunk without losing reuse.
  int64_t cached_prefix_tokens(std::span<const TokenId> tokens) const;
  // Creates a sequence holding `tokens` (may be empty); reuses resident full
  // blocks with the same chained hash (prefix sharing, see the cap rule above).
  // Returns how many leading tokens were already cached (their KV need not be
  // recomputed): a multiple of block_size, 0 with prefix sharing disabled, and
  // always < tokens.size() for a non-empty prompt. InvalidArgument if seq
  // exists; ResourceExhausted ("need N blocks, M free"; nothing changed) if the
  // pool cannot hold it.
  // `opts`: see AllocateOptions (a sequence allocated with publish = false
  // registers nothing, its appends included, until publish()).
  Result<int64_t> allocate(SeqId seq, std::span<const TokenId> tokens, AllocateOptions opts = {});
  // The KV of `seq`'s tokens is written: registers its full blocks not yet
  // registered (a hash another block holds already keeps that one), and its
  // later appends register as usual. NotFound for an unknown seq.
  Status publish(SeqId seq);
  // Blocks `seq` needs to append `n` more tokens (0 or more; counts a CoW copy).
  // An unknown seq reads as an empty sequence.
  int64_t blocks_needed_to_append(SeqId seq, int n) const;
  // Appends tokens to `seq`, allocating blocks as needed. If the last block is
  // partially filled and shared (refcount > 1, e.g. after fork), it is first
  // replaced by a fresh private block and the copy is pushed onto `copies`
  // (appended, not cleared), which the caller applies to the KV storage before
  // writing. Every block the append fills is registered for prefix sharing.
  // NotFound for an unknown seq; InvalidArgument if a copy is needed and
  // `copies` is null; ResourceExhausted. On any error nothing changed.
  Status append(SeqId seq, std::span<const TokenId> tokens, std::vector<BlockCopy>* copies);
  // Shortens `seq` to its first kept.size() tokens, which `kept` holds (the
  // caller's copy of them): speculative decoding's rollback of rejected draft
  // tokens. Blocks past the new end are released, and a block the cut leaves
  // partial, or any block past it, that was registered for prefix sharing with
  // the tokens cut off is unregistered first (its KV held them). NotFound for
  // an unknown seq; InvalidArgument when kept is longer than the sequence or
  // the cut falls inside a block shared with another sequence. On error
  // nothing changed.
  Status truncate(SeqId seq, std::span<const TokenId> kept);
  // New sequence `child` sharing all of `parent`'s blocks (refcounts +1); needs
  // no free block. NotFound if parent is unknown; InvalidArgument if child exists.
  Status fork(SeqId parent, SeqId child);
  // Releases every block of `seq` (refcount -1; full hashed blocks stay cached
  // for reuse). NotFound naming the seq if unknown.
  Status free(SeqId seq);
  // Like free(), for a sequence whose KV may never have been (fully) written
  // (a cancelled prefill, a failed or timed-out transfer): every block it
  // placed itself (all but those allocate() reused from the cache) that it
  // holds alone is unregistered and goes to the free list instead of the
  // prefix cache, so no later prompt reuses unwritten KV. Blocks it shares stay
  // registered: the caller must also discard the sequences that reused them.
  // NotFound naming the seq if unknown.
  Status discard(SeqId seq);

  bool has(SeqId seq) const;
  int64_t num_tokens(SeqId seq) const;  // 0 for an unknown seq
  // The blocks holding seq's tokens in order; block i holds tokens
  // [i*block_size, (i+1)*block_size). Empty for an unknown seq. The reference
  // is valid until the next call that mutates this manager.
  const std::vector<BlockId>& block_table(SeqId seq) const;
  int32_t ref_count(BlockId b) const;  // 0 for a block id outside the pool
  // Number of full blocks currently registered for prefix sharing.
  int64_t num_cached_blocks() const;
  // The chained hashes of every registered block (what a snapshot reports).
  std::vector<uint64_t> cached_hashes() const;

  // KV events (for the router's prefix index). Off until enabled; while on,
  // every registration and unregistration is recorded, coalesced per hash:
  // what piles up between two take_events() is at most twice the pool's
  // blocks, however long nobody takes it. take_events() returns and clears it.
  void enable_events(bool on);
  KvCacheEvents take_events();

  // Checks every invariant (no block both free and owned, refcounts equal the
  // number of tables holding each block, total conserved, hash map entries
  // point at full blocks whose hash matches). Internal error naming the first
  // violation. O(pool + tokens); for tests.
  Status check_invariants() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pd

template <>
struct std::hash<pd::SeqId> {
  size_t operator()(pd::SeqId s) const noexcept { return std::hash<int64_t>()(s.value); }
};
