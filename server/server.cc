#include "server/server.h"

#include <chrono>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/pipeline.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "server/memory_store.h"
#include "spdlog/spdlog.h"

#if defined(KVRELAY_CIVETWEB_FEATURES)
#include "civetweb.h"
#endif

namespace kvrelay {
namespace {

// Whether the metrics HTTP server can listen on IPv6 (unknown: assume so).
bool MetricsServerHasIpv6() {
#if defined(KVRELAY_CIVETWEB_FEATURES)
  constexpr unsigned kCivetwebIpv6 = 8;  // mg_check_feature: built with IPv6
  return mg_check_feature(kCivetwebIpv6) != 0;
#else
  return true;
#endif
}

}  // namespace

absl::StatusOr<std::unique_ptr<RelayServer>> RelayServer::Start(const ServerConfig& config) {
  std::unique_ptr<RelayServer> s(new RelayServer());
  s->config_ = config;
  int port;
  absl::Status st = SplitHostPort(config.listen, &s->grpc_host_, &port);
  if (!st.ok()) return absl::InvalidArgumentError(absl::StrCat("--listen=", st.message()));
  s->metrics_ = std::make_unique<Metrics>();
  std::vector<std::string> policies = {config.default_policy};
  for (const auto& [role, spec] : config.role_policies) policies.push_back(spec);
  for (const std::string& spec : policies) {
    if (auto p = Pipeline::Create(spec); p.ok()) s->metrics_->DeclareFamily(PolicyFamily((*p)->spec()));
  }
  StoreLimits limits;
  limits.max_inflight_bytes = config.max_inflight_bytes;
  limits.max_mailbox_bytes = config.max_mailbox_bytes;
  limits.max_session_messages = config.max_session_messages;
  limits.max_session_bytes = config.max_session_bytes;
  limits.max_store_bytes = config.max_store_bytes;
  limits.session_ttl_seconds = config.session_ttl_seconds;
  s->store_ = std::make_unique<MemoryStore>(limits, s->metrics_.get());
  s->metrics_->SetLimit("inflight", static_cast<double>(config.max_inflight_bytes));
  s->metrics_->SetLimit("mailbox", static_cast<double>(config.max_mailbox_bytes));
  s->metrics_->SetLimit("session", static_cast<double>(config.max_session_bytes));
  s->metrics_->SetLimit("store", static_cast<double>(config.max_store_bytes));
  s->pool_ = std::make_unique<ThreadPool>(std::max(1, config.worker_threads));
  s->service_ = std::make_unique<RelayService>(config, s->store_.get(), s->pool_.get(), s->metrics_.get());

  if (!config.metrics_listen.empty()) {
    int mport;
    st = SplitHostPort(config.metrics_listen, &s->metrics_host_, &mport);
    if (!st.ok()) return absl::InvalidArgumentError(absl::StrCat("--metrics-listen=", st.message()));
    if (config.metrics_listen[0] == '[' && !MetricsServerHasIpv6()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--metrics-listen=", config.metrics_listen,
          ": IPv6, expected an IPv4 address or host name (this build's metrics HTTP server, civetweb, "
          "has no IPv6), e.g. 0.0.0.0:9464"));
    }
    try {
      s->exposer_ = std::make_unique<prometheus::Exposer>(config.metrics_listen);
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("--metrics-listen=", config.metrics_listen,
                                                 ": cannot listen: ", e.what()));
    }
    s->exposer_->RegisterCollectable(s->metrics_->registry());
    const std::vector<int> ports = s->exposer_->GetListeningPorts();
    s->metrics_port_ = ports.empty() ? mport : ports[0];
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // gRPC sets SO_REUSEPORT by default: a second relay on the same port would
  // then start, and the kernel would split connections between two separate
  // stores. Binding a port in use must fail instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(config.listen, grpc::InsecureServerCredentials(), &s->grpc_port_);
  builder.RegisterService(s->service_.get());
  // Chunks are <= 1 MiB; leave room for the envelope, refuse anything bigger.
  builder.SetMaxReceiveMessageSize(4 << 20);
  s->server_ = builder.BuildAndStart();
  if (!s->server_ || s->grpc_port_ == 0) {
    return absl::UnavailableError(absl::StrCat(
        "--listen=", config.listen,
        ": cannot listen (the port is in use, or the address is not one of this host's; gRPC's log above has the "
        "system error)"));
  }
  s->server_->GetHealthCheckService()->SetServingStatus(true);
  s->server_->GetHealthCheckService()->SetServingStatus("kvrelay.v1.Relay", true);
  spdlog::info("kvrelay-server serving grpc={} metrics={} workers={} default_policy={} kernels={}",
               s->grpc_address(), s->exposer_ ? absl::StrCat(s->metrics_host_, ":", s->metrics_port_) : "off",
               config.worker_threads, config.default_policy, KernelSummary());
  return s;
}

RelayServer::~RelayServer() {
  Shutdown();
  exposer_.reset();
}

std::string RelayServer::grpc_address() const { return absl::StrCat(grpc_host_, ":", grpc_port_); }

std::string RelayServer::ReadyLine() const {
  return absl::StrCat("kvrelay-server ready grpc=", grpc_address(), " metrics=",
                      exposer_ ? absl::StrCat(metrics_host_, ":", metrics_port_) : std::string("off"));
}

void RelayServer::Shutdown() {
  std::lock_guard<std::mutex> lock(shutdown_mu_);
  if (shut_down_) return;
  shut_down_ = true;
  if (server_) {
    server_->GetHealthCheckService()->SetServingStatus(false);
    // Waiting Fetches end now (UNAVAILABLE) instead of holding the drain.
    store_->Shutdown();
    const auto grace = std::chrono::duration_cast<std::chrono::system_clock::duration>(
        std::chrono::duration<double>(config_.shutdown_grace_seconds));
    spdlog::info("kvrelay-server shutting down, draining for up to {}s", config_.shutdown_grace_seconds);
    server_->Shutdown(std::chrono::system_clock::now() + grace);
    server_->Wait();
  }
  // The pool drains queued layers (their reactors are gone or finished).
  pool_.reset();
  if (server_) spdlog::info("kvrelay-server stopped");  // not after a failed start
}

}  // namespace kvrelay
