// UTF-8 helpers private to the tokenizer module (not part of its public API).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace pd::utf8 {

enum class StepKind {
  kValid,       // a complete, well-formed character of `len` bytes
  kIncomplete,  // a well-formed prefix that ran into the end of the input; `len` = bytes seen
  kInvalid,     // an ill-formed sequence; `len` = its maximal subpart (>= 1 byte)
};

struct Step {
  StepKind kind;
  size_t len;
};

// Examines the character starting at s[0] (n >= 1). Follows the Unicode
// definition of well-formed UTF-8 (no overlongs, no surrogates, <= U+10FFFF),
// and for ill-formed input reports the "maximal subpart" so callers replace
// each one with exactly one U+FFFD, as browsers and Python do.
Step step(const unsigned char* s, size_t n);

// Decodes the character at s[0] assuming step() said kValid with `len` bytes.
uint32_t decode_valid(const unsigned char* s, size_t len);

// Appends the UTF-8 encoding of code point `cp` (cp <= 0x10FFFF).
void append(std::string& out, uint32_t cp);

inline constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

}  // namespace pd::utf8
