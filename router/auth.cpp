#include "router/auth.h"

#include <cstddef>
#include <cstdint>

namespace pd::router {
namespace {

bool is_blank(char c) { return c == ' ' || c == '\t'; }

char lower(char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; }

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (lower(a[i]) != lower(b[i])) return false;
  }
  return true;
}

}  // namespace

bool constant_time_equal(std::string_view a, std::string_view b) {
  // Fold the length difference in (no early return), then compare every byte
  // of `a` against b, wrapping around b so the reads never depend on content.
  // The accumulator is volatile so the compiler cannot turn the loop into an
  // early-exit comparison.
  volatile uint8_t diff = a.size() == b.size() ? 0 : 1;
  if (b.empty()) return a.empty();  // nothing to wrap around; an empty secret is public
  for (size_t i = 0; i < a.size(); ++i) {
    diff = static_cast<uint8_t>(diff | (static_cast<uint8_t>(a[i]) ^ static_cast<uint8_t>(b[i % b.size()])));
  }
  return diff == 0;
}

bool authorized(std::string_view header, std::string_view api_key) {
  if (api_key.empty()) return true;
  constexpr std::string_view kScheme = "bearer";
  size_t i = 0;
  while (i < header.size() && is_blank(header[i])) ++i;
  if (header.size() - i <= kScheme.size() || !iequals(header.substr(i, kScheme.size()), kScheme)) return false;
  i += kScheme.size();
  if (!is_blank(header[i])) return false;  // "Bearerx ..." is another scheme
  while (i < header.size() && is_blank(header[i])) ++i;
  size_t end = header.size();
  while (end > i && is_blank(header[end - 1])) --end;
  const std::string_view token = header.substr(i, end - i);
  if (token.empty()) return false;
  return constant_time_equal(token, api_key);
}

AdminAccess admin_access(std::string_view header, std::string_view admin_key) {
  if (admin_key.empty()) return AdminAccess::kDisabled;
  return authorized(header, admin_key) ? AdminAccess::kAllowed : AdminAccess::kDenied;
}

}  // namespace pd::router
