// The decode scheduler, table-driven: per iteration, who is preempted and who
// is admitted (TensorRT-LLM's capacitySchedulerTest style).
#include <catch2/catch.hpp>

#include "decode_node/scheduler.h"

using pd::SchedulerInput;
using pd::schedule_iteration;

namespace {
struct Row {
  const char* what;
  int64_t free_blocks;
  int max_running;
  std::vector<SchedulerInput::Running> running;
  std::vector<SchedulerInput::Waiting> waiting;
  std::vector<uint64_t> preempt;
  std::vector<uint64_t> admit;
  int64_t free_after;
  std::vector<uint64_t> evict = {};
};
}  // namespace

TEST_CASE("scheduler: preemption and admission per iteration", "[scheduler]") {
  const std::vector<Row> table{
      {"everyone fits: all run, waiting admitted in order", 10, 8, {{1, 1, 3}, {2, 0, 2}}, {{3, 2}, {4, 3}}, {}, {3, 4}, 4},
      {"max_running caps admission", 100, 3, {{1, 0, 1}, {2, 0, 1}}, {{3, 1}, {4, 1}}, {}, {3}, 99},
      {"no overtaking: a big waiter blocks the small one behind it", 3, 8, {}, {{1, 5}, {2, 1}}, {}, {}, 3},
      {"pool short by one: the newest running sequence is preempted", 1, 8, {{1, 1, 4}, {2, 1, 4}, {3, 1, 4}}, {}, {3}, {}, 3},
      {"preempt several, newest first, until the rest fit", 0, 8, {{1, 1, 1}, {2, 1, 1}, {3, 1, 1}}, {}, {3, 2}, {}, 1},
      {"a sequence preempted this iteration is not readmitted in it", 0, 8, {{1, 1, 1}, {2, 1, 1}}, {{2, 1}}, {2}, {}, 0},
      {"freed blocks go to older waiters after preemption", 0, 8, {{1, 1, 8}, {2, 1, 8}}, {{9, 2}}, {2}, {9}, 5},
      {"nothing running, nothing waiting", 5, 8, {}, {}, {}, {}, 5},
      {"a lone sequence that cannot grow is preempted (caller keeps it feasible)", 0, 8, {{1, 1, 6}}, {}, {1}, {}, 6},
      {"stalled holders, nothing running: the newest holder is evicted", 0, 8, {}, {{1, 1, 3}, {2, 1, 2}, {3, 4, 0}},
       {}, {}, 2, {2}},
      {"holders that fit are admitted, nothing evicted", 2, 8, {}, {{1, 1, 3}, {2, 1, 2}}, {}, {1, 2}, 0, {}},
  };
  for (const Row& r : table) {
    SchedulerInput in;
    in.free_blocks = r.free_blocks;
    in.max_running = r.max_running;
    in.running = r.running;
    in.waiting = r.waiting;
    const auto plan = schedule_iteration(in);
    INFO(r.what);
    CHECK(plan.preempt == r.preempt);
    CHECK(plan.admit == r.admit);
    CHECK(plan.free_blocks_after == r.free_after);
    CHECK(plan.evict == r.evict);
  }
}
