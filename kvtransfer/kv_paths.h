// KvPaths: the Transport a worker holds, with one transport per KV path
// (mpi always; nccl and cuda_ipc where this process has them) and each peer
// routed over the path its handoffs negotiated (select_path, from
// choose_kv_path on both ends). Small byte buffers (trailers) always take the
// mpi path. Operation ids are this object's own; each maps to the inner
// transport and op that carries it.
#pragma once

#include <map>
#include <memory>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"
#include "kvtransfer/transport.h"
#include "protocol/mpi_links.h"

namespace pd {

class KvPaths final : public Transport {
 public:
  explicit KvPaths(std::unique_ptr<Transport> mpi);
  // Adds a device path (replacing one of the same kind). kMpi is the constructor's.
  void add(KvPath path, std::unique_ptr<Transport> transport);

  std::string name() const override;
  Result<TransferOp> post_send(int peer, int tag, const KvRegion& region) override;
  Result<TransferOp> post_recv(int peer, int tag, const KvRegion& region) override;
  Result<TransferOp> post_send_bytes(int peer, int tag, const void* data, size_t bytes) override;
  Result<TransferOp> post_recv_bytes(int peer, int tag, void* data, size_t bytes) override;
  Result<OpState> test(TransferOp op) override;
  void cancel(TransferOp op) override;
  void abandon(TransferOp op) override;
  // Over the path `peer`'s region operations take now: the mpi path carries a
  // handoff's every message under its tag; a device path refuses.
  Result<TransferOp> post_reclaim(int peer, int tag) override;
  size_t pending() const override { return ops_.size(); }
  std::vector<KvPath> paths() const override;
  // Unsupported (naming the path) when this process has no such path. A
  // peer's path changes only when it is selected anew (logged, with why);
  // operations already posted stay on the path they were posted on.
  Status select_path(int peer, const KvPathChoice& choice) override;
  void forget_peer(int peer) override;
  void progress() override;
  void bind_thread() override;
  // The path region operations with `peer` take now (kMpi until selected).
  KvPath path_of(int peer) const;

 private:
  struct Inner {
    Transport* transport;
    TransferOp op;
  };
  Result<TransferOp> track(Transport* t, Result<TransferOp> op);
  std::map<KvPath, std::unique_ptr<Transport>> paths_;
  std::unordered_map<int, KvPath> selected_;
  std::unordered_map<int64_t, Inner> ops_;
  int64_t next_ = 0;
};

// A worker's KV transport for its cache in `cache` on `backend`: MPI over
// `links` (staged through host memory when the cache is device memory) plus
// the device paths this build and process have.
std::unique_ptr<KvPaths> make_kv_transport(std::shared_ptr<MpiLinks> links, Backend& backend, BackendBuffer& cache);

}  // namespace pd
