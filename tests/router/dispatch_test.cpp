// The router's dispatch policy over its worker table.
#include <catch2/catch.hpp>

#include "router/dispatch.h"

#include <thread>

using pd::router::WorkerTable;

namespace {
pd::proto::LoadReport report(int64_t free_blocks, int waiting = 0) {
  pd::proto::LoadReport r;
  r.free_blocks = free_blocks;
  r.total_blocks = 1000;
  r.waiting = waiting;
  r.ready = true;
  return r;
}
}  // namespace

TEST_CASE("dispatch: least outstanding prefill work; decode with room for the request", "[router]") {
  WorkerTable t({1, 2}, {3, 4}, 16);
  t.on_report(1, report(100));
  t.on_report(2, report(100));
  t.on_report(3, report(10));   // 160 tokens of room
  t.on_report(4, report(500));
  auto c = t.pick(/*prompt*/ 100, /*max_tokens*/ 100, 8);
  REQUIRE(c);
  CHECK(c->decode_rank == 4);  // rank 3 cannot hold 200 tokens
  t.on_dispatch(*c, 100, 100);
  auto c2 = t.pick(10, 10, 8);
  REQUIRE(c2);
  CHECK(c2->prefill_rank != c->prefill_rank);  // the other prefill rank has no outstanding tokens
  CHECK(c2->decode_rank == 3);                 // fits in rank 3 and it has fewer outstanding
  t.on_prefill_done(c->prefill_rank, 100);
  t.on_request_done(c->decode_rank, 100, 100);
  CHECK(t.prefill()[0].outstanding == 0);
  CHECK(t.decode()[1].outstanding == 0);
}

TEST_CASE("dispatch: full workers queue in the router; readiness needs every rank", "[router]") {
  WorkerTable t({1}, {2}, 16);
  std::string why;
  CHECK(!t.ready(&why));
  CHECK(why.find("rank 1") != std::string::npos);
  CHECK(!t.pick(10, 10, 4));  // nobody is up yet
  t.on_report(1, report(100));
  t.on_report(2, report(100));
  CHECK(t.ready(&why));
  auto c = t.pick(10, 10, 1);
  REQUIRE(c);
  t.on_dispatch(*c, 10, 10);
  CHECK(!t.pick(10, 10, 1));  // both at max_inflight = 1
  WorkerTable colocated({}, {5}, 16);
  CHECK(colocated.colocated());
  colocated.on_report(5, report(0));
  auto cc = colocated.pick(10, 10, 4);
  REQUIRE(cc);
  CHECK((cc->prefill_rank == -1 && cc->decode_rank == 5));  // no rank has room: the one with the most free blocks
}

TEST_CASE("dispatch: a silent rank is declared down, skipped, and re-admitted under a new epoch", "[router]") {
  using namespace std::chrono_literals;
  using pd::router::RankState;
  WorkerTable t({1, 2}, {3}, 16);
  for (int r : {1, 2, 3}) t.on_report(r, report(100));
  // Rank 2 keeps reporting; rank 1 goes silent (kill -STOP).
  std::this_thread::sleep_for(30ms);
  t.heard(2);
  t.heard(3);
  const std::vector<int> down = t.expire(20ms, 10s);
  REQUIRE(down == std::vector<int>{1});
  CHECK(t.find(1)->state == RankState::kDown);
  CHECK(t.find(1)->times_down == 1);
  std::string why;
  CHECK(t.ready(&why));  // a prefill->decode path still works
  CHECK(t.degraded());
  // Every pick goes to rank 2 now (before: about half went to the stopped rank).
  for (int i = 0; i < 20; ++i) {
    auto c = t.pick(10 + i, 10, 64);
    REQUIRE(c);
    CHECK(c->prefill_rank == 2);
    t.on_dispatch(*c, 10 + i, 10);
  }
  // A late report from the old incarnation does not bring it back; mark_up does.
  t.on_report(1, report(100));
  CHECK(t.find(1)->state == RankState::kDown);
  t.mark_up(1, 1);
  CHECK(t.find(1)->state == RankState::kUp);
  CHECK(t.find(1)->epoch == 1);
  CHECK(!t.degraded());
  // Both prefill ranks down: not ready, and the reason says so.
  t.mark_down(1);
  t.mark_down(2);
  CHECK(!t.ready(&why));
  CHECK(why == "every prefill rank is down");
  CHECK(!t.pick(10, 10, 64));
}

TEST_CASE("dispatch: a rank that never reports is declared down after the startup deadline", "[router]") {
  using namespace std::chrono_literals;
  WorkerTable t({1}, {2, 3}, 16);
  t.on_report(1, report(100));
  t.on_report(2, report(100));
  CHECK(t.expire(10s, 20ms).empty());  // the startup clock runs from the table's construction
  std::this_thread::sleep_for(30ms);
  t.heard(1);
  t.heard(2);
  CHECK(t.expire(10s, 20ms) == std::vector<int>{3});
  std::string why;
  CHECK(t.ready(&why));
  CHECK(t.degraded());
}

TEST_CASE("dispatch: a joined rank is paired only with the ranks it linked to; a draining rank gets nothing",
          "[router]") {
  using pd::router::RankState;
  WorkerTable t({1, 2}, {3}, 16);
  for (int r : {1, 2, 3}) t.on_report(r, report(100));
  t.add(5, /*prefill*/ false, "node-c:1");
  t.link(5, 2);  // it connected to prefill rank 2's port only
  std::string why;
  CHECK(t.ready(&why));  // a rank still starting after launch does not hold readiness back
  t.on_report(5, report(800));
  CHECK(t.find(5)->state == RankState::kUp);
  CHECK(t.linked(*t.find(2), *t.find(5)));
  CHECK(!t.linked(*t.find(1), *t.find(5)));
  CHECK(t.linked(*t.find(1), *t.find(3)));  // the launching job's ranks reach each other
  REQUIRE(t.begin_drain(3));
  CHECK(!t.begin_drain(3));
  // Prefill rank 1 is preferred (less outstanding work) but cannot reach rank 5: rank 2 is used.
  t.on_dispatch({2, 5}, 500, 10);
  for (int i = 0; i < 5; ++i) {
    auto c = t.pick(10, 10, 64);
    REQUIRE(c);
    CHECK(c->decode_rank == 5);
    CHECK(c->prefill_rank == 2);
  }
  t.remove(5);
  CHECK(t.find(5) == nullptr);
  CHECK(!t.pick(10, 10, 64));  // the only other decode rank is draining
  CHECK(t.find(2)->links.empty());
}

TEST_CASE("dispatch: a router started alone runs disaggregated and says what has not joined", "[router]") {
  WorkerTable t({}, {}, 16);
  CHECK(!t.colocated());
  std::string why;
  CHECK(!t.ready(&why));
  CHECK(why == "no prefill rank has joined yet");
  t.add(1, true, "a:1");
  t.on_report(1, report(100));
  CHECK(!t.ready(&why));
  CHECK(why == "no decode rank has joined yet");
  t.add(2, false, "b:1");
  t.link(1, 2);
  t.on_report(2, report(100));
  CHECK(t.ready(&why));
  auto c = t.pick(10, 10, 4);
  REQUIRE(c);
  CHECK((c->prefill_rank == 1 && c->decode_rank == 2));
}
