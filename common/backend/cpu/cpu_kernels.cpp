#include "backend/cpu/cpu_kernels.h"

#include <cstring>
#include <vector>
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
inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline __m256 u8x8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
inline __m256 i8x8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

// Weight blocks as the AVX2 kernel sees them: the 32 quantized values as four
// vectors of 8 floats (elements 0-7, 8-15, 16-23, 24-31), the scale d and, for
// Q4_1, the offset m: sum((d*q + m) * x) = d * sum(q*x) + m * sum(x).
struct Q4_0Avx2 {
  using Block = BlockQ4_0;
  static constexpr bool kHasMin = false;
  static void load(const Block& b, __m256 q[4]) {
    const __m128i low4 = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs));
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(v, low4), eight);
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), low4), eight);
    q[0] = i8x8_to_ps(lo), q[1] = i8x8_to_ps(_mm_srli_si128(lo, 8));
    q[2] = i8x8_to_ps(hi), q[3] = i8x8_to_ps(_mm_srli_si128(hi, 8));
  }
  static float min(const Block&) { return 0.0f; }
};
struct Q4_1Avx2 {
  using Block = BlockQ4_1;
  static constexpr bool kHasMin = true;
  static void load(const Block& b, __m256 q[4]) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs));
    const __m128i lo = _mm_and_si128(v, low4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
    q[0] = u8x8_to_ps(lo), q[1] = u8x8_to_ps(_mm_srli_si128(lo, 8));
    q[2] = u8x8_to_ps(hi), q[3] = u8x8_to_ps(_mm_srli_si128(hi, 8));
  }
  static float min(const Block& b) { return half_to_float(b.m); }
};
struct Q8_0Avx2 {
  using Block = BlockQ8_0;
  static constexpr bool kHasMin = false;
  static void load(const Block& b, __m256 q[4]) {
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs + 16));
    q[0] = i8x8_to_ps(q0), q[1] = i8x8_to_ps(_mm_srli_si128(q0, 8));
    q[2] = i8x8_to_ps(q1), q[3] = i8x8_to_ps(_mm_srli_si128(q1, 8));
  }
  static float min(const Block&) { return 0.0f; }
};

// acc[i] += dot(weight row, x_i) for m inputs, straight from the packed
// blocks: each block is unpacked once per tile of inputs, and every input
// keeps its own vector accumulator (one horizontal sum per row). The
// arithmetic of one input's dot product is the same whatever m is, so a
// row's result does not depend on the batch it came in (batch invariance).
template <typename T>
void dot_rows_avx2(const void* w_row, int64_t k, const float* x, int64_t x_stride, int m, float* acc) {
  constexpr int kTile = 16;
  const auto* blocks = static_cast<const typename T::Block*>(w_row);
  const int64_t nb = k / kQK;
  for (int i0 = 0; i0 < m; i0 += kTile) {
    const int mt = m - i0 < kTile ? m - i0 : kTile;
    __m256 a[kTile];
    for (int i = 0; i < mt; ++i) a[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256 q[4];
      T::load(blocks[b], q);
      const __m256 d = _mm256_set1_ps(half_to_float(blocks[b].d));
      const __m256 mn = _mm256_set1_ps(T::min(blocks[b]));
      for (int i = 0; i < mt; ++i) {
        const float* xb = x + (i0 + i) * x_stride + b * kQK;
        const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
        const __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
        __m256 qx = _mm256_mul_ps(q[0], x0);
        qx = _mm256_fmadd_ps(q[1], x1, qx);
        qx = _mm256_fmadd_ps(q[2], x2, qx);
        qx = _mm256_fmadd_ps(q[3], x3, qx);
        a[i] = _mm256_fmadd_ps(d, qx, a[i]);
        if constexpr (T::kHasMin) {
          const __m256 sx = _mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3));
          a[i] = _mm256_fmadd_ps(mn, sx, a[i]);
        }
      }
    }
    for (int i = 0; i < mt; ++i) acc[i0 + i] += hsum256(a[i]);
  }
}

// The same dot products for a group of R weight rows at once: each input
// block x is loaded once and used for all R rows (R times less input traffic),
// while every (row, input) pair keeps its own accumulator and sees exactly the
// operations dot_rows_avx2 performs — results are bit-identical to it.
template <typename T, int R>
void dot_rowgroup_avx2(const void* const* w_rows, int64_t k, const float* x, int64_t x_stride, int m, float* acc,
                       int64_t acc_stride) {
  constexpr int kTile = 8;
  const typename T::Block* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = static_cast<const typename T::Block*>(w_rows[r]);
  const int64_t nb = k / kQK;
  for (int i0 = 0; i0 < m; i0 += kTile) {
    const int mt = m - i0 < kTile ? m - i0 : kTile;
    __m256 a[R][kTile];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < mt; ++i) a[r][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256 q[R][4], d[R], mn[R];
      for (int r = 0; r < R; ++r) {
        T::load(rows[r][b], q[r]);
        d[r] = _mm256_set1_ps(half_to_float(rows[r][b].d));
        mn[r] = _mm256_set1_ps(T::min(rows[r][b]));
      }
      for (int i = 0; i < mt; ++i) {
        const float* xb = x + (i0 + i) * x_stride + b * kQK;
        const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
        const __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
        __m256 sx = _mm256_setzero_ps();
        if constexpr (T::kHasMin) sx = _mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3));
        for (int r = 0; r < R; ++r) {
          __m256 qx = _mm256_mul_ps(q[r][0], x0);
          qx = _mm256_fmadd_ps(q[r][1], x1, qx);
          qx = _mm256_fmadd_ps(q[r][2], x2, qx);
          qx = _mm256_fmadd_ps(q[r][3], x3, qx);
          a[r][i] = _mm256_fmadd_ps(d[r], qx, a[r][i]);
          if constexpr (T::kHasMin) a[r][i] = _mm256_fmadd_ps(mn[r], sx, a[r][i]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < mt; ++i) acc[r * acc_stride + i0 + i] += hsum256(a[r][i]);
  }
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

// acc[i] += dot(w, x_i) for i < m, fp32 rows of k.
void dot_rows_f32(const float* w, int64_t k, const float* x, int64_t x_stride, int m, float* acc) {
  for (int i = 0; i < m; ++i) {
    const float* xi = x + i * x_stride;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < k; ++j) s += w[j] * xi[j];
    acc[i] += s;
  }
}

}  // namespace

int64_t block_elems(GgmlType type) { return ggml_traits(type).block_elems; }

void dot_row_multi(GgmlType type, const void* w_row, int64_t k, const float* x, int64_t x_stride, int m,
                   float* acc) {
  switch (type) {
#if PD_CPU_AVX2
    case GgmlType::kQ4_0: return dot_rows_avx2<Q4_0Avx2>(w_row, k, x, x_stride, m, acc);
    case GgmlType::kQ4_1: return dot_rows_avx2<Q4_1Avx2>(w_row, k, x, x_stride, m, acc);
    case GgmlType::kQ8_0: return dot_rows_avx2<Q8_0Avx2>(w_row, k, x, x_stride, m, acc);
#else
    case GgmlType::kQ4_0: return dot_blocks<BlockQ4_0, decode_q4_0>(w_row, k, x, x_stride, m, acc);
    case GgmlType::kQ4_1: return dot_blocks<BlockQ4_1, decode_q4_1>(w_row, k, x, x_stride, m, acc);
    case GgmlType::kQ8_0: return dot_blocks<BlockQ8_0, decode_q8_0>(w_row, k, x, x_stride, m, acc);
#endif
    case GgmlType::kF32: return dot_rows_f32(static_cast<const float*>(w_row), k, x, x_stride, m, acc);
    default: {  // the other quantized types: the whole row decoded once for all m inputs
      thread_local std::vector<float> w;
      w.resize(static_cast<size_t>(k));
      dequantize_row(type, w_row, w.data(), k);
      return dot_rows_f32(w.data(), k, x, x_stride, m, acc);
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

void dot_rows_grouped(GgmlType type, const void* const* w_rows, int n_rows, int64_t k, const float* x,
                      int64_t x_stride, int m, float* acc, int64_t acc_stride) {
#if PD_CPU_AVX2
  if (n_rows == kDotGroupRows) {
    switch (type) {
      case GgmlType::kQ4_0: return dot_rowgroup_avx2<Q4_0Avx2, kDotGroupRows>(w_rows, k, x, x_stride, m, acc, acc_stride);
      case GgmlType::kQ4_1: return dot_rowgroup_avx2<Q4_1Avx2, kDotGroupRows>(w_rows, k, x, x_stride, m, acc, acc_stride);
      case GgmlType::kQ8_0: return dot_rowgroup_avx2<Q8_0Avx2, kDotGroupRows>(w_rows, k, x, x_stride, m, acc, acc_stride);
      default: break;
    }
  }
#endif
  for (int r = 0; r < n_rows; ++r) dot_row_multi(type, w_rows[r], k, x, x_stride, m, acc + r * acc_stride);
}

void dequant_row(GgmlType type, const void* w_row, int64_t k, float* dst) {
  switch (type) {
    case GgmlType::kQ4_0: return dequant_blocks<BlockQ4_0, decode_q4_0>(w_row, k, dst);
    case GgmlType::kQ4_1: return dequant_blocks<BlockQ4_1, decode_q4_1>(w_row, k, dst);
    case GgmlType::kQ8_0: return dequant_blocks<BlockQ8_0, decode_q8_0>(w_row, k, dst);
    case GgmlType::kF32: std::memcpy(dst, w_row, static_cast<size_t>(k) * sizeof(float)); return;
    default: dequantize_row(type, w_row, dst, k); return;
  }
}

}  // namespace pd::cpu
