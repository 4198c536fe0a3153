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

namespace kvrelay {

// Checks a relay address before dialling: InvalidArgument naming it unless
// it is HOST:PORT (or [V6]:PORT) with PORT in 1..65535, or a target with
// one of gRPC's resolver schemes (dns:, unix:, unix-abstract:, ipv4:, ipv6:,
// vsock:, xds:, google-c2p:; e.g. "dns:///relay:50051"), which passes as
// is. (gRPC itself takes a port above 65535 modulo 65536, and a missing
// port as 443.)
absl::Status CheckRelayAddress(const std::string& addr);

// grpc.health.v1 serving status.
enum class HealthStatus { kUnknown = 0, kServing = 1, kNotServing = 2, kServiceUnknown = 3 };
const char* HealthStatusName(HealthStatus s);

// grpc.health.v1.Health/Check for `service` ("" = the whole server;
// "kvrelay.v1.Relay" = the relay service) over `channel`, waiting at most
// `deadline`. kServiceUnknown for a service the server does not know (the
// protocol's NOT_FOUND); the call's status for any other failure.
absl::StatusOr<HealthStatus> CheckHealth(const std::shared_ptr<grpc::Channel>& channel,
                                         const std::string& service, std::chrono::milliseconds deadline);

}  // namespace kvrelay

#endif  // KVRELAY_PROTO_CHANNEL_H_
