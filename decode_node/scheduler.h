// The decode scheduler: who runs each iteration. Pure policy over numbers the
// KV block manager answers; knows nothing of MPI, HTTP or the model.
//
// Each iteration (continuous batching at iteration level):
//  1. Capacity: every running sequence needs room for its next token. While the
//     free blocks cannot cover all of them, preempt the running sequence that
//     arrived last (Running::arrival; its blocks return to the pool; it will be
//     recomputed), whatever its place in the running list. A resumed (once
//     preempted, recomputed) sequence keeps its arrival order even though the
//     caller appends it to the end of its running list, so it is not the next
//     victim unless it is the newest: preemption order is fair by construction
//     and cannot starve one request (vLLM/SGLang preempt by arrival/priority).
//     Equal arrivals (e.g. all left at 0) fall back to list order, last first.
//  2. Admission: waiting sequences, in the caller's order (the decode worker
//     lists sequences whose KV arrived, then preempted ones oldest first, then
//     prompts it prefills itself), join while the batch is below max_running and their
//     blocks fit in what step 1 left. No overtaking: the first that does not
//     fit stops admission, so a large request is not starved by small ones.
//     A sequence preempted in step 1 is not readmitted in the same iteration.
//  3. Deadlock breaker: if nothing would run and nothing was admitted while
//     sequences wait, the newest waiting sequence that holds blocks (KV that
//     arrived but could not join) is evicted: its blocks are freed and it is
//     recomputed later. A pool full of stalled holders can then never wedge,
//     as long as any one sequence fits the pool alone (the caller ensures it).
//  4. The step runs every running sequence that was not preempted, plus the
//     admitted ones.
#pragma once

#include <cstdint>
#include <vector>

namespace pd {

struct SchedulerInput {
  int64_t free_blocks = 0;
  int max_running = 1;
  struct Running {
    uint64_t id;
    int64_t blocks_for_next;  // blocks it needs to append its next token (0 or 1 usually)
    int64_t blocks_held;      // blocks freed if it is preempted
    uint64_t arrival = 0;     // arrival order at this rank: smaller = older, unique;
                              // kept across preemption and recompute
  };
  std::vector<Running> running;  // any order (step 1 goes by arrival)
  struct Waiting {
    uint64_t id;
    int64_t blocks_to_admit;  // blocks it needs to join and take its first step
    int64_t blocks_held = 0;  // blocks it already holds (freed if it is evicted)
    uint64_t arrival = 0;     // arrival order (informational: admission follows list order)
  };
  std::vector<Waiting> waiting;  // in the order they may be admitted
};

struct SchedulerPlan {
  std::vector<uint64_t> preempt;  // newest arrival first
  std::vector<uint64_t> admit;    // in admission order
  std::vector<uint64_t> evict;    // waiting sequences whose blocks are freed (step 3)
  int64_t free_blocks_after = 0;  // free blocks once all of it is done
};

SchedulerPlan schedule_iteration(const SchedulerInput& in);

}  // namespace pd
