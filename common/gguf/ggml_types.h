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
  kQ8_0 = 8,
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
static_assert(sizeof(BlockQ4_0) == 18);
static_assert(sizeof(BlockQ4_1) == 20);
static_assert(sizeof(BlockQ8_0) == 34);

float fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f);  // round to nearest even
float bf16_to_fp32(uint16_t h);
uint16_t fp32_to_bf16(float f);  // round to nearest even

// Dequantize n elements (n a multiple of the block size) from src into dst.
void dequantize_row(GgmlType type, const void* src, float* dst, int64_t n);
// Quantize n floats into dst (ggml's reference quantizers). Used by the GGUF
// writer for test models and by kernels' tests.
void quantize_row(GgmlType type, const float* src, void* dst, int64_t n);

// The element types a KV cache may hold (kv.dtype, --kv-dtype).
// "f32" | "f16" | "q8_0" (case-insensitive; "fp32", "fp16", "float32",
// "float16" and "q8" are accepted too). InvalidArgument naming `what` (a flag
// or config key) and the value otherwise.
Result<GgmlType> parse_kv_dtype(std::string_view name, std::string_view what);
// "f32", "f16", "q8_0" (the wire header's and the config's spelling).
const char* kv_dtype_name(GgmlType dtype);

}  // namespace pd
