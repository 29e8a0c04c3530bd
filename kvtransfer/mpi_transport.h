// The MPI Transport: host memory, one MPI_Isend/MPI_Irecv per KV layer with an
// hindexed derived datatype over the sequence's blocks, so neither side packs
// or unpacks (no staging copy). Peers are rank ids (MpiLinks, shared with the
// control channel). The engine-loop thread is the only caller.
#pragma once

#include <mpi.h>

#include <memory>
#include <unordered_map>
#include <unordered_set>

#include "kvtransfer/transport.h"
#include "protocol/mpi_links.h"

namespace pd {

class MpiTransport final : public Transport {
 public:
  explicit MpiTransport(std::shared_ptr<MpiLinks> links = std::make_shared<MpiLinks>()) : links_(std::move(links)) {}
  ~MpiTransport() override;
  std::string name() const override { return "mpi"; }
  Result<TransferOp> post_send(int peer, int tag, const KvRegion& region) override;
  Result<TransferOp> post_recv(int peer, int tag, const KvRegion& region) override;
  Result<TransferOp> post_send_bytes(int peer, int tag, const void* data, size_t bytes) override;
  Result<TransferOp> post_recv_bytes(int peer, int tag, void* data, size_t bytes) override;
  Result<OpState> test(TransferOp op) override;
  void cancel(TransferOp op) override;
  void abandon(TransferOp op) override;
  size_t pending() const override { return ops_.size(); }

 private:
  Result<TransferOp> post(bool send, int peer, int tag, const KvRegion& region);
  TransferOp track(MPI_Request req);
  std::shared_ptr<MpiLinks> links_;
  int64_t next_ = 0;
  std::unordered_map<int64_t, MPI_Request> ops_;
  std::unordered_set<int64_t> cancelled_;  // ops MPI_Cancel was called on (at most once each)
};

}  // namespace pd
