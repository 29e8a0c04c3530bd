// Tensor element types of the GGUF/ggml format, their block layouts, and
// reference (scalar) conversions to and from fp32.
//
// A quantized type stores a row of K elements as K / block_elems blocks of
// block_bytes bytes each. Rows must have K divisible by block_elems.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "util/status.h"

namespace pd {

// Values are the on-disk ggml_type ids.
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kBF16 = 30,
};

struct GgmlTypeTraits {
  GgmlType type;
  const char* name;      // "F32", "Q4_1", ...
  uint32_t block_elems;  // elements per block (1 for F32/F16/BF16)
  uint32_t block_bytes;  // bytes per block
  bool quantized;
};

// Traits of a supported type, or nullopt for an id this project does not handle.
std::optional<GgmlTypeTraits> ggml_type_traits(uint32_t raw_type);
const GgmlTypeTraits& ggml_traits(GgmlType type);  // type must be supported
const char* ggml_type_name(GgmlType type);
// Human-readable name of any raw id, including ones we don't support ("Q5_K", "type 99").
// Names of ggml's ids are static; for an id ggml does not define, the view points
// into a per-thread buffer that the next call on the same thread overwrites.
std::string_view ggml_raw_type_name(uint32_t raw_type);

// Bytes of a row of n elements; n must be a multiple of the block size.
size_t ggml_row_bytes(GgmlType type, int64_t n);

// Block structs, bit-exact with ggml.
struct BlockQ4_0 {  // 32 elements: x = d * (q - 8)
  uint16_t d;       // fp16 scale
  uint8_t qs[16];   // element j in low nibble of qs[j] (j<16), element j+16 in high nibble
};
struct BlockQ4_1 {  // 32 elements: x = d * q + m
  uint16_t d;       // fp16 scale
  uint16_t m;       // fp16 min
  uint8_t qs[16];
};
struct BlockQ8_0 {  // 32 elements: x = d * q
  uint16_t d;       // fp16 scale
  int8_t qs[32];
};
struct BlockQ5_0 {  // 32 elements: x = d * (q - 16), q = 4 low bits | 1 high bit
  uint16_t d;       // fp16 scale
  uint8_t qh[4];    // bit j of the little-endian u32: high bit of element j
  uint8_t qs[16];   // low nibbles, as Q4_0
};
struct BlockQ5_1 {  // 32 elements: x = d * q + m
  uint16_t d;
  uint16_t m;
  uint8_t qh[4];
  uint8_t qs[16];
};
static_assert(sizeof(BlockQ4_0) == 18);
static_assert(sizeof(BlockQ4_1) == 20);
static_assert(sizeof(BlockQ5_0) == 22);
static_assert(sizeof(BlockQ5_1) == 24);
static_assert(sizeof(BlockQ8_0) == 34);

// K-quants: super-blocks of 256 elements (rows must be multiples of 256).
inline constexpr int kQK_K = 256;
// Q4_K: 8 sub-blocks of 32, x = d * sc_j * q - dmin * m_j, q in [0, 15]; the
// eight 6-bit (sc, m) pairs are packed into scales[12] (see kquant_scale_min).
// qs[32c + l] holds element 64c + l (low nibble) and 64c + 32 + l (high).
struct BlockQ4_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];
  uint8_t qs[128];
};
// Q5_K: Q4_K plus a fifth bit: bit 2c of qh[l] for element 64c + l, bit 2c+1
// for element 64c + 32 + l.
struct BlockQ5_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];
  uint8_t qh[32];
  uint8_t qs[128];
};
// Q6_K: 16 sub-blocks of 16, x = d * scales[j] * (q - 32), q in [0, 63]: low
// 4 bits in ql, high 2 in qh (layout in dequantize_row).
struct BlockQ6_K {
  uint8_t ql[128];
  uint8_t qh[64];
  int8_t scales[16];
  uint16_t d;
};
// Q8_K: x = d * q with a float scale (ggml's activation type for K-quants).
struct BlockQ8_K {
  float d;
  int8_t qs[256];
  int16_t bsums[16];  // sums of groups of 16 qs (unused by dequantization)
};
static_assert(sizeof(BlockQ4_K) == 144);
static_assert(sizeof(BlockQ5_K) == 176);
static_assert(sizeof(BlockQ6_K) == 210);
static_assert(sizeof(BlockQ8_K) == 292);

// Sub-block j's (scale, min) of a Q4_K/Q5_K block's 12 packed scale bytes.
inline void kquant_scale_min(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

float fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f);  // round to nearest even
float bf16_to_fp32(uint16_t h);
uint16_t fp32_to_bf16(float f);  // round to nearest even

// Dequantize n elements (n a multiple of the block size) from src into dst.
void dequantize_row(GgmlType type, const void* src, float* dst, int64_t n);
// Quantize n floats into dst. Q4_0/Q4_1/Q5_0/Q5_1/Q8_0: ggml's reference
// quantizers, bit for bit. K-quants: a plain min/max search of our own (valid
// blocks, not the scales llama-quantize would pick). Used by the GGUF writer
// for test models and by kernels' tests.
void quantize_row(GgmlType type, const float* src, void* dst, int64_t n);

// The element types a KV cache may hold (kv.dtype, --kv-dtype).
// "f32" | "f16" | "q8_0" (case-insensitive; "fp32", "fp16", "float32",
// "float16" and "q8" are accepted too). InvalidArgument naming `what` (a flag
// or config key) and the value otherwise.
Result<GgmlType> parse_kv_dtype(std::string_view name, std::string_view what);
// "f32", "f16", "q8_0" (the wire header's and the config's spelling).
const char* kv_dtype_name(GgmlType dtype);

}  // namespace pd
