// Private to the tokenizer module: re-labels a Status with the file it concerns.
#pragma once

#include <string>
#include <string_view>

#include "util/status.h"

namespace pd::tokenizer_internal {

// Same code as `s` (which must not be OK), message "<context>: <s.message()>".
inline Status with_context(const Status& s, std::string_view context) {
  const std::string msg = std::string(context) + ": " + s.message();
  switch (s.code()) {
    case StatusCode::kInvalidArgument: return Status::invalid_argument(msg);
    case StatusCode::kNotFound: return Status::not_found(msg);
    case StatusCode::kCorruption: return Status::corruption(msg);
    case StatusCode::kUnsupported: return Status::unsupported(msg);
    case StatusCode::kResourceExhausted: return Status::resource_exhausted(msg);
    case StatusCode::kIoError: return Status::io_error(msg);
    case StatusCode::kTimeout: return Status::timeout(msg);
    case StatusCode::kCancelled: return Status::cancelled(msg);
    case StatusCode::kUnavailable: return Status::unavailable(msg);
    case StatusCode::kOk:
    case StatusCode::kInternal: break;
  }
  return Status::internal(msg);
}

}  // namespace pd::tokenizer_internal
