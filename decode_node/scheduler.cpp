#include "decode_node/scheduler.h"

#include <cstddef>

namespace pd {

SchedulerPlan schedule_iteration(const SchedulerInput& in) {
  SchedulerPlan plan;
  int64_t free = in.free_blocks;
  int64_t need = 0;
  for (const auto& r : in.running) need += r.blocks_for_next;
  // 1. Capacity: preempt newest-first until the survivors' next tokens fit.
  std::size_t n_running = in.running.size();
  while (need > free && n_running > 0) {
    const auto& victim = in.running[n_running - 1];
    plan.preempt.push_back(victim.id);
    need -= victim.blocks_for_next;
    free += victim.blocks_held;
    --n_running;
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
