// Who is calling the relay, and the credentials it serves and dials with.
//
// Three kinds of transport reach a call, told apart by gRPC's auth context
// (transport_security_type):
//   - "tls": a TCP --listen address with --tls-cert/--tls-key. The client
//     may present a certificate (verified against --tls-client-ca);
//   - "insecure": a TCP --listen address without TLS (loopback, or
//     --insecure);
//   - "local": a --local-listen address or any unix:PATH, always plaintext.
//
// Agents prove who they are with a bearer token (`authorization: Bearer T`
// metadata) whose SHA-256 is in --tokens-file. A token is required on
// --listen addresses whenever a tokens file is given, and on local ones
// only with --local-auth=token; otherwise the caller may act as any agent
// (with --local-auth=pod, the pod is the trust boundary). Relays prove who
// they are with a verified client certificate whose SAN matches a
// --peer-identity pattern; without TLS configured, and no tokens file,
// relay-to-relay calls are open as they were before security existed.
//
// Tokens never reach logs, errors or metrics. Each refusal is counted in
// kvrelay_auth_failures_total{reason} and logged (rate-limited) with the
// reason and the peer address only.
//
// Thread-safe.
#ifndef KVRELAY_SERVER_AUTH_AUTH_H_
#define KVRELAY_SERVER_AUTH_AUTH_H_

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/mutex.h"
#include "core/time_source.h"
#include "core/token.h"  // TokenEntry, ParseTokensFile: the tokens file
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_context.h"
#include "server/config/identity_pattern.h"
#include "server/config/watched_file.h"

namespace kvrelay {

class Metrics;
class RouteTable;
struct Caller;

// The reasons of kvrelay_auth_failures_total, a fixed set.
enum class AuthFailure { kMissingCredentials, kBadToken, kBadCertificate, kPeerNotAllowed, kForbidden };
inline constexpr AuthFailure kAuthFailures[] = {AuthFailure::kMissingCredentials, AuthFailure::kBadToken,
                                                AuthFailure::kBadCertificate, AuthFailure::kPeerNotAllowed,
                                                AuthFailure::kForbidden};
const char* AuthFailureName(AuthFailure f);

// How callers on local listeners are treated.
enum class LocalAuth { kPod, kToken };

// Whether `caller` (a kPeer with a certificate) has a SAN `pattern`
// matches, by the type rule above; the SAN that matched, or "".
std::string MatchingIdentity(absl::string_view pattern, const Caller& caller);

// The host a target names, as a certificate's SAN would: "dns:///a.b:50051"
// and "a.b:50051" give "a.b", "ipv4:10.0.0.1:7" gives "10.0.0.1",
// "[::1]:7" gives "::1"; "" for unix: targets.
std::string TargetHost(absl::string_view target);


// Who a call comes from, once authenticated.
struct Caller {
  enum class Kind {
    kAnyAgent,  // may act as any agent (local pod, or no tokens file)
    kAgent,     // an agent proven by its token
    kPeer,      // another relay (its certificate, or an open mesh without TLS)
  };
  Kind kind = Kind::kAnyAgent;
  std::string agent;  // kAgent
  // kPeer with a certificate: its SANs, by type, and all of them.
  std::vector<std::string> dns, ips, uris, sans;
  std::string identity;  // kPeer: the SAN that matched --peer-identity ("" without TLS)

  // Whether the caller may act as `agent` (kAnyAgent, or kAgent itself).
  bool MayActAs(absl::string_view agent) const;
  // Whether a kPeer caller's certificate names `host` as TLS would: a DNS
  // SAN (with "*." wildcards) or an IP SAN (compared as addresses); "" never
  // matches. True for a peer without TLS (nothing to check against).
  bool PeerIsHost(absl::string_view host) const;
  // "agent \"X\"", "an unauthenticated caller", "peer relay \"ID\"": for
  // messages.
  std::string Describe() const;
};

struct AuthOptions {
  bool tls = false;             // TCP --listen addresses serve TLS
  std::string tokens_file;      // "": none
  LocalAuth local_auth = LocalAuth::kPod;
  std::vector<std::string> peer_identities;  // checked patterns
  std::chrono::milliseconds poll_interval{1000};
  // The poller's time (not owned; outlives the authenticator).
  TimeSource* time = TimeSource::Real();
};

class Authenticator {
 public:
  // Loads the tokens file (an unreadable or bad file is the error, naming
  // --tokens-file) and starts watching it. `metrics` may be null and must
  // outlive the authenticator.
  static absl::StatusOr<std::unique_ptr<Authenticator>> Create(const AuthOptions& opts, Metrics* metrics);

  // The caller of an agent's RPC (Publish, Fetch, Ack, CloseSession,
  // MessageStatus, Stats, Compress). UNAUTHENTICATED when a token is
  // required and missing or not in the tokens file (counted).
  absl::StatusOr<Caller> Agent(const grpc::ServerContextBase& ctx, absl::string_view rpc) const;
  // The caller of a relay-to-relay RPC (Forward, ReportRecipient, a
  // propagated CloseSession): with TLS, a verified certificate
  // (UNAUTHENTICATED, missing_credentials, without one) whose SAN matches
  // a --peer-identity (PERMISSION_DENIED, peer_not_allowed, otherwise).
  // Without TLS: any caller when no tokens file is given, else
  // UNAUTHENTICATED (a token cannot vouch for a relay).
  absl::StatusOr<Caller> Peer(const grpc::ServerContextBase& ctx, absl::string_view rpc) const;

  // PERMISSION_DENIED with `message` (which names the identity and the
  // field), counted as forbidden and logged like the other refusals.
  absl::Status Forbid(const grpc::ServerContextBase& ctx, absl::string_view rpc, const std::string& message) const;

  // Re-reads the tokens file now (the poller does it every poll interval).
  absl::Status ReloadTokens();
  uint64_t token_loads() const { return tokens_file_ ? tokens_file_->loads() : 0; }

 private:
  Authenticator(const AuthOptions& opts, Metrics* metrics);
  absl::Status Refuse(const grpc::ServerContextBase& ctx, absl::string_view rpc, AuthFailure reason,
                      absl::Status status) const;
  std::optional<std::string> LookupToken(absl::string_view token) const;

  const AuthOptions opts_;
  Metrics* const metrics_;
  mutable Mutex mu_;
  std::shared_ptr<const std::vector<TokenEntry>> tokens_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<WatchedFile> tokens_file_;
  // Rate limit of the refusal log lines.
  mutable Mutex log_mu_;
  mutable std::chrono::steady_clock::time_point log_window_ ABSL_GUARDED_BY(log_mu_);
  mutable int log_lines_ ABSL_GUARDED_BY(log_mu_) = 0;
  mutable uint64_t log_suppressed_ ABSL_GUARDED_BY(log_mu_) = 0;
};

// ---- Credentials ----

struct TlsFiles {
  std::string cert, key;  // this relay's identity (PEM); reloaded when they change
  std::string client_ca;  // verifies client certificates ("" : none requested)
  std::string peer_ca;    // verifies the relays this one forwards to
};

// Checks at start-up that the files can be read and parse: the certificate
// chain and the key (which must belong to it), and each CA bundle.
// InvalidArgument naming the flag otherwise. Logs a warning when the
// certificate is expired or not yet valid.
absl::Status CheckTlsFiles(const TlsFiles& files);

// The TLS server credentials of the --listen TCP addresses: gRPC's
// FileWatcherCertificateProvider re-reads the files every
// `refresh_seconds`, so renewed certificates are served to new connections
// without a restart (calls in progress keep theirs). With a client CA,
// client certificates are requested and every one presented is verified;
// none is required (agents may come with a token only).
std::shared_ptr<grpc::ServerCredentials> TlsServerCredentials(const TlsFiles& files, unsigned refresh_seconds);

// The credentials this relay dials its peers with: its own certificate,
// the peer CA, and a check that the destination's certificate names the
// target's host (DNS or IP SAN, "*." wildcards as in TLS) or carries a URI
// SAN (e.g. SPIFFE) matching one of `peer_identities`. A destination that
// fails the check is counted as bad_certificate (`metrics` may be null).
std::shared_ptr<grpc::ChannelCredentials> PeerChannelCredentials(const TlsFiles& files, unsigned refresh_seconds,
                                                                 const std::vector<std::string>& peer_identities,
                                                                 Metrics* metrics);

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_AUTH_AUTH_H_
