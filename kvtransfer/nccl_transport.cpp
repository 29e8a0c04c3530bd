#include "kvtransfer/nccl_transport.h"

#include <spdlog/spdlog.h>

#include <cstring>
#include <string>

namespace pd {
namespace {

constexpr const char* kNcclWho = "nccl transport";
static_assert(sizeof(ncclUniqueId) == sizeof(NcclIdMsg::id));

Status nccl_error(const std::string& call, ncclResult_t r, ncclComm_t comm) {
  std::string msg = std::string(kNcclWho) + ": " + call + " failed: " + ncclGetErrorString(r);
  if (const char* last = ncclGetLastError(comm); last != nullptr && *last != '\0')
    msg += std::string(" (") + last + ")";
  return Status::io_error(msg);
}

std::string with_rank(const char* call, int peer) { return std::string(call) + " with rank " + std::to_string(peer); }

}  // namespace

Result<std::unique_ptr<NcclTransport>> NcclTransport::create(std::shared_ptr<MpiLinks> links, void* compute_stream,
                                                             BackendBuffer& cache) {
  cudaPointerAttributes attr{};
  if (cudaError_t err = cudaPointerGetAttributes(&attr, cache.data()); err != cudaSuccess)
    return cuda_call_error(kNcclWho, "cudaPointerGetAttributes (KV cache)", err);
  if (attr.type != cudaMemoryTypeDevice)
    return Status::invalid_argument("nccl transport: KV cache is not device memory");
  if (cudaError_t err = cudaSetDevice(attr.device); err != cudaSuccess)
    return cuda_call_error(kNcclWho, "cudaSetDevice", err);
  std::unique_ptr<NcclTransport> t(
      new NcclTransport(std::move(links), static_cast<cudaStream_t>(compute_stream), cache));
  t->device_ = attr.device;
  PD_ASSIGN_OR_RETURN(t->order_, t->events_.get());
  return t;
}

NcclTransport::NcclTransport(std::shared_ptr<MpiLinks> links, cudaStream_t compute, BackendBuffer& cache)
    : msgs_(std::move(links), proto::kTagKvNccl),
      compute_(compute),
      cache_base_(static_cast<uint8_t*>(cache.data())),
      cache_bytes_(cache.size()) {}

NcclTransport::~NcclTransport() {
  for (auto& [peer, p] : pairs_)
    if (p.comm != nullptr) (void)ncclCommAbort(p.comm);
  for (auto& [peer, p] : pairs_) {
    if (p.stream == nullptr) continue;
    (void)cudaStreamSynchronize(p.stream);
    for (Work& w : p.issued)
      if (w.staging != nullptr) (void)cudaFree(w.staging);
    (void)cudaStreamDestroy(p.stream);
  }
  for (Send& s : sends_) (void)cudaEventDestroy(s.ready);
  for (Flying& f : flying_) {
    (void)cudaEventDestroy(f.done);
    if (f.pinned != nullptr) pinned_.put(f.pinned);
  }
  if (order_ != nullptr) (void)cudaEventDestroy(order_);
}

Result<std::vector<int64_t>> NcclTransport::cache_offsets(const KvRegion& region) const {
  return kv_cache_offsets(region, cache_base_, cache_bytes_, "nccl transport");
}

Status NcclTransport::init_comm(int peer, Pair& p, const ncclUniqueId& id, int nranks, int rank) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const ncclResult_t r = ncclCommInitRankConfig(&p.comm, nranks, id, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) return nccl_error(with_rank("ncclCommInitRankConfig", peer), r, p.comm);
  p.state = CommState::kInitializing;
  return Status::ok();
}

Result<NcclTransport::Pair*> NcclTransport::pair(int peer) {
  if (auto it = pairs_.find(peer); it != pairs_.end()) {
    if (it->second.state == CommState::kFailed) return it->second.error;
    return &it->second;
  }
  Pair& p = pairs_[peer];
  Status s;
  if (cudaError_t err = cudaStreamCreateWithFlags(&p.stream, cudaStreamNonBlocking); err != cudaSuccess) {
    s = cuda_call_error(kNcclWho, "cudaStreamCreateWithFlags", err);
  } else {
    const int self = msgs_.self_id();
    if (self <= peer) {
      // The lower id (or a rank alone with itself) makes the id. The higher waits for it.
      ncclUniqueId id;
      if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
        s = nccl_error("ncclGetUniqueId", r, nullptr);
      } else if (peer == self) {
        s = init_comm(peer, p, id, 1, 0);
      } else {
        NcclIdMsg m;
        std::memcpy(m.id.data(), &id, sizeof id);
        s = msgs_.send(peer, m);
        if (s.is_ok()) s = init_comm(peer, p, id, 2, 0);
      }
    }
  }
  if (!s.is_ok()) {
    fail_pair(peer, p, s);
    return s;
  }
  return &p;
}

void NcclTransport::fail_pair(int peer, Pair& p, Status why) {
  spdlog::warn("nccl transport: communicator with rank {} failed: {}", peer, why.to_string());
  if (p.comm != nullptr) (void)ncclCommAbort(p.comm);
  p.comm = nullptr;
  p.state = CommState::kFailed;
  p.error = why;
  // A group NCCL never enqueued: its staging (and its gather) is released in stream order.
  for (Work& w : p.issued)
    if (w.staging != nullptr) (void)cudaFreeAsync(w.staging, p.stream);
  p.issued.clear();
  p.todo.clear();
  for (Flying& f : flying_)
    if (f.peer == peer && f.error.is_ok()) f.error = why;
  for (int64_t op : ops_.live_ops_with(peer)) {
    bool on_device = false;
    for (const Flying& f : flying_) on_device |= f.op == op;
    if (on_device) continue;  // fails once the device is done with its memory
    ops_.fail(op, why);
    recvs_.erase(op);
  }
}

void NcclTransport::land(int peer, Pair& p, int64_t op, void* pinned, Status pending_error) {
  Result<cudaEvent_t> ev = events_.get();
  cudaError_t err = cudaErrorUnknown;
  if (ev.is_ok() && (err = cudaEventRecord(*ev, p.stream)) == cudaSuccess) {
    flying_.push_back(Flying{op, peer, *ev, pinned, std::move(pending_error)});
    return;
  }
  if (ev.is_ok()) events_.put(*ev);
  (void)cudaStreamSynchronize(p.stream);
  if (pinned != nullptr) pinned_.put(pinned);
  ops_.fail(op, ev.is_ok() ? cuda_call_error(kNcclWho, "cudaEventRecord", err) : ev.status());
}

void NcclTransport::enqueued(int peer, Pair& p) {
  // The group is on the stream: what depends on it can follow.
  for (Work& w : p.issued) {
    void* pinned = nullptr;
    Status s;
    const DeviceOpTable::Op* op = ops_.find(w.op);
    if (!w.send && !w.offsets.empty() && op != nullptr && op->phase == DevicePhase::kInFlight) {
      // The blocks may still be read by ops already on the compute stream.
      cudaError_t err = cudaEventRecord(order_, compute_);
      if (err == cudaSuccess) err = cudaStreamWaitEvent(p.stream, order_, 0);
      if (err != cudaSuccess) s = cuda_call_error(kNcclWho, "ordering after the compute stream", err);
      if (s.is_ok())
        s = enqueue_piece_copy(p.stream, pinned_, w.staging, {}, cache_base_, w.offsets,
                               static_cast<int64_t>(w.offsets.size()), static_cast<size_t>(w.piece_bytes), &pinned);
    }
    (void)cudaFreeAsync(w.staging, p.stream);
    w.staging = nullptr;
    if (w.op < 0) continue;
    if (!s.is_ok()) {
      ops_.fail(w.op, std::move(s));
      continue;
    }
    land(peer, p, w.op, pinned, Status::ok());
  }
  p.issued.clear();
}

Status NcclTransport::issue(int peer, Pair& p) {
  const int self = msgs_.self_id();
  // A rank alone with itself sends and receives in one group (pushed together).
  const size_t n = peer == self ? 2 : 1;
  if (p.todo.size() < n) return Status::ok();
  const int nccl_peer = peer == self ? 0 : (self < peer ? 1 : 0);
  for (size_t k = 0; k < n; ++k) {
    Work w = std::move(p.todo.front());
    p.todo.pop_front();
    p.issued.push_back(std::move(w));
    Work& x = p.issued.back();
    if (cudaError_t err = cudaMallocAsync(&x.staging, x.bytes, p.stream); err != cudaSuccess) {
      x.staging = nullptr;
      return cuda_call_error(kNcclWho, "cudaMallocAsync (staging)", err);
    }
    if (x.send) {
      void* pinned = nullptr;
      PD_RETURN_IF_ERROR(enqueue_piece_copy(p.stream, pinned_, cache_base_, x.offsets, x.staging, {},
                                            static_cast<int64_t>(x.offsets.size()), static_cast<size_t>(x.piece_bytes),
                                            &pinned));
      land(peer, p, -1, pinned, Status::ok());  // gives the offsets' pinned buffer back once the gather ran
    }
  }
  if (ncclResult_t r = ncclGroupStart(); r != ncclSuccess) return nccl_error("ncclGroupStart", r, p.comm);
  for (Work& w : p.issued) {
    const ncclResult_t r = w.send ? ncclSend(w.staging, w.bytes, ncclUint8, nccl_peer, p.comm, p.stream)
                                  : ncclRecv(w.staging, w.bytes, ncclUint8, nccl_peer, p.comm, p.stream);
    if (r != ncclSuccess && r != ncclInProgress) {
      (void)ncclGroupEnd();
      return nccl_error(with_rank(w.send ? "ncclSend" : "ncclRecv", peer), r, p.comm);
    }
  }
  const ncclResult_t r = ncclGroupEnd();
  if (r == ncclInProgress) {
    p.state = CommState::kEnqueuing;
  } else if (r != ncclSuccess) {
    return nccl_error(with_rank("ncclGroupEnd", peer), r, p.comm);
  } else {
    enqueued(peer, p);
  }
  return Status::ok();
}

void NcclTransport::advance(int peer, Pair& p) {
  if (p.state == CommState::kInitializing || p.state == CommState::kEnqueuing) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(p.comm, &state);
    if (r != ncclSuccess) return fail_pair(peer, p, nccl_error(with_rank("ncclCommGetAsyncError", peer), r, p.comm));
    if (state == ncclInProgress) return;
    if (state != ncclSuccess)
      return fail_pair(peer, p,
                       nccl_error(p.state == CommState::kInitializing ? with_rank("ncclCommInitRankConfig", peer)
                                                                      : with_rank("ncclGroupEnd", peer),
                                  state, p.comm));
    if (p.state == CommState::kEnqueuing) enqueued(peer, p);
    p.state = CommState::kReady;
  }
  while (p.state == CommState::kReady && !p.todo.empty()) {
    const size_t before = p.todo.size();
    if (Status s = issue(peer, p); !s.is_ok()) return fail_pair(peer, p, std::move(s));
    if (p.todo.size() == before) break;  // waiting for the other half of a self group
  }
}

void NcclTransport::on_envelope(int peer, const NcclEnvelope& e) {
  Result<Pair*> p = pair(peer);
  const std::optional<int64_t> op = ops_.match(peer, e.tag);
  if (!p.is_ok()) {
    if (op) ops_.fail(*op, p.status());
    return;
  }
  Work w;
  w.bytes = static_cast<size_t>(e.bytes);
  if (op) {
    auto it = recvs_.find(*op);
    const int64_t want =
        it == recvs_.end() ? -1 : it->second.piece_bytes * static_cast<int64_t>(it->second.offsets.size());
    if (want != static_cast<int64_t>(e.bytes)) {
      ops_.fail(*op, Status::invalid_argument("nccl transport: rank " + std::to_string(peer) + " sent " +
                                              std::to_string(e.bytes) + " bytes under tag " + std::to_string(e.tag) +
                                              ", the receive holds " + std::to_string(want)));
    } else {
      w.op = *op;
      w.offsets = std::move(it->second.offsets);
      w.piece_bytes = it->second.piece_bytes;
    }
    if (it != recvs_.end()) recvs_.erase(it);
  }
  (*p)->todo.push_back(std::move(w));
}

void NcclTransport::on_message(int peer, Result<DeviceMsg> msg) {
  if (!msg.is_ok()) {
    spdlog::warn("nccl transport: message from rank {} dropped: {}", peer, msg.status().to_string());
    return;
  }
  if (const auto* e = std::get_if<NcclEnvelope>(&*msg)) return on_envelope(peer, *e);
  if (const auto* m = std::get_if<NcclIdMsg>(&*msg)) {
    Result<Pair*> p = pair(peer);
    if (!p.is_ok()) return;
    if ((*p)->state != CommState::kWaitingId || peer > msgs_.self_id()) {
      spdlog::warn("nccl transport: unexpected communicator id from rank {} dropped", peer);
      return;
    }
    ncclUniqueId id;
    std::memcpy(&id, m->id.data(), sizeof id);
    if (Status s = init_comm(peer, **p, id, 2, 1); !s.is_ok()) fail_pair(peer, **p, std::move(s));
    return;
  }
  spdlog::warn("nccl transport: unexpected message kind from rank {} dropped", peer);
}

void NcclTransport::progress() {
  for (DeviceMsgLink::Arrived& a : msgs_.poll()) on_message(a.peer, std::move(a.msg));
  start_ready_sends();
  for (auto& [peer, p] : pairs_) advance(peer, p);
  land_finished();
}

void NcclTransport::start_ready_sends() {
  // Sends whose KV the compute stream has finished writing: envelope, then the
  // NCCL work in the same order. One stream, so its events complete in order.
  size_t i = 0;
  for (; i < sends_.size(); ++i) {
    Send& s = sends_[i];
    const DeviceOpTable::Op* op = ops_.find(s.op);
    if (op == nullptr || op->phase != DevicePhase::kQueued) {  // cancelled, abandoned or failed
      events_.put(s.ready);
      continue;
    }
    const cudaError_t q = cudaEventQuery(s.ready);
    if (q == cudaErrorNotReady) break;
    events_.put(s.ready);
    if (q != cudaSuccess) {
      ops_.fail(s.op, cuda_call_error(kNcclWho, "cudaEventQuery (compute stream)", q));
      continue;
    }
    const int peer = op->peer;
    const NcclEnvelope env{op->tag, static_cast<uint64_t>(s.piece_bytes) * s.offsets.size()};
    Result<Pair*> p = pair(peer);
    if (!p.is_ok()) {
      ops_.fail(s.op, p.status());
      continue;
    }
    if (peer != msgs_.self_id()) {
      if (Status st = msgs_.send(peer, env); !st.is_ok()) {
        ops_.fail(s.op, std::move(st));
        continue;
      }
    }
    ops_.start(s.op);
    Work w;
    w.send = true;
    w.op = s.op;
    w.bytes = static_cast<size_t>(env.bytes);
    w.offsets = std::move(s.offsets);
    w.piece_bytes = s.piece_bytes;
    (*p)->todo.push_back(std::move(w));
    if (peer == msgs_.self_id()) on_envelope(peer, env);
  }
  sends_.erase(sends_.begin(), sends_.begin() + static_cast<std::ptrdiff_t>(i));
}

void NcclTransport::land_finished() {
  for (auto it = flying_.begin(); it != flying_.end();) {
    const cudaError_t q = cudaEventQuery(it->done);
    if (q == cudaErrorNotReady) {
      ++it;
      continue;
    }
    if (q != cudaSuccess)
      ops_.fail(it->op, cuda_call_error(kNcclWho, "KV transfer with rank " + std::to_string(it->peer), q));
    else if (!it->error.is_ok())
      ops_.fail(it->op, std::move(it->error));
    else
      ops_.finish(it->op);
    events_.put(it->done);
    if (it->pinned != nullptr) pinned_.put(it->pinned);
    it = flying_.erase(it);
  }
}

Result<TransferOp> NcclTransport::post_send(int peer, int tag, const KvRegion& region) {
  PD_ASSIGN_OR_RETURN(std::vector<int64_t> offsets, cache_offsets(region));
  PD_RETURN_IF_ERROR(pair(peer).status());  // starts the communicator now
  PD_ASSIGN_OR_RETURN(cudaEvent_t ready, events_.get());
  if (cudaError_t err = cudaEventRecord(ready, compute_); err != cudaSuccess) {
    events_.put(ready);
    return cuda_call_error(kNcclWho, "cudaEventRecord (compute stream)", err);
  }
  const int64_t op = ops_.add(true, peer, tag);
  sends_.push_back(Send{op, ready, std::move(offsets), region.piece_bytes});
  return TransferOp{op};
}

Result<TransferOp> NcclTransport::post_recv(int peer, int tag, const KvRegion& region) {
  PD_ASSIGN_OR_RETURN(std::vector<int64_t> offsets, cache_offsets(region));
  PD_RETURN_IF_ERROR(pair(peer).status());
  const int64_t op = ops_.add(false, peer, tag);
  recvs_.emplace(op, Recv{std::move(offsets), region.piece_bytes});
  return TransferOp{op};
}

Result<TransferOp> NcclTransport::post_send_bytes(int, int, const void*, size_t) {
  return Status::unsupported("nccl transport: byte buffers travel over MPI");
}
Result<TransferOp> NcclTransport::post_recv_bytes(int, int, void*, size_t) {
  return Status::unsupported("nccl transport: byte buffers travel over MPI");
}
Result<TransferOp> NcclTransport::post_reclaim(int, int) {
  return Status::unsupported("nccl transport: a tag cannot be reclaimed on this path (its KV does not travel under the tag)");
}

Result<OpState> NcclTransport::test(TransferOp op) {
  progress();
  return ops_.report(op.value);
}

void NcclTransport::cancel(TransferOp op) {
  if (ops_.cancel(op.value)) recvs_.erase(op.value);  // a send's event is returned by progress()
}

void NcclTransport::abandon(TransferOp op) {
  // Work already handed to a pair is still issued (both ends keep the order);
  // what it owns lives until its event completes.
  if (ops_.abandon(op.value) == DevicePhase::kQueued) recvs_.erase(op.value);
}

void NcclTransport::forget_peer(int peer) {
  auto it = pairs_.find(peer);
  if (it == pairs_.end()) return;
  Pair& p = it->second;
  if (p.state != CommState::kFailed)
    fail_pair(peer, p, Status::io_error("nccl transport: rank " + std::to_string(peer) + " is gone"));
  // Queued sends of the peer failed with it; their compute events go back in progress().
  if (p.stream != nullptr) (void)cudaStreamDestroy(p.stream);  // returns at once; its work still completes
  pairs_.erase(it);
}

void NcclTransport::bind_thread() {
  if (cudaError_t err = cudaSetDevice(device_); err != cudaSuccess)
    spdlog::error("NcclTransport: cudaSetDevice({}) on the communication thread: {}", device_, cudaGetErrorString(err));
}

}  // namespace pd
