// The worker's router link (worker/router_link.h) and the worker's stage table
// (worker/worker_core.h), without an engine: senders, the router's liveness,
// load reports and their counts.
#include "worker/router_link.h"

#include <catch2/catch.hpp>

#include <chrono>
#include <variant>

#include "fake_channel.h"
#include "worker/worker_core.h"

namespace pd::router_link_test {

using namespace std::chrono_literals;
constexpr int kRouter = 0, kPrefill = 1, kDecode = 2;

RoleTable decode_roles(bool joined = false) {
  RoleTable t;
  t.roles = {Role::kRouter, Role::kPrefill, Role::kDecode};
  t.hosts = {"test", "test", "test"};
  t.self = kDecode;
  t.router = kRouter;
  t.prefill = {kPrefill};
  t.decode = {kDecode};
  t.joined = joined;
  return t;
}

ClusterConfig link_config() {
  ClusterConfig cfg;
  cfg.timeouts.router_ms = 2000;
  cfg.timeouts.startup_ms = 5000;
  return cfg;
}

template <typename T>
int count_of(const std::vector<std::pair<int, proto::Message>>& msgs) {
  int n = 0;
  for (const auto& [source, m] : msgs) n += std::holds_alternative<T>(m);
  return n;
}

TEST_CASE("router link: router messages only from the router, worker messages only from a worker", "[router_link]") {
  test::FakeChannelHub hub;
  auto channel = hub.endpoint(kDecode);
  const ClusterConfig cfg = link_config();
  const RoleTable roles = decode_roles();
  RouterLink link("decode", cfg, roles, *channel);
  CHECK(link.accept(kRouter, proto::RouterBeat{}));
  CHECK_FALSE(link.accept(kPrefill, proto::Shutdown{}));  // a worker may not stop another
  CHECK(link.accept(kPrefill, proto::Hello{}));
  CHECK_FALSE(link.accept(kRouter, proto::Hello{}));      // Hello is a worker's
  CHECK_FALSE(link.accept(kDecode, proto::Hello{}));      // nor from this rank itself
  link.count_refused();                                   // refused for what it says
  link.report_load(proto::LoadReport{}, true, std::chrono::steady_clock::time_point{});
  const auto sent = hub.take_all(kRouter);
  REQUIRE(count_of<proto::LoadReport>(sent) == 1);
  for (const auto& [source, m] : sent)
    if (const auto* r = std::get_if<proto::LoadReport>(&m)) CHECK(r->refused_messages == 4);
}

TEST_CASE("router link: silence counts startup_ms until the router is heard, router_ms after, 1 s per iteration at most",
          "[router_link]") {
  test::FakeChannelHub hub;
  auto channel = hub.endpoint(kDecode);
  const ClusterConfig cfg = link_config();
  const RoleTable roles = decode_roles();
  RouterLink link("decode", cfg, roles, *channel);
  std::chrono::steady_clock::time_point now{};
  auto idle = [&](std::chrono::milliseconds total) {
    std::optional<Status> lost;
    for (auto t = 0ms; t < total && !lost; t += 100ms) {
      now += 100ms;
      lost = link.watch(now);
    }
    return lost;
  };
  CHECK(link.contact() == RouterContact::kWaiting);
  CHECK_FALSE(idle(4000ms));  // past router_ms, within startup_ms: it may still be starting
  REQUIRE(link.accept(kRouter, proto::RouterBeat{}));
  CHECK(link.contact() == RouterContact::kHeard);
  now += 60s;  // one long pass (or a stopped process): 1 s of silence at most
  CHECK_FALSE(link.watch(now));
  const std::optional<Status> lost = idle(1500ms);
  REQUIRE(lost);
  CHECK(lost->message().find("timeouts.router_ms") != std::string::npos);
  CHECK(link.contact() == RouterContact::kLost);
  CHECK_FALSE(idle(500ms));  // said once
}

TEST_CASE("router link: a joined rank has heard its router (router_ms from the start)", "[router_link]") {
  test::FakeChannelHub hub;
  auto channel = hub.endpoint(kDecode);
  const ClusterConfig cfg = link_config();
  const RoleTable roles = decode_roles(/*joined=*/true);
  RouterLink link("decode", cfg, roles, *channel);
  CHECK(link.contact() == RouterContact::kHeard);
  std::chrono::steady_clock::time_point now{};
  std::optional<Status> lost;
  for (int i = 0; i < 30 && !lost; ++i) lost = link.watch(now += 100ms);
  CHECK(lost);
}

TEST_CASE("router link: load reports carry the prompt-token counts kept here", "[router_link]") {
  test::FakeChannelHub hub;
  auto channel = hub.endpoint(kDecode);
  const ClusterConfig cfg = link_config();
  const RoleTable roles = decode_roles();
  RouterLink link("decode", cfg, roles, *channel);
  link.count_prompt(16, 4);
  link.count_prompt(0, 10);
  proto::LoadReport r;
  r.running = 3;
  link.report_load(r, true, std::chrono::steady_clock::time_point{});
  const auto sent = hub.take_all(kRouter);
  REQUIRE(count_of<proto::LoadReport>(sent) == 1);
  const auto& got = std::get<proto::LoadReport>(sent.front().second);
  CHECK(got.prompt_tokens_cached == 16);
  CHECK(got.prompt_tokens_computed == 14);
  CHECK(got.running == 3);
}

TEST_CASE("worker stage: leaving goes serving -> (leave asked) -> leaving -> drained -> shutdown, and stops are final",
          "[router_link]") {
  using S = WorkerStage;
  CHECK(legal(S::kServing, S::kLeaveAsked));
  CHECK(legal(S::kServing, S::kLeaving));
  CHECK(legal(S::kLeaveAsked, S::kLeaving));
  CHECK(legal(S::kLeaving, S::kDrained));
  CHECK(legal(S::kDrained, S::kShutdown));
  CHECK(legal(S::kServing, S::kShutdown));
  CHECK_FALSE(legal(S::kServing, S::kDrained));  // Drained only after leaving
  CHECK_FALSE(legal(S::kLeaving, S::kServing));
  CHECK_FALSE(legal(S::kDrained, S::kLeaving));
  for (S stop : {S::kShutdown, S::kRouterLost, S::kDeviceFailed}) {
    CHECK(legal(S::kLeaving, stop));
    for (S to : {S::kServing, S::kLeaveAsked, S::kLeaving, S::kDrained, S::kShutdown, S::kRouterLost, S::kDeviceFailed})
      CHECK_FALSE(legal(stop, to));
  }
}

}  // namespace pd::router_link_test
