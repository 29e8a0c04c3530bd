// A bound on the KV sends in flight to each peer: a Transport decorator.
//
// Why: a peer that dies or stops keeps the shared-memory fragments of the sends
// it had begun to receive (OpenMPI's vader BTL: ~32-128 KiB each, out of a
// 4 MiB segment per process), and once they run out no send to any peer moves.
// Measured: 24 stuck 1 MiB sends to one stopped rank stalled every other
// transfer. So each send is charged what a stuck one would hold, min(bytes,
// charge_cap), against its peer while it is in flight; a send that would pass
// the peer's budget waits here (sends under one tag in their order) and is
// posted when earlier ones end.
//
// Which waiting send goes next is the transfer scheduling policy
// (send_order.h): sends a decode waits on (expedite(): a handoff whose token 1
// is out) before segments of prompts still computing, none overtaken past a
// bound. A send never waits while its peer has room; one a decode waits on
// may go one charge_cap past the budget, so a trailer never waits for a bulk
// send to end (what a stuck peer can hold: per_peer_bytes + charge_cap).
//
// It sits in the rank's communication side (kvtransfer/comm_side.h), whose
// thread tests every operation each round: a send that ends refunds its charge
// and the next waiting send goes out in the same round, whatever the compute
// side is doing. Receives pass straight through.
//
// Operations: test() of a waiting send reports kPending; cancel() of a waiting
// send ends it kCancelled without posting it; abandon() forgets it. A send
// that ends (done, cancelled, failed, or abandoned — the worker abandons only
// sends of ended handoffs, and sends nothing more to a peer it holds down)
// gives its charge back.
//
// Threading: one thread (that of the transport it wraps).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "kvtransfer/send_order.h"
#include "kvtransfer/transport.h"

namespace pd {

struct SendBudget {
  int64_t per_peer_bytes = 1 << 20;  // in-flight charge per peer (leaves most of a 4 MiB segment to the others)
  int64_t charge_cap = 128 << 10;    // a send is charged at most this
  SendOrderPolicy order;             // which waiting send goes next
};

class SendBudgetTransport final : public Transport {
 public:
  explicit SendBudgetTransport(std::unique_ptr<Transport> inner, SendBudget budget = {});

  std::string name() const override { return inner_->name(); }
  Result<TransferOp> post_send(int peer, int tag, const KvRegion& region) override;
  Result<TransferOp> post_recv(int peer, int tag, const KvRegion& region) override;
  Result<TransferOp> post_send_bytes(int peer, int tag, const void* data, size_t bytes) override;
  Result<TransferOp> post_recv_bytes(int peer, int tag, void* data, size_t bytes) override;
  Result<OpState> test(TransferOp op) override;
  void cancel(TransferOp op) override;
  void abandon(TransferOp op) override;
  // Like a receive: straight through.
  Result<TransferOp> post_reclaim(int peer, int tag) override;
  size_t pending() const override { return ops_.size(); }
  // Marks the send's waiting peers under its tag kDecodeWaiting (send_order.h);
  // sends posted later under that tag, while any of them waits, join them.
  void expedite(TransferOp op) override;
  std::vector<KvPath> paths() const override { return inner_->paths(); }
  Status select_path(int peer, const KvPathChoice& choice) override { return inner_->select_path(peer, choice); }
  void forget_peer(int peer) override;
  void progress() override { inner_->progress(); }
  void bind_thread() override { inner_->bind_thread(); }

  // Charge in flight to `peer` and sends waiting for it (tests, metrics).
  int64_t charged(int peer) const;
  size_t waiting(int peer) const;

 private:
  struct Op {
    int peer = -1;
    bool is_send = false;
    bool is_bytes = false;            // a byte buffer (post_send_bytes), else a region
    std::optional<TransferOp> inner;  // posted (else waiting, or ended before posting)
    int64_t charge = 0;               // charged while posted
    SendUrgency urgency = SendUrgency::kBehindCompute;
    int64_t bypassed = 0;             // bytes of later sends posted while it waited
    // A waiting send's arguments.
    int tag = 0;
    KvRegion region;
    const void* data = nullptr;
    size_t bytes = 0;
    // Ended before it could be posted (cancelled, or the post failed): reported by test().
    std::optional<Result<OpState>> ended;
  };
  struct Peer {
    int64_t charged = 0;
    std::deque<int64_t> waiting;  // op ids in posting order (ended ones are dropped by pump())
    std::unordered_map<int, int> urgent;  // tag -> its waiting sends a decode waits on (none: absent)
  };
  // A waiting send becomes kDecodeWaiting (counted in its peer's `urgent`).
  void mark_urgent(Peer& p, Op& op);
  // A waiting send stops waiting (posted, cancelled or abandoned): uncounted.
  void leave_queue(Peer& p, const Op& op);
  Result<TransferOp> enqueue(Op op);
  // A receive the inner transport posted (or refused): passes straight through.
  Result<TransferOp> track_recv(int peer, Result<TransferOp> inner);
  void pump(int peer);
  void refund(Op& op);
  std::unique_ptr<Transport> inner_;
  SendBudget budget_;
  int64_t next_id_ = 1;
  std::unordered_map<int64_t, Op> ops_;
  std::unordered_map<int, Peer> peers_;
  std::vector<WaitingSend> order_;  // pump()'s view of a peer's waiting sends (kept: no allocation)
};

}  // namespace pd
