// Transport::post_reclaim and the seal that ends it, over the loopback
// transport and the decorators a worker's transport stack has (send budget,
// fault injection, KvPaths): what a sender left under a tag is taken up to
// its seal, a later receive under the tag meets only what follows, a send
// that never went out is not waited for, a reclaim can be cancelled; and
// the seal request and a decode rank's tag counts on the wire.
#include <catch2/catch.hpp>

#include <cstring>

#include "kvtransfer/fault_injection_transport.h"
#include "kvtransfer/kv_paths.h"
#include "kvtransfer/loopback_transport.h"
#include "kvtransfer/send_budget.h"
#include "protocol/messages.h"

namespace pd::test {
namespace {

// File-local names unique among the node tests (a unity build compiles several files as one).
constexpr int kFrom = 1, kTo = 2, kReclaimedTag = 1003;


OpState ended_as(Transport& t, TransferOp op) {
  Result<OpState> r = t.test(op);
  REQUIRE(r.is_ok());
  return *r;
}

TEST_CASE("reclaim: takes every message left under the tag up to the seal, a later receive meets only what follows") {
  LoopbackNetwork net;
  auto s = net.endpoint(kFrom);
  auto r = net.endpoint(kTo);
  // A handoff the receiver gave up on: its receives were cancelled, the sends stay.
  std::vector<uint8_t> stale1(512, 1), stale2(64, 2), in(512, 0);
  auto cancelled = r->post_recv(kFrom, kReclaimedTag, whole_region(in));
  REQUIRE(cancelled.is_ok());
  r->cancel(*cancelled);
  CHECK(ended_as(*r, *cancelled) == OpState::kCancelled);
  auto s1 = s->post_send(kTo, kReclaimedTag, whole_region(stale1));
  auto s2 = s->post_send_bytes(kTo, kReclaimedTag, stale2.data(), stale2.size());
  REQUIRE((s1.is_ok() && s2.is_ok()));

  auto rec = r->post_reclaim(kFrom, kReclaimedTag);
  REQUIRE(rec.is_ok());
  CHECK(ended_as(*r, *rec) == OpState::kPending);  // no seal yet
  CHECK(net.messages_reclaimed() == 2);
  CHECK(ended_as(*s, *s1) == OpState::kDone);  // taken: the sender's memory is free again
  CHECK(ended_as(*s, *s2) == OpState::kDone);
  auto seal = s->post_send_bytes(kTo, kReclaimedTag, nullptr, 0);
  REQUIRE(seal.is_ok());
  CHECK(ended_as(*r, *rec) == OpState::kDone);
  CHECK(ended_as(*s, *seal) == OpState::kDone);

  // The tag's next handoff: its receive meets its own send, not a stale one.
  std::vector<uint8_t> fresh(512, 9);
  auto recv = r->post_recv(kFrom, kReclaimedTag, whole_region(in));
  auto send = s->post_send(kTo, kReclaimedTag, whole_region(fresh));
  REQUIRE((recv.is_ok() && send.is_ok()));
  CHECK(ended_as(*r, *recv) == OpState::kDone);
  CHECK(in == fresh);
  CHECK(net.messages_reclaimed() == 3);
  CHECK(r->pending() == 0);
}

TEST_CASE("reclaim: cancelled before the seal, it ends kCancelled and takes nothing more") {
  LoopbackNetwork net;
  auto s = net.endpoint(kFrom);
  auto r = net.endpoint(kTo);
  auto rec = r->post_reclaim(kFrom, kReclaimedTag);
  REQUIRE(rec.is_ok());
  CHECK(ended_as(*r, *rec) == OpState::kPending);
  r->cancel(*rec);
  CHECK(ended_as(*r, *rec) == OpState::kCancelled);
  std::vector<uint8_t> late(16, 3);
  auto send = s->post_send_bytes(kTo, kReclaimedTag, late.data(), late.size());
  REQUIRE(send.is_ok());
  CHECK(ended_as(*s, *send) == OpState::kPending);  // nobody takes it
  CHECK(net.messages_reclaimed() == 0);
}

TEST_CASE("reclaim: sends abandoned while they wait for the send budget never go out, the seal follows what did") {
  LoopbackNetwork net;
  SendBudgetTransport s(net.endpoint(kFrom), SendBudget{1, 128 << 10, {}});  // one send in flight per peer
  auto r = net.endpoint(kTo);
  std::vector<std::vector<uint8_t>> layers(3, std::vector<uint8_t>(256, 5));
  std::vector<TransferOp> sends;
  for (auto& l : layers) sends.push_back(*s.post_send(kTo, kReclaimedTag, whole_region(l)));
  CHECK(s.waiting(kTo) == 2);
  // The handoff ended; abandoned last first (as HandoffSender does), the two
  // waiting are gone before the one in flight gives its budget back.
  for (auto it = sends.rbegin(); it != sends.rend(); ++it) s.abandon(*it);
  auto seal = s.post_send_bytes(kTo, kReclaimedTag, nullptr, 0);
  REQUIRE(seal.is_ok());
  auto rec = r->post_reclaim(kFrom, kReclaimedTag);
  REQUIRE(rec.is_ok());
  CHECK(ended_as(*r, *rec) == OpState::kDone);
  CHECK(net.messages_reclaimed() == 2);  // the one posted, and the seal
  CHECK(ended_as(s, *seal) == OpState::kDone);
  CHECK(s.pending() == 0);
}

TEST_CASE("reclaim: the fault injector never hangs a seal, KvPaths reclaims over the mpi path") {
  LoopbackNetwork net;
  FaultInjectionTransport s(net.endpoint(kFrom), FaultInjectionTransport::Fault::kHangFirstSend);
  KvPaths r(net.endpoint(kTo));
  std::vector<uint8_t> layer(128, 4);
  auto hung = s.post_send(kTo, kReclaimedTag, whole_region(layer));  // the first transfer's: it never goes out
  REQUIRE(hung.is_ok());
  auto seal = s.post_send_bytes(kTo, kReclaimedTag, nullptr, 0);  // carries no KV: it goes
  REQUIRE(seal.is_ok());
  auto rec = r.post_reclaim(kFrom, kReclaimedTag);
  REQUIRE(rec.is_ok());
  CHECK(ended_as(r, *rec) == OpState::kDone);
  CHECK(net.messages_reclaimed() == 1);
  CHECK(ended_as(s, *hung) == OpState::kPending);
  CHECK(r.pending() == 0);
}

TEST_CASE("reclaim: the seal request and a decode rank's tag counts survive the wire") {
  const std::vector<uint8_t> seal_bytes = proto::serialize(proto::KvTagSeal{77, 1003, 5});
  auto seal = proto::deserialize(seal_bytes.data(), seal_bytes.size());
  REQUIRE(seal.is_ok());
  REQUIRE(std::holds_alternative<proto::KvTagSeal>(*seal));
  const auto& s = std::get<proto::KvTagSeal>(*seal);
  CHECK((s.id == 77 && s.tag == 1003 && s.epoch == 5));
  CHECK(std::string(proto::message_name(*seal)) == "KvTagSeal");
  proto::LoadReport lr;
  lr.kv_tags_retired = 3;
  lr.kv_tags_reclaiming = 2;
  const std::vector<uint8_t> load_bytes = proto::serialize(lr);
  auto load = proto::deserialize(load_bytes.data(), load_bytes.size());
  REQUIRE(load.is_ok());
  const auto& l = std::get<proto::LoadReport>(*load);
  CHECK((l.kv_tags_retired == 3 && l.kv_tags_reclaiming == 2));
}

}  // namespace
}  // namespace pd::test
