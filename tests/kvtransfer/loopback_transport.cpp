#include "kvtransfer/loopback_transport.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <set>
#include <string>
#include <vector>

namespace pd::test {

struct LoopbackNetwork::State {
  struct Op {
    int owner = -1;       // the rank that posted it
    bool send = false;
    bool hung = false;    // a send under hang_sends: never matches
    bool abandoned = false;
    bool reclaim = false; // a receive-side reclaim: takes sends until an empty one
    int64_t partner = 0;  // matched, bytes not moved yet (the sender is frozen or dead)
    OpState state = OpState::kPending;
    Status error;         // reported by test() instead of the state
    // The bytes: pieces of a region, or one contiguous buffer (pieces = {0}).
    uint8_t* base = nullptr;
    std::vector<int64_t> offsets;
    int64_t piece_bytes = 0;
    int64_t total() const { return piece_bytes * static_cast<int64_t>(offsets.size()); }
  };
  using Key = std::tuple<int, int, int>;  // (source, dest, tag)
  struct Queues {
    std::deque<int64_t> sends, recvs;     // unmatched, oldest first
  };

  bool hang = false;
  std::set<int> frozen, dead;
  int64_t next_id = 1;
  int64_t moved = 0;
  int64_t reclaimed = 0;  // messages taken by reclaims
  std::unordered_map<int64_t, Op> ops;
  std::map<Key, Queues> queues;

  Result<TransferOp> post(int owner, int peer, int tag, bool send, uint8_t* base, std::vector<int64_t> offsets,
                          int64_t piece_bytes, bool reclaim = false) {
    const int64_t id = next_id++;
    Op& op = ops[id];
    op.owner = owner;
    op.send = send;
    op.reclaim = reclaim;
    op.base = base;
    op.offsets = std::move(offsets);
    op.piece_bytes = piece_bytes;
    if (send && hang) {
      op.hung = true;
      return TransferOp{id};
    }
    Queues& q = queues[send ? Key{owner, peer, tag} : Key{peer, owner, tag}];
    (send ? q.sends : q.recvs).push_back(id);
    pump(q);
    return TransferOp{id};
  }

  // Matches the oldest unmatched send with the oldest unmatched receive while
  // both exist. A reclaim at the head of the receives takes sends (each
  // completes, its bytes dropped) until it takes an empty one; it takes
  // nothing while either rank is stopped or dead.
  void pump(Queues& q) {
    while (!q.sends.empty() && !q.recvs.empty()) {
      const int64_t sid = q.sends.front(), rid = q.recvs.front();
      Op& s = ops.at(sid);
      Op& r = ops.at(rid);
      const bool stopped =
          frozen.count(s.owner) || dead.count(s.owner) || frozen.count(r.owner) || dead.count(r.owner);
      if (r.reclaim) {
        if (stopped) return;
        q.sends.pop_front();
        s.state = OpState::kDone;
        ++reclaimed;
        if (s.total() == 0) {
          r.state = OpState::kDone;
          q.recvs.pop_front();
        }
        continue;
      }
      q.sends.pop_front();
      q.recvs.pop_front();
      if (stopped) {
        s.partner = rid;
        r.partner = sid;
      } else {
        match(s, r);
      }
    }
  }

  // Moves the bytes of matched pairs whose ranks are both running.
  void move_matched() {
    for (auto& [id, s] : ops) {
      if (!s.send || s.partner == 0) continue;
      Op& r = ops.at(s.partner);
      if (frozen.count(s.owner) || dead.count(s.owner) || frozen.count(r.owner) || dead.count(r.owner)) continue;
      s.partner = r.partner = 0;
      match(s, r);
    }
    for (auto& [key, q] : queues) pump(q);
    reap();
  }
  // Abandoned ops that completed are gone for good.
  void reap() {
    std::erase_if(ops, [](const auto& kv) { return kv.second.abandoned && kv.second.state != OpState::kPending; });
  }

  // Copies the send's byte stream into the receive's pieces.
  void match(Op& s, Op& r) {
    s.state = r.state = OpState::kDone;
    if (s.total() > r.total()) {
      r.error = Status::internal("loopback: message of " + std::to_string(s.total()) + " bytes truncated to " +
                                 std::to_string(r.total()));
      return;
    }
    std::vector<uint8_t> stream;
    stream.reserve(static_cast<size_t>(s.total()));
    for (int64_t off : s.offsets) stream.insert(stream.end(), s.base + off, s.base + off + s.piece_bytes);
    size_t at = 0;
    for (int64_t off : r.offsets) {
      if (at >= stream.size()) break;
      const size_t n = std::min(static_cast<size_t>(r.piece_bytes), stream.size() - at);
      std::memcpy(r.base + off, stream.data() + at, n);
      at += n;
    }
    moved += static_cast<int64_t>(stream.size());
  }

  void cancel(int owner, int64_t id) {
    auto it = ops.find(id);
    if (it == ops.end() || it->second.owner != owner || it->second.state != OpState::kPending) return;
    if (it->second.send || it->second.partner != 0) return;  // ob1: sends and matched receives stay
    it->second.state = OpState::kCancelled;
    for (auto& [key, q] : queues) {
      std::erase(q.sends, id);
      std::erase(q.recvs, id);
    }
  }

  void abandon(int owner, int64_t id) {
    auto it = ops.find(id);
    if (it == ops.end() || it->second.owner != owner || it->second.abandoned) return;
    it->second.abandoned = true;
    reap();
  }

  Result<OpState> test(int owner, int64_t id) {
    auto it = ops.find(id);
    if (it == ops.end() || it->second.owner != owner || it->second.abandoned)
      return Status::not_found("loopback transport: unknown op " + std::to_string(id));
    const Op& op = it->second;
    if (op.state == OpState::kPending) return OpState::kPending;
    Status error = op.error;
    const OpState state = op.state;
    ops.erase(it);
    if (!error.is_ok()) return error;
    return state;
  }

  size_t pending(int owner) const {
    return static_cast<size_t>(
        std::count_if(ops.begin(), ops.end(), [&](const auto& kv) {
          return kv.second.owner == owner && !kv.second.abandoned;
        }));
  }
};

namespace {

class LoopbackTransport final : public Transport {
 public:
  LoopbackTransport(std::shared_ptr<LoopbackNetwork::State> state, int rank) : state_(std::move(state)), rank_(rank) {}
  std::string name() const override { return "loopback"; }
  Result<TransferOp> post_send(int peer, int tag, const KvRegion& region) override {
    return state_->post(rank_, peer, tag, true, region.base, region.offsets, region.piece_bytes);
  }
  Result<TransferOp> post_recv(int peer, int tag, const KvRegion& region) override {
    return state_->post(rank_, peer, tag, false, region.base, region.offsets, region.piece_bytes);
  }
  Result<TransferOp> post_send_bytes(int peer, int tag, const void* data, size_t bytes) override {
    return state_->post(rank_, peer, tag, true, static_cast<uint8_t*>(const_cast<void*>(data)), {0},
                        static_cast<int64_t>(bytes));
  }
  Result<TransferOp> post_recv_bytes(int peer, int tag, void* data, size_t bytes) override {
    return state_->post(rank_, peer, tag, false, static_cast<uint8_t*>(data), {0}, static_cast<int64_t>(bytes));
  }
  Result<OpState> test(TransferOp op) override { return state_->test(rank_, op.value); }
  void cancel(TransferOp op) override { state_->cancel(rank_, op.value); }
  void abandon(TransferOp op) override { state_->abandon(rank_, op.value); }
  Result<TransferOp> post_reclaim(int peer, int tag) override {
    return state_->post(rank_, peer, tag, false, nullptr, {}, 0, /*reclaim=*/true);
  }
  size_t pending() const override { return state_->pending(rank_); }

 private:
  std::shared_ptr<LoopbackNetwork::State> state_;
  int rank_;
};

}  // namespace

LoopbackNetwork::LoopbackNetwork() : state_(std::make_shared<State>()) {}
LoopbackNetwork::~LoopbackNetwork() = default;

std::unique_ptr<Transport> LoopbackNetwork::endpoint(int rank) {
  return std::make_unique<LoopbackTransport>(state_, rank);
}
void LoopbackNetwork::hang_sends(bool on) { state_->hang = on; }
void LoopbackNetwork::freeze(int rank) { state_->frozen.insert(rank); }
void LoopbackNetwork::thaw(int rank) {
  state_->frozen.erase(rank);
  state_->move_matched();
}
void LoopbackNetwork::kill(int rank) { state_->dead.insert(rank); }
int64_t LoopbackNetwork::bytes_moved() const { return state_->moved; }
int64_t LoopbackNetwork::messages_reclaimed() const { return state_->reclaimed; }

}  // namespace pd::test
