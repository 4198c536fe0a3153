// What both the relay and its clients need to reach a relay: the address
// check and the grpc.health.v1 probe. Pure functions, thread-safe.
#ifndef KVRELAY_PROTO_CHANNEL_H_
#define KVRELAY_PROTO_CHANNEL_H_

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"

namespace kvrelay {

// Checks a relay address before dialling: CheckGrpcTarget (proto/address.h),
// e.g. "127.0.0.1:50051", "dns:///relay:50051" or "unix:/run/kvrelay.sock".
absl::Status CheckRelayAddress(const std::string& addr);

// grpc.health.v1 serving status.
enum class HealthStatus { kUnknown = 0, kServing = 1, kNotServing = 2, kServiceUnknown = 3 };
const char* HealthStatusName(HealthStatus s);

// grpc.health.v1.Health/Check for `service` ("" = the whole server;
// "kvrelay.v1.Relay" = the relay service) over `channel`, waiting at most
// `deadline`. kServiceUnknown for a service the server does not know (the
// protocol's NOT_FOUND); the call's status for any other failure. `ctx`:
// null, or a fresh context of the caller's to make the call with (e.g. one
// carrying metadata); the deadline is set on it.
absl::StatusOr<HealthStatus> CheckHealth(const std::shared_ptr<grpc::Channel>& channel,
                                         const std::string& service, std::chrono::milliseconds deadline,
                                         grpc::ClientContext* ctx = nullptr);

}  // namespace kvrelay

#endif  // KVRELAY_PROTO_CHANNEL_H_
