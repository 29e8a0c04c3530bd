// The seam between the router's HTTP front and its link loop (front_link.h):
// the inbox keeps the io threads' order (a client that left lands after its
// choices), the status hands the front one consistent snapshot, the queued
// count moves both ways, and the lifecycles (the router's, an answer's) take
// only their legal moves.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "router/answer.h"
#include "router/front_link.h"
#include "util/lifecycle.h"

namespace pd::router {
namespace {

// A writer that keeps the disconnect hook, so the test can play the client leaving.
class HookWriter : public ResponseWriter {
 public:
  bool respond(int, std::string, std::string, std::vector<std::pair<std::string, std::string>>) override {
    return true;
  }
  bool start_sse() override { return true; }
  bool send_event(std::string) override { return true; }
  bool finish() override { return true; }
  void on_disconnect(std::function<void()> cb) override { hook = std::move(cb); }
  std::function<void()> hook;
};

std::unique_ptr<Request> request(uint64_t id) {
  auto r = std::make_unique<Request>();
  r->wire_id = r->http_id = id;
  return r;
}

TEST_CASE("front link: the inbox hands the link what the io threads posted, in order", "[router][front_link]") {
  LinkInbox inbox;
  CHECK(inbox.take().empty());
  auto w = std::make_shared<HookWriter>();
  {
    LinkInbox::Batch batch(inbox);
    w->on_disconnect([&inbox] { inbox.post(ClientGone{{1, 2}}); });
    batch.add(NewRequest{request(1)});
    batch.add(NewRequest{request(2)});
  }
  inbox.post(DrainRank{3, w});
  REQUIRE(w->hook);
  w->hook();  // the client leaves: its choices are named after they were posted
  auto items = inbox.take();
  REQUIRE(items.size() == 4);
  CHECK(std::get<NewRequest>(items[0]).req->http_id == 1);
  CHECK(std::get<NewRequest>(items[1]).req->http_id == 2);
  CHECK(std::get<DrainRank>(items[2]).rank == 3);
  CHECK(std::get<ClientGone>(items[3]).http_ids == std::vector<uint64_t>{1, 2});
  CHECK(inbox.take().empty());  // taken once
}

TEST_CASE("front link: a post from another thread waits for the batch being posted", "[router][front_link]") {
  LinkInbox inbox;
  std::thread other;
  {
    LinkInbox::Batch batch(inbox);
    other = std::thread([&inbox] { inbox.post(ClientGone{{9}}); });  // a disconnect hook on an io thread
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    batch.add(NewRequest{request(9)});
    inbox.post(DrainRank{1, nullptr});  // the batch's own thread may post (a hook run inline)
  }
  other.join();
  auto items = inbox.take();
  REQUIRE(items.size() == 3);
  CHECK(std::holds_alternative<NewRequest>(items[0]));
  CHECK(std::holds_alternative<DrainRank>(items[1]));
  CHECK(std::holds_alternative<ClientGone>(items[2]));
}

TEST_CASE("front link: the status is one snapshot, published whole", "[router][front_link]") {
  LinkStatus status;
  const LinkSnapshot first = status.snapshot();
  CHECK(first.state == RouterState::kServing);
  CHECK_FALSE(first.ready);
  CHECK(first.ranks_json == "[]");
  CHECK_FALSE(status.stopping());
  LinkSnapshot s;
  s.ready = true;
  s.degraded = true;
  s.not_ready_reason = "no decode rank is up";
  s.ranks_json = R"([{"rank":1}])";
  status.publish(s);
  const LinkSnapshot got = status.snapshot();
  CHECK(got.ready);
  CHECK(got.degraded);
  CHECK(got.not_ready_reason == "no decode rank is up");
  CHECK(got.ranks_json == R"([{"rank":1}])");
  s.state = RouterState::kStopping;
  status.publish(s);
  CHECK(status.stopping());
  // A reader on another thread sees a whole snapshot, never a mix of two.
  LinkSnapshot a, b;
  a.ready = true;
  a.ranks_json = "A";
  b.ranks_json = "B";
  status.publish(b);
  std::thread writer([&] {
    for (int i = 0; i < 2000; ++i) status.publish(i % 2 ? a : b);
  });
  for (int i = 0; i < 2000; ++i) {
    const LinkSnapshot r = status.snapshot();
    CHECK(r.ready == (r.ranks_json == "A"));
  }
  writer.join();
}

TEST_CASE("front link: the queued count: the front adds what it accepts, the link takes away", "[router][front_link]") {
  LinkStatus status;
  CHECK(status.queued() == 0);
  status.add_queued(3);  // an answer of three choices accepted
  status.add_queued(-1);  // one dispatched
  status.add_queued(1);   // one re-run
  CHECK(status.queued() == 3);
}

TEST_CASE("front link: ids are unique across threads", "[router][front_link]") {
  RequestIds ids;
  std::vector<uint64_t> a, b;
  std::thread t([&] {
    for (int i = 0; i < 1000; ++i) a.push_back(ids.next());
  });
  for (int i = 0; i < 1000; ++i) b.push_back(ids.next());
  t.join();
  std::vector<uint64_t> all = a;
  all.insert(all.end(), b.begin(), b.end());
  std::sort(all.begin(), all.end());
  CHECK(std::adjacent_find(all.begin(), all.end()) == all.end());
  CHECK(all.front() == 1);
}

TEST_CASE("front link: the router's lifecycle is serving -> stopping -> stopped", "[router][front_link]") {
  using S = RouterState;
  CHECK(legal(S::kServing, S::kStopping));
  CHECK(legal(S::kStopping, S::kStopped));
  CHECK(legal(S::kServing, S::kStopped));  // finish() without a stop (tests)
  CHECK_FALSE(legal(S::kStopping, S::kServing));
  CHECK_FALSE(legal(S::kStopped, S::kServing));
  CHECK_FALSE(legal(S::kStopped, S::kStopping));
  CHECK_FALSE(legal(S::kStopping, S::kStopping));
  // (An illegal transition() aborts a Debug build, so only legal ones run here.)
  const int64_t before = illegal_transitions();
  S s = S::kServing;
  CHECK(transition(s, S::kStopping, 0, "test"));
  CHECK(transition(s, S::kStopped, 0, "test"));
  CHECK(s == S::kStopped);
  CHECK(illegal_transitions() == before);
  CHECK(std::string(state_name(S::kStopped)) == "stopped");
}

TEST_CASE("request: an attempt's leg goes prefill -> decode, and a new attempt starts at prefill",
          "[router][front_link]") {
  using L = AttemptLeg;
  CHECK(legal(L::kPrefill, L::kDecode));
  CHECK_FALSE(legal(L::kDecode, L::kDecode));  // token 0 arrives once per attempt
  CHECK(legal(L::kDecode, L::kPrefill));       // a migration after tokens
  CHECK(legal(L::kPrefill, L::kPrefill));      // a re-run before token 0
}

TEST_CASE("front link: an answer is given once", "[router][front_link]") {
  using A = AnswerState;
  for (A to : {A::kAnswered, A::kFailed, A::kAbandoned}) {
    CHECK(legal(A::kOpen, to));
    for (A again : {A::kOpen, A::kAnswered, A::kFailed, A::kAbandoned}) CHECK_FALSE(legal(to, again));
  }
  Response r;
  r.choices = {5};
  CHECK_FALSE(r.ended());
  r.end(A::kAbandoned);
  CHECK(r.ended());
  CHECK(r.state == A::kAbandoned);
}

}  // namespace
}  // namespace pd::router
