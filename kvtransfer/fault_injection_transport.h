// A Transport wrapper that injects faults into a real one, for tests of the
// failure paths (LevelDB's fault_injection_test style: wrap the real
// interface, don't mock it). Selected at start-up from PD_FAULT_INJECT:
//
//   PD_FAULT_INJECT=hang_first_send   the first transfer's sends never go out
//                                     and never complete (a stuck peer/link);
//                                     they complete as cancelled once cancelled.
//   PD_FAULT_INJECT=corrupt_first_send  the first transfer's first layer is sent
//                                     with one byte flipped (on the wire only).
//
// Everything else passes through to the wrapped transport, the empty message
// that seals a tag (Transport::post_reclaim) included: it carries no KV.
#pragma once

#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kvtransfer/transport.h"

namespace pd {

class FaultInjectionTransport final : public Transport {
 public:
  enum class Fault { kHangFirstSend, kCorruptFirstSend };
  FaultInjectionTransport(std::unique_ptr<Transport> inner, Fault fault) : inner_(std::move(inner)), fault_(fault) {}
  // The wrapper PD_FAULT_INJECT asks for around `inner`, or `inner` itself.
  static std::unique_ptr<Transport> from_env(std::unique_ptr<Transport> inner);

  std::string name() const override { return inner_->name() + "+faults"; }
  Result<TransferOp> post_send(int peer, int tag, const KvRegion& region) override;
  Result<TransferOp> post_recv(int peer, int tag, const KvRegion& region) override {
    return wrap(inner_->post_recv(peer, tag, region));
  }
  Result<TransferOp> post_send_bytes(int peer, int tag, const void* data, size_t bytes) override;
  Result<TransferOp> post_recv_bytes(int peer, int tag, void* data, size_t bytes) override {
    return wrap(inner_->post_recv_bytes(peer, tag, data, bytes));
  }
  Result<OpState> test(TransferOp op) override;
  void cancel(TransferOp op) override;
  void abandon(TransferOp op) override;
  Result<TransferOp> post_reclaim(int peer, int tag) override { return wrap(inner_->post_reclaim(peer, tag)); }
  size_t pending() const override { return inner_->pending() + hung_.size(); }
  std::vector<KvPath> paths() const override { return inner_->paths(); }
  Status select_path(int peer, const KvPathChoice& choice) override { return inner_->select_path(peer, choice); }
  void forget_peer(int peer) override { inner_->forget_peer(peer); }
  void progress() override { inner_->progress(); }
  void bind_thread() override { inner_->bind_thread(); }

 private:
  bool targets(int tag);
  Result<TransferOp> wrap(Result<TransferOp> inner_op);
  std::unique_ptr<Transport> inner_;
  Fault fault_;
  int target_tag_ = -1;       // the first transfer's tag (with its peer: first seen)
  bool corrupted_ = false;
  int64_t next_ = 1;
  std::unordered_map<int64_t, TransferOp> ops_;  // our id -> inner op
  std::unordered_map<int64_t, bool> hung_;       // our id -> cancelled
  std::vector<std::unique_ptr<std::vector<uint8_t>>> staging_;  // corrupted copies in flight
};

}  // namespace pd
