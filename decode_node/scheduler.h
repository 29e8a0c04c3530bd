// The decode scheduler: who runs each iteration. Pure policy over numbers the
// KV block manager answers; knows nothing of MPI, HTTP or the model.
//
// Each iteration (continuous batching at iteration level):
//  1. Capacity: every running sequence needs room for its next token. While the
//     free blocks cannot cover all of them, preempt the most recently admitted
//     running sequence (its blocks return to the pool; it will be recomputed).
//  2. Admission: waiting sequences, in order (the caller lists preempted ones
//     first, oldest first), join while the batch is below max_running and their
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
  };
  std::vector<Running> running;  // in admission order, oldest first
  struct Waiting {
    uint64_t id;
    int64_t blocks_to_admit;  // blocks it needs to join and take its first step
    int64_t blocks_held = 0;  // blocks it already holds (freed if it is evicted)
  };
  std::vector<Waiting> waiting;  // in the order they may be admitted
};

struct SchedulerPlan {
  std::vector<uint64_t> preempt;  // newest first
  std::vector<uint64_t> admit;    // in admission order
  std::vector<uint64_t> evict;    // waiting sequences whose blocks are freed (step 3)
  int64_t free_blocks_after = 0;  // free blocks once all of it is done
};

SchedulerPlan schedule_iteration(const SchedulerInput& in);

}  // namespace pd
