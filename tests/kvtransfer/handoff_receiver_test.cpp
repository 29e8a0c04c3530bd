// HandoffReceiver (kvtransfer/handoff_receiver.h) against the loopback
// transport, without a model: the layers and the trailer land; a cancelled
// handoff whose sender never sent ends broken (tag not reusable) once MPI lets
// go; a receive already matched to a stopped sender cannot be cancelled, only
// abandoned once the sender is gone; a refused post leaves the handoff unclean.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstring>

#include "kvtransfer/handoff_receiver.h"
#include "kvtransfer/forwarding_transport.h"
#include "kvtransfer/loopback_transport.h"

namespace pd::test::handoff_receiver {
namespace {

constexpr int kPrefill = 1, kDecode = 2, kLayers = 3, kTag = 41;
using Phase = HandoffReceiver::Phase;
const auto kT0 = std::chrono::steady_clock::time_point(std::chrono::hours(1));

struct Pages {
  std::vector<uint8_t> bytes = std::vector<uint8_t>(kLayers * 128, 0);
  HandoffReceiver::RegionOf region_of() {
    return [this](int layer, int) {
      KvRegion r;
      r.base = bytes.data();
      r.piece_bytes = 128;
      r.offsets = {static_cast<int64_t>(layer) * 128};
      return r;
    };
  }
};

// The prefill side, played by hand: every layer, then a trailer.
void send_all(Transport& t, Pages& src, uint64_t id, uint32_t epoch, std::vector<uint8_t>& trailer_bytes) {
  for (int l = 0; l < kLayers; ++l) {
    std::memset(src.bytes.data() + l * 128, 10 + l, 128);
    REQUIRE(t.post_send(kDecode, kTag, src.region_of()(l, 0)).is_ok());
  }
  KvTrailer tr;
  tr.request_id = id;
  tr.epoch = epoch;
  tr.first_token = 42;
  tr.checksums.assign(kLayers, 0);
  trailer_bytes = tr.serialize();
  REQUIRE(t.post_send_bytes(kDecode, kTag, trailer_bytes.data(), trailer_bytes.size()).is_ok());
}

TEST_CASE("handoff receiver: the layers and the trailer land, clean") {
  LoopbackNetwork net;
  auto rx_t = net.endpoint(kDecode);
  auto tx_t = net.endpoint(kPrefill);
  Pages dst, src;
  HandoffReceiver h(kPrefill, kLayers);
  CHECK(h.phase() == Phase::kIdle);
  CHECK(h.post(*rx_t, kTag, dst.region_of(), kT0).is_ok());
  CHECK(h.pending() == kLayers + 1);
  CHECK(h.poll(*rx_t, kT0) == Phase::kReceiving);
  std::vector<uint8_t> trailer;
  send_all(*tx_t, src, 9, 2, trailer);
  CHECK(h.poll(*rx_t, kT0 + std::chrono::milliseconds(5)) == Phase::kLanded);
  CHECK(h.all_ended());
  CHECK(h.clean());
  CHECK(h.last_progress() == kT0 + std::chrono::milliseconds(5));
  CHECK(dst.bytes == src.bytes);
  auto tr = h.trailer();
  REQUIRE(tr.is_ok());
  CHECK(tr->request_id == 9);
  CHECK(tr->epoch == 2);
  CHECK(tr->first_token == 42);
  h.mark_foreign();  // e.g. the trailer names another request
  CHECK_FALSE(h.clean());
}

TEST_CASE("handoff receiver: cancelled before anything was sent, it ends broken and not clean") {
  LoopbackNetwork net;
  auto rx_t = net.endpoint(kDecode);
  Pages dst;
  HandoffReceiver h(kPrefill, kLayers);
  REQUIRE(h.post(*rx_t, kTag, dst.region_of(), kT0).is_ok());
  h.cancel(*rx_t);
  CHECK(h.poll(*rx_t, kT0) == Phase::kBroken);
  CHECK(h.all_ended());
  CHECK_FALSE(h.clean());  // the tag must be retired: a late send could still match under it
  CHECK(rx_t->pending() == 0);
}

TEST_CASE("handoff receiver: receives matched by a stopped sender wait, abandoned once it is gone") {
  LoopbackNetwork net;
  auto rx_t = net.endpoint(kDecode);
  auto tx_t = net.endpoint(kPrefill);
  Pages dst, src;
  HandoffReceiver h(kPrefill, kLayers);
  REQUIRE(h.post(*rx_t, kTag, dst.region_of(), kT0).is_ok());
  net.freeze(kPrefill);
  std::vector<uint8_t> trailer;
  send_all(*tx_t, src, 9, 0, trailer);  // matched, but the stopped sender moves no bytes
  h.cancel(*rx_t);                      // matched receives cannot be cancelled
  CHECK(h.poll(*rx_t, kT0) == Phase::kReceiving);
  CHECK_FALSE(h.all_ended());
  net.kill(kPrefill);
  h.abandon(*rx_t);  // the sender's process is confirmed gone
  CHECK(h.all_ended());
  CHECK(h.phase() == Phase::kBroken);
  CHECK_FALSE(h.clean());
  CHECK(rx_t->pending() == 0);
}

// Refuses the n-th receive posted; everything else goes to the loopback.
class RefusingTransport final : public ForwardingTransport {
 public:
  RefusingTransport(std::unique_ptr<Transport> inner, int refuse_nth)
      : ForwardingTransport(std::move(inner)), left_(refuse_nth) {}
  Result<TransferOp> post_recv(int p, int t, const KvRegion& r) override {
    if (--left_ == 0) return Status::resource_exhausted("no receive slots (test)");
    return ForwardingTransport::post_recv(p, t, r);
  }

 private:
  int left_;
};

TEST_CASE("handoff receiver: a post the transport refuses leaves it unclean with what was posted") {
  LoopbackNetwork net;
  RefusingTransport rx_t(net.endpoint(kDecode), 2);
  Pages dst;
  HandoffReceiver h(kPrefill, kLayers);
  const Status st = h.post(rx_t, kTag, dst.region_of(), kT0);
  CHECK(st.code() == StatusCode::kResourceExhausted);
  CHECK_FALSE(h.clean());
  CHECK(h.pending() == 1);  // layer 0 was posted before the refusal
  h.cancel(rx_t);
  CHECK(h.poll(rx_t, kT0) == Phase::kBroken);
  CHECK(rx_t.pending() == 0);
}

}  // namespace
}  // namespace pd::test::handoff_receiver
