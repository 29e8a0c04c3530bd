// The router's view of the workers, driven through Router::submit with a
// recording writer (router_harness.h): ranks going silent (down, fenced,
// re-admitted), joining, and draining out of the pool.
#include "router/router_harness.h"

namespace pd::router::test_router {
namespace {

TEST_CASE("router: a prefill rank that goes silent is declared down, its request re-runs on the other one", "[router]") {
  Harness h;
  auto f = h.post(kBody);
  auto d = h.dispatched();
  REQUIRE(d);
  const int first = d->first;
  const proto::PrefillRequest* pr = &d->second;
  const int other = first == kP1 ? kP2 : kP1;
  h.silent.insert(first);  // kill -STOP
  auto again = h.expect<proto::PrefillRequest>(other, 2s);
  REQUIRE(again);
  CHECK(again->id != pr->id);        // a new wire id for the new attempt
  CHECK(again->prompt == pr->prompt);
  // The other workers were told; the stopped one was not sent anything more.
  bool told = false;
  for (auto& [src, m] : h.hub.take_all(again->decode_rank))
    if (auto* down = std::get_if<proto::PeerDown>(&m)) told |= down->rank == first;
  for (auto& m : h.inbox[again->decode_rank])
    if (auto* down = std::get_if<proto::PeerDown>(&m)) told |= down->rank == first;
  CHECK(told);
  // The stopped rank wakes up and speaks of the old attempt: ignored (it is fenced).
  h.tokens(first, pr->id, 0, 1, false);
  h.hub.send(first, kRouterRank, proto::RequestFailed{pr->id, "late", proto::FailureKind::kInternal});
  h.tokens(other, again->id, 0, 1, false);
  h.tokens(again->decode_rank, again->id, 1, 2, true);
  const Answer r = h.finish(f);
  CHECK(r.status == 200);
  CHECK(r.json()["choices"][0]["text"] == "aaa");
  const Answer health = h.get("/health");
  CHECK(health.status == 200);
  CHECK(health.raw().find("\"degraded\"") != std::string::npos);
  const Answer metrics = h.get("/metrics");
  CHECK(metrics.raw().find("pd_rank_up{role=\"prefill\",rank=\"" + std::to_string(first) + "\"} 0") != std::string::npos);
  CHECK(metrics.raw().find("pd_requests_retried_total 1") != std::string::npos);
  CHECK(metrics.raw().find("pd_rank_down_total{role=\"prefill\",rank=\"" + std::to_string(first) + "\"} 1") !=
        std::string::npos);
}

TEST_CASE("router: a rank declared down reads 0 running and waiting in /metrics, its KV figures as last reported",
          "[router]") {
  Harness h;
  proto::LoadReport lr;
  lr.ready = true;
  lr.running = 3;
  lr.waiting = 2;
  lr.free_blocks = 600;
  lr.total_blocks = 1000;
  h.hub.send(kD2, kRouterRank, lr);
  h.silent.insert(kD2);  // it reports no more
  h.pump_for(50ms);
  const std::string d2 = "{role=\"decode\",rank=\"" + std::to_string(kD2) + "\"} ";
  std::string m = h.get("/metrics").raw();
  CHECK(m.find("pd_running_sequences" + d2 + "3\n") != std::string::npos);
  CHECK(m.find("pd_waiting_requests" + d2 + "2\n") != std::string::npos);
  h.pump_for(400ms);  // heartbeat_ms 150: declared down
  m = h.get("/metrics").raw();
  CHECK(m.find("pd_rank_up" + d2 + "0\n") != std::string::npos);
  CHECK(m.find("pd_running_sequences" + d2 + "0\n") != std::string::npos);
  CHECK(m.find("pd_waiting_requests" + d2 + "0\n") != std::string::npos);
  CHECK(m.find("pd_free_kv_blocks" + d2 + "600\n") != std::string::npos);
  CHECK(m.find("pd_kv_blocks" + d2 + "1000\n") != std::string::npos);
}

// RouterBeats `rank` got since the last look (its inbox is emptied).
// A Join of `role` from a process on `host` (as a rank sends it; the hub does
// not ask for the cluster secret's proof).
proto::Join join_of(int32_t role, std::string host, int32_t pid, int32_t block_size, std::string port, std::string pool) {
  proto::Join j;
  j.role = role;
  j.host = std::move(host);
  j.pid = pid;
  j.block_size = block_size;
  j.port = std::move(port);
  j.pool = std::move(pool);
  return j;
}

int beats(Harness& h, int rank) {
  int n = 0;
  for (auto& [src, m] : h.hub.take_all(rank)) n += std::holds_alternative<proto::RouterBeat>(m) && src == kRouterRank;
  return n;
}

TEST_CASE("router: every worker hears the router beat once a second, but not a rank declared down", "[router]") {
  Harness h;  // heartbeat_ms 150
  h.silent.insert(kD2);
  h.pump_for(400ms);  // kD2 declared down
  for (int r : {kP1, kP2, kD1, kD2}) h.hub.take_all(r);
  h.pump_for(2100ms);
  for (int r : {kP1, kP2, kD1}) {
    INFO("rank " << r);
    const int n = beats(h, r);
    CHECK((n >= 2 && n <= 3));  // 2.1 s of beats a second apart
  }
  CHECK(beats(h, kD2) == 0);
}

TEST_CASE("router: a rank silent for a while hears no beat until it speaks again, long before it is down",
          "[router]") {
  Harness h(/*heartbeat_ms=*/10000);  // silence alone declares no one down here
  h.pump_for(100ms);
  h.silent.insert(kD2);  // stopped (SIGSTOP): a message to it may open a connection that never completes
  h.pump_for(2000ms);
  for (int r : {kP1, kP2, kD1, kD2}) h.hub.take_all(r);
  h.pump_for(2100ms);
  CHECK(beats(h, kD1) >= 2);
  CHECK(beats(h, kD2) == 0);
  h.silent.erase(kD2);  // it resumes: heard, then beaten again
  h.pump_for(2100ms);
  CHECK(beats(h, kD2) >= 2);
  // A rank still starting (joined, no report yet) is beaten all the same: until
  // it first hears the router it would wait for it as long as startup_ms.
  constexpr int kJoined = 7;
  h.hub.send(kJoined, kRouterRank,
             join_of(static_cast<int32_t>(Role::kDecode), "node-c", 4242, h.cfg.kv.block_size, "port-7", "node-c:1"));
  REQUIRE(h.expect<proto::JoinAccepted>(kJoined));
  h.pump_for(2100ms);
  CHECK(beats(h, kJoined) >= 2);
}

TEST_CASE("router: prompt tokens from each rank's cache and computed, from its load reports", "[router]") {
  Harness h;
  h.live = {kD1, kD2};  // the prefill ranks report only what the test sends (well within heartbeat_ms)
  auto report = [&](int rank, int64_t cached, int64_t computed) {
    proto::LoadReport lr;
    lr.ready = true;
    lr.free_blocks = lr.total_blocks = 1000;
    lr.prompt_tokens_cached = cached;
    lr.prompt_tokens_computed = computed;
    h.hub.send(rank, kRouterRank, lr);
    h.pump_for(1ms);
  };
  report(kP1, 0, 100);
  report(kP1, 64, 130);   // a prompt of 94 tokens, 64 of them cached
  report(kP1, 64, 130);   // nothing new
  report(kP2, 16, 20);
  const std::string m = h.get("/metrics").body;
  CHECK(m.find("pd_rank_prompt_tokens_total{role=\"prefill\",rank=\"1\",source=\"cache\"} 64") != std::string::npos);
  CHECK(m.find("pd_rank_prompt_tokens_total{role=\"prefill\",rank=\"1\",source=\"computed\"} 130") != std::string::npos);
  CHECK(m.find("pd_rank_prompt_tokens_total{role=\"prefill\",rank=\"2\",source=\"cache\"} 16") != std::string::npos);
}

TEST_CASE("router: a down rank whose process ended is reported to the others once (PeerGone), a stopped one never",
          "[router]") {
  Harness h;
  h.silent.insert(kP1);  // kill -STOP: down, but its process runs
  auto down = h.expect<proto::PeerDown>(kD1, 2s);
  REQUIRE(down);
  REQUIRE(down->rank == kP1);
  CHECK_FALSE(h.expect<proto::PeerGone>(kD1, 3s));  // never ended: never reported gone
  h.env.set_gone(kP1);  // kill -9: mpirun's table says it ended
  auto gone = h.expect<proto::PeerGone>(kD1, 2s);
  REQUIRE(gone);
  CHECK((gone->rank == kP1 && gone->epoch == 0));
  auto gone2 = h.expect<proto::PeerGone>(kD2, 2s);
  REQUIRE(gone2);
  CHECK(gone2->rank == kP1);
  CHECK_FALSE(h.expect<proto::PeerGone>(kD1, 3s));  // once
  h.env.set_gone(kD2);  // a rank that is up is not reported, whatever the table says
  CHECK_FALSE(h.expect<proto::PeerGone>(kD1, 2s));
}

TEST_CASE("router: a fenced rank that comes back is told to rejoin and re-admitted under a new epoch", "[router]") {
  Harness h;
  h.silent.insert(kD2);
  h.pump_for(250ms);  // past the heartbeat: declared down
  h.hub.take_all(kD2);
  h.silent.erase(kD2);  // kill -CONT: it reports under its old epoch
  auto rejoin = h.expect<proto::Rejoin>(kD2, 1s);
  REQUIRE(rejoin);
  CHECK(rejoin->epoch == 1);
  CHECK(h.get("/health").raw().find("\"degraded\"") != std::string::npos);
  h.epochs[kD2] = 1;  // it dropped its old state and reports under the new epoch
  auto up = h.expect<proto::PeerUp>(kP1, 1s);
  REQUIRE(up);
  CHECK((up->rank == kD2 && up->epoch == 1));
  h.pump_for(30ms);  // /health reflects the table as of the last housekeeping pass (every 10 ms)
  const Answer health = h.get("/health");
  INFO(health.raw());
  CHECK(health.status == 200);
  CHECK(health.raw().find("\"status\":\"ok\"") != std::string::npos);
}

TEST_CASE("router: with no prefill->decode path /health is 503 naming why, and requests fail at once", "[router]") {
  Harness h;
  h.silent.insert(kD1);
  h.silent.insert(kD2);
  h.pump_for(250ms);
  const Answer health = h.get("/health");
  CHECK(health.status == 503);
  CHECK(health.raw().find("every decode rank is down") != std::string::npos);
  auto f = h.post(kBody);
  CHECK(f->done());  // answered by submit() itself, before the link runs
  const Answer r = h.finish(f, 1000ms);
  CHECK(r.status == 503);
  CHECK(r.raw().find("no prefill->decode path") != std::string::npos);
  CHECK(r.raw().find("every decode rank is down") != std::string::npos);  // the reason /health gives
  CHECK(r.header("Retry-After") == "1");
}

TEST_CASE("router: once every decode rank has drained out, requests fail at once until a decode rank joins",
          "[router]") {
  Harness h;
  for (int r : {kD1, kD2}) {
    CHECK(h.finish(h.admin_post("{\"rank\": " + std::to_string(r) + "}")).status == 200);
    REQUIRE(h.expect<proto::Drain>(r));
    h.hub.send(r, kRouterRank, proto::Drained{});
    REQUIRE(h.expect<proto::Shutdown>(r));
    h.live.erase(std::find(h.live.begin(), h.live.end(), r));
  }
  h.pump_for(30ms);
  const Answer health = h.get("/health");
  CHECK(health.status == 503);
  CHECK(health.raw().find("every decode rank has left (drained out)") != std::string::npos);
  auto f = h.post(kBody);
  CHECK(f->done());  // answered by submit() itself: nothing will take it from the queue
  const Answer r = h.finish(f, 100ms);
  CHECK(r.status == 503);
  CHECK(r.raw().find("every decode rank has left") != std::string::npos);
  CHECK(r.header("Retry-After") == "1");
  // A decode rank joins: requests are taken again.
  for (int p : {kP1, kP2}) h.hub.send(p, kRouterRank, proto::Listening{"port-" + std::to_string(p)});
  constexpr int kJoined = 7;
  h.hub.send(kJoined, kRouterRank,
             join_of(static_cast<int32_t>(Role::kDecode), "node-c", 4242, h.cfg.kv.block_size, "port-7", "node-c:1"));
  REQUIRE(h.expect<proto::JoinAccepted>(kJoined));
  h.live.push_back(kJoined);
  h.pump_for(30ms);
  auto g = h.post(kBody);
  auto d = h.dispatched();
  REQUIRE(d);
  CHECK(d->second.decode_rank == kJoined);
  h.serve(d->first, d->second);
  CHECK(h.finish(g).status == 200);
}

TEST_CASE("router: while every decode rank drains out, what waits in the queue and what comes fail at once (503)",
          "[router]") {
  Harness h(150, 30000, false, [](ClusterConfig& c) { c.router.max_inflight_per_worker = 1; });
  // One request on each decode rank (running), a third waiting in the queue.
  std::vector<std::shared_ptr<RecordingWriter>> running;
  for (int i = 0; i < 2; ++i) {
    running.push_back(h.post(kBody));
    REQUIRE(h.dispatched());
  }
  auto waiting = h.post(kBody);
  CHECK(h.dispatched(30ms) == std::nullopt);
  for (int r : {kD1, kD2}) {
    CHECK(h.finish(h.admin_post("{\"rank\": " + std::to_string(r) + "}")).status == 200);
    REQUIRE(h.expect<proto::Drain>(r));
  }
  const Answer queued = h.finish(waiting, 100ms);
  CHECK(queued.status == 503);
  CHECK(queued.raw().find("every decode rank is draining out") != std::string::npos);
  CHECK(queued.header("Retry-After") == "1");
  h.pump_for(30ms);  // what the front reads is refreshed every 10 ms
  auto f = h.post(kBody);
  CHECK(f->done());  // answered by submit() itself
  CHECK(h.finish(f, 100ms).status == 503);
  const Answer health = h.get("/health");
  CHECK(health.status == 503);
  CHECK(health.raw().find("every decode rank is draining out of the cluster") != std::string::npos);
  for (auto& w : running) CHECK_FALSE(w->done());  // the draining ranks still finish what they hold
}

TEST_CASE("router: a rank joins, is linked to the up workers of the other role, and gets work once ready", "[router]") {
  Harness h;
  for (int r : {kP1, kP2}) h.hub.send(r, kRouterRank, proto::Listening{"port-" + std::to_string(r)});
  constexpr int kJoined = 7;
  h.hub.send(kJoined, kRouterRank,
             join_of(static_cast<int32_t>(Role::kDecode), "node-c", 4242, h.cfg.kv.block_size, "port-7", "node-c:1"));
  auto accepted = h.expect<proto::JoinAccepted>(kJoined);
  REQUIRE(accepted);
  CHECK(accepted->rank == kJoined);
  CHECK(!accepted->colocated);
  REQUIRE(accepted->peers.size() == 2);
  CHECK((accepted->peers[0].rank == kP1 && accepted->peers[0].port == "port-1"));
  CHECK((accepted->peers[1].rank == kP2 && accepted->peers[1].port == "port-2"));
  h.live.push_back(kJoined);  // it reports ready
  h.pump_for(30ms);
  // Three requests, none answered: the decode ranks take one each (fewest outstanding).
  std::vector<std::shared_ptr<RecordingWriter>> fs;
  std::set<int> decode_ranks;
  std::vector<proto::PrefillRequest> reqs;
  for (int i = 0; i < 3; ++i) {
    fs.push_back(h.post(kBody));
    auto d = h.dispatched();
    REQUIRE(d);
    decode_ranks.insert(d->second.decode_rank);
    reqs.push_back(d->second);
    h.tokens(d->first, d->second.id, 0, 1, false);
  }
  CHECK(decode_ranks.count(kJoined) == 1);
  for (const auto& r : reqs) h.tokens(r.decode_rank, r.id, 1, 2, true);
  for (auto& f : fs) CHECK(h.finish(f).status == 200);
  const Answer health = h.get("/health");
  CHECK(health.raw().find("{\"rank\":7,\"role\":\"decode\",\"state\":\"up\"}") != std::string::npos);
  CHECK(h.get("/metrics").raw().find("pd_ranks_joined_total{role=\"decode\"} 1") != std::string::npos);
}

TEST_CASE("router: ranks that join together link to each other before either is ready, not to their own pool",
          "[router]") {
  Harness h;  // the launching job's decode ranks never said Listening: no port, never linked
  h.hub.send(7, kRouterRank,
             join_of(static_cast<int32_t>(Role::kDecode), "node-c", 41, h.cfg.kv.block_size, "port-7", "node-c:41"));
  auto first = h.expect<proto::JoinAccepted>(7);
  REQUIRE(first);
  CHECK(first->peers.empty());
  // Rank 7 has not reported ready yet when a prefill rank of another pool joins.
  h.hub.send(8, kRouterRank,
             join_of(static_cast<int32_t>(Role::kPrefill), "node-d", 42, h.cfg.kv.block_size, "port-8", "node-d:42"));
  auto second = h.expect<proto::JoinAccepted>(8);
  REQUIRE(second);
  REQUIRE(second->peers.size() == 1);
  CHECK((second->peers[0].rank == 7 && second->peers[0].port == "port-7"));
  // A prefill rank of rank 7's own pool reaches it through their MPI job.
  h.hub.send(9, kRouterRank,
             join_of(static_cast<int32_t>(Role::kPrefill), "node-c", 43, h.cfg.kv.block_size, "port-9", "node-c:41"));
  auto third = h.expect<proto::JoinAccepted>(9);
  REQUIRE(third);
  CHECK(third->peers.empty());
}

TEST_CASE("router: a join is refused naming what differs", "[router]") {
  Harness h;
  h.hub.send(8, kRouterRank, join_of(static_cast<int32_t>(Role::kDecode), "x", 1, h.cfg.kv.block_size * 2, "p", "x:1"));
  auto refused = h.expect<proto::JoinRefused>(8);
  REQUIRE(refused);
  CHECK(refused->reason.find("kv.block_size") != std::string::npos);
  CHECK(h.hub.forgotten(kRouterRank).count(8) == 1);  // its link is released
  h.hub.send(9, kRouterRank, join_of(3, "x", 1, h.cfg.kv.block_size, "p", "x:1"));
  auto bad_role = h.expect<proto::JoinRefused>(9);
  REQUIRE(bad_role);
  CHECK(bad_role->reason.find("role 3") != std::string::npos);
  proto::Join other_kv = join_of(static_cast<int32_t>(Role::kDecode), "x", 1, h.cfg.kv.block_size, "p", "x:1");
  other_kv.kv_dtype = "q8_0";  // the harness's cluster keeps f16
  h.hub.send(10, kRouterRank, other_kv);
  auto bad_kv = h.expect<proto::JoinRefused>(10);
  REQUIRE(bad_kv);
  CHECK(bad_kv->reason.find("kv.dtype q8_0 differs from the cluster's f16") != std::string::npos);
  CHECK(h.get("/health").raw().find("\"rank\":8") == std::string::npos);
}

// A pool started on another model file (another model, quantization or
// fine-tune) would fail every handoff, or serve other text: refused at join.
TEST_CASE("router: a join from a pool on another model file is refused naming it", "[router]") {
  Harness h(150, 30000, false, {}, [](ModelInfo& m) { m.fingerprint = "00112233aabbccdd"; });
  int source = 8;
  for (const std::string model : {std::string(), std::string("ffeeddcc99887766"), std::string(5000, 'z')}) {
    proto::Join j = join_of(static_cast<int32_t>(Role::kDecode), "x", 1, h.cfg.kv.block_size, "p", "x:1");
    j.model = model;
    h.hub.send(source, kRouterRank, j);
    auto refused = h.expect<proto::JoinRefused>(source++);
    REQUIRE(refused);
    CHECK(refused->reason.find("model file") != std::string::npos);
    CHECK(refused->reason.find("00112233aabbccdd") != std::string::npos);
    CHECK(refused->reason.size() < 200);  // a peer's string is not echoed unless it looks like a fingerprint
  }
  proto::Join same = join_of(static_cast<int32_t>(Role::kDecode), "x", 1, h.cfg.kv.block_size, "p", "x:1");
  same.model = "00112233aabbccdd";
  h.hub.send(source, kRouterRank, same);
  CHECK(h.expect<proto::JoinAccepted>(source));
}

TEST_CASE("router: a drained rank takes no new work, its handed-back prompts re-run elsewhere, then it is removed",
          "[router]") {
  Harness h;
  auto f = h.post(kBody);
  auto d = h.dispatched();
  REQUIRE(d);
  const int leaving = d->first, other = d->first == kP1 ? kP2 : kP1;
  auto drain = h.admin_post("{\"rank\": " + std::to_string(leaving) + "}");
  const Answer drained = h.finish(drain);
  CHECK(drained.status == 200);
  CHECK(drained.json() == nlohmann::json{{"rank", leaving}, {"state", "draining"}});
  REQUIRE(h.expect<proto::Drain>(leaving));
  // The rank hands its queued prompt back: it re-runs on the other prefill rank.
  h.hub.send(leaving, kRouterRank, proto::RequestFailed{d->second.id, "leaving", proto::FailureKind::kLeaving});
  auto again = h.expect<proto::PrefillRequest>(other);
  REQUIRE(again);
  h.tokens(other, again->id, 0, 1, false);
  h.tokens(again->decode_rank, again->id, 1, 2, true);
  CHECK(h.finish(f).status == 200);
  // New requests go only to the other prefill rank.
  for (int i = 0; i < 3; ++i) {
    auto g = h.post(kBody);
    auto n = h.dispatched();
    REQUIRE(n);
    CHECK(n->first == other);
    h.serve(other, n->second);
    CHECK(h.finish(g).status == 200);
  }
  auto twice = h.admin_post("{\"rank\": " + std::to_string(leaving) + "}");
  CHECK(h.finish(twice).status == 409);
  h.hub.send(leaving, kRouterRank, proto::Drained{});
  auto left = h.expect<proto::PeerLeft>(kD1);
  REQUIRE(left);
  CHECK(left->rank == leaving);
  REQUIRE(h.expect<proto::Shutdown>(leaving));
  CHECK(h.hub.forgotten(kRouterRank).count(leaving) == 1);
  h.live.erase(std::find(h.live.begin(), h.live.end(), leaving));
  h.pump_for(30ms);
  const Answer health = h.get("/health");
  CHECK(health.status == 200);
  CHECK(health.raw().find("\"rank\":" + std::to_string(leaving) + ",") == std::string::npos);
  CHECK(h.get("/metrics").raw().find("pd_ranks_left_total{role=\"prefill\"} 1") != std::string::npos);
  CHECK(illegal_transitions() == 0);
}

TEST_CASE("router: a rank that does not finish draining within rank_drain_ms is ended as down and removed",
          "[router]") {
  // Only the rank's deadline is short: the router's stop grace plays no part.
  Harness h(150, 30000, false, [](ClusterConfig& c) { c.timeouts.rank_drain_ms = 300; });
  auto f = h.post(kStreamBody);
  auto d = h.dispatched();
  REQUIRE(d);
  h.tokens(d->first, d->second.id, 0, 1, false);  // streaming: it will migrate
  const int decode = d->second.decode_rank;
  auto drain = h.admin_post("{\"rank\": " + std::to_string(decode) + "}");
  CHECK(h.finish(drain).status == 200);
  REQUIRE(h.expect<proto::Drain>(decode));
  // It keeps beating but never says Drained: after rank_drain_ms it is ended as down:
  // its stream goes on on the other pair, the others are told it left, and it
  // is told to shut down.
  auto again = h.dispatched(2000ms, [&] { return f->done(); });
  REQUIRE(again);
  CHECK(again->second.decode_rank != decode);
  CHECK(again->second.sampling.resumed_tokens == 1);
  h.serve(again->first, again->second, 1);  // the 2 tokens left of 3
  const Answer r = h.finish(f);
  CHECK(count(r.raw(), "\"error\"") == 0);
  CHECK(count(r.raw(), "data: [DONE]") == 1);
  CHECK(count(r.raw(), "finish_reason\":\"length") == 1);
  REQUIRE(h.expect<proto::Shutdown>(decode));
  bool left = false;
  for (auto& m : h.inbox[kP1])
    if (auto* l = std::get_if<proto::PeerLeft>(&m)) left |= l->rank == decode;
  if (!left) left = h.expect<proto::PeerLeft>(kP1).has_value();
  CHECK(left);
  h.live.erase(std::find(h.live.begin(), h.live.end(), decode));
  h.pump_for(30ms);
  CHECK(h.get("/health").raw().find("\"rank\":" + std::to_string(decode) + ",") == std::string::npos);
}

TEST_CASE("router: POST /admin/drain refuses bodies and ranks it cannot act on", "[router]") {
  Harness h;
  auto post = [&](const std::string& body) {
    auto f = h.admin_post(body);
    return h.finish(f);
  };
  const Answer unknown = post(R"({"rank": 99})");
  CHECK(unknown.status == 404);
  CHECK(unknown.raw().find("\"param\":\"rank\"") != std::string::npos);
  CHECK(post(R"({"rank": "one"})").status == 400);
  CHECK(post(R"({"rank": -1})").status == 400);
  CHECK(post("[1]").status == 400);
  CHECK(post("not json").status == 400);
  h.silent.insert(kD2);
  h.pump_for(250ms);  // declared down
  // A down rank is removed at once (its requests were already re-run or failed).
  CHECK(post(R"({"rank": 4})").status == 200);
  REQUIRE(h.expect<proto::PeerLeft>(kP1));
  h.pump_for(30ms);
  const Answer health = h.get("/health");
  CHECK(health.raw().find("\"rank\":4,") == std::string::npos);
  CHECK(health.raw().find("\"status\":\"ok\"") != std::string::npos);  // no longer degraded
  CHECK(post(R"({"rank": 4})").status == 404);
}

TEST_CASE("router: /admin/* takes only the admin key, and is closed (403) while none is configured", "[router]") {
  const std::string api = "Bearer sk-api", admin = "Bearer " + kAdminKey;
  const std::string drain_d2 = R"({"rank": 4})";
  {
    // No admin key: closed to everyone, the API key included; nothing is drained.
    Harness h(150, 30000, false, [](ClusterConfig& c) {
      c.http.api_key = "sk-api";
      c.http.admin_key.clear();
    });
    for (const std::string& auth : {std::string(), api, admin}) {
      INFO("Authorization: " << auth);
      auto f = h.post(drain_d2, "/admin/drain", auth);
      const Answer a = h.finish(f);
      CHECK(a.status == 403);
      const nlohmann::json e = a.json()["error"];
      CHECK(e["code"] == "admin_disabled");
      CHECK(e["type"] == "invalid_request_error");
      CHECK_THAT(e["message"].get<std::string>(), Catch::Matchers::Contains("http.admin_key"));
    }
    auto other = h.post("{}", "/admin/anything", api);
    CHECK(h.finish(other).status == 403);
    h.pump_for(30ms);
    CHECK(h.get("/health").raw().find("draining") == std::string::npos);
    CHECK(h.cancelled().empty());
    for (int r : {kP1, kP2, kD1, kD2})
      for (auto& [src, m] : h.hub.take_all(r)) CHECK_FALSE(std::holds_alternative<proto::Drain>(m));
  }
  {
    // An admin key: it alone opens /admin/*; the API key does not, and it does not open the API.
    Harness h(150, 30000, false, [](ClusterConfig& c) { c.http.api_key = "sk-api"; });
    for (const std::string& auth : {std::string(), api, std::string("Bearer test-admin-ke"), std::string("Basic x")}) {
      INFO("Authorization: " << auth);
      auto f = h.post(drain_d2, "/admin/drain", auth);
      const Answer a = h.finish(f);
      CHECK(a.status == 401);
      CHECK(a.json()["error"]["code"] == "invalid_api_key");
      CHECK(a.header("WWW-Authenticate") == "Bearer");
      CHECK_THAT(a.json()["error"]["message"].get<std::string>(), Catch::Matchers::Contains("admin key"));
    }
    auto unknown = h.post("{}", "/admin/anything", admin);
    CHECK(h.finish(unknown).status == 404);
    auto models = h.submit("GET", "/v1/models", "", admin);
    CHECK(h.finish(models).status == 401);
    auto models_api = h.submit("GET", "/v1/models", "", api);
    CHECK(h.finish(models_api).status == 200);
    auto drained = h.post(drain_d2, "/admin/drain", admin);
    const Answer a = h.finish(drained);
    CHECK(a.status == 200);
    CHECK(a.json() == nlohmann::json{{"rank", 4}, {"state", "draining"}});
    REQUIRE(h.expect<proto::Drain>(kD2));
  }
}

}  // namespace
}  // namespace pd::router::test_router
