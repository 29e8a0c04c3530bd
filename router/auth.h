// API-key authentication of HTTP requests (RFC 6750 bearer tokens).
//
// Pure functions, callable from any thread. The router calls authorized() with
// the raw Authorization header of each request that needs the key (/v1/*, the
// tokenizer routes, and /metrics when http.metrics_require_key is set) and
// answers 401 when it is false. The admin routes (/admin/*) have their own key
// (http.admin_key), checked by admin_access(): closed when it is unset.
#pragma once

#include <string_view>

namespace pd::router {

// Whether a request whose Authorization header is `authorization_header` (the
// raw value, "" when absent) may proceed when the configured key is `api_key`.
//   - An empty api_key means no authentication: always true.
//   - Otherwise the header must be "<scheme> <token>" where the scheme is
//     "Bearer" in any letter case, followed by one or more spaces or tabs, and
//     the token (surrounding spaces and tabs ignored) equals api_key exactly
//     (case-sensitive). Anything else (no header, another scheme such as Basic,
//     an empty token) is false.
// The token is compared in constant time: see constant_time_equal().
bool authorized(std::string_view authorization_header, std::string_view api_key);

// Whether an admin request may proceed, given the configured admin key.
enum class AdminAccess {
  kAllowed,   // the header carries the admin key
  kDisabled,  // no admin key is configured: the admin endpoints are closed to everyone (403)
  kDenied,    // a key is configured and the header does not carry it (401)
};
// As authorized(), except that an empty `admin_key` closes instead of opening:
// kDisabled, whatever the header holds. The token is compared in constant time.
AdminAccess admin_access(std::string_view authorization_header, std::string_view admin_key);

// a == b, in time that depends only on a.size(): every byte of `a` is compared
// (no exit at the first difference) and a length difference is folded into the
// result instead of returning early, so the time taken says nothing about how
// much of `b` a guess got right, nor about b's length. Pass the untrusted input
// (the client's token) as `a` and the secret as `b`.
bool constant_time_equal(std::string_view a, std::string_view b);

}  // namespace pd::router
