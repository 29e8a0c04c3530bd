// The MPI Transport: host memory, one MPI_Isend/MPI_Irecv per KV layer with an
// hindexed derived datatype over the sequence's blocks, so neither side packs
// or unpacks (no staging copy). Peers are rank ids (MpiLinks, shared with the
// control channel). The engine-loop thread is the only caller.
#pragma once

#include <mpi.h>

#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <vector>

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
  // MPI_Iprobe under (peer, tag), then an MPI_Irecv of the probed size into
  // scratch memory, until an empty message (the seal) is taken. Probe and
  // receive cannot be split by another receive: the communication side's
  // thread makes every MPI call of the rank, and the caller posts no receive
  // under (peer, tag) meanwhile — so no matched probe is needed.
  Result<TransferOp> post_reclaim(int peer, int tag) override;
  size_t pending() const override { return ops_.size() + reclaims_.size(); }

 private:
  // A reclaim in progress (post_reclaim).
  struct Reclaim {
    int peer = -1;
    int tag = 0;
    MPI_Request recv = MPI_REQUEST_NULL;  // the message being taken, if any
    bool seal = false;                    // ... is the seal (empty)
    bool cancelled = false;
    std::unique_ptr<std::vector<uint8_t>> scratch;
  };
  Result<TransferOp> post(bool send, int peer, int tag, const KvRegion& region);
  TransferOp track(MPI_Request req);
  Result<OpState> test_reclaim(int64_t id);
  std::shared_ptr<MpiLinks> links_;
  int64_t next_ = 0;
  std::unordered_map<int64_t, MPI_Request> ops_;
  std::unordered_set<int64_t> cancelled_;  // ops MPI_Cancel was called on (at most once each)
  std::unordered_map<int64_t, Reclaim> reclaims_;  // by op id (the same numbering as ops_)
  // Scratch of reclaims abandoned while taking a message: MPI may still write there.
  std::vector<std::unique_ptr<std::vector<uint8_t>>> parked_;
};

}  // namespace pd
