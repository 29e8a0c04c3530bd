#include "kvtransfer/staged_transport.h"

namespace pd {

Status StagedTransport::check_region(const KvRegion& region) const {
  if (region.base != cache_.data())
    return Status::invalid_argument("staged transport: the KV region does not describe this rank's cache");
  if (region.offsets.empty() || region.piece_bytes <= 0)
    return Status::invalid_argument("staged transport: empty KV region");
  return Status::ok();
}

Result<TransferOp> StagedTransport::post_send(int peer, int tag, const KvRegion& region) {
  PD_RETURN_IF_ERROR(check_region(region));
  Staged s;
  s.bytes.resize(static_cast<size_t>(region.total_bytes()));
  PD_RETURN_IF_ERROR(
      backend_.kv_gather(cache_, region.offsets, static_cast<size_t>(region.piece_bytes), s.bytes.data()));
  PD_ASSIGN_OR_RETURN(TransferOp op, inner_->post_send_bytes(peer, tag, s.bytes.data(), s.bytes.size()));
  staged_.emplace(op.value, std::move(s));
  return op;
}

Result<TransferOp> StagedTransport::post_recv(int peer, int tag, const KvRegion& region) {
  PD_RETURN_IF_ERROR(check_region(region));
  Staged s;
  s.bytes.resize(static_cast<size_t>(region.total_bytes()));
  s.offsets = region.offsets;
  s.piece_bytes = region.piece_bytes;
  s.recv = true;
  PD_ASSIGN_OR_RETURN(TransferOp op, inner_->post_recv_bytes(peer, tag, s.bytes.data(), s.bytes.size()));
  staged_.emplace(op.value, std::move(s));
  return op;
}

Result<OpState> StagedTransport::test(TransferOp op) {
  Result<OpState> r = inner_->test(op);
  if (r.is_ok() && *r == OpState::kPending) return r;
  const auto it = staged_.find(op.value);
  if (it == staged_.end()) return r;  // a trailer, or an op this wrapper does not know
  Staged s = std::move(it->second);
  staged_.erase(it);
  if (r.is_ok() && *r == OpState::kDone && s.recv) {
    const Status st = backend_.kv_scatter(cache_, s.offsets, static_cast<size_t>(s.piece_bytes), s.bytes.data());
    if (!st.is_ok()) return Status::io_error("staged transport: landing received KV in device memory: " + st.to_string());
  }
  return r;
}

void StagedTransport::abandon(TransferOp op) {
  inner_->abandon(op);
  const auto it = staged_.find(op.value);
  if (it == staged_.end()) return;
  abandoned_.push_back(std::move(it->second.bytes));
  staged_.erase(it);
}

}  // namespace pd
