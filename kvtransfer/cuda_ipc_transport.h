// CudaIpcTransport: KV between two processes on the same GPU (NCCL refuses
// two ranks on one device). Pull model over CUDA IPC:
//   send    records an event on the compute stream; once it has completed
//           (polled, never waited), a descriptor {tag, the cache's IPC handle,
//           the region's offsets and piece size} goes to the receiver over MPI
//           (proto::kTagKvDevice). The send is kDone when the receiver acks it.
//   receive is posted FIFO per (peer, tag). A descriptor matches the oldest;
//           the receiver maps the sender's cache (once per peer), copies the
//           pieces cache to cache on its own stream (after the ops already on
//           the compute stream, which may still read the blocks), and acks
//           when the copy's event has completed. kDone is reported only then,
//           so every later launch on the compute stream is ordered after the copy.
//   A descriptor that finds no receive (cancelled, abandoned) is acked at once
//   and copies nothing; one whose size differs fails its receive (both sizes
//   named) and is acked too. Cancel: an unmatched receive, or a send whose
//   descriptor has not gone out, ends kCancelled; anything else completes.
// Progress (descriptors, copies, acks) is made in test(). Small byte buffers
// are unsupported (trailers travel over MPI). The cache buffer's data() must be
// the base of its cudaMalloc allocation. The engine-loop thread is the only caller.
#pragma once

#include <cuda_runtime_api.h>

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

class CudaIpcTransport final : public Transport {
 public:
  // `compute_stream`: the backend's stream (Backend::native_stream()); `cache`
  // the KV cache every region points into. Uses the device that holds `cache`.
  static Result<std::unique_ptr<CudaIpcTransport>> create(std::shared_ptr<MpiLinks> links, void* compute_stream,
                                                          BackendBuffer& cache);
  // Waits for its own copies (bounded: no peer is involved), then unmaps.
  ~CudaIpcTransport() override;

  std::string name() const override { return "cuda_ipc"; }
  std::vector<KvPath> paths() const override { return {KvPath::kCudaIpc}; }
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
  // Unmaps the peer's cache once no copy reads it. Its operations that wait on
  // it (unmatched receives, sends) fail; a running copy completes.
  void forget_peer(int peer) override;

 private:
  int device_ = 0;  // the device holding the cache (bind_thread)
  // A peer's cache mapped into this process; unmapped when the last user goes.
  struct Mapping {
    std::array<uint8_t, 64> handle{};
    void* ptr = nullptr;
    ~Mapping();
  };
  struct Send {  // waiting for the compute stream
    int64_t op;
    cudaEvent_t ready;
    std::vector<int64_t> offsets;  // from the cache base
    int64_t piece_bytes;
  };
  struct Recv {  // posted, not matched
    std::vector<int64_t> offsets;
    int64_t piece_bytes;
  };
  struct Copy {  // matched, on the device
    int64_t op;
    int peer;
    DeviceAck ack;
    cudaEvent_t done;
    void* pinned;
    std::shared_ptr<Mapping> src;
  };

  CudaIpcTransport(std::shared_ptr<MpiLinks> links, cudaStream_t compute, BackendBuffer& cache);
  Result<std::vector<int64_t>> cache_offsets(const KvRegion& region) const;
  void on_message(int peer, Result<DeviceMsg> msg);
  void on_descriptor(int peer, const IpcDescriptor& d);
  Status start_copy(int peer, int64_t op, const IpcDescriptor& d, const Recv& dst);
  Result<std::shared_ptr<Mapping>> map_peer(int peer, const IpcDescriptor& d);
  void ack(int peer, const DeviceAck& a);

  DeviceMsgLink msgs_;
  cudaStream_t compute_;           // the backend's
  cudaStream_t stream_ = nullptr;  // the copies', non-blocking
  uint8_t* cache_base_;
  size_t cache_bytes_;
  std::array<uint8_t, 64> cache_handle_{};
  cudaEvent_t order_ = nullptr;  // re-recorded on the compute stream before each copy
  CudaEventPool events_;
  PinnedPool pinned_;
  DeviceOpTable ops_;
  std::vector<Send> sends_;  // posting order
  std::unordered_map<int64_t, Recv> recvs_;
  std::vector<Copy> copies_;
  std::map<int, std::shared_ptr<Mapping>> mapped_;  // peer -> its cache
};

}  // namespace pd
