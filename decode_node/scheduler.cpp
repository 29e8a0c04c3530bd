#include "decode_node/scheduler.h"

#include <algorithm>
#include <cstddef>
#include <numeric>
#include <vector>

namespace pd {

SchedulerPlan schedule_iteration(const SchedulerInput& in) {
  SchedulerPlan plan;
  int64_t free = in.free_blocks;
  int64_t need = 0;
  for (const auto& r : in.running) need += r.blocks_for_next;
  // 1. Capacity: preempt the newest arrival first until the survivors' next
  // tokens fit. Victims go by (arrival, position in the list), newest first, so
  // a resumed sequence the caller appended last keeps its original turn; with
  // all-zero arrivals this is the list order, newest last.
  std::size_t n_running = in.running.size();
  if (need > free) {
    std::vector<std::size_t> order(in.running.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      const uint64_t aa = in.running[a].arrival, ab = in.running[b].arrival;
      return aa != ab ? aa > ab : a > b;
    });
    for (std::size_t i = 0; i < order.size() && need > free; ++i) {
      const auto& victim = in.running[order[i]];
      plan.preempt.push_back(victim.id);
      need -= victim.blocks_for_next;
      free += victim.blocks_held;
      --n_running;
    }
  }
  free -= need;
  // 2. Admission, in order, no overtaking.
  int slots = in.max_running - static_cast<int>(n_running);
  for (const auto& w : in.waiting) {
    if (slots <= 0 || w.blocks_to_admit > free) break;
    bool preempted_now = false;
    for (uint64_t p : plan.preempt) preempted_now |= p == w.id;
    if (preempted_now) break;
    plan.admit.push_back(w.id);
    free -= w.blocks_to_admit;
    --slots;
  }
  // 3. Deadlock breaker.
  if (n_running == 0 && plan.admit.empty()) {
    for (auto it = in.waiting.rbegin(); it != in.waiting.rend(); ++it) {
      if (it->blocks_held > 0) {
        plan.evict.push_back(it->id);
        free += it->blocks_held;
        break;
      }
    }
  }
  plan.free_blocks_after = free;
  return plan;
}

}  // namespace pd
