// NcclTransport: KV GPU to GPU between different devices (one host or many).
// NCCL matches sends and receives by order on a communicator, not by tag, so:
//   - each peer pair has its own 2-rank communicator, made on first use with
//     the non-blocking init (polled, never waited): the lower rank id makes
//     the ncclUniqueId and sends it over MPI (proto::kTagKvNccl) and is NCCL rank 0.
//     A rank sending to itself gets a 1-rank communicator (send and receive
//     in one group).
//   - send: once the compute stream's event for it has completed (polled),
//     the region's pieces are gathered into contiguous device staging on the
//     pair's stream, an envelope {tag, bytes} goes to the peer over MPI and
//     an ncclSend follows on the pair's communicator; kDone when its event
//     completes.
//   - receive: posted FIFO per (peer, tag). Envelopes arrive in order (MPI
//     does not overtake); each takes the oldest posted receive of its tag and
//     becomes an ncclRecv into staging, then a scatter into the region (after
//     the ops already on the compute stream); kDone when its event completes,
//     so later launches on the compute stream are ordered after it. An
//     envelope with no receive (cancelled, abandoned) or of the wrong size
//     (that receive fails, naming both sizes) is received into scratch and
//     dropped: the send must be matched or the communicator stalls.
//   Both ends issue the pair's NCCL operations in envelope order, so they agree.
//   Traffic between a pair goes one way (prefill -> decode): two ranks sending
//   to each other at once could each wait in ncclSend for the other.
// Cancel: an unmatched receive, or a send still waiting on the compute stream,
// ends kCancelled; anything else completes. forget_peer() aborts the pair's
// communicator (how operations with a dead peer end); every CUDA or NCCL error
// becomes a Status naming the call, and a failed communicator fails its
// operations. Progress is made in test(). Small byte buffers are unsupported
// (trailers travel over MPI). The engine-loop thread is the only caller.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <deque>
#include <map>
#include <memory>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"
#include "kvtransfer/cuda_kv_copy.h"
#include "kvtransfer/device_match.h"
#include "kvtransfer/transport.h"
#include "protocol/mpi_links.h"

namespace pd {

class NcclTransport final : public Transport {
 public:
  // `compute_stream`: the backend's stream; `cache`: the KV cache every region
  // points into. Uses the device that holds `cache`.
  static Result<std::unique_ptr<NcclTransport>> create(std::shared_ptr<MpiLinks> links, void* compute_stream,
                                                       BackendBuffer& cache);
  // Aborts every communicator, then waits for its own streams (bounded once aborted).
  ~NcclTransport() override;

  std::string name() const override { return "nccl"; }
  std::vector<KvPath> paths() const override { return {KvPath::kNccl}; }
  Result<TransferOp> post_send(int peer, int tag, const KvRegion& region) override;
  Result<TransferOp> post_recv(int peer, int tag, const KvRegion& region) override;
  Result<TransferOp> post_send_bytes(int peer, int tag, const void* data, size_t bytes) override;
  Result<TransferOp> post_recv_bytes(int peer, int tag, void* data, size_t bytes) override;
  Result<OpState> test(TransferOp op) override;
  void cancel(TransferOp op) override;
  void abandon(TransferOp op) override;
  // Unsupported: a handoff's KV travels on this path's own message tag, apart
  // from its trailer's MPI tag, so no seal under the tag can order it (a
  // tag whose handoff ended early on this path is retired: decode_node/kv_tags.h).
  Result<TransferOp> post_reclaim(int peer, int tag) override;
  size_t pending() const override { return ops_.size(); }
  void progress() override;
  // Makes the device holding the cache current on the calling thread.
  void bind_thread() override;
  // Aborts the pair's communicator and drops its state; the peer's operations
  // fail (a receive already on the device fails once its last write is done).
  void forget_peer(int peer) override;

 private:
  int device_ = 0;  // the device holding the cache (bind_thread)
  enum class CommState {
    kWaitingId,     // the higher id: waiting for the lower one's ncclUniqueId
    kInitializing,  // ncclCommInitRankConfig in progress
    kReady,
    kEnqueuing,  // a group was issued; NCCL has not put it on the stream yet
    kFailed,     // until forget_peer()
  };
  struct Work {  // one NCCL operation of a pair, in the order both ends issue them
    bool send = false;
    int64_t op = -1;  // -1: a receive nobody wants (into scratch)
    size_t bytes = 0;
    std::vector<int64_t> offsets;  // the region's pieces from the cache base; empty for scratch
    int64_t piece_bytes = 0;
    void* staging = nullptr;  // stream-ordered device memory
  };
  struct Pair {
    ncclComm_t comm = nullptr;
    CommState state = CommState::kWaitingId;
    cudaStream_t stream = nullptr;
    std::deque<Work> todo;     // not issued
    std::vector<Work> issued;  // in the group being enqueued (kEnqueuing)
    Status error;              // kFailed
  };
  struct Send {  // waiting for the compute stream
    int64_t op;
    cudaEvent_t ready;
    std::vector<int64_t> offsets;
    int64_t piece_bytes;
  };
  struct Recv {  // posted, not matched
    std::vector<int64_t> offsets;
    int64_t piece_bytes;
  };
  struct Flying {  // on the device
    int64_t op;
    int peer;
    cudaEvent_t done;
    void* pinned;
    Status error;  // set when the pair failed under it: the op fails once the device is done
  };

  NcclTransport(std::shared_ptr<MpiLinks> links, cudaStream_t compute, BackendBuffer& cache);
  Result<std::vector<int64_t>> cache_offsets(const KvRegion& region) const;
  Result<Pair*> pair(int peer);
  Status init_comm(int peer, Pair& p, const ncclUniqueId& id, int nranks, int rank);
  void fail_pair(int peer, Pair& p, Status why);
  void advance(int peer, Pair& p);
  // progress(): sends whose KV is written go to their pair's queue; operations
  // the device finished end (finished or failed).
  void start_ready_sends();
  void land_finished();
  Status issue(int peer, Pair& p);
  void enqueued(int peer, Pair& p);
  void land(int peer, Pair& p, int64_t op, void* pinned, Status pending_error);
  void on_message(int peer, Result<DeviceMsg> msg);
  void on_envelope(int peer, const NcclEnvelope& e);

  DeviceMsgLink msgs_;
  cudaStream_t compute_;  // the backend's
  uint8_t* cache_base_;
  size_t cache_bytes_;
  cudaEvent_t order_ = nullptr;  // re-recorded on the compute stream before each scatter
  CudaEventPool events_;
  PinnedPool pinned_;
  DeviceOpTable ops_;
  std::vector<Send> sends_;  // posting order
  std::unordered_map<int64_t, Recv> recvs_;
  std::map<int, Pair> pairs_;
  std::vector<Flying> flying_;
};

}  // namespace pd
