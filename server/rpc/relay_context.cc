#include "server/rpc/relay_context.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/message_id.h"
#include "core/pipeline.h"
#include "server/auth/auth.h"
#include "spdlog/spdlog.h"

namespace kvrelay {

RelayContext::RelayContext(const ServerConfig& config, Store* store, ThreadPool* pool, Metrics* metrics,
                           Forwarder* forwarder, const RouteTable* routes, const Authenticator* auth,
                           TimeSource* time)
    : config_(config), store_(store), pool_(pool), metrics_(metrics), forwarder_(forwarder), routes_(routes),
      auth_(auth), watchdog_(config.upload_idle_timeout_seconds, time) {}

absl::StatusOr<std::string> RelayContext::NewMessageId() const { return kvrelay::NewMessageId(); }

void RelayContext::CountRpc(const char* method, const grpc::Status& s) const {
  if (metrics_) metrics_->AddRpc(method, s.error_code());
}

void RelayContext::NoteUploadFailure(const char* rpc, const absl::Status& s) const {
  if (!IsInvariantViolation(s)) return;
  spdlog::error("{}: nothing committed, the compression pipeline broke an invariant: {}", rpc, std::string(s.message()));
  if (metrics_) metrics_->AddInvariantViolation();
}

void RelayContext::SetLayerObserver(std::function<void(int outstanding)> observe) {
  MutexLock lock(&observer_mu_);
  layer_observer_ = std::move(observe);
}

std::function<void(int outstanding)> RelayContext::layer_observer() const {
  MutexLock lock(&observer_mu_);
  return layer_observer_;
}

absl::StatusOr<Caller> RelayContext::AuthenticateAgent(const grpc::CallbackServerContext& ctx,
                                                       absl::string_view rpc) const {
  if (!auth_) return Caller{};
  return auth_->Agent(ctx, rpc);
}

absl::StatusOr<Caller> RelayContext::AuthenticatePeer(const grpc::CallbackServerContext& ctx,
                                                      absl::string_view rpc) const {
  if (!auth_) {
    Caller peer;
    peer.kind = Caller::Kind::kPeer;
    return peer;
  }
  return auth_->Peer(ctx, rpc);
}

absl::Status RelayContext::Forbid(const grpc::CallbackServerContext& ctx, absl::string_view rpc,
                                  const std::string& message) const {
  if (!auth_) return absl::PermissionDeniedError(message);
  return auth_->Forbid(ctx, rpc, message);
}

absl::Status RelayContext::CheckActsAs(const grpc::CallbackServerContext& ctx, absl::string_view rpc,
                                       const Caller& caller, absl::string_view field, absl::string_view agent) const {
  if (caller.MayActAs(agent)) return absl::OkStatus();
  return Forbid(ctx, rpc, absl::StrCat(field, ": caller is ", caller.Describe(), ", not \"", agent, "\""));
}

}  // namespace kvrelay
