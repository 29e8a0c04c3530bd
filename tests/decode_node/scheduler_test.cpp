// The decode scheduler: table-driven per iteration (who is preempted, who is
// admitted; TensorRT-LLM's capacitySchedulerTest style), then preemption
// fairness by arrival, alone and over a simulated decode rank.
#include <catch2/catch.hpp>

#include <algorithm>
#include <string>
#include <vector>

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

TEST_CASE("scheduler: the victim is the newest arrival, not the last in the list", "[scheduler]") {
  // Running list in admission order: 1 was preempted earlier, recomputed and
  // appended last by the worker, but it arrived first. The pool is short by
  // one block: 3 (newest arrival) is the victim, not the resumed 1.
  SchedulerInput in;
  in.free_blocks = 2;
  in.max_running = 8;
  in.running = {{2, 1, 1, /*arrival=*/2}, {3, 1, 1, /*arrival=*/3}, {1, 1, 1, /*arrival=*/1}};
  auto plan = schedule_iteration(in);
  CHECK(plan.preempt == std::vector<uint64_t>{3});
  CHECK(plan.free_blocks_after == 1);

  // Several victims come out newest arrival first, whatever the list order.
  in.free_blocks = 0;
  in.running = {{4, 1, 1, 40}, {1, 1, 1, 10}, {3, 1, 1, 30}, {2, 1, 1, 20}};
  plan = schedule_iteration(in);
  CHECK(plan.preempt == std::vector<uint64_t>{4, 3});
  CHECK(plan.free_blocks_after == 0);

  // Preempted by arrival and then not readmitted in the same iteration.
  in.free_blocks = 1;
  in.running = {{5, 1, 2, 50}, {1, 1, 2, 10}};
  in.waiting = {{5, 2, 0, 50}};
  plan = schedule_iteration(in);
  CHECK(plan.preempt == std::vector<uint64_t>{5});
  CHECK(plan.admit.empty());
  CHECK(plan.free_blocks_after == 2);
}

namespace {
// A decode rank in miniature, stepped like DecodeWorker::step(): requests
// arrive with their prompt's KV (they hold its blocks while they wait), join
// ahead of preempted ones, and every admitted sequence is appended to the end
// of the running list; preempted ones lose their blocks and are recomputed.
struct SimSeq {
  uint64_t id;
  int64_t arrive_at;  // iteration its KV lands
  int64_t len;        // tokens so far
  int64_t final_len;  // it finishes on reaching this
  int64_t held = 0;
  bool arrived = false, preempted = false, done = false;
  int preemptions = 0;
};

struct SimResult {
  std::vector<uint64_t> finish_order;
  std::vector<int> preemptions;                // per id
  int unfair = 0;                              // victims chosen while a newer arrival kept running
  bool all_done = false;
  bool free_consistent = true;                 // plan.free_blocks_after matched the pool
};

SimResult simulate(int64_t pool, int64_t block, int max_running, std::vector<SimSeq> seqs, int64_t max_iters) {
  auto blocks_for = [&](int64_t tokens) { return (tokens + block - 1) / block; };
  SimResult res;
  res.preemptions.assign(seqs.size(), 0);
  std::vector<uint64_t> running;  // ids, in the order the worker keeps them
  int64_t free = pool;
  for (int64_t it = 0; it < max_iters; ++it) {
    // KV for new requests lands when its blocks fit, in arrival order.
    for (SimSeq& s : seqs) {
      if (s.arrived || s.arrive_at > it) continue;
      if (blocks_for(s.len) > free) break;
      s.arrived = true;
      s.held = blocks_for(s.len);
      free -= s.held;
    }
    // Waiting: KV holders first, then preempted ones, each oldest first.
    std::vector<uint64_t> waiting;
    for (int pass = 0; pass < 2; ++pass)
      for (const SimSeq& s : seqs)
        if (s.arrived && !s.done && s.preempted == (pass == 1) &&
            std::find(running.begin(), running.end(), s.id) == running.end())
          waiting.push_back(s.id);
    if (running.empty() && waiting.empty()) {
      if (std::all_of(seqs.begin(), seqs.end(), [](const SimSeq& s) { return s.done; })) {
        res.all_done = true;
        break;
      }
      continue;
    }
    SchedulerInput in;
    in.free_blocks = free;
    in.max_running = max_running;
    for (uint64_t id : running) {
      const SimSeq& s = seqs[id];
      in.running.push_back({id, blocks_for(s.len + 1) - blocks_for(s.len), s.held, id});
    }
    for (uint64_t id : waiting) {
      const SimSeq& s = seqs[id];
      in.waiting.push_back({id, blocks_for(s.len + 1) - s.held, s.held, id});
    }
    const auto plan = schedule_iteration(in);
    // Fairness, checked against the input: a victim must be newer than every survivor.
    for (uint64_t p : plan.preempt)
      for (uint64_t r : running)
        if (r > p && std::find(plan.preempt.begin(), plan.preempt.end(), r) == plan.preempt.end()) ++res.unfair;
    for (uint64_t id : plan.preempt) {
      SimSeq& s = seqs[id];
      free += s.held;
      s.held = 0;
      s.preempted = true;
      ++s.preemptions;
      running.erase(std::find(running.begin(), running.end(), id));
    }
    for (uint64_t id : plan.evict) {
      SimSeq& s = seqs[id];
      free += s.held;
      s.held = 0;
      s.preempted = true;
      ++s.preemptions;
    }
    for (uint64_t id : plan.admit) {  // recompute (or join with its KV), appended last
      SimSeq& s = seqs[id];
      free -= blocks_for(s.len) - s.held;
      s.held = blocks_for(s.len);
      s.preempted = false;
      running.push_back(id);
    }
    for (uint64_t id : running) {  // one token each
      SimSeq& s = seqs[id];
      ++s.len;
      free -= blocks_for(s.len) - s.held;
      s.held = blocks_for(s.len);
    }
    if (free != plan.free_blocks_after || free < 0) res.free_consistent = false;
    for (auto itr = running.begin(); itr != running.end();) {
      SimSeq& s = seqs[*itr];
      if (s.len < s.final_len) {
        ++itr;
        continue;
      }
      s.done = true;
      free += s.held;
      s.held = 0;
      res.finish_order.push_back(s.id);
      itr = running.erase(itr);
    }
  }
  for (const SimSeq& s : seqs) res.preemptions[s.id] = s.preemptions;
  return res;
}
}  // namespace

TEST_CASE("scheduler: a resumed request is not preempted again and again", "[scheduler]") {
  // 4-token blocks, a 16-block pool; a request arrives every 6 iterations with
  // an 8-token prompt (2 blocks) and generates 24 tokens (8 blocks at the end).
  // The pool holds two or three at a time, so the rank preempts all the time.
  // Preempting the last of the running list (the old policy) picks the resumed
  // request again and again, because the worker appends it behind newer ones:
  // there request 6 is preempted 7 times and finishes 15th, request 7 19th.
  constexpr int kRequests = 30;
  std::vector<SimSeq> seqs;
  for (int i = 0; i < kRequests; ++i) seqs.push_back({static_cast<uint64_t>(i), 6 * i, 8, 32});
  const SimResult r = simulate(/*pool=*/16, /*block=*/4, /*max_running=*/64, seqs, /*max_iters=*/20000);
  std::string trace = "finish order:";
  for (uint64_t id : r.finish_order) trace += " " + std::to_string(id);
  trace += "; preemptions per request:";
  for (int p : r.preemptions) trace += " " + std::to_string(p);
  INFO(trace);
  REQUIRE(r.all_done);
  REQUIRE(r.finish_order.size() == kRequests);
  CHECK(r.free_consistent);
  // Fair by construction: no victim while a newer arrival keeps running.
  CHECK(r.unfair == 0);
  // Hence no request is recomputed over and over, the oldest is never
  // preempted, and requests finish close to arrival order (admission lets KV
  // that arrived join ahead of preempted ones, so not exactly in it).
  CHECK(*std::max_element(r.preemptions.begin(), r.preemptions.end()) <= 3);
  CHECK(r.preemptions[0] == 0);
  CHECK(r.finish_order.front() == 0);
  int64_t max_late = 0;  // places a request finishes behind its arrival rank
  for (std::size_t pos = 0; pos < r.finish_order.size(); ++pos)
    max_late = std::max(max_late, static_cast<int64_t>(pos) - static_cast<int64_t>(r.finish_order[pos]));
  CHECK(max_late <= 3);
}
