#include "router/dispatch.h"

#include <algorithm>
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

std::optional<DispatchChoice> WorkerTable::pick(int64_t prompt_tokens, int64_t max_tokens, int max_inflight) const {
  // Prefill candidates, best first (colocated: one empty candidate).
  std::vector<const WorkerView*> prefills;
  for (const WorkerView& w : prefill_)
    if (w.state == RankState::kUp && w.outstanding < max_inflight) prefills.push_back(&w);
  std::sort(prefills.begin(), prefills.end(), [](const WorkerView* a, const WorkerView* b) {
    if (a->outstanding_tokens != b->outstanding_tokens) return a->outstanding_tokens < b->outstanding_tokens;
    if (a->load.waiting != b->load.waiting) return a->load.waiting < b->load.waiting;
    return a->rank < b->rank;
  });
  if (!colocated_ && prefills.empty()) return std::nullopt;
  if (colocated_) prefills.push_back(nullptr);
  const int64_t need = (prompt_tokens + max_tokens + block_size_ - 1) / block_size_;
  auto free_of = [&](const WorkerView& w) {
    // Blocks the router has committed since the last report are not in it yet: estimate them.
    return w.load.free_blocks - (w.outstanding_tokens + block_size_ - 1) / block_size_;
  };
  for (const WorkerView* p : prefills) {
    const WorkerView* best_fit = nullptr;
    const WorkerView* most_free = nullptr;
    for (const WorkerView& w : decode_) {
      if (w.state != RankState::kUp || w.outstanding >= max_inflight) continue;
      if (p != nullptr && !linked(*p, w)) continue;
      if (free_of(w) >= need && (!best_fit || w.outstanding < best_fit->outstanding)) best_fit = &w;
      if (!most_free || free_of(w) > free_of(*most_free)) most_free = &w;
    }
    const WorkerView* d = best_fit ? best_fit : most_free;
    if (!d) continue;
    DispatchChoice c;
    c.prefill_rank = p ? p->rank : -1;
    c.decode_rank = d->rank;
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
    p->outstanding_tokens += prompt_tokens;
  }
  if (WorkerView* d = find(c.decode_rank)) {
    ++d->outstanding;
    d->outstanding_tokens += prompt_tokens + max_tokens;
  }
}

void WorkerTable::on_prefill_done(int rank, int64_t prompt_tokens) {
  if (WorkerView* p = find(rank); p && p->is_prefill) {  // 0 after the rank went down: clamp
    p->outstanding = std::max(0, p->outstanding - 1);
    p->outstanding_tokens = std::max<int64_t>(0, p->outstanding_tokens - prompt_tokens);
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
    w->outstanding = 0;  // the router ends or re-runs everything it had there
    w->outstanding_tokens = 0;
  }
}

void WorkerTable::mark_up(int rank, proto::Epoch epoch) {
  if (WorkerView* w = find(rank); w && w->state == RankState::kDown) {
    w->state = RankState::kUp;
    w->epoch = epoch;
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
