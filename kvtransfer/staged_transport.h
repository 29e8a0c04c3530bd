// Host-staged KV transfers for a cache in device memory over a host-memory
// transport (MPI): a send gathers the region's pieces from the device into a
// contiguous host buffer (Backend::kv_gather, which waits for the compute that
// wrote them) and posts it as bytes; a receive lands contiguous bytes in a host
// buffer and scatters them into the device pieces (Backend::kv_scatter) when
// the inner receive completes. The bytes on the wire are the region's in wire
// order, the same as the plain MPI path's derived datatypes, so a staged end
// and a host-memory end talk to each other unchanged.
//
// Regions must describe `cache` (their base is its data()). Trailers (byte
// operations) pass straight through. A staging buffer lives until its inner
// operation has ended; an abandoned one until the transport is destroyed
// (the inner transport may still write into it).
#pragma once

#include <memory>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"
#include "kvtransfer/transport.h"

namespace pd {

class StagedTransport final : public Transport {
 public:
  StagedTransport(std::unique_ptr<Transport> inner, Backend& backend, BackendBuffer& cache)
      : inner_(std::move(inner)), backend_(backend), cache_(cache) {}
  std::string name() const override { return inner_->name() + "+staged"; }
  Result<TransferOp> post_send(int peer, int tag, const KvRegion& region) override;
  Result<TransferOp> post_recv(int peer, int tag, const KvRegion& region) override;
  Result<TransferOp> post_send_bytes(int peer, int tag, const void* data, size_t bytes) override {
    return inner_->post_send_bytes(peer, tag, data, bytes);
  }
  Result<TransferOp> post_recv_bytes(int peer, int tag, void* data, size_t bytes) override {
    return inner_->post_recv_bytes(peer, tag, data, bytes);
  }
  Result<OpState> test(TransferOp op) override;
  void cancel(TransferOp op) override { inner_->cancel(op); }
  void abandon(TransferOp op) override;
  // What is reclaimed was never staged: straight through.
  Result<TransferOp> post_reclaim(int peer, int tag) override { return inner_->post_reclaim(peer, tag); }
  size_t pending() const override { return inner_->pending(); }
  void forget_peer(int peer) override { inner_->forget_peer(peer); }
  void progress() override { inner_->progress(); }
  void bind_thread() override { inner_->bind_thread(); }

 private:
  struct Staged {
    std::vector<uint8_t> bytes;
    std::vector<int64_t> offsets;  // receive: where the bytes go
    int64_t piece_bytes = 0;
    bool recv = false;
  };
  Status check_region(const KvRegion& region) const;
  std::unique_ptr<Transport> inner_;
  Backend& backend_;
  BackendBuffer& cache_;
  std::unordered_map<int64_t, Staged> staged_;  // by inner op id
  std::vector<std::vector<uint8_t>> abandoned_;
};

}  // namespace pd
