// SendBudgetTransport (kvtransfer/send_budget.h) over the loopback transport:
// sends beyond a peer's budget wait in posting order and go out as earlier ones
// end; other peers are not held up; a waiting send can be cancelled or
// abandoned without ever being posted; receives pass straight through; sends a
// decode waits on (expedite) overtake the others, by tag, within the bound.
#include <catch2/catch.hpp>

#include <cstring>

#include "kvtransfer/forwarding_transport.h"
#include "kvtransfer/loopback_transport.h"
#include "kvtransfer/send_budget.h"

namespace pd::test {
namespace {

constexpr int kSender = 1, kPeerA = 2, kPeerB = 3;

TEST_CASE("send budget: sends past a peer's budget wait, in order, and go out as earlier ones end") {
  LoopbackNetwork net;
  SendBudgetTransport t(net.endpoint(kSender), SendBudget{2048, 1024, {}});
  auto a = net.endpoint(kPeerA);
  constexpr int kN = 5;
  std::vector<std::vector<uint8_t>> out(kN, std::vector<uint8_t>(4096)), in(kN, std::vector<uint8_t>(4096, 0));
  std::vector<TransferOp> sends;
  for (int i = 0; i < kN; ++i) {
    std::memset(out[i].data(), 1 + i, out[i].size());
    auto s = t.post_send(kPeerA, 7, whole_region(out[i]));
    REQUIRE(s.is_ok());
    sends.push_back(*s);
  }
  CHECK(t.charged(kPeerA) == 2048);  // two sends of 4 KiB, each charged the 1 KiB cap
  CHECK(t.waiting(kPeerA) == 3);
  CHECK(t.pending() == kN);

  // Another peer is not held up by the first one's queue.
  std::vector<uint8_t> other(256, 9), other_in(256, 0);
  auto ob = t.post_send(kPeerB, 7, whole_region(other));
  REQUIRE(ob.is_ok());
  CHECK(t.charged(kPeerB) == 256);
  auto b = net.endpoint(kPeerB);
  auto br = b->post_recv(kSender, 7, whole_region(other_in));
  REQUIRE(br.is_ok());
  CHECK(*t.test(*ob) == OpState::kDone);
  CHECK(other_in == other);
  CHECK(t.charged(kPeerB) == 0);

  std::vector<TransferOp> recvs;
  for (int i = 0; i < kN; ++i) {
    auto r = a->post_recv(kSender, 7, whole_region(in[i]));
    REQUIRE(r.is_ok());
    recvs.push_back(*r);
  }
  // Testing the sends moves the queue along: each that ends lets the next out.
  int done = 0;
  for (int round = 0; round < 20 && done < kN; ++round)
    for (int i = 0; i < kN; ++i) {
      if (sends[i].value < 0) continue;
      auto r = t.test(sends[i]);
      REQUIRE(r.is_ok());
      if (*r == OpState::kDone) {
        sends[i].value = -1;
        ++done;
      }
    }
  CHECK(done == kN);
  for (int i = 0; i < kN; ++i) {
    CHECK(*a->test(recvs[i]) == OpState::kDone);
    CHECK(in[i] == out[i]);  // posting order held under one tag
  }
  CHECK(t.charged(kPeerA) == 0);
  CHECK(t.pending() == 0);
}

TEST_CASE("send budget: a waiting send cancelled or abandoned is never posted") {
  LoopbackNetwork net;
  SendBudgetTransport t(net.endpoint(kSender), SendBudget{1024, 1024, {}});
  std::vector<uint8_t> first(1024, 1), second(1024, 2), third(1024, 3);
  auto s1 = t.post_send(kPeerA, 4, whole_region(first));
  auto s2 = t.post_send(kPeerA, 4, whole_region(second));
  auto s3 = t.post_send(kPeerA, 4, whole_region(third));
  REQUIRE((s1.is_ok() && s2.is_ok() && s3.is_ok()));
  CHECK(t.waiting(kPeerA) == 2);
  t.cancel(*s2);
  CHECK(*t.test(*s2) == OpState::kCancelled);
  t.abandon(*s3);
  CHECK(t.pending() == 1);
  CHECK(t.test(*s3).status().code() == StatusCode::kNotFound);

  // Only the first ever reaches the peer: its next receive under the tag stays unmatched.
  auto a = net.endpoint(kPeerA);
  std::vector<uint8_t> got(1024, 0), more(1024, 0);
  auto r1 = a->post_recv(kSender, 4, whole_region(got));
  auto r2 = a->post_recv(kSender, 4, whole_region(more));
  REQUIRE((r1.is_ok() && r2.is_ok()));
  CHECK(*t.test(*s1) == OpState::kDone);
  CHECK(*a->test(*r1) == OpState::kDone);
  CHECK(got == first);
  CHECK(*a->test(*r2) == OpState::kPending);
  CHECK(t.charged(kPeerA) == 0);
  a->cancel(*r2);
  CHECK(*a->test(*r2) == OpState::kCancelled);
}

TEST_CASE("send budget: abandoning a posted send gives its charge back and lets the next one out") {
  LoopbackNetwork net;
  SendBudgetTransport t(net.endpoint(kSender), SendBudget{1024, 1024, {}});
  std::vector<uint8_t> stuck(1024, 1), next(1024, 2), got(1024, 0);
  auto s1 = t.post_send(kPeerA, 4, whole_region(stuck));
  auto s2 = t.post_send(kPeerA, 5, whole_region(next));
  REQUIRE((s1.is_ok() && s2.is_ok()));
  CHECK(t.waiting(kPeerA) == 1);
  t.abandon(*s1);  // its handoff ended; nobody will receive it
  CHECK(t.waiting(kPeerA) == 0);
  CHECK(t.charged(kPeerA) == 1024);  // the second is in flight now
  auto a = net.endpoint(kPeerA);
  auto r = a->post_recv(kSender, 5, whole_region(got));
  REQUIRE(r.is_ok());
  CHECK(*t.test(*s2) == OpState::kDone);
  CHECK(got == next);
}

TEST_CASE("send budget: receives pass straight through") {
  LoopbackNetwork net;
  SendBudgetTransport t(net.endpoint(kPeerA), SendBudget{1, 1, {}});
  auto s = net.endpoint(kSender);
  std::vector<uint8_t> buf(64, 0), src(64, 5);
  auto r1 = t.post_recv(kSender, 2, whole_region(buf));
  auto r2 = t.post_recv_bytes(kSender, 3, buf.data(), 8);
  REQUIRE((r1.is_ok() && r2.is_ok()));
  auto ss = s->post_send(kPeerA, 2, whole_region(src));
  REQUIRE(ss.is_ok());
  CHECK(*t.test(*r1) == OpState::kDone);
  CHECK(buf == src);
  CHECK(t.charged(kSender) == 0);
  t.cancel(*r2);
  CHECK(*t.test(*r2) == OpState::kCancelled);
}

// Records the tag of every send posted through it, in order.
class RecordingTransport final : public ForwardingTransport {
 public:
  RecordingTransport(std::unique_ptr<Transport> inner, std::vector<int>* tags)
      : ForwardingTransport(std::move(inner)), tags_(tags) {}
  Result<TransferOp> post_send(int peer, int tag, const KvRegion& region) override {
    tags_->push_back(tag);
    return ForwardingTransport::post_send(peer, tag, region);
  }
  Result<TransferOp> post_send_bytes(int peer, int tag, const void* data, size_t bytes) override {
    tags_->push_back(tag);
    return ForwardingTransport::post_send_bytes(peer, tag, data, bytes);
  }

 private:
  std::vector<int>* tags_;
};

// Tests every send until all ended; each that ends lets the next out.
void drain(SendBudgetTransport& t, std::vector<TransferOp> sends) {
  for (int round = 0; round < 100 && !sends.empty(); ++round)
    std::erase_if(sends, [&](TransferOp op) {
      auto r = t.test(op);
      REQUIRE(r.is_ok());
      return *r != OpState::kPending;
    });
  CHECK(sends.empty());
}

TEST_CASE("send budget: a handoff a decode waits on goes ahead of a prompt still computing, its sends in order") {
  LoopbackNetwork net;
  std::vector<int> posted;
  SendBudgetTransport t(std::make_unique<RecordingTransport>(net.endpoint(kSender), &posted), SendBudget{1024, 1024, {}});
  auto a = net.endpoint(kPeerA);
  constexpr int kLong = 10, kShort = 20;  // a long prompt's segments; a short one's rest and trailer
  std::vector<std::vector<uint8_t>> out, in;
  for (int i = 0; i < 6; ++i) {
    out.emplace_back(1024, static_cast<uint8_t>(i + 1));
    in.emplace_back(1024, 0);
  }
  std::vector<TransferOp> sends;
  auto send = [&](int tag, int i) {
    auto s = t.post_send(kPeerA, tag, whole_region(out[i]));
    REQUIRE(s.is_ok());
    sends.push_back(*s);
    return *s;
  };
  send(kLong, 0);   // in flight at once: the budget holds one
  send(kLong, 1);   // waiting, nothing waits on them yet
  send(kLong, 2);
  send(kShort, 3);  // the short prompt's last segment ...
  const TransferOp trailer = send(kShort, 4);
  CHECK(t.waiting(kPeerA) == 4);
  t.expedite(trailer);  // ... its token 1 is out: its decode waits on these
  // The first of them goes at once, one charge past the full budget: it does
  // not wait for the bulk send in flight to end.
  CHECK(t.waiting(kPeerA) == 3);
  CHECK(t.charged(kPeerA) == 2048);
  send(kShort, 5);  // a later send under its tag joins them (and waits: one past the budget at most)
  CHECK(t.waiting(kPeerA) == 4);
  // The receiver posts per tag, in each tag's order.
  std::vector<TransferOp> recvs;
  for (int i : {0, 1, 2}) recvs.push_back(*a->post_recv(kSender, kLong, whole_region(in[i])));
  for (int i : {3, 4, 5}) recvs.push_back(*a->post_recv(kSender, kShort, whole_region(in[i])));
  drain(t, sends);
  CHECK(posted == std::vector<int>{kLong, kShort, kShort, kShort, kLong, kLong});
  for (int i = 0; i < 6; ++i) CHECK(in[i] == out[i]);  // each tag's sends met its receives in order
}

// Once a tag's waiting sends a decode waited on are gone (abandoned: the
// handoff ended), a new send under the tag — the next handoff's — is not
// taken for one of them: it waits its turn behind older sends.
TEST_CASE("send budget: a tag's sends a decode waited on, once abandoned, do not speed the tag's next send") {
  LoopbackNetwork net;
  std::vector<int> posted;
  SendBudgetTransport t(std::make_unique<RecordingTransport>(net.endpoint(kSender), &posted), SendBudget{1024, 1024, {}});
  auto a = net.endpoint(kPeerA);
  std::vector<std::vector<uint8_t>> out(5, std::vector<uint8_t>(1024, 3)), in(5, std::vector<uint8_t>(1024, 0));
  const TransferOp first = *t.post_send(kPeerA, 1, whole_region(out[0]));  // in flight
  const TransferOp older = *t.post_send(kPeerA, 2, whole_region(out[1]));  // waits, nothing waits on it
  const TransferOp segment = *t.post_send(kPeerA, 3, whole_region(out[2]));
  const TransferOp trailer = *t.post_send(kPeerA, 3, whole_region(out[3]));
  t.expedite(trailer);  // the segment goes past the full budget; the trailer waits, a decode waiting on it
  CHECK(t.waiting(kPeerA) == 2);
  t.abandon(trailer);  // its handoff ended
  const TransferOp next = *t.post_send(kPeerA, 3, whole_region(out[4]));  // the tag's next handoff
  for (auto [tag, i] : {std::pair{1, 0}, {3, 2}, {2, 1}, {3, 4}}) (void)*a->post_recv(kSender, tag, whole_region(in[i]));
  drain(t, {first, older, segment, next});
  CHECK(posted == std::vector<int>{1, 3, 2, 3});
}

TEST_CASE("send budget: a send overtaken past the bound goes next") {
  LoopbackNetwork net;
  std::vector<int> posted;
  SendBudget budget{1024, 1024, {}};
  budget.order.max_bypass_bytes = 2048;
  SendBudgetTransport t(std::make_unique<RecordingTransport>(net.endpoint(kSender), &posted), budget);
  auto a = net.endpoint(kPeerA);
  std::vector<std::vector<uint8_t>> out(8, std::vector<uint8_t>(1024, 7)), in(8, std::vector<uint8_t>(1024, 0));
  std::vector<TransferOp> sends;
  sends.push_back(*t.post_send(kPeerA, 1, whole_region(out[0])));  // in flight
  sends.push_back(*t.post_send(kPeerA, 2, whole_region(out[1])));  // nothing waits on it
  for (int i = 2; i < 8; ++i) {  // one handoff after another whose decode waits
    sends.push_back(*t.post_send(kPeerA, 10 + i, whole_region(out[i])));
    t.expedite(sends.back());
  }
  for (int i = 0; i < 8; ++i) (void)*a->post_recv(kSender, i == 0 ? 1 : i == 1 ? 2 : 10 + i, whole_region(in[i]));
  drain(t, sends);
  // Three 1 KiB sends overtook tag 2 (3 KiB > 2 KiB); then it went.
  CHECK(posted == std::vector<int>{1, 12, 13, 14, 2, 15, 16, 17});
}

}  // namespace
}  // namespace pd::test
