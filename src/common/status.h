// Status and StatusOr<T> (hxfer/status.h, part of the public API) and the macros the library
// uses to pass them on.
#pragma once

#include "hxfer/status.h"

#define HXFER_CONCAT_INNER_(a, b) a##b
#define HXFER_CONCAT_(a, b) HXFER_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (a Status) is not ok.
#define RETURN_IF_ERROR(expr)                        \
  do {                                               \
    ::hxfer::Status hxfer_status_ = (expr);          \
    if (!hxfer_status_.isOk()) return hxfer_status_; \
  } while (0)

// ASSIGN_OR_RETURN(auto x, F()): declares/assigns from a StatusOr or returns its error.
#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL_(HXFER_CONCAT_(hxfer_statusor_, __LINE__), lhs, expr)
#define ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                           \
  if (!tmp.isOk()) return tmp.status();        \
  lhs = std::move(tmp).value()
