#include "kvtransfer/mpi_transport.h"

#include <limits>

namespace pd {

MpiTransport::~MpiTransport() {
  // Outstanding operations at destruction (shutdown after a failure): cancel
  // and free them rather than wait on a peer that may be gone.
  for (auto& [id, op] : ops_) {
    if (op.req == MPI_REQUEST_NULL) continue;
    MPI_Cancel(&op.req);
    MPI_Request_free(&op.req);
  }
  for (auto& [id, r] : reclaims_) {
    if (r.recv == MPI_REQUEST_NULL) continue;
    MPI_Request_free(&r.recv);  // matched: it cannot be cancelled
    parked_.push_back(std::move(r.scratch));
  }
}

TransferOp MpiTransport::track(MPI_Request req) {
  const int64_t id = next_++;
  ops_.emplace(id, Op{req, 0});
  return TransferOp{id};
}

OpState MpiTransport::ended_state(MPI_Status& st) {
  int cancelled = 0;
  MPI_Test_cancelled(&st, &cancelled);
  return cancelled ? OpState::kCancelled : OpState::kDone;
}

void MpiTransport::progress() {
  if (ops_.empty()) return;
  sweep_ids_.clear();
  sweep_reqs_.clear();
  for (const auto& [id, op] : ops_) {
    sweep_ids_.push_back(id);
    sweep_reqs_.push_back(op.req);
  }
  const size_t n = sweep_reqs_.size();
  if (n > static_cast<size_t>(std::numeric_limits<int>::max())) return;  // test() takes them one by one
  sweep_done_.resize(n);
  sweep_status_.resize(n);
  int count = 0;
  const int rc = MPI_Testsome(static_cast<int>(n), sweep_reqs_.data(), &count, sweep_done_.data(),
                              sweep_status_.data());
  auto fail = [&](int64_t id) {
    ended_.emplace(id, Status::io_error("mpi transport: transfer op " + std::to_string(id) + " failed"));
  };
  // The ones it reports complete (MPI freed them: their handles in ops_ are
  // stale): indices[k] names the k-th, and statuses[k] — not statuses[index] — is its status.
  if (count != MPI_UNDEFINED && count >= 0 && static_cast<size_t>(count) <= n)
    for (int k = 0; k < count; ++k) {
      const size_t i = static_cast<size_t>(sweep_done_[static_cast<size_t>(k)]);
      if (i >= n) continue;
      MPI_Status& st = sweep_status_[static_cast<size_t>(k)];
      if (rc == MPI_SUCCESS || (rc == MPI_ERR_IN_STATUS && st.MPI_ERROR == MPI_SUCCESS))
        ended_.emplace(sweep_ids_[i], ended_state(st));
      else
        fail(sweep_ids_[i]);
    }
  // Any other request MPI freed (a call that stopped part way): ended, how unknown.
  for (size_t i = 0; i < n; ++i)
    if (sweep_reqs_[i] == MPI_REQUEST_NULL && !ended_.count(sweep_ids_[i])) fail(sweep_ids_[i]);
  for (size_t i = 0; i < n; ++i)
    if (ended_.count(sweep_ids_[i])) {
      ops_.erase(sweep_ids_[i]);
      cancelled_.erase(sweep_ids_[i]);
    }
  // An error beyond the requests' own: no answer is known for the rest; test() asks one by one.
  if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS) return;
  ++sweep_;
  for (auto& [id, op] : ops_) op.pending_at = sweep_;
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
  if (reclaims_.count(op.value)) return test_reclaim(op.value);
  if (auto e = ended_.find(op.value); e != ended_.end()) {
    Result<OpState> r = std::move(e->second);
    ended_.erase(e);
    return r;
  }
  auto it = ops_.find(op.value);
  if (it == ops_.end()) return Status::not_found("mpi transport: unknown transfer op " + std::to_string(op.value));
  // The last sweep found it in flight: that is the answer, once (a caller
  // that stops sweeping gets real tests again).
  if (it->second.pending_at != 0 && it->second.pending_at == sweep_) {
    it->second.pending_at = 0;
    return OpState::kPending;
  }
  int done = 0;
  MPI_Status st;
  if (MPI_Test(&it->second.req, &done, &st) != MPI_SUCCESS) {  // MPI_ERRORS_RETURN: the op ended in error
    if (it->second.req != MPI_REQUEST_NULL) MPI_Request_free(&it->second.req);
    cancelled_.erase(it->first);
    ops_.erase(it);
    return Status::io_error("mpi transport: transfer op " + std::to_string(op.value) + " failed");
  }
  if (!done) return OpState::kPending;
  const OpState state = ended_state(st);
  cancelled_.erase(it->first);
  ops_.erase(it);
  return state;
}

void MpiTransport::abandon(TransferOp op) {
  if (auto r = reclaims_.find(op.value); r != reclaims_.end()) {
    if (r->second.recv != MPI_REQUEST_NULL) {
      MPI_Request_free(&r->second.recv);  // completes in the background, into the parked scratch
      parked_.push_back(std::move(r->second.scratch));
    }
    reclaims_.erase(r);
    return;
  }
  if (ended_.erase(op.value)) return;  // ended in a sweep: nothing of it is left in MPI
  auto it = ops_.find(op.value);
  if (it == ops_.end()) return;
  // MPI_Request_free on an active request: MPI completes it in the background
  // (or never, if the peer is dead) and frees it then; we never look again.
  if (it->second.req != MPI_REQUEST_NULL) MPI_Request_free(&it->second.req);
  cancelled_.erase(it->first);
  ops_.erase(it);
}

void MpiTransport::cancel(TransferOp op) {
  if (auto r = reclaims_.find(op.value); r != reclaims_.end()) {
    r->second.cancelled = true;  // a message being taken lands first (test_reclaim)
    return;
  }
  auto it = ops_.find(op.value);
  if (it == ops_.end() || it->second.req == MPI_REQUEST_NULL) return;
  // Once per operation: OpenMPI 4.1's ob1 crashes (SIGSEGV in PMPI_Cancel) on a
  // second cancel of a receive it has already taken off its queue.
  if (!cancelled_.insert(op.value).second) return;
  MPI_Cancel(&it->second.req);
  it->second.pending_at = 0;  // its state may change without a sweep: test it
}

Result<TransferOp> MpiTransport::post_reclaim(int peer, int tag) {
  if (!links_->endpoint(peer)) return Status::not_found("mpi transport: no link to rank " + std::to_string(peer));
  const int64_t id = next_++;
  Reclaim r;
  r.peer = peer;
  r.tag = tag;
  r.scratch = std::make_unique<std::vector<uint8_t>>();
  reclaims_.emplace(id, std::move(r));
  return TransferOp{id};
}

// Takes every message that has arrived under the reclaim's (peer, tag), one
// after the other, until none is waiting (kPending), the seal is taken
// (kDone) or it was cancelled between two messages (kCancelled).
Result<OpState> MpiTransport::test_reclaim(int64_t id) {
  auto it = reclaims_.find(id);
  Reclaim& r = it->second;
  auto fail = [&](const std::string& why) -> Result<OpState> {
    if (r.recv != MPI_REQUEST_NULL) {
      MPI_Request_free(&r.recv);
      parked_.push_back(std::move(r.scratch));
    }
    const std::string what = "mpi transport: reclaiming tag " + std::to_string(r.tag) + " of rank " +
                             std::to_string(r.peer) + ": " + why;
    reclaims_.erase(it);
    return Status::io_error(what);
  };
  for (;;) {
    if (r.recv != MPI_REQUEST_NULL) {
      int done = 0;
      MPI_Status st;
      if (MPI_Test(&r.recv, &done, &st) != MPI_SUCCESS) return fail("MPI_Test failed");
      if (!done) return OpState::kPending;
      if (r.seal) {
        reclaims_.erase(it);
        return OpState::kDone;
      }
    }
    if (r.cancelled) {
      reclaims_.erase(it);
      return OpState::kCancelled;
    }
    const auto ep = links_->endpoint(r.peer);
    if (!ep) return fail("no link");
    int waiting = 0;
    MPI_Status st;
    if (MPI_Iprobe(ep->rank, r.tag, ep->comm, &waiting, &st) != MPI_SUCCESS) return fail("MPI_Iprobe failed");
    if (!waiting) return OpState::kPending;
    int bytes = 0;
    if (MPI_Get_count(&st, MPI_BYTE, &bytes) != MPI_SUCCESS || bytes == MPI_UNDEFINED || bytes < 0)
      return fail("a message of unknown size");
    r.seal = bytes == 0;
    r.scratch->resize(static_cast<size_t>(bytes));
    if (MPI_Irecv(r.scratch->data(), bytes, MPI_BYTE, ep->rank, r.tag, ep->comm, &r.recv) != MPI_SUCCESS)
      return fail("MPI_Irecv failed");
  }
}

}  // namespace pd
