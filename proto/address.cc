#include "proto/address.h"

#include <arpa/inet.h>

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvrelay {
namespace {

// The bytes of an IPv4 or IPv6 address, or "" for anything else.
std::string IpBytes(absl::string_view s) {
  const std::string z(s);
  unsigned char buf[16];
  if (inet_pton(AF_INET, z.c_str(), buf) == 1) return std::string(reinterpret_cast<char*>(buf), 4);
  if (inet_pton(AF_INET6, z.c_str(), buf) == 1) return std::string(reinterpret_cast<char*>(buf), 16);
  return "";
}

}  // namespace

absl::Status CheckGrpcTarget(absl::string_view addr) {
  auto bad = [&addr] {
    return absl::InvalidArgumentError(absl::StrCat(
        "address '", addr, "': expected HOST:PORT with PORT in 1..65535 (or a gRPC target such as dns:///HOST:PORT)"));
  };
  if (addr.empty()) return bad();
  // gRPC's resolvers; another scheme (http://...) would only fail later.
  for (absl::string_view scheme :
       {"dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:", "xds:", "google-c2p:"}) {
    // gRPC matches the scheme exactly (DNS:/// is not dns:///).
    if (absl::StartsWith(addr, scheme)) return addr.size() > scheme.size() ? absl::OkStatus() : bad();
  }
  const size_t colon = addr.rfind(':');
  if (addr[0] == '[') {
    const size_t close = addr.find(']');
    if (close == absl::string_view::npos || close + 1 != colon) return bad();
  } else if (colon == 0 || addr.find(':') != colon) {
    return bad();  // no host, or a bare IPv6 address without brackets
  }
  int port;
  if (colon == absl::string_view::npos || !absl::SimpleAtoi(addr.substr(colon + 1), &port) || port < 1 ||
      port > 65535 || addr.find_first_of(" \t,") != absl::string_view::npos) {
    return bad();
  }
  return absl::OkStatus();
}

bool SameHost(absl::string_view a, absl::string_view b) {
  const std::string ia = IpBytes(a), ib = IpBytes(b);
  if (!ia.empty() || !ib.empty()) return ia == ib;
  return absl::EqualsIgnoreCase(a, b);
}

}  // namespace kvrelay
