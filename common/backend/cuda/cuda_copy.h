// Piece copies in device memory: the one CUDA kernel the KV transports share
// with the backend. A KV region is a list of equally sized pieces at byte
// offsets of a cache; these gather them into a contiguous buffer (for a send or
// a host copy), scatter a contiguous buffer into them (a receive), or move
// them cache to cache (a copy between two processes' caches on one device).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace pd::cuda {

// For p in [0, n): copies piece_bytes from src + src_off[p] to dst + dst_off[p].
// A null offset array means contiguous pieces (p * piece_bytes). The offset
// arrays are device memory (or null); one block per piece, 16-byte loads when
// every address and the piece size allow. Returns the launch error.
cudaError_t copy_pieces(const void* src, const int64_t* src_off, void* dst, const int64_t* dst_off, int64_t n,
                        size_t piece_bytes, bool aligned16, cudaStream_t stream);

// True when 16-byte loads are safe: base, every offset (host copies of the
// device arrays, or none for contiguous) and the piece size are multiples of 16.
bool pieces_aligned16(const void* base, const int64_t* host_off, int64_t n, size_t piece_bytes);

}  // namespace pd::cuda
