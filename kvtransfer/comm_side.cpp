#include "kvtransfer/comm_side.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <variant>

#include "util/lifecycle.h"

namespace pd {

// The communication thread: kIdle (not started) -> kRunning -> kStopping (stop()
// asked; the commands already queued still run) -> kStopped (the loop ended).
enum class CommThread { kIdle, kRunning, kStopping, kStopped };
const char* state_name(CommThread s) {
  switch (s) {
    case CommThread::kIdle: return "idle";
    case CommThread::kRunning: return "running";
    case CommThread::kStopping: return "stopping";
    case CommThread::kStopped: return "stopped";
  }
  return "?";
}
bool legal(CommThread from, CommThread to) {
  return static_cast<int>(to) == static_cast<int>(from) + 1;  // one way, one step at a time
}
namespace {

using Clock = std::chrono::steady_clock;

// What the compute side asks of the thread, in the order it asked.
struct SendMessage {
  int dest;
  proto::Message message;
};
struct ForgetRank {
  int rank;
};
struct PostOp {
  enum Kind { kSend, kRecv, kSendBytes, kRecvBytes, kReclaim };
  int64_t id;
  Kind kind;
  int peer, tag;
  KvRegion region;
  void* data = nullptr;
  size_t bytes = 0;
};
struct CancelOp {
  int64_t id;
};
struct AbandonOp {
  int64_t id;
};
struct ExpediteOp {
  int64_t id;
};
struct SelectPath {
  int peer;
  KvPathChoice choice;
};
struct ForgetPeer {
  int peer;
};
using Command =
    std::variant<SendMessage, ForgetRank, PostOp, CancelOp, AbandonOp, ExpediteOp, SelectPath, ForgetPeer>;

struct Inbound {
  int source;
  proto::Message message;
  Clock::time_point arrived;
};

}  // namespace

struct CommSide::Shared {
  // Constant after construction.
  CommSideOptions opts;
  std::string transport_name;
  std::vector<KvPath> paths;
  // The real channel and transport: the thread's alone between start() and stop().
  std::unique_ptr<ControlChannel> channel;
  std::unique_ptr<Transport> transport;

  mutable std::mutex mu;
  std::condition_variable wake;     // the thread waits here (commands, stop)
  std::condition_variable changed;  // flush() waits here (sends completed)
  // Guarded by mu.
  std::deque<Command> commands;
  std::deque<Inbound> inbox;
  std::unordered_map<int64_t, Result<OpState>> ended;  // op id -> how it ended, until test() takes it
  size_t queued_sends = 0;                             // SendMessage commands not yet run
  size_t channel_pending = 0;                          // the real channel's sends in flight (last round)
  uint64_t events = 0;                                 // rounds that brought the compute side something
  int64_t next_op = 1;                                 // op ids, unique across the transport ends
  CommThread thread = CommThread::kIdle;  // the communication thread's lifecycle
  bool stopped() const { return thread == CommThread::kStopped; }
  CommStats stats;

  // Last call of the compute side (steady clock ticks): the stall guard.
  std::atomic<int64_t> compute_touch{0};
  void touch() { compute_touch.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed); }

  void push(Command c) {
    {
      std::lock_guard lock(mu);
      if (std::holds_alternative<SendMessage>(c)) ++queued_sends;
      commands.push_back(std::move(c));
    }
    wake.notify_one();
  }
};

// The compute side's ControlChannel.
class CommSide::Channel final : public ControlChannel {
 public:
  explicit Channel(std::shared_ptr<Shared> s) : s_(std::move(s)) {}

  void send(int dest, const proto::Message& m) override {
    s_->touch();
    {
      std::lock_guard lock(s_->mu);
      if (s_->stopped()) return;
    }
    s_->push(SendMessage{dest, m});
  }
  int receive(const std::function<void(int, proto::Message&)>& fn, int max) override {
    s_->touch();
    std::vector<Inbound> got;
    {
      std::lock_guard lock(s_->mu);
      while (static_cast<int>(got.size()) < max && !s_->inbox.empty()) {
        got.push_back(std::move(s_->inbox.front()));
        s_->inbox.pop_front();
      }
    }
    for (Inbound& in : got) hand(in, fn);
    return static_cast<int>(got.size());
  }
  int receive_while(const std::function<bool(int, const proto::Message&)>& take,
                    const std::function<void(int, proto::Message&)>& fn, int max) override {
    s_->touch();
    int n = 0;
    while (n < max) {
      std::optional<Inbound> in;
      {
        std::lock_guard lock(s_->mu);
        if (s_->inbox.empty() || !take(s_->inbox.front().source, s_->inbox.front().message)) break;
        in = std::move(s_->inbox.front());
        s_->inbox.pop_front();
      }
      hand(*in, fn);
      ++n;
    }
    return n;
  }
  std::optional<Clock::time_point> arrival() const override {
    if (!in_fn_) return std::nullopt;
    return arrival_;
  }
  void progress() override { s_->touch(); }
  void wait_for_work(std::chrono::microseconds max) override {
    std::unique_lock lock(s_->mu);
    const uint64_t seen = seen_events_;
    s_->changed.wait_for(lock, max, [&] { return s_->events != seen || !s_->inbox.empty() || s_->stopped(); });
    seen_events_ = s_->events;
  }
  size_t pending_sends() const override {
    std::lock_guard lock(s_->mu);
    return s_->queued_sends + s_->channel_pending;
  }
  bool flush(std::chrono::milliseconds deadline) override {
    std::unique_lock lock(s_->mu);
    return s_->changed.wait_for(lock, deadline, [&] {
      return s_->stopped() || (s_->queued_sends == 0 && s_->channel_pending == 0);
    }) && !s_->stopped();
  }
  void forget(int rank) override { s_->push(ForgetRank{rank}); }

 private:
  void hand(Inbound& in, const std::function<void(int, proto::Message&)>& fn) {
    in_fn_ = true;
    arrival_ = in.arrived;
    struct Reset {
      bool* flag;
      ~Reset() { *flag = false; }
    } reset{&in_fn_};
    fn(in.source, in.message);
  }
  std::shared_ptr<Shared> s_;
  uint64_t seen_events_ = 0;  // Shared::events when wait_for_work last returned
  bool in_fn_ = false;
  Clock::time_point arrival_{};
};

// The compute side's Transport.
class CommSide::Port final : public Transport {
 public:
  explicit Port(std::shared_ptr<Shared> s) : s_(std::move(s)) {}

  std::string name() const override { return s_->transport_name; }
  Result<TransferOp> post_send(int peer, int tag, const KvRegion& region) override {
    return post(PostOp{0, PostOp::kSend, peer, tag, region});
  }
  Result<TransferOp> post_recv(int peer, int tag, const KvRegion& region) override {
    return post(PostOp{0, PostOp::kRecv, peer, tag, region});
  }
  Result<TransferOp> post_send_bytes(int peer, int tag, const void* data, size_t bytes) override {
    return post(PostOp{0, PostOp::kSendBytes, peer, tag, {}, const_cast<void*>(data), bytes});
  }
  Result<TransferOp> post_recv_bytes(int peer, int tag, void* data, size_t bytes) override {
    return post(PostOp{0, PostOp::kRecvBytes, peer, tag, {}, data, bytes});
  }
  Result<TransferOp> post_reclaim(int peer, int tag) override { return post(PostOp{0, PostOp::kReclaim, peer, tag, {}}); }
  Result<OpState> test(TransferOp op) override {
    if (!mine_.count(op.value)) return Status::not_found("transfer op " + std::to_string(op.value));
    std::lock_guard lock(s_->mu);
    auto it = s_->ended.find(op.value);
    if (it == s_->ended.end()) return OpState::kPending;
    Result<OpState> r = std::move(it->second);
    s_->ended.erase(it);
    mine_.erase(op.value);
    return r;
  }
  void cancel(TransferOp op) override {
    if (mine_.count(op.value)) s_->push(CancelOp{op.value});
  }
  void expedite(TransferOp op) override {
    if (mine_.count(op.value)) s_->push(ExpediteOp{op.value});
  }
  void abandon(TransferOp op) override {
    if (!mine_.erase(op.value)) return;
    {
      std::lock_guard lock(s_->mu);
      s_->ended.erase(op.value);
    }
    s_->push(AbandonOp{op.value});
  }
  size_t pending() const override { return mine_.size(); }
  std::vector<KvPath> paths() const override { return s_->paths; }
  Status select_path(int peer, const KvPathChoice& choice) override {
    // The real transport refuses only a path it lacks: answered here, now.
    if (std::find(s_->paths.begin(), s_->paths.end(), choice.path) == s_->paths.end())
      return Status::unsupported(std::string("no ") + kv_path_name(choice.path) + " path in this process (it has " +
                                 s_->transport_name + ") for KV with rank " + std::to_string(peer));
    s_->push(SelectPath{peer, choice});
    return Status::ok();
  }
  void forget_peer(int peer) override { s_->push(ForgetPeer{peer}); }

 private:
  Result<TransferOp> post(PostOp p) {
    s_->touch();
    {
      std::lock_guard lock(s_->mu);
      if (s_->stopped()) return Status::cancelled("the rank's communication side has stopped");
      p.id = s_->next_op++;
    }
    mine_.insert(p.id);
    s_->push(std::move(p));
    return TransferOp{p.id};
  }
  std::shared_ptr<Shared> s_;
  std::unordered_set<int64_t> mine_;  // posted, not yet reported ended nor abandoned
};

CommSide::CommSide(std::unique_ptr<ControlChannel> channel, std::unique_ptr<Transport> transport,
                   CommSideOptions opts)
    : shared_(std::make_shared<Shared>()) {
  shared_->opts = opts;
  shared_->transport_name = transport->name();
  shared_->paths = transport->paths();
  shared_->channel = std::move(channel);
  shared_->transport = std::move(transport);
  shared_->touch();
}

CommSide::~CommSide() { stop(); }

std::unique_ptr<ControlChannel> CommSide::channel() { return std::make_unique<Channel>(shared_); }
std::unique_ptr<Transport> CommSide::transport() { return std::make_unique<Port>(shared_); }

void CommSide::start() {
  {
    std::lock_guard lock(shared_->mu);
    if (shared_->thread != CommThread::kIdle) return;
    transition(shared_->thread, CommThread::kRunning, 0, "communication side");
  }
  shared_->touch();
  thread_ = std::thread([this] { loop(); });
}

void CommSide::stop() {
  {
    std::lock_guard lock(shared_->mu);
    if (shared_->thread != CommThread::kRunning) return;
    transition(shared_->thread, CommThread::kStopping, 0, "communication side");
  }
  shared_->wake.notify_one();
  if (thread_.joinable()) thread_.join();
}

CommStats CommSide::stats() const {
  std::lock_guard lock(shared_->mu);
  return shared_->stats;
}

// The communication thread's state between rounds, and one round in steps.
class CommSide::Loop {
 public:
  explicit Loop(Shared& s) : s_(s), channel_(*s.channel), transport_(*s.transport), wait_(s.opts.idle_wait) {}

  // One round: the commands queued since the last, progress, what arrived,
  // heartbeats; then the results go to the compute side and the thread waits
  // for the next commands (at most the wait chosen). False once stopped.
  bool round() {
    bool stopping = false;
    {
      std::lock_guard lock(s_.mu);
      commands_.swap(s_.commands);
      stopping = s_.thread == CommThread::kStopping;
    }
    const bool ran_commands = !commands_.empty();
    size_t sends_run = 0;
    for (Command& c : commands_) {
      if (std::holds_alternative<SendMessage>(c)) ++sends_run;
      std::visit([this](auto& cmd) { run(cmd); }, c);
    }
    commands_.clear();

    // Progress: the transport's ops, the channel's sends, then what arrived.
    poll_ops();
    channel_.progress();
    channel_.receive([&](int source, proto::Message& m) { arrived_.push_back({source, std::move(m), Clock::now()}); },
                   256);
    heartbeat(stopping);
    const size_t channel_pending = channel_.pending_sends();
    const bool sends_completed = channel_pending < channel_pending_before_;
    choose_wait(ran_commands || !ended_.empty() || !arrived_.empty() || sends_completed,
                !live_.empty() || channel_pending > 0);
    channel_pending_before_ = channel_pending;
    return publish(stopping, sends_run, channel_pending, sends_completed);
  }

 private:
  void run(SendMessage& cmd) {
    if (s_.opts.router >= 0 && cmd.dest == s_.opts.router) {
      if (auto* r = std::get_if<proto::LoadReport>(&cmd.message)) {
        last_report_ = *r;
        last_report_at_ = Clock::now();
      }
    }
    channel_.send(cmd.dest, cmd.message);
    ++stats_.messages_out;
  }
  void run(ForgetRank& cmd) { channel_.forget(cmd.rank); }
  void run(PostOp& cmd) {
    Result<TransferOp> op = [&]() -> Result<TransferOp> {
      switch (cmd.kind) {
        case PostOp::kSend: return transport_.post_send(cmd.peer, cmd.tag, cmd.region);
        case PostOp::kRecv: return transport_.post_recv(cmd.peer, cmd.tag, cmd.region);
        case PostOp::kSendBytes: return transport_.post_send_bytes(cmd.peer, cmd.tag, cmd.data, cmd.bytes);
        case PostOp::kRecvBytes: return transport_.post_recv_bytes(cmd.peer, cmd.tag, cmd.data, cmd.bytes);
        case PostOp::kReclaim: return transport_.post_reclaim(cmd.peer, cmd.tag);
      }
      return Status::internal("unknown transfer op kind");
    }();
    ++stats_.ops_posted;
    if (op.is_ok()) live_.emplace(cmd.id, *op);
    else ended_.emplace_back(cmd.id, op.status());
  }
  void run(CancelOp& cmd) {
    if (auto it = live_.find(cmd.id); it != live_.end()) transport_.cancel(it->second);
  }
  void run(AbandonOp& cmd) {
    if (auto it = live_.find(cmd.id); it != live_.end()) {
      transport_.abandon(it->second);
      live_.erase(it);
    }
    std::erase_if(ended_, [&](const auto& e) { return e.first == cmd.id; });
    abandoned_.push_back(cmd.id);  // it may have ended in an earlier round: forgotten there too
  }
  void run(ExpediteOp& cmd) {
    if (auto it = live_.find(cmd.id); it != live_.end()) transport_.expedite(it->second);
  }
  void run(SelectPath& cmd) {
    if (Status st = transport_.select_path(cmd.peer, cmd.choice); !st.is_ok())
      spdlog::error("KV path to rank {}: {}", cmd.peer, st.to_string());
  }
  void run(ForgetPeer& cmd) { transport_.forget_peer(cmd.peer); }

  void poll_ops() {
    transport_.progress();
    for (auto it = live_.begin(); it != live_.end();) {
      Result<OpState> r = transport_.test(it->second);
      if (r.is_ok() && *r == OpState::kPending) {
        ++it;
        continue;
      }
      ended_.emplace_back(it->first, std::move(r));
      it = live_.erase(it);
    }
  }

  // Liveness on the compute side's behalf, while it is busy but not wedged.
  void heartbeat(bool stopping) {
    const auto now = Clock::now();
    if (!last_report_ || now - last_report_at_ < s_.opts.heartbeat || stopping) return;
    const Clock::time_point touched{Clock::duration(s_.compute_touch.load(std::memory_order_relaxed))};
    if (now - touched >= s_.opts.compute_stall) return;
    channel_.send(s_.opts.router, *last_report_);
    last_report_at_ = now;
    ++stats_.heartbeats;
  }

  // How long to wait before the next round: busy_wait right after a round
  // that moved something (an operation ended, a message came or went, a
  // command ran); doubling from there while operations are in flight but
  // nothing moves (receives posted long before their sender computes its
  // layers: testing them every 50 us would cost a fifth of a core for
  // nothing), up to idle_wait, which is also the wait with nothing in flight.
  void choose_wait(bool moved, bool in_flight) {
    if (!in_flight) wait_ = s_.opts.idle_wait;
    else if (moved) wait_ = s_.opts.busy_wait;
    else wait_ = std::min(wait_ * 2, s_.opts.idle_wait);
  }

  // Hands the round's results to the compute side, then waits. False: stopped.
  bool publish(bool stopping, size_t sends_run, size_t channel_pending, bool sends_completed) {
    std::unique_lock lock(s_.mu);
    s_.queued_sends -= sends_run;
    s_.channel_pending = channel_pending;
    for (auto& e : ended_) s_.ended.insert_or_assign(e.first, std::move(e.second));
    for (int64_t id : abandoned_) s_.ended.erase(id);
    stats_.ops_ended += static_cast<int64_t>(ended_.size());
    stats_.messages_in += static_cast<int64_t>(arrived_.size());
    for (Inbound& in : arrived_) s_.inbox.push_back(std::move(in));
    const bool news = !ended_.empty() || !arrived_.empty() || sends_completed || sends_run > 0;
    if (news) ++s_.events;
    ++stats_.rounds;
    s_.stats.rounds += stats_.rounds;
    s_.stats.messages_in += stats_.messages_in;
    s_.stats.messages_out += stats_.messages_out;
    s_.stats.ops_posted += stats_.ops_posted;
    s_.stats.ops_ended += stats_.ops_ended;
    s_.stats.heartbeats += stats_.heartbeats;
    stats_ = CommStats{};
    ended_.clear();
    abandoned_.clear();
    arrived_.clear();
    if (stopping && s_.commands.empty()) {
      transition(s_.thread, CommThread::kStopped, 0, "communication side");
      s_.changed.notify_all();
      return false;
    }
    if (news) s_.changed.notify_all();  // flush() and wait_for_work() waiters
    s_.wake.wait_for(lock, wait_, [&] { return !s_.commands.empty() || s_.thread == CommThread::kStopping; });
    return true;
  }

  Shared& s_;
  ControlChannel& channel_;
  Transport& transport_;
  std::unordered_map<int64_t, TransferOp> live_;  // op id -> the real transport's op
  std::optional<proto::LoadReport> last_report_;  // the compute side's last, for heartbeats
  Clock::time_point last_report_at_{};
  std::deque<Command> commands_;
  std::vector<Inbound> arrived_;
  std::vector<std::pair<int64_t, Result<OpState>>> ended_;
  std::vector<int64_t> abandoned_;
  CommStats stats_;  // this round's, added to the shared ones as it ends
  std::chrono::microseconds wait_;
  size_t channel_pending_before_ = 0;
};

void CommSide::loop() {
  shared_->transport->bind_thread();
  Loop loop(*shared_);
  while (loop.round()) {
  }
}

}  // namespace pd
