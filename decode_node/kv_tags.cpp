#include "decode_node/kv_tags.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "util/lifecycle.h"

namespace pd {

const char* state_name(KvTagPool::TagState s) {
  using S = KvTagPool::TagState;
  switch (s) {
    case S::kFree: return "free";
    case S::kHeld: return "held";
    case S::kUnsealed: return "unsealed";
    case S::kSealing: return "sealing";
    case S::kRetired: return "retired";
  }
  return "?";
}

bool legal(KvTagPool::TagState from, KvTagPool::TagState to) {
  using S = KvTagPool::TagState;
  switch (from) {
    case S::kFree: return to == S::kHeld;
    case S::kHeld: return to == S::kFree || to == S::kUnsealed || to == S::kRetired;
    case S::kUnsealed: return to == S::kSealing || to == S::kRetired;
    case S::kSealing: return to == S::kFree || to == S::kRetired;
    case S::kRetired: return false;
  }
  return false;
}

void KvTagPool::set(int tag, Entry& e, TagState to) {
  const TagState from = e.state;
  if (!transition(e.state, to, static_cast<uint64_t>(tag), "kv tag")) return;
  if (from != TagState::kFree) --counts_[static_cast<size_t>(from)];
  if (to != TagState::kFree) ++counts_[static_cast<size_t>(to)];
  else tags_.erase(tag);  // `e` is gone
}

KvTagPool::TagState KvTagPool::state(int tag) const {
  const auto it = tags_.find(tag);
  return it == tags_.end() ? TagState::kFree : it->second.state;
}

std::optional<int> KvTagPool::acquire() {
  for (int i = 0; i < span_; ++i) {
    const int tag = first_ + next_;
    next_ = (next_ + 1) % span_;
    if (tags_.count(tag)) continue;
    Entry& e = tags_[tag];
    set(tag, e, TagState::kHeld);
    return tag;
  }
  return std::nullopt;
}

void KvTagPool::release(int tag) {
  auto it = tags_.find(tag);
  if (it != tags_.end()) set(tag, it->second, TagState::kFree);
}

void KvTagPool::reclaim(int tag, proto::RequestId id, TimePoint now) {
  auto it = tags_.find(tag);
  if (it == tags_.end()) return;
  it->second.id = id;
  it->second.since = now;
  set(tag, it->second, TagState::kUnsealed);
}

std::vector<KvTagPool::Unsealed> KvTagPool::unsealed() const {
  if (count(TagState::kUnsealed) == 0) return {};  // the common case: no walk over the retired ones
  std::vector<std::pair<TimePoint, Unsealed>> found;
  for (const auto& [tag, e] : tags_)
    if (e.state == TagState::kUnsealed) found.push_back({e.since, Unsealed{tag, e.id}});
  std::stable_sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<Unsealed> out;
  for (const auto& [since, u] : found) out.push_back(u);
  return out;
}

void KvTagPool::sealing(int tag, TransferOp op) {
  auto it = tags_.find(tag);
  if (it == tags_.end()) return;
  it->second.op = op;
  set(tag, it->second, TagState::kSealing);
}

bool KvTagPool::poll(Transport& t, TimePoint now, std::chrono::milliseconds limit) {
  if (reclaiming() == 0) return false;
  bool changed = false;
  std::vector<std::pair<int, TagState>> ended;
  for (auto& [tag, e] : tags_) {
    if (e.state == TagState::kUnsealed && now - e.since > limit) {
      ended.push_back({tag, TagState::kRetired});  // never asked (no link to the peer?)
      continue;
    }
    if (e.state != TagState::kSealing || !e.op) continue;
    Result<OpState> r = t.test(*e.op);
    if (r.is_ok() && *r == OpState::kPending) {
      if (now - e.since > limit && !e.cancelled) {
        e.cancelled = true;
        t.cancel(*e.op);
      }
      continue;
    }
    e.op.reset();
    const bool sealed = r.is_ok() && *r == OpState::kDone;
    if (!sealed)
      spdlog::warn("KV tag {}: its reclaim ended without the peer's seal ({}): retired", tag,
                   r.is_ok() ? (e.cancelled ? "past its limit" : "cancelled") : r.status().to_string());
    ended.push_back({tag, sealed ? TagState::kFree : TagState::kRetired});
  }
  for (auto& [tag, to] : ended) {
    auto it = tags_.find(tag);
    set(tag, it->second, to);
    changed = true;
  }
  return changed;
}

void KvTagPool::retire(int tag, Transport& t) {
  auto it = tags_.find(tag);
  if (it == tags_.end()) return;
  if (it->second.op) t.abandon(*it->second.op);
  it->second.op.reset();
  set(tag, it->second, TagState::kRetired);
}

void KvTagPool::retire_unsealed(Transport& t) {
  if (reclaiming() == 0) return;
  std::vector<int> ids;
  for (const auto& [tag, e] : tags_)
    if (e.state == TagState::kUnsealed || e.state == TagState::kSealing) ids.push_back(tag);
  for (int tag : ids) retire(tag, t);
}

void KvTagPool::cancel_reclaims(Transport& t) {
  if (count(TagState::kSealing) == 0) return;
  for (auto& [tag, e] : tags_)
    if (e.op && !e.cancelled) {
      e.cancelled = true;
      t.cancel(*e.op);
    }
}

}  // namespace pd
