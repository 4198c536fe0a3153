// Relay addresses as gRPC dials them: the one check shared by the clients
// (RelayClient's CheckRelayAddress, kvrelayctl --addr) and the relay's own
// configuration (--route, --route-template, --advertise, route files), and
// the host and port of a listen address.
//
// Thread-safety: pure functions.
#ifndef KVRELAY_PROTO_ADDRESS_H_
#define KVRELAY_PROTO_ADDRESS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvrelay {

// OK when `target` is HOST:PORT (or [V6]:PORT) with PORT in 1..65535 and no
// whitespace or comma, or a target with one of gRPC's resolver schemes
// (dns:, unix:, unix-abstract:, ipv4:, ipv6:, vsock:, xds:, google-c2p:;
// e.g. "dns:///relay:50051", "unix:/run/kvrelay.sock") followed by at least
// one character, which passes as is. Otherwise InvalidArgument
// "address 'TARGET': expected ...". (gRPC itself would take a port above
// 65535 modulo 65536, and a missing port as 443.)
absl::Status CheckGrpcTarget(absl::string_view target);
// The same, with the error prefixed by `field` ("--route=a=b: address ...").
absl::Status CheckGrpcTarget(absl::string_view target, absl::string_view field);

// Splits "HOST:PORT" ("[V6]:PORT" too, HOST keeping its brackets).
// InvalidArgument unless PORT is 0..65535.
absl::Status SplitHostPort(absl::string_view addr, std::string* host, int* port);

// Whether HOST (as SplitHostPort gives it) is a loopback address: localhost,
// ::1 (bracketed or not) or 127.x.y.z.
bool IsLoopbackHost(absl::string_view host);

// Whether `a` and `b` name the same host: equal IP addresses (any
// spelling inet_pton reads), else equal names ASCII case-insensitively.
bool SameHost(absl::string_view a, absl::string_view b);

}  // namespace kvrelay

#endif  // KVRELAY_PROTO_ADDRESS_H_
