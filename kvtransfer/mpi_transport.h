// The MPI Transport: host memory, one MPI_Isend/MPI_Irecv per KV layer with an
// hindexed derived datatype over the sequence's blocks, so neither side packs
// or unpacks (no staging copy). Peers are rank ids (MpiLinks, shared with the
// control channel). The engine-loop thread is the only caller.
//
// Testing: progress() tests every operation in flight with one MPI_Testsome
// and keeps what ended; a test() after it answers from that sweep without an
// MPI call. Each MPI test of a request that has not ended runs the progress
// engine, and with mpi_yield_when_idle (set on an oversubscribed node) one
// that moves nothing yields the core: a decode rank with a long prompt's
// ~500 receives posted, tested one by one every round, gave its core away
// ~500 times a round, and its control messages (token events) waited up to
// 0.6 s behind them. A test() with no sweep since the operation's last
// answer tests it alone, as before (callers that never call progress()).
#pragma once

#include <mpi.h>

#include <map>
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
  size_t pending() const override { return ops_.size() + ended_.size() + reclaims_.size(); }
  // One MPI_Testsome over every operation in flight (reclaims excepted).
  void progress() override;

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
  // An operation in flight.
  struct Op {
    MPI_Request req = MPI_REQUEST_NULL;
    uint64_t pending_at = 0;  // the sweep that last found it in flight (0: none since its last answer)
  };
  Result<TransferOp> post(bool send, int peer, int tag, const KvRegion& region);
  TransferOp track(MPI_Request req);
  // How an operation MPI reports complete ended: done, cancelled.
  static OpState ended_state(MPI_Status& st);
  Result<OpState> test_reclaim(int64_t id);
  std::shared_ptr<MpiLinks> links_;
  int64_t next_ = 0;
  std::map<int64_t, Op> ops_;  // by id: a sweep tests them in posting order
  // Ended in a sweep, until test() reports it (or abandon() forgets it).
  std::unordered_map<int64_t, Result<OpState>> ended_;
  uint64_t sweep_ = 0;  // sweeps so far
  // A sweep's arrays, kept between sweeps (no allocation in steady state).
  std::vector<int64_t> sweep_ids_;
  std::vector<MPI_Request> sweep_reqs_;
  std::vector<int> sweep_done_;
  std::vector<MPI_Status> sweep_status_;
  std::unordered_set<int64_t> cancelled_;  // ops MPI_Cancel was called on (at most once each)
  std::unordered_map<int64_t, Reclaim> reclaims_;  // by op id (the same numbering as ops_)
  // Scratch of reclaims abandoned while taking a message: MPI may still write there.
  std::vector<std::unique_ptr<std::vector<uint8_t>>> parked_;
};

}  // namespace pd
