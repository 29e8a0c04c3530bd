// Membership alone (no router): what a liveness check reports is a list of
// events for the link loop to apply — a silent rank's RankDown, a late
// drain's RankDown followed by its RemoveRank — and the ranks are told
// (PeerDown) before the check returns, while removal waits for the caller.
#include <catch2/catch.hpp>

#include <chrono>
#include <variant>

#include "fake_channel.h"
#include "fake_env.h"
#include "router/membership.h"
#include "router/metrics.h"

namespace pd::router {
namespace {

using namespace std::chrono_literals;
using test::FakeChannelHub;

constexpr int kRouter = 0, kP = 1, kD1 = 2, kD2 = 3;

struct Fixture {
  FakeChannelHub hub;
  std::unique_ptr<ControlChannel> channel = hub.endpoint(kRouter);
  ClusterConfig cfg;
  FakeEnv env;
  WorkerTable workers{{kP}, {kD1, kD2}, 16};
  Registry registry;
  RouterMetrics metrics{registry, "f16", 0};
  std::unique_ptr<Membership> m;

  Fixture() {
    cfg.timeouts.heartbeat_ms = 2000;
    cfg.timeouts.rank_drain_ms = 5000;
    cfg.timeouts.stop_grace_ms = 60000;  // not a membership deadline
    workers.set_env(&env);
    m = std::make_unique<Membership>(cfg, "f16", "", workers, *channel, metrics);
    m->set_env(&env);
    for (int r : {kP, kD1, kD2}) report(r);
  }
  void report(int rank) {
    proto::LoadReport lr;
    lr.ready = true;
    lr.free_blocks = lr.total_blocks = 100;
    m->on_report(rank, lr);
  }
  // PeerDown messages `rank` received, by the rank they name.
  std::vector<int> peer_downs(int rank) {
    std::vector<int> out;
    for (auto& [src, msg] : hub.take_all(rank))
      if (auto* d = std::get_if<proto::PeerDown>(&msg)) out.push_back(d->rank);
    return out;
  }
};

TEST_CASE("membership: a silent rank comes back as one RankDown, the others already told", "[router][membership]") {
  Fixture f;
  CHECK(f.m->check_liveness().empty());
  f.env.advance(1500ms);
  for (int r : {kP, kD1}) f.report(r);  // kD2 stays silent
  f.env.advance(1000ms);
  const std::vector<MembershipEvent> events = f.m->check_liveness();
  REQUIRE(events.size() == 1);
  const auto* down = std::get_if<RankDown>(&events[0]);
  REQUIRE(down != nullptr);
  CHECK(down->rank == kD2);
  CHECK(down->name == "decode rank 3");
  CHECK(down->why.find("timeouts.heartbeat_ms") != std::string::npos);
  CHECK(f.workers.find(kD2)->state == RankState::kDown);
  CHECK(f.peer_downs(kP) == std::vector<int>{kD2});
  CHECK(f.peer_downs(kD1) == std::vector<int>{kD2});
  CHECK(f.m->check_liveness().empty());  // reported once
}

TEST_CASE("membership: a drain past rank_drain_ms is a RankDown, then a RemoveRank the caller applies",
          "[router][membership]") {
  Fixture f;
  REQUIRE(f.m->begin_drain(kD1, "test").empty());
  for (int i = 0; i < 4; ++i) {  // it keeps reporting, never says Drained
    f.env.advance(1000ms);
    for (int r : {kP, kD1, kD2}) f.report(r);
    CHECK(f.m->check_liveness().empty());
  }
  f.env.advance(1500ms);
  for (int r : {kP, kD1, kD2}) f.report(r);
  const std::vector<MembershipEvent> events = f.m->check_liveness();
  REQUIRE(events.size() == 2);
  const auto* down = std::get_if<RankDown>(&events[0]);
  REQUIRE(down != nullptr);
  CHECK(down->rank == kD1);
  CHECK(down->why.find("timeouts.rank_drain_ms") != std::string::npos);
  const auto* remove = std::get_if<RemoveRank>(&events[1]);
  REQUIRE(remove != nullptr);
  CHECK(remove->rank == kD1);
  // Told down, not yet removed: the caller re-runs what it held first.
  CHECK(f.peer_downs(kP) == std::vector<int>{kD1});
  REQUIRE(f.workers.find(kD1) != nullptr);
  f.m->remove(remove->rank);
  CHECK(f.workers.find(kD1) == nullptr);
  bool left = false;
  for (auto& [src, msg] : f.hub.take_all(kD2))
    if (auto* l = std::get_if<proto::PeerLeft>(&msg)) left |= l->rank == kD1;
  CHECK(left);
}

TEST_CASE("membership: a drain past its deadline that is also silent is declared down once, then removed",
          "[router][membership]") {
  Fixture f;
  REQUIRE(f.m->begin_drain(kD1, "test").empty());
  f.report(kD1);  // it has reported (a silent draining rank is then down too)
  for (int i = 0; i < 5; ++i) {  // the others report; kD1 falls silent while draining
    f.env.advance(1000ms);
    for (int r : {kP, kD2}) f.report(r);
    if (i < 1) CHECK(f.m->check_liveness().empty());
  }
  // The link thread was held up: both deadlines passed by the next check.
  f.env.advance(1500ms);
  for (int r : {kP, kD2}) f.report(r);
  const std::vector<MembershipEvent> events = f.m->check_liveness();
  int downs = 0, removes = 0;
  for (const MembershipEvent& e : events) {
    downs += std::holds_alternative<RankDown>(e);
    removes += std::holds_alternative<RemoveRank>(e);
  }
  CHECK(downs == 1);
  CHECK(removes == 1);
  CHECK(f.peer_downs(kP) == std::vector<int>{kD1});  // fenced once
  for (const MembershipEvent& e : events)
    if (const auto* r = std::get_if<RemoveRank>(&e)) f.m->remove(r->rank);
  CHECK(f.workers.find(kD1) == nullptr);
}

TEST_CASE("membership: a join is refused while the router stops", "[router][membership]") {
  Fixture f;
  proto::Join j;
  j.role = static_cast<int32_t>(Role::kDecode);
  j.block_size = f.cfg.kv.block_size;
  j.kv_dtype = "f16";
  f.m->on_join(7, j, /*router_stopping=*/true);
  CHECK(f.workers.find(7) == nullptr);
  bool refused = false;
  for (auto& [src, msg] : f.hub.take_all(7))
    if (auto* r = std::get_if<proto::JoinRefused>(&msg))
      refused |= r->reason.find("shutting down") != std::string::npos;
  CHECK(refused);
  f.m->on_join(8, j, false);
  CHECK(f.workers.find(8) != nullptr);
}

}  // namespace
}  // namespace pd::router
