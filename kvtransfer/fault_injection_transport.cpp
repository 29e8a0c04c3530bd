#include "kvtransfer/fault_injection_transport.h"

#include <cstdlib>
#include <cstring>
#include <string>

namespace pd {

std::unique_ptr<Transport> FaultInjectionTransport::from_env(std::unique_ptr<Transport> inner) {
  const char* v = std::getenv("PD_FAULT_INJECT");
  if (!v || !*v) return inner;
  const std::string s(v);
  if (s == "hang_first_send") return std::make_unique<FaultInjectionTransport>(std::move(inner), Fault::kHangFirstSend);
  if (s == "corrupt_first_send")
    return std::make_unique<FaultInjectionTransport>(std::move(inner), Fault::kCorruptFirstSend);
  return inner;
}

bool FaultInjectionTransport::targets(int tag) {
  if (target_tag_ < 0) target_tag_ = tag;
  return tag == target_tag_;
}

Result<TransferOp> FaultInjectionTransport::wrap(Result<TransferOp> inner_op) {
  if (!inner_op.is_ok()) return inner_op;
  const int64_t id = next_++;
  ops_.emplace(id, *inner_op);
  return TransferOp{id};
}

Result<TransferOp> FaultInjectionTransport::post_send(int peer, int tag, const KvRegion& region) {
  if (targets(tag)) {
    if (fault_ == Fault::kHangFirstSend) {
      const int64_t id = next_++;
      hung_.emplace(id, false);
      return TransferOp{id};
    }
    if (!corrupted_) {  // send a packed copy with one byte flipped
      corrupted_ = true;
      auto copy = std::make_unique<std::vector<uint8_t>>();
      for (int64_t off : region.offsets)
        copy->insert(copy->end(), region.base + off, region.base + off + region.piece_bytes);
      (*copy)[copy->size() / 2] ^= 0x40;
      KvRegion packed;
      packed.base = copy->data();
      packed.piece_bytes = region.piece_bytes;
      for (size_t i = 0; i < region.offsets.size(); ++i)
        packed.offsets.push_back(static_cast<int64_t>(i) * region.piece_bytes);
      staging_.push_back(std::move(copy));
      return wrap(inner_->post_send(peer, tag, packed));
    }
  }
  return wrap(inner_->post_send(peer, tag, region));
}

Result<TransferOp> FaultInjectionTransport::post_send_bytes(int peer, int tag, const void* data, size_t bytes) {
  if (fault_ == Fault::kHangFirstSend && bytes > 0 && targets(tag)) {
    const int64_t id = next_++;
    hung_.emplace(id, false);
    return TransferOp{id};
  }
  return wrap(inner_->post_send_bytes(peer, tag, data, bytes));
}

Result<OpState> FaultInjectionTransport::test(TransferOp op) {
  if (auto h = hung_.find(op.value); h != hung_.end()) {
    if (!h->second) return OpState::kPending;
    hung_.erase(h);
    return OpState::kCancelled;
  }
  auto it = ops_.find(op.value);
  if (it == ops_.end()) return Status::not_found("fault transport: unknown op " + std::to_string(op.value));
  auto r = inner_->test(it->second);
  if (!r.is_ok() || *r != OpState::kPending) ops_.erase(it);
  return r;
}

void FaultInjectionTransport::abandon(TransferOp op) {
  if (hung_.erase(op.value)) return;
  if (auto it = ops_.find(op.value); it != ops_.end()) {
    inner_->abandon(it->second);
    ops_.erase(it);
  }
}

void FaultInjectionTransport::cancel(TransferOp op) {
  if (auto h = hung_.find(op.value); h != hung_.end()) {
    h->second = true;
    return;
  }
  if (auto it = ops_.find(op.value); it != ops_.end()) inner_->cancel(it->second);
}

}  // namespace pd
