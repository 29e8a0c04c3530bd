// CPU kernels against a plain scalar computation: dequantize with the
// reference conversion (gguf/ggml_types), dot in double.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "backend/cpu/cpu_kernels.h"
#include "gguf/ggml_types.h"
#include "test_support.h"

using pd::test::random_floats;

TEST_CASE("dot_row_multi equals dequantize-then-dot for every weight type and batch size", "[cpu][kernels]") {
  const pd::GgmlType types[] = {pd::GgmlType::kQ4_0, pd::GgmlType::kQ4_1, pd::GgmlType::kQ8_0,
                                pd::GgmlType::kF16,  pd::GgmlType::kBF16, pd::GgmlType::kF32};
  for (pd::GgmlType type : types) {
    for (int64_t k : {32, 64, 96, 608}) {
      const std::vector<float> w = random_floats(k, 17 + k);
      std::vector<uint8_t> packed(pd::ggml_row_bytes(type, k));
      pd::quantize_row(type, w.data(), packed.data(), k);
      std::vector<float> wq(k);
      pd::dequantize_row(type, packed.data(), wq.data(), k);
      for (int m : {1, 2, 3, 7, 9}) {
        const int64_t stride = k + 5;  // inputs not packed back to back
        const std::vector<float> x = random_floats(stride * m, 99 + m);
        std::vector<float> acc(m, 0.25f);  // accumulates onto existing values
        pd::cpu::dot_row_multi(type, packed.data(), k, x.data(), stride, m, acc.data());
        for (int i = 0; i < m; ++i) {
          double want = 0.25, mag = 0.0;
          for (int64_t j = 0; j < k; ++j) {
            want += static_cast<double>(wq[j]) * x[i * stride + j];
            mag += std::fabs(static_cast<double>(wq[j]) * x[i * stride + j]);
          }
          INFO(pd::ggml_type_name(type) << " k=" << k << " m=" << m << " row " << i);
          CHECK(std::fabs(acc[i] - want) <= 1e-5 * mag + 1e-6);
        }
      }
    }
  }
}

TEST_CASE("dequant_row equals the reference dequantization exactly", "[cpu][kernels]") {
  for (pd::GgmlType type : {pd::GgmlType::kQ4_0, pd::GgmlType::kQ4_1, pd::GgmlType::kQ8_0, pd::GgmlType::kF16,
                            pd::GgmlType::kBF16, pd::GgmlType::kF32}) {
    const int64_t k = 160;
    const std::vector<float> w = random_floats(k, 5, 3.0f);
    std::vector<uint8_t> packed(pd::ggml_row_bytes(type, k));
    pd::quantize_row(type, w.data(), packed.data(), k);
    std::vector<float> want(k), got(k);
    pd::dequantize_row(type, packed.data(), want.data(), k);
    pd::cpu::dequant_row(type, packed.data(), k, got.data());
    INFO(pd::ggml_type_name(type));
    CHECK(got == want);
  }
}

// The matmul's fast path runs weight rows in groups; the cluster's token
// identity needs that to change nothing: bit-identical to one row at a time,
// for full groups, partial groups, every type and input counts across tiles.
TEST_CASE("dot_rows_grouped is bit-identical to dot_row_multi per row", "[cpu][kernels]") {
  const pd::GgmlType types[] = {pd::GgmlType::kQ4_0, pd::GgmlType::kQ4_1, pd::GgmlType::kQ8_0, pd::GgmlType::kF16,
                                pd::GgmlType::kF32};
  for (pd::GgmlType type : types) {
    const int64_t k = 160;
    const size_t rb = pd::ggml_row_bytes(type, k);
    std::vector<uint8_t> packed(rb * pd::cpu::kDotGroupRows);
    for (int r = 0; r < pd::cpu::kDotGroupRows; ++r) {
      const std::vector<float> w = random_floats(k, 300 + r);
      pd::quantize_row(type, w.data(), packed.data() + r * rb, k);
    }
    for (int n_rows : {pd::cpu::kDotGroupRows, 3, 1}) {
      for (int m : {1, 5, 8, 9, 17, 64}) {
        const std::vector<float> x = random_floats(static_cast<size_t>(k * m), 7 + m);
        const void* rows[pd::cpu::kDotGroupRows];
        for (int r = 0; r < n_rows; ++r) rows[r] = packed.data() + r * rb;
        std::vector<float> grouped(static_cast<size_t>(n_rows) * 64, 0.0f), single(grouped.size(), 0.0f);
        pd::cpu::dot_rows_grouped(type, rows, n_rows, k, x.data(), k, m, grouped.data(), 64);
        for (int r = 0; r < n_rows; ++r) pd::cpu::dot_row_multi(type, rows[r], k, x.data(), k, m, single.data() + r * 64);
        INFO(pd::ggml_type_name(type) << " rows " << n_rows << " m " << m);
        CHECK(grouped == single);
      }
    }
  }
}
