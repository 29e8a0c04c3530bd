// AVX512-VNNI integer matmul kernels for q8_kernels.h: one packed group in
// 256-bit vectors (AVX512VL encodings), or two in 512-bit vectors (the
// Kernels::*_x2 entries; Rows16 below). vpdpbusd multiplies 4 unsigned bytes by 4 signed bytes
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
//
// q8_kernels_avxvnni.cpp compiles it a second time with PD_AVX_VNNI, for
// AVX-VNNI (the same vpdpbusd in its 256-bit VEX encoding, on CPUs without
// AVX-512: Intel since Alder Lake, AMD Zen 5 client parts): the one-group
// (Rows8) kernels only, and in the Q4 kernels one integer sum per token
// instead of two (the same exact integer) so that a 4-token tile's sums fit
// AVX2's 16 vector registers.
#include "backend/cpu/q8_kernels.h"

#if ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(PD_VNNI_EMULATION) || \
     (defined(PD_AVX_VNNI) && defined(__AVXVNNI__))) &&                                  \
    defined(__FMA__) && defined(__F16C__)
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
#elif defined(PD_AVX_VNNI)
inline __m256i dpbusd(__m256i acc, __m256i a, __m256i b) { return _mm256_dpbusd_avx_epi32(acc, a, b); }
#else
inline __m256i dpbusd(__m256i acc, __m256i a, __m256i b) { return _mm256_dpbusd_epi32(acc, a, b); }
#endif

// One integer sum per token in the Q4 kernels (AVX-VNNI: 16 registers), or
// two (the low and high nibbles' apart: two dependency chains per token).
#if defined(PD_AVX_VNNI)
constexpr bool kOneQ4SumAvxVnni = true;
#else
constexpr bool kOneQ4SumAvxVnni = false;
#endif

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm256_set1_epi32(v);
}

constexpr int kPrefetchBytes = 8192;  // as in the AVX2 kernels: 8 KB ahead into L2 (prefetcht1)

// The 8 rows' scales of a Q4 block: fp16 (PackedQ4x8) or fp32 (PackedQ4x8F).
inline __m256 load_fp16x8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load_d(const PackedQ4x8& B) { return load_fp16x8(B.d); }
inline __m256 load_m(const PackedQ4x8& B) { return load_fp16x8(B.m); }
inline __m256 load_d(const PackedQ4x8F& B) { return _mm256_loadu_ps(B.d); }
inline __m256 load_m(const PackedQ4x8F& B) { return _mm256_loadu_ps(B.m); }

// Q8_0 weights are signed: |w| as the unsigned operand, x with w's sign.
template <int T>
inline void q8x8_tile(const PackedQ8x8* w, int64_t nb, const BlockQ8A* x, int64_t x_rows_stride, float* out,
                      int64_t out_stride) {
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const PackedQ8x8& B = w[b];
    for (int l = 0; l < 5; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(&B) + kPrefetchBytes + 64 * l, _MM_HINT_T1);
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
      _mm_prefetch(reinterpret_cast<const char*>(&B) + kPrefetchBytes + 64 * l, _MM_HINT_T1);
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

// The rows one tile computes and the vectors it computes them in. Rows8: one
// packed group, 256-bit vectors, row r in lane r. Rows16: two consecutive
// groups (w and w + nb blocks) in 512-bit vectors, the first group's rows in
// the low half, so that each activation broadcast and each scale step serve 16
// rows (1.2-1.5x Rows8's rate where the weights are in cache: pd-bench-kernels).
// A lane does the same arithmetic either way: the same bits. In the emulation
// build (AVX2 only) a Rows16 vector is two 256-bit halves, so the tests run
// its loops on any AVX2 CPU.
struct Rows8 {
  static constexpr int kTileTokens = 4;
  using I = __m256i;
  using F = __m256;
  static I zero_i() { return _mm256_setzero_si256(); }
  static F zero_f() { return _mm256_setzero_ps(); }
  static I set1_i(int32_t v) { return _mm256_set1_epi32(v); }
  static F set1_f(float v) { return _mm256_set1_ps(v); }
  static I and_i(I a, I b) { return _mm256_and_si256(a, b); }
  static I srli16_4(I a) { return _mm256_srli_epi16(a, 4); }
  static I add_i(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub_i(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I slli32_7(I a) { return _mm256_slli_epi32(a, 7); }
  static I dpbusd_i(I acc, I a, I b) { return dpbusd(acc, a, b); }
  static F cvt_f(I a) { return _mm256_cvtepi32_ps(a); }
  static F mul_f(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma_f(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static void store_f(float* p, F a) { _mm256_storeu_ps(p, a); }
  // The 32 bytes at `at` of block b's quants; a vector of one value per row
  // of block b (load: const Block& -> __m256).
  template <typename Block>
  static I quants(const Block* w, int64_t, int64_t b, int at) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[b].qs + at));
  }
  template <typename Block, typename Load>
  static F per_row(const Block* w, int64_t, int64_t b, Load load) {
    return load(w[b]);
  }
  // Weights stream once per call: 8 KB ahead into L2, as in the AVX2 kernels.
  template <typename Block>
  static void prefetch(const Block* w, int64_t, int64_t b) {
    for (int l = 0; l < static_cast<int>((sizeof(Block) + 63) / 64); ++l)
      _mm_prefetch(reinterpret_cast<const char*>(w + b) + kPrefetchBytes + 64 * l, _MM_HINT_T1);
  }
};

#if !defined(PD_AVX_VNNI)
struct Rows16 {
  static constexpr int kTileTokens = 8;
#if defined(PD_VNNI_EMULATION)
  struct I {
    __m256i lo, hi;
  };
  struct F {
    __m256 lo, hi;
  };
  static I pair_i(__m256i lo, __m256i hi) { return {lo, hi}; }
  static F pair_f(__m256 lo, __m256 hi) { return {lo, hi}; }
  static I zero_i() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
  static F zero_f() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static I set1_i(int32_t v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
  static F set1_f(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
  static I and_i(I a, I b) { return {_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
  static I srli16_4(I a) { return {_mm256_srli_epi16(a.lo, 4), _mm256_srli_epi16(a.hi, 4)}; }
  static I add_i(I a, I b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
  static I sub_i(I a, I b) { return {_mm256_sub_epi32(a.lo, b.lo), _mm256_sub_epi32(a.hi, b.hi)}; }
  static I slli32_7(I a) { return {_mm256_slli_epi32(a.lo, 7), _mm256_slli_epi32(a.hi, 7)}; }
  static I dpbusd_i(I acc, I a, I b) { return {dpbusd(acc.lo, a.lo, b.lo), dpbusd(acc.hi, a.hi, b.hi)}; }
  static F cvt_f(I a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
  static F mul_f(F a, F b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
  static F fma_f(F a, F b, F c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
  static void store_f(float* p, F a) { _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi); }
#else
  using I = __m512i;
  using F = __m512;
  static I pair_i(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_zextsi256_si512(lo), hi, 1); }
  static F pair_f(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_zextps256_ps512(lo)), _mm256_castps_pd(hi), 1));
  }
  static I zero_i() { return _mm512_setzero_si512(); }
  static F zero_f() { return _mm512_setzero_ps(); }
  static I set1_i(int32_t v) { return _mm512_set1_epi32(v); }
  static F set1_f(float v) { return _mm512_set1_ps(v); }
  static I and_i(I a, I b) { return _mm512_and_si512(a, b); }
  static I srli16_4(I a) { return _mm512_srli_epi16(a, 4); }
  static I add_i(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub_i(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I slli32_7(I a) { return _mm512_slli_epi32(a, 7); }
  static I dpbusd_i(I acc, I a, I b) { return _mm512_dpbusd_epi32(acc, a, b); }
  static F cvt_f(I a) { return _mm512_cvtepi32_ps(a); }
  static F mul_f(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma_f(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static void store_f(float* p, F a) { _mm512_storeu_ps(p, a); }
#endif
  template <typename Block>
  static I quants(const Block* w, int64_t nb, int64_t b, int at) {
    return pair_i(Rows8::quants(w, nb, b, at), Rows8::quants(w + nb, nb, b, at));
  }
  template <typename Block, typename Load>
  static F per_row(const Block* w, int64_t nb, int64_t b, Load load) {
    return pair_f(load(w[b]), load(w[nb + b]));
  }
  // A pair is two read streams one group apart, which the hardware
  // prefetchers follow poorly, and a fixed distance ahead in each would mostly
  // land in the other group. Block b of the next pair (the next work item, as
  // the caller walks a matrix in pairs) goes to L2 while block b of this pair
  // is read. pd-bench-kernels --cold (weights read from memory, one token):
  // without a software prefetch the pairs ran at half Rows8's rate; with 2 KB
  // ahead in each stream, at 0.6x; with this one, at 0.84-1.3x.
  template <typename Block>
  static void prefetch(const Block* w, int64_t nb, int64_t b) {
    const char* p0 = reinterpret_cast<const char*>(w + 2 * nb + b);
    const char* p1 = reinterpret_cast<const char*>(w + 3 * nb + b);
    for (int l = 0; l < static_cast<int>((sizeof(Block) + 63) / 64); ++l) {
      _mm_prefetch(p0 + 64 * l, _MM_HINT_T1);
      _mm_prefetch(p1 + 64 * l, _MM_HINT_T1);
    }
  }
};
#endif  // !PD_AVX_VNNI

// The activations' 4 bytes at p, in every lane.
template <typename R>
inline typename R::I broadcast4_rows(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return R::set1_i(v);
}

// Q4_0/Q4_1 (PackedQ4x8) and Q4_K (PackedQ4x8F). The low and high nibbles'
// products go to separate integer sums, added before the conversion (the
// same exact integer), so that two dependency chains run per token; tiles of
// more than 4 tokens have chains enough with one sum per token, and the
// registers for it.
template <typename R, typename Block, int T>
inline void q4_tile(const Block* w, int64_t nb, const BlockQ8A* x, int64_t x_rows_stride, float* out,
                    int64_t out_stride) {
  using I = typename R::I;
  using F = typename R::F;
  constexpr bool kOneQ4Sum = kOneQ4SumAvxVnni || T > 4;
  const I low4 = R::set1_i(0x0F0F0F0F);
  F acc[T];
  for (int t = 0; t < T; ++t) acc[t] = R::zero_f();
  for (int64_t b = 0; b < nb; ++b) {
    R::prefetch(w, nb, b);
    I s[T], u[T];
    for (int t = 0; t < T; ++t) s[t] = u[t] = R::zero_i();
    for (int c = 0; c < 4; ++c) {
      const I v = R::quants(w, nb, b, 32 * c);
      const I lo = R::and_i(v, low4);
      const I hi = R::and_i(R::srli16_4(v), low4);
      for (int t = 0; t < T; ++t) {
        const int8_t* q = x[t * x_rows_stride + b].qs;
        s[t] = R::dpbusd_i(s[t], lo, broadcast4_rows<R>(q + 4 * c));
        I& high = kOneQ4Sum ? s[t] : u[t];
        high = R::dpbusd_i(high, hi, broadcast4_rows<R>(q + 16 + 4 * c));
      }
    }
    const F d = R::per_row(w, nb, b, [](const Block& B) { return load_d(B); });
    const F mn = R::per_row(w, nb, b, [](const Block& B) { return load_m(B); });
    for (int t = 0; t < T; ++t) {
      const BlockQ8A& xb = x[t * x_rows_stride + b];
      const I sum = kOneQ4Sum ? s[t] : R::add_i(s[t], u[t]);
      acc[t] = R::fma_f(R::cvt_f(sum), R::mul_f(d, R::set1_f(xb.d)), acc[t]);
      acc[t] = R::fma_f(mn, R::set1_f(xb.s), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) R::store_f(out + t * out_stride, acc[t]);
}

// The offset kernels (Kernels::gemm_q8x8_offset, gemm_q8x8h_offset): x + 128
// is the unsigned operand and the weights the signed one, as stored;
// sum((x + 128) * w) - 128 * sum(w) is the same exact integer sum as the sign
// trick's. The weight sums take one vpdpbusd of ones per run, shared by the
// tile's tokens, where the sign trick takes a vpsignb per run and token.
// PackedQ8x8H keeps a sum per 16-element half, each scaled by its half's d
// (q8x8h_tile's arithmetic), PackedQ8x8 one (q8x8_tile's).
template <typename R, typename Block, int T>
inline void q8_offset_tile(const Block* w, int64_t nb, const BlockQ8A* x, int64_t x_rows_stride, float* out,
                           int64_t out_stride) {
  using I = typename R::I;
  using F = typename R::F;
  constexpr bool kHalves = std::is_same_v<Block, PackedQ8x8H>;
  constexpr int kSums = kHalves ? 2 : 1;
  constexpr int kRuns = 8 / kSums;  // runs per sum
  const I ones = R::set1_i(0x01010101);
  F acc[T];
  for (int t = 0; t < T; ++t) acc[t] = R::zero_f();
  for (int64_t b = 0; b < nb; ++b) {
    R::prefetch(w, nb, b);
    // One sum at a time (PackedQ8x8H: runs g < 4, then g >= 4), folded into
    // acc before the next one is built: the same operations in the same order
    // as building both first, in fewer registers (the AVX-VNNI build's 16
    // hold it; on an Intel Xeon the 512-bit pairs of Q5/Q6 ran 1.6-1.9x faster so).
    for (int h = 0; h < kSums; ++h) {
      I s[T], wsum = R::zero_i();
      for (int t = 0; t < T; ++t) s[t] = R::zero_i();
      for (int j = 0; j < kRuns; ++j) {
        const int g = h * kRuns + j;
        const I v = R::quants(w, nb, b, 32 * g);
        wsum = R::dpbusd_i(wsum, ones, v);
        for (int t = 0; t < T; ++t)
          s[t] = R::dpbusd_i(s[t], broadcast4_rows<R>(x[t * x_rows_stride + b].qs + 4 * g), v);
      }
      const I offset = R::slli32_7(wsum);
      F d;
      if constexpr (kHalves)
        d = R::per_row(w, nb, b, [h](const Block& B) { return _mm256_loadu_ps(B.d + 8 * h); });
      else
        d = R::per_row(w, nb, b, [](const Block& B) { return load_fp16x8(B.d); });
      for (int t = 0; t < T; ++t) {
        const F f = R::cvt_f(R::sub_i(s[t], offset));
        acc[t] = R::fma_f(f, R::mul_f(d, R::set1_f(x[t * x_rows_stride + b].d)), acc[t]);
      }
    }
    if constexpr (kHalves) {
      const F mn = R::per_row(w, nb, b, [](const Block& B) { return _mm256_loadu_ps(B.m); });
      for (int t = 0; t < T; ++t) acc[t] = R::fma_f(mn, R::set1_f(x[t * x_rows_stride + b].s), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) R::store_f(out + t * out_stride, acc[t]);
}

// Tiles of up to R::kTileTokens tokens: the weights of a call stream past
// once per tile, so a call of that many tokens or fewer (a decode batch, a
// verification step) reads them once. Rows16 (32 registers) takes 8 tokens at
// a time, Rows8 4 (the AVX-VNNI build has 16 registers). A token's outputs
// are the same bits in any tile.
// The last tile: `left` (< MaxT) tokens through Tiles::tile<left>.
template <typename Block, typename Tiles, int N>
inline void last_tile(int left, const Block* w, int64_t nb, const BlockQ8A* x, float* out, int64_t out_stride) {
  if constexpr (N > 0) {
    if (left == N) return Tiles::template tile<N>(w, nb, x, nb, out, out_stride);
    last_tile<Block, Tiles, N - 1>(left, w, nb, x, out, out_stride);
  }
}

template <typename Block, typename Tiles, int MaxT>
void gemm_tiles(const Block* w, int64_t nb, const BlockQ8A* x, int m, float* out, int64_t out_stride) {
  int t = 0;
  for (; t + MaxT <= m; t += MaxT)
    Tiles::template tile<MaxT>(w, nb, x + t * nb, nb, out + t * out_stride, out_stride);
  last_tile<Block, Tiles, MaxT - 1>(m - t, w, nb, x + t * nb, out + t * out_stride, out_stride);
}

template <typename R, typename Block>
struct Q4Tiles {
  template <int T>
  static void tile(const Block* w, int64_t nb, const BlockQ8A* x, int64_t xs, float* out, int64_t os) {
    q4_tile<R, Block, T>(w, nb, x, xs, out, os);
  }
};
template <typename R, typename Block>
struct Q8OffsetTiles {
  template <int T>
  static void tile(const Block* w, int64_t nb, const BlockQ8A* x, int64_t xs, float* out, int64_t os) {
    q8_offset_tile<R, Block, T>(w, nb, x, xs, out, os);
  }
};
struct Q8x8Tiles {
  template <int T>
  static void tile(const PackedQ8x8* w, int64_t nb, const BlockQ8A* x, int64_t xs, float* out, int64_t os) {
    q8x8_tile<T>(w, nb, x, xs, out, os);
  }
};
struct Q8x8hTiles {
  template <int T>
  static void tile(const PackedQ8x8H* w, int64_t nb, const BlockQ8A* x, int64_t xs, float* out, int64_t os) {
    q8x8h_tile<T>(w, nb, x, xs, out, os);
  }
};

// The Q4 and offset kernels over R's rows; and the sign-trick kernels, 8 rows only.
template <typename R, typename Block>
void gemm_q4(const Block* w, int64_t nb, const BlockQ8A* x, int m, float* out, int64_t out_stride) {
  gemm_tiles<Block, Q4Tiles<R, Block>, R::kTileTokens>(w, nb, x, m, out, out_stride);
}

template <typename R, typename Block>
void gemm_q8_offset(const Block* w, int64_t nb, const BlockQ8A* x, int m, float* out, int64_t out_stride) {
  gemm_tiles<Block, Q8OffsetTiles<R, Block>, R::kTileTokens>(w, nb, x, m, out, out_stride);
}

void gemm_q8x8h_vnni(const PackedQ8x8H* w, int64_t nb, const BlockQ8A* x, int m, float* out, int64_t out_stride) {
  gemm_tiles<PackedQ8x8H, Q8x8hTiles, 4>(w, nb, x, m, out, out_stride);
}

void gemm_q8x8_vnni(const PackedQ8x8* w, int64_t nb, const BlockQ8A* x, int m, float* out, int64_t out_stride) {
  gemm_tiles<PackedQ8x8, Q8x8Tiles, 4>(w, nb, x, m, out, out_stride);
}

constexpr IntegerGemm kVnniGemm{gemm_q4<Rows8, PackedQ4x8>,
                                gemm_q8x8_vnni,
                                gemm_q4<Rows8, PackedQ4x8F>,
                                gemm_q8x8h_vnni,
                                gemm_q8_offset<Rows8, PackedQ8x8>,
                                gemm_q8_offset<Rows8, PackedQ8x8H>,
#if defined(PD_AVX_VNNI)  // one group at a time: no 16-row pairs
                                nullptr,
                                nullptr,
                                nullptr,
                                nullptr};
#else
                                gemm_q4<Rows16, PackedQ4x8>,
                                gemm_q4<Rows16, PackedQ4x8F>,
                                gemm_q8_offset<Rows16, PackedQ8x8>,
                                gemm_q8_offset<Rows16, PackedQ8x8H>};
#endif

#if !defined(PD_VNNI_EMULATION) && !defined(PD_AVX_VNNI)
#include "backend/cpu/attention_kernels.inc"

constexpr AttentionKernels kAvx512Attention{qk_scores_simd, softmax_step_simd, pv_accumulate_simd};
#endif

}  // namespace

#if defined(PD_AVX_VNNI) && defined(PD_VNNI_EMULATION)
const IntegerGemm* avxvnni_gemm_emulated() { return &kVnniGemm; }
#elif defined(PD_AVX_VNNI)
const IntegerGemm* avxvnni_gemm() { return &kVnniGemm; }
#elif defined(PD_VNNI_EMULATION)
const IntegerGemm* avx512vnni_gemm_emulated() { return &kVnniGemm; }
#else
const IntegerGemm* avx512vnni_gemm() { return &kVnniGemm; }
const AttentionKernels* avx512_attention() { return &kAvx512Attention; }
#endif

}  // namespace pd::cpu

#elif defined(PD_AVX_VNNI)  // not compiled for AVX-VNNI (a non-x86 target)

namespace pd::cpu {
const IntegerGemm* avxvnni_gemm() { return nullptr; }
}  // namespace pd::cpu

#elif !defined(PD_VNNI_EMULATION)  // not compiled for AVX512-VNNI (a non-x86 target)

namespace pd::cpu {
const IntegerGemm* avx512vnni_gemm() { return nullptr; }
const AttentionKernels* avx512_attention() { return nullptr; }
}  // namespace pd::cpu

#endif
