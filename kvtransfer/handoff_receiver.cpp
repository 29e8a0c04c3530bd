#include "kvtransfer/handoff_receiver.h"

namespace pd {

HandoffReceiver::HandoffReceiver(int peer, int n_layers, int n_segments)
    : peer_(peer), n_layers_(n_layers), n_segments_(n_segments < 1 ? 1 : n_segments),
      trailer_(KvTrailer::serialized_size(n_layers), 0) {}

Status HandoffReceiver::post(Transport& t, int tag, const RegionOf& region_of, TimePoint now) {
  phase_ = Phase::kReceiving;
  last_progress_ = now;
  Status st;
  for (int m = 0; m < n_segments_ * n_layers_ && st.is_ok(); ++m) {
    Result<TransferOp> op = t.post_recv(peer_, tag, region_of(m % n_layers_, m / n_layers_));
    if (op.is_ok()) ops_.push_back(*op);
    else st = op.status();
  }
  if (st.is_ok()) {
    Result<TransferOp> op = t.post_recv_bytes(peer_, tag, trailer_.data(), trailer_.size());
    if (op.is_ok()) ops_.push_back(*op);
    else st = op.status();
  }
  if (!st.is_ok()) clean_ = false;
  return st;
}

HandoffReceiver::Phase HandoffReceiver::poll(Transport& t, TimePoint now) {
  for (auto it = ops_.begin(); it != ops_.end();) {
    Result<OpState> r = t.test(*it);
    if (r.is_ok() && *r == OpState::kPending) {
      ++it;
      continue;
    }
    if (!r.is_ok() || *r == OpState::kCancelled) clean_ = false;
    last_progress_ = now;
    it = ops_.erase(it);
  }
  if (phase_ == Phase::kReceiving && ops_.empty()) phase_ = clean_ ? Phase::kLanded : Phase::kBroken;
  return phase_;
}

void HandoffReceiver::cancel(Transport& t) {
  for (TransferOp op : ops_) t.cancel(op);
}

void HandoffReceiver::abandon(Transport& t) {
  if (ops_.empty()) return;
  for (TransferOp op : ops_) t.abandon(op);
  ops_.clear();
  clean_ = false;
  if (phase_ == Phase::kReceiving) phase_ = Phase::kBroken;
}

}  // namespace pd
