#include "router/dispatch.h"

#include <algorithm>
#include <limits>
#include <string>

namespace pd::router {

const char* rank_state_name(RankState s) {
  switch (s) {
    case RankState::kStarting: return "starting";
    case RankState::kUp: return "up";
    case RankState::kDown: return "down";
    case RankState::kDraining: return "draining";
  }
  return "?";
}

void WorkerTable::set_env(const Env* env) {
  env_ = env;
  start_ = env_->now();
}

WorkerTable::WorkerTable(const std::vector<int>& prefill_ranks, const std::vector<int>& decode_ranks, int block_size)
    : colocated_(prefill_ranks.empty() && !decode_ranks.empty()), block_size_(block_size) {
  for (int r : prefill_ranks) {
    WorkerView w;
    w.rank = r;
    w.is_prefill = true;
    prefill_.push_back(w);
  }
  for (int r : decode_ranks) {
    WorkerView w;
    w.rank = r;
    decode_.push_back(w);
  }
}

namespace {

// A rank's outstanding prompt tokens within the imbalance bound of the least loaded candidate's.
struct Bound {
  double limit = 0;
  bool within(const WorkerView& w) const { return static_cast<double>(w.outstanding_tokens) <= limit; }
};
Bound bound_of(const std::vector<const WorkerView*>& candidates, const RoutingPolicy& p) {
  int64_t least = std::numeric_limits<int64_t>::max();
  for (const WorkerView* w : candidates) least = std::min(least, w->outstanding_tokens);
  return {p.balance_ratio * static_cast<double>(least) + static_cast<double>(p.balance_tokens)};
}

}  // namespace

const char* route_reason_name(RouteReason r) {
  switch (r) {
    case RouteReason::kLeastWork: return "least_work";
    case RouteReason::kCacheAware: return "cache_aware";
    case RouteReason::kBalance: return "balance";
    case RouteReason::kDecodeReuse: return "decode_reuse";
  }
  return "?";
}

std::optional<DispatchChoice> WorkerTable::pick(const DispatchRequest& q, int max_inflight) const {
  const int64_t n = q.prompt_tokens;
  const bool use_cache = policy_.cache_aware && !q.block_hashes.empty();
  // Tokens of the prompt in `w`'s cache (never the last one: it is computed for its logits).
  auto cached_on = [&](const WorkerView& w) -> int64_t {
    if (!use_cache) return 0;
    const int64_t cap = n > 0 ? (n - 1) / block_size_ : 0;
    const int64_t cached = std::min(index_.matched_blocks(w.rank, q.block_hashes), cap) * block_size_;
    return static_cast<double>(cached) >= policy_.min_cached_fraction * static_cast<double>(n) ? cached : 0;
  };
  // Fewer outstanding requests, then fewer ever sent (ties rotate over idle ranks).
  auto less_busy = [](const WorkerView& a, const WorkerView& b) {
    return a.outstanding != b.outstanding ? a.outstanding < b.outstanding : a.dispatched < b.dispatched;
  };
  auto open = [&](const WorkerView& w) { return w.state == RankState::kUp && w.outstanding < max_inflight; };
  const int64_t need = (n + q.max_tokens + block_size_ - 1) / block_size_;
  auto free_of = [&](const WorkerView& w) {
    // Blocks the router has committed since the last report are not in it yet: estimate them.
    return w.load.free_blocks - (w.outstanding_tokens + block_size_ - 1) / block_size_;
  };
  std::vector<const WorkerView*> open_prefill, open_decode;
  for (const WorkerView& w : prefill_)
    if (open(w)) open_prefill.push_back(&w);
  for (const WorkerView& w : decode_)
    if (open(w)) open_decode.push_back(&w);
  if (!colocated_ && open_prefill.empty()) return std::nullopt;
  const Bound prefill_bound = bound_of(open_prefill, policy_);
  const Bound decode_bound = bound_of(open_decode, policy_);

  // Prefill candidates, best first (colocated: one empty candidate).
  struct Candidate {
    const WorkerView* w;
    int64_t cached;  // counted for it (0 over the bound)
    double cost;
  };
  std::vector<Candidate> prefills;
  int64_t most_cached = 0;  // by any prefill rank within the bound
  bool over_bound = false;  // a rank's cache was passed over for the bound
  for (const WorkerView* w : open_prefill) {
    int64_t cached = cached_on(*w);
    if (cached > 0 && !prefill_bound.within(*w)) {
      over_bound = true;
      cached = 0;
    }
    most_cached = std::max(most_cached, cached);
    prefills.push_back({w, cached, static_cast<double>(n - cached) + policy_.queue_weight * static_cast<double>(w->outstanding_tokens)});
  }
  std::sort(prefills.begin(), prefills.end(), [](const Candidate& a, const Candidate& b) {
    if (a.cost != b.cost) return a.cost < b.cost;
    if (a.w->outstanding_tokens != b.w->outstanding_tokens) return a.w->outstanding_tokens < b.w->outstanding_tokens;
    if (a.w->load.waiting != b.w->load.waiting) return a.w->load.waiting < b.w->load.waiting;
    if (a.w->dispatched != b.w->dispatched) return a.w->dispatched < b.w->dispatched;
    return a.w->rank < b.w->rank;
  });

  // A decode rank that holds all but a short suffix computes it itself.
  if (use_cache && !colocated_ && policy_.decode_reuse_tokens > 0) {
    const WorkerView* reuse = nullptr;
    int64_t reuse_cached = 0;
    for (const WorkerView* w : open_decode) {
      if (free_of(*w) < need || !decode_bound.within(*w)) continue;
      const int64_t cached = cached_on(*w);
      if (cached == 0 || n - cached > policy_.decode_reuse_tokens || cached < most_cached) continue;
      if (!reuse || cached > reuse_cached || (cached == reuse_cached && less_busy(*w, *reuse))) {
        reuse = w;
        reuse_cached = cached;
      }
    }
    if (reuse) return DispatchChoice{-1, reuse->rank, reuse_cached, 0, RouteReason::kDecodeReuse};
  }

  if (colocated_) prefills.push_back({nullptr, 0, 0});
  for (const Candidate& p : prefills) {
    const WorkerView* best_fit = nullptr;
    const WorkerView* most_free = nullptr;
    int64_t best_cached = 0;
    for (const WorkerView* w : open_decode) {
      if (p.w != nullptr && !linked(*p.w, *w)) continue;
      // Colocated: the decode rank computes the prompt, so its cache counts (within the bound).
      const int64_t cached = p.w == nullptr && decode_bound.within(*w) ? cached_on(*w) : 0;
      if (free_of(*w) >= need &&
          (!best_fit || cached > best_cached || (cached == best_cached && less_busy(*w, *best_fit)))) {
        best_fit = w;
        best_cached = cached;
      }
      if (!most_free || free_of(*w) > free_of(*most_free)) most_free = w;
    }
    const WorkerView* d = best_fit ? best_fit : most_free;
    if (!d) continue;
    DispatchChoice c;
    c.prefill_rank = p.w ? p.w->rank : -1;
    c.decode_rank = d->rank;
    c.cached_tokens = p.w ? p.cached : best_fit ? best_cached : 0;
    c.prefill_work = p.w ? n - p.cached : 0;
    c.reason = c.cached_tokens > 0 ? RouteReason::kCacheAware : over_bound ? RouteReason::kBalance : RouteReason::kLeastWork;
    return c;
  }
  return std::nullopt;
}

bool WorkerTable::linked(const WorkerView& a, const WorkerView& b) const {
  if (!a.joined && !b.joined) return true;
  if (a.joined && b.joined && a.pool == b.pool) return true;
  return a.links.count(b.rank) > 0 || b.links.count(a.rank) > 0;
}

WorkerView& WorkerTable::add(int rank, bool is_prefill, const std::string& pool) {
  WorkerView w;
  w.rank = rank;
  w.is_prefill = is_prefill;
  w.joined = true;
  w.pool = pool;
  w.added = env_->now();
  auto& list = is_prefill ? prefill_ : decode_;
  list.push_back(std::move(w));
  return list.back();
}

void WorkerTable::link(int a, int b) {
  if (WorkerView* w = find(a)) w->links.insert(b);
  if (WorkerView* w = find(b)) w->links.insert(a);
}

bool WorkerTable::begin_drain(int rank) {
  WorkerView* w = find(rank);
  if (w == nullptr || (w->state != RankState::kUp && w->state != RankState::kStarting)) return false;
  w->state = RankState::kDraining;
  w->drain_started = env_->now();
  return true;
}

void WorkerTable::remove(int rank) {
  index_.purge(rank);
  for (auto* pool : {&prefill_, &decode_}) {
    std::erase_if(*pool, [rank](const WorkerView& w) { return w.rank == rank; });
    for (WorkerView& w : *pool) w.links.erase(rank);
  }
}

const WorkerView* WorkerTable::find(int rank) const { return const_cast<WorkerTable*>(this)->find(rank); }

WorkerView* WorkerTable::find(int rank) {
  for (WorkerView& w : prefill_)
    if (w.rank == rank) return &w;
  for (WorkerView& w : decode_)
    if (w.rank == rank) return &w;
  return nullptr;
}

void WorkerTable::on_dispatch(const DispatchChoice& c, int64_t prompt_tokens, int64_t max_tokens) {
  if (WorkerView* p = find(c.prefill_rank)) {
    ++p->outstanding;
    ++p->dispatched;
    p->outstanding_tokens += c.prefill_work;
  }
  if (WorkerView* d = find(c.decode_rank)) {
    ++d->outstanding;
    ++d->dispatched;
    d->outstanding_tokens += prompt_tokens + max_tokens;
  }
}

void WorkerTable::on_prefill_done(int rank, int64_t prefill_work) {
  if (WorkerView* p = find(rank); p && p->is_prefill) {  // 0 after the rank went down: clamp
    p->outstanding = std::max(0, p->outstanding - 1);
    p->outstanding_tokens = std::max<int64_t>(0, p->outstanding_tokens - prefill_work);
  }
}

void WorkerTable::on_request_done(int rank, int64_t prompt_tokens, int64_t max_tokens) {
  if (WorkerView* d = find(rank); d && !d->is_prefill) {
    d->outstanding = std::max(0, d->outstanding - 1);
    d->outstanding_tokens = std::max<int64_t>(0, d->outstanding_tokens - (prompt_tokens + max_tokens));
  }
}

void WorkerTable::on_report(int rank, const proto::LoadReport& r) {
  if (WorkerView* w = find(rank)) {
    if (w->state == RankState::kDown) return;  // re-admission is the router's call (mark_up)
    w->load = r;
    w->reported = true;
    w->last_report = w->last_heard = env_->now();
    if (w->state == RankState::kStarting && r.ready) w->state = RankState::kUp;
  }
}

void WorkerTable::on_kv_events(int rank, const proto::KvEvents& e) {
  const WorkerView* w = find(rank);
  if (w == nullptr || w->state == RankState::kDown || e.epoch != w->epoch) return;
  index_.apply(rank, e);
}

void WorkerTable::heard(int rank) {
  if (WorkerView* w = find(rank); w && w->state != RankState::kDown) w->last_heard = env_->now();
}

std::vector<int> WorkerTable::expire(std::chrono::milliseconds heartbeat, std::chrono::milliseconds startup) {
  const auto now = env_->now();
  std::vector<int> down;
  for (auto* pool : {&prefill_, &decode_}) {
    for (WorkerView& w : *pool) {
      const bool silent = (w.state == RankState::kUp || (w.state == RankState::kDraining && w.reported)) &&
                          now - w.last_heard > heartbeat;
      const bool never = w.state == RankState::kStarting && now - (w.joined ? w.added : start_) > startup;
      if (silent || never) {
        mark_down(w.rank);
        down.push_back(w.rank);
      }
    }
  }
  return down;
}

void WorkerTable::mark_down(int rank) {
  if (WorkerView* w = find(rank); w && w->state != RankState::kDown) {
    w->state = RankState::kDown;
    ++w->times_down;
    index_.purge(rank);
    w->outstanding = 0;  // the router ends or re-runs everything it had there
    w->outstanding_tokens = 0;
  }
}

void WorkerTable::mark_up(int rank, proto::Epoch epoch) {
  if (WorkerView* w = find(rank); w && w->state == RankState::kDown) {
    w->state = RankState::kUp;
    w->epoch = epoch;
    index_.purge(rank);  // what it held under the old epoch is not trusted
    w->last_heard = w->last_report = env_->now();
  }
}

bool WorkerTable::ready(std::string* why) const {
  auto up = [](const std::vector<WorkerView>& pool) {
    int n = 0;
    for (const WorkerView& w : pool) n += w.state == RankState::kUp;
    return n;
  };
  for (const auto* pool : {&prefill_, &decode_}) {
    for (const WorkerView& w : *pool) {
      if (w.state == RankState::kStarting && !w.joined) {
        *why = std::string(w.is_prefill ? "prefill" : "decode") + " rank " + std::to_string(w.rank) +
               " has not reported ready";
        return false;
      }
    }
  }
  if (!colocated() && up(prefill_) == 0) {
    *why = prefill_.empty() ? "no prefill rank has joined yet" : "every prefill rank is down";
    return false;
  }
  if (up(decode_) == 0) {
    *why = decode_.empty() ? "no decode rank has joined yet" : "every decode rank is down";
    return false;
  }
  return true;
}

bool WorkerTable::degraded() const {
  for (const auto* pool : {&prefill_, &decode_})
    for (const WorkerView& w : *pool)
      if (w.state == RankState::kDown) return true;
  return false;
}

}  // namespace pd::router
