// The router's two halves wired by hand, without the Router that owns them
// and without an HTTP server: the front (HttpFront) posts to the inbox and
// reads the status, the link loop (LinkLoop) takes the inbox and publishes the
// status (front_link.h). What crosses the seam, and the router's stop: the
// grace is timeouts.stop_grace_ms, whatever a rank's drain deadline.
#include "router/http_front.h"
#include "router/link_loop.h"
#include "router/router_harness.h"

namespace pd::router::test_router {
namespace {

struct Halves {
  FakeChannelHub hub;
  ClusterConfig cfg;
  RoleTable roles;
  ModelInfo model = tiny_model_info();
  Registry registry;
  RouterMetrics metrics{registry, "f16", 0};
  RequestIds ids;
  LinkInbox inbox;
  LinkStatus status;
  FakeEnv env;
  std::unique_ptr<HttpFront> front;
  std::unique_ptr<LinkLoop> link;

  Halves() {
    cfg.timeouts.stop_grace_ms = 300;
    cfg.timeouts.rank_drain_ms = 60000;
    cfg.timeouts.heartbeat_ms = 150;
    roles.roles = {Role::kRouter, Role::kPrefill, Role::kPrefill, Role::kDecode, Role::kDecode};
    roles.hosts.assign(5, "test");
    roles.pids.assign(5, 0);
    roles.self = roles.router = kRouterRank;
    roles.prefill = {kP1, kP2};
    roles.decode = {kD1, kD2};
    front = std::make_unique<HttpFront>(FrontParts{cfg, model, registry, metrics, ids, inbox, status});
    link = std::make_unique<LinkLoop>(LinkParts{cfg, roles, model, metrics, ids, inbox, status},
                                      hub.endpoint(kRouterRank));
    front->set_env(&env);
    link->set_env(&env);
    link->start();
    step(30ms);
  }
  // The link runs for `d` (the ranks report every 10 ms); false once it said the stop is over.
  bool step(std::chrono::milliseconds d, bool stop_asked = false) {
    bool more = true;
    for (auto end = env.now() + d; env.now() < end && more; env.advance(1ms)) {
      if ((env.now().time_since_epoch() / 1ms) % 10 == 0)
        for (int r : {kP1, kP2, kD1, kD2}) {
          proto::LoadReport lr;
          lr.ready = true;
          lr.free_blocks = lr.total_blocks = 1000;
          hub.send(r, kRouterRank, lr);
        }
      more = link->run_once(stop_asked);
    }
    return more;
  }
  std::shared_ptr<RecordingWriter> submit(const std::string& method, const std::string& path, const std::string& body) {
    auto w = std::make_shared<RecordingWriter>();
    HttpRequest http;
    http.method = method;
    http.target = path;
    http.body = body;
    front->submit(std::move(http), w);
    return w;
  }
  size_t prompts_sent() {
    size_t n = 0;
    for (int r : {kP1, kP2})
      for (auto& [src, m] : hub.take_all(r)) n += std::holds_alternative<proto::PrefillRequest>(m);
    return n;
  }
};

TEST_CASE("link loop: what the front accepts reaches the link through the inbox, and the status says it is queued",
          "[router][link_loop]") {
  Halves h;
  CHECK(h.status.snapshot().ready);  // published by the link from the ranks' reports
  CHECK(h.submit("GET", "/health", "")->answer().status == 200);
  auto w = h.submit("POST", "/v1/completions", kBody);
  CHECK_FALSE(w->done());
  CHECK(h.status.queued() == 1);  // counted at once, before the link took it
  CHECK(h.prompts_sent() == 0);
  h.link->run_once(false);
  CHECK(h.status.queued() == 0);
  CHECK(h.prompts_sent() == 1);
  CHECK(h.link->state() == RouterState::kServing);
}

TEST_CASE("link loop: a stop is published at once and in-flight requests get timeouts.stop_grace_ms",
          "[router][link_loop]") {
  Halves h;
  auto w = h.submit("POST", "/v1/completions", kBody);
  h.step(5ms);
  REQUIRE(h.prompts_sent() == 1);
  CHECK(h.step(1ms, true));  // the stop begins
  CHECK(h.link->state() == RouterState::kStopping);
  CHECK(h.status.stopping());
  // The front refuses new requests and /health says why, from the snapshot alone.
  const Answer refused = h.submit("POST", "/v1/completions", kBody)->answer();
  CHECK(refused.status == 503);
  CHECK(refused.body.find("shutting down") != std::string::npos);
  const Answer health = h.submit("GET", "/health", "")->answer();
  CHECK(health.status == 503);
  CHECK(health.body.find("shutting down") != std::string::npos);
  CHECK(h.step(250ms, true));  // within the grace: the request may still finish
  CHECK_FALSE(w->done());
  CHECK_FALSE(h.step(100ms, true));  // past stop_grace_ms (300 ms): the stop is over
  h.link->finish();
  CHECK(h.link->state() == RouterState::kStopped);
  CHECK(h.status.snapshot().state == RouterState::kStopped);
  REQUIRE(w->done());
  CHECK(w->answer().status == 503);
  CHECK(w->answer().body.find("shut down before the request finished") != std::string::npos);
  bool shutdown = false;
  for (auto& [src, m] : h.hub.take_all(kD1)) shutdown |= std::holds_alternative<proto::Shutdown>(m);
  CHECK(shutdown);
  CHECK(illegal_transitions() == 0);
}

// A stopped router process, or an MPI progress call that blocked (a stray TCP
// connection to its MPI port can make Open MPI's accept handler wait): the
// ranks kept reporting; on resuming the router must not take its own stall
// for their silence.
TEST_CASE("link loop: a stall of the router's own loop is not the ranks' silence", "[router][link_loop]") {
  Halves h;
  REQUIRE(h.status.snapshot().ready);
  auto report_all = [&] {
    for (int r : {kP1, kP2, kD1, kD2}) {
      proto::LoadReport lr;
      lr.ready = true;
      lr.free_blocks = lr.total_blocks = 1000;
      h.hub.send(r, kRouterRank, lr);
    }
  };
  h.env.advance(5s);  // heartbeat_ms 150: 33 heartbeats
  // The first iteration after it looks before what they sent meanwhile is taken in.
  h.link->run_once(false);
  report_all();
  h.step(50ms);
  const LinkSnapshot after = h.status.snapshot();
  CHECK(after.ready);
  CHECK_FALSE(after.degraded);
  CHECK(after.ranks_json.find("down") == std::string::npos);
  // A rank silent after the stall is still found out within heartbeat_ms.
  for (int i = 0; i < 40; ++i) {
    for (int r : {kP1, kP2, kD1}) {
      proto::LoadReport lr;
      lr.ready = true;
      lr.free_blocks = lr.total_blocks = 1000;
      h.hub.send(r, kRouterRank, lr);
    }
    h.link->run_once(false);
    h.env.advance(10ms);
  }
  CHECK(h.status.snapshot().degraded);
  CHECK(h.status.snapshot().ranks_json.find("down") != std::string::npos);
}

TEST_CASE("link loop: with nothing in flight the stop is over at once", "[router][link_loop]") {
  Halves h;
  CHECK_FALSE(h.step(1ms, true));
  CHECK(h.link->state() == RouterState::kStopping);
  h.link->finish();
  CHECK(h.link->state() == RouterState::kStopped);
}

}  // namespace
}  // namespace pd::router::test_router
