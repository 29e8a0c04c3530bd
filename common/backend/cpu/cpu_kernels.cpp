#include "backend/cpu/cpu_kernels.h"

#include <cstring>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PD_CPU_AVX2 1
#endif

namespace pd::cpu {
namespace {

constexpr int kQK = 32;

// fp16 scale -> fp32, inlined into the block loops (F16C where the compiler targets it).
inline float half_to_float(uint16_t h) {
#if PD_CPU_AVX2
  return _cvtsh_ss(h);
#else
  return fp16_to_fp32(h);
#endif
}

// Decodes one 32-element block into out[32].
inline void decode_q4_0(const BlockQ4_0& b, float* out) {
  const float d = half_to_float(b.d);
  for (int j = 0; j < 16; ++j) {
    out[j] = d * static_cast<float>((b.qs[j] & 0x0F) - 8);
    out[j + 16] = d * static_cast<float>((b.qs[j] >> 4) - 8);
  }
}
inline void decode_q4_1(const BlockQ4_1& b, float* out) {
  const float d = half_to_float(b.d);
  const float m = half_to_float(b.m);
  for (int j = 0; j < 16; ++j) {
    out[j] = d * static_cast<float>(b.qs[j] & 0x0F) + m;
    out[j + 16] = d * static_cast<float>(b.qs[j] >> 4) + m;
  }
}
inline void decode_q8_0(const BlockQ8_0& b, float* out) {
  const float d = half_to_float(b.d);
  for (int j = 0; j < kQK; ++j) out[j] = d * static_cast<float>(b.qs[j]);
}

inline float dot32(const float* a, const float* b) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int j = 0; j < kQK; ++j) s += a[j] * b[j];
  return s;
}

#if PD_CPU_AVX2
// One input row against one weight row, straight from the packed blocks, with
// vector accumulators carried across blocks (one horizontal sum per row).
inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline __m256 u8x8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
inline __m256 i8x8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

// Q4_1: sum((d*q + m) * x) = d * sum(q*x) + m * sum(x).
float row_dot_q4_1_avx2(const BlockQ4_1* blocks, int64_t nb, const float* x) {
  __m256 acc = _mm256_setzero_ps();
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks[b].qs));
    const __m128i lo = _mm_and_si128(q, low4);                      // elements 0..15
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), low4);   // elements 16..31
    const float* xb = x + b * kQK;
    const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
    const __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
    __m256 qx = _mm256_mul_ps(u8x8_to_ps(lo), x0);
    qx = _mm256_fmadd_ps(u8x8_to_ps(_mm_srli_si128(lo, 8)), x1, qx);
    qx = _mm256_fmadd_ps(u8x8_to_ps(hi), x2, qx);
    qx = _mm256_fmadd_ps(u8x8_to_ps(_mm_srli_si128(hi, 8)), x3, qx);
    const __m256 sx = _mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3));
    acc = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(blocks[b].d)), qx, acc);
    acc = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(blocks[b].m)), sx, acc);
  }
  return hsum256(acc);
}

// Q4_0: d * sum((q - 8) * x).
float row_dot_q4_0_avx2(const BlockQ4_0* blocks, int64_t nb, const float* x) {
  __m256 acc = _mm256_setzero_ps();
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m128i eight = _mm_set1_epi8(8);
  for (int64_t b = 0; b < nb; ++b) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks[b].qs));
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(q, low4), eight);
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), low4), eight);
    const float* xb = x + b * kQK;
    __m256 qx = _mm256_mul_ps(i8x8_to_ps(lo), _mm256_loadu_ps(xb));
    qx = _mm256_fmadd_ps(i8x8_to_ps(_mm_srli_si128(lo, 8)), _mm256_loadu_ps(xb + 8), qx);
    qx = _mm256_fmadd_ps(i8x8_to_ps(hi), _mm256_loadu_ps(xb + 16), qx);
    qx = _mm256_fmadd_ps(i8x8_to_ps(_mm_srli_si128(hi, 8)), _mm256_loadu_ps(xb + 24), qx);
    acc = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(blocks[b].d)), qx, acc);
  }
  return hsum256(acc);
}

// Q8_0: d * sum(q * x).
float row_dot_q8_0_avx2(const BlockQ8_0* blocks, int64_t nb, const float* x) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks[b].qs));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks[b].qs + 16));
    const float* xb = x + b * kQK;
    __m256 qx = _mm256_mul_ps(i8x8_to_ps(q0), _mm256_loadu_ps(xb));
    qx = _mm256_fmadd_ps(i8x8_to_ps(_mm_srli_si128(q0, 8)), _mm256_loadu_ps(xb + 8), qx);
    qx = _mm256_fmadd_ps(i8x8_to_ps(q1), _mm256_loadu_ps(xb + 16), qx);
    qx = _mm256_fmadd_ps(i8x8_to_ps(_mm_srli_si128(q1, 8)), _mm256_loadu_ps(xb + 24), qx);
    acc = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(blocks[b].d)), qx, acc);
  }
  return hsum256(acc);
}

template <typename Block, float (*RowDot)(const Block*, int64_t, const float*)>
void dot_rows_avx2(const void* w_row, int64_t k, const float* x, int64_t x_stride, int m, float* acc) {
  const Block* blocks = static_cast<const Block*>(w_row);
  for (int i = 0; i < m; ++i) acc[i] += RowDot(blocks, k / kQK, x + i * x_stride);
}
#endif  // PD_CPU_AVX2

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
#if PD_CPU_AVX2
    // Small batches: each input streams the (cache-resident) weight row again;
    // cheaper than decoding to fp32 first at these sizes.
    case GgmlType::kQ4_0: return dot_rows_avx2<BlockQ4_0, row_dot_q4_0_avx2>(w_row, k, x, x_stride, m, acc);
    case GgmlType::kQ4_1: return dot_rows_avx2<BlockQ4_1, row_dot_q4_1_avx2>(w_row, k, x, x_stride, m, acc);
    case GgmlType::kQ8_0: return dot_rows_avx2<BlockQ8_0, row_dot_q8_0_avx2>(w_row, k, x, x_stride, m, acc);
#else
    case GgmlType::kQ4_0: return dot_blocks<BlockQ4_0, decode_q4_0>(w_row, k, x, x_stride, m, acc);
    case GgmlType::kQ4_1: return dot_blocks<BlockQ4_1, decode_q4_1>(w_row, k, x, x_stride, m, acc);
    case GgmlType::kQ8_0: return dot_blocks<BlockQ8_0, decode_q8_0>(w_row, k, x, x_stride, m, acc);
#endif
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
