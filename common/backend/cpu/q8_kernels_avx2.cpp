// AVX2 kernels for q8_kernels.h. This file alone is compiled with
// -mavx2 -mfma -mf16c (common/CMakeLists.txt). It must not use any inline
// function or template defined outside it (not even exp_approx): a Debug build
// would emit an AVX2 copy of it that the linker may pick for the whole
// program. Its functions run only after best_isa() saw the CPU support them.
#include "backend/cpu/q8_kernels.h"

namespace pd::cpu {
bool avx2_unit_built_with_avx512() { return PD_UNIT_HAS_AVX512; }
}  // namespace pd::cpu

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include <cstring>

namespace pd::cpu {
namespace {

// Marks a running integer sum as computed here, in a register. Integer adds
// associate, so GCC otherwise rewrites a tile's chains of `s += p` into trees
// over all its maddubs results, which keeps some 30 vectors live: on a CPU
// with 16 vector registers (AVX2 without AVX-512) they spilled to the stack
// and the Q4 kernel ran at 0.68x (docs/BENCHMARKS.md, "16 registers").
inline void pin(__m256i& v) { __asm__("" : "+v"(v)); }

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm256_set1_epi32(v);
}

void quantize_rows_avx2(const float* x, int64_t k, int64_t x_stride, int m, BlockQ8A* out) {
  const int64_t nb = k / kQBlock;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int i = 0; i < m; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + i * x_stride + b * kQBlock;
      BlockQ8A& o = out[i * nb + b];
      __m256 v[4];
      for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(xb + 8 * j);
      __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      const float amax = _mm_cvtss_f32(h);
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      const __m256 vid = _mm256_set1_ps(id);
      __m256i q[4];
      for (int j = 0; j < 4; ++j)
        q[j] = _mm256_cvtps_epi32(
            _mm256_round_ps(_mm256_mul_ps(v[j], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      // Sum of the 32 integers (exact), then pack to bytes in element order.
      __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
      const int32_t sum = _mm_cvtsi128_si32(s4);
      __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      p = _mm256_permutevar8x32_epi32(p, order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.qs), p);
      o.d = d;
      o.s = d * static_cast<float>(sum);
    }
  }
}

// Software prefetch: the weights stream from memory once per call (decode),
// and one core's hardware prefetcher alone leaves bandwidth unused. A
// one-token tile takes about a DRAM latency to get through 2 KB of weights,
// so the lines are asked for 8 KB ahead, into L2 (prefetcht1): batch-1 decode
// ran 1.3x faster than with 2 KB into L1, batch 8 1.1x, prefill unchanged
// (PD_CPU_ISA=avx2, alternated: docs/BENCHMARKS.md).
constexpr int kPrefetchBytes = 8192;

// The 8 rows' scales of a Q4 block: fp16 (PackedQ4x8) or fp32 (PackedQ4x8F).
inline __m256 load_fp16x8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load_d(const PackedQ4x8& B) { return load_fp16x8(B.d); }
inline __m256 load_m(const PackedQ4x8& B) { return load_fp16x8(B.m); }
inline __m256 load_d(const PackedQ4x8F& B) { return _mm256_loadu_ps(B.d); }
inline __m256 load_m(const PackedQ4x8F& B) { return _mm256_loadu_ps(B.m); }

// T tokens against one packed group of 8 Q4 rows. Per block: the 128 bytes of
// nibbles are loaded once for all T tokens; each token's 8 broadcast
// 4-byte runs are multiplied (u8 x s8 -> pairs of i16) and summed in i16
// (at most 16 products of |15 * 127| per lane: no overflow), widened once.
template <typename Block, int T>
inline void q4x8_tile(const Block* w, int64_t nb, const BlockQ8A* x, int64_t x_rows_stride, float* out,
                      int64_t out_stride) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const Block& B = w[b];
    for (int l = 0; l < static_cast<int>((sizeof(Block) + 63) / 64); ++l)
      _mm_prefetch(reinterpret_cast<const char*>(&B) + kPrefetchBytes + 64 * l, _MM_HINT_T1);
    __m256i s[T];
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.qs + 32 * c));
      const __m256i lo = _mm256_and_si256(v, low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      for (int t = 0; t < T; ++t) {
        const int8_t* q = x[t * x_rows_stride + b].qs;
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(q + 4 * c)),
                                           _mm256_maddubs_epi16(hi, broadcast4(q + 16 + 4 * c)));
        s[t] = c == 0 ? p : _mm256_add_epi16(s[t], p);
        pin(s[t]);
      }
    }
    const __m256 d = load_d(B);
    const __m256 mn = load_m(B);
    for (int t = 0; t < T; ++t) {
      const BlockQ8A& xb = x[t * x_rows_stride + b];
      const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[t], ones));
      acc[t] = _mm256_fmadd_ps(f, _mm256_mul_ps(d, _mm256_set1_ps(xb.d)), acc[t]);
      acc[t] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xb.s), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) _mm256_storeu_ps(out + t * out_stride, acc[t]);
}

// T tokens against one packed group of 8 Q8_0 rows: signed x signed through
// maddubs(|w|, sign(x, w)); pairs of products fit i16, widened per run.
template <int T>
inline void q8x8_tile(const PackedQ8x8* w, int64_t nb, const BlockQ8A* x, int64_t x_rows_stride, float* out,
                      int64_t out_stride) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const PackedQ8x8& B = w[b];
    for (int l = 0; l < 5; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(&B) + kPrefetchBytes + 64 * l, _MM_HINT_T1);
    __m256i s[T];
    for (int g = 0; g < 8; ++g) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.qs + 32 * g));
      const __m256i av = _mm256_sign_epi8(v, v);
      for (int t = 0; t < T; ++t) {
        const __m256i xv = broadcast4(x[t * x_rows_stride + b].qs + 4 * g);
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(xv, v)), ones);
        s[t] = g == 0 ? p : _mm256_add_epi32(s[t], p);
        pin(s[t]);
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(B.d)));
    for (int t = 0; t < T; ++t) {
      const __m256 f = _mm256_cvtepi32_ps(s[t]);
      acc[t] = _mm256_fmadd_ps(f, _mm256_mul_ps(d, _mm256_set1_ps(x[t * x_rows_stride + b].d)), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) _mm256_storeu_ps(out + t * out_stride, acc[t]);
}

// T tokens against one packed group of 8 rows of PackedQ8x8H (|q| <= 32):
// signed x signed as in q8x8_tile, the products of runs g < 4 and g >= 4
// summed apart in i16 (4 pairs of at most 2 * 32 * 127 per lane: 32512, no
// overflow), each half widened once and scaled by its own d.
template <int T>
inline void q8x8h_tile(const PackedQ8x8H* w, int64_t nb, const BlockQ8A* x, int64_t x_rows_stride, float* out,
                       int64_t out_stride) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const PackedQ8x8H& B = w[b];
    for (int l = 0; l < 6; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(&B) + kPrefetchBytes + 64 * l, _MM_HINT_T1);
    // One half at a time (runs g < 4, then g >= 4), its sums folded into acc
    // before the next half starts: the same operations in the same order as
    // summing both halves first, in 16 registers.
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m256i s[T];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const int g = 4 * h + j;
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.qs + 32 * g));
        const __m256i av = _mm256_sign_epi8(v, v);
        for (int t = 0; t < T; ++t) {
          const __m256i xv = broadcast4(x[t * x_rows_stride + b].qs + 4 * g);
          const __m256i p = _mm256_maddubs_epi16(av, _mm256_sign_epi8(xv, v));
          s[t] = j == 0 ? p : _mm256_add_epi16(s[t], p);
          pin(s[t]);
        }
      }
      const __m256 dh = _mm256_loadu_ps(B.d + 8 * h);
      for (int t = 0; t < T; ++t) {
        const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[t], ones));
        acc[t] = _mm256_fmadd_ps(f, _mm256_mul_ps(dh, _mm256_set1_ps(x[t * x_rows_stride + b].d)), acc[t]);
      }
    }
    const __m256 mn = _mm256_loadu_ps(B.m);
    for (int t = 0; t < T; ++t) acc[t] = _mm256_fmadd_ps(mn, _mm256_set1_ps(x[t * x_rows_stride + b].s), acc[t]);
  }
  for (int t = 0; t < T; ++t) _mm256_storeu_ps(out + t * out_stride, acc[t]);
}

constexpr int kTileTokens = 4;

// Tiles of kTileTokens tokens, then one tile for the remaining 1-3.
template <typename Block, void (*Tile4)(const Block*, int64_t, const BlockQ8A*, int64_t, float*, int64_t),
          void (*Tile3)(const Block*, int64_t, const BlockQ8A*, int64_t, float*, int64_t),
          void (*Tile2)(const Block*, int64_t, const BlockQ8A*, int64_t, float*, int64_t),
          void (*Tile1)(const Block*, int64_t, const BlockQ8A*, int64_t, float*, int64_t)>
void gemm_tiles(const Block* w, int64_t nb, const BlockQ8A* x, int m, float* out, int64_t out_stride) {
  int t = 0;
  for (; t + kTileTokens <= m; t += kTileTokens) Tile4(w, nb, x + t * nb, nb, out + t * out_stride, out_stride);
  switch (m - t) {
    case 3: Tile3(w, nb, x + t * nb, nb, out + t * out_stride, out_stride); break;
    case 2: Tile2(w, nb, x + t * nb, nb, out + t * out_stride, out_stride); break;
    case 1: Tile1(w, nb, x + t * nb, nb, out + t * out_stride, out_stride); break;
    default: break;
  }
}

void gemm_q4x8_avx2(const PackedQ4x8* w, int64_t nb, const BlockQ8A* x, int m, float* out, int64_t out_stride) {
  using B = PackedQ4x8;
  gemm_tiles<B, q4x8_tile<B, 4>, q4x8_tile<B, 3>, q4x8_tile<B, 2>, q4x8_tile<B, 1>>(w, nb, x, m, out, out_stride);
}

void gemm_q4x8f_avx2(const PackedQ4x8F* w, int64_t nb, const BlockQ8A* x, int m, float* out, int64_t out_stride) {
  using B = PackedQ4x8F;
  gemm_tiles<B, q4x8_tile<B, 4>, q4x8_tile<B, 3>, q4x8_tile<B, 2>, q4x8_tile<B, 1>>(w, nb, x, m, out, out_stride);
}

void gemm_q8x8h_avx2(const PackedQ8x8H* w, int64_t nb, const BlockQ8A* x, int m, float* out, int64_t out_stride) {
  gemm_tiles<PackedQ8x8H, q8x8h_tile<4>, q8x8h_tile<3>, q8x8h_tile<2>, q8x8h_tile<1>>(w, nb, x, m, out, out_stride);
}

void gemm_q8x8_avx2(const PackedQ8x8* w, int64_t nb, const BlockQ8A* x, int m, float* out, int64_t out_stride) {
  gemm_tiles<PackedQ8x8, q8x8_tile<4>, q8x8_tile<3>, q8x8_tile<2>, q8x8_tile<1>>(w, nb, x, m, out, out_stride);
}

#include "backend/cpu/attention_kernels.inc"

void silu_mul_avx2(const float* gate, const float* up, int64_t n, float* out) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp8(_mm256_xor_ps(g, sign));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
  }
  if (i < n) {  // the tail through the same vector formula, padded
    alignas(32) float g[8] = {}, u[8] = {}, o[8];
    for (int64_t j = i; j < n; ++j) g[j - i] = gate[j], u[j - i] = up[j];
    const __m256 gv = _mm256_load_ps(g);
    const __m256 e = exp8(_mm256_xor_ps(gv, sign));
    _mm256_store_ps(o, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_load_ps(u)));
    for (int64_t j = i; j < n; ++j) out[j] = o[j - i];
  }
}

const Kernels kAvx2Kernels{quantize_rows_avx2, gemm_q4x8_avx2,     gemm_q8x8_avx2,    gemm_q4x8f_avx2,
                           gemm_q8x8h_avx2,    nullptr,            nullptr,           nullptr,
                           nullptr,            nullptr,            nullptr,           qk_scores_simd,
                           softmax_step_simd,  pv_accumulate_simd, silu_mul_avx2};

}  // namespace

const Kernels* avx2_kernels() { return &kAvx2Kernels; }

}  // namespace pd::cpu

#else  // not compiled for AVX2 (a non-x86 target)

namespace pd::cpu {
const Kernels* avx2_kernels() { return nullptr; }
}  // namespace pd::cpu

#endif
