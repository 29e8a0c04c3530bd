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
    {GgmlType::kQ5_0, "Q5_0", 32, sizeof(BlockQ5_0), true},
    {GgmlType::kQ5_1, "Q5_1", 32, sizeof(BlockQ5_1), true},
    {GgmlType::kQ8_0, "Q8_0", 32, sizeof(BlockQ8_0), true},
    {GgmlType::kQ4_K, "Q4_K", kQK_K, sizeof(BlockQ4_K), true},
    {GgmlType::kQ5_K, "Q5_K", kQK_K, sizeof(BlockQ5_K), true},
    {GgmlType::kQ6_K, "Q6_K", kQK_K, sizeof(BlockQ6_K), true},
    {GgmlType::kQ8_K, "Q8_K", kQK_K, sizeof(BlockQ8_K), true},
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

// The element of largest magnitude, sign kept (the first of equals), as
// ggml's Q4_0/Q5_0 reference quantizers pick it.
float signed_absmax(const float* x, int n) {
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < n; ++j) {
    if (amax < std::fabs(x[j])) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  }
  return max;
}

// Smallest and largest of n floats (ggml's Q4_1/Q5_1 reference quantizers).
void min_max(const float* x, int n, float* mn, float* mx) {
  *mn = HUGE_VALF;
  *mx = -HUGE_VALF;
  for (int j = 0; j < n; ++j) {
    if (x[j] < *mn) *mn = x[j];
    if (x[j] > *mx) *mx = x[j];
  }
}

void quantize_q4_0(const float* x, uint8_t* out, int64_t nb) {
  constexpr int qk = 32;
  for (int64_t i = 0; i < nb; ++i, x += qk, out += sizeof(BlockQ4_0)) {
    const float max = signed_absmax(x, qk);
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
    float min, max;
    min_max(x, qk, &min, &max);
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

// ggml's quantize_row_q5_0_ref: Q4_0 with a fifth bit, x = d * (q - 16).
void quantize_q5_0(const float* x, uint8_t* out, int64_t nb) {
  constexpr int qk = 32;
  for (int64_t i = 0; i < nb; ++i, x += qk, out += sizeof(BlockQ5_0)) {
    const float max = signed_absmax(x, qk);
    const float d = max / -16;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    store_u16(out, fp32_to_fp16(d));
    uint32_t qh = 0;
    uint8_t* qs = out + 6;
    for (int j = 0; j < qk / 2; ++j) {
      const int xi0 = std::min(31, trunc_to_int(x[j] * id + 16.5f)) & 0xFF;
      const int xi1 = std::min(31, trunc_to_int(x[qk / 2 + j] * id + 16.5f)) & 0xFF;
      qs[j] = static_cast<uint8_t>((xi0 & 0x0F) | ((xi1 & 0x0F) << 4));
      qh |= static_cast<uint32_t>((xi0 & 0x10) >> 4) << j;
      qh |= static_cast<uint32_t>((xi1 & 0x10) >> 4) << (j + qk / 2);
    }
    std::memcpy(out + 2, &qh, 4);
  }
}

// ggml's quantize_row_q5_1_ref: x = d * q + m, q in [0, 31].
void quantize_q5_1(const float* x, uint8_t* out, int64_t nb) {
  constexpr int qk = 32;
  for (int64_t i = 0; i < nb; ++i, x += qk, out += sizeof(BlockQ5_1)) {
    float min, max;
    min_max(x, qk, &min, &max);
    const float d = (max - min) / ((1 << 5) - 1);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    store_u16(out, fp32_to_fp16(d));
    store_u16(out + 2, fp32_to_fp16(min));
    uint32_t qh = 0;
    uint8_t* qs = out + 8;
    for (int j = 0; j < qk / 2; ++j) {
      const int xi0 = std::clamp(trunc_to_int((x[j] - min) * id + 0.5f), 0, 31);
      const int xi1 = std::clamp(trunc_to_int((x[qk / 2 + j] - min) * id + 0.5f), 0, 31);
      qs[j] = static_cast<uint8_t>((xi0 & 0x0F) | ((xi1 & 0x0F) << 4));
      qh |= static_cast<uint32_t>((xi0 & 0x10) >> 4) << j;
      qh |= static_cast<uint32_t>((xi1 & 0x10) >> 4) << (j + qk / 2);
    }
    std::memcpy(out + 4, &qh, 4);
  }
}

int clamp_round(float v, int lo, int hi) {
  if (!(v > static_cast<float>(lo))) return lo;  // also NaN
  if (v > static_cast<float>(hi)) return hi;
  return std::clamp(static_cast<int>(std::lround(v)), lo, hi);
}

// Q4_K / Q5_K (bits = 4 or 5): per 32-element sub-block, the range
// [min(0, lo), hi] split into 2^bits - 1 steps; the eight step sizes and
// offsets quantized to 6 bits against the super-block's d and dmin.
void quantize_kquant_affine(const float* x, uint8_t* out, int64_t nb, int bits) {
  const int qmax = (1 << bits) - 1;
  const size_t block_bytes = bits == 4 ? sizeof(BlockQ4_K) : sizeof(BlockQ5_K);
  for (int64_t i = 0; i < nb; ++i, x += kQK_K, out += block_bytes) {
    float step[8], off[8];
    float max_step = 0.0f, max_off = 0.0f;
    for (int j = 0; j < 8; ++j) {
      float lo = 0.0f, hi = 0.0f;
      for (int l = 0; l < 32; ++l) lo = std::min(lo, x[32 * j + l]), hi = std::max(hi, x[32 * j + l]);
      step[j] = (hi - lo) / static_cast<float>(qmax);
      off[j] = -lo;
      max_step = std::max(max_step, step[j]);
      max_off = std::max(max_off, off[j]);
    }
    const uint16_t dh = fp32_to_fp16(max_step / 63.0f), mh = fp32_to_fp16(max_off / 63.0f);
    const float d = fp16_to_fp32(dh), dmin = fp16_to_fp32(mh);
    uint8_t sc[8], mn[8];
    for (int j = 0; j < 8; ++j) {
      sc[j] = static_cast<uint8_t>(d > 0.0f ? clamp_round(step[j] / d, 0, 63) : 0);
      mn[j] = static_cast<uint8_t>(dmin > 0.0f ? clamp_round(off[j] / dmin, 0, 63) : 0);
    }
    store_u16(out, dh);
    store_u16(out + 2, mh);
    uint8_t* scales = out + 4;
    for (int j = 0; j < 4; ++j) {
      scales[j] = static_cast<uint8_t>((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
      scales[j + 4] = static_cast<uint8_t>((mn[j] & 63) | ((mn[j + 4] >> 4) << 6));
      scales[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4));
    }
    uint8_t* qh = bits == 5 ? out + 16 : nullptr;
    uint8_t* qs = bits == 5 ? out + 48 : out + 16;
    if (qh) std::memset(qh, 0, 32);
    for (int j = 0; j < 8; ++j) {
      const float step_j = d * sc[j], off_j = dmin * mn[j];
      for (int l = 0; l < 32; ++l) {
        const int q = step_j > 0.0f ? clamp_round((x[32 * j + l] + off_j) / step_j, 0, qmax) : 0;
        uint8_t& byte = qs[32 * (j / 2) + l];
        if (j % 2 == 0) byte = static_cast<uint8_t>(q & 0xF);
        else byte = static_cast<uint8_t>(byte | ((q & 0xF) << 4));
        if (qh && (q & 0x10)) qh[l] = static_cast<uint8_t>(qh[l] | (1 << j));
      }
    }
  }
}

// Q6_K: per 16-element sub-block a step of amax / 31 (q - 32 in [-32, 31]),
// the sixteen steps quantized to int8 against the super-block's d.
void quantize_q6_k(const float* x, uint8_t* out, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQK_K, out += sizeof(BlockQ6_K)) {
    float step[16];
    float max_step = 0.0f;
    for (int j = 0; j < 16; ++j) {
      float amax = 0.0f;
      for (int l = 0; l < 16; ++l) amax = std::max(amax, std::fabs(x[16 * j + l]));
      step[j] = amax / 31.0f;
      max_step = std::max(max_step, step[j]);
    }
    const uint16_t dh = fp32_to_fp16(max_step / 127.0f);
    const float d = fp16_to_fp32(dh);
    uint8_t* ql = out;
    uint8_t* qh = out + 128;
    auto* scales = reinterpret_cast<int8_t*>(out + 192);
    std::memset(out, 0, 192);
    for (int j = 0; j < 16; ++j) scales[j] = static_cast<int8_t>(d > 0.0f ? clamp_round(step[j] / d, 0, 127) : 0);
    store_u16(out + 208, dh);
    for (int e = 0; e < kQK_K; ++e) {
      const float s = d * scales[e / 16];
      const int q = s > 0.0f ? clamp_round(x[e] / s, -32, 31) + 32 : 32;
      // Element e = 128n + 32k + l (k < 4, l < 32): low nibble of ql[64n + l
      // + 32 (k & 1)] (high nibble for k >= 2), bits 2k..2k+1 of qh[32n + l].
      const int n = e / 128, k = (e % 128) / 32, l = e % 32;
      uint8_t& lo = ql[64 * n + l + 32 * (k & 1)];
      lo = static_cast<uint8_t>(lo | ((q & 0xF) << (k >= 2 ? 4 : 0)));
      qh[32 * n + l] = static_cast<uint8_t>(qh[32 * n + l] | ((q >> 4) << (2 * k)));
    }
  }
}

void quantize_q8_k(const float* x, uint8_t* out, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQK_K, out += sizeof(BlockQ8_K)) {
    BlockQ8_K b{};
    float amax = 0.0f;
    for (int e = 0; e < kQK_K; ++e) amax = std::max(amax, std::fabs(x[e]));
    b.d = amax / 127.0f;
    const float id = b.d != 0.0f ? 1.0f / b.d : 0.0f;
    for (int e = 0; e < kQK_K; ++e) b.qs[e] = static_cast<int8_t>(clamp_round(x[e] * id, -127, 127));
    for (int g = 0; g < 16; ++g) {
      int sum = 0;
      for (int l = 0; l < 16; ++l) sum += b.qs[16 * g + l];
      b.bsums[g] = static_cast<int16_t>(sum);
    }
    std::memcpy(out, &b, sizeof b);
  }
}

// The dequantizers below follow ggml's dequantize_row_* (ggml-quants.c)
// operation for operation, so their results are the same floats.
void dequantize_q5(bool has_min, const uint8_t* p, float* dst, int64_t nb) {
  const size_t block_bytes = has_min ? sizeof(BlockQ5_1) : sizeof(BlockQ5_0);
  for (int64_t b = 0; b < nb; ++b, p += block_bytes, dst += 32) {
    const float d = fp16_to_fp32(load_u16(p));
    const float m = has_min ? fp16_to_fp32(load_u16(p + 2)) : 0.0f;
    const uint8_t* h = p + (has_min ? 4 : 2);
    const uint8_t* qs = h + 4;
    uint32_t qh;
    std::memcpy(&qh, h, 4);
    for (int j = 0; j < 16; ++j) {
      const int xh0 = static_cast<int>(((qh >> j) << 4) & 0x10);
      const int xh1 = static_cast<int>((qh >> (j + 12)) & 0x10);
      const int x0 = (qs[j] & 0x0F) | xh0;
      const int x1 = (qs[j] >> 4) | xh1;
      if (has_min) {
        dst[j] = static_cast<float>(x0) * d + m;
        dst[j + 16] = static_cast<float>(x1) * d + m;
      } else {
        dst[j] = static_cast<float>(x0 - 16) * d;
        dst[j + 16] = static_cast<float>(x1 - 16) * d;
      }
    }
  }
}

void dequantize_kquant_affine(bool five_bits, const uint8_t* p, float* y, int64_t nb) {
  const size_t block_bytes = five_bits ? sizeof(BlockQ5_K) : sizeof(BlockQ4_K);
  for (int64_t b = 0; b < nb; ++b, p += block_bytes) {
    const float d = fp16_to_fp32(load_u16(p));
    const float min = fp16_to_fp32(load_u16(p + 2));
    const uint8_t* scales = p + 4;
    const uint8_t* qh = five_bits ? p + 16 : nullptr;
    const uint8_t* q = five_bits ? p + 48 : p + 16;
    int u1 = 1, u2 = 2;
    for (int j = 0; j < 4; ++j, q += 32, u1 <<= 2, u2 <<= 2) {
      uint8_t sc, m;
      kquant_scale_min(2 * j, scales, &sc, &m);
      const float d1 = d * sc, m1 = min * m;
      kquant_scale_min(2 * j + 1, scales, &sc, &m);
      const float d2 = d * sc, m2 = min * m;
      for (int l = 0; l < 32; ++l) {
        const int hi = qh && (qh[l] & u1) ? 16 : 0;
        *y++ = d1 * static_cast<float>((q[l] & 0xF) + hi) - m1;
      }
      for (int l = 0; l < 32; ++l) {
        const int hi = qh && (qh[l] & u2) ? 16 : 0;
        *y++ = d2 * static_cast<float>((q[l] >> 4) + hi) - m2;
      }
    }
  }
}

void dequantize_q6_k(const uint8_t* p, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, p += sizeof(BlockQ6_K)) {
    const float d = fp16_to_fp32(load_u16(p + 208));
    const uint8_t* ql = p;
    const uint8_t* qh = p + 128;
    const auto* sc = reinterpret_cast<const int8_t*>(p + 192);
    for (int n = 0; n < kQK_K; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = d * static_cast<float>(sc[is]) * static_cast<float>(q1);
        y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
        y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
        y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
      }
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
    case GgmlType::kQ5_0:
    case GgmlType::kQ5_1:
      dequantize_q5(type == GgmlType::kQ5_1, p, dst, n / 32);
      return;
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K:
      dequantize_kquant_affine(type == GgmlType::kQ5_K, p, dst, n / kQK_K);
      return;
    case GgmlType::kQ6_K:
      dequantize_q6_k(p, dst, n / kQK_K);
      return;
    case GgmlType::kQ8_K:
      for (int64_t b = 0; b < n / kQK_K; ++b, p += sizeof(BlockQ8_K), dst += kQK_K) {
        float d;
        std::memcpy(&d, p, 4);
        for (int j = 0; j < kQK_K; ++j) dst[j] = d * static_cast<float>(static_cast<int8_t>(p[4 + j]));
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
    case GgmlType::kQ5_0:
      quantize_q5_0(src, out, n / 32);
      return;
    case GgmlType::kQ5_1:
      quantize_q5_1(src, out, n / 32);
      return;
    case GgmlType::kQ4_K:
      quantize_kquant_affine(src, out, n / kQK_K, 4);
      return;
    case GgmlType::kQ5_K:
      quantize_kquant_affine(src, out, n / kQK_K, 5);
      return;
    case GgmlType::kQ6_K:
      quantize_q6_k(src, out, n / kQK_K);
      return;
    case GgmlType::kQ8_K:
      quantize_q8_k(src, out, n / kQK_K);
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
