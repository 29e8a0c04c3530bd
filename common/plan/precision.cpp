#include "plan/precision.h"

#include <algorithm>

#include "util/strings.h"

namespace pd::plan {

int precision_bits(Precision p) {
  switch (p) {
    case Precision::kFp32: return 32;
    case Precision::kBf16: return 16;
    case Precision::kFp16: return 16;
    case Precision::kFp8: return 8;
    case Precision::kInt8: return 8;
    case Precision::kInt4: return 4;
  }
  return 32;
}

double precision_bytes(Precision p) { return precision_bits(p) / 8.0; }

const char* precision_name(Precision p) {
  switch (p) {
    case Precision::kFp32: return "fp32";
    case Precision::kBf16: return "bf16";
    case Precision::kFp16: return "fp16";
    case Precision::kFp8: return "fp8";
    case Precision::kInt8: return "int8";
    case Precision::kInt4: return "int4";
  }
  return "?";
}

Result<Precision> parse_precision(std::string_view text, std::string_view what) {
  const std::string s = ascii_lower(text);
  if (s == "fp32" || s == "f32" || s == "float32") return Precision::kFp32;
  if (s == "bf16" || s == "bfloat16") return Precision::kBf16;
  if (s == "fp16" || s == "f16" || s == "float16") return Precision::kFp16;
  if (s == "fp8" || s == "f8" || s == "e4m3" || s == "e5m2") return Precision::kFp8;
  if (s == "int8" || s == "i8" || s == "q8") return Precision::kInt8;
  if (s == "int4" || s == "i4" || s == "q4") return Precision::kInt4;
  return Status::invalid_argument(std::string(what) + ": unknown precision '" + std::string(text) +
                                  "' (expected fp32, bf16, fp16, fp8, int8 or int4)");
}

std::vector<Precision> all_precisions() {
  return {Precision::kFp32, Precision::kBf16, Precision::kFp16,
          Precision::kFp8,  Precision::kInt8, Precision::kInt4};
}

}  // namespace pd::plan
