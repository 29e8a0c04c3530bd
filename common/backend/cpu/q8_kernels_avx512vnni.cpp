// AVX512-VNNI integer matmul kernels for q8_kernels.h (256-bit vectors,
// AVX512VL encodings). vpdpbusd multiplies 4 unsigned bytes by 4 signed bytes
// and adds the four products into an i32 lane — exactly the 4-byte runs the
// packed layout puts in each row's lane — so a block's 8 runs are 8
// instructions, with no i16 stage and no widening. Everything after the
// integer sums is the AVX2 kernels' float arithmetic, so results equal the
// scalar and AVX2 paths bit for bit. The attention kernels
// (attention_kernels.inc) are compiled here a second time, for this ISA: the
// same arithmetic as the AVX2 copy, with more rows per pass in 32 registers.
//
// This file alone is compiled with -mavx512f -mavx512bw -mavx512vl
// -mavx512vnni (plus AVX2/FMA/F16C). Like q8_kernels_avx2.cpp it uses no
// inline function or template from outside itself, and only runs after
// best_isa() saw the CPU support it.
#include "backend/cpu/q8_kernels.h"

#if ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(PD_VNNI_EMULATION)) && defined(__FMA__) && \
    defined(__F16C__)
#include <immintrin.h>

#include <cstring>

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's avx512fintrin.h spells "any value" as a self-initialized variable
// (_mm512_undefined_*: __Y = __Y), which -Wmaybe-uninitialized reports once
// inlined into the 512-bit kernels below; the value is never read.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <type_traits>

namespace pd::cpu {
namespace {

#if defined(PD_VNNI_EMULATION)
// Test build (tests/common/vnni_emulation.cpp): vpdpbusd computed exactly
// with AVX2, so these kernels' layout, loops and tails run on any AVX2 CPU.
inline __m256i dpbusd(__m256i acc, __m256i a, __m256i b) {
  const __m256i byte = _mm256_set1_epi16(0x00FF);
  const __m256i a_even = _mm256_and_si256(a, byte), a_odd = _mm256_srli_epi16(a, 8);
  const __m256i b_even = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8), b_odd = _mm256_srai_epi16(b, 8);
  return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(a_even, b_even), _mm256_madd_epi16(a_odd, b_odd)));
}
#else
inline __m256i dpbusd(__m256i acc, __m256i a, __m256i b) { return _mm256_dpbusd_epi32(acc, a, b); }
#endif

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm256_set1_epi32(v);
}

constexpr int kPrefetchBytes = 2048;  // as in the AVX2 kernels: weights stream once per call

// The 8 rows' scales of a Q4 block: fp16 (PackedQ4x8) or fp32 (PackedQ4x8F).
inline __m256 load_fp16x8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load_d(const PackedQ4x8& B) { return load_fp16x8(B.d); }
inline __m256 load_m(const PackedQ4x8& B) { return load_fp16x8(B.m); }
inline __m256 load_d(const PackedQ4x8F& B) { return _mm256_loadu_ps(B.d); }
inline __m256 load_m(const PackedQ4x8F& B) { return _mm256_loadu_ps(B.m); }

template <typename Block, int T>
inline void q4x8_tile(const Block* w, int64_t nb, const BlockQ8A* x, int64_t x_rows_stride, float* out,
                      int64_t out_stride) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const Block& B = w[b];
    for (int l = 0; l < static_cast<int>((sizeof(Block) + 63) / 64); ++l)
      _mm_prefetch(reinterpret_cast<const char*>(&B) + kPrefetchBytes + 64 * l, _MM_HINT_T0);
    __m256i s[T];
    for (int t = 0; t < T; ++t) s[t] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.qs + 32 * c));
      const __m256i lo = _mm256_and_si256(v, low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      for (int t = 0; t < T; ++t) {
        const int8_t* q = x[t * x_rows_stride + b].qs;
        s[t] = dpbusd(s[t], lo, broadcast4(q + 4 * c));
        s[t] = dpbusd(s[t], hi, broadcast4(q + 16 + 4 * c));
      }
    }
    const __m256 d = load_d(B);
    const __m256 mn = load_m(B);
    for (int t = 0; t < T; ++t) {
      const BlockQ8A& xb = x[t * x_rows_stride + b];
      const __m256 f = _mm256_cvtepi32_ps(s[t]);
      acc[t] = _mm256_fmadd_ps(f, _mm256_mul_ps(d, _mm256_set1_ps(xb.d)), acc[t]);
      acc[t] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xb.s), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) _mm256_storeu_ps(out + t * out_stride, acc[t]);
}

// Q8_0 weights are signed: |w| as the unsigned operand, x with w's sign.
template <int T>
inline void q8x8_tile(const PackedQ8x8* w, int64_t nb, const BlockQ8A* x, int64_t x_rows_stride, float* out,
                      int64_t out_stride) {
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const PackedQ8x8& B = w[b];
    for (int l = 0; l < 5; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(&B) + kPrefetchBytes + 64 * l, _MM_HINT_T0);
    __m256i s[T];
    for (int t = 0; t < T; ++t) s[t] = _mm256_setzero_si256();
    for (int g = 0; g < 8; ++g) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.qs + 32 * g));
      const __m256i av = _mm256_sign_epi8(v, v);
      for (int t = 0; t < T; ++t) {
        const __m256i xv = broadcast4(x[t * x_rows_stride + b].qs + 4 * g);
        s[t] = dpbusd(s[t], av, _mm256_sign_epi8(xv, v));
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

// PackedQ8x8H: as q8x8_tile, the runs g < 4 and g >= 4 into separate sums,
// each scaled by its half's d.
template <int T>
inline void q8x8h_tile(const PackedQ8x8H* w, int64_t nb, const BlockQ8A* x, int64_t x_rows_stride, float* out,
                       int64_t out_stride) {
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const PackedQ8x8H& B = w[b];
    for (int l = 0; l < 6; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(&B) + kPrefetchBytes + 64 * l, _MM_HINT_T0);
    __m256i s[2][T];
    for (int t = 0; t < T; ++t) s[0][t] = s[1][t] = _mm256_setzero_si256();
    for (int g = 0; g < 8; ++g) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.qs + 32 * g));
      const __m256i av = _mm256_sign_epi8(v, v);
      for (int t = 0; t < T; ++t) {
        const __m256i xv = broadcast4(x[t * x_rows_stride + b].qs + 4 * g);
        s[g / 4][t] = dpbusd(s[g / 4][t], av, _mm256_sign_epi8(xv, v));
      }
    }
    const __m256 dlo = _mm256_loadu_ps(B.d), dhi = _mm256_loadu_ps(B.d + 8), mn = _mm256_loadu_ps(B.m);
    for (int t = 0; t < T; ++t) {
      const BlockQ8A& xb = x[t * x_rows_stride + b];
      const __m256 xd = _mm256_set1_ps(xb.d);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[0][t]), _mm256_mul_ps(dlo, xd), acc[t]);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[1][t]), _mm256_mul_ps(dhi, xd), acc[t]);
      acc[t] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xb.s), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) _mm256_storeu_ps(out + t * out_stride, acc[t]);
}

// The offset kernels (Kernels::gemm_q8x8_offset, gemm_q8x8h_offset): x + 128
// is the unsigned operand and the weights the signed one, as stored;
// sum((x + 128) * w) - 128 * sum(w) is the same exact integer sum as the sign
// trick's. The weight sums take one vpdpbusd of ones per run, shared by the
// tile's tokens, where the sign trick takes a vpsignb per run and token.
// PackedQ8x8H keeps a sum per 16-element half, each scaled by its half's d
// (q8x8h_tile's arithmetic), PackedQ8x8 one (q8x8_tile's).
template <typename Block, int T>
inline void q8_offset_tile(const Block* w, int64_t nb, const BlockQ8A* x, int64_t x_rows_stride, float* out,
                           int64_t out_stride) {
  constexpr bool kHalves = std::is_same_v<Block, PackedQ8x8H>;
  constexpr int kSums = kHalves ? 2 : 1;
  const __m256i ones = _mm256_set1_epi8(1);
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const Block& B = w[b];
    for (int l = 0; l < static_cast<int>((sizeof(Block) + 63) / 64); ++l)
      _mm_prefetch(reinterpret_cast<const char*>(&B) + kPrefetchBytes + 64 * l, _MM_HINT_T0);
    __m256i s[kSums][T], wsum[kSums];
    for (int h = 0; h < kSums; ++h) {
      wsum[h] = _mm256_setzero_si256();
      for (int t = 0; t < T; ++t) s[h][t] = _mm256_setzero_si256();
    }
    for (int g = 0; g < 8; ++g) {
      const int h = kHalves ? g / 4 : 0;
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.qs + 32 * g));
      wsum[h] = dpbusd(wsum[h], ones, v);
      for (int t = 0; t < T; ++t) s[h][t] = dpbusd(s[h][t], broadcast4(x[t * x_rows_stride + b].qs + 4 * g), v);
    }
    __m256 f[kSums][T];
    for (int h = 0; h < kSums; ++h) {
      const __m256i offset = _mm256_slli_epi32(wsum[h], 7);
      for (int t = 0; t < T; ++t) f[h][t] = _mm256_cvtepi32_ps(_mm256_sub_epi32(s[h][t], offset));
    }
    for (int t = 0; t < T; ++t) {
      const BlockQ8A& xb = x[t * x_rows_stride + b];
      const __m256 xd = _mm256_set1_ps(xb.d);
      if constexpr (kHalves) {
        acc[t] = _mm256_fmadd_ps(f[0][t], _mm256_mul_ps(_mm256_loadu_ps(B.d), xd), acc[t]);
        acc[t] = _mm256_fmadd_ps(f[1][t], _mm256_mul_ps(_mm256_loadu_ps(B.d + 8), xd), acc[t]);
        acc[t] = _mm256_fmadd_ps(_mm256_loadu_ps(B.m), _mm256_set1_ps(xb.s), acc[t]);
      } else {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(B.d)));
        acc[t] = _mm256_fmadd_ps(f[0][t], _mm256_mul_ps(d, xd), acc[t]);
      }
    }
  }
  for (int t = 0; t < T; ++t) _mm256_storeu_ps(out + t * out_stride, acc[t]);
}

// Two consecutive packed groups at once (16 rows: group 0's 8 in the low half
// of a 512-bit vector, group 1's in the high half): the same per-lane
// arithmetic as the 8-row tiles above, so the same bits, but each activation
// broadcast and each float step serves 16 rows. Measured on Zen 4: 1.3x the
// 8-row Q4 kernel's rate at 4 tokens per tile. V16i / V16f are a 512-bit
// vector; the emulation build (AVX2 only) makes them two 256-bit halves, so
// the tests run these kernels' loops on any AVX2 CPU.
#if defined(PD_VNNI_EMULATION)
struct V16i {
  __m256i lo, hi;
};
struct V16f {
  __m256 lo, hi;
};
inline V16i pair_i(__m256i lo, __m256i hi) { return {lo, hi}; }
inline V16f pair_f(__m256 lo, __m256 hi) { return {lo, hi}; }
inline V16i zero_i() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline V16f zero_f() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16i set1_i(int32_t v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
inline V16f set1_f(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline V16i and_i(V16i a, V16i b) { return {_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
inline V16i srli16_4(V16i a) { return {_mm256_srli_epi16(a.lo, 4), _mm256_srli_epi16(a.hi, 4)}; }
inline V16i add_i(V16i a, V16i b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline V16i sub_i(V16i a, V16i b) { return {_mm256_sub_epi32(a.lo, b.lo), _mm256_sub_epi32(a.hi, b.hi)}; }
inline V16i slli32_7(V16i a) { return {_mm256_slli_epi32(a.lo, 7), _mm256_slli_epi32(a.hi, 7)}; }
inline V16i dpbusd16(V16i acc, V16i a, V16i b) { return {dpbusd(acc.lo, a.lo, b.lo), dpbusd(acc.hi, a.hi, b.hi)}; }
inline V16f cvt_f(V16i a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline V16f mul_f(V16f a, V16f b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16f fma_f(V16f a, V16f b, V16f c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline void store_f(float* p, V16f a) { _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi); }
#else
using V16i = __m512i;
using V16f = __m512;
inline V16i pair_i(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_zextsi256_si512(lo), hi, 1); }
inline V16f pair_f(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_zextps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}
inline V16i zero_i() { return _mm512_setzero_si512(); }
inline V16f zero_f() { return _mm512_setzero_ps(); }
inline V16i set1_i(int32_t v) { return _mm512_set1_epi32(v); }
inline V16f set1_f(float v) { return _mm512_set1_ps(v); }
inline V16i and_i(V16i a, V16i b) { return _mm512_and_si512(a, b); }
inline V16i srli16_4(V16i a) { return _mm512_srli_epi16(a, 4); }
inline V16i add_i(V16i a, V16i b) { return _mm512_add_epi32(a, b); }
inline V16i sub_i(V16i a, V16i b) { return _mm512_sub_epi32(a, b); }
inline V16i slli32_7(V16i a) { return _mm512_slli_epi32(a, 7); }
inline V16i dpbusd16(V16i acc, V16i a, V16i b) { return _mm512_dpbusd_epi32(acc, a, b); }
inline V16f cvt_f(V16i a) { return _mm512_cvtepi32_ps(a); }
inline V16f mul_f(V16f a, V16f b) { return _mm512_mul_ps(a, b); }
inline V16f fma_f(V16f a, V16f b, V16f c) { return _mm512_fmadd_ps(a, b, c); }
inline void store_f(float* p, V16f a) { _mm512_storeu_ps(p, a); }
#endif

inline V16i broadcast4x16(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return set1_i(v);
}
inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
// Software prefetch for the two-group kernels. A pair of groups is two read
// streams one group apart, which the hardware prefetchers follow poorly, and
// a fixed distance ahead in each stream would mostly land in the other group.
// Block b of the next pair (the next work item, as the caller walks a matrix
// in pairs) goes to L2 while block b of this pair is read. Measured with
// pd-bench-kernels --cold (weights read from memory, one token): without a
// software prefetch the pairs ran at half the 8-row kernels' rate; with "2 KB
// ahead" in each stream, at 0.6x; with this one, at 0.9-1.1x.
template <typename Block>
inline void prefetch_next_pair(const Block* w, int64_t nb, int64_t b) {
  const char* p0 = reinterpret_cast<const char*>(w + 2 * nb + b);
  const char* p1 = reinterpret_cast<const char*>(w + 3 * nb + b);
  for (int l = 0; l < static_cast<int>((sizeof(Block) + 63) / 64); ++l) {
    _mm_prefetch(p0 + 64 * l, _MM_HINT_T1);
    _mm_prefetch(p1 + 64 * l, _MM_HINT_T1);
  }
}

// q4x8_tile over groups w and w + nb. The low and high nibbles' products go
// to separate integer sums (added before the conversion: the same exact
// integer), so that two dependency chains run per token.
template <typename Block, int T>
inline void q4x16_tile(const Block* w, int64_t nb, const BlockQ8A* x, int64_t x_rows_stride, float* out,
                       int64_t out_stride) {
  const Block* w1 = w + nb;
  const V16i low4 = set1_i(0x0F0F0F0F);
  V16f acc[T];
  for (int t = 0; t < T; ++t) acc[t] = zero_f();
  for (int64_t b = 0; b < nb; ++b) {
    const Block& B0 = w[b];
    const Block& B1 = w1[b];
    prefetch_next_pair(w, nb, b);
    V16i s[T], u[T];
    for (int t = 0; t < T; ++t) s[t] = u[t] = zero_i();
    for (int c = 0; c < 4; ++c) {
      const V16i v = pair_i(load256(B0.qs + 32 * c), load256(B1.qs + 32 * c));
      const V16i lo = and_i(v, low4);
      const V16i hi = and_i(srli16_4(v), low4);
      for (int t = 0; t < T; ++t) {
        const int8_t* q = x[t * x_rows_stride + b].qs;
        s[t] = dpbusd16(s[t], lo, broadcast4x16(q + 4 * c));
        u[t] = dpbusd16(u[t], hi, broadcast4x16(q + 16 + 4 * c));
      }
    }
    const V16f d = pair_f(load_d(B0), load_d(B1));
    const V16f mn = pair_f(load_m(B0), load_m(B1));
    for (int t = 0; t < T; ++t) {
      const BlockQ8A& xb = x[t * x_rows_stride + b];
      acc[t] = fma_f(cvt_f(add_i(s[t], u[t])), mul_f(d, set1_f(xb.d)), acc[t]);
      acc[t] = fma_f(mn, set1_f(xb.s), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) store_f(out + t * out_stride, acc[t]);
}

// q8_offset_tile over groups w and w + nb.
template <typename Block, int T>
inline void q8_offset_x16_tile(const Block* w, int64_t nb, const BlockQ8A* x, int64_t x_rows_stride, float* out,
                               int64_t out_stride) {
  constexpr bool kHalves = std::is_same_v<Block, PackedQ8x8H>;
  constexpr int kSums = kHalves ? 2 : 1;
  const Block* w1 = w + nb;
  const V16i ones = set1_i(0x01010101);
  V16f acc[T];
  for (int t = 0; t < T; ++t) acc[t] = zero_f();
  for (int64_t b = 0; b < nb; ++b) {
    const Block& B0 = w[b];
    const Block& B1 = w1[b];
    prefetch_next_pair(w, nb, b);
    V16i s[kSums][T], wsum[kSums];
    for (int h = 0; h < kSums; ++h) {
      wsum[h] = zero_i();
      for (int t = 0; t < T; ++t) s[h][t] = zero_i();
    }
    for (int g = 0; g < 8; ++g) {
      const int h = kHalves ? g / 4 : 0;
      const V16i v = pair_i(load256(B0.qs + 32 * g), load256(B1.qs + 32 * g));
      wsum[h] = dpbusd16(wsum[h], ones, v);
      for (int t = 0; t < T; ++t) s[h][t] = dpbusd16(s[h][t], broadcast4x16(x[t * x_rows_stride + b].qs + 4 * g), v);
    }
    V16f f[kSums][T];
    for (int h = 0; h < kSums; ++h) {
      const V16i offset = slli32_7(wsum[h]);
      for (int t = 0; t < T; ++t) f[h][t] = cvt_f(sub_i(s[h][t], offset));
    }
    for (int t = 0; t < T; ++t) {
      const BlockQ8A& xb = x[t * x_rows_stride + b];
      const V16f xd = set1_f(xb.d);
      if constexpr (kHalves) {
        const V16f dlo = pair_f(_mm256_loadu_ps(B0.d), _mm256_loadu_ps(B1.d));
        const V16f dhi = pair_f(_mm256_loadu_ps(B0.d + 8), _mm256_loadu_ps(B1.d + 8));
        acc[t] = fma_f(f[0][t], mul_f(dlo, xd), acc[t]);
        acc[t] = fma_f(f[1][t], mul_f(dhi, xd), acc[t]);
        acc[t] = fma_f(pair_f(_mm256_loadu_ps(B0.m), _mm256_loadu_ps(B1.m)), set1_f(xb.s), acc[t]);
      } else {
        acc[t] = fma_f(f[0][t], mul_f(pair_f(load_fp16x8(B0.d), load_fp16x8(B1.d)), xd), acc[t]);
      }
    }
  }
  for (int t = 0; t < T; ++t) store_f(out + t * out_stride, acc[t]);
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

void gemm_q4x8_vnni(const PackedQ4x8* w, int64_t nb, const BlockQ8A* x, int m, float* out, int64_t out_stride) {
  using B = PackedQ4x8;
  gemm_tiles<B, q4x8_tile<B, 4>, q4x8_tile<B, 3>, q4x8_tile<B, 2>, q4x8_tile<B, 1>>(w, nb, x, m, out, out_stride);
}

void gemm_q4x8f_vnni(const PackedQ4x8F* w, int64_t nb, const BlockQ8A* x, int m, float* out, int64_t out_stride) {
  using B = PackedQ4x8F;
  gemm_tiles<B, q4x8_tile<B, 4>, q4x8_tile<B, 3>, q4x8_tile<B, 2>, q4x8_tile<B, 1>>(w, nb, x, m, out, out_stride);
}

void gemm_q8x8h_vnni(const PackedQ8x8H* w, int64_t nb, const BlockQ8A* x, int m, float* out, int64_t out_stride) {
  gemm_tiles<PackedQ8x8H, q8x8h_tile<4>, q8x8h_tile<3>, q8x8h_tile<2>, q8x8h_tile<1>>(w, nb, x, m, out, out_stride);
}

void gemm_q8x8_vnni(const PackedQ8x8* w, int64_t nb, const BlockQ8A* x, int m, float* out, int64_t out_stride) {
  gemm_tiles<PackedQ8x8, q8x8_tile<4>, q8x8_tile<3>, q8x8_tile<2>, q8x8_tile<1>>(w, nb, x, m, out, out_stride);
}

void gemm_q8x8_offset_vnni(const PackedQ8x8* w, int64_t nb, const BlockQ8A* x, int m, float* out, int64_t out_stride) {
  using B = PackedQ8x8;
  gemm_tiles<B, q8_offset_tile<B, 4>, q8_offset_tile<B, 3>, q8_offset_tile<B, 2>, q8_offset_tile<B, 1>>(
      w, nb, x, m, out, out_stride);
}

void gemm_q8x8h_offset_vnni(const PackedQ8x8H* w, int64_t nb, const BlockQ8A* x, int m, float* out,
                            int64_t out_stride) {
  using B = PackedQ8x8H;
  gemm_tiles<B, q8_offset_tile<B, 4>, q8_offset_tile<B, 3>, q8_offset_tile<B, 2>, q8_offset_tile<B, 1>>(
      w, nb, x, m, out, out_stride);
}

void gemm_q4x8_x2_vnni(const PackedQ4x8* w, int64_t nb, const BlockQ8A* x, int m, float* out, int64_t out_stride) {
  using B = PackedQ4x8;
  gemm_tiles<B, q4x16_tile<B, 4>, q4x16_tile<B, 3>, q4x16_tile<B, 2>, q4x16_tile<B, 1>>(w, nb, x, m, out, out_stride);
}

void gemm_q4x8f_x2_vnni(const PackedQ4x8F* w, int64_t nb, const BlockQ8A* x, int m, float* out, int64_t out_stride) {
  using B = PackedQ4x8F;
  gemm_tiles<B, q4x16_tile<B, 4>, q4x16_tile<B, 3>, q4x16_tile<B, 2>, q4x16_tile<B, 1>>(w, nb, x, m, out, out_stride);
}

void gemm_q8x8_offset_x2_vnni(const PackedQ8x8* w, int64_t nb, const BlockQ8A* x, int m, float* out,
                              int64_t out_stride) {
  using B = PackedQ8x8;
  gemm_tiles<B, q8_offset_x16_tile<B, 4>, q8_offset_x16_tile<B, 3>, q8_offset_x16_tile<B, 2>,
             q8_offset_x16_tile<B, 1>>(w, nb, x, m, out, out_stride);
}

void gemm_q8x8h_offset_x2_vnni(const PackedQ8x8H* w, int64_t nb, const BlockQ8A* x, int m, float* out,
                               int64_t out_stride) {
  using B = PackedQ8x8H;
  gemm_tiles<B, q8_offset_x16_tile<B, 4>, q8_offset_x16_tile<B, 3>, q8_offset_x16_tile<B, 2>,
             q8_offset_x16_tile<B, 1>>(w, nb, x, m, out, out_stride);
}

constexpr IntegerGemm kVnniGemm{gemm_q4x8_vnni,           gemm_q8x8_vnni,           gemm_q4x8f_vnni,
                                gemm_q8x8h_vnni,          gemm_q8x8_offset_vnni,    gemm_q8x8h_offset_vnni,
                                gemm_q4x8_x2_vnni,        gemm_q4x8f_x2_vnni,       gemm_q8x8_offset_x2_vnni,
                                gemm_q8x8h_offset_x2_vnni};

#if !defined(PD_VNNI_EMULATION)
#include "backend/cpu/attention_kernels.inc"

constexpr AttentionKernels kAvx512Attention{qk_scores_simd, softmax_step_simd, pv_accumulate_simd};
#endif

}  // namespace

#if defined(PD_VNNI_EMULATION)
const IntegerGemm* avx512vnni_gemm_emulated() { return &kVnniGemm; }
#else
const IntegerGemm* avx512vnni_gemm() { return &kVnniGemm; }
const AttentionKernels* avx512_attention() { return &kAvx512Attention; }
#endif

}  // namespace pd::cpu

#elif !defined(PD_VNNI_EMULATION)  // not compiled for AVX512-VNNI (a non-x86 target)

namespace pd::cpu {
const IntegerGemm* avx512vnni_gemm() { return nullptr; }
const AttentionKernels* avx512_attention() { return nullptr; }
}  // namespace pd::cpu

#endif
