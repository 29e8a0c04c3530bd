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

// What one pick() reads of the table: the pools, the policy and the caches.
// A plain view, so the picker depends on the table's data, never on the table.
struct PickView {
  const std::vector<WorkerView>& prefill;
  const std::vector<WorkerView>& decode;
  bool colocated;
  const RoutingPolicy& policy;
  const PrefixIndex& index;
  int block_size;
};

// One pick(): the request against the ranks that can take it now.
class Picker {
 public:
  Picker(const PickView& v, const DispatchRequest& q, int max_inflight)
      : p_(v.policy), index_(v.index), colocated_(v.colocated), bs_(v.block_size), q_(q), n_(q.prompt_tokens),
        need_((q.prompt_tokens + q.max_tokens + v.block_size - 1) / v.block_size),
        use_cache_(p_.cache_aware && !q.block_hashes.empty()) {
    for (const WorkerView& w : v.prefill)
      if (w.state == RankState::kUp && w.outstanding < max_inflight) open_prefill_.push_back(&w);
    for (const WorkerView& w : v.decode)
      if (w.state == RankState::kUp && w.outstanding < max_inflight) open_decode_.push_back(&w);
    prefill_limit_ = limit_of(open_prefill_);
    decode_limit_ = limit_of(open_decode_);
  }

  std::optional<DispatchChoice> run() {
    if (!colocated_ && open_prefill_.empty()) return std::nullopt;
    rank_prefills();
    if (!colocated_)
      if (auto reuse = decode_reuse()) return reuse;
    if (colocated_) prefills_.push_back({nullptr, 0, 0});
    for (const Candidate& p : prefills_) {
      int64_t cached = 0;
      const WorkerView* d = decode_for(p.w, &cached);
      if (!d) continue;
      DispatchChoice c;
      c.prefill_rank = p.w ? p.w->rank : -1;
      c.decode_rank = d->rank;
      c.cached_tokens = p.w ? p.cached : cached;
      c.prefill_work = p.w ? n_ - p.cached : 0;
      c.reason = c.cached_tokens > 0 ? RouteReason::kCacheAware
                 : over_bound_       ? RouteReason::kBalance
                                     : RouteReason::kLeastWork;
      return c;
    }
    return std::nullopt;
  }

 private:
  struct Candidate {
    const WorkerView* w;
    int64_t cached;  // counted for it (0 over the bound)
    double cost;
  };

  // The imbalance bound over `ranks`: balance_ratio x the least outstanding tokens + balance_tokens.
  double limit_of(const std::vector<const WorkerView*>& ranks) const {
    int64_t least = std::numeric_limits<int64_t>::max();
    for (const WorkerView* w : ranks) least = std::min(least, w->outstanding_tokens);
    return p_.balance_ratio * static_cast<double>(least) + static_cast<double>(p_.balance_tokens);
  }
  static bool within(const WorkerView& w, double limit) { return static_cast<double>(w.outstanding_tokens) <= limit; }
  // Tokens of the prompt in `w`'s cache (never the last one: it is computed for its logits),
  // 0 below min_cached_fraction of the prompt.
  int64_t cached_on(const WorkerView& w) const {
    if (!use_cache_) return 0;
    const int64_t cap = n_ > 0 ? (n_ - 1) / bs_ : 0;
    const int64_t cached = std::min(index_.matched_blocks(w.rank, q_.block_hashes), cap) * bs_;
    return static_cast<double>(cached) >= p_.min_cached_fraction * static_cast<double>(n_) ? cached : 0;
  }
  // Free blocks as reported, less what the router committed to the rank since (not in the report yet).
  int64_t free_of(const WorkerView& w) const { return w.load.free_blocks - (w.outstanding_tokens + bs_ - 1) / bs_; }
  // Fewer outstanding requests, then fewer ever sent (ties rotate over idle ranks).
  static bool less_busy(const WorkerView& a, const WorkerView& b) {
    return a.outstanding != b.outstanding ? a.outstanding < b.outstanding : a.dispatched < b.dispatched;
  }

  // The prefill candidates, least expected cost first.
  void rank_prefills() {
    for (const WorkerView* w : open_prefill_) {
      int64_t cached = cached_on(*w);
      if (cached > 0 && !within(*w, prefill_limit_)) {
        over_bound_ = true;
        cached = 0;
      }
      most_cached_ = std::max(most_cached_, cached);
      const double cost =
          static_cast<double>(n_ - cached) + p_.queue_weight * static_cast<double>(w->outstanding_tokens);
      prefills_.push_back({w, cached, cost});
    }
    std::sort(prefills_.begin(), prefills_.end(), [](const Candidate& a, const Candidate& b) {
      if (a.cost != b.cost) return a.cost < b.cost;
      if (a.w->outstanding_tokens != b.w->outstanding_tokens) return a.w->outstanding_tokens < b.w->outstanding_tokens;
      if (a.w->load.waiting != b.w->load.waiting) return a.w->load.waiting < b.w->load.waiting;
      if (a.w->dispatched != b.w->dispatched) return a.w->dispatched < b.w->dispatched;
      return a.w->rank < b.w->rank;
    });
  }

  // A decode rank that holds all but a short suffix of the prompt, and more of it than any
  // prefill rank (what only it holds: the answer it generated), with room and within the
  // bound: it computes the suffix itself. With no more than a prefill rank holds, the prefill
  // pool computes it (a decode rank's steps are its running sequences' time).
  std::optional<DispatchChoice> decode_reuse() const {
    if (!use_cache_ || p_.decode_reuse_tokens <= 0) return std::nullopt;
    int64_t cached = 0;
    const WorkerView* best = reuse_candidate(&cached);
    if (!best) return std::nullopt;
    // A decode rank computes between its running sequences' steps: while it has other
    // follow-ups to compute, an idle prefill rank may answer sooner though it holds less.
    const double reuse_cost = p_.decode_reuse_weight * static_cast<double>(n_ - cached + best->reuse_tokens);
    if (!prefills_.empty() && prefills_.front().cost < reuse_cost) return std::nullopt;
    return DispatchChoice{-1, best->rank, cached, n_ - cached, RouteReason::kDecodeReuse};
  }

  // The decode rank that holds the most of the prompt, all but a short suffix of it,
  // with room and within the bound (nullptr: none); its cached tokens in *cached_out.
  const WorkerView* reuse_candidate(int64_t* cached_out) const {
    const WorkerView* best = nullptr;
    int64_t best_cached = 0;
    for (const WorkerView* w : open_decode_) {
      if (free_of(*w) < need_ || !within(*w, decode_limit_)) continue;
      const int64_t cached = cached_on(*w);
      if (cached == 0 || n_ - cached > p_.decode_reuse_tokens || cached <= most_cached_) continue;
      if (!best || cached > best_cached || (cached == best_cached && less_busy(*w, *best))) {
        best = w;
        best_cached = cached;
      }
    }
    *cached_out = best_cached;
    return best;
  }

  // The decode rank for `prefill` (nullptr: colocated, the decode rank computes the
  // prompt, so its cache counts): among those linked to it with room for the whole
  // request, the least busy; none with room: the one with the most free blocks.
  const WorkerView* decode_for(const WorkerView* prefill, int64_t* cached_out) const {
    const WorkerView* best_fit = nullptr;
    const WorkerView* most_free = nullptr;
    int64_t best_cached = 0;
    for (const WorkerView* w : open_decode_) {
      if (prefill != nullptr && !ranks_linked(*prefill, *w)) continue;
      const int64_t cached = prefill == nullptr && within(*w, decode_limit_) ? cached_on(*w) : 0;
      if (free_of(*w) >= need_ &&
          (!best_fit || cached > best_cached || (cached == best_cached && less_busy(*w, *best_fit)))) {
        best_fit = w;
        best_cached = cached;
      }
      if (!most_free || free_of(*w) > free_of(*most_free)) most_free = w;
    }
    *cached_out = best_fit ? best_cached : 0;
    return best_fit ? best_fit : most_free;
  }

  const RoutingPolicy& p_;
  const PrefixIndex& index_;
  const bool colocated_;
  const int64_t bs_;
  const DispatchRequest& q_;
  const int64_t n_, need_;
  const bool use_cache_;
  std::vector<const WorkerView*> open_prefill_, open_decode_;
  double prefill_limit_ = 0, decode_limit_ = 0;
  std::vector<Candidate> prefills_;
  int64_t most_cached_ = 0;  // by any prefill rank within the bound
  bool over_bound_ = false;  // a prefill rank's cache was passed over for the bound
};

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

std::optional<DispatchChoice> WorkerTable::pick_warm(std::span<const uint64_t> hashes, int64_t n,
                                                     int64_t max_compute) const {
  std::optional<DispatchChoice> best;
  const int64_t cap = n > 0 ? (n - 1) / block_size_ : 0;
  for (const WorkerView& w : prefill_) {
    if (w.state != RankState::kUp || w.outstanding > 0) continue;
    const int64_t cached = std::min(index_.matched_blocks(w.rank, hashes), cap) * block_size_;
    if (cached == 0 || n - cached > max_compute || (best && cached <= best->cached_tokens)) continue;
    best = DispatchChoice{w.rank, -1, cached, n - cached, RouteReason::kCacheAware};
  }
  return best;
}

std::optional<DispatchChoice> WorkerTable::pick(const DispatchRequest& q, int max_inflight) const {
  const PickView view{prefill_, decode_, colocated_, policy_, index_, block_size_};
  return Picker(view, q, max_inflight).run();
}

bool ranks_linked(const WorkerView& a, const WorkerView& b) {
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
    if (std::erase_if(*pool, [rank](const WorkerView& w) { return w.rank == rank; }) > 0 && pool->empty())
      (pool == &prefill_ ? prefill_left_ : decode_left_) = true;
    for (WorkerView& w : *pool) w.links.erase(rank);
  }
}

bool WorkerTable::pool_left() const {
  // Left: its last rank was removed; leaving: every rank it has is draining out.
  auto gone = [](const std::vector<WorkerView>& pool, bool left) {
    if (pool.empty()) return left;
    return std::all_of(pool.begin(), pool.end(), [](const WorkerView& w) { return w.state == RankState::kDraining; });
  };
  return gone(prefill_, prefill_left_) || gone(decode_, decode_left_);
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
    if (c.prefill_rank < 0) d->reuse_tokens += c.prefill_work;
  }
}

void WorkerTable::on_prefill_done(int rank, int64_t prefill_work) {
  WorkerView* w = find(rank);
  if (w == nullptr) return;
  if (!w->is_prefill) {  // a decode reuse's suffix (0 after the rank went down: clamp)
    w->reuse_tokens = std::max<int64_t>(0, w->reuse_tokens - prefill_work);
    return;
  }
  w->outstanding = std::max(0, w->outstanding - 1);
  w->outstanding_tokens = std::max<int64_t>(0, w->outstanding_tokens - prefill_work);
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

void WorkerTable::excuse(std::chrono::steady_clock::duration d) {
  start_ += d;
  for (auto* pool : {&prefill_, &decode_})
    for (WorkerView& w : *pool) {
      w.last_heard += d;
      w.added += d;
    }
}

void WorkerTable::mark_down(int rank) {
  if (WorkerView* w = find(rank); w && w->state != RankState::kDown) {
    w->state = RankState::kDown;
    ++w->times_down;
    index_.purge(rank);
    w->outstanding = 0;  // the router ends or re-runs everything it had there
    w->outstanding_tokens = 0;
    w->reuse_tokens = 0;
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
  auto none_up = [](const char* role, const std::vector<WorkerView>& pool, bool left) {
    const auto draining = std::count_if(pool.begin(), pool.end(), [](const WorkerView& w) { return w.state == RankState::kDraining; });
    if (!pool.empty() && draining == static_cast<std::ptrdiff_t>(pool.size()))
      return std::string("every ") + role + " rank is draining out of the cluster";
    if (draining > 0) return std::string("every ") + role + " rank is down or draining out of the cluster";
    if (!pool.empty()) return std::string("every ") + role + " rank is down";
    return left ? std::string("every ") + role + " rank has left (drained out)"
                : std::string("no ") + role + " rank has joined yet";
  };
  if (!colocated() && up(prefill_) == 0) {
    *why = none_up("prefill", prefill_, prefill_left_);
    return false;
  }
  if (up(decode_) == 0) {
    *why = none_up("decode", decode_, decode_left_);
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
