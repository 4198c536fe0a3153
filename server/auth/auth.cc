#include "server/auth/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <arpa/inet.h>
#include <openssl/x509.h>

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/mutex.h"
#include "core/status_macros.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_certificate_verifier.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "proto/address.h"
#include "server/metrics/metrics.h"
#include "spdlog/spdlog.h"

namespace kvrelay {
namespace {

// The first value of auth-context property `name`, "" when absent.
std::string Property(const grpc::AuthContext* ac, const char* name) {
  if (!ac) return "";
  std::vector<grpc::string_ref> v = ac->FindPropertyValues(name);
  return v.empty() ? std::string() : std::string(v[0].data(), v[0].size());
}

std::vector<std::string> Properties(const grpc::AuthContext* ac, const char* name) {
  std::vector<std::string> out;
  if (!ac) return out;
  for (const grpc::string_ref& r : ac->FindPropertyValues(name)) out.emplace_back(r.data(), r.size());
  return out;
}

// A DNS SAN as TLS matches it: exact, or "*.rest" for one more label.
bool DnsSanMatches(absl::string_view san, absl::string_view host) {
  if (absl::StartsWith(san, "*.")) return IdentityMatches(san, host);
  return absl::EqualsIgnoreCase(san, host);
}

// Whether a certificate with these DNS and IP SANs names `host`.
bool NamesHost(const std::vector<std::string>& dns, const std::vector<std::string>& ips, absl::string_view host) {
  if (host.empty()) return false;
  for (const std::string& d : dns) {
    if (DnsSanMatches(d, host)) return true;
  }
  for (const std::string& ip : ips) {
    if (SameHost(ip, host)) return true;
  }
  return false;
}

std::vector<std::string> Strings(const std::vector<grpc::string_ref>& refs) {
  std::vector<std::string> out;
  for (const grpc::string_ref& r : refs) out.emplace_back(r.data(), r.size());
  return out;
}

// Checks, after the chain was verified against the peer CA, that the
// destination relay is the one the target names.
class PeerVerifier final : public grpc::experimental::ExternalCertificateVerifier {
 public:
  PeerVerifier(std::vector<std::string> identities, Metrics* metrics)
      : identities_(std::move(identities)), metrics_(metrics) {}

  bool Verify(grpc::experimental::TlsCustomVerificationCheckRequest* request,
              std::function<void(grpc::Status)> /*callback*/, grpc::Status* sync_status) override {
    const std::string target(request->target_name().data(), request->target_name().size());
    const std::string host = TargetHost(target);
    if (NamesHost(Strings(request->dns_names()), Strings(request->ip_names()), host)) return Ok(sync_status);
    for (const grpc::string_ref& u : request->uri_names()) {
      for (const std::string& p : identities_) {
        if (IdentityMatches(p, absl::string_view(u.data(), u.size()))) return Ok(sync_status);
      }
    }
    if (metrics_) metrics_->AddAuthFailure(AuthFailureName(AuthFailure::kBadCertificate));
    *sync_status = grpc::Status(
        grpc::UNAUTHENTICATED,
        absl::StrCat("the certificate of relay ", target, " names neither host '", host,
                     "' (DNS or IP SAN) nor a --peer-identity (URI SAN)"));
    return true;
  }
  void Cancel(grpc::experimental::TlsCustomVerificationCheckRequest*) override {}

 private:
  static bool Ok(grpc::Status* s) {
    *s = grpc::Status::OK;
    return true;
  }
  const std::vector<std::string> identities_;
  Metrics* const metrics_;
};

std::shared_ptr<grpc::experimental::FileWatcherCertificateProvider> Provider(const TlsFiles& f,
                                                                            const std::string& ca,
                                                                            unsigned refresh_seconds) {
  if (ca.empty()) {
    return std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(f.key, f.cert, refresh_seconds);
  }
  return std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(f.key, f.cert, ca, refresh_seconds);
}

}  // namespace

const char* AuthFailureName(AuthFailure f) {
  switch (f) {
    case AuthFailure::kMissingCredentials: return "missing_credentials";
    case AuthFailure::kBadToken: return "bad_token";
    case AuthFailure::kBadCertificate: return "bad_certificate";
    case AuthFailure::kPeerNotAllowed: return "peer_not_allowed";
    case AuthFailure::kForbidden: return "forbidden";
  }
  return "forbidden";
}

std::string MatchingIdentity(absl::string_view pattern, const Caller& caller) {
  const bool uri = absl::StrContains(pattern, "://");
  for (const std::vector<std::string>* sans : uri ? std::vector<const std::vector<std::string>*>{&caller.uris}
                                                  : std::vector<const std::vector<std::string>*>{&caller.dns,
                                                                                                 &caller.ips}) {
    for (const std::string& san : *sans) {
      if (IdentityMatches(pattern, san)) return san;
    }
  }
  return "";
}

std::string TargetHost(absl::string_view t) {
  if (absl::StartsWith(t, "unix:") || absl::StartsWith(t, "unix-abstract:")) return "";
  if (absl::StartsWith(t, "dns:")) {
    t.remove_prefix(4);
    if (absl::StartsWith(t, "//")) {  // dns://AUTHORITY/HOST:PORT
      const size_t slash = t.find('/', 2);
      t = slash == absl::string_view::npos ? absl::string_view() : t.substr(slash + 1);
    }
  } else if (absl::StartsWith(t, "ipv4:") || absl::StartsWith(t, "ipv6:")) {
    t.remove_prefix(5);
    t = t.substr(0, t.find(','));
  }
  if (std::count(t.begin(), t.end(), ':') > 1 && !absl::StrContains(t, '[')) {
    return std::string(t);  // a bare IPv6 address
  }
  if (absl::StartsWith(t, "[")) {
    const size_t close = t.find(']');
    return close == absl::string_view::npos ? std::string() : std::string(t.substr(1, close - 1));
  }
  const size_t colon = t.rfind(':');
  return std::string(colon == absl::string_view::npos ? t : t.substr(0, colon));
}

bool Caller::MayActAs(absl::string_view a) const {
  return kind == Kind::kAnyAgent || (kind == Kind::kAgent && agent == a);
}

bool Caller::PeerIsHost(absl::string_view host) const {
  if (kind != Kind::kPeer) return false;
  if (identity.empty() && sans.empty()) return true;
  return NamesHost(dns, ips, host);
}

std::string Caller::Describe() const {
  switch (kind) {
    case Kind::kAnyAgent: return "an unauthenticated caller";
    case Kind::kAgent: return absl::StrCat("agent \"", agent, "\"");
    case Kind::kPeer: return identity.empty() ? "a peer relay" : absl::StrCat("peer relay \"", identity, "\"");
  }
  return "";
}

Authenticator::Authenticator(const AuthOptions& opts, Metrics* metrics)
    : opts_(opts), metrics_(metrics), tokens_(std::make_shared<std::vector<TokenEntry>>()) {}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::Create(const AuthOptions& opts, Metrics* metrics) {
  std::unique_ptr<Authenticator> a(new Authenticator(opts, metrics));
  if (!opts.tokens_file.empty()) {
    Authenticator* p = a.get();
    KVRELAY_ASSIGN_OR_RETURN(
        a->tokens_file_,
        WatchedFile::Start(
            "--tokens-file", opts.tokens_file, opts.poll_interval,
            [p](const std::string& content) {
              KVRELAY_ASSIGN_OR_RETURN(auto entries,
                                       ParseTokensFile(content, absl::StrCat("--tokens-file=", p->opts_.tokens_file)));
              MutexLock lock(&p->mu_);
              p->tokens_ = std::make_shared<const std::vector<TokenEntry>>(std::move(entries));
              return absl::OkStatus();
            },
            [p] {
              MutexLock lock(&p->mu_);
              return absl::StrCat("the last good tokens (", p->tokens_->size(), " entries)");
            },
            opts.time));
  }
  return a;
}

absl::Status Authenticator::ReloadTokens() { return tokens_file_ ? tokens_file_->ReloadNow() : absl::OkStatus(); }

std::optional<std::string> Authenticator::LookupToken(absl::string_view token) const {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  if (EVP_Digest(token.data(), token.size(), md, &n, EVP_sha256(), nullptr) != 1 || n != 32) return std::nullopt;
  std::shared_ptr<const std::vector<TokenEntry>> tokens;
  {
    MutexLock lock(&mu_);
    tokens = tokens_;
  }
  // Every entry is compared, in constant time each, whatever matches.
  const TokenEntry* found = nullptr;
  for (const TokenEntry& e : *tokens) {
    if (CRYPTO_memcmp(e.digest.data(), md, e.digest.size()) == 0 && found == nullptr) found = &e;
  }
  if (!found) return std::nullopt;
  return found->agent;
}

absl::Status Authenticator::Refuse(const grpc::ServerContextBase& ctx, absl::string_view rpc, AuthFailure reason,
                                   absl::Status status) const {
  if (metrics_) metrics_->AddAuthFailure(AuthFailureName(reason));
  // At most 10 lines a second: a flood of bad calls must not flood the log.
  constexpr int kLinesPerSecond = 10;
  MutexLock lock(&log_mu_);
  const auto now = std::chrono::steady_clock::now();
  if (now - log_window_ >= std::chrono::seconds(1)) {
    if (log_suppressed_ > 0) spdlog::warn("auth: {} more refusals not logged in the last second", log_suppressed_);
    log_window_ = now;
    log_lines_ = 0;
    log_suppressed_ = 0;
  }
  if (log_lines_++ < kLinesPerSecond) {
    spdlog::warn("auth: refused rpc={} reason={} peer={}", std::string(rpc), AuthFailureName(reason), ctx.peer());
  } else {
    ++log_suppressed_;
  }
  return status;
}

absl::Status Authenticator::Forbid(const grpc::ServerContextBase& ctx, absl::string_view rpc,
                                   const std::string& message) const {
  return Refuse(ctx, rpc, AuthFailure::kForbidden, absl::PermissionDeniedError(message));
}

absl::StatusOr<Caller> Authenticator::Agent(const grpc::ServerContextBase& ctx, absl::string_view rpc) const {
  const std::shared_ptr<const grpc::AuthContext> ac = ctx.auth_context();
  const bool local = Property(ac.get(), GRPC_TRANSPORT_SECURITY_TYPE_PROPERTY_NAME) == "local";
  const bool required = local ? opts_.local_auth == LocalAuth::kToken : !opts_.tokens_file.empty();
  if (!required) return Caller{};
  const auto& md = ctx.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) {
    return Refuse(ctx, rpc, AuthFailure::kMissingCredentials,
                  absl::UnauthenticatedError(absl::StrCat(
                      rpc, ": no credentials: expected metadata 'authorization: Bearer TOKEN' with an agent's token "
                           "from --tokens-file")));
  }
  absl::string_view v(it->second.data(), it->second.size());
  constexpr absl::string_view kBearer = "bearer ";
  if (v.size() <= kBearer.size() || !absl::StartsWithIgnoreCase(v, kBearer)) {
    return Refuse(ctx, rpc, AuthFailure::kBadToken,
                  absl::UnauthenticatedError(absl::StrCat(
                      rpc, ": metadata 'authorization' is not 'Bearer TOKEN' (its value is not shown)")));
  }
  std::optional<std::string> agent = LookupToken(absl::StripAsciiWhitespace(v.substr(kBearer.size())));
  if (!agent) {
    return Refuse(ctx, rpc, AuthFailure::kBadToken,
                  absl::UnauthenticatedError(absl::StrCat(rpc, ": the bearer token is not one --tokens-file lists")));
  }
  Caller c;
  c.kind = Caller::Kind::kAgent;
  c.agent = std::move(*agent);
  return c;
}

absl::StatusOr<Caller> Authenticator::Peer(const grpc::ServerContextBase& ctx, absl::string_view rpc) const {
  Caller c;
  c.kind = Caller::Kind::kPeer;
  if (!opts_.tls) {
    if (opts_.tokens_file.empty()) return c;
    return Refuse(ctx, rpc, AuthFailure::kMissingCredentials,
                  absl::UnauthenticatedError(absl::StrCat(
                      rpc, ": relay-to-relay calls need mTLS, and this relay has no --tls-cert (a token cannot "
                           "vouch for a relay)")));
  }
  const std::shared_ptr<const grpc::AuthContext> ac = ctx.auth_context();
  const std::string type = Property(ac.get(), GRPC_TRANSPORT_SECURITY_TYPE_PROPERTY_NAME);
  if ((type != "ssl" && type != "tls") || Property(ac.get(), GRPC_X509_PEM_CERT_PROPERTY_NAME).empty()) {
    return Refuse(ctx, rpc, AuthFailure::kMissingCredentials,
                  absl::UnauthenticatedError(absl::StrCat(
                      rpc, ": relay-to-relay calls need a verified client certificate (mTLS on a --listen "
                           "address)")));
  }
  c.sans = Properties(ac.get(), GRPC_X509_SAN_PROPERTY_NAME);
  c.dns = Properties(ac.get(), GRPC_PEER_DNS_PROPERTY_NAME);
  c.ips = Properties(ac.get(), GRPC_PEER_IP_PROPERTY_NAME);
  c.uris = Properties(ac.get(), GRPC_PEER_URI_PROPERTY_NAME);
  for (const std::string& p : opts_.peer_identities) {
    c.identity = MatchingIdentity(p, c);
    if (!c.identity.empty()) return c;
  }
  return Refuse(ctx, rpc, AuthFailure::kPeerNotAllowed,
                absl::PermissionDeniedError(absl::StrCat(
                    rpc, ": the peer certificate's SANs (", c.sans.empty() ? "none" : absl::StrJoin(c.sans, ", "),
                    ") match no --peer-identity", opts_.peer_identities.empty() ? " (none is configured)" : "")));
}

namespace {

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};

absl::StatusOr<std::unique_ptr<BIO, BioFree>> OpenPem(const char* flag, const std::string& path) {
  std::unique_ptr<BIO, BioFree> bio(BIO_new_file(path.c_str(), "r"));
  if (!bio) return absl::InvalidArgumentError(absl::StrCat(flag, "=", path, ": cannot open it"));
  return bio;
}

// The certificates of a PEM bundle (at least one).
absl::StatusOr<std::vector<std::unique_ptr<X509, X509Free>>> ReadCerts(const char* flag, const std::string& path) {
  KVRELAY_ASSIGN_OR_RETURN(auto bio, OpenPem(flag, path));
  std::vector<std::unique_ptr<X509, X509Free>> out;
  while (X509* x = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) out.emplace_back(x);
  if (out.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, "=", path, ": no PEM certificate in it"));
  }
  return out;
}

}  // namespace

absl::Status CheckTlsFiles(const TlsFiles& f) {
  KVRELAY_ASSIGN_OR_RETURN(auto chain, ReadCerts("--tls-cert", f.cert));
  KVRELAY_ASSIGN_OR_RETURN(auto kbio, OpenPem("--tls-key", f.key));
  std::unique_ptr<EVP_PKEY, KeyFree> key(PEM_read_bio_PrivateKey(kbio.get(), nullptr, nullptr, nullptr));
  if (!key) return absl::InvalidArgumentError(absl::StrCat("--tls-key=", f.key, ": no PEM private key in it"));
  if (X509_check_private_key(chain[0].get(), key.get()) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-key=", f.key, ": not the key of the certificate in --tls-cert=", f.cert));
  }
  if (X509_cmp_current_time(X509_get0_notAfter(chain[0].get())) < 0 ||
      X509_cmp_current_time(X509_get0_notBefore(chain[0].get())) > 0) {
    spdlog::warn("--tls-cert={}: the certificate is not valid now (expired or not yet valid); clients will "
                 "refuse it until the file is renewed", f.cert);
  }
  if (!f.client_ca.empty()) KVRELAY_RETURN_IF_ERROR(ReadCerts("--tls-client-ca", f.client_ca).status());
  if (!f.peer_ca.empty()) KVRELAY_RETURN_IF_ERROR(ReadCerts("--tls-peer-ca", f.peer_ca).status());
  return absl::OkStatus();
}

std::shared_ptr<grpc::ServerCredentials> TlsServerCredentials(const TlsFiles& files, unsigned refresh_seconds) {
  grpc::experimental::TlsServerCredentialsOptions o(Provider(files, files.client_ca, refresh_seconds));
  o.watch_identity_key_cert_pairs();
  if (!files.client_ca.empty()) {
    o.watch_root_certs();
    o.set_cert_request_type(GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    o.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  return grpc::experimental::TlsServerCredentials(o);
}

std::shared_ptr<grpc::ChannelCredentials> PeerChannelCredentials(const TlsFiles& files, unsigned refresh_seconds,
                                                                 const std::vector<std::string>& peer_identities,
                                                                 Metrics* metrics) {
  grpc::experimental::TlsChannelCredentialsOptions o;
  o.set_certificate_provider(Provider(files, files.peer_ca, refresh_seconds));
  o.watch_identity_key_cert_pairs();
  o.watch_root_certs();
  o.set_verify_server_certs(true);
  o.set_check_call_host(false);  // PeerVerifier checks the host, and SPIFFE URIs too
  o.set_certificate_verifier(
      grpc::experimental::ExternalCertificateVerifier::Create<PeerVerifier>(peer_identities, metrics));
  return grpc::experimental::TlsCredentials(o);
}

}  // namespace kvrelay
