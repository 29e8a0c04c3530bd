// ggml type traits and conversions: fp16/bf16 rounding, quantizer error bounds,
// and bit-exact block layouts against hand-computed values.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <limits>
#include <random>
#include <vector>

#include "gguf/ggml_types.h"

namespace pd {
namespace {

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
[[maybe_unused]] uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

std::vector<float> random_floats(size_t n, uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>((static_cast<double>(rng() >> 11) * 0x1.0p-53 * 2.0 - 1.0) * scale);
  return v;
}

}  // namespace

TEST_CASE("ggml type traits match ggml", "[ggml]") {
  CHECK(ggml_traits(GgmlType::kF32).block_bytes == 4);
  CHECK(ggml_traits(GgmlType::kF16).block_bytes == 2);
  CHECK(ggml_traits(GgmlType::kBF16).block_bytes == 2);
  CHECK(ggml_traits(GgmlType::kQ4_0).block_bytes == 18);
  CHECK(ggml_traits(GgmlType::kQ4_1).block_bytes == 20);
  CHECK(ggml_traits(GgmlType::kQ8_0).block_bytes == 34);
  CHECK(ggml_traits(GgmlType::kQ8_0).block_elems == 32);
  CHECK(ggml_traits(GgmlType::kQ4_1).quantized);
  CHECK_FALSE(ggml_traits(GgmlType::kBF16).quantized);
  CHECK(std::string(ggml_type_name(GgmlType::kQ4_1)) == "Q4_1");
  CHECK(ggml_row_bytes(GgmlType::kQ4_1, 64) == 40);
  CHECK(ggml_row_bytes(GgmlType::kF16, 7) == 14);

  CHECK(ggml_type_traits(8)->type == GgmlType::kQ8_0);
  CHECK(ggml_type_traits(30)->type == GgmlType::kBF16);
  CHECK(ggml_type_traits(13)->type == GgmlType::kQ5_K);
  CHECK(ggml_type_traits(14)->block_elems == 256);
  CHECK_FALSE(ggml_type_traits(10).has_value());  // Q2_K
  CHECK_FALSE(ggml_type_traits(4).has_value());
  CHECK(ggml_raw_type_name(6) == "Q5_0");
  CHECK(ggml_raw_type_name(7) == "Q5_1");
  CHECK(ggml_raw_type_name(9) == "Q8_1");
  CHECK(ggml_raw_type_name(10) == "Q2_K");
  CHECK(ggml_raw_type_name(13) == "Q5_K");
  CHECK(ggml_raw_type_name(15) == "Q8_K");
  CHECK(ggml_raw_type_name(16) == "IQ2_XXS");
  CHECK(ggml_raw_type_name(24) == "I8");
  CHECK(ggml_raw_type_name(28) == "F64");
  CHECK(ggml_raw_type_name(29) == "IQ1_M");
  CHECK(ggml_raw_type_name(30) == "BF16");
  CHECK(ggml_raw_type_name(34) == "TQ1_0");
  CHECK(ggml_raw_type_name(35) == "TQ2_0");
  CHECK(ggml_raw_type_name(39) == "MXFP4");
  CHECK(ggml_raw_type_name(99) == "type 99");
}

TEST_CASE("fp16 conversion is exact and rounds to nearest even", "[ggml]") {
  CHECK(fp32_to_fp16(1.0f) == 0x3C00);
  CHECK(fp32_to_fp16(-2.0f) == 0xC000);
  CHECK(fp32_to_fp16(0.0f) == 0x0000);
  CHECK(fp32_to_fp16(-0.0f) == 0x8000);
  CHECK(fp32_to_fp16(65504.0f) == 0x7BFF);
  CHECK(fp32_to_fp16(65519.0f) == 0x7BFF);
  CHECK(fp32_to_fp16(65520.0f) == 0x7C00);  // halfway to 65536 rounds to even = inf
  CHECK(fp32_to_fp16(1e10f) == 0x7C00);
  CHECK(fp32_to_fp16(std::numeric_limits<float>::infinity()) == 0x7C00);
  CHECK(fp32_to_fp16(-std::numeric_limits<float>::infinity()) == 0xFC00);
  CHECK(fp32_to_fp16(std::numeric_limits<float>::quiet_NaN()) == 0x7E00);
  CHECK((fp32_to_fp16(-std::numeric_limits<float>::quiet_NaN()) & 0x7FFF) == 0x7E00);
  // Normal ties: 1 + 2^-11 is halfway between 1 and 1 + 2^-10.
  CHECK(fp32_to_fp16(1.0f + 0x1.0p-11f) == 0x3C00);
  CHECK(fp32_to_fp16(1.0f + 3 * 0x1.0p-11f) == 0x3C02);
  CHECK(fp32_to_fp16(1.0f + 0x1.0p-11f + 0x1.0p-20f) == 0x3C01);
  // Subnormals: unit 2^-24.
  CHECK(fp32_to_fp16(0x1.0p-14f) == 0x0400);  // smallest normal
  CHECK(fp32_to_fp16(0x1.0p-24f) == 0x0001);
  CHECK(fp32_to_fp16(0x1.0p-25f) == 0x0000);        // tie -> even (0)
  CHECK(fp32_to_fp16(0x1.8p-25f) == 0x0001);        // 0.75 units
  CHECK(fp32_to_fp16(3 * 0x1.0p-25f) == 0x0002);    // 1.5 units -> 2
  CHECK(fp32_to_fp16(5 * 0x1.0p-25f) == 0x0002);    // 2.5 units -> 2
  CHECK(fp32_to_fp16(-0x1.0p-24f) == 0x8001);
  CHECK(fp32_to_fp16(0x1.ff8p-15f) == 0x03FF);      // largest subnormal, 1023 units
  CHECK(fp32_to_fp16(0x1.ffcp-15f) == 0x0400);      // 1023.5 units: tie -> even, into the normals
  CHECK(fp32_to_fp16(1e-30f) == 0x0000);
  CHECK(fp32_to_fp16(from_bits(0x00000001)) == 0x0000);  // fp32 subnormal

  CHECK(fp16_to_fp32(0x0001) == 0x1.0p-24f);
  CHECK(fp16_to_fp32(0x03FF) == 0x1.ff8p-15f);
  CHECK(fp16_to_fp32(0x8000) == 0.0f);
  CHECK(std::signbit(fp16_to_fp32(0x8000)));
  CHECK(std::isinf(fp16_to_fp32(0x7C00)));
  CHECK(std::isnan(fp16_to_fp32(0x7E00)));
  CHECK(std::isnan(fp16_to_fp32(0x7C01)));

  // Every fp16 value survives fp16 -> fp32 -> fp16 (NaNs stay NaN).
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = fp16_to_fp32(static_cast<uint16_t>(h));
    if ((h & 0x7C00) == 0x7C00 && (h & 0x3FF) != 0) {
      REQUIRE(std::isnan(f));
      REQUIRE(std::isnan(fp16_to_fp32(fp32_to_fp16(f))));
    } else {
      REQUIRE(fp32_to_fp16(f) == h);
    }
  }
}

#if defined(__FLT16_MAX__)
TEST_CASE("fp16 conversion agrees with the compiler _Float16 type", "[ggml]") {
  std::mt19937_64 rng(7);
  for (int i = 0; i < 200000; ++i) {
    // Mostly values near fp16's range, plus arbitrary bit patterns.
    const uint32_t bits = (i % 4 == 0) ? static_cast<uint32_t>(rng())
                                       : (static_cast<uint32_t>(rng()) & 0x87FFFFFFu) | 0x30000000u;
    const float f = from_bits(bits);
    if (std::isnan(f)) continue;
    const _Float16 h = static_cast<_Float16>(f);
    uint16_t hb;
    std::memcpy(&hb, &h, 2);
    INFO("bits 0x" << std::hex << bits);
    REQUIRE(fp32_to_fp16(f) == hb);
    REQUIRE(to_bits(fp16_to_fp32(hb)) == to_bits(static_cast<float>(h)));
  }
}
#endif

TEST_CASE("bf16 conversion rounds to nearest even", "[ggml]") {
  CHECK(fp32_to_bf16(1.0f) == 0x3F80);
  CHECK(fp32_to_bf16(from_bits(0x3F808000)) == 0x3F80);  // tie -> even
  CHECK(fp32_to_bf16(from_bits(0x3F818000)) == 0x3F82);  // tie -> even (up)
  CHECK(fp32_to_bf16(from_bits(0x3F808001)) == 0x3F81);
  CHECK(fp32_to_bf16(std::numeric_limits<float>::infinity()) == 0x7F80);
  CHECK(fp32_to_bf16(-std::numeric_limits<float>::infinity()) == 0xFF80);
  CHECK(fp32_to_bf16(std::numeric_limits<float>::max()) == 0x7F80);  // rounds up to inf
  CHECK(std::isnan(bf16_to_fp32(fp32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  // A signalling NaN whose payload lies only in the low bits stays a NaN.
  CHECK(std::isnan(bf16_to_fp32(fp32_to_bf16(from_bits(0x7F800001)))));
  CHECK(fp32_to_bf16(from_bits(0x00010000)) == 0x0001);  // subnormal kept
  CHECK(bf16_to_fp32(0x0001) == from_bits(0x00010000));
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = bf16_to_fp32(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      REQUIRE(std::isnan(bf16_to_fp32(fp32_to_bf16(f))));
    } else {
      REQUIRE(fp32_to_bf16(f) == h);
    }
  }
}

TEST_CASE("quantize then dequantize stays within the error bound of each type", "[ggml]") {
  constexpr int64_t n = 32 * 256;
  // Scales keep every block's fp16 scale normal (subnormal scales lose relative precision,
  // in ggml too).
  for (float scale : {0.02f, 1.0f, 300.0f}) {
    const std::vector<float> x = random_floats(n, 42, scale);
    for (GgmlType type : {GgmlType::kF32, GgmlType::kF16, GgmlType::kBF16, GgmlType::kQ4_0, GgmlType::kQ4_1,
                          GgmlType::kQ8_0}) {
      INFO("type " << ggml_type_name(type) << " scale " << scale);
      std::vector<uint8_t> q(ggml_row_bytes(type, n));
      std::vector<float> y(n);
      quantize_row(type, x.data(), q.data(), n);
      dequantize_row(type, q.data(), y.data(), n);
      double sq_err = 0, sq_x = 0;
      for (int64_t b = 0; b < n / 32; ++b) {
        float mn = x[b * 32], mx = x[b * 32], amax = 0;
        for (int j = 0; j < 32; ++j) {
          const float v = x[b * 32 + j];
          mn = std::min(mn, v);
          mx = std::max(mx, v);
          amax = std::max(amax, std::fabs(v));
        }
        for (int j = 0; j < 32; ++j) {
          const float v = x[b * 32 + j];
          const float err = std::fabs(y[b * 32 + j] - v);
          sq_err += double(err) * err;
          sq_x += double(v) * v;
          float bound = 0;
          switch (type) {
            case GgmlType::kF32: bound = 0; break;
            case GgmlType::kF16: bound = std::fabs(v) * 0x1.0p-11f + 0x1.0p-25f; break;  // + subnormal step
            case GgmlType::kBF16: bound = std::fabs(v) * 0x1.0p-8f; break;
            // half a step, plus the fp16 rounding of the scale (<= 2^-11 relative, times 127).
            case GgmlType::kQ8_0: bound = amax / 127 * 0.5f + amax * 0x1.0p-10f; break;
            // the step is amax/8; the largest magnitude of the opposite sign is clamped to 7 steps.
            case GgmlType::kQ4_0: bound = amax / 8 + amax * 0x1.0p-9f; break;
            case GgmlType::kQ4_1:
              bound = (mx - mn) / 15 * 0.5f + (std::fabs(mn) + std::fabs(mx)) * 0x1.0p-9f;
              break;
            default: FAIL("no bound for this type"); break;
          }
          REQUIRE(err <= bound);
        }
      }
      // Relative RMS error: a regression guard beyond the per-element bound.
      const double rel = std::sqrt(sq_err / sq_x);
      const double max_rel = type == GgmlType::kF32    ? 0.0
                             : type == GgmlType::kF16  ? 1e-3
                             : type == GgmlType::kBF16 ? 5e-3
                             : type == GgmlType::kQ8_0 ? 1e-2
                                                       : 0.12;
      CHECK(rel <= max_rel);
    }
  }
}

TEST_CASE("quantizers handle constant and zero and non-finite blocks without UB", "[ggml]") {
  std::vector<float> zeros(32, 0.0f), consts(32, 3.0f), weird(32, 1.0f);
  weird[3] = std::numeric_limits<float>::quiet_NaN();
  weird[5] = std::numeric_limits<float>::infinity();
  for (GgmlType type : {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ8_0}) {
    std::vector<uint8_t> q(ggml_row_bytes(type, 32));
    std::vector<float> y(32);
    quantize_row(type, zeros.data(), q.data(), 32);
    dequantize_row(type, q.data(), y.data(), 32);
    for (float v : y) CHECK(v == 0.0f);
    quantize_row(type, consts.data(), q.data(), 32);
    dequantize_row(type, q.data(), y.data(), 32);
    for (float v : y) CHECK(v == Approx(3.0f).epsilon(1e-3));
    quantize_row(type, weird.data(), q.data(), 32);  // must not trap; values unspecified
    dequantize_row(type, q.data(), y.data(), 32);
  }
}

TEST_CASE("Q4_0 block layout is bit-exact with ggml", "[ggml]") {
  BlockQ4_0 b{};
  b.d = fp32_to_fp16(0.5f);
  REQUIRE(b.d == 0x3800);
  for (int j = 0; j < 16; ++j) b.qs[j] = static_cast<uint8_t>(j | ((15 - j) << 4));
  uint8_t bytes[18];
  std::memcpy(bytes, &b, 18);
  CHECK(bytes[0] == 0x00);
  CHECK(bytes[1] == 0x38);
  CHECK(bytes[2] == 0xF0);  // element 0 = low nibble 0, element 16 = high nibble 15
  float y[32];
  dequantize_row(GgmlType::kQ4_0, bytes, y, 32);
  for (int j = 0; j < 16; ++j) {
    CHECK(y[j] == (j - 8) * 0.5f);
    CHECK(y[j + 16] == (7 - j) * 0.5f);
  }
  // The reference quantizer on grid values: max-magnitude element -8 gives d = 1.
  float x[32];
  for (int j = 0; j < 32; ++j) x[j] = static_cast<float>((j * 5) % 16 - 8);  // in [-8, 7], has -8
  BlockQ4_0 q{};
  quantize_row(GgmlType::kQ4_0, x, &q, 32);
  CHECK(q.d == 0x3C00);  // 1.0 = -8 / -8
  for (int j = 0; j < 16; ++j) {
    CHECK((q.qs[j] & 0xF) == static_cast<int>(x[j]) + 8);
    CHECK((q.qs[j] >> 4) == static_cast<int>(x[j + 16]) + 8);
  }
}

TEST_CASE("Q4_1 block layout is bit-exact with ggml", "[ggml]") {
  BlockQ4_1 b{};
  b.d = fp32_to_fp16(0.25f);
  b.m = fp32_to_fp16(-1.0f);
  REQUIRE(b.d == 0x3400);
  REQUIRE(b.m == 0xBC00);
  for (int j = 0; j < 16; ++j) b.qs[j] = static_cast<uint8_t>(((j * 3) % 16) | (j << 4));
  uint8_t bytes[20];
  std::memcpy(bytes, &b, 20);
  CHECK(bytes[0] == 0x00);
  CHECK(bytes[1] == 0x34);
  CHECK(bytes[2] == 0x00);
  CHECK(bytes[3] == 0xBC);
  float y[32];
  dequantize_row(GgmlType::kQ4_1, bytes, y, 32);
  for (int j = 0; j < 16; ++j) {
    CHECK(y[j] == ((j * 3) % 16) * 0.25f - 1.0f);
    CHECK(y[j + 16] == j * 0.25f - 1.0f);
  }
  // Reference quantizer: min 0, max 15 gives d = 1, m = 0, q = x.
  float x[32];
  for (int j = 0; j < 32; ++j) x[j] = static_cast<float>((j * 7) % 16);
  BlockQ4_1 q{};
  quantize_row(GgmlType::kQ4_1, x, &q, 32);
  CHECK(q.d == 0x3C00);
  CHECK(q.m == 0x0000);
  for (int j = 0; j < 16; ++j) {
    CHECK((q.qs[j] & 0xF) == static_cast<int>(x[j]));
    CHECK((q.qs[j] >> 4) == static_cast<int>(x[j + 16]));
  }
}

TEST_CASE("Q8_0 block layout is bit-exact with ggml", "[ggml]") {
  BlockQ8_0 b{};
  b.d = fp32_to_fp16(0.125f);
  REQUIRE(b.d == 0x3000);
  for (int j = 0; j < 32; ++j) b.qs[j] = static_cast<int8_t>(j * 8 - 128);
  uint8_t bytes[34];
  std::memcpy(bytes, &b, 34);
  CHECK(bytes[1] == 0x30);
  CHECK(bytes[2] == 0x80);  // -128
  float y[32];
  dequantize_row(GgmlType::kQ8_0, bytes, y, 32);
  for (int j = 0; j < 32; ++j) CHECK(y[j] == (j * 8 - 128) * 0.125f);
  // Reference quantizer: amax 127 gives d = 1; roundf rounds halves away from zero.
  float x[32];
  for (int j = 0; j < 32; ++j) x[j] = static_cast<float>(j * 8 - 127);
  x[1] = 2.5f;
  x[2] = -2.5f;
  x[3] = 0.49f;
  BlockQ8_0 q{};
  quantize_row(GgmlType::kQ8_0, x, &q, 32);
  CHECK(q.d == 0x3C00);
  CHECK(q.qs[0] == -127);
  CHECK(q.qs[1] == 3);
  CHECK(q.qs[2] == -3);
  CHECK(q.qs[3] == 0);
  CHECK(q.qs[31] == 31 * 8 - 127);
}

TEST_CASE("F16 and BF16 rows convert element-wise", "[ggml]") {
  const float x[4] = {1.0f, -0.5f, 65504.0f, 0x1.0p-24f};
  uint16_t h[4];
  quantize_row(GgmlType::kF16, x, h, 4);
  CHECK(h[0] == 0x3C00);
  CHECK(h[1] == 0xB800);
  CHECK(h[2] == 0x7BFF);
  CHECK(h[3] == 0x0001);
  float y[4];
  dequantize_row(GgmlType::kF16, h, y, 4);
  for (int i = 0; i < 4; ++i) CHECK(y[i] == x[i]);
  quantize_row(GgmlType::kBF16, x, h, 4);
  CHECK(h[0] == 0x3F80);
  CHECK(h[1] == 0xBF00);
}

}  // namespace pd

namespace pd {
namespace {

std::vector<uint8_t> read_quant_data(const std::string& name) {
  const std::string path = std::string(PD_TEST_DATA_DIR) + "/quant/" + name;
  FILE* f = std::fopen(path.c_str(), "rb");
  INFO("reading " << path);
  REQUIRE(f != nullptr);
  std::vector<uint8_t> bytes;
  uint8_t buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) bytes.insert(bytes.end(), buf, buf + n);
  std::fclose(f);
  return bytes;
}

std::vector<float> as_floats(const std::vector<uint8_t>& bytes) {
  std::vector<float> v(bytes.size() / 4);
  std::memcpy(v.data(), bytes.data(), v.size() * 4);
  return v;
}

}  // namespace

// tests/data/quant/ holds random blocks and gguf-py's dequantization of them
// (scripts/make_quant_reference.py): ggml's reference arithmetic, not ours.
TEST_CASE("dequantization of Q5 and K-quant blocks is bit-exact with gguf-py", "[ggml]") {
  for (GgmlType type : {GgmlType::kQ5_0, GgmlType::kQ5_1, GgmlType::kQ4_K, GgmlType::kQ5_K, GgmlType::kQ6_K}) {
    const std::string name = ggml_type_name(type);
    INFO("type " << name);
    const std::vector<uint8_t> blocks = read_quant_data(name + ".blocks");
    const std::vector<float> want = as_floats(read_quant_data(name + ".f32"));
    const GgmlTypeTraits& t = ggml_traits(type);
    REQUIRE(blocks.size() % t.block_bytes == 0);
    const int64_t n = static_cast<int64_t>(blocks.size() / t.block_bytes) * t.block_elems;
    REQUIRE(want.size() == static_cast<size_t>(n));
    std::vector<float> got(static_cast<size_t>(n));
    dequantize_row(type, blocks.data(), got.data(), n);
    int mismatches = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (to_bits(got[i]) != to_bits(want[i]) && mismatches++ < 5)
        UNSCOPED_INFO("element " << i << ": got " << got[i] << ", gguf-py " << want[i]);
    }
    CHECK(mismatches == 0);
  }
}

TEST_CASE("Q5_0 and Q5_1 quantizers are bit-exact with gguf-py", "[ggml]") {
  for (GgmlType type : {GgmlType::kQ5_0, GgmlType::kQ5_1}) {
    const std::string name = ggml_type_name(type);
    INFO("type " << name);
    const std::vector<float> x = as_floats(read_quant_data(name + ".input.f32"));
    const std::vector<uint8_t> want = read_quant_data(name + ".quantized");
    const int64_t n = static_cast<int64_t>(x.size());
    REQUIRE(want.size() == ggml_row_bytes(type, n));
    std::vector<uint8_t> got(want.size());
    quantize_row(type, x.data(), got.data(), n);
    CHECK(got == want);
  }
}

TEST_CASE("K-quant and Q5 quantizers for test models stay within their error bounds", "[ggml]") {
  constexpr int64_t n = 256 * 16;
  for (float scale : {0.02f, 1.0f, 300.0f}) {
    const std::vector<float> x = random_floats(n, 7, scale);
    // Bounds on the RMS error relative to the RMS of x (uniform values): a step is
    // range / (2^bits - 1), plus the 6-bit (8-bit for Q6_K) rounding of the sub-block scales.
    const struct {
      GgmlType type;
      double max_rel;
    } cases[] = {{GgmlType::kQ5_0, 0.05}, {GgmlType::kQ5_1, 0.04}, {GgmlType::kQ4_K, 0.12},
                 {GgmlType::kQ5_K, 0.06}, {GgmlType::kQ6_K, 0.04}, {GgmlType::kQ8_K, 0.01}};
    for (const auto& c : cases) {
      INFO("type " << ggml_type_name(c.type) << " scale " << scale);
      std::vector<uint8_t> q(ggml_row_bytes(c.type, n));
      std::vector<float> y(n);
      quantize_row(c.type, x.data(), q.data(), n);
      dequantize_row(c.type, q.data(), y.data(), n);
      double sq_err = 0, sq_x = 0;
      for (int64_t i = 0; i < n; ++i) {
        sq_err += double(y[i] - x[i]) * (y[i] - x[i]);
        sq_x += double(x[i]) * x[i];
      }
      CHECK(std::sqrt(sq_err / sq_x) <= c.max_rel);
      CHECK(std::sqrt(sq_err / sq_x) > 0.0);
    }
    // Zeros stay zeros; non-finite input must not trap.
    for (GgmlType type : {GgmlType::kQ5_0, GgmlType::kQ5_1, GgmlType::kQ4_K, GgmlType::kQ5_K, GgmlType::kQ6_K,
                          GgmlType::kQ8_K}) {
      std::vector<float> z(256, 0.0f), y(256);
      std::vector<uint8_t> q(ggml_row_bytes(type, 256));
      quantize_row(type, z.data(), q.data(), 256);
      dequantize_row(type, q.data(), y.data(), 256);
      for (float v : y) CHECK(v == 0.0f);
      z[3] = std::numeric_limits<float>::quiet_NaN();
      z[9] = -std::numeric_limits<float>::infinity();
      quantize_row(type, z.data(), q.data(), 256);
    }
  }
}

}  // namespace pd
