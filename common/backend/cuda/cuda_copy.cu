#include "backend/cuda/cuda_copy.h"

namespace pd::cuda {
namespace {

__global__ void copy_pieces_kernel(const uint8_t* src, const int64_t* src_off, uint8_t* dst, const int64_t* dst_off,
                                   size_t piece_bytes, bool aligned16) {
  const int64_t p = blockIdx.x;
  const uint8_t* s = src + (src_off ? src_off[p] : p * static_cast<int64_t>(piece_bytes));
  uint8_t* d = dst + (dst_off ? dst_off[p] : p * static_cast<int64_t>(piece_bytes));
  if (aligned16) {
    const size_t n16 = piece_bytes / 16;
    for (size_t i = threadIdx.x; i < n16; i += blockDim.x)
      reinterpret_cast<uint4*>(d)[i] = reinterpret_cast<const uint4*>(s)[i];
  } else {
    for (size_t i = threadIdx.x; i < piece_bytes; i += blockDim.x) d[i] = s[i];
  }
}

}  // namespace

cudaError_t copy_pieces(const void* src, const int64_t* src_off, void* dst, const int64_t* dst_off, int64_t n,
                        size_t piece_bytes, bool aligned16, cudaStream_t stream) {
  if (n <= 0 || piece_bytes == 0) return cudaSuccess;
  // One block per piece; the grid's x dimension takes up to 2^31 - 1 blocks.
  if (n > 0x7fffffffLL) return cudaErrorInvalidValue;
  copy_pieces_kernel<<<static_cast<unsigned>(n), 256, 0, stream>>>(static_cast<const uint8_t*>(src), src_off,
                                                                   static_cast<uint8_t*>(dst), dst_off, piece_bytes,
                                                                   aligned16);
  return cudaGetLastError();
}

bool pieces_aligned16(const void* base, const int64_t* host_off, int64_t n, size_t piece_bytes) {
  if (piece_bytes % 16 != 0 || reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
  for (int64_t i = 0; host_off != nullptr && i < n; ++i)
    if (host_off[i] % 16 != 0) return false;
  return true;
}

}  // namespace pd::cuda
