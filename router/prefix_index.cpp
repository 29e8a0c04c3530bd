#include "router/prefix_index.h"

#include <spdlog/spdlog.h>

#include "kv/kv_block_manager.h"

namespace pd::router {

void PrefixIndex::apply(int rank, const proto::KvEvents& e) {
  if (e.reset) purge(rank);
  if (e.stored.empty() && e.removed.empty()) return;
  std::unordered_set<uint64_t>& held = held_[rank];
  for (uint64_t h : e.removed) total_ -= held.erase(h);
  for (uint64_t h : e.stored) {
    if (held.size() >= kMaxBlocksPerRank) {
      if (overflows_++ == 0) {
        spdlog::error("router: rank {} reports more than {} cached blocks; ignoring the rest", rank, held.size());
      }
      break;
    }
    total_ += held.insert(h).second ? 1 : 0;
  }
}

void PrefixIndex::purge(int rank) {
  auto it = held_.find(rank);
  if (it == held_.end()) return;
  total_ -= it->second.size();
  held_.erase(it);
}

int64_t PrefixIndex::matched_blocks(int rank, std::span<const uint64_t> chain) const {
  auto it = held_.find(rank);
  if (it == held_.end()) return 0;
  int64_t m = 0;
  for (uint64_t h : chain) {
    if (!it->second.count(h)) break;
    ++m;
  }
  return m;
}

size_t PrefixIndex::blocks(int rank) const {
  auto it = held_.find(rank);
  return it == held_.end() ? 0 : it->second.size();
}

std::vector<uint64_t> prompt_block_hashes(std::span<const int32_t> tokens, int block_size) {
  std::vector<uint64_t> out;
  if (block_size <= 0) return out;
  const size_t bs = static_cast<size_t>(block_size);
  out.reserve(tokens.size() / bs);
  uint64_t parent = kKvRootBlockHash;
  for (size_t k = 0; (k + 1) * bs <= tokens.size(); ++k) {
    parent = kv_block_hash(parent, tokens.subspan(k * bs, bs));
    out.push_back(parent);
  }
  return out;
}

}  // namespace pd::router
