// Numeric precisions the planner knows, for weights and for the KV cache
// separately: fp32, bf16/fp16, fp8/int8, int4.
//
// Widths are storage widths only: quantization scales (e.g. a Q4_1 block's
// scale and minimum) are not counted, so int4 is an exact 0.5 byte per element.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "util/status.h"

namespace pd::plan {

enum class Precision { kFp32, kBf16, kFp16, kFp8, kInt8, kInt4 };

// Bits per stored element: 32, 16, 16, 8, 8, 4.
int precision_bits(Precision p);
// Bytes per element as a real number (0.5 for int4).
double precision_bytes(Precision p);
// "fp32", "bf16", "fp16", "fp8", "int8", "int4".
const char* precision_name(Precision p);
// Parses one of the names above (case-insensitive; "f32", "f16", "float32",
// "float16", "bfloat16" are accepted too). InvalidArgument naming `what` (for
// example "--kv-precision") and the bad value otherwise.
Result<Precision> parse_precision(std::string_view text, std::string_view what);
// Every precision, in the order above.
std::vector<Precision> all_precisions();

}  // namespace pd::plan
