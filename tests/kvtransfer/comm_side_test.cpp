// The communication side (kvtransfer/comm_side.h) over the fake channel and the
// loopback transport: what the compute side's ends promise — messages both
// ways with their arrival time, look-ahead drains that keep order, operations
// posted in order and reported once, cancel/abandon, refusals, heartbeats while
// the compute side is busy and none once it is wedged, no spinning when idle —
// and the MPI thread check that keeps compute threads off MPI.
#include <catch2/catch.hpp>
#include <mpi.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstring>
#include <mutex>
#include <thread>

#include "kvtransfer/comm_side.h"
#include "fake_channel.h"
#include "kvtransfer/loopback_transport.h"
#include "protocol/mpi_thread_check.h"
#include "test_support.h"

namespace pd::test {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// The fakes belong to one thread; these decorators let a communication thread
// and the test's thread share them (every call under one mutex).
class LockedChannel final : public ControlChannel {
 public:
  LockedChannel(std::unique_ptr<ControlChannel> inner, std::shared_ptr<std::mutex> mu)
      : inner_(std::move(inner)), mu_(std::move(mu)) {}
  void send(int dest, const proto::Message& m) override {
    std::lock_guard lock(*mu_);
    inner_->send(dest, m);
  }
  int receive(const std::function<void(int, proto::Message&)>& fn, int max) override {
    std::lock_guard lock(*mu_);
    return inner_->receive(fn, max);
  }
  void progress() override {}
  size_t pending_sends() const override { return 0; }
  bool flush(std::chrono::milliseconds) override { return true; }
  void forget(int rank) override {
    std::lock_guard lock(*mu_);
    inner_->forget(rank);
  }

 private:
  std::unique_ptr<ControlChannel> inner_;
  std::shared_ptr<std::mutex> mu_;
};

class LockedTransport final : public Transport {
 public:
  LockedTransport(std::unique_ptr<Transport> inner, std::shared_ptr<std::mutex> mu)
      : inner_(std::move(inner)), mu_(std::move(mu)) {}
  std::string name() const override { return inner_->name(); }
  Result<TransferOp> post_send(int peer, int tag, const KvRegion& r) override {
    std::lock_guard lock(*mu_);
    return inner_->post_send(peer, tag, r);
  }
  Result<TransferOp> post_recv(int peer, int tag, const KvRegion& r) override {
    std::lock_guard lock(*mu_);
    return inner_->post_recv(peer, tag, r);
  }
  Result<TransferOp> post_send_bytes(int peer, int tag, const void* d, size_t n) override {
    std::lock_guard lock(*mu_);
    return inner_->post_send_bytes(peer, tag, d, n);
  }
  Result<TransferOp> post_recv_bytes(int peer, int tag, void* d, size_t n) override {
    std::lock_guard lock(*mu_);
    return inner_->post_recv_bytes(peer, tag, d, n);
  }
  Result<OpState> test(TransferOp op) override {
    std::lock_guard lock(*mu_);
    return inner_->test(op);
  }
  void cancel(TransferOp op) override {
    std::lock_guard lock(*mu_);
    inner_->cancel(op);
  }
  void abandon(TransferOp op) override {
    std::lock_guard lock(*mu_);
    inner_->abandon(op);
  }
  Result<TransferOp> post_reclaim(int peer, int tag) override {
    std::lock_guard lock(*mu_);
    return inner_->post_reclaim(peer, tag);
  }
  size_t pending() const override {
    std::lock_guard lock(*mu_);
    return inner_->pending();
  }

 private:
  std::unique_ptr<Transport> inner_;
  std::shared_ptr<std::mutex> mu_;
};

// Two ranks (1 and 2) with a communication side each; the test plays rank 0 (the router).
struct Pair {
  std::shared_ptr<std::mutex> mu = std::make_shared<std::mutex>();
  FakeChannelHub hub;
  LoopbackNetwork net;
  std::unique_ptr<CommSide> side[3];
  std::unique_ptr<ControlChannel> channel[3];
  std::unique_ptr<Transport> transport[3];

  explicit Pair(CommSideOptions opts = {}) {
    for (int r : {1, 2}) {
      side[r] = std::make_unique<CommSide>(std::make_unique<LockedChannel>(hub.endpoint(r), mu),
                                           std::make_unique<LockedTransport>(net.endpoint(r), mu), opts);
      channel[r] = side[r]->channel();
      transport[r] = side[r]->transport();
      side[r]->start();
    }
  }
  ~Pair() {
    for (int r : {1, 2}) side[r]->stop();
  }
  void send_as_router(int dest, const proto::Message& m) {
    std::lock_guard lock(*mu);
    hub.send(0, dest, m);
  }
  std::vector<std::pair<int, proto::Message>> router_inbox() {
    std::lock_guard lock(*mu);
    return hub.take_all(0);
  }
};

// Polls `done` for up to two seconds (the communication thread runs every
// millisecond or so when idle).
template <typename F>
bool eventually(F done, std::chrono::milliseconds limit = 2000ms) {
  const auto end = Clock::now() + limit;
  while (Clock::now() < end) {
    if (done()) return true;
    std::this_thread::sleep_for(200us);
  }
  return done();
}

Result<OpState> wait_op(Transport& t, TransferOp op) {
  Result<OpState> r = OpState::kPending;
  eventually([&] {
    r = t.test(op);
    return !r.is_ok() || *r != OpState::kPending;
  });
  return r;
}

KvRegion bytes_region(std::vector<uint8_t>& buf, int64_t piece) {
  KvRegion r;
  r.base = buf.data();
  r.piece_bytes = piece;
  for (int64_t off = 0; off + piece <= static_cast<int64_t>(buf.size()); off += piece) r.offsets.push_back(off);
  return r;
}

TEST_CASE("comm side: messages out go at once, messages in wait in the inbox with their arrival time") {
  Pair p;
  p.channel[1]->send(0, proto::Drained{});
  REQUIRE(eventually([&] {
    auto got = p.router_inbox();
    return got.size() == 1 && std::holds_alternative<proto::Drained>(got[0].second) && got[0].first == 1;
  }));
  REQUIRE(eventually([&] { return p.channel[1]->pending_sends() == 0; }));

  p.channel[1]->wait_for_work(std::chrono::microseconds(1000));  // catch up with the exchange above
  const auto before = Clock::now();
  p.send_as_router(1, proto::Cancel{7});
  // Once the communication side has taken it off the network (wait_for_work
  // returns), it waits in the inbox: 30 ms here, however busy the machine.
  p.channel[1]->wait_for_work(std::chrono::microseconds(2000000));
  std::this_thread::sleep_for(30ms);
  int seen = 0;
  Clock::time_point arrived{};
  REQUIRE(eventually([&] {
    p.channel[1]->receive([&](int source, proto::Message& m) {
      CHECK(source == 0);
      CHECK(std::get<proto::Cancel>(m).id == 7);
      REQUIRE(p.channel[1]->arrival().has_value());
      arrived = *p.channel[1]->arrival();
      ++seen;
    });
    return seen == 1;
  }));
  CHECK(arrived >= before);
  CHECK(Clock::now() - arrived >= 25ms);  // the wait in the inbox shows
}

TEST_CASE("comm side: wait_for_work returns when a message arrives or an operation ends, else at its limit") {
  Pair p;
  p.channel[1]->wait_for_work(std::chrono::microseconds(1000));  // catch up with what happened at start
  auto t0 = Clock::now();
  p.channel[1]->wait_for_work(std::chrono::microseconds(30000));  // nothing comes
  CHECK(Clock::now() - t0 >= 25ms);

  std::thread router([&] {
    std::this_thread::sleep_for(20ms);
    p.send_as_router(1, proto::Cancel{3});
  });
  t0 = Clock::now();
  p.channel[1]->wait_for_work(std::chrono::microseconds(2000000));
  const auto waited = Clock::now() - t0;
  router.join();
  CHECK(waited < 1s);  // woken by the arrival, long before the limit
  int seen = 0;
  p.channel[1]->receive([&](int, proto::Message&) { ++seen; });
  CHECK(seen == 1);

  // An operation that ends wakes it too.
  std::vector<uint8_t> out(256, 1), in(256, 0);
  auto r = p.transport[2]->post_recv(1, 3, bytes_region(in, 256));
  REQUIRE(r.is_ok());
  p.channel[2]->wait_for_work(std::chrono::microseconds(20000));  // settle: the post itself
  std::thread sender([&] {
    std::this_thread::sleep_for(20ms);
    (void)p.transport[1]->post_send(2, 3, bytes_region(out, 256));
  });
  t0 = Clock::now();
  bool done = false;
  while (!done && Clock::now() - t0 < 1s) {
    p.channel[2]->wait_for_work(std::chrono::microseconds(2000000));
    auto st = p.transport[2]->test(*r);
    done = st.is_ok() && *st == OpState::kDone;
  }
  sender.join();
  CHECK(done);
  CHECK(Clock::now() - t0 < 1s);
}

TEST_CASE("comm side: receive_while takes messages until the first refused one and keeps the rest in order") {
  Pair p;
  p.send_as_router(1, proto::Cancel{1});
  p.send_as_router(1, proto::Drain{});
  p.send_as_router(1, proto::Cancel{2});
  REQUIRE(eventually([&] { return p.side[1]->stats().messages_in == 3; }));  // all three in the inbox
  std::vector<std::string> order;
  auto record = [&](int, proto::Message& m) { order.push_back(proto::message_name(m)); };
  const auto only_cancels = [](int, const proto::Message& m) { return std::holds_alternative<proto::Cancel>(m); };
  CHECK(p.channel[1]->receive_while(only_cancels, record) == 1);
  CHECK(p.channel[1]->receive_while(only_cancels, record) == 0);  // Drain blocks the Cancel behind it
  CHECK(p.channel[1]->receive(record) == 2);
  CHECK(order == std::vector<std::string>{"Cancel", "Drain", "Cancel"});
}

TEST_CASE("comm side: operations are posted in order, move without the compute side, and end once") {
  Pair p;
  constexpr int kN = 4;
  std::vector<std::vector<uint8_t>> out(kN, std::vector<uint8_t>(4096)), in(kN, std::vector<uint8_t>(4096, 0));
  std::vector<TransferOp> sends, recvs;
  for (int i = 0; i < kN; ++i) {
    std::memset(out[i].data(), 10 + i, out[i].size());
    auto r = p.transport[2]->post_recv(1, 5, bytes_region(in[i], 1024));
    REQUIRE(r.is_ok());
    recvs.push_back(*r);
  }
  for (int i = 0; i < kN; ++i) {
    auto s = p.transport[1]->post_send(2, 5, bytes_region(out[i], 1024));
    REQUIRE(s.is_ok());
    sends.push_back(*s);
  }
  CHECK(p.transport[1]->pending() == kN);
  // Nobody on the compute side calls anything; the bytes still land.
  REQUIRE(eventually([&] {
    std::lock_guard lock(*p.mu);
    return p.net.bytes_moved() == kN * 4096;
  }));
  for (int i = 0; i < kN; ++i) {
    CHECK(*wait_op(*p.transport[1], sends[i]) == OpState::kDone);
    CHECK(*wait_op(*p.transport[2], recvs[i]) == OpState::kDone);
    CHECK(in[i] == out[i]);  // FIFO per (source, dest, tag): posting order held
  }
  CHECK(p.transport[1]->pending() == 0);
  CHECK(p.transport[2]->pending() == 0);
  CHECK(p.transport[1]->test(sends[0]).status().code() == StatusCode::kNotFound);  // reported once
}

TEST_CASE("comm side: cancel ends an unmatched receive, abandon forgets an operation, refusals reach test()") {
  Pair p;
  std::vector<uint8_t> buf(1024), small(512), big(1024, 3);
  auto r = p.transport[2]->post_recv(1, 9, bytes_region(buf, 1024));
  REQUIRE(r.is_ok());
  p.transport[2]->cancel(*r);
  CHECK(*wait_op(*p.transport[2], *r) == OpState::kCancelled);

  auto lost = p.transport[2]->post_recv(1, 10, bytes_region(buf, 1024));
  REQUIRE(lost.is_ok());
  p.transport[2]->abandon(*lost);
  CHECK(p.transport[2]->pending() == 0);
  CHECK(p.transport[2]->test(*lost).status().code() == StatusCode::kNotFound);

  // A receive smaller than its send: the loopback reports it on the receive.
  auto rs = p.transport[2]->post_recv(1, 11, bytes_region(small, 512));
  auto ss = p.transport[1]->post_send(2, 11, bytes_region(big, 1024));
  REQUIRE(rs.is_ok());
  REQUIRE(ss.is_ok());
  CHECK_FALSE(wait_op(*p.transport[2], *rs).is_ok());

  KvPathChoice nccl;
  nccl.path = KvPath::kNccl;
  const Status st = p.transport[1]->select_path(2, nccl);
  CHECK(st.code() == StatusCode::kUnsupported);
  CHECK_THAT(st.message(), Catch::Contains("nccl"));
}

TEST_CASE("comm side: a reclaim takes what the peer left under the tag, behind the compute side's back, to its seal") {
  Pair p;
  std::vector<uint8_t> stale(2048, 6);
  auto s1 = p.transport[1]->post_send(2, 12, bytes_region(stale, 1024));  // nobody receives it
  REQUIRE(s1.is_ok());
  auto rec = p.transport[2]->post_reclaim(1, 12);
  REQUIRE(rec.is_ok());
  CHECK(*wait_op(*p.transport[1], *s1) == OpState::kDone);  // taken on the thread, while the test waits
  CHECK(*p.transport[2]->test(*rec) == OpState::kPending);
  auto seal = p.transport[1]->post_send_bytes(2, 12, nullptr, 0);
  REQUIRE(seal.is_ok());
  CHECK(*wait_op(*p.transport[2], *rec) == OpState::kDone);
  CHECK(*wait_op(*p.transport[1], *seal) == OpState::kDone);
  CHECK(p.transport[2]->pending() == 0);
}

TEST_CASE("comm side: heartbeats while the compute side is busy, none once it is wedged") {
  CommSideOptions opts;
  opts.router = 0;
  opts.heartbeat = 20ms;
  opts.compute_stall = 150ms;
  Pair p(opts);
  proto::LoadReport report;
  report.waiting = 3;
  report.epoch = 2;
  p.channel[1]->send(0, report);
  // Busy: the compute side touches its ends (as a layer hook does) but sends nothing.
  const auto busy_until = Clock::now() + 120ms;
  while (Clock::now() < busy_until) {
    p.channel[1]->progress();
    std::this_thread::sleep_for(5ms);
  }
  auto got = p.router_inbox();
  REQUIRE(got.size() >= 3);  // the report, then repeats every ~20 ms
  for (auto& [source, m] : got) {
    CHECK(source == 1);
    const auto& r = std::get<proto::LoadReport>(m);
    CHECK(r.waiting == 3);
    CHECK(r.epoch == 2);
  }
  // Wedged: no call from the compute side for longer than compute_stall.
  std::this_thread::sleep_for(200ms);
  (void)p.router_inbox();
  std::this_thread::sleep_for(150ms);
  CHECK(p.router_inbox().empty());
  CHECK(p.side[1]->stats().heartbeats >= 2);
}

TEST_CASE("comm side: waits when there is nothing to do (no spinning)") {
  Pair p;
  const int64_t before = p.side[1]->stats().rounds;
  std::this_thread::sleep_for(200ms);
  const int64_t rounds = p.side[1]->stats().rounds - before;
  // idle_wait is 1 ms: about 200 rounds; a spinning thread would run millions.
  CHECK(rounds > 20);
  CHECK(rounds < 1000);
}

TEST_CASE("comm side: after stop, posts fail and sends vanish") {
  Pair p;
  p.side[1]->stop();
  std::vector<uint8_t> buf(64);
  auto op = p.transport[1]->post_send(2, 1, bytes_region(buf, 64));
  CHECK(op.status().code() == StatusCode::kCancelled);
  p.channel[1]->send(0, proto::Drained{});
  std::this_thread::sleep_for(10ms);
  CHECK(p.router_inbox().empty());
  CHECK_FALSE(p.channel[1]->flush(10ms));
}

TEST_CASE("mpi thread check: an MPI call from a compute thread aborts with a message naming it") {
  if (!mpi_thread_check_compiled()) skip("built with PD_MPI_THREAD_CHECK=OFF: MPI calls are not interposed");
  int fds[2];
  REQUIRE(pipe(fds) == 0);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    std::signal(SIGABRT, SIG_DFL);  // the test framework's handler would report it as a failure here
    dup2(fds[1], STDERR_FILENO);
    close(fds[0]);
    ComputeThreadScope compute;
    int flag = 0;
    MPI_Status st;
    // Checked before MPI is touched: no MPI_Init needed to see the abort.
    MPI_Iprobe(MPI_ANY_SOURCE, 0, MPI_COMM_WORLD, &flag, &st);
    _exit(0);  // reached only if the call was not checked
  }
  close(fds[1]);
  std::string err;
  char chunk[256];
  for (ssize_t n; (n = read(fds[0], chunk, sizeof chunk)) > 0;) err.append(chunk, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  CHECK(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGABRT);
  CHECK_THAT(err, Catch::Contains("MPI_Iprobe called from a compute thread"));
  // Outside the scope the mark is gone again.
  CHECK_FALSE(is_compute_thread());
}

}  // namespace
}  // namespace pd::test
