// A Transport that passes every call on to another: a test's fault decorator
// derives from it and overrides only what it changes.
#pragma once

#include <memory>
#include <string>

#include "kvtransfer/transport.h"

namespace pd::test {

class ForwardingTransport : public Transport {
 public:
  explicit ForwardingTransport(std::unique_ptr<Transport> inner) : inner_(std::move(inner)) {}
  std::string name() const override { return inner_->name(); }
  Result<TransferOp> post_send(int peer, int tag, const KvRegion& region) override {
    return inner_->post_send(peer, tag, region);
  }
  Result<TransferOp> post_recv(int peer, int tag, const KvRegion& region) override {
    return inner_->post_recv(peer, tag, region);
  }
  Result<TransferOp> post_send_bytes(int peer, int tag, const void* data, size_t bytes) override {
    return inner_->post_send_bytes(peer, tag, data, bytes);
  }
  Result<TransferOp> post_recv_bytes(int peer, int tag, void* data, size_t bytes) override {
    return inner_->post_recv_bytes(peer, tag, data, bytes);
  }
  Result<OpState> test(TransferOp op) override { return inner_->test(op); }
  void cancel(TransferOp op) override { inner_->cancel(op); }
  void abandon(TransferOp op) override { inner_->abandon(op); }
  Result<TransferOp> post_reclaim(int peer, int tag) override { return inner_->post_reclaim(peer, tag); }
  size_t pending() const override { return inner_->pending(); }
  std::vector<KvPath> paths() const override { return inner_->paths(); }
  Status select_path(int peer, const KvPathChoice& choice) override { return inner_->select_path(peer, choice); }
  void forget_peer(int peer) override { inner_->forget_peer(peer); }
  void progress() override { inner_->progress(); }

 private:
  std::unique_ptr<Transport> inner_;
};

}  // namespace pd::test
