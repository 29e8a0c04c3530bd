// Scalar-portable CPU kernels over ggml block formats (auto-vectorized with
// -O3; explicit SIMD paths belong to the CPU-speed work). Single-threaded:
// the CPU backend splits work across threads around them.
#pragma once

#include <cstdint>

#include "gguf/ggml_types.h"

namespace pd::cpu {

// Elements per block of a weight type (1 for F32/F16/BF16, 32 for Q types).
int64_t block_elems(GgmlType type);

// acc[i] += dot(w_row, x + i * x_stride) for i < m, where w_row is one row of k
// elements of `type` and x holds m fp32 rows. The weight row is decoded once
// and reused for all m inputs (one weight stream per batch).
void dot_row_multi(GgmlType type, const void* w_row, int64_t k, const float* x, int64_t x_stride, int m,
                   float* acc);

// dst[0..k) = dequantized row.
void dequant_row(GgmlType type, const void* w_row, int64_t k, float* dst);

}  // namespace pd::cpu
