// Status and Result<T>: the error convention at every module boundary.
//
// OK costs one null pointer; an error carries a code and a message that names
// the thing at fault (the field, the file, the rank, the request id).
// Exceptions thrown by third-party libraries are caught at the boundary and
// turned into a Status; asserts are for invariants only, never for input.
#pragma once

#include <cassert>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace pd {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument,
  kNotFound,
  kCorruption,
  kUnsupported,
  kResourceExhausted,
  kIoError,
  kTimeout,
  kCancelled,
  kUnavailable,  // the other side is gone (nothing was lost on this side)
  kInternal,
};

const char* status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  static Status ok() { return Status(); }
  static Status invalid_argument(std::string_view msg) { return Status(StatusCode::kInvalidArgument, msg); }
  static Status not_found(std::string_view msg) { return Status(StatusCode::kNotFound, msg); }
  static Status corruption(std::string_view msg) { return Status(StatusCode::kCorruption, msg); }
  static Status unsupported(std::string_view msg) { return Status(StatusCode::kUnsupported, msg); }
  static Status resource_exhausted(std::string_view msg) { return Status(StatusCode::kResourceExhausted, msg); }
  static Status io_error(std::string_view msg) { return Status(StatusCode::kIoError, msg); }
  static Status timeout(std::string_view msg) { return Status(StatusCode::kTimeout, msg); }
  static Status cancelled(std::string_view msg) { return Status(StatusCode::kCancelled, msg); }
  static Status unavailable(std::string_view msg) { return Status(StatusCode::kUnavailable, msg); }
  static Status internal(std::string_view msg) { return Status(StatusCode::kInternal, msg); }

  Status(const Status& o) : rep_(o.rep_ ? std::make_unique<Rep>(*o.rep_) : nullptr) {}
  Status& operator=(const Status& o) {
    if (this != &o) rep_ = o.rep_ ? std::make_unique<Rep>(*o.rep_) : nullptr;
    return *this;
  }
  Status(Status&&) noexcept = default;
  Status& operator=(Status&&) noexcept = default;

  bool is_ok() const { return rep_ == nullptr; }
  explicit operator bool() const { return is_ok(); }
  StatusCode code() const { return rep_ ? rep_->code : StatusCode::kOk; }
  const std::string& message() const;
  bool is_invalid_argument() const { return code() == StatusCode::kInvalidArgument; }
  bool is_not_found() const { return code() == StatusCode::kNotFound; }
  bool is_corruption() const { return code() == StatusCode::kCorruption; }
  bool is_unsupported() const { return code() == StatusCode::kUnsupported; }
  bool is_resource_exhausted() const { return code() == StatusCode::kResourceExhausted; }
  bool is_io_error() const { return code() == StatusCode::kIoError; }
  bool is_timeout() const { return code() == StatusCode::kTimeout; }
  bool is_cancelled() const { return code() == StatusCode::kCancelled; }
  bool is_unavailable() const { return code() == StatusCode::kUnavailable; }

  // "InvalidArgument: <message>", or "OK".
  std::string to_string() const;

 private:
  struct Rep {
    StatusCode code;
    std::string message;
  };
  Status(StatusCode code, std::string_view msg) : rep_(std::make_unique<Rep>(Rep{code, std::string(msg)})) {}
  std::unique_ptr<Rep> rep_;
};

// Result<T>: a value or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT: implicit by design
    assert(!std::get<Status>(v_).is_ok() && "Result constructed from an OK status");
  }
  bool is_ok() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return is_ok(); }
  const Status& status() const {
    static const Status kOk;
    return is_ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

#define PD_RETURN_IF_ERROR(expr)            \
  do {                                      \
    ::pd::Status pd_status_ = (expr);       \
    if (!pd_status_.is_ok()) return pd_status_; \
  } while (0)

#define PD_CONCAT_INNER_(a, b) a##b
#define PD_CONCAT_(a, b) PD_CONCAT_INNER_(a, b)
#define PD_ASSIGN_OR_RETURN(lhs, expr) PD_ASSIGN_OR_RETURN_IMPL_(PD_CONCAT_(pd_result_, __LINE__), lhs, expr)
#define PD_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.is_ok()) return tmp.status();          \
  lhs = std::move(tmp).value()

}  // namespace pd
