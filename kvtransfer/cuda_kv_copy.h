// The CUDA pieces both device KV transports use: CUDA errors as Status, reused
// events and pinned host buffers, and an enqueued piece copy whose offset
// arrays travel host -> device through pinned staging. The engine-loop thread
// is the only caller; the device is the one current on that thread.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string_view>
#include <vector>

#include "util/status.h"

namespace pd {

// "<who>: <call> failed: <CUDA's name and text>".
Status cuda_call_error(std::string_view who, std::string_view call, cudaError_t err);

// Events without timing, reused. Destroys what it holds.
class CudaEventPool {
 public:
  CudaEventPool() = default;
  CudaEventPool(const CudaEventPool&) = delete;
  CudaEventPool& operator=(const CudaEventPool&) = delete;
  ~CudaEventPool();
  Result<cudaEvent_t> get();
  void put(cudaEvent_t e) { free_.push_back(e); }

 private:
  std::vector<cudaEvent_t> free_;
};

// Pinned host buffers (cudaMallocHost), reused by size. A buffer handed out
// must come back only once the device has stopped reading it.
class PinnedPool {
 public:
  PinnedPool() = default;
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;
  ~PinnedPool();
  Result<void*> get(size_t bytes);
  void put(void* p);

 private:
  std::map<void*, size_t> size_of_;    // every buffer made
  std::multimap<size_t, void*> free_;  // capacity -> idle buffer
};

// Enqueues on `stream`: piece p (piece_bytes) from src + src_off[p] to dst + dst_off[p]
// for p in [0, n); an empty offset list means contiguous pieces. The offsets
// are copied into a pinned buffer from `pool` (returned in *pinned: give it
// back once an event recorded after this call has completed) and uploaded to
// stream-ordered device memory freed on the stream after the copy. On an
// error nothing is left to give back (*pinned is null).
Status enqueue_piece_copy(cudaStream_t stream, PinnedPool& pool, const void* src, std::span<const int64_t> src_off,
                          void* dst, std::span<const int64_t> dst_off, int64_t n, size_t piece_bytes, void** pinned);

}  // namespace pd
