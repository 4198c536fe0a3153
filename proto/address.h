// Relay addresses as gRPC dials them: the one check shared by the clients
// (RelayClient's CheckRelayAddress, kvrelayctl --addr) and the relay's own
// configuration (--route, --route-template, --advertise).
//
// Thread-safety: pure functions.
#ifndef KVRELAY_PROTO_ADDRESS_H_
#define KVRELAY_PROTO_ADDRESS_H_

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

// Whether `a` and `b` name the same host: equal IP addresses (any
// spelling inet_pton reads), else equal names ASCII case-insensitively.
bool SameHost(absl::string_view a, absl::string_view b);

}  // namespace kvrelay

#endif  // KVRELAY_PROTO_ADDRESS_H_
