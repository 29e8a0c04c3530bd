#include "util/status.h"

namespace pd {

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "InvalidArgument";
    case StatusCode::kNotFound: return "NotFound";
    case StatusCode::kCorruption: return "Corruption";
    case StatusCode::kUnsupported: return "Unsupported";
    case StatusCode::kResourceExhausted: return "ResourceExhausted";
    case StatusCode::kIoError: return "IoError";
    case StatusCode::kTimeout: return "Timeout";
    case StatusCode::kCancelled: return "Cancelled";
    case StatusCode::kUnavailable: return "Unavailable";
    case StatusCode::kInternal: return "Internal";
  }
  return "Unknown";
}

const std::string& Status::message() const {
  static const std::string kEmpty;
  return rep_ ? rep_->message : kEmpty;
}

std::string Status::to_string() const {
  if (is_ok()) return "OK";
  return std::string(status_code_name(rep_->code)) + ": " + rep_->message;
}

}  // namespace pd
