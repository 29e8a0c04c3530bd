// The router's dispatch policy over its worker table.
#include <catch2/catch.hpp>

#include "router/dispatch.h"

#include <map>
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

TEST_CASE("dispatch: least outstanding prefill work, decode with room for the request", "[router]") {
  WorkerTable t({1, 2}, {3, 4}, 16);
  t.on_report(1, report(100));
  t.on_report(2, report(100));
  t.on_report(3, report(10));   // 160 tokens of room
  t.on_report(4, report(500));
  auto c = t.pick({100, 100}, 8);
  REQUIRE(c);
  CHECK(c->decode_rank == 4);  // rank 3 cannot hold 200 tokens
  t.on_dispatch(*c, 100, 100);
  auto c2 = t.pick({10, 10}, 8);
  REQUIRE(c2);
  CHECK(c2->prefill_rank != c->prefill_rank);  // the other prefill rank has no outstanding tokens
  CHECK(c2->decode_rank == 3);                 // fits in rank 3 and it has fewer outstanding
  t.on_prefill_done(c->prefill_rank, 100);
  t.on_request_done(c->decode_rank, 100, 100);
  CHECK(t.prefill()[0].outstanding == 0);
  CHECK(t.decode()[1].outstanding == 0);
}

TEST_CASE("dispatch: full workers queue in the router, readiness needs every rank", "[router]") {
  WorkerTable t({1}, {2}, 16);
  std::string why;
  CHECK(!t.ready(&why));
  CHECK(why.find("rank 1") != std::string::npos);
  CHECK(!t.pick({10, 10}, 4));  // nobody is up yet
  t.on_report(1, report(100));
  t.on_report(2, report(100));
  CHECK(t.ready(&why));
  auto c = t.pick({10, 10}, 1);
  REQUIRE(c);
  t.on_dispatch(*c, 10, 10);
  CHECK(!t.pick({10, 10}, 1));  // both at max_inflight = 1
  WorkerTable colocated({}, {5}, 16);
  CHECK(colocated.colocated());
  colocated.on_report(5, report(0));
  auto cc = colocated.pick({10, 10}, 4);
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
    auto c = t.pick({10 + i, 10}, 64);
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
  CHECK(!t.pick({10, 10}, 64));
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

TEST_CASE("dispatch: a joined rank is paired only with the ranks it linked to, a draining rank gets nothing",
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
  CHECK(ranks_linked(*t.find(2), *t.find(5)));
  CHECK(!ranks_linked(*t.find(1), *t.find(5)));
  CHECK(ranks_linked(*t.find(1), *t.find(3)));  // the launching job's ranks reach each other
  REQUIRE(t.begin_drain(3));
  CHECK(!t.begin_drain(3));
  // Prefill rank 1 is preferred (less outstanding work) but cannot reach rank 5: rank 2 is used.
  t.on_dispatch({2, 5, 0, /*prefill_work*/ 500}, 500, 10);
  for (int i = 0; i < 5; ++i) {
    auto c = t.pick({10, 10}, 64);
    REQUIRE(c);
    CHECK(c->decode_rank == 5);
    CHECK(c->prefill_rank == 2);
  }
  t.remove(5);
  CHECK(t.find(5) == nullptr);
  CHECK(!t.pick({10, 10}, 64));  // the only other decode rank is draining
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
  auto c = t.pick({10, 10}, 4);
  REQUIRE(c);
  CHECK((c->prefill_rank == 1 && c->decode_rank == 2));
}

// --- Prefix-aware dispatch over the prefix index (router/prefix_index.h) ---

namespace {
using pd::router::DispatchRequest;
using pd::router::RouteReason;

// A prompt of n tokens: a shared head of `shared` tokens, then tokens unique to `tag`.
std::vector<int32_t> prompt_of(int n, int shared, int tag) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back(i < shared ? 1000 + i : 100000 * tag + i);
  return p;
}
// `rank` reports that its cache holds the first `blocks` blocks of `prompt`.
void holds(WorkerTable& t, int rank, const std::vector<int32_t>& prompt, size_t blocks, pd::proto::Epoch epoch = 0) {
  auto chain = pd::router::prompt_block_hashes(prompt, 16);
  chain.resize(std::min(blocks, chain.size()));
  t.on_kv_events(rank, pd::proto::KvEvents{epoch, false, chain, {}});
}
}  // namespace

TEST_CASE("prefix index: chained hashes, leading matches, removals, resets and purges", "[router]") {
  pd::router::PrefixIndex idx;
  const auto a = prompt_of(100, 64, 1), b = prompt_of(100, 64, 2);
  const auto ha = pd::router::prompt_block_hashes(a, 16), hb = pd::router::prompt_block_hashes(b, 16);
  REQUIRE(ha.size() == 6);  // full blocks only
  CHECK(std::equal(ha.begin(), ha.begin() + 4, hb.begin()));  // the shared 64 tokens: the same 4 hashes
  CHECK(ha[4] != hb[4]);
  idx.apply(7, {0, false, ha, {}});
  CHECK(idx.matched_blocks(7, ha) == 6);
  CHECK(idx.matched_blocks(7, hb) == 4);  // the shared head only
  CHECK(idx.matched_blocks(8, ha) == 0);  // another rank holds nothing
  idx.apply(7, {0, false, {}, {ha[2]}});  // block 2 evicted: the chain breaks there
  CHECK(idx.matched_blocks(7, ha) == 2);
  CHECK(idx.blocks(7) == 5);
  idx.apply(7, {0, true, {hb[0]}, {}});  // reset: the rank's whole set
  CHECK(idx.blocks(7) == 1);
  CHECK(idx.blocks() == 1);
  idx.purge(7);
  CHECK(idx.blocks() == 0);
  CHECK(idx.matched_blocks(7, ha) == 0);
}

TEST_CASE("dispatch: a prompt goes to the prefill rank holding its prefix, within the imbalance bound",
          "[router]") {
  WorkerTable t({1, 2}, {3}, 16);
  for (int r : {1, 2, 3}) t.on_report(r, report(1000));
  const auto conv = prompt_of(400, 0, 1);
  holds(t, 2, conv, 100);
  const auto hashes = pd::router::prompt_block_hashes(conv, 16);
  auto c = t.pick({400, 10, hashes}, 64);
  REQUIRE(c);
  CHECK(c->prefill_rank == 2);
  CHECK(c->cached_tokens == 384);  // 24 blocks; never the last token
  CHECK(c->prefill_work == 16);
  CHECK(c->reason == RouteReason::kCacheAware);
  // The least_work policy ignores the cache: rank 1 (lower rank, equal load).
  WorkerTable lw({1, 2}, {3}, 16);
  lw.set_policy({.cache_aware = false});
  for (int r : {1, 2, 3}) lw.on_report(r, report(1000));
  holds(lw, 2, conv, 100);
  auto l = lw.pick({400, 10, hashes}, 64);
  REQUIRE(l);
  CHECK(l->prefill_rank == 1);
  CHECK(l->reason == RouteReason::kLeastWork);
  // Rank 2 loaded past the bound (1.5 x 0 + 1024 tokens): its cache no longer counts.
  t.on_dispatch({2, 3, 0, 2000}, 2000, 10);
  auto b = t.pick({400, 10, hashes}, 64);
  REQUIRE(b);
  CHECK(b->prefill_rank == 1);
  CHECK(b->reason == RouteReason::kBalance);
}

TEST_CASE("dispatch: a cached prefix draws a rank only while its queue is not longer than what it saves",
          "[router]") {
  WorkerTable t({1, 2}, {3}, 16);
  t.set_policy({.balance_ratio = 100, .balance_tokens = 1 << 20});  // the bound out of the way
  for (int r : {1, 2, 3}) t.on_report(r, report(100000));
  const auto p = prompt_of(500, 0, 1);
  const auto hashes = pd::router::prompt_block_hashes(p, 16);
  holds(t, 2, p, 100);  // rank 2 saves 496 tokens of 500
  t.on_dispatch({2, 3, 0, 300}, 300, 10);
  CHECK(t.pick({500, 10, hashes}, 64)->prefill_rank == 2);  // 4 + 300 < 500 + 0
  t.on_dispatch({2, 3, 0, 300}, 300, 10);
  CHECK(t.pick({500, 10, hashes}, 64)->prefill_rank == 1);  // 4 + 600 > 500 + 0
}

TEST_CASE("dispatch: uniform prompts spread evenly, a shared head does not pile them onto one rank", "[router]") {
  WorkerTable t({1, 2, 3}, {4}, 16);
  for (int r : {1, 2, 3, 4}) t.on_report(r, report(1 << 20));
  const auto head = prompt_of(400, 400, 0);
  holds(t, 1, head, 25);  // only rank 1 holds the shared system prompt so far
  std::map<int, int> share;
  std::vector<pd::router::DispatchChoice> live;
  for (int i = 0; i < 300; ++i) {
    const auto p = prompt_of(500, 400, i + 1);
    const auto hashes = pd::router::prompt_block_hashes(p, 16);
    auto c = t.pick({500, 16, hashes}, 64);
    REQUIRE(c);
    ++share[c->prefill_rank];
    t.on_dispatch(*c, 500, 16);
    live.push_back(*c);
    if (live.size() > 6) {  // a steady state: the oldest request finishes
      t.on_prefill_done(live.front().prefill_rank, live.front().prefill_work);
      t.on_request_done(live.front().decode_rank, 500, 16);
      live.erase(live.begin());
    }
    holds(t, c->prefill_rank, head, 25);  // whoever computed it now holds the head too
  }
  for (auto [rank, n] : share) CHECK(n <= 1.5 * 300 / 3);
  CHECK(share.size() == 3);
}

TEST_CASE("dispatch: a follow-up goes back to the decode rank holding all but a short suffix", "[router]") {
  WorkerTable t({1, 2}, {3, 4}, 16);
  for (int r : {1, 2, 3, 4}) t.on_report(r, report(1000));
  const auto turn2 = prompt_of(600, 0, 5);  // turn 1's prompt + answer (560 tokens) + a new question
  holds(t, 4, turn2, 35);                  // decode rank 4 holds turn 1's 560 tokens
  holds(t, 1, turn2, 25);                  // prefill rank 1 holds turn 1's prompt (400)
  const auto hashes = pd::router::prompt_block_hashes(turn2, 16);
  auto c = t.pick({600, 32, hashes}, 64);
  REQUIRE(c);
  CHECK(c->reason == RouteReason::kDecodeReuse);
  CHECK((c->prefill_rank == -1 && c->decode_rank == 4));
  CHECK(c->cached_tokens == 560);
  // The suffix past decode_reuse_tokens: a prefill rank computes it (the one with the most cached).
  t.set_policy({.decode_reuse_tokens = 32});
  auto p = t.pick({600, 32, hashes}, 64);
  REQUIRE(p);
  CHECK(p->prefill_rank == 1);
  CHECK(p->reason == RouteReason::kCacheAware);
  // A decode rank holding no more than a prefill rank leaves the prompt to the prefill pool.
  holds(t, 1, turn2, 35);
  auto same = t.pick({600, 32, hashes}, 64);
  REQUIRE(same);
  CHECK(same->prefill_rank == 1);
  CHECK(same->reason == RouteReason::kCacheAware);
  t.on_kv_events(1, pd::proto::KvEvents{0, true, {}, {}});  // rank 1's cache emptied (a reset snapshot)
  holds(t, 1, turn2, 25);
  // A decode rank without room for the request is not used for reuse.
  t.set_policy({});
  t.on_report(4, report(10));
  CHECK(t.pick({600, 32, hashes}, 64)->prefill_rank == 1);
}

TEST_CASE("dispatch: a decode rank busy with follow-ups leaves the next one to an idle prefill rank", "[router]") {
  WorkerTable t({1, 2}, {3}, 16);
  for (int r : {1, 2, 3}) t.on_report(r, report(1000));
  // Two conversations: decode rank 3 holds each one's turn 1 prompt + answer (560
  // tokens); prefill rank 1 holds each one's turn 1 prompt (432).
  const auto a = prompt_of(720, 0, 1), b = prompt_of(720, 0, 2);
  const auto ha = pd::router::prompt_block_hashes(a, 16), hb = pd::router::prompt_block_hashes(b, 16);
  for (const auto* p : {&a, &b}) {
    holds(t, 3, *p, 35);
    holds(t, 1, *p, 27);
  }
  // a: the decode rank computes its 160 new tokens (rank 1 would compute 288).
  auto first = t.pick({720, 32, ha}, 64);
  REQUIRE(first);
  CHECK(first->reason == RouteReason::kDecodeReuse);
  CHECK(first->prefill_work == 160);
  t.on_dispatch(*first, 720, 32);
  CHECK(t.find(3)->reuse_tokens == 160);
  // b, while a's 160 are still to compute there: 160 + 160 > 288 at rank 1.
  auto second = t.pick({720, 32, hb}, 64);
  REQUIRE(second);
  CHECK(second->prefill_rank == 1);
  CHECK(second->reason == RouteReason::kCacheAware);
  CHECK(second->cached_tokens == 432);
  // A decode rank's tokens weighted less (a decode rank with cores to spare): back to it.
  t.set_policy({.decode_reuse_weight = 0.5});
  CHECK(t.pick({720, 32, hb}, 64)->reason == RouteReason::kDecodeReuse);
  t.set_policy({});
  // a's first token: the decode rank is free of prompt work again, and b goes back to it.
  t.on_prefill_done(3, first->prefill_work);
  CHECK(t.find(3)->reuse_tokens == 0);
  CHECK(t.find(3)->outstanding == 1);  // a is still decoding there
  auto third = t.pick({720, 32, hb}, 64);
  REQUIRE(third);
  CHECK(third->reason == RouteReason::kDecodeReuse);
  t.on_dispatch(*third, 720, 32);
  t.mark_down(3);
  CHECK(t.find(3)->reuse_tokens == 0);
}

TEST_CASE("dispatch: a warm-up goes to the idle prefill rank holding most of a finished request", "[router]") {
  WorkerTable t({1, 2}, {3}, 16);
  for (int r : {1, 2, 3}) t.on_report(r, report(1000));
  // The finished request's prompt + answer: 600 tokens; rank 1 holds its prompt (512),
  // rank 2 a shorter head (256).
  const auto p = prompt_of(600, 0, 1);
  const auto h = pd::router::prompt_block_hashes(p, 16);
  holds(t, 1, p, 32);
  holds(t, 2, p, 16);
  auto w = t.pick_warm(h, 600, 512);
  REQUIRE(w);
  CHECK(w->prefill_rank == 1);
  CHECK(w->decode_rank == -1);
  CHECK(w->cached_tokens == 512);
  CHECK(w->prefill_work == 88);
  // Counted against rank 1 until it ends; a busy rank is not warmed.
  t.on_dispatch(*w, w->prefill_work, 0);
  CHECK(t.find(1)->outstanding_tokens == 88);
  auto next = t.pick_warm(h, 600, 512);
  REQUIRE(next);
  CHECK(next->prefill_rank == 2);
  CHECK(next->prefill_work == 344);
  // More than max_compute left to compute: none.
  CHECK_FALSE(t.pick_warm(h, 600, 300));
  t.on_prefill_done(1, w->prefill_work);
  CHECK(t.find(1)->outstanding == 0);
  CHECK(t.find(1)->outstanding_tokens == 0);
  // Nothing cached anywhere, or the rank down: none.
  CHECK_FALSE(t.pick_warm(pd::router::prompt_block_hashes(prompt_of(600, 0, 9), 16), 600, 512));
  t.mark_down(1);
  t.mark_down(2);
  CHECK_FALSE(t.pick_warm(h, 600, 512));
}

TEST_CASE("dispatch: a rank's index entry goes when it goes down, rejoins or leaves, stale events are dropped",
          "[router]") {
  WorkerTable t({1, 2}, {3}, 16);
  for (int r : {1, 2, 3}) t.on_report(r, report(1000));
  const auto p = prompt_of(300, 0, 1);
  const auto hashes = pd::router::prompt_block_hashes(p, 16);
  holds(t, 2, p, 100);
  CHECK(t.index().blocks(2) == 18);
  t.mark_down(2);
  CHECK(t.index().blocks(2) == 0);
  holds(t, 2, p, 100);  // from the fenced incarnation: dropped
  CHECK(t.index().blocks(2) == 0);
  t.mark_up(2, 1);
  holds(t, 2, p, 100, /*epoch*/ 0);  // a late message of epoch 0: dropped
  CHECK(t.index().blocks(2) == 0);
  holds(t, 2, p, 100, /*epoch*/ 1);
  CHECK(t.index().blocks(2) == 18);
  CHECK(t.pick({300, 10, hashes}, 64)->prefill_rank == 2);
  REQUIRE(t.begin_drain(2));
  CHECK(t.pick({300, 10, hashes}, 64)->prefill_rank == 1);  // draining: no new work, cache or not
  t.remove(2);
  CHECK(t.index().blocks() == 0);
}

TEST_CASE("dispatch: colocated ranks are chosen by the prefix they hold", "[router]") {
  WorkerTable t({}, {5, 6}, 16);
  for (int r : {5, 6}) t.on_report(r, report(1000));
  const auto p = prompt_of(300, 0, 1);
  holds(t, 6, p, 10);
  auto c = t.pick({300, 10, pd::router::prompt_block_hashes(p, 16)}, 64);
  REQUIRE(c);
  CHECK((c->prefill_rank == -1 && c->decode_rank == 6));
  CHECK(c->cached_tokens == 160);
  CHECK(c->reason == RouteReason::kCacheAware);
}

TEST_CASE("dispatch: at light load a short common head does not draw every prompt to one rank", "[router]") {
  WorkerTable t({1, 2}, {3, 4}, 16);
  for (int r : {1, 2, 3, 4}) t.on_report(r, report(1 << 20));
  const auto head = prompt_of(25, 25, 0);  // a chat template's default system prompt: one full block
  holds(t, 1, head, 1);
  std::map<int, int> prefill, decode;
  for (int i = 0; i < 40; ++i) {
    const auto p = prompt_of(120, 25, i + 1);
    auto c = t.pick({120, 16, pd::router::prompt_block_hashes(p, 16)}, 64);
    REQUIRE(c);
    CHECK(c->reason == RouteReason::kLeastWork);  // 16 of 120 tokens: below min_cached_fraction
    ++prefill[c->prefill_rank];
    ++decode[c->decode_rank];
    t.on_dispatch(*c, 120, 16);  // each finishes before the next arrives
    t.on_prefill_done(c->prefill_rank, c->prefill_work);
    t.on_request_done(c->decode_rank, 120, 16);
  }
  CHECK((prefill[1] == 20 && prefill[2] == 20));
  CHECK((decode[3] == 20 && decode[4] == 20));
}
