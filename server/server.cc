#include "server/server.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/mutex.h"
#include "core/pipeline.h"
#include "proto/address.h"
#include "core/status_macros.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/server_builder.h"
#include "server/store/memory_store.h"
#include "server/store/spool_store.h"
#include "server/mesh/forwarder.h"
#include "server/mesh/routing.h"
#include "server/auth/auth.h"
#include "spdlog/spdlog.h"

#if defined(KVRELAY_CIVETWEB_FEATURES)
#include "civetweb.h"
#endif

namespace kvrelay {
namespace {

// Hands the forwards a restart found in the spool's outbox to the forwarder,
// reserving their bytes like a publish does (past the outbox limits they go
// all the same: they were accepted).
void ResumeForwards(SpoolStore& spool, Forwarder* fwd) {
  for (const SpoolStore::PendingForward& p : spool.RecoveredOutbox()) {
    const uint64_t bytes = p.msg->bytes;
    if (!spool.ReserveOutbox(p.target, bytes).ok()) {
      spdlog::warn("spool: resuming the forward of session={} message={} to {} past the outbox limits",
                   p.msg->session_id, p.msg->message_id, p.target);
    }
    spdlog::info("spool: resuming the forward of session={} message={} to {} for {}", p.msg->session_id,
                 p.msg->message_id, p.target, absl::StrJoin(p.agents, ","));
    fwd->Enqueue(p.target, p.agents, ForwardHeaderOf(*p.msg), ForwardSource::OfCommitted(p.msg), bytes);
  }
}

// Whether the metrics HTTP server can listen on IPv6 (unknown: assume so).
bool MetricsServerHasIpv6() {
#if defined(KVRELAY_CIVETWEB_FEATURES)
  constexpr unsigned kCivetwebIpv6 = 8;  // mg_check_feature: built with IPv6
  return mg_check_feature(kCivetwebIpv6) != 0;
#else
  return true;
#endif
}

// Before binding unix:PATH (`addr`): OK when PATH does not exist, or was a
// socket nobody accepts on, which is removed. gRPC would remove any socket,
// and so take over the PATH of a relay still serving on it.
absl::Status PrepareUnixSocket(const std::string& flag, const std::string& addr) {
  const std::string path = addr.substr(strlen(kUnixPrefix));
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return absl::UnavailableError(absl::StrCat(flag, "=", addr, ": ", std::strerror(errno)));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::UnavailableError(
        absl::StrCat(flag, "=", addr, ": exists and is not a socket (left as it is; expected a free path)"));
  }
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  if (path.size() >= sizeof(sa.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(flag, "=", addr, ": path longer than 107 bytes"));
  }
  std::memcpy(sa.sun_path, path.data(), path.size());
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat(flag, "=", addr, ": socket: ", std::strerror(errno)));
  const int r = connect(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof(sa));
  const int err = errno;
  close(fd);
  if (r == 0) {
    return absl::UnavailableError(absl::StrCat(flag, "=", addr, ": another process is serving on this socket"));
  }
  if (err != ECONNREFUSED) {
    return absl::UnavailableError(absl::StrCat(flag, "=", addr, ": cannot tell whether the socket is in use: ",
                                               std::strerror(err)));
  }
  if (unlink(path.c_str()) != 0 && errno != ENOENT) {
    return absl::UnavailableError(
        absl::StrCat(flag, "=", addr, ": cannot remove the stale socket: ", std::strerror(errno)));
  }
  spdlog::info("{}={}: removed a stale socket (nothing accepted on it)", flag, addr);
  return absl::OkStatus();
}

}  // namespace

// Keeps a ServerBuilder from adding the process-wide plugins (reflection):
// the health port serves grpc.health.v1 alone.
class NoPlugins final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override { plugins->clear(); }
};

// Everything but grpc.health.v1 on the health port: UNIMPLEMENTED. (It also
// gives that server the callback queue gRPC requires of every server.)
class UnimplementedService final : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override {
    class Refused final : public grpc::ServerGenericBidiReactor {
     public:
      explicit Refused(const std::string& method) {
        Finish(grpc::Status(grpc::UNIMPLEMENTED,
                            absl::StrCat(method, ": the health port (--health-listen) serves grpc.health.v1 only")));
      }
      void OnDone() override { delete this; }
    };
    return new Refused(ctx->method());
  }
};

// The addresses a gRPC server listens on, each with its credentials.
// How often TLS certificate files are read again (seconds).
constexpr unsigned kCertRefreshSeconds = 1;

struct Listener {
  std::string addr, flag;  // flag: "--listen", "--local-listen" or "--health-listen"
  std::string host;        // "" for a Unix socket
  std::shared_ptr<grpc::ServerCredentials> creds;
  int port = 0;            // filled by BuildAndStart
};

// Checks that every listener is bound (BuildAndStart fills the ports up to
// the first address it cannot bind), makes sockets mode 0666, and appends
// the bound addresses to `out`.
absl::Status CheckBound(const grpc::Server* server, std::vector<Listener>& ls, std::vector<std::string>* out) {
  for (const Listener& l : ls) {
    const bool unix_socket = l.host.empty();
    if (!server || l.port == 0) {
      return absl::UnavailableError(absl::StrCat(
          l.flag, "=", l.addr,
          unix_socket ? ": cannot listen (the directory does not exist or is not writable; gRPC's log above has "
                        "the system error)"
                      : ": cannot listen (the port is in use, or the address is not one of this host's; gRPC's log "
                        "above has the system error)"));
    }
    if (unix_socket) {
      if (chmod(l.addr.c_str() + strlen(kUnixPrefix), 0666) != 0) {
        spdlog::warn("{}={}: cannot make the socket mode 0666: {}", l.flag, l.addr, std::strerror(errno));
      }
      out->push_back(l.addr);
    } else {
      out->push_back(absl::StrCat(l.host, ":", l.port));
    }
  }
  return absl::OkStatus();
}

namespace {

// The gRPC listeners of --listen and --local-listen, with their credentials.
absl::StatusOr<std::vector<Listener>> ListenersOf(const ServerConfig& config,
                                                  const std::shared_ptr<grpc::ServerCredentials>& tls_creds) {
  std::vector<Listener> listeners;
  for (const auto& [flag, addrs] : {std::pair<const char*, const std::vector<std::string>*>{"--listen", &config.listen},
                                    {"--local-listen", &config.local_listen}}) {
    const bool local = std::string(flag) == "--local-listen";
    for (const std::string& addr : *addrs) {
      Listener l;
      l.addr = addr;
      l.flag = flag;
      if (absl::StartsWith(addr, kUnixPrefix)) {
        l.creds = grpc::experimental::LocalServerCredentials(UDS);
      } else {
        int port;
        absl::Status hs = SplitHostPort(addr, &l.host, &port);
        if (!hs.ok()) return absl::InvalidArgumentError(absl::StrCat(flag, "=", hs.message()));
        l.creds = local       ? grpc::experimental::LocalServerCredentials(LOCAL_TCP)
                  : tls_creds ? tls_creds
                              : grpc::InsecureServerCredentials();
      }
      listeners.push_back(std::move(l));
    }
  }
  return listeners;
}

// The store --spool-dir asks for (durable), or the in-memory one; `*spool`
// is the durable store, or null.
absl::StatusOr<std::unique_ptr<Store>> OpenStore(const ServerConfig& config, Metrics* metrics, TimeSource* time,
                                                 SpoolStore** spool) {
  StoreLimits limits;
  limits.max_inflight_bytes = config.max_inflight_bytes;
  limits.max_mailbox_bytes = config.max_mailbox_bytes;
  limits.max_session_messages = config.max_session_messages;
  limits.max_session_bytes = config.max_session_bytes;
  limits.max_store_bytes = config.max_store_bytes;
  limits.session_ttl_seconds = config.session_ttl_seconds;
  limits.max_outbox_bytes = config.max_outbox_bytes;
  limits.max_outbox_bytes_per_destination = config.max_outbox_bytes_per_destination;
  metrics->SetLimit("outbox", static_cast<double>(config.max_outbox_bytes));
  metrics->SetLimit("inflight", static_cast<double>(config.max_inflight_bytes));
  metrics->SetLimit("mailbox", static_cast<double>(config.max_mailbox_bytes));
  metrics->SetLimit("session", static_cast<double>(config.max_session_bytes));
  metrics->SetLimit("store", static_cast<double>(config.max_store_bytes));
  *spool = nullptr;
  if (config.spool_dir.empty()) return std::make_unique<MemoryStore>(limits, metrics, time);
  SpoolOptions so;
  so.dir = config.spool_dir;
  so.fsync = config.fsync != "never";
  so.max_spool_bytes = config.max_spool_bytes;
  so.compact_bytes = config.spool_compact_bytes;
  so.salvage = config.spool_salvage;
  so.message_body = config.wire_codec_rans ? MessageBody::kCoded : MessageBody::kPlain;
  if (!so.fsync) {
    spdlog::warn("--fsync=never: the spool is not synced; a power loss or kernel crash loses what the kernel had "
                 "not written (for benchmarks only)");
  }
  KVRELAY_ASSIGN_OR_RETURN(std::unique_ptr<SpoolStore> store, SpoolStore::Open(limits, so, metrics, time));
  if (config.max_spool_bytes) metrics->SetLimit("spool", static_cast<double>(config.max_spool_bytes));
  *spool = store.get();
  return store;
}

absl::StatusOr<std::unique_ptr<RouteTable>> OpenRoutes(const ServerConfig& config, TimeSource* time) {
  RouteOptions ro;
  ro.routes = config.routes;
  ro.route_file = config.route_file;
  ro.route_template = config.route_template;
  ro.advertise = config.advertise;
  ro.time = time;
  KVRELAY_ASSIGN_OR_RETURN(std::unique_ptr<RouteTable> routes, RouteTable::Create(ro));
  if (routes->enabled() && config.advertise.empty()) {
    spdlog::warn("routes are set but --advertise is not: the relays this one forwards to cannot report "
                 "deliveries back, pass a close back, or elide ancestors they got from it");
  }
  return routes;
}

absl::StatusOr<std::unique_ptr<Authenticator>> OpenAuthenticator(const ServerConfig& config, bool tls,
                                                                 Metrics* metrics, TimeSource* time) {
  AuthOptions ao;
  ao.tls = tls;
  ao.tokens_file = config.tokens_file;
  ao.local_auth = config.local_auth == "token" ? LocalAuth::kToken : LocalAuth::kPod;
  ao.peer_identities = config.peer_identities;
  ao.time = time;
  return Authenticator::Create(ao, metrics);
}

// What the security flags leave open, logged once at start-up.
void WarnAboutSecurity(const ServerConfig& config, bool tls, Metrics* metrics) {
  const bool insecure = ServesPlaintextOffLoopback(config);
  metrics->SetInsecure(insecure);
  if (insecure) {
    spdlog::warn("--insecure: a non-loopback --listen address serves plaintext: anyone who can reach it can read "
                 "and inject KV caches in transit (kvrelay_insecure 1)");
  }
  if (tls && !config.tls_client_ca.empty() && config.peer_identities.empty()) {
    spdlog::warn("--tls-client-ca without --peer-identity: no relay may forward to this one");
  }
  if (!tls && !config.tokens_file.empty()) {
    spdlog::warn("--tokens-file without --tls-cert: tokens travel in plaintext on --listen, and forwards from other "
                 "relays are refused (they authenticate by certificate)");
  }
}

// The /metrics endpoint on `listen`: its host and bound port.
absl::StatusOr<std::unique_ptr<prometheus::Exposer>> StartMetricsEndpoint(const std::string& listen,
                                                                          const Metrics& metrics, std::string* host,
                                                                          int* port) {
  int mport;
  absl::Status st = SplitHostPort(listen, host, &mport);
  if (!st.ok()) return absl::InvalidArgumentError(absl::StrCat("--metrics-listen=", st.message()));
  if (listen[0] == '[' && !MetricsServerHasIpv6()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics-listen=", listen,
        ": IPv6, expected an IPv4 address or host name (this build's metrics HTTP server, civetweb, "
        "has no IPv6), e.g. 0.0.0.0:9464"));
  }
  std::unique_ptr<prometheus::Exposer> exposer;
  try {
    exposer = std::make_unique<prometheus::Exposer>(listen);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("--metrics-listen=", listen, ": cannot listen: ", e.what()));
  }
  exposer->RegisterCollectable(metrics.registry());
  const std::vector<int> ports = exposer->GetListeningPorts();
  *port = ports.empty() ? mport : ports[0];
  return exposer;
}

// The --health-listen server: grpc.health.v1 alone (every other method
// UNIMPLEMENTED through `unimplemented`), plaintext; its bound address.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartHealthServer(const std::string& listen,
                                                                grpc::CallbackGenericService* unimplemented,
                                                                std::string* bound_address) {
  grpc::ServerBuilder hb;
  hb.SetOption(std::make_unique<NoPlugins>());
  hb.RegisterCallbackGenericService(unimplemented);
  hb.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  std::vector<Listener> hl(1);
  hl[0].addr = listen;
  hl[0].flag = "--health-listen";
  int hport;
  KVRELAY_RETURN_IF_ERROR(SplitHostPort(listen, &hl[0].host, &hport));
  hb.AddListeningPort(listen, grpc::InsecureServerCredentials(), &hl[0].port);
  std::unique_ptr<grpc::Server> server = hb.BuildAndStart();
  std::vector<std::string> bound;
  KVRELAY_RETURN_IF_ERROR(CheckBound(server.get(), hl, &bound));
  *bound_address = bound[0];
  return server;
}

// The forwarder's options from the flags; with TLS (`tls` set) its peer
// channels present this relay's certificate and check the peer's.
ForwarderOptions ForwarderOptionsOf(const ServerConfig& config, TimeSource* time, const TlsFiles* tls,
                                    Metrics* metrics) {
  ForwarderOptions fo;
  fo.advertise = config.advertise;
  fo.forward_timeout_seconds = config.forward_timeout_seconds;
  fo.stall_seconds = config.forward_stall_seconds;
  fo.wire_codec_rans = config.wire_codec_rans;
  fo.time = time;
  if (tls) fo.credentials = PeerChannelCredentials(*tls, kCertRefreshSeconds, config.peer_identities, metrics);
  return fo;
}

// Starts the gRPC server of `service` on `listeners` (their ports filled
// in), with the health service and reflection; the addresses it listens on
// in `*addresses`.
absl::StatusOr<std::unique_ptr<grpc::Server>> ServeOn(std::vector<Listener>& listeners, grpc::Service* service,
                                                      std::vector<std::string>* addresses) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // gRPC sets SO_REUSEPORT by default: a second relay on the same port would
  // then start, and the kernel would split connections between two separate
  // stores. Binding a port in use must fail instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  for (const Listener& l : listeners) {
    if (l.host.empty()) KVRELAY_RETURN_IF_ERROR(PrepareUnixSocket(l.flag, l.addr));
  }
  for (Listener& l : listeners) builder.AddListeningPort(l.addr, l.creds, &l.port);
  builder.RegisterService(service);
  // Chunks are <= 1 MiB; leave room for the envelope, refuse anything bigger.
  builder.SetMaxReceiveMessageSize(4 << 20);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  KVRELAY_RETURN_IF_ERROR(CheckBound(server.get(), listeners, addresses));
  return server;
}

}  // namespace

absl::StatusOr<std::unique_ptr<RelayServer>> RelayServer::Start(const ServerConfig& config, TimeSource* time) {
  std::unique_ptr<RelayServer> s(new RelayServer());
  s->config_ = config;
  if (config.listen.empty()) return absl::InvalidArgumentError("--listen: expected at least one address");
  const bool tls = !config.tls_cert.empty();
  TlsFiles tls_files{config.tls_cert, config.tls_key, config.tls_client_ca,
                     config.tls_peer_ca.empty() ? config.tls_client_ca : config.tls_peer_ca};
  if (tls) KVRELAY_RETURN_IF_ERROR(CheckTlsFiles(tls_files));
  // One provider for every TLS address: the files are watched once.
  const std::shared_ptr<grpc::ServerCredentials> tls_creds =
      tls ? TlsServerCredentials(tls_files, kCertRefreshSeconds) : nullptr;
  KVRELAY_ASSIGN_OR_RETURN(std::vector<Listener> listeners, ListenersOf(config, tls_creds));

  s->metrics_ = std::make_unique<Metrics>();
  std::vector<std::string> policies = {config.default_policy};
  for (const auto& [role, spec] : config.role_policies) policies.push_back(spec);
  for (const std::string& spec : policies) {
    if (auto p = Pipeline::Create(spec); p.ok()) s->metrics_->DeclareFamily(PolicyFamily((*p)->spec()));
  }
  SpoolStore* spool = nullptr;
  KVRELAY_ASSIGN_OR_RETURN(s->store_, OpenStore(config, s->metrics_.get(), time, &spool));
  if (spool) {
    RelayServer* self = s.get();
    spool->SetOnFailure([self](const absl::Status&) { self->SetNotServing(); });
  }
  s->pool_ = std::make_unique<ThreadPool>(std::max(1, config.worker_threads));
  KVRELAY_ASSIGN_OR_RETURN(s->routes_, OpenRoutes(config, time));
  s->forwarder_ = std::make_unique<Forwarder>(ForwarderOptionsOf(config, time, tls ? &tls_files : nullptr,
                                                                 s->metrics_.get()),
                                              s->store_.get(), s->store_.get(), s->store_.get(), s->routes_.get(),
                                              s->metrics_.get());
  if (spool) ResumeForwards(*spool, s->forwarder_.get());
  KVRELAY_ASSIGN_OR_RETURN(s->auth_, OpenAuthenticator(config, tls, s->metrics_.get(), time));
  s->service_ = std::make_unique<RelayService>(config, s->store_.get(), s->pool_.get(), s->metrics_.get(),
                                               s->forwarder_.get(), s->routes_.get(), s->auth_.get(), time);
  WarnAboutSecurity(config, tls, s->metrics_.get());
  if (!config.metrics_listen.empty()) {
    KVRELAY_ASSIGN_OR_RETURN(s->exposer_, StartMetricsEndpoint(config.metrics_listen, *s->metrics_,
                                                               &s->metrics_host_, &s->metrics_port_));
  }

  KVRELAY_ASSIGN_OR_RETURN(s->server_, ServeOn(listeners, s->service_.get(), &s->grpc_addresses_));
  for (const Listener& l : listeners) {
    if (!l.host.empty()) {
      s->grpc_port_ = l.port;
      break;
    }
  }
  if (!config.health_listen.empty()) {
    s->health_unimplemented_ = std::make_unique<UnimplementedService>();
    KVRELAY_ASSIGN_OR_RETURN(s->health_server_, StartHealthServer(config.health_listen,
                                                                  s->health_unimplemented_.get(), &s->health_address_));
  }
  {
    // A spool that failed before this point keeps the relay NOT_SERVING.
    MutexLock lock(&s->shutdown_mu_);
    s->serving_ = s->serving_ && (spool == nullptr || spool->health().ok());
    for (grpc::Server* g : {s->server_.get(), s->health_server_.get()}) {
      if (!g) continue;
      g->GetHealthCheckService()->SetServingStatus(s->serving_);
      g->GetHealthCheckService()->SetServingStatus("kvrelay.v1.Relay", s->serving_);
    }
  }
  spdlog::info("kvrelay-server serving grpc={} metrics={} health={} tls={} mtls={} tokens={} local_auth={} workers={} "
               "default_policy={} kernels={}",
               absl::StrJoin(s->grpc_addresses_, ","),
               s->exposer_ ? absl::StrCat(s->metrics_host_, ":", s->metrics_port_) : "off",
               s->health_address_.empty() ? "off" : s->health_address_, tls, !config.tls_client_ca.empty(),
               config.tokens_file.empty() ? "off" : "on", config.local_auth, config.worker_threads,
               config.default_policy, KernelSummary());
  return s;
}

RelayServer::~RelayServer() {
  Shutdown();
  exposer_.reset();
}

std::string RelayServer::ReadyLine() const {
  return absl::StrCat("kvrelay-server ready grpc=", absl::StrJoin(grpc_addresses_, ","), " metrics=",
                      exposer_ ? absl::StrCat(metrics_host_, ":", metrics_port_) : std::string("off"),
                      health_address_.empty() ? "" : absl::StrCat(" health=", health_address_));
}

void RelayServer::SetNotServing() {
  MutexLock lock(&shutdown_mu_);
  serving_ = false;
  if (shut_down_ || !server_) return;  // not serving yet: Start reads the spool's health
  server_->GetHealthCheckService()->SetServingStatus(false);
  server_->GetHealthCheckService()->SetServingStatus("kvrelay.v1.Relay", false);
  if (health_server_) {
    health_server_->GetHealthCheckService()->SetServingStatus(false);
    health_server_->GetHealthCheckService()->SetServingStatus("kvrelay.v1.Relay", false);
  }
}

void RelayServer::Shutdown() {
  MutexLock lock(&shutdown_mu_);
  if (shut_down_) return;
  shut_down_ = true;
  if (server_) {
    server_->GetHealthCheckService()->SetServingStatus(false);
    if (health_server_) health_server_->GetHealthCheckService()->SetServingStatus(false);
    // Waiting Fetches end now (UNAVAILABLE) instead of holding the drain.
    store_->Shutdown();
    const auto grace = std::chrono::duration_cast<std::chrono::system_clock::duration>(
        std::chrono::duration<double>(config_.shutdown_grace_seconds));
    spdlog::info("kvrelay-server shutting down, draining for up to {}s", config_.shutdown_grace_seconds);
    const auto deadline = std::chrono::system_clock::now() + grace;
    server_->Shutdown(deadline);
    server_->Wait();
    // Publishes are over: forward what the outbox holds within the rest of
    // the grace period; what is left is logged, message by message.
    const auto left = std::max(std::chrono::milliseconds(0), std::chrono::duration_cast<std::chrono::milliseconds>(
                                                                 deadline - std::chrono::system_clock::now()));
    if (const int n = forwarder_->Drain(left); n > 0) {
      spdlog::warn("kvrelay-server: {} forwards not done at shutdown (listed above)", n);
    }
  }
  if (health_server_) {
    health_server_->Shutdown(std::chrono::system_clock::now());
    health_server_->Wait();
  }
  forwarder_.reset();
  // The pool drains queued layers (their reactors are gone or finished).
  pool_.reset();
  if (server_) spdlog::info("kvrelay-server stopped");  // not after a failed start
}

}  // namespace kvrelay
