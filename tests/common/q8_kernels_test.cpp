// The integer matmul kernels (backend/cpu/q8_kernels.h) against plain scalar
// arithmetic written here: dequantize with gguf/ggml_types, dot in double.
// Every instruction-set path this machine runs is checked, and each must
// equal the portable path bit for bit.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <random>
#include <vector>

#include "backend/cpu/q8_kernels.h"
#include "gguf/ggml_types.h"

namespace {

using pd::cpu::BlockQ8A;
using pd::cpu::Isa;

std::vector<float> random_floats(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

std::vector<Isa> runnable_isas() {
  std::vector<Isa> out{Isa::kScalar};
  if (pd::cpu::isa_supported(Isa::kAvx2))
    out.push_back(Isa::kAvx2);
  else
    std::printf("note: this CPU cannot run the AVX2 kernels; only the scalar path is tested\n");
  return out;
}

// A quantized weight matrix in ggml rows, its dequantized values, and its packing.
struct Weights {
  pd::GgmlType type;
  int64_t n, k;
  std::vector<uint8_t> rows;
  std::vector<float> deq;
  std::vector<uint8_t> packed;
};

Weights make_weights(pd::GgmlType type, int64_t n, int64_t k, uint64_t seed) {
  Weights w{type, n, k, {}, {}, {}};
  const size_t row_bytes = pd::ggml_row_bytes(type, k);
  w.rows.resize(row_bytes * n);
  w.deq.resize(n * k);
  const std::vector<float> f = random_floats(n * k, seed, 0.5f);
  for (int64_t r = 0; r < n; ++r) {
    pd::quantize_row(type, f.data() + r * k, w.rows.data() + r * row_bytes, k);
    pd::dequantize_row(type, w.rows.data() + r * row_bytes, w.deq.data() + r * k, k);
  }
  const auto fmt = pd::cpu::packed_format_for(type);
  w.packed.resize(pd::cpu::packed_bytes(fmt, n, k));
  REQUIRE(pd::cpu::pack_rows(type, w.rows.data(), n, k, w.packed.data()));
  return w;
}

// Runs every group of the packed matrix against m quantized rows.
std::vector<float> run_gemm(const pd::cpu::Kernels& kern, const Weights& w, const std::vector<BlockQ8A>& xq, int m) {
  const auto fmt = pd::cpu::packed_format_for(w.type);
  const int64_t nb = w.k / pd::cpu::kQBlock, groups = (w.n + 7) / 8;
  std::vector<float> out(m * groups * 8, -1.0f);
  const size_t gb = pd::cpu::packed_group_bytes(fmt, w.k);
  for (int64_t g = 0; g < groups; ++g) {
    const void* grp = w.packed.data() + g * gb;
    if (pd::cpu::is_q4x8(fmt))
      kern.gemm_q4x8(static_cast<const pd::cpu::PackedQ4x8*>(grp), nb, xq.data(), m, out.data() + g * 8, groups * 8);
    else
      kern.gemm_q8x8(static_cast<const pd::cpu::PackedQ8x8*>(grp), nb, xq.data(), m, out.data() + g * 8, groups * 8);
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

TEST_CASE("packing moves bytes only: unpacked rows equal the ggml dequantization", "[cpu][kernels]") {
  for (pd::GgmlType type : {pd::GgmlType::kQ4_0, pd::GgmlType::kQ4_1, pd::GgmlType::kQ8_0}) {
    for (int64_t n : {8, 13, 1}) {  // whole groups, a padded tail, a lone row
      const Weights w = make_weights(type, n, 96, 3 + n);
      std::vector<float> row(96);
      for (int64_t r = 0; r < n; ++r) {
        pd::cpu::unpack_row(pd::cpu::packed_format_for(type), w.packed.data(), 96, r, row.data());
        INFO(pd::ggml_type_name(type) << " n=" << n << " row " << r);
        CHECK(std::memcmp(row.data(), w.deq.data() + r * 96, 96 * sizeof(float)) == 0);
      }
    }
  }
  CHECK(pd::cpu::packed_format_for(pd::GgmlType::kF16) == pd::cpu::PackedFormat::kNone);
}

TEST_CASE("integer gemm equals the scalar dot of the dequantized operands on every ISA path", "[cpu][kernels]") {
  for (pd::GgmlType type : {pd::GgmlType::kQ4_0, pd::GgmlType::kQ4_1, pd::GgmlType::kQ8_0}) {
    for (int64_t k : {32, 96, 608}) {
      for (int64_t n : {8, 21}) {
        const Weights w = make_weights(type, n, k, 7 * k + n);
        for (int m : {1, 2, 3, 4, 5, 7, 9}) {  // full token tiles of 4 and every tail
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
              INFO(pd::ggml_type_name(type) << " k=" << k << " n=" << n << " m=" << m << " t=" << t << " r=" << r);
              CHECK(std::fabs(ref[t * ld + r] - want) <= 1e-5 * mag + 1e-6);
              CHECK(std::fabs(ref[t * ld + r] - want_x) <= 0.02 * mag + 1e-5);  // 8-bit activations
            }
          }
          for (Isa isa : runnable_isas()) {
            const std::vector<float> got = run_gemm(pd::cpu::kernels(isa), w, xq, m);
            INFO(pd::cpu::isa_name(isa) << " " << pd::ggml_type_name(type) << " k=" << k << " n=" << n
                                        << " m=" << m);
            CHECK(std::memcmp(got.data(), ref.data(), got.size() * sizeof(float)) == 0);
          }
        }
      }
    }
  }
}

TEST_CASE("integer gemm is batch invariant: a row's result does not depend on its neighbours", "[cpu][kernels]") {
  const Weights w = make_weights(pd::GgmlType::kQ4_1, 16, 192, 5);
  const int m = 11;
  const std::vector<float> x = random_floats(192 * m, 77);
  std::vector<BlockQ8A> xq(m * 6);
  for (Isa isa : runnable_isas()) {
    const pd::cpu::Kernels& kern = pd::cpu::kernels(isa);
    kern.quantize_rows(x.data(), 192, 192, m, xq.data());
    const std::vector<float> all = run_gemm(kern, w, xq, m);
    for (int t = 0; t < m; ++t) {
      std::vector<BlockQ8A> one(xq.begin() + t * 6, xq.begin() + (t + 1) * 6);
      const std::vector<float> alone = run_gemm(kern, w, one, 1);
      INFO(pd::cpu::isa_name(isa) << " token " << t);
      CHECK(std::memcmp(alone.data(), all.data() + t * 16, 16 * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("dispatch: best_isa is a runnable path and names itself", "[cpu][kernels]") {
  const Isa best = pd::cpu::best_isa();
  CHECK(pd::cpu::isa_supported(best));
  CHECK(std::string(pd::cpu::isa_name(best)).size() > 0);
  CHECK(pd::cpu::isa_supported(Isa::kScalar));
}
