#include "kvtransfer/cuda_kv_copy.h"

#include <cstring>
#include <string>

#include "backend/cuda/cuda_copy.h"

namespace pd {

Status cuda_call_error(std::string_view who, std::string_view call, cudaError_t err) {
  return Status::internal(std::string(who) + ": " + std::string(call) + " failed: " + cudaGetErrorName(err) + " (" +
                          cudaGetErrorString(err) + ")");
}

CudaEventPool::~CudaEventPool() {
  for (cudaEvent_t e : free_) (void)cudaEventDestroy(e);
}

Result<cudaEvent_t> CudaEventPool::get() {
  if (!free_.empty()) {
    cudaEvent_t e = free_.back();
    free_.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  if (cudaError_t err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming); err != cudaSuccess)
    return cuda_call_error("device transport", "cudaEventCreateWithFlags", err);
  return e;
}

PinnedPool::~PinnedPool() {
  for (auto& [p, bytes] : size_of_) (void)cudaFreeHost(p);
}

Result<void*> PinnedPool::get(size_t bytes) {
  if (auto it = free_.lower_bound(bytes); it != free_.end()) {
    void* p = it->second;
    free_.erase(it);
    return p;
  }
  size_t cap = 4096;
  while (cap < bytes) cap *= 2;
  void* p = nullptr;
  if (cudaError_t err = cudaMallocHost(&p, cap); err != cudaSuccess)
    return cuda_call_error("device transport", "cudaMallocHost", err);
  size_of_.emplace(p, cap);
  return p;
}

void PinnedPool::put(void* p) {
  if (auto it = size_of_.find(p); it != size_of_.end()) free_.emplace(it->second, p);
}

Status enqueue_piece_copy(cudaStream_t stream, PinnedPool& pool, const void* src, std::span<const int64_t> src_off,
                          void* dst, std::span<const int64_t> dst_off, int64_t n, size_t piece_bytes, void** pinned) {
  *pinned = nullptr;
  const size_t off_bytes = (src_off.size() + dst_off.size()) * sizeof(int64_t);
  void* host = nullptr;
  int64_t* dev = nullptr;
  // On an error the stream is drained before the pinned buffer goes back (an
  // error path: the device is failing anyway).
  auto fail = [&](const char* call, cudaError_t err) {
    if (dev != nullptr) (void)cudaFreeAsync(dev, stream);
    if (host != nullptr) {
      (void)cudaStreamSynchronize(stream);
      pool.put(host);
    }
    return cuda_call_error("device transport", call, err);
  };
  if (off_bytes > 0) {
    PD_ASSIGN_OR_RETURN(host, pool.get(off_bytes));
    std::memcpy(host, src_off.data(), src_off.size_bytes());
    std::memcpy(static_cast<uint8_t*>(host) + src_off.size_bytes(), dst_off.data(), dst_off.size_bytes());
    if (cudaError_t err = cudaMallocAsync(reinterpret_cast<void**>(&dev), off_bytes, stream); err != cudaSuccess)
      return fail("cudaMallocAsync", err);
    if (cudaError_t err = cudaMemcpyAsync(dev, host, off_bytes, cudaMemcpyHostToDevice, stream); err != cudaSuccess)
      return fail("cudaMemcpyAsync (piece offsets)", err);
  }
  const int64_t* dev_src = src_off.empty() ? nullptr : dev;
  const int64_t* dev_dst = dst_off.empty() ? nullptr : dev + src_off.size();
  const bool aligned = cuda::pieces_aligned16(src, src_off.empty() ? nullptr : src_off.data(), n, piece_bytes) &&
                       cuda::pieces_aligned16(dst, dst_off.empty() ? nullptr : dst_off.data(), n, piece_bytes);
  if (cudaError_t err = cuda::copy_pieces(src, dev_src, dst, dev_dst, n, piece_bytes, aligned, stream);
      err != cudaSuccess)
    return fail("copy_pieces launch", err);
  if (dev != nullptr) (void)cudaFreeAsync(dev, stream);
  *pinned = host;
  return Status::ok();
}

}  // namespace pd
