// Error-propagation macros for absl::Status / absl::StatusOr.
// Debian's absl 20220623 ships no status macros, so kvrelay carries these two.
#ifndef KVRELAY_CORE_STATUS_MACROS_H_
#define KVRELAY_CORE_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KVRELAY_INTERNAL_CONCAT2(a, b) a##b
#define KVRELAY_INTERNAL_CONCAT(a, b) KVRELAY_INTERNAL_CONCAT2(a, b)

// Evaluates `expr` (an absl::Status); returns it from the caller if not ok.
#define KVRELAY_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    ::absl::Status kvrelay_status_ = (expr);           \
    if (!kvrelay_status_.ok()) return kvrelay_status_; \
  } while (0)

// Evaluates `rexpr` (an absl::StatusOr<T>); returns its status from the
// caller on error, otherwise moves the value into `lhs` (which may be a
// declaration such as `auto x`).
#define KVRELAY_ASSIGN_OR_RETURN(lhs, rexpr) \
  KVRELAY_INTERNAL_ASSIGN_OR_RETURN(         \
      KVRELAY_INTERNAL_CONCAT(kvrelay_statusor_, __LINE__), lhs, rexpr)

#define KVRELAY_INTERNAL_ASSIGN_OR_RETURN(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                                      \
  if (!tmp.ok()) return std::move(tmp).status();           \
  lhs = std::move(tmp).value()

#endif  // KVRELAY_CORE_STATUS_MACROS_H_
