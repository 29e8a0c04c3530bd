#include "router/dispatch.h"

#include <string>

namespace pd::router {

WorkerTable::WorkerTable(const std::vector<int>& prefill_ranks, const std::vector<int>& decode_ranks, int block_size)
    : block_size_(block_size) {
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
  DispatchChoice c;
  if (!prefill_.empty()) {
    const WorkerView* best = nullptr;
    for (const WorkerView& w : prefill_) {
      if (w.outstanding >= max_inflight) continue;
      if (!best || w.outstanding_tokens < best->outstanding_tokens ||
          (w.outstanding_tokens == best->outstanding_tokens && w.load.waiting < best->load.waiting))
        best = &w;
    }
    if (!best) return std::nullopt;
    c.prefill_rank = best->rank;
  }
  const int64_t need = (prompt_tokens + max_tokens + block_size_ - 1) / block_size_;
  const WorkerView* best_fit = nullptr;
  const WorkerView* most_free = nullptr;
  auto free_of = [&](const WorkerView& w) {
    // Blocks the router has committed since the last report are not in it yet: estimate them.
    return w.load.free_blocks - (w.outstanding_tokens + block_size_ - 1) / block_size_;
  };
  for (const WorkerView& w : decode_) {
    if (w.outstanding >= max_inflight) continue;
    if (free_of(w) >= need && (!best_fit || w.outstanding < best_fit->outstanding)) best_fit = &w;
    if (!most_free || free_of(w) > free_of(*most_free)) most_free = &w;
  }
  const WorkerView* d = best_fit ? best_fit : most_free;
  if (!d) return std::nullopt;
  c.decode_rank = d->rank;
  return c;
}

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
  if (WorkerView* p = find(rank); p && p->is_prefill) {
    --p->outstanding;
    p->outstanding_tokens -= prompt_tokens;
  }
}

void WorkerTable::on_request_done(int rank, int64_t prompt_tokens, int64_t max_tokens) {
  if (WorkerView* d = find(rank); d && !d->is_prefill) {
    --d->outstanding;
    d->outstanding_tokens -= prompt_tokens + max_tokens;
  }
}

void WorkerTable::on_report(int rank, const proto::LoadReport& r) {
  if (WorkerView* w = find(rank)) {
    w->load = r;
    w->reported = true;
    w->last_report = std::chrono::steady_clock::now();
  }
}

bool WorkerTable::ready(std::chrono::milliseconds stale, std::string* why) const {
  const auto now = std::chrono::steady_clock::now();
  for (const auto* pool : {&prefill_, &decode_}) {
    for (const WorkerView& w : *pool) {
      const char* kind = w.is_prefill ? "prefill" : "decode";
      if (!w.reported || !w.load.ready) {
        *why = std::string(kind) + " rank " + std::to_string(w.rank) + " has not reported ready";
        return false;
      }
      if (now - w.last_report > stale) {
        *why = std::string(kind) + " rank " + std::to_string(w.rank) + " has not reported for " +
               std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(now - w.last_report).count()) +
               " ms";
        return false;
      }
    }
  }
  return true;
}

}  // namespace pd::router
