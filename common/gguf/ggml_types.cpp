#include "gguf/ggml_types.h"

#include <algorithm>
#include <string>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "util/strings.h"

namespace pd {
namespace {

constexpr GgmlTypeTraits kSupported[] = {
    {GgmlType::kF32, "F32", 1, 4, false},
    {GgmlType::kF16, "F16", 1, 2, false},
    {GgmlType::kQ4_0, "Q4_0", 32, sizeof(BlockQ4_0), true},
    {GgmlType::kQ4_1, "Q4_1", 32, sizeof(BlockQ4_1), true},
    {GgmlType::kQ8_0, "Q8_0", 32, sizeof(BlockQ8_0), true},
    {GgmlType::kBF16, "BF16", 1, 2, false},
};

// ggml's type ids (ggml.h, enum ggml_type). Ids 4 and 5 (Q4_2, Q4_3) and
// 31..33 (Q4_0_4_4 ...), 36..38 (IQ4_NL_4_4 ...) were removed from ggml but
// may still appear in old files.
constexpr const char* kRawNames[] = {
    "F32",      "F16",      "Q4_0",     "Q4_1",       "Q4_2",       "Q4_3",       "Q5_0",
    "Q5_1",     "Q8_0",     "Q8_1",     "Q2_K",       "Q3_K",       "Q4_K",       "Q5_K",
    "Q6_K",     "Q8_K",     "IQ2_XXS",  "IQ2_XS",     "IQ3_XXS",    "IQ1_S",      "IQ4_NL",
    "IQ3_S",    "IQ2_S",    "IQ4_XS",   "I8",         "I16",        "I32",        "I64",
    "F64",      "IQ1_M",    "BF16",     "Q4_0_4_4",   "Q4_0_4_8",   "Q4_0_8_8",   "TQ1_0",
    "TQ2_0",    "IQ4_NL_4_4", "IQ4_NL_4_8", "IQ4_NL_8_8", "MXFP4",
};

[[noreturn]] void die(const char* what) {
  std::fprintf(stderr, "ggml_types: %s\n", what);
  std::abort();
}

uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
void store_u16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }

// (int8_t)(x) as ggml does it, but defined for every input: out-of-range and
// NaN inputs (which only non-finite data produces) are clamped instead of UB.
int trunc_to_int(float x) {
  if (!(x > -128.0f)) return -128;  // also NaN
  if (x > 127.0f) return 127;
  return static_cast<int>(x);
}
int round_to_int(float x) {
  if (!(x > -128.0f)) return -128;
  if (x > 127.0f) return 127;
  return static_cast<int>(std::roundf(x));
}

void quantize_q4_0(const float* x, uint8_t* out, int64_t nb) {
  constexpr int qk = 32;
  for (int64_t i = 0; i < nb; ++i, x += qk, out += sizeof(BlockQ4_0)) {
    float amax = 0.0f;
    float max = 0.0f;
    for (int j = 0; j < qk; ++j) {
      if (amax < std::fabs(x[j])) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    }
    const float d = max / -8;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    store_u16(out, fp32_to_fp16(d));
    uint8_t* qs = out + 2;
    for (int j = 0; j < qk / 2; ++j) {
      const int xi0 = std::min(15, trunc_to_int(x[j] * id + 8.5f));
      const int xi1 = std::min(15, trunc_to_int(x[qk / 2 + j] * id + 8.5f));
      qs[j] = static_cast<uint8_t>((xi0 & 0xF) | ((xi1 & 0xF) << 4));
    }
  }
}

void quantize_q4_1(const float* x, uint8_t* out, int64_t nb) {
  constexpr int qk = 32;
  for (int64_t i = 0; i < nb; ++i, x += qk, out += sizeof(BlockQ4_1)) {
    float min = HUGE_VALF;
    float max = -HUGE_VALF;
    for (int j = 0; j < qk; ++j) {
      if (x[j] < min) min = x[j];
      if (x[j] > max) max = x[j];
    }
    const float d = (max - min) / ((1 << 4) - 1);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    store_u16(out, fp32_to_fp16(d));
    store_u16(out + 2, fp32_to_fp16(min));
    uint8_t* qs = out + 4;
    for (int j = 0; j < qk / 2; ++j) {
      const int xi0 = std::min(15, trunc_to_int((x[j] - min) * id + 0.5f));
      const int xi1 = std::min(15, trunc_to_int((x[qk / 2 + j] - min) * id + 0.5f));
      qs[j] = static_cast<uint8_t>((xi0 & 0xF) | ((xi1 & 0xF) << 4));
    }
  }
}

void quantize_q8_0(const float* x, uint8_t* out, int64_t nb) {
  constexpr int qk = 32;
  for (int64_t i = 0; i < nb; ++i, x += qk, out += sizeof(BlockQ8_0)) {
    float amax = 0.0f;
    for (int j = 0; j < qk; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / ((1 << 7) - 1);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    store_u16(out, fp32_to_fp16(d));
    for (int j = 0; j < qk; ++j) {
      out[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(round_to_int(x[j] * id)));
    }
  }
}

}  // namespace

std::optional<GgmlTypeTraits> ggml_type_traits(uint32_t raw_type) {
  for (const GgmlTypeTraits& t : kSupported) {
    if (static_cast<uint32_t>(t.type) == raw_type) return t;
  }
  return std::nullopt;
}

const GgmlTypeTraits& ggml_traits(GgmlType type) {
  for (const GgmlTypeTraits& t : kSupported) {
    if (t.type == type) return t;
  }
  die("ggml_traits: unsupported type");
}

const char* ggml_type_name(GgmlType type) { return ggml_traits(type).name; }

std::string_view ggml_raw_type_name(uint32_t raw_type) {
  constexpr uint32_t n = sizeof(kRawNames) / sizeof(kRawNames[0]);
  if (raw_type < n) return kRawNames[raw_type];
  // Unknown ids: formatted into a per-thread buffer (see the header's contract).
  static thread_local char buf[24];
  std::snprintf(buf, sizeof(buf), "type %u", raw_type);
  return buf;
}

size_t ggml_row_bytes(GgmlType type, int64_t n) {
  const GgmlTypeTraits& t = ggml_traits(type);
  if (n < 0 || n % t.block_elems != 0) die("ggml_row_bytes: n is not a multiple of the block size");
  return static_cast<size_t>(n / t.block_elems) * t.block_bytes;
}

float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F;
  uint32_t mant = h & 0x3FF;
  if (exp == 0x1F) return bits_f32(sign | 0x7F800000u | (mant << 13));  // inf / nan (payload kept)
  if (exp != 0) return bits_f32(sign | ((exp + 112) << 23) | (mant << 13));
  if (mant == 0) return bits_f32(sign);  // +-0
  // Subnormal: value = mant * 2^-24; normalize.
  int e = -1;
  do {
    ++e;
    mant <<= 1;
  } while ((mant & 0x400) == 0);
  return bits_f32(sign | (static_cast<uint32_t>(112 - e) << 23) | ((mant & 0x3FF) << 13));
}

uint16_t fp32_to_fp16(float f) {
  const uint32_t x = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return sign | 0x7E00;    // NaN -> quiet NaN (as ggml)
  if (ax >= 0x477FF000u) return sign | 0x7C00;   // >= 65520 rounds to inf
  if (ax < 0x38800000u) {                        // below 2^-14: fp16 subnormal or zero
    const uint32_t exp = ax >> 23;
    const uint32_t shift = 126 - exp;            // value / 2^-24 == mant >> shift
    if (exp == 0 || shift >= 32) return sign;
    const uint32_t mant = (ax & 0x7FFFFF) | 0x800000;
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  uint32_t h = (ax >> 13) - ((127 - 15) << 10);
  const uint32_t rem = ax & 0x1FFF;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) ++h;  // carry into the exponent is correct
  return static_cast<uint16_t>(sign | h);
}

float bf16_to_fp32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

uint16_t fp32_to_bf16(float f) {
  const uint32_t x = f32_bits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 64);  // quiet NaN
  return static_cast<uint16_t>((x + (0x7FFFu + ((x >> 16) & 1))) >> 16);
}

void dequantize_row(GgmlType type, const void* src, float* dst, int64_t n) {
  const size_t row_bytes = ggml_row_bytes(type, n);  // validates n
  (void)row_bytes;
  const auto* p = static_cast<const uint8_t*>(src);
  switch (type) {
    case GgmlType::kF32:
      std::memcpy(dst, p, static_cast<size_t>(n) * 4);
      return;
    case GgmlType::kF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_fp32(load_u16(p + 2 * i));
      return;
    case GgmlType::kBF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_fp32(load_u16(p + 2 * i));
      return;
    case GgmlType::kQ4_0:
      for (int64_t b = 0; b < n / 32; ++b, p += sizeof(BlockQ4_0), dst += 32) {
        const float d = fp16_to_fp32(load_u16(p));
        const uint8_t* qs = p + 2;
        for (int j = 0; j < 16; ++j) {
          dst[j] = static_cast<float>((qs[j] & 0x0F) - 8) * d;
          dst[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
        }
      }
      return;
    case GgmlType::kQ4_1:
      for (int64_t b = 0; b < n / 32; ++b, p += sizeof(BlockQ4_1), dst += 32) {
        const float d = fp16_to_fp32(load_u16(p));
        const float m = fp16_to_fp32(load_u16(p + 2));
        const uint8_t* qs = p + 4;
        for (int j = 0; j < 16; ++j) {
          dst[j] = static_cast<float>(qs[j] & 0x0F) * d + m;
          dst[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
        }
      }
      return;
    case GgmlType::kQ8_0:
      for (int64_t b = 0; b < n / 32; ++b, p += sizeof(BlockQ8_0), dst += 32) {
        const float d = fp16_to_fp32(load_u16(p));
        for (int j = 0; j < 32; ++j) dst[j] = static_cast<float>(static_cast<int8_t>(p[2 + j])) * d;
      }
      return;
  }
  die("dequantize_row: unsupported type");
}

void quantize_row(GgmlType type, const float* src, void* dst, int64_t n) {
  (void)ggml_row_bytes(type, n);  // validates n
  auto* out = static_cast<uint8_t*>(dst);
  switch (type) {
    case GgmlType::kF32:
      std::memcpy(out, src, static_cast<size_t>(n) * 4);
      return;
    case GgmlType::kF16:
      for (int64_t i = 0; i < n; ++i) store_u16(out + 2 * i, fp32_to_fp16(src[i]));
      return;
    case GgmlType::kBF16:
      for (int64_t i = 0; i < n; ++i) store_u16(out + 2 * i, fp32_to_bf16(src[i]));
      return;
    case GgmlType::kQ4_0:
      quantize_q4_0(src, out, n / 32);
      return;
    case GgmlType::kQ4_1:
      quantize_q4_1(src, out, n / 32);
      return;
    case GgmlType::kQ8_0:
      quantize_q8_0(src, out, n / 32);
      return;
  }
  die("quantize_row: unsupported type");
}

Result<GgmlType> parse_kv_dtype(std::string_view name, std::string_view what) {
  const std::string s = ascii_lower(name);
  if (s == "f32" || s == "fp32" || s == "float32") return GgmlType::kF32;
  if (s == "f16" || s == "fp16" || s == "float16") return GgmlType::kF16;
  if (s == "q8_0" || s == "q8") return GgmlType::kQ8_0;
  return Status::invalid_argument(std::string(what) + ": unknown KV cache type '" + std::string(name) +
                                  "' (expected f32, f16 or q8_0)");
}

const char* kv_dtype_name(GgmlType dtype) {
  switch (dtype) {
    case GgmlType::kF32: return "f32";
    case GgmlType::kF16: return "f16";
    case GgmlType::kQ8_0: return "q8_0";
    default: return "unsupported";
  }
}

}  // namespace pd
