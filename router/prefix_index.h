// The router's prefix index: which worker rank holds which prefix blocks in
// its prefix cache, from the ranks' own KV events (KvEvents). A block is named
// by the chained hash the ranks' block managers use (kv_block_hash over the
// block's tokens, seeded with the hash of the block before), so the hash of a
// prompt's k-th full block names the whole prefix up to it, and a rank holds
// a prompt's first m blocks when it reports those m hashes.
//
// The index says what a rank reported, a moment ago: a block may have been
// evicted since (the rank then computes it; nothing is wrong, only slower).
// An entry is purged when its rank goes down, rejoins (it sends its whole set
// again under the new epoch) or leaves. Bounded: at most kMaxBlocksPerRank
// hashes per rank (a rank's pool is far smaller; more is a bug, logged).
// Link thread only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "protocol/messages.h"

namespace pd::router {

class PrefixIndex {
 public:
  static constexpr size_t kMaxBlocksPerRank = size_t{1} << 22;

  // A rank's events, in the order it sent them (reset: replaces its entry).
  void apply(int rank, const proto::KvEvents& e);
  void purge(int rank);
  // How many leading hashes of `chain` (a prompt's, prompt_block_hashes) `rank` holds.
  int64_t matched_blocks(int rank, std::span<const uint64_t> chain) const;
  size_t blocks(int rank) const;
  size_t blocks() const { return total_; }

 private:
  std::unordered_map<int, std::unordered_set<uint64_t>> held_;
  size_t total_ = 0;
  uint64_t overflows_ = 0;  // events cut at kMaxBlocksPerRank (the first one is logged)
};

// The chained hashes of the full blocks of `tokens` (block k covers tokens
// [k*block_size, (k+1)*block_size)), as the ranks' prefix caches name them.
std::vector<uint64_t> prompt_block_hashes(std::span<const int32_t> tokens, int block_size);

}  // namespace pd::router
