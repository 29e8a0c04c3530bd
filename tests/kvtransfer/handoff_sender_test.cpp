// HandoffSender (kvtransfer/handoff_sender.h) against the loopback transport,
// without a model: layers go out as they are written once accepted, in order,
// then the trailer; a handoff accepted after its pass sends everything at
// once; bytes that went out before finish() count as sent behind compute; a
// failed post fails the handoff; abandoning keeps the trailer's bytes alive.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstring>

#include "kvtransfer/forwarding_transport.h"
#include "kvtransfer/handoff_sender.h"
#include "kvtransfer/loopback_transport.h"

namespace pd::test::handoff_sender {
namespace {

constexpr int kPrefill = 1, kDecode = 2, kLayers = 4, kTag = 40;
using Phase = HandoffSender::Phase;

// A "cache" of kSegments segments of kLayers layers of 256 bytes each;
// segment s's layer l filled with 16 s + l + 1.
constexpr int kSegments = 2;
struct Cache {
  std::vector<uint8_t> bytes = std::vector<uint8_t>(kSegments * kLayers * 256, 0);
  HandoffSender::RegionOf region_of() {
    return [this](int layer, int segment) {
      KvRegion r;
      r.base = bytes.data();
      r.piece_bytes = 256;
      r.offsets = {static_cast<int64_t>(segment * kLayers + layer) * 256};
      return r;
    };
  }
  void write(int layer, int segment = 0) {
    std::memset(bytes.data() + (segment * kLayers + layer) * 256, 16 * segment + layer + 1, 256);
  }
};

// The decode side, played by hand: a receive per layer, then the trailer.
struct Receiver {
  std::unique_ptr<Transport> t;
  Cache cache;
  std::vector<TransferOp> ops;
  std::vector<uint8_t> trailer = std::vector<uint8_t>(KvTrailer::serialized_size(kLayers));
  explicit Receiver(LoopbackNetwork& net, int segments = 1) : t(net.endpoint(kDecode)) {
    for (int m = 0; m < segments * kLayers; ++m)
      ops.push_back(*t->post_recv(kPrefill, kTag, cache.region_of()(m % kLayers, m / kLayers)));
    ops.push_back(*t->post_recv_bytes(kPrefill, kTag, trailer.data(), trailer.size()));
  }
  int done() {
    int n = 0;
    for (TransferOp op : ops) {
      auto r = t->test(op);
      if (r.is_ok() && *r == OpState::kDone) ++n;
    }
    return n;
  }
};

const auto kT0 = std::chrono::steady_clock::time_point(std::chrono::hours(1));

TEST_CASE("handoff sender: a chunked prompt's complete segments go before its last pass, the rest layer by layer") {
  LoopbackNetwork net;
  auto t = net.endpoint(kPrefill);
  Cache cache;
  HandoffSender h(kDecode, 78, 3, kLayers, kSegments);
  REQUIRE(h.accept(kTag));
  Receiver rx(net, kSegments);
  // Earlier chunks wrote segment 0 in every layer (and part of segment 1).
  for (int l = 0; l < kLayers; ++l) cache.write(l, 0);
  h.post_written(*t, cache.region_of(), kT0);
  CHECK(h.bytes_posted() == 0);  // nothing is complete yet
  h.segments_done(1);
  h.post_written(*t, cache.region_of(), kT0);
  h.poll(*t, kT0);
  CHECK(h.bytes_sent() == 256 * kLayers);  // segment 0, all layers, before the last pass
  // The last pass writes segment 1 layer by layer: each goes as it lands.
  for (int l = 0; l < kLayers; ++l) {
    cache.write(l, 1);
    h.layer_written(l, 2000 + l);
    h.post_written(*t, cache.region_of(), kT0);
    h.poll(*t, kT0);
    CHECK(h.bytes_sent() == 256 * (kLayers + l + 1));
  }
  h.finish(5, false, *t, cache.region_of(), kT0);
  CHECK(h.poll(*t, kT0) == Phase::kSent);
  CHECK(rx.done() == kSegments * kLayers + 1);
  CHECK(rx.cache.bytes == cache.bytes);
}

TEST_CASE("handoff sender: accepted before the pass, each layer goes as it is written, then the trailer") {
  LoopbackNetwork net;
  auto t = net.endpoint(kPrefill);
  Cache cache;
  HandoffSender h(kDecode, 77, 3, kLayers);
  CHECK(h.phase() == Phase::kOffered);
  CHECK(h.accept(kTag));
  CHECK_FALSE(h.accept(kTag + 1));  // a duplicate changes nothing
  Receiver rx(net);
  for (int l = 0; l < kLayers; ++l) {
    cache.write(l);
    h.layer_written(l, 1000 + l);
    h.post_written(*t, cache.region_of(), kT0);
    CHECK(h.phase() == Phase::kAccepted);  // layers go out; the trailer waits for finish()
    h.poll(*t, kT0);
    CHECK(h.bytes_sent() == 256 * (l + 1));  // the loopback completes a matched pair at once
  }
  CHECK_FALSE(h.finished());
  h.finish(11, false, *t, cache.region_of(), kT0);
  CHECK(h.finished());
  CHECK(h.phase() == Phase::kSending);
  CHECK(h.poll(*t, kT0) == Phase::kSent);
  CHECK(rx.done() == kLayers + 1);
  CHECK(rx.cache.bytes == cache.bytes);
  auto tr = KvTrailer::deserialize(rx.trailer, kLayers);
  REQUIRE(tr.is_ok());
  CHECK(tr->request_id == 77);
  CHECK(tr->epoch == 3);
  CHECK(tr->first_token == 11);
  CHECK(tr->finished == 0);
  CHECK(tr->checksums == std::vector<uint64_t>{1000, 1001, 1002, 1003});
  CHECK(h.bytes_posted() == kLayers * 256);
  CHECK(h.in_flight() == 0);
}

// Counts expedite() calls and remembers the last op named.
class ExpediteRecorder final : public ForwardingTransport {
 public:
  using ForwardingTransport::ForwardingTransport;
  void expedite(TransferOp op) override {
    ++calls;
    last = op;
  }
  Result<TransferOp> post_send_bytes(int peer, int tag, const void* data, size_t bytes) override {
    auto op = ForwardingTransport::post_send_bytes(peer, tag, data, bytes);
    if (op.is_ok()) trailer = *op;
    return op;
  }
  int calls = 0;
  TransferOp last, trailer;
};

TEST_CASE("handoff sender: once token 1 is out its sends are expedited (the decode waits on them), accepted early or late") {
  for (bool accept_first : {true, false}) {
    INFO((accept_first ? "accepted before the pass" : "accepted after it"));
    LoopbackNetwork net;
    ExpediteRecorder t(net.endpoint(kPrefill));
    Cache cache;
    HandoffSender h(kDecode, 78, 1, kLayers);
    if (accept_first) h.accept(kTag);
    for (int l = 0; l < kLayers; ++l) {
      cache.write(l);
      h.layer_written(l, 0);
      h.post_written(t, cache.region_of(), kT0);
    }
    CHECK(t.calls == 0);  // nothing waits on KV of a prompt still computing
    h.finish(5, false, t, cache.region_of(), kT0);
    if (!accept_first) {
      CHECK(t.calls == 0);  // nothing posted yet
      h.accept(kTag);
      h.post_written(t, cache.region_of(), kT0);
    }
    CHECK(t.calls == 1);
    CHECK(t.last == t.trailer);
    Receiver rx(net);
    CHECK(h.poll(t, kT0) == Phase::kSent);
    CHECK(rx.done() == kLayers + 1);
  }
}

TEST_CASE("handoff sender: accepted after its pass, everything goes at once, nothing goes before the accept") {
  LoopbackNetwork net;
  auto t = net.endpoint(kPrefill);
  Cache cache;
  HandoffSender h(kDecode, 5, 0, kLayers);
  for (int l = 0; l < kLayers; ++l) {
    cache.write(l);
    h.layer_written(l, 0);
    h.post_written(*t, cache.region_of(), kT0);  // not accepted: holds
  }
  h.finish(9, true, *t, cache.region_of(), kT0);
  CHECK(h.phase() == Phase::kHeld);
  CHECK_FALSE(h.accepted());
  CHECK(h.bytes_posted() == 0);
  CHECK(t->pending() == 0);
  h.accept(kTag);
  CHECK(h.phase() == Phase::kFinishing);  // everything to post: the worker posts it now
  CHECK(h.accepted());
  Receiver rx(net);
  h.post_written(*t, cache.region_of(), kT0 + std::chrono::seconds(1));
  CHECK(h.send_started() == kT0 + std::chrono::seconds(1));
  CHECK(h.poll(*t, kT0 + std::chrono::seconds(2)) == Phase::kSent);
  CHECK(h.last_progress() == kT0 + std::chrono::seconds(2));
  CHECK(rx.done() == kLayers + 1);
  CHECK(KvTrailer::deserialize(rx.trailer, kLayers)->finished == 1);
}

TEST_CASE("handoff sender: a send that fails, or a failure outside, fails the handoff and stops its sends") {
  LoopbackNetwork net;
  auto t = net.endpoint(kPrefill);
  Cache cache;
  HandoffSender h(kDecode, 5, 0, kLayers);
  h.accept(kTag);
  // The decode side posted a receive too small for layer 0: the transfer fails.
  std::vector<uint8_t> small(16);
  auto bad = net.endpoint(kDecode);
  REQUIRE(bad->post_recv_bytes(kPrefill, kTag, small.data(), small.size()).is_ok());
  h.layer_written(0, 0);
  h.post_written(*t, cache.region_of(), kT0);
  CHECK(h.poll(*t, kT0) == Phase::kAccepted);  // the send completes; the receiver's side reports the error
  h.fail("KV checksum failed: test");
  CHECK(h.phase() == Phase::kFailed);
  CHECK(h.error() == "KV checksum failed: test");
  const int64_t posted = h.bytes_posted();
  h.finish(1, false, *t, cache.region_of(), kT0);
  CHECK(h.bytes_posted() == posted);  // nothing more goes out
  CHECK_FALSE(h.finished());
  CHECK(h.phase() == Phase::kFailed);
  CHECK(h.accepted());  // a failed handoff keeps its tag (the worker answers and seals by it)
}

TEST_CASE("handoff sender: phases move only along the table, a sent handoff stays sent when abandoned") {
  CHECK(legal(Phase::kOffered, Phase::kAccepted));
  CHECK(legal(Phase::kOffered, Phase::kHeld));
  CHECK(legal(Phase::kHeld, Phase::kFinishing));
  CHECK(legal(Phase::kAccepted, Phase::kFinishing));
  CHECK(legal(Phase::kFinishing, Phase::kSending));
  CHECK(legal(Phase::kSending, Phase::kSent));
  CHECK_FALSE(legal(Phase::kOffered, Phase::kSending));  // nothing goes out before the accept
  CHECK_FALSE(legal(Phase::kHeld, Phase::kAccepted));
  CHECK_FALSE(legal(Phase::kSent, Phase::kFailed));  // a handoff that is out stays out
  CHECK_FALSE(legal(Phase::kFailed, Phase::kSending));
  for (Phase p : {Phase::kOffered, Phase::kHeld, Phase::kAccepted, Phase::kFinishing, Phase::kSending})
    CHECK(legal(p, Phase::kFailed));
  CHECK(std::string(state_name(Phase::kFinishing)) == "finishing");
  // Abandoned once sent: it stays sent (nothing was in flight).
  LoopbackNetwork net;
  auto t = net.endpoint(kPrefill);
  Cache cache;
  HandoffSender h(kDecode, 8, 0, kLayers);
  h.accept(kTag);
  Receiver rx(net);
  h.finish(2, false, *t, cache.region_of(), kT0);
  REQUIRE(h.poll(*t, kT0) == Phase::kSent);
  std::deque<std::vector<uint8_t>> graveyard;
  h.abandon(*t, graveyard);
  CHECK(h.phase() == Phase::kSent);
  CHECK(graveyard.empty());
}

TEST_CASE("handoff sender: abandoned with sends in flight, the trailer's bytes stay alive") {
  LoopbackNetwork net;
  net.hang_sends(true);  // nothing ever completes
  auto t = net.endpoint(kPrefill);
  Cache cache;
  HandoffSender h(kDecode, 5, 0, kLayers);
  h.accept(kTag);
  h.finish(3, false, *t, cache.region_of(), kT0);
  CHECK(h.in_flight() == kLayers + 1);
  CHECK(h.poll(*t, kT0) == Phase::kSending);
  std::deque<std::vector<uint8_t>> graveyard;
  h.abandon(*t, graveyard);
  CHECK(h.in_flight() == 0);
  CHECK(t->pending() == 0);
  REQUIRE(graveyard.size() == 1);
  CHECK(graveyard.front().size() == KvTrailer::serialized_size(kLayers));
  CHECK(h.phase() == Phase::kFailed);
  // An abandoned handoff that had sent nothing leaves nothing behind.
  HandoffSender idle(kDecode, 6, 0, kLayers);
  idle.abandon(*t, graveyard);
  CHECK(graveyard.size() == 1);
}

}  // namespace
}  // namespace pd::test::handoff_sender
