#include "server/config/config.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/status_macros.h"
#include "proto/address.h"
#include "server/config/flags.h"

namespace kvrelay {
namespace {

// The rules between the security flags, checked once every source is in.
absl::Status CheckSecurity(const ServerConfig& c) {
  if (c.tls_cert.empty() != c.tls_key.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(c.tls_cert.empty() ? "--tls-key" : "--tls-cert",
                                                   ": expected together with ",
                                                   c.tls_cert.empty() ? "--tls-cert" : "--tls-key"));
  }
  const bool tls = !c.tls_cert.empty();
  if (!tls) {
    for (const auto& [flag, set] : {std::pair<const char*, bool>{"--tls-client-ca", !c.tls_client_ca.empty()},
                                    {"--tls-peer-ca", !c.tls_peer_ca.empty()},
                                    {"--peer-identity", !c.peer_identities.empty()}}) {
      if (set) return absl::InvalidArgumentError(absl::StrCat(flag, ": needs --tls-cert FILE and --tls-key FILE"));
    }
  }
  if (!c.peer_identities.empty() && c.tls_client_ca.empty()) {
    return absl::InvalidArgumentError(
        "--peer-identity: needs --tls-client-ca FILE (relays prove who they are with a client certificate, which "
        "is requested only with a client CA)");
  }
  for (const std::string& a : c.local_listen) {
    if (absl::StartsWith(a, kUnixPrefix)) continue;
    std::string host;
    int port;
    if (!SplitHostPort(a, &host, &port).ok() || !IsLoopbackHost(host)) {
      return FlagError("local-listen", a,
                 "a loopback HOST:PORT (127.0.0.1, ::1 or localhost) or unix:PATH: local listeners are plaintext "
                 "for the pod's own agents; use --listen for other addresses");
    }
  }
  for (const std::string& a : c.local_listen) {
    if (std::find(c.listen.begin(), c.listen.end(), a) != c.listen.end()) {
      return absl::InvalidArgumentError(absl::StrCat("--local-listen=", a, ": also given as --listen"));
    }
  }
  if (c.local_auth == "token" && c.tokens_file.empty()) {
    return absl::InvalidArgumentError("--local-auth=token: needs --tokens-file FILE");
  }
  const bool routes = !c.routes.empty() || !c.route_file.empty() || !c.route_template.empty();
  if (tls && routes && c.tls_peer_ca.empty() && c.tls_client_ca.empty()) {
    return absl::InvalidArgumentError(
        "--tls-cert with routes: forwards to other relays use mTLS, so the relay must verify them; add "
        "--tls-peer-ca FILE (or --tls-client-ca FILE, its default)");
  }
  if (!tls && !c.insecure) {
    for (const std::string& a : c.listen) {
      if (absl::StartsWith(a, kUnixPrefix)) continue;
      std::string host;
      int port;
      if (SplitHostPort(a, &host, &port).ok() && !IsLoopbackHost(host)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--listen=", a,
            ": plaintext on a non-loopback address; add --tls-cert FILE --tls-key FILE (and --tls-client-ca FILE "
            "for mTLS), or --insecure to serve plaintext anyway, or --local-listen for the pod's own agents"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckServerConfig(const ServerConfig& c) {
  KVRELAY_RETURN_IF_ERROR(CheckSecurity(c));
  if (c.max_outbox_bytes_per_destination > c.max_outbox_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-outbox-bytes-per-destination=", c.max_outbox_bytes_per_destination,
        ": expected at most --max-outbox-bytes=", c.max_outbox_bytes, " (bytes)"));
  }
  return absl::OkStatus();
}

bool ServesPlaintextOffLoopback(const ServerConfig& c) {
  if (!c.tls_cert.empty()) return false;
  for (const std::string& a : c.listen) {
    std::string host;
    int port;
    if (!absl::StartsWith(a, kUnixPrefix) && SplitHostPort(a, &host, &port).ok() && !IsLoopbackHost(host)) {
      return true;
    }
  }
  return false;
}

const std::string& ServerConfig::PolicyForRole(const std::string& role) const {
  auto it = role_policies.find(role);
  return it == role_policies.end() ? default_policy : it->second;
}

}  // namespace kvrelay
