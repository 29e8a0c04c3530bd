// The CPU kernel table (backend/cpu/q8_kernels.h) against plain scalar
// arithmetic written here: dequantize with gguf/ggml_types, dot and exp in
// double. Every instruction-set path this machine runs is checked; the integer
// matmul paths must also equal the portable path bit for bit.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/q8_kernels.h"
#include "gguf/ggml_types.h"
#include "test_support.h"

namespace pd::cpu {
// tests/common/vnni_emulation.cpp: the VNNI kernels with vpdpbusd emulated (AVX2).
const IntegerGemm* avx512vnni_gemm_emulated();
// tests/common/avxvnni_emulation.cpp: the AVX-VNNI kernels, vpdpbusd emulated.
const IntegerGemm* avxvnni_gemm_emulated();
// tests/common/attention_avx2_only.cpp: the attention kernels as a CPU without
// AVX-512 gets them (nullptr where this machine cannot build or run them).
const AttentionKernels* attention_avx2_16_registers();
}  // namespace pd::cpu

namespace {

using pd::cpu::BlockQ8A;
using pd::cpu::Isa;

using pd::test::random_floats;

// Every path this CPU runs; the others are named once (not counted as tested).
std::vector<Isa> runnable_isas() {
  std::vector<Isa> out;
  static bool noted = false;
  for (Isa isa : pd::cpu::kAllIsas) {
    if (pd::cpu::isa_supported(isa))
      out.push_back(isa);
    else if (!noted)
      std::printf("note: this CPU cannot run the %s kernels; they are not tested here\n", pd::cpu::isa_name(isa));
  }
  noted = true;
  return out;
}

// n rows of hd floats as the attention kernels take them (row pointers).
struct F32Rows {
  std::vector<const void*> ptr;
  F32Rows(const float* x, int n, int64_t hd) {
    for (int r = 0; r < n; ++r) ptr.push_back(x + r * hd);
  }
  pd::cpu::KvRows at(int first = 0) const { return {ptr.data() + first, pd::GgmlType::kF32}; }
};

// The same rows stored as `type` (F16 or Q8_0, as the KV cache stores them),
// and those stored values widened back to floats.
struct StoredRows {
  std::vector<uint8_t> bytes;
  std::vector<const void*> ptr;
  std::vector<float> widened;
  pd::GgmlType type;
  StoredRows(pd::GgmlType t, const float* x, int n, int64_t hd) : type(t) {
    const size_t row = pd::ggml_row_bytes(t, hd);
    bytes.resize(row * n);
    widened.resize(n * hd);
    for (int r = 0; r < n; ++r) {
      pd::quantize_row(t, x + r * hd, bytes.data() + r * row, hd);
      pd::dequantize_row(t, bytes.data() + r * row, widened.data() + r * hd, hd);
    }
    for (int r = 0; r < n; ++r) ptr.push_back(bytes.data() + r * row);
  }
  pd::cpu::KvRows at(int first = 0) const { return {ptr.data() + first, type}; }
};

// A quantized weight matrix in ggml rows, its dequantized values, and its packing.
struct Weights {
  pd::GgmlType type;
  int64_t n, k;
  std::vector<uint8_t> rows;
  std::vector<float> deq;
  std::vector<uint8_t> packed;
};

// Every weight type the integer kernels take, and the row lengths to test
// them at (the K-quants' rows are whole 256-element super-blocks).
constexpr pd::GgmlType kPackedTypes[] = {pd::GgmlType::kQ4_0, pd::GgmlType::kQ4_1, pd::GgmlType::kQ8_0,
                                         pd::GgmlType::kQ5_0, pd::GgmlType::kQ5_1, pd::GgmlType::kQ4_K,
                                         pd::GgmlType::kQ5_K, pd::GgmlType::kQ6_K};
bool is_kquant(pd::GgmlType type) { return pd::ggml_traits(type).block_elems == 256; }
std::vector<int64_t> row_lengths(pd::GgmlType type, bool few = false) {
  if (is_kquant(type)) return few ? std::vector<int64_t>{256, 768} : std::vector<int64_t>{256, 512, 768};
  return few ? std::vector<int64_t>{32, 608} : std::vector<int64_t>{32, 96, 608};
}

// Random block bytes with valid scales: every bit pattern of the quants
// (the whole range of q, which the quantizers may not reach), fp16 scales of
// either sign and moderate size (|d| in [2^-12, 2^-4]; Q4_0's -8d stays exact).
void randomize_rows(pd::GgmlType type, uint8_t* rows, size_t bytes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < bytes; ++i) rows[i] = static_cast<uint8_t>(rng());
  auto scale = [&](uint8_t* p) {
    const float mag = std::ldexp(1.0f + static_cast<float>(rng() % 1024) / 1024.0f, -12 + static_cast<int>(rng() % 8));
    const uint16_t h = pd::fp32_to_fp16(rng() % 2 ? -mag : mag);
    std::memcpy(p, &h, 2);
  };
  const size_t bb = pd::ggml_traits(type).block_bytes;
  for (size_t at = 0; at < bytes; at += bb) {
    uint8_t* b = rows + at;
    switch (type) {
      case pd::GgmlType::kQ4_0:
      case pd::GgmlType::kQ8_0:
      case pd::GgmlType::kQ5_0: scale(b); break;
      case pd::GgmlType::kQ4_1:
      case pd::GgmlType::kQ5_1:
      case pd::GgmlType::kQ4_K:
      case pd::GgmlType::kQ5_K: scale(b), scale(b + 2); break;
      case pd::GgmlType::kQ6_K: scale(b + 208); break;
      default: FAIL("no random blocks for " << pd::ggml_type_name(type));
    }
  }
}

// n rows of type `type`: quantized from N(0, 0.25) floats, or random blocks (raw).
Weights make_weights(pd::GgmlType type, int64_t n, int64_t k, uint64_t seed, bool raw = false) {
  Weights w{type, n, k, {}, {}, {}};
  const size_t row_bytes = pd::ggml_row_bytes(type, k);
  w.rows.resize(row_bytes * n);
  w.deq.resize(n * k);
  if (raw) {
    randomize_rows(type, w.rows.data(), w.rows.size(), seed);
  } else {
    const std::vector<float> f = random_floats(n * k, seed, 0.5f);
    for (int64_t r = 0; r < n; ++r) pd::quantize_row(type, f.data() + r * k, w.rows.data() + r * row_bytes, k);
  }
  for (int64_t r = 0; r < n; ++r)
    pd::dequantize_row(type, w.rows.data() + r * row_bytes, w.deq.data() + r * k, k);
  const auto fmt = pd::cpu::packed_format_for(type);
  REQUIRE(fmt != pd::cpu::PackedFormat::kNone);
  w.packed.resize(pd::cpu::packed_bytes(fmt, n, k));
  REQUIRE(pd::cpu::pack_rows(type, w.rows.data(), n, k, w.packed.data()));
  return w;
}

// Runs every group of the packed matrix against m quantized rows.
// pairs: consecutive groups two at a time through gemm_group_pair (the
// kernels' 16-row path where kern has one), as the backend runs them.
std::vector<float> run_gemm(const pd::cpu::Kernels& kern, const Weights& w, const std::vector<BlockQ8A>& xq, int m,
                            bool pairs = false) {
  const auto fmt = pd::cpu::packed_format_for(w.type);
  const int64_t nb = w.k / pd::cpu::kQBlock, groups = (w.n + 7) / 8;
  std::vector<float> out(m * groups * 8, -1.0f);
  const size_t gb = pd::cpu::packed_group_bytes(fmt, w.k);
  // Where kern has an offset kernel for this layout, through it (the plain
  // kernel is then not used by the backend for this layout).
  std::vector<BlockQ8A> xo;
  if (pd::cpu::uses_offset_activations(kern, fmt)) {
    xo.resize(xq.size());
    pd::cpu::offset_activations(xq.data(), static_cast<int64_t>(xq.size()), xo.data());
  }
  for (int64_t g = 0; g < groups; g += pairs && g + 1 < groups ? 2 : 1) {
    const uint8_t* group = w.packed.data() + g * gb;
    const BlockQ8A* xop = xo.empty() ? nullptr : xo.data();
    if (pairs && g + 1 < groups)
      pd::cpu::gemm_group_pair(kern, fmt, group, nb, xq.data(), m, out.data() + g * 8, groups * 8, xop);
    else
      pd::cpu::gemm_group(kern, fmt, group, nb, xq.data(), m, out.data() + g * 8, groups * 8, xop);
  }
  return out;
}

}  // namespace

TEST_CASE("q8 quantize: every path equals the scalar one bit for bit, error within half a step", "[cpu][kernels]") {
  for (int64_t k : {32, 64, 160}) {
    const int m = 5;
    const int64_t stride = k + 3;
    std::vector<float> x = random_floats(stride * m, 11 + k, 2.0f);
    for (int64_t j = 0; j < 32; ++j) x[stride + j] = 0.0f;  // an all-zero block: d = 0, q = 0
    x[2 * stride + 7] = 1e4f;                               // an outlier owns its block's scale
    const int64_t nb = k / 32;
    std::vector<BlockQ8A> ref(m * nb);
    pd::cpu::kernels(Isa::kScalar).quantize_rows(x.data(), k, stride, m, ref.data());
    for (int i = 0; i < m; ++i) {
      for (int64_t b = 0; b < nb; ++b) {
        const BlockQ8A& q = ref[i * nb + b];
        int sum = 0;
        for (int j = 0; j < 32; ++j) {
          const float v = x[i * stride + b * 32 + j];
          INFO("k=" << k << " row " << i << " block " << b << " element " << j);
          CHECK(std::abs(static_cast<int>(q.qs[j])) <= 127);
          CHECK(std::fabs(q.d * q.qs[j] - v) <= 0.5f * q.d * 1.0001f + 1e-30f);
          sum += q.qs[j];
        }
        CHECK(q.s == q.d * static_cast<float>(sum));
      }
    }
    CHECK(ref[nb].d == 0.0f);
    for (Isa isa : runnable_isas()) {
      std::vector<BlockQ8A> got(m * nb);
      pd::cpu::kernels(isa).quantize_rows(x.data(), k, stride, m, got.data());
      INFO(pd::cpu::isa_name(isa) << " k=" << k);
      CHECK(std::memcmp(got.data(), ref.data(), got.size() * sizeof(BlockQ8A)) == 0);
    }
  }
}

TEST_CASE("packing keeps every value: unpacked rows equal the ggml dequantization bit for bit", "[cpu][kernels]") {
  for (pd::GgmlType type : kPackedTypes) {
    const int64_t k = is_kquant(type) ? 512 : 96;
    for (bool raw : {false, true}) {
      for (int64_t n : {8, 13, 1}) {  // whole groups, a padded tail, a lone row
        const Weights w = make_weights(type, n, k, 3 + n, raw);
        std::vector<float> row(k);
        for (int64_t r = 0; r < n; ++r) {
          pd::cpu::unpack_row(pd::cpu::packed_format_for(type), w.packed.data(), k, r, row.data());
          INFO(pd::ggml_type_name(type) << (raw ? " random blocks" : " quantized") << " n=" << n << " row " << r);
          CHECK(std::memcmp(row.data(), w.deq.data() + r * k, k * sizeof(float)) == 0);
        }
      }
    }
  }
  CHECK(pd::cpu::packed_format_for(pd::GgmlType::kF16) == pd::cpu::PackedFormat::kNone);
  CHECK(pd::cpu::packed_format_for(pd::GgmlType::kQ8_K) == pd::cpu::PackedFormat::kNone);
  // A K-quant row is whole super-blocks.
  std::vector<uint8_t> rows(pd::ggml_row_bytes(pd::GgmlType::kQ4_K, 256)), dst(4096);
  CHECK_FALSE(pd::cpu::pack_rows(pd::GgmlType::kQ4_K, rows.data(), 1, 128, dst.data()));
}

TEST_CASE("integer gemm equals the scalar dot of the dequantized operands on every ISA path", "[cpu][kernels]") {
  for (pd::GgmlType type : kPackedTypes) {
    for (int64_t k : row_lengths(type)) {
      for (int64_t n : {8, 21}) {
        for (bool raw : {false, true}) {
          const Weights w = make_weights(type, n, k, 7 * k + n, raw);
          for (int m : {1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 15, 17}) {  // full token tiles of 4 and 8, every tail
            const std::vector<float> x = random_floats(k * m, 31 + m);
            const int64_t nb = k / 32;
            std::vector<BlockQ8A> xq(m * nb);
            pd::cpu::kernels(Isa::kScalar).quantize_rows(x.data(), k, k, m, xq.data());
            const std::vector<float> ref = run_gemm(pd::cpu::kernels(Isa::kScalar), w, xq, m);
            const int64_t ld = (n + 7) / 8 * 8;
            for (int t = 0; t < m; ++t) {
              for (int64_t r = 0; r < n; ++r) {
                // What the kernel computes exactly: dequantized weights times
                // dequantized activations. And what it approximates: times x.
                double want = 0.0, want_x = 0.0, mag = 0.0;
                for (int64_t j = 0; j < k; ++j) {
                  const BlockQ8A& b = xq[t * nb + j / 32];
                  const double xd = static_cast<double>(b.d) * b.qs[j % 32];
                  want += w.deq[r * k + j] * xd;
                  want_x += static_cast<double>(w.deq[r * k + j]) * x[t * k + j];
                  mag += std::fabs(w.deq[r * k + j] * xd);
                }
                INFO(pd::ggml_type_name(type) << (raw ? " random blocks" : " quantized") << " k=" << k << " n=" << n
                                              << " m=" << m << " t=" << t << " r=" << r);
                CHECK(std::fabs(ref[t * ld + r] - want) <= 1e-5 * mag + 1e-6);
                CHECK(std::fabs(ref[t * ld + r] - want_x) <= 0.02 * mag + 1e-5);  // 8-bit activations
              }
            }
            for (Isa isa : runnable_isas()) {
              for (bool pairs : {false, true}) {
                const std::vector<float> got = run_gemm(pd::cpu::kernels(isa), w, xq, m, pairs);
                INFO(pd::cpu::isa_name(isa) << " " << pd::ggml_type_name(type)
                                            << (raw ? " random blocks" : " quantized") << " k=" << k << " n=" << n
                                            << " m=" << m << (pairs ? " groups in pairs" : ""));
                CHECK(std::memcmp(got.data(), ref.data(), got.size() * sizeof(float)) == 0);
              }
            }
          }
        }
      }
    }
  }
}

// Two-pass activations (CpuBackendConfig::int8x2_matmul_kinds): x ~ d1*q1 +
// d2*q2, q2 the quantized residual, each pass through the same kernels.
TEST_CASE("two-pass activations: the same bits on every ISA path, error bounded by the second step", "[cpu][kernels]") {
  for (pd::GgmlType type : {pd::GgmlType::kQ4_1, pd::GgmlType::kQ8_0, pd::GgmlType::kQ4_K, pd::GgmlType::kQ6_K}) {
    const int64_t k = is_kquant(type) ? 512 : 576, n = 21, nb = k / 32, ld = (n + 7) / 8 * 8;
    const Weights w = make_weights(type, n, k, 11);
    for (int m : {1, 5}) {
      // One large value per block (as in a transformer's hidden state): with one
      // pass it sets the step of the block's other 31 values.
      std::vector<float> x = random_floats(k * m, 41 + m);
      for (int64_t b = 0; b < m * nb; ++b) x[b * 32 + (b * 7) % 32] *= 60.0f;
      std::vector<BlockQ8A> q1(m * nb), q2(m * nb);
      std::vector<float> res(k * m);
      const pd::cpu::Kernels& scalar = pd::cpu::kernels(Isa::kScalar);
      scalar.quantize_rows(x.data(), k, k, m, q1.data());
      for (int t = 0; t < m; ++t) pd::cpu::quantization_residual(x.data() + t * k, q1.data() + t * nb, k, res.data() + t * k);
      scalar.quantize_rows(res.data(), k, k, m, q2.data());
      const std::vector<float> one = run_gemm(scalar, w, q1, m), second = run_gemm(scalar, w, q2, m);
      double err_one = 0.0, err_two = 0.0;
      for (int t = 0; t < m; ++t) {
        for (int64_t r = 0; r < n; ++r) {
          double want_x = 0.0, bound = 0.0, mag = 0.0;
          for (int64_t j = 0; j < k; ++j) {
            const double wj = w.deq[r * k + j];
            want_x += wj * x[t * k + j];
            bound += std::fabs(wj) * 0.5 * q2[t * nb + j / 32].d;  // half the second step per element
            mag += std::fabs(wj * x[t * k + j]);
          }
          const double two = static_cast<double>(one[t * ld + r]) + second[t * ld + r];
          INFO(pd::ggml_type_name(type) << " m=" << m << " t=" << t << " r=" << r);
          CHECK(std::fabs(two - want_x) <= bound * 1.001 + 1e-5 * mag);
          err_one += std::fabs(one[t * ld + r] - want_x);
          err_two += std::fabs(two - want_x);
        }
      }
      std::printf("two-pass activations, %s m=%d: mean |error| %.3g (one pass %.3g)\n", pd::ggml_type_name(type), m,
                  err_two / (m * n), err_one / (m * n));
      CHECK(err_two * 50 < err_one);
      for (Isa isa : runnable_isas()) {
        const pd::cpu::Kernels& kern = pd::cpu::kernels(isa);
        std::vector<BlockQ8A> g1(m * nb), g2(m * nb);
        std::vector<float> gres(k * m);
        kern.quantize_rows(x.data(), k, k, m, g1.data());
        for (int t = 0; t < m; ++t) pd::cpu::quantization_residual(x.data() + t * k, g1.data() + t * nb, k, gres.data() + t * k);
        kern.quantize_rows(gres.data(), k, k, m, g2.data());
        INFO(pd::cpu::isa_name(isa) << " " << pd::ggml_type_name(type) << " m=" << m);
        CHECK(std::memcmp(g2.data(), q2.data(), q2.size() * sizeof(BlockQ8A)) == 0);
        const std::vector<float> got = run_gemm(kern, w, g2, m);
        CHECK(std::memcmp(got.data(), second.data(), got.size() * sizeof(float)) == 0);
      }
    }
  }
}

TEST_CASE("the VNNI kernels (vpdpbusd emulated), AVX-512 and AVX-VNNI builds, equal the scalar path bit for bit",
          "[cpu][kernels]") {
  if (!pd::cpu::isa_supported(Isa::kAvx2)) pd::test::skip("the emulated VNNI kernels need AVX2, which this CPU lacks");
  pd::cpu::Kernels emulated = pd::cpu::kernels(Isa::kAvx2);
  emulated.gemm_q4x8 = pd::cpu::avx512vnni_gemm_emulated()->gemm_q4x8;
  emulated.gemm_q8x8 = pd::cpu::avx512vnni_gemm_emulated()->gemm_q8x8;
  emulated.gemm_q4x8f = pd::cpu::avx512vnni_gemm_emulated()->gemm_q4x8f;
  emulated.gemm_q8x8h = pd::cpu::avx512vnni_gemm_emulated()->gemm_q8x8h;
  pd::cpu::Kernels emulated_offset = emulated;
  emulated_offset.gemm_q8x8_offset = pd::cpu::avx512vnni_gemm_emulated()->gemm_q8x8_offset;
  emulated_offset.gemm_q8x8h_offset = pd::cpu::avx512vnni_gemm_emulated()->gemm_q8x8h_offset;
  // The 16-row kernels (512-bit vectors, here as two 256-bit halves).
  pd::cpu::Kernels emulated_pairs = emulated_offset;
  emulated_pairs.gemm_q4x8_x2 = pd::cpu::avx512vnni_gemm_emulated()->gemm_q4x8_x2;
  emulated_pairs.gemm_q4x8f_x2 = pd::cpu::avx512vnni_gemm_emulated()->gemm_q4x8f_x2;
  emulated_pairs.gemm_q8x8_offset_x2 = pd::cpu::avx512vnni_gemm_emulated()->gemm_q8x8_offset_x2;
  emulated_pairs.gemm_q8x8h_offset_x2 = pd::cpu::avx512vnni_gemm_emulated()->gemm_q8x8h_offset_x2;
  // The AVX-VNNI build: one group at a time, one integer sum per token in the Q4 kernels.
  const pd::cpu::IntegerGemm& avx = *pd::cpu::avxvnni_gemm_emulated();
  CHECK((avx.gemm_q4x8_x2 == nullptr && avx.gemm_q8x8_offset_x2 == nullptr));
  pd::cpu::Kernels emulated_avx = pd::cpu::kernels(Isa::kAvx2);
  emulated_avx.gemm_q4x8 = avx.gemm_q4x8, emulated_avx.gemm_q8x8 = avx.gemm_q8x8;
  emulated_avx.gemm_q4x8f = avx.gemm_q4x8f, emulated_avx.gemm_q8x8h = avx.gemm_q8x8h;
  emulated_avx.gemm_q8x8_offset = avx.gemm_q8x8_offset, emulated_avx.gemm_q8x8h_offset = avx.gemm_q8x8h_offset;
  for (pd::GgmlType type : kPackedTypes) {
    for (int64_t k : row_lengths(type, true)) {
      const Weights w = make_weights(type, 21, k, 3 * k, /*raw=*/k > 256);
      for (int m : {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 15, 17}) {  // tiles of 4 (one group) and 8 (pairs), every tail
        const std::vector<float> x = random_floats(k * m, 13 + m);
        std::vector<BlockQ8A> xq(m * (k / 32));
        pd::cpu::kernels(Isa::kScalar).quantize_rows(x.data(), k, k, m, xq.data());
        const std::vector<float> ref = run_gemm(pd::cpu::kernels(Isa::kScalar), w, xq, m);
        const std::vector<float> got = run_gemm(emulated, w, xq, m);
        const std::vector<float> got_offset = run_gemm(emulated_offset, w, xq, m);  // the Q8 layouts' offset kernels
        const std::vector<float> got_pairs = run_gemm(emulated_pairs, w, xq, m, /*pairs=*/true);
        const std::vector<float> got_avx = run_gemm(emulated_avx, w, xq, m);
        INFO(pd::ggml_type_name(type) << " k=" << k << " m=" << m);
        CHECK(std::memcmp(got.data(), ref.data(), got.size() * sizeof(float)) == 0);
        CHECK(std::memcmp(got_offset.data(), ref.data(), got.size() * sizeof(float)) == 0);
        CHECK(std::memcmp(got_pairs.data(), ref.data(), got.size() * sizeof(float)) == 0);
        CHECK(std::memcmp(got_avx.data(), ref.data(), got.size() * sizeof(float)) == 0);
      }
    }
  }
}

TEST_CASE("integer gemm is batch invariant: a row's result does not depend on its neighbours", "[cpu][kernels]") {
  for (pd::GgmlType type : kPackedTypes) {
    const int64_t k = is_kquant(type) ? 256 : 192, nb = k / 32;
    const Weights w = make_weights(type, 16, k, 5);
    const int m = 11;
    const std::vector<float> x = random_floats(k * m, 77);
    std::vector<BlockQ8A> xq(m * nb);
    for (Isa isa : runnable_isas()) {
      const pd::cpu::Kernels& kern = pd::cpu::kernels(isa);
      kern.quantize_rows(x.data(), k, k, m, xq.data());
      const std::vector<float> all = run_gemm(kern, w, xq, m);
      for (int t = 0; t < m; ++t) {
        std::vector<BlockQ8A> one(xq.begin() + t * nb, xq.begin() + (t + 1) * nb);
        const std::vector<float> alone = run_gemm(kern, w, one, 1);
        INFO(pd::cpu::isa_name(isa) << " " << pd::ggml_type_name(type) << " token " << t);
        CHECK(std::memcmp(alone.data(), all.data() + t * 16, 16 * sizeof(float)) == 0);
      }
    }
  }
}

TEST_CASE("dispatch: best_isa is a runnable path and names itself", "[cpu][kernels]") {
  const Isa best = pd::cpu::best_isa();
  CHECK(pd::cpu::isa_supported(best));
  CHECK(std::string(pd::cpu::isa_name(best)).size() > 0);
  CHECK(pd::cpu::isa_supported(Isa::kScalar));
}

// Attention runs many query rows through one kernel call (a prefill tile) or
// few (a decode token): a row's scores and sums must not depend on which.
TEST_CASE("attention kernels: a row's bits do not depend on the rows or keys beside it, nor on the ISA path",
          "[cpu][kernels]") {
  const pd::cpu::Kernels& scalar = pd::cpu::kernels(Isa::kScalar);
  std::vector<std::pair<std::string, pd::cpu::Kernels>> paths;
  for (Isa isa : runnable_isas()) paths.emplace_back(pd::cpu::isa_name(isa), pd::cpu::kernels(isa));
  if (pd::cpu::isa_supported(Isa::kAvx2) && pd::cpu::attention_avx2_16_registers()) {
    pd::cpu::Kernels k = pd::cpu::kernels(Isa::kAvx2);
    k.qk_scores = pd::cpu::attention_avx2_16_registers()->qk_scores;
    k.pv_accumulate = pd::cpu::attention_avx2_16_registers()->pv_accumulate;
    paths.emplace_back("avx2 (16 registers)", k);
  }
  for (const auto& [name, kern] : paths) {
    for (int64_t hd : {8, 64, 72, 136}) {
      for (int nr : {1, 2, 3, 5, 7}) {
        for (int n : {1, 5, 8, 13, 64}) {
          INFO(name << " hd=" << hd << " rows=" << nr << " keys=" << n);
          const std::vector<float> q = random_floats(nr * hd, 10 + nr + hd), k = random_floats(n * hd, 20 + n);
          const F32Rows kr(k.data(), n, hd);
          const int64_t stride = n + 3;  // rows of scores further apart than n
          std::vector<float> s(nr * stride, -1.0f), want(nr * stride, -1.0f);
          kern.qk_scores(q.data(), hd, nr, kr.at(), hd, n, 0.125f, s.data(), stride);
          scalar.qk_scores(q.data(), hd, nr, kr.at(), hd, n, 0.125f, want.data(), stride);
          CHECK(std::memcmp(s.data(), want.data(), s.size() * sizeof(float)) == 0);
          for (int i = 0; i < nr; ++i) {  // each row alone, and its keys in two calls
            std::vector<float> one(n);
            kern.qk_scores(q.data() + i * hd, hd, 1, kr.at(), hd, n, 0.125f, one.data(), n);
            CHECK(std::memcmp(one.data(), s.data() + i * stride, n * sizeof(float)) == 0);
            const int half = n / 2;
            kern.qk_scores(q.data() + i * hd, hd, 1, kr.at(half), hd, n - half, 0.125f, one.data() + half, n);
            CHECK(std::memcmp(one.data(), s.data() + i * stride, n * sizeof(float)) == 0);
          }
          // Values: each row its own number of keys (0 included) and factor.
          const std::vector<float> p = random_floats(nr * stride, 30 + nr), v = random_floats(n * hd, 40 + n);
          const F32Rows vr(v.data(), n, hd);
          const std::vector<float> acc0 = random_floats(nr * hd, 50 + nr);
          std::vector<int> counts(nr);
          std::vector<float> c(nr);
          for (int i = 0; i < nr; ++i) counts[i] = std::max(0, (n * (i + 1)) / nr - (i % 3 == 2 ? 1 : 0)), c[i] = 0.5f + 0.1f * i;
          std::vector<float> acc = acc0, acc_want = acc0;
          kern.pv_accumulate(p.data(), stride, nr, counts.data(), c.data(), vr.at(), hd, acc.data(), hd);
          scalar.pv_accumulate(p.data(), stride, nr, counts.data(), c.data(), vr.at(), hd, acc_want.data(), hd);
          CHECK(std::memcmp(acc.data(), acc_want.data(), acc.size() * sizeof(float)) == 0);
          for (int i = 0; i < nr; ++i) {
            std::vector<float> one(acc0.begin() + i * hd, acc0.begin() + (i + 1) * hd);
            kern.pv_accumulate(p.data() + i * stride, stride, 1, &counts[i], &c[i], vr.at(), hd, one.data(), hd);
            CHECK(std::memcmp(one.data(), acc.data() + i * hd, hd * sizeof(float)) == 0);
          }
          // K and V rows stored as the KV cache stores them, read in place:
          // the same bits as their values widened to fp32 first, here and
          // on the scalar path.
          for (const pd::GgmlType t : {pd::GgmlType::kF16, pd::GgmlType::kQ8_0}) {
            if (t == pd::GgmlType::kQ8_0 && hd % 32 != 0) continue;  // q8_0 rows are whole blocks
            INFO("rows stored as " << pd::ggml_type_name(t));
            const StoredRows ks(t, k.data(), n, hd), vs(t, v.data(), n, hd);
            const F32Rows kw(ks.widened.data(), n, hd), vw(vs.widened.data(), n, hd);
            std::vector<float> s_in(nr * stride, -1.0f), s_wide(nr * stride, -1.0f), s_scalar(nr * stride, -1.0f);
            kern.qk_scores(q.data(), hd, nr, ks.at(), hd, n, 0.125f, s_in.data(), stride);
            kern.qk_scores(q.data(), hd, nr, kw.at(), hd, n, 0.125f, s_wide.data(), stride);
            scalar.qk_scores(q.data(), hd, nr, ks.at(), hd, n, 0.125f, s_scalar.data(), stride);
            CHECK(std::memcmp(s_in.data(), s_wide.data(), s_in.size() * sizeof(float)) == 0);
            CHECK(std::memcmp(s_in.data(), s_scalar.data(), s_in.size() * sizeof(float)) == 0);
            std::vector<float> a_in = acc0, a_wide = acc0, a_scalar = acc0;
            kern.pv_accumulate(p.data(), stride, nr, counts.data(), c.data(), vs.at(), hd, a_in.data(), hd);
            kern.pv_accumulate(p.data(), stride, nr, counts.data(), c.data(), vw.at(), hd, a_wide.data(), hd);
            scalar.pv_accumulate(p.data(), stride, nr, counts.data(), c.data(), vs.at(), hd, a_scalar.data(), hd);
            CHECK(std::memcmp(a_in.data(), a_wide.data(), a_in.size() * sizeof(float)) == 0);
            CHECK(std::memcmp(a_in.data(), a_scalar.data(), a_in.size() * sizeof(float)) == 0);
          }
        }
      }
    }
  }
}

TEST_CASE("attention and activation kernels equal plain double arithmetic on every ISA path", "[cpu][kernels]") {
  for (Isa isa : runnable_isas()) {
    const pd::cpu::Kernels& kern = pd::cpu::kernels(isa);
    for (int64_t hd : {8, 64, 72, 136}) {
      for (int n : {1, 3, 4, 7, 16, 17}) {  // the 4-key groups, the 8-lane exp and every tail
        INFO(pd::cpu::isa_name(isa) << " hd=" << hd << " n=" << n);
        const std::vector<float> q = random_floats(hd, 1 + hd), k = random_floats(hd * n, 2 + n);
        const float scale = 0.125f;
        std::vector<float> s(n);
        kern.qk_scores(q.data(), hd, 1, F32Rows(k.data(), n, hd).at(), hd, n, scale, s.data(), n);
        for (int r = 0; r < n; ++r) {
          double dot = 0, mag = 0;
          for (int64_t j = 0; j < hd; ++j) {
            dot += static_cast<double>(q[j]) * k[r * hd + j];
            mag += std::fabs(static_cast<double>(q[j]) * k[r * hd + j]);
          }
          CHECK(std::fabs(s[r] - dot * scale) <= 1e-6 * mag * scale + 1e-7);
        }
        // One softmax step over the scores (one far below the rest, which
        // underflows to nearly 0) from a running max m0 and sum l0.
        std::vector<float> e(s);
        e[0] -= 200.0f;
        const std::vector<float> e_in = e;
        for (const float m0 : {-std::numeric_limits<float>::infinity(), 0.5f}) {
          e = e_in;
          float m = m0, l = 2.0f, c = -1.0f;
          kern.softmax_step(e.data(), n, 1, &n, &m, &l, &c);
          const float mx = std::max(m0, *std::max_element(e_in.begin(), e_in.end()));
          CHECK(m == mx);
          const double want_c = std::exp(static_cast<double>(m0 - mx));
          CHECK(std::fabs(c - want_c) <= 2e-7 * want_c + 1e-37);
          double want_sum = 0;
          for (int r = 0; r < n; ++r) {
            const float x = e_in[r] - mx;  // the kernel exponentiates this float difference
            const double want = std::exp(static_cast<double>(x));
            want_sum += want;
            CHECK(std::fabs(e[r] - want) <= 2e-7 * want + 1e-37);
          }
          const double want_l = 2.0 * c + want_sum;
          CHECK(std::fabs(l - want_l) <= 1e-6 * want_l + 1e-37);
        }
        // A row with no scores this step is left alone, with c = 1.
        {
          const int zero = 0;
          float m = 0.25f, l = 3.0f, c = -1.0f;
          kern.softmax_step(e.data(), n, 1, &zero, &m, &l, &c);
          CHECK((m == 0.25f && l == 3.0f && c == 1.0f));
        }
        // acc = acc * c + sum p[r] v[r]
        const std::vector<float> v = random_floats(hd * n, 3 + n), acc0 = random_floats(hd, 4);
        std::vector<float> acc = acc0;
        const float c = 0.75f;
        kern.pv_accumulate(e.data(), n, 1, &n, &c, F32Rows(v.data(), n, hd).at(), hd, acc.data(), hd);
        for (int64_t j = 0; j < hd; ++j) {
          double want = 0.75 * acc0[j], mag = std::fabs(want);
          for (int r = 0; r < n; ++r) {
            want += static_cast<double>(e[r]) * v[r * hd + j];
            mag += std::fabs(static_cast<double>(e[r]) * v[r * hd + j]);
          }
          CHECK(std::fabs(acc[j] - want) <= 1e-6 * mag + 1e-7);
        }
      }
    }
    for (int64_t n : {1, 7, 8, 9, 100}) {
      std::vector<float> g = random_floats(n, 5 + n, 4.0f), u = random_floats(n, 6 + n), o(n);
      if (n > 2) g[1] = 100.0f, g[2] = -100.0f;  // saturating ends of the exp range
      kern.silu_mul(g.data(), u.data(), n, o.data());
      for (int64_t i = 0; i < n; ++i) {
        const double want = g[i] / (1.0 + std::exp(-static_cast<double>(g[i]))) * u[i];
        INFO(pd::cpu::isa_name(isa) << " silu n=" << n << " i=" << i << " g=" << g[i]);
        CHECK(std::fabs(o[i] - want) <= 1e-6 * std::fabs(want) + 1e-30);
      }
    }
  }
}

TEST_CASE("exp_approx stays within 2e-7 relative error over the softmax range", "[cpu][kernels]") {
  for (float x = -87.0f; x <= 88.0f; x += 0.0137f) {
    const double want = std::exp(static_cast<double>(x));
    INFO("x=" << x);
    REQUIRE(std::fabs(pd::cpu::exp_approx(x) - want) <= 2e-7 * want);
  }
  CHECK(pd::cpu::exp_approx(-1e30f) < 1e-37f);  // clamped: exp(-inf) ~ 0, never NaN
  CHECK(pd::cpu::exp_approx(-std::numeric_limits<float>::infinity()) < 1e-37f);
}
