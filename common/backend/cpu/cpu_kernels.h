// The CPU backend's fp32-activation kernels (CpuBackendConfig::int8_activations
// = false, the reference path): quantized weights dotted with fp32 inputs
// straight from the GGUF blocks. AVX2/F16C where the compiler targets it
// (-march=native), portable otherwise — chosen at compile time, unlike the
// default integer kernels (q8_kernels.h), which dispatch at run time.
// Single-threaded: the CPU backend splits work across threads around them.
#pragma once

#include <cmath>
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

// Weight rows per group in dot_rows_grouped's fast path.
inline constexpr int kDotGroupRows = 4;

// dot_row_multi for n_rows weight rows at once: acc[r * acc_stride + i] +=
// dot(w_rows[r], x + i * x_stride). Bit-identical to calling dot_row_multi per
// row (each input block is loaded once for the whole group).
void dot_rows_grouped(GgmlType type, const void* const* w_rows, int n_rows, int64_t k, const float* x,
                      int64_t x_stride, int m, float* acc, int64_t acc_stride);

// dst[0..k) = dequantized row.
void dequant_row(GgmlType type, const void* w_row, int64_t k, float* dst);

// GELU, tanh approximation, in fp32 with ggml's constants (ggml_gelu_f32).
inline float gelu_tanh(float x) {
  constexpr float kCoefA = 0.044715f;
  constexpr float kSqrt2OverPi = 0.79788456080286535587989211986876f;
  return 0.5f * x * (1.0f + std::tanh(kSqrt2OverPi * x * (1.0f + kCoefA * x * x)));
}

}  // namespace pd::cpu
