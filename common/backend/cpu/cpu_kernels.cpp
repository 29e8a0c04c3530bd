#include "backend/cpu/cpu_kernels.h"

#include <cstring>

namespace pd::cpu {
namespace {

constexpr int kQK = 32;

// Decodes one 32-element block into out[32].
inline void decode_q4_0(const BlockQ4_0& b, float* out) {
  const float d = fp16_to_fp32(b.d);
  for (int j = 0; j < 16; ++j) {
    out[j] = d * static_cast<float>((b.qs[j] & 0x0F) - 8);
    out[j + 16] = d * static_cast<float>((b.qs[j] >> 4) - 8);
  }
}
inline void decode_q4_1(const BlockQ4_1& b, float* out) {
  const float d = fp16_to_fp32(b.d);
  const float m = fp16_to_fp32(b.m);
  for (int j = 0; j < 16; ++j) {
    out[j] = d * static_cast<float>(b.qs[j] & 0x0F) + m;
    out[j + 16] = d * static_cast<float>(b.qs[j] >> 4) + m;
  }
}
inline void decode_q8_0(const BlockQ8_0& b, float* out) {
  const float d = fp16_to_fp32(b.d);
  for (int j = 0; j < kQK; ++j) out[j] = d * static_cast<float>(b.qs[j]);
}

inline float dot32(const float* a, const float* b) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int j = 0; j < kQK; ++j) s += a[j] * b[j];
  return s;
}

template <typename Block, void (*Decode)(const Block&, float*)>
void dot_blocks(const void* w_row, int64_t k, const float* x, int64_t x_stride, int m, float* acc) {
  const Block* blocks = static_cast<const Block*>(w_row);
  const int64_t nb = k / kQK;
  alignas(64) float w[kQK];
  for (int64_t b = 0; b < nb; ++b) {
    Decode(blocks[b], w);
    for (int i = 0; i < m; ++i) acc[i] += dot32(w, x + i * x_stride + b * kQK);
  }
}

template <typename Block, void (*Decode)(const Block&, float*)>
void dequant_blocks(const void* w_row, int64_t k, float* dst) {
  const Block* blocks = static_cast<const Block*>(w_row);
  for (int64_t b = 0; b < k / kQK; ++b) Decode(blocks[b], dst + b * kQK);
}

}  // namespace

int64_t block_elems(GgmlType type) { return ggml_traits(type).block_elems; }

void dot_row_multi(GgmlType type, const void* w_row, int64_t k, const float* x, int64_t x_stride, int m,
                   float* acc) {
  switch (type) {
    case GgmlType::kQ4_0: return dot_blocks<BlockQ4_0, decode_q4_0>(w_row, k, x, x_stride, m, acc);
    case GgmlType::kQ4_1: return dot_blocks<BlockQ4_1, decode_q4_1>(w_row, k, x, x_stride, m, acc);
    case GgmlType::kQ8_0: return dot_blocks<BlockQ8_0, decode_q8_0>(w_row, k, x, x_stride, m, acc);
    case GgmlType::kF32: {
      const float* w = static_cast<const float*>(w_row);
      for (int i = 0; i < m; ++i) {
        const float* xi = x + i * x_stride;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < k; ++j) s += w[j] * xi[j];
        acc[i] += s;
      }
      return;
    }
    case GgmlType::kF16:
    case GgmlType::kBF16: {
      // Decode in chunks of 32 so the row is converted once for all m inputs.
      const uint16_t* w16 = static_cast<const uint16_t*>(w_row);
      alignas(64) float w[kQK];
      for (int64_t j0 = 0; j0 < k; j0 += kQK) {
        const int64_t n = (k - j0 < kQK) ? k - j0 : kQK;
        for (int64_t j = 0; j < n; ++j)
          w[j] = type == GgmlType::kF16 ? fp16_to_fp32(w16[j0 + j]) : bf16_to_fp32(w16[j0 + j]);
        for (int i = 0; i < m; ++i) {
          const float* xi = x + i * x_stride + j0;
          float s = 0.0f;
          for (int64_t j = 0; j < n; ++j) s += w[j] * xi[j];
          acc[i] += s;
        }
      }
      return;
    }
  }
}

void dequant_row(GgmlType type, const void* w_row, int64_t k, float* dst) {
  switch (type) {
    case GgmlType::kQ4_0: return dequant_blocks<BlockQ4_0, decode_q4_0>(w_row, k, dst);
    case GgmlType::kQ4_1: return dequant_blocks<BlockQ4_1, decode_q4_1>(w_row, k, dst);
    case GgmlType::kQ8_0: return dequant_blocks<BlockQ8_0, decode_q8_0>(w_row, k, dst);
    case GgmlType::kF32: std::memcpy(dst, w_row, static_cast<size_t>(k) * sizeof(float)); return;
    case GgmlType::kF16:
    case GgmlType::kBF16: dequantize_row(type, w_row, dst, k); return;
  }
}

}  // namespace pd::cpu
