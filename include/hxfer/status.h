// Status and StatusOr<T>: the one error vocabulary of hxfer, internal and public (every call
// of the public API in hxfer/hxfer.h returns one; no exception crosses the library boundary).
//
// Codes (their meaning is part of the API):
//   kOk                 success.
//   kInvalidArgument    the caller passed something malformed (a config, a flag, an id).
//   kCorruption         bytes from outside (a wire message, a file) fail a structural check.
//   kIncompatible       two well-formed things cannot work together (peer layouts, dtypes).
//   kUnavailable        a peer or resource is gone or unreachable; retrying later may work.
//   kTimeout            a deadline passed before the operation reached a terminal state.
//   kCancelled          the operation was cancelled by one side.
//   kResourceExhausted  a pool, queue or budget is full.
//   kNotFound           an id (request, region, peer) is not known.
//   kInternal           a broken invariant inside hxfer: a bug.
//   kPermissionDenied   a peer failed authentication (token, uid) or is not allowed to do what
//                       it asked; final for that connection, retrying does not help.
//   kExpired            what was asked for existed but its time ran out (a context rank's
//                       lease on a request's pages ended before this rank asked).
//
// Messages name the field and the values: "peer tp=3 does not divide n_groups=8".
// Thread-safety: values; safe to copy between threads.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>

namespace hxfer {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,
  kCorruption = 2,
  kIncompatible = 3,
  kUnavailable = 4,
  kTimeout = 5,
  kCancelled = 6,
  kResourceExhausted = 7,
  kNotFound = 8,
  kInternal = 9,
  kPermissionDenied = 10,
  kExpired = 11,
};

std::string_view statusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() { return Status(); }

  bool isOk() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "Incompatible: ctx ssm dtype fp32 != gen ssm dtype bf16"
  std::string toString() const;

  // Returns a copy whose message is "<context>: <message>".
  Status withContext(std::string_view context) const;

  bool operator==(const Status& other) const = default;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status OkStatus() { return Status(); }
inline Status InvalidArgument(std::string m) {
  return {StatusCode::kInvalidArgument, std::move(m)};
}
inline Status Corruption(std::string m) { return {StatusCode::kCorruption, std::move(m)}; }
inline Status Incompatible(std::string m) { return {StatusCode::kIncompatible, std::move(m)}; }
inline Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
inline Status Timeout(std::string m) { return {StatusCode::kTimeout, std::move(m)}; }
inline Status Cancelled(std::string m) { return {StatusCode::kCancelled, std::move(m)}; }
inline Status ResourceExhausted(std::string m) {
  return {StatusCode::kResourceExhausted, std::move(m)};
}
inline Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
inline Status PermissionDenied(std::string m) {
  return {StatusCode::kPermissionDenied, std::move(m)};
}
inline Status Expired(std::string m) { return {StatusCode::kExpired, std::move(m)}; }

// StatusOr<T>: a value or a non-ok Status. Accessing value() of an error aborts with the
// status printed (a bug in the caller, never reachable from bad input).
template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(const Status& status) : status_(status) { checkNotOk(); }
  StatusOr(Status&& status) : status_(std::move(status)) { checkNotOk(); }
  StatusOr(const T& value) : value_(value) {}
  StatusOr(T&& value) : value_(std::move(value)) {}
  template <typename U>
  requires(std::is_constructible_v<T, U&&> && !std::is_same_v<std::decay_t<U>, T> &&
           !std::is_same_v<std::decay_t<U>, Status>) StatusOr(U&& value)
      : value_(T(std::forward<U>(value))) {}

  bool isOk() const { return status_.isOk(); }
  const Status& status() const { return status_; }

  const T& value() const& {
    checkOk();
    return *value_;
  }
  T& value() & {
    checkOk();
    return *value_;
  }
  T&& value() && {
    checkOk();
    return std::move(*value_);
  }
  const T& operator*() const& { return value(); }
  T& operator*() & { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  const T* operator->() const { return &value(); }
  T* operator->() { return &value(); }

 private:
  void checkNotOk();
  void checkOk() const;

  Status status_;
  std::optional<T> value_;
};

[[noreturn]] void dieOnBadStatusAccess(const Status& status);

template <typename T>
void StatusOr<T>::checkNotOk() {
  if (status_.isOk()) status_ = Internal("StatusOr constructed from an ok Status");
}

template <typename T>
void StatusOr<T>::checkOk() const {
  if (!status_.isOk()) dieOnBadStatusAccess(status_);
}

}  // namespace hxfer
