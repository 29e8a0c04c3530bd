// The CPU part of the device KV transports: their MPI messages and the
// operation table (FIFO matching per peer and tag, cancellation, draining).
#include "kvtransfer/device_match.h"

#include <catch2/catch.hpp>

namespace {

pd::OpState reported(pd::DeviceOpTable& t, int64_t id) {
  auto r = t.report(id);
  REQUIRE(r.is_ok());
  return *r;
}

}  // namespace

TEST_CASE("device messages: every kind round-trips", "[device_match]") {
  pd::IpcDescriptor d;
  d.tag = 1234;
  d.seq = 0x0102030405060708ULL;
  for (size_t i = 0; i < d.handle.size(); ++i) d.handle[i] = static_cast<uint8_t>(i * 3 + 1);
  d.piece_bytes = 4096;
  d.offsets = {0, 8192, -1, 1LL << 40};
  auto back = pd::deserialize_device_msg(pd::serialize_device_msg(d));
  REQUIRE(back.is_ok());
  const auto* got = std::get_if<pd::IpcDescriptor>(&*back);
  REQUIRE(got != nullptr);
  CHECK(got->tag == 1234);
  CHECK(got->seq == d.seq);
  CHECK(got->handle == d.handle);
  CHECK(got->piece_bytes == 4096);
  CHECK(got->offsets == d.offsets);
  CHECK(pd::serialize_device_msg(d).size() == pd::serialized_size(d));

  auto ack = pd::deserialize_device_msg(pd::serialize_device_msg(pd::DeviceAck{-7, 99}));
  REQUIRE(ack.is_ok());
  REQUIRE(std::holds_alternative<pd::DeviceAck>(*ack));
  CHECK(std::get<pd::DeviceAck>(*ack).tag == -7);
  CHECK(std::get<pd::DeviceAck>(*ack).seq == 99);

  pd::NcclIdMsg id;
  id.id.fill(0xAB);
  id.id[127] = 1;
  auto idb = pd::deserialize_device_msg(pd::serialize_device_msg(id));
  REQUIRE(idb.is_ok());
  REQUIRE(std::holds_alternative<pd::NcclIdMsg>(*idb));
  CHECK(std::get<pd::NcclIdMsg>(*idb).id == id.id);

  auto env = pd::deserialize_device_msg(pd::serialize_device_msg(pd::NcclEnvelope{31000, 1ULL << 33}));
  REQUIRE(env.is_ok());
  REQUIRE(std::holds_alternative<pd::NcclEnvelope>(*env));
  CHECK(std::get<pd::NcclEnvelope>(*env).tag == 31000);
  CHECK(std::get<pd::NcclEnvelope>(*env).bytes == (1ULL << 33));
}

TEST_CASE("device messages: truncated, overlong, empty and unknown ones are Corruption", "[device_match]") {
  pd::IpcDescriptor d;
  d.piece_bytes = 64;
  d.offsets = {0, 64, 128};
  const std::vector<pd::DeviceMsg> msgs{d, pd::DeviceAck{1, 2}, pd::NcclIdMsg{}, pd::NcclEnvelope{3, 4}};
  for (const pd::DeviceMsg& m : msgs) {
    const std::vector<uint8_t> full = pd::serialize_device_msg(m);
    for (size_t n = 0; n < full.size(); ++n) {
      INFO("kind " << int(full[0]) << ", first " << n << " of " << full.size() << " bytes");
      CHECK(pd::deserialize_device_msg(std::span(full).first(n)).status().is_corruption());
    }
    std::vector<uint8_t> longer = full;
    longer.push_back(0);
    CHECK(pd::deserialize_device_msg(longer).status().is_corruption());
  }
  const std::vector<uint8_t> unknown{0x7F, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  auto u = pd::deserialize_device_msg(unknown);
  REQUIRE_FALSE(u.is_ok());
  CHECK(u.status().message().find("unknown kind 127") != std::string::npos);
  pd::IpcDescriptor empty;
  empty.piece_bytes = 64;
  CHECK(pd::deserialize_device_msg(pd::serialize_device_msg(empty)).status().is_corruption());
}

TEST_CASE("device ops: arrivals match posted receives oldest first, per peer and tag", "[device_match]") {
  pd::DeviceOpTable t;
  const int64_t a1 = t.add(false, 1, 1000);
  const int64_t b1 = t.add(false, 2, 1000);
  const int64_t a2 = t.add(false, 1, 1000);
  const int64_t c1 = t.add(false, 1, 1001);
  CHECK(t.match(1, 1001) == c1);
  CHECK(t.match(1, 1000) == a1);
  CHECK(t.match(1, 1000) == a2);
  CHECK(t.match(1, 1000) == std::nullopt);  // nothing posted: drain
  CHECK(t.match(2, 1000) == b1);
  CHECK(t.match(3, 1000) == std::nullopt);
  for (int64_t id : {a1, a2, b1, c1}) CHECK(reported(t, id) == pd::OpState::kPending);
  t.finish(a2);
  CHECK(reported(t, a2) == pd::OpState::kDone);
  CHECK(reported(t, a1) == pd::OpState::kPending);
  CHECK(t.size() == 3);
}

TEST_CASE("device ops: a cancelled receive is skipped, what arrives for it is drained", "[device_match]") {
  pd::DeviceOpTable t;
  const int64_t r1 = t.add(false, 1, 1000);
  const int64_t r2 = t.add(false, 1, 1000);
  CHECK(t.cancel(r1));
  CHECK_FALSE(t.cancel(r1));  // once
  CHECK(reported(t, r1) == pd::OpState::kCancelled);
  CHECK(t.report(r1).status().is_not_found());  // reported once, then released
  CHECK(t.match(1, 1000) == r2);                // the next arrival goes to the next receive
  CHECK(t.match(1, 1000) == std::nullopt);      // a late arrival finds none: drained

  // A matched receive cannot be cancelled: it completes normally.
  const int64_t r3 = t.add(false, 1, 1000);
  CHECK(t.match(1, 1000) == r3);
  CHECK_FALSE(t.cancel(r3));
  CHECK(reported(t, r3) == pd::OpState::kPending);
  t.finish(r3);
  CHECK(reported(t, r3) == pd::OpState::kDone);

  // Every receive of a tag cancelled (a handoff aborted): all arrivals drain.
  const int64_t r4 = t.add(false, 2, 1005);
  const int64_t r5 = t.add(false, 2, 1005);
  CHECK(t.cancel(r5));
  CHECK(t.cancel(r4));
  CHECK(t.match(2, 1005) == std::nullopt);
  CHECK(t.match(2, 1005) == std::nullopt);
}

TEST_CASE("device ops: a send is cancellable until it starts", "[device_match]") {
  pd::DeviceOpTable t;
  const int64_t s1 = t.add(true, 4, 1000);
  const int64_t s2 = t.add(true, 4, 1000);
  CHECK(t.match(4, 1000) == std::nullopt);  // sends never match arrivals
  CHECK(t.cancel(s1));
  CHECK_FALSE(t.start(s1));  // cancelled: its descriptor is never sent
  CHECK(reported(t, s1) == pd::OpState::kCancelled);
  CHECK(t.start(s2));
  CHECK_FALSE(t.start(s2));
  CHECK_FALSE(t.cancel(s2));  // started: pending until its ack
  CHECK(reported(t, s2) == pd::OpState::kPending);
  t.finish(s2);
  CHECK(reported(t, s2) == pd::OpState::kDone);
  t.finish(s2);  // a late completion of a released op is ignored
  CHECK(t.size() == 0);
}

TEST_CASE("device ops: failure, abandon and a peer's live ops", "[device_match]") {
  pd::DeviceOpTable t;
  const int64_t r1 = t.add(false, 1, 1000);
  const int64_t r2 = t.add(false, 1, 1000);
  const int64_t s1 = t.add(true, 1, 1001);
  const int64_t other = t.add(false, 2, 1000);
  CHECK(t.live_ops_with(1) == std::vector<int64_t>{r1, r2, s1});
  t.fail(r1, pd::Status::invalid_argument("sizes differ: 10 vs 20"));
  t.cancel(r1);                   // ended: unchanged
  CHECK(t.match(1, 1000) == r2);  // a failed queued receive left the queue
  auto f = t.report(r1);
  REQUIRE_FALSE(f.is_ok());
  CHECK(f.status().is_invalid_argument());
  CHECK(f.status().message() == "sizes differ: 10 vs 20");
  CHECK(t.live_ops_with(1) == std::vector<int64_t>{r2, s1});

  // Abandoned: forgotten at once, never reported; a queued receive leaves its queue.
  CHECK(t.abandon(other) == pd::DevicePhase::kQueued);
  CHECK(t.match(2, 1000) == std::nullopt);
  CHECK(t.report(other).status().is_not_found());
  CHECK(t.abandon(r2) == pd::DevicePhase::kInFlight);
  t.finish(r2);  // its copy ending later changes nothing
  CHECK(t.report(r2).status().is_not_found());
  CHECK(t.abandon(r2) == std::nullopt);
  CHECK(t.size() == 1);
  CHECK(t.find(s1) != nullptr);
  CHECK(t.find(s1)->send);
}
