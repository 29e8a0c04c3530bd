#include "kvtransfer/mpi_transport.h"

#include <limits>

namespace pd {

MpiTransport::~MpiTransport() {
  // Outstanding operations at destruction (shutdown after a failure): cancel
  // and free them rather than wait on a peer that may be gone.
  for (auto& [id, req] : ops_) {
    if (req == MPI_REQUEST_NULL) continue;
    MPI_Cancel(&req);
    MPI_Request_free(&req);
  }
}

TransferOp MpiTransport::track(MPI_Request req) {
  const int64_t id = next_++;
  ops_.emplace(id, req);
  return TransferOp{id};
}

Result<TransferOp> MpiTransport::post(bool send, int peer, int tag, const KvRegion& region) {
  if (region.offsets.empty() || region.piece_bytes <= 0)
    return Status::invalid_argument("mpi transport: empty KV region");
  if (region.piece_bytes > std::numeric_limits<int>::max() ||
      region.offsets.size() > static_cast<size_t>(std::numeric_limits<int>::max()))
    return Status::invalid_argument("mpi transport: KV region too large for one MPI datatype");
  // One derived datatype: the region's pieces at their offsets from base.
  std::vector<MPI_Aint> displs(region.offsets.begin(), region.offsets.end());
  MPI_Datatype type;
  if (MPI_Type_create_hindexed_block(static_cast<int>(displs.size()), static_cast<int>(region.piece_bytes),
                                     displs.data(), MPI_BYTE, &type) != MPI_SUCCESS)
    return Status::internal("mpi transport: MPI_Type_create_hindexed_block failed");
  MPI_Type_commit(&type);
  const auto ep = links_->endpoint(peer);
  if (!ep) {
    MPI_Type_free(&type);
    return Status::not_found("mpi transport: no link to rank " + std::to_string(peer));
  }
  MPI_Request req = MPI_REQUEST_NULL;
  const int rc = send ? MPI_Isend(region.base, 1, type, ep->rank, tag, ep->comm, &req)
                      : MPI_Irecv(region.base, 1, type, ep->rank, tag, ep->comm, &req);
  MPI_Type_free(&type);  // the posted operation keeps its own reference
  if (rc != MPI_SUCCESS)
    return Status::internal(std::string("mpi transport: ") + (send ? "MPI_Isend" : "MPI_Irecv") + " to rank " +
                            std::to_string(peer) + " failed");
  return track(req);
}

Result<TransferOp> MpiTransport::post_send(int peer, int tag, const KvRegion& region) {
  return post(true, peer, tag, region);
}
Result<TransferOp> MpiTransport::post_recv(int peer, int tag, const KvRegion& region) {
  return post(false, peer, tag, region);
}

Result<TransferOp> MpiTransport::post_send_bytes(int peer, int tag, const void* data, size_t bytes) {
  const auto ep = links_->endpoint(peer);
  if (!ep) return Status::not_found("mpi transport: no link to rank " + std::to_string(peer));
  MPI_Request req = MPI_REQUEST_NULL;
  if (MPI_Isend(data, static_cast<int>(bytes), MPI_BYTE, ep->rank, tag, ep->comm, &req) != MPI_SUCCESS)
    return Status::internal("mpi transport: MPI_Isend to rank " + std::to_string(peer) + " failed");
  return track(req);
}
Result<TransferOp> MpiTransport::post_recv_bytes(int peer, int tag, void* data, size_t bytes) {
  const auto ep = links_->endpoint(peer);
  if (!ep) return Status::not_found("mpi transport: no link to rank " + std::to_string(peer));
  MPI_Request req = MPI_REQUEST_NULL;
  if (MPI_Irecv(data, static_cast<int>(bytes), MPI_BYTE, ep->rank, tag, ep->comm, &req) != MPI_SUCCESS)
    return Status::internal("mpi transport: MPI_Irecv from rank " + std::to_string(peer) + " failed");
  return track(req);
}

Result<OpState> MpiTransport::test(TransferOp op) {
  auto it = ops_.find(op.value);
  if (it == ops_.end()) return Status::not_found("mpi transport: unknown transfer op " + std::to_string(op.value));
  int done = 0;
  MPI_Status st;
  if (MPI_Test(&it->second, &done, &st) != MPI_SUCCESS) {  // MPI_ERRORS_RETURN: the op ended in error
    if (it->second != MPI_REQUEST_NULL) MPI_Request_free(&it->second);
    cancelled_.erase(it->first);
    ops_.erase(it);
    return Status::io_error("mpi transport: transfer op " + std::to_string(op.value) + " failed");
  }
  if (!done) return OpState::kPending;
  int cancelled = 0;
  MPI_Test_cancelled(&st, &cancelled);
  cancelled_.erase(it->first);
  ops_.erase(it);
  return cancelled ? OpState::kCancelled : OpState::kDone;
}

void MpiTransport::abandon(TransferOp op) {
  auto it = ops_.find(op.value);
  if (it == ops_.end()) return;
  // MPI_Request_free on an active request: MPI completes it in the background
  // (or never, if the peer is dead) and frees it then; we never look again.
  if (it->second != MPI_REQUEST_NULL) MPI_Request_free(&it->second);
  cancelled_.erase(it->first);
  ops_.erase(it);
}

void MpiTransport::cancel(TransferOp op) {
  auto it = ops_.find(op.value);
  if (it == ops_.end() || it->second == MPI_REQUEST_NULL) return;
  // Once per operation: OpenMPI 4.1's ob1 crashes (SIGSEGV in PMPI_Cancel) on a
  // second cancel of a receive it has already taken off its queue.
  if (!cancelled_.insert(op.value).second) return;
  MPI_Cancel(&it->second);
}

}  // namespace pd
