// The one place where absl::Status becomes grpc::Status. The canonical codes
// map one to one.
#ifndef KVRELAY_PROTO_STATUS_UTIL_H_
#define KVRELAY_PROTO_STATUS_UTIL_H_

#include <string>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace kvrelay {

inline grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(static_cast<int>(s.code())),
                      std::string(s.message()));
}

inline absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(static_cast<int>(s.error_code())),
                      s.error_message());
}

}  // namespace kvrelay

#endif  // KVRELAY_PROTO_STATUS_UTIL_H_
