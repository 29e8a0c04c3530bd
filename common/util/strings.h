// Small string helpers the parsers share.
#pragma once

#include <algorithm>
#include <string>
#include <string_view>

namespace pd {

// `s` with ASCII letters lowered (names of types, models and machines are ASCII).
inline std::string ascii_lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : static_cast<char>(c); });
  return out;
}

}  // namespace pd
