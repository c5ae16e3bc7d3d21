#include "common/status.h"

#include <cstdio>
#include <cstdlib>

namespace hxfer {

std::string_view statusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kInvalidArgument:
      return "InvalidArgument";
    case StatusCode::kCorruption:
      return "Corruption";
    case StatusCode::kIncompatible:
      return "Incompatible";
    case StatusCode::kUnavailable:
      return "Unavailable";
    case StatusCode::kTimeout:
      return "Timeout";
    case StatusCode::kCancelled:
      return "Cancelled";
    case StatusCode::kResourceExhausted:
      return "ResourceExhausted";
    case StatusCode::kNotFound:
      return "NotFound";
    case StatusCode::kInternal:
      return "Internal";
    case StatusCode::kPermissionDenied:
      return "PermissionDenied";
    case StatusCode::kExpired:
      return "Expired";
  }
  return "Unknown";
}

std::string Status::toString() const {
  if (isOk()) return "OK";
  std::string out(statusCodeName(code_));
  out += ": ";
  out += message_;
  return out;
}

Status Status::withContext(std::string_view context) const {
  if (isOk()) return *this;
  std::string m(context);
  m += ": ";
  m += message_;
  return Status(code_, std::move(m));
}

void dieOnBadStatusAccess(const Status& status) {
  std::fprintf(stderr, "hxfer: value() of an error StatusOr: %s\n", status.toString().c_str());
  std::abort();
}

}  // namespace hxfer
