#include "kvtransfer/send_budget.h"

#include <algorithm>

namespace pd {

SendBudgetTransport::SendBudgetTransport(std::unique_ptr<Transport> inner, SendBudget budget)
    : inner_(std::move(inner)), budget_(budget) {}

Result<TransferOp> SendBudgetTransport::post_send(int peer, int tag, const KvRegion& region) {
  Op op;
  op.peer = peer;
  op.is_send = true;
  op.tag = tag;
  op.region = region;
  op.bytes = static_cast<size_t>(region.total_bytes());
  return enqueue(std::move(op));
}

Result<TransferOp> SendBudgetTransport::post_send_bytes(int peer, int tag, const void* data, size_t bytes) {
  Op op;
  op.peer = peer;
  op.is_send = true;
  op.tag = tag;
  op.is_bytes = true;
  op.data = data;
  op.bytes = bytes;
  return enqueue(std::move(op));
}

Result<TransferOp> SendBudgetTransport::post_recv(int peer, int tag, const KvRegion& region) {
  return track_recv(peer, inner_->post_recv(peer, tag, region));
}

Result<TransferOp> SendBudgetTransport::post_recv_bytes(int peer, int tag, void* data, size_t bytes) {
  return track_recv(peer, inner_->post_recv_bytes(peer, tag, data, bytes));
}

Result<TransferOp> SendBudgetTransport::post_reclaim(int peer, int tag) {
  return track_recv(peer, inner_->post_reclaim(peer, tag));
}

Result<TransferOp> SendBudgetTransport::track_recv(int peer, Result<TransferOp> inner) {
  PD_ASSIGN_OR_RETURN(TransferOp posted, std::move(inner));
  Op op;
  op.peer = peer;
  op.inner = posted;
  const int64_t id = next_id_++;
  ops_.emplace(id, std::move(op));
  return TransferOp{id};
}

Result<TransferOp> SendBudgetTransport::enqueue(Op op) {
  const int64_t id = next_id_++;
  const int peer = op.peer;
  Peer& p = peers_[peer];
  Op& o = ops_.emplace(id, std::move(op)).first->second;
  p.waiting.push_back(id);
  // Under a tag a decode waits on, a later send waits with the earlier ones.
  if (p.urgent.count(o.tag)) mark_urgent(p, o);
  pump(peer);
  // A send that could be posted at once and was refused fails as before: at once.
  if (o.ended && !o.ended->is_ok()) {
    Status st = o.ended->status();
    ops_.erase(id);
    return st;
  }
  return TransferOp{id};
}

void SendBudgetTransport::mark_urgent(Peer& p, Op& op) {
  if (op.urgency == SendUrgency::kDecodeWaiting) return;
  op.urgency = SendUrgency::kDecodeWaiting;
  if (!op.inner && !op.ended) ++p.urgent[op.tag];
}

void SendBudgetTransport::leave_queue(Peer& p, const Op& op) {
  if (op.urgency != SendUrgency::kDecodeWaiting || op.inner || op.ended) return;
  if (auto it = p.urgent.find(op.tag); it != p.urgent.end() && --it->second <= 0) p.urgent.erase(it);
}

void SendBudgetTransport::pump(int peer) {
  auto pit = peers_.find(peer);
  if (pit == peers_.end()) return;
  Peer& p = pit->second;
  // A send a decode waits on may go one charge past the budget, so it never
  // waits for a bulk send to end (the bound on what a stuck peer holds grows by that one charge).
  while (!p.waiting.empty() && p.charged < budget_.per_peer_bytes + budget_.charge_cap) {
    if (p.charged >= budget_.per_peer_bytes && p.urgent.empty()) return;  // full, and nothing may pass
    // Abandoned or cancelled while waiting: never posted.
    std::erase_if(p.waiting, [&](int64_t id) {
      auto it = ops_.find(id);
      return it == ops_.end() || it->second.ended;
    });
    if (p.waiting.empty()) return;
    order_.clear();
    for (int64_t id : p.waiting) {
      const Op& o = ops_.at(id);
      order_.push_back({o.urgency, o.bypassed});
    }
    const size_t pick = next_send(order_, budget_.order);
    const int64_t id = p.waiting[pick];
    Op& op = ops_.at(id);
    if (p.charged >= budget_.per_peer_bytes && op.urgency != SendUrgency::kDecodeWaiting) return;
    leave_queue(p, op);
    p.waiting.erase(p.waiting.begin() + static_cast<std::ptrdiff_t>(pick));
    for (size_t i = 0; i < pick; ++i) ops_.at(p.waiting[i]).bypassed += static_cast<int64_t>(op.bytes);
    Result<TransferOp> posted = op.is_bytes ? inner_->post_send_bytes(peer, op.tag, op.data, op.bytes)
                                    : inner_->post_send(peer, op.tag, op.region);
    if (!posted.is_ok()) {
      op.ended = Result<OpState>(posted.status());
      continue;
    }
    op.inner = *posted;
    op.charge = std::min(static_cast<int64_t>(op.bytes), budget_.charge_cap);
    p.charged += op.charge;
    op.region = KvRegion{};  // the inner transport holds what it needs
  }
}

void SendBudgetTransport::expedite(TransferOp handle) {
  auto it = ops_.find(handle.value);
  if (it == ops_.end() || !it->second.is_send) return;
  const int peer = it->second.peer, tag = it->second.tag;
  Peer& p = peers_[peer];
  mark_urgent(p, it->second);
  for (int64_t w : p.waiting)
    if (auto o = ops_.find(w); o != ops_.end() && o->second.tag == tag) mark_urgent(p, o->second);
  pump(peer);  // one may go now, past the budget
}

void SendBudgetTransport::refund(Op& op) {
  if (op.charge == 0) return;
  peers_[op.peer].charged -= op.charge;
  op.charge = 0;
}

Result<OpState> SendBudgetTransport::test(TransferOp handle) {
  auto it = ops_.find(handle.value);
  if (it == ops_.end()) return Status::not_found("transfer op " + std::to_string(handle.value));
  Op& op = it->second;
  if (!op.inner) {  // waiting (pump() posts it when its peer has room) or ended before it was posted
    if (op.ended) {
      Result<OpState> r = std::move(*op.ended);
      ops_.erase(it);
      return r;
    }
    if (!op.inner) return OpState::kPending;
  }
  Result<OpState> r = inner_->test(*op.inner);
  if (r.is_ok() && *r == OpState::kPending) return r;
  const int peer = op.peer;
  refund(op);
  ops_.erase(it);
  pump(peer);
  return r;
}

void SendBudgetTransport::cancel(TransferOp handle) {
  auto it = ops_.find(handle.value);
  if (it == ops_.end()) return;
  Op& op = it->second;
  if (op.inner) {
    inner_->cancel(*op.inner);
  } else if (!op.ended) {  // never posted
    leave_queue(peers_[op.peer], op);
    op.ended = Result<OpState>(OpState::kCancelled);
  }
}

void SendBudgetTransport::abandon(TransferOp handle) {
  auto it = ops_.find(handle.value);
  if (it == ops_.end()) return;
  Op& op = it->second;
  const int peer = op.peer;
  if (op.inner) inner_->abandon(*op.inner);
  leave_queue(peers_[peer], op);
  refund(op);
  ops_.erase(it);  // a waiting entry is skipped by pump()
  pump(peer);
}

void SendBudgetTransport::forget_peer(int peer) {
  inner_->forget_peer(peer);
  if (auto it = peers_.find(peer); it != peers_.end() && it->second.waiting.empty() && it->second.charged == 0)
    peers_.erase(it);
}

int64_t SendBudgetTransport::charged(int peer) const {
  auto it = peers_.find(peer);
  return it == peers_.end() ? 0 : it->second.charged;
}

size_t SendBudgetTransport::waiting(int peer) const {
  auto it = peers_.find(peer);
  if (it == peers_.end()) return 0;
  return static_cast<size_t>(std::count_if(it->second.waiting.begin(), it->second.waiting.end(), [&](int64_t id) {
    auto o = ops_.find(id);
    return o != ops_.end() && !o->second.inner && !o->second.ended;
  }));
}

}  // namespace pd
