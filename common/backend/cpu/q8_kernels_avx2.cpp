// AVX2 kernels for q8_kernels.h. This file alone is compiled with
// -mavx2 -mfma -mf16c (common/CMakeLists.txt). It must not use any inline
// function or template defined outside it (not even exp_approx): a Debug build
// would emit an AVX2 copy of it that the linker may pick for the whole
// program. Its functions run only after best_isa() saw the CPU support them.
#include "backend/cpu/q8_kernels.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include <cstring>

namespace pd::cpu {
namespace {

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

// Software prefetch distance: the weights stream from memory once per call
// (decode), and one core's hardware prefetcher alone leaves bandwidth unused.
constexpr int kPrefetchBytes = 2048;

// T tokens against one packed group of 8 Q4 rows. Per block: the 128 bytes of
// nibbles are loaded once for all T tokens; each token's 8 broadcast
// 4-byte runs are multiplied (u8 x s8 -> pairs of i16) and summed in i16
// (at most 16 products of |15 * 127| per lane: no overflow), widened once.
template <int T>
inline void q4x8_tile(const PackedQ4x8* w, int64_t nb, const BlockQ8A* x, int64_t x_rows_stride, float* out,
                      int64_t out_stride) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const PackedQ4x8& B = w[b];
    _mm_prefetch(reinterpret_cast<const char*>(&B) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(&B) + kPrefetchBytes + 64, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(&B) + kPrefetchBytes + 128, _MM_HINT_T0);
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
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(B.d)));
    const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(B.m)));
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
      _mm_prefetch(reinterpret_cast<const char*>(&B) + kPrefetchBytes + 64 * l, _MM_HINT_T0);
    __m256i s[T];
    for (int g = 0; g < 8; ++g) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.qs + 32 * g));
      const __m256i av = _mm256_sign_epi8(v, v);
      for (int t = 0; t < T; ++t) {
        const __m256i xv = broadcast4(x[t * x_rows_stride + b].qs + 4 * g);
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(xv, v)), ones);
        s[t] = g == 0 ? p : _mm256_add_epi32(s[t], p);
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
  gemm_tiles<PackedQ4x8, q4x8_tile<4>, q4x8_tile<3>, q4x8_tile<2>, q4x8_tile<1>>(w, nb, x, m, out, out_stride);
}

void gemm_q8x8_avx2(const PackedQ8x8* w, int64_t nb, const BlockQ8A* x, int m, float* out, int64_t out_stride) {
  gemm_tiles<PackedQ8x8, q8x8_tile<4>, q8x8_tile<3>, q8x8_tile<2>, q8x8_tile<1>>(w, nb, x, m, out, out_stride);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp_approx (q8_kernels.h), 8 lanes.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Rows per pass of the attention loops: with AVX-512's 32 vector registers
// (this file compiled for a CPU that has them) the accumulators of more rows
// stay in registers. The arithmetic per row is the same either way.
#if defined(__AVX512F__)
constexpr int kQkRows = 2, kPvRows = 4;
#else
constexpr int kQkRows = 1, kPvRows = 2;
#endif

// Scores of R query rows against eight keys: R x 8 accumulators of 8 lanes,
// each key row loaded once for the R rows, reduced by horizontal adds in the
// lane order of q8_kernels.h into one vector of eight scores per row. nk < 8
// keys: the caller repeats the last key's pointer and nk scores are stored.
template <int R>
inline void qk_group(const float* q, int64_t q_stride, const float* const* kr, int64_t hd, __m256 scale, float* s,
                     int64_t s_stride, int nk) {
  __m256 a[R][8];
  #pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
    #pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) a[i][u] = _mm256_setzero_ps();
  for (int64_t j = 0; j < hd; j += 8) {
    __m256 kv[8];
    #pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) {
      kv[u] = _mm256_loadu_ps(kr[u] + j);
      if (R > 1) asm("" : "+v"(kv[u]));  // one load shared by the rows, not one per FMA
    }
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m256 qv = _mm256_loadu_ps(q + i * q_stride + j);
      #pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) a[i][u] = _mm256_fmadd_ps(qv, kv[u], a[i][u]);
    }
  }
  #pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    // x = [key 0..3: lanes 0-3 summed | key 0..3: lanes 4-7], y the same for keys 4..7.
    const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(a[i][0], a[i][1]), _mm256_hadd_ps(a[i][2], a[i][3]));
    const __m256 y = _mm256_hadd_ps(_mm256_hadd_ps(a[i][4], a[i][5]), _mm256_hadd_ps(a[i][6], a[i][7]));
    const __m256 sum = _mm256_mul_ps(
        _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31)), scale);
    float* out = s + i * s_stride;
    if (nk == 8) {
      _mm256_storeu_ps(out, sum);
    } else {
      alignas(32) float t[8];
      _mm256_store_ps(t, sum);
      #pragma GCC unroll 8
      for (int u = 0; u < nk; ++u) out[u] = t[u];
    }
  }
}

// Keys in groups of eight, the rows kQkRows at a time under each group (the
// key rows stay in L1 while every query row passes).
void qk_scores_avx2(const float* q, int64_t q_stride, int nr, const float* k, int64_t hd, int n, float scale, float* s,
                    int64_t s_stride) {
  const __m256 sc = _mm256_set1_ps(scale);
  for (int r = 0; r < n; r += 8) {
    const int nk = n - r < 8 ? n - r : 8;
    const float* kr[8];
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) kr[u] = k + (r + (u < nk ? u : nk - 1)) * hd;
    int i = 0;
    for (; i + kQkRows <= nr; i += kQkRows)
      qk_group<kQkRows>(q + i * q_stride, q_stride, kr, hd, sc, s + i * s_stride + r, s_stride, nk);
    for (; i < nr; ++i) qk_group<1>(q + i * q_stride, q_stride, kr, hd, sc, s + i * s_stride + r, s_stride, nk);
  }
}

inline float hmax(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// The exps 8 at a time, summed in 8 lanes, the tail through the same vector
// formula (padded) and added in order.
void softmax_step_avx2(float* s, int64_t s_stride, int nr, const int* n, float* m, float* l, float* c) {
  for (int i = 0; i < nr; ++i) {
    float* si = s + i * s_stride;
    const int ni = n[i];
    if (ni == 0) {
      c[i] = 1.0f;
      continue;
    }
    __m256 mx = _mm256_set1_ps(m[i]);
    int r = 0;
    for (; r + 8 <= ni; r += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(si + r));
    float m_new = hmax(mx);
    for (; r < ni; ++r) m_new = si[r] > m_new ? si[r] : m_new;
    const __m256 mv = _mm256_set1_ps(m_new);
    __m256 sum = _mm256_setzero_ps();
    for (r = 0; r + 8 <= ni; r += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(si + r), mv));
      _mm256_storeu_ps(si + r, e);
      sum = _mm256_add_ps(sum, e);
    }
    float total = hsum(sum);
    // The tail, and the accumulator factor in the last lane, through one exp8.
    alignas(32) float t[8];
    for (int u = 0; u < 7; ++u) t[u] = r + u < ni ? si[r + u] - m_new : 0.0f;
    t[7] = m[i] - m_new;
    _mm256_store_ps(t, exp8(_mm256_load_ps(t)));
    for (int u = 0; r < ni; ++r, ++u) total += (si[r] = t[u]);
    c[i] = t[7];
    l[i] = l[i] * c[i] + total;
    m[i] = m_new;
  }
}

// R rows x W vectors of 8 elements of acc in registers; each value row's
// vectors are loaded once for the R rows. Keys every row takes first, then
// each row's own tail, so each element still adds its keys in order.
template <int R, int W>
inline void pv_chunk(const float* p, int64_t p_stride, const int* n, const float* c, const float* v, int64_t hd,
                     float* acc, int64_t acc_stride) {
  __m256 a[R][W];
  int n_all = n[0];
  #pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    n_all = n[i] < n_all ? n[i] : n_all;
    const __m256 ci = _mm256_set1_ps(c[i]);
    #pragma GCC unroll 8
    for (int w = 0; w < W; ++w) a[i][w] = _mm256_mul_ps(_mm256_loadu_ps(acc + i * acc_stride + 8 * w), ci);
  }
  for (int r = 0; r < n_all; ++r) {
    __m256 vr[W];
    #pragma GCC unroll 8
    for (int w = 0; w < W; ++w) {
      vr[w] = _mm256_loadu_ps(v + r * hd + 8 * w);
      if (R > 1) asm("" : "+v"(vr[w]));  // one load shared by the rows, not one per FMA
    }
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m256 pr = _mm256_set1_ps(p[i * p_stride + r]);
      #pragma GCC unroll 8
      for (int w = 0; w < W; ++w) a[i][w] = _mm256_fmadd_ps(pr, vr[w], a[i][w]);
    }
  }
  #pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    for (int r = n_all; r < n[i]; ++r) {
      const __m256 pr = _mm256_set1_ps(p[i * p_stride + r]);
      #pragma GCC unroll 8
      for (int w = 0; w < W; ++w) a[i][w] = _mm256_fmadd_ps(pr, _mm256_loadu_ps(v + r * hd + 8 * w), a[i][w]);
    }
    #pragma GCC unroll 8
    for (int w = 0; w < W; ++w) _mm256_storeu_ps(acc + i * acc_stride + 8 * w, a[i][w]);
  }
}

template <int R>
void pv_rows(const float* p, int64_t p_stride, const int* n, const float* c, const float* v, int64_t hd, float* acc,
             int64_t acc_stride) {
  int64_t j0 = 0;
  for (; j0 + 32 <= hd; j0 += 32) pv_chunk<R, 4>(p, p_stride, n, c, v + j0, hd, acc + j0, acc_stride);
  for (; j0 < hd; j0 += 8) pv_chunk<R, 1>(p, p_stride, n, c, v + j0, hd, acc + j0, acc_stride);
}

void pv_accumulate_avx2(const float* p, int64_t p_stride, int nr, const int* n, const float* c, const float* v,
                        int64_t hd, float* acc, int64_t acc_stride) {
  int i = 0;
  for (; i + kPvRows <= nr; i += kPvRows)
    pv_rows<kPvRows>(p + i * p_stride, p_stride, n + i, c + i, v, hd, acc + i * acc_stride, acc_stride);
  if (kPvRows > 2 && i + 2 <= nr) {  // a decode token's three heads: two and one
    pv_rows<2>(p + i * p_stride, p_stride, n + i, c + i, v, hd, acc + i * acc_stride, acc_stride);
    i += 2;
  }
  for (; i < nr; ++i) pv_rows<1>(p + i * p_stride, p_stride, n + i, c + i, v, hd, acc + i * acc_stride, acc_stride);
}

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

const Kernels kAvx2Kernels{quantize_rows_avx2, gemm_q4x8_avx2,     gemm_q8x8_avx2, qk_scores_avx2,
                           softmax_step_avx2,  pv_accumulate_avx2, silu_mul_avx2};

}  // namespace

const Kernels* avx2_kernels() { return &kAvx2Kernels; }

}  // namespace pd::cpu

#else  // not compiled for AVX2 (a non-x86 target)

namespace pd::cpu {
const Kernels* avx2_kernels() { return nullptr; }
}  // namespace pd::cpu

#endif
