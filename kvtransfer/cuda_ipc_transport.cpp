#include "kvtransfer/cuda_ipc_transport.h"

#include <spdlog/spdlog.h>

#include <cstring>
#include <string>

namespace pd {
namespace {

constexpr const char* kCudaIpcWho = "cuda_ipc transport";
static_assert(sizeof(cudaIpcMemHandle_t) == sizeof(IpcDescriptor::handle));

std::string region_size(size_t pieces, int64_t piece_bytes) {
  return std::to_string(static_cast<int64_t>(pieces) * piece_bytes) + " bytes (" + std::to_string(pieces) + " x " +
         std::to_string(piece_bytes) + ")";
}

}  // namespace

CudaIpcTransport::Mapping::~Mapping() {
  if (ptr != nullptr) (void)cudaIpcCloseMemHandle(ptr);
}

Result<std::unique_ptr<CudaIpcTransport>> CudaIpcTransport::create(std::shared_ptr<MpiLinks> links,
                                                                   void* compute_stream, BackendBuffer& cache) {
  cudaPointerAttributes attr{};
  if (cudaError_t err = cudaPointerGetAttributes(&attr, cache.data()); err != cudaSuccess)
    return cuda_call_error(kCudaIpcWho, "cudaPointerGetAttributes (KV cache)", err);
  if (attr.type != cudaMemoryTypeDevice)
    return Status::invalid_argument("cuda_ipc transport: KV cache is not device memory");
  if (cudaError_t err = cudaSetDevice(attr.device); err != cudaSuccess)
    return cuda_call_error(kCudaIpcWho, "cudaSetDevice", err);
  std::unique_ptr<CudaIpcTransport> t(
      new CudaIpcTransport(std::move(links), static_cast<cudaStream_t>(compute_stream), cache));
  t->device_ = attr.device;
  cudaIpcMemHandle_t h;
  if (cudaError_t err = cudaIpcGetMemHandle(&h, cache.data()); err != cudaSuccess)
    return cuda_call_error(kCudaIpcWho, "cudaIpcGetMemHandle (KV cache)", err);
  std::memcpy(t->cache_handle_.data(), &h, sizeof h);
  if (cudaError_t err = cudaStreamCreateWithFlags(&t->stream_, cudaStreamNonBlocking); err != cudaSuccess)
    return cuda_call_error(kCudaIpcWho, "cudaStreamCreateWithFlags", err);
  PD_ASSIGN_OR_RETURN(t->order_, t->events_.get());
  return t;
}

CudaIpcTransport::CudaIpcTransport(std::shared_ptr<MpiLinks> links, cudaStream_t compute, BackendBuffer& cache)
    : msgs_(std::move(links), proto::kTagKvDevice),
      compute_(compute),
      cache_base_(static_cast<uint8_t*>(cache.data())),
      cache_bytes_(cache.size()) {}

CudaIpcTransport::~CudaIpcTransport() {
  if (stream_ != nullptr) (void)cudaStreamSynchronize(stream_);
  for (Send& s : sends_) (void)cudaEventDestroy(s.ready);
  for (Copy& c : copies_) {
    (void)cudaEventDestroy(c.done);
    if (c.pinned != nullptr) pinned_.put(c.pinned);
  }
  copies_.clear();
  mapped_.clear();
  if (order_ != nullptr) (void)cudaEventDestroy(order_);
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
}

Result<std::vector<int64_t>> CudaIpcTransport::cache_offsets(const KvRegion& region) const {
  return kv_cache_offsets(region, cache_base_, cache_bytes_, "cuda_ipc transport");
}

Result<TransferOp> CudaIpcTransport::post_send(int peer, int tag, const KvRegion& region) {
  PD_ASSIGN_OR_RETURN(std::vector<int64_t> offsets, cache_offsets(region));
  PD_ASSIGN_OR_RETURN(cudaEvent_t ready, events_.get());
  if (cudaError_t err = cudaEventRecord(ready, compute_); err != cudaSuccess) {
    events_.put(ready);
    return cuda_call_error(kCudaIpcWho, "cudaEventRecord (compute stream)", err);
  }
  const int64_t op = ops_.add(true, peer, tag);
  sends_.push_back(Send{op, ready, std::move(offsets), region.piece_bytes});
  return TransferOp{op};
}

Result<TransferOp> CudaIpcTransport::post_recv(int peer, int tag, const KvRegion& region) {
  PD_ASSIGN_OR_RETURN(std::vector<int64_t> offsets, cache_offsets(region));
  const int64_t op = ops_.add(false, peer, tag);
  recvs_.emplace(op, Recv{std::move(offsets), region.piece_bytes});
  return TransferOp{op};
}

Result<TransferOp> CudaIpcTransport::post_send_bytes(int, int, const void*, size_t) {
  return Status::unsupported("cuda_ipc transport: byte buffers travel over MPI");
}
Result<TransferOp> CudaIpcTransport::post_recv_bytes(int, int, void*, size_t) {
  return Status::unsupported("cuda_ipc transport: byte buffers travel over MPI");
}
Result<TransferOp> CudaIpcTransport::post_reclaim(int, int) {
  return Status::unsupported("cuda_ipc transport: a tag cannot be reclaimed on this path (its KV does not travel under the tag)");
}

void CudaIpcTransport::ack(int peer, const DeviceAck& a) {
  if (Status s = msgs_.send(peer, a); !s.is_ok())
    spdlog::warn("cuda_ipc transport: ack of tag {} to rank {} not sent: {}", a.tag, peer, s.to_string());
}

Result<std::shared_ptr<CudaIpcTransport::Mapping>> CudaIpcTransport::map_peer(int peer, const IpcDescriptor& d) {
  auto it = mapped_.find(peer);
  if (it != mapped_.end() && it->second->handle == d.handle) return it->second;
  // First descriptor from this peer, or a new cache there: map it (copies in
  // flight keep the old mapping until they end).
  cudaIpcMemHandle_t h;
  std::memcpy(&h, d.handle.data(), sizeof h);
  auto m = std::make_shared<Mapping>();
  m->handle = d.handle;
  if (cudaError_t err = cudaIpcOpenMemHandle(&m->ptr, h, cudaIpcMemLazyEnablePeerAccess); err != cudaSuccess) {
    m->ptr = nullptr;
    return cuda_call_error(kCudaIpcWho, "cudaIpcOpenMemHandle (cache of rank " + std::to_string(peer) + ")", err);
  }
  mapped_[peer] = m;
  return m;
}

Status CudaIpcTransport::start_copy(int peer, int64_t op, const IpcDescriptor& d, const Recv& dst) {
  PD_ASSIGN_OR_RETURN(std::shared_ptr<Mapping> src, map_peer(peer, d));
  // The blocks may still be read by ops already on the compute stream.
  if (cudaError_t err = cudaEventRecord(order_, compute_); err != cudaSuccess)
    return cuda_call_error(kCudaIpcWho, "cudaEventRecord (compute stream)", err);
  if (cudaError_t err = cudaStreamWaitEvent(stream_, order_, 0); err != cudaSuccess)
    return cuda_call_error(kCudaIpcWho, "cudaStreamWaitEvent", err);
  PD_ASSIGN_OR_RETURN(cudaEvent_t done, events_.get());
  void* pinned = nullptr;
  Status s = enqueue_piece_copy(stream_, pinned_, src->ptr, d.offsets, cache_base_, dst.offsets,
                                static_cast<int64_t>(dst.offsets.size()), static_cast<size_t>(d.piece_bytes), &pinned);
  if (s.is_ok()) {
    if (cudaError_t err = cudaEventRecord(done, stream_); err != cudaSuccess) {
      (void)cudaStreamSynchronize(stream_);
      pinned_.put(pinned);
      s = cuda_call_error(kCudaIpcWho, "cudaEventRecord (copy stream)", err);
    }
  }
  if (!s.is_ok()) {
    events_.put(done);
    return s;
  }
  copies_.push_back(Copy{op, peer, DeviceAck{d.tag, d.seq}, done, pinned, std::move(src)});
  return Status::ok();
}

void CudaIpcTransport::on_descriptor(int peer, const IpcDescriptor& d) {
  const DeviceAck done{d.tag, d.seq};
  const std::optional<int64_t> op = ops_.match(peer, d.tag);
  if (!op) {  // no receive posted (cancelled or abandoned): nothing lands anywhere
    ack(peer, done);
    return;
  }
  auto it = recvs_.find(*op);
  if (it == recvs_.end()) {
    ops_.fail(*op, Status::internal("cuda_ipc transport: matched receive has no region"));
    ack(peer, done);
    return;
  }
  const Recv dst = std::move(it->second);
  recvs_.erase(it);
  Status s;
  if (d.piece_bytes != dst.piece_bytes || d.offsets.size() != dst.offsets.size()) {
    s = Status::invalid_argument("cuda_ipc transport: rank " + std::to_string(peer) + " sent " +
                                 region_size(d.offsets.size(), d.piece_bytes) + " under tag " + std::to_string(d.tag) +
                                 ", the receive holds " + region_size(dst.offsets.size(), dst.piece_bytes));
  } else {
    s = start_copy(peer, *op, d, dst);
  }
  if (!s.is_ok()) {
    ops_.fail(*op, std::move(s));
    ack(peer, done);
  }
}

void CudaIpcTransport::on_message(int peer, Result<DeviceMsg> msg) {
  if (!msg.is_ok()) {
    spdlog::warn("cuda_ipc transport: message from rank {} dropped: {}", peer, msg.status().to_string());
    return;
  }
  if (const auto* d = std::get_if<IpcDescriptor>(&*msg)) return on_descriptor(peer, *d);
  if (const auto* a = std::get_if<DeviceAck>(&*msg)) {
    const DeviceOpTable::Op* op = ops_.find(static_cast<int64_t>(a->seq));
    if (op != nullptr && op->send && op->peer == peer) ops_.finish(static_cast<int64_t>(a->seq));
    return;  // otherwise the send was abandoned
  }
  spdlog::warn("cuda_ipc transport: unexpected message kind from rank {} dropped", peer);
}

void CudaIpcTransport::progress() {
  // Sends whose KV the compute stream has finished writing: the descriptor goes
  // out. One stream, so its events complete in posting order.
  size_t i = 0;
  for (; i < sends_.size(); ++i) {
    Send& s = sends_[i];
    const DeviceOpTable::Op* op = ops_.find(s.op);
    if (op == nullptr || op->phase != DevicePhase::kQueued) {  // cancelled or abandoned
      events_.put(s.ready);
      s.ready = nullptr;
      continue;
    }
    const cudaError_t q = cudaEventQuery(s.ready);
    if (q == cudaErrorNotReady) break;
    events_.put(s.ready);
    s.ready = nullptr;
    if (q != cudaSuccess) {
      ops_.fail(s.op, cuda_call_error(kCudaIpcWho, "cudaEventQuery (compute stream)", q));
      continue;
    }
    IpcDescriptor d;
    d.tag = op->tag;
    d.seq = static_cast<uint64_t>(s.op);
    d.handle = cache_handle_;
    d.piece_bytes = s.piece_bytes;
    d.offsets = std::move(s.offsets);
    const int peer = op->peer;
    ops_.start(s.op);
    if (Status st = msgs_.send(peer, d); !st.is_ok()) ops_.fail(s.op, std::move(st));
  }
  sends_.erase(sends_.begin(), sends_.begin() + static_cast<std::ptrdiff_t>(i));

  for (DeviceMsgLink::Arrived& a : msgs_.poll()) on_message(a.peer, std::move(a.msg));

  for (auto it = copies_.begin(); it != copies_.end();) {
    const cudaError_t q = cudaEventQuery(it->done);
    if (q == cudaErrorNotReady) {
      ++it;
      continue;
    }
    if (q == cudaSuccess)
      ops_.finish(it->op);
    else
      ops_.fail(it->op, cuda_call_error(kCudaIpcWho, "KV copy from rank " + std::to_string(it->peer), q));
    ack(it->peer, it->ack);
    events_.put(it->done);
    pinned_.put(it->pinned);
    it = copies_.erase(it);
  }
}

Result<OpState> CudaIpcTransport::test(TransferOp op) {
  progress();
  return ops_.report(op.value);
}

void CudaIpcTransport::cancel(TransferOp op) {
  if (ops_.cancel(op.value)) recvs_.erase(op.value);  // a send's event is returned by progress()
}

void CudaIpcTransport::abandon(TransferOp op) {
  // A copy in flight keeps its event, staging and mapping until it ends.
  if (ops_.abandon(op.value) == DevicePhase::kQueued) recvs_.erase(op.value);
}

void CudaIpcTransport::forget_peer(int peer) {
  // A receive whose copy is running completes by itself; everything else
  // waits on the peer and ends here.
  for (int64_t op : ops_.live_ops_with(peer)) {
    const DeviceOpTable::Op* o = ops_.find(op);
    if (!o->send && o->phase == DevicePhase::kInFlight) continue;
    ops_.fail(op, Status::io_error("cuda_ipc transport: rank " + std::to_string(peer) + " is gone"));
    recvs_.erase(op);
  }
  mapped_.erase(peer);
}

void CudaIpcTransport::bind_thread() {
  if (cudaError_t err = cudaSetDevice(device_); err != cudaSuccess)
    spdlog::error("CudaIpcTransport: cudaSetDevice({}) on the communication thread: {}", device_, cudaGetErrorString(err));
}

}  // namespace pd
