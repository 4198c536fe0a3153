#include "proto/address.h"

#include <arpa/inet.h>

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

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
  std::string host;
  int port;
  if (!SplitHostPort(addr, &host, &port).ok() || host.empty() || port < 1 ||
      (host[0] != '[' && host.find(':') != std::string::npos) ||  // a bare IPv6 address without brackets
      addr.find_first_of(" \t,") != absl::string_view::npos) {
    return bad();
  }
  return absl::OkStatus();
}

absl::Status CheckGrpcTarget(absl::string_view target, absl::string_view field) {
  absl::Status s = CheckGrpcTarget(target);
  if (s.ok()) return s;
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", s.message()));
}

absl::Status SplitHostPort(absl::string_view addr, std::string* host, int* port) {
  size_t colon;
  if (!addr.empty() && addr[0] == '[') {
    const size_t close = addr.find(']');
    if (close == absl::string_view::npos || close + 1 >= addr.size() || addr[close + 1] != ':') {
      return absl::InvalidArgumentError(absl::StrCat(addr, ": expected [V6]:PORT"));
    }
    colon = close + 1;
  } else {
    colon = addr.rfind(':');
    if (colon == absl::string_view::npos) return absl::InvalidArgumentError(absl::StrCat(addr, ": expected HOST:PORT"));
  }
  int p;
  if (!absl::SimpleAtoi(addr.substr(colon + 1), &p) || p < 0 || p > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(addr, ": port expected in 0..65535"));
  }
  *host = std::string(addr.substr(0, colon));
  *port = p;
  return absl::OkStatus();
}

bool IsLoopbackHost(absl::string_view host) {
  if (absl::StartsWith(host, "[") && absl::EndsWith(host, "]")) host = host.substr(1, host.size() - 2);
  if (host == "localhost" || host == "::1") return true;
  if (!absl::StartsWith(host, "127.")) return false;
  int octets = 0;
  for (absl::string_view o : absl::StrSplit(host, '.')) {
    int v;
    if (!absl::SimpleAtoi(o, &v) || v < 0 || v > 255) return false;
    ++octets;
  }
  return octets == 4;
}

bool SameHost(absl::string_view a, absl::string_view b) {
  const std::string ia = IpBytes(a), ib = IpBytes(b);
  if (!ia.empty() || !ib.empty()) return ia == ib;
  return absl::EqualsIgnoreCase(a, b);
}

}  // namespace kvrelay
