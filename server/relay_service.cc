#include "server/relay_service.h"

#include "absl/strings/str_cat.h"
#include "core/mutex.h"
#include "core/pipeline.h"
#include "proto/status_util.h"
#include "server/auth.h"
#include "server/compress_reactor.h"
#include "server/fetch_reactor.h"
#include "server/forward_reactor.h"
#include "server/internal/call_util.h"
#include "core/message_id.h"
#include "server/publish_reactor.h"
#include "server/request_checks.h"
#include "spdlog/spdlog.h"

namespace kvrelay {
namespace {

// A streaming call refused before it starts: finishes at once with `s`.
template <typename Base>
class RefusedReactor final : public Base {
 public:
  explicit RefusedReactor(const grpc::Status& s) { this->Finish(s); }
  void OnDone() override { delete this; }
};

template <typename Base>
Base* Refuse(const RelayService* svc, const char* method, const absl::Status& s) {
  const grpc::Status g = ToGrpcStatus(s);
  svc->CountRpc(method, g);
  return new RefusedReactor<Base>(g);
}

}  // namespace

RelayService::RelayService(const ServerConfig& config, Store* store, ThreadPool* pool, Metrics* metrics,
                           Forwarder* forwarder, const RouteTable* routes, const Authenticator* auth,
                           TimeSource* time)
    : config_(config), store_(store), pool_(pool), metrics_(metrics), forwarder_(forwarder), routes_(routes),
      auth_(auth),
      watchdog_(config.upload_idle_timeout_seconds, time) {}

absl::StatusOr<std::string> RelayService::NewMessageId() { return kvrelay::NewMessageId(); }

void RelayService::CountRpc(const char* method, const grpc::Status& s) const {
  if (metrics_) metrics_->AddRpc(method, s.error_code());
}

void RelayService::NoteUploadFailure(const char* rpc, const absl::Status& s) const {
  if (!IsInvariantViolation(s)) return;
  spdlog::error("{}: nothing committed, the compression pipeline broke an invariant: {}", rpc, std::string(s.message()));
  if (metrics_) metrics_->AddInvariantViolation();
}

void RelayService::SetLayerObserver(std::function<void(int outstanding)> observe) {
  MutexLock lock(&observer_mu_);
  layer_observer_ = std::move(observe);
}

std::function<void(int outstanding)> RelayService::layer_observer() const {
  MutexLock lock(&observer_mu_);
  return layer_observer_;
}

absl::StatusOr<Caller> RelayService::AuthenticateAgent(const grpc::CallbackServerContext& ctx,
                                                       absl::string_view rpc) const {
  if (!auth_) return Caller{};
  return auth_->Agent(ctx, rpc);
}

absl::StatusOr<Caller> RelayService::AuthenticatePeer(const grpc::CallbackServerContext& ctx,
                                                      absl::string_view rpc) const {
  if (!auth_) {
    Caller peer;
    peer.kind = Caller::Kind::kPeer;
    return peer;
  }
  return auth_->Peer(ctx, rpc);
}

absl::Status RelayService::Forbid(const grpc::CallbackServerContext& ctx, absl::string_view rpc,
                                  const std::string& message) const {
  if (!auth_) return absl::PermissionDeniedError(message);
  return auth_->Forbid(ctx, rpc, message);
}

absl::Status RelayService::CheckActsAs(const grpc::CallbackServerContext& ctx, absl::string_view rpc,
                                       const Caller& caller, absl::string_view field, absl::string_view agent) const {
  if (caller.MayActAs(agent)) return absl::OkStatus();
  return Forbid(ctx, rpc, absl::StrCat(field, ": caller is ", caller.Describe(), ", not \"", agent, "\""));
}

grpc::ServerReadReactor<grpc::ByteBuffer>* RelayService::Publish(grpc::CallbackServerContext* ctx,
                                                                 grpc::ByteBuffer* response) {
  absl::StatusOr<Caller> caller = AuthenticateAgent(*ctx, "publish");
  if (!caller.ok()) return Refuse<grpc::ServerReadReactor<grpc::ByteBuffer>>(this, "Publish", caller.status());
  return NewPublishReactor(this, ctx, response, *std::move(caller));
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* RelayService::Fetch(grpc::CallbackServerContext* ctx,
                                                               const grpc::ByteBuffer* request) {
  v1::FetchRequest req;
  absl::StatusOr<Caller> caller = AuthenticateAgent(*ctx, "fetch");
  absl::Status s = caller.status();
  if (s.ok()) s = ParseRequest(*request, "fetch", &req);
  if (s.ok()) s = CheckId("agent", req.agent());
  if (s.ok()) s = CheckActsAs(*ctx, "fetch", *caller, "agent", req.agent());
  return NewFetchReactor(this, ctx, req, s);
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* RelayService::Compress(
    grpc::CallbackServerContext* ctx) {
  absl::StatusOr<Caller> caller = AuthenticateAgent(*ctx, "compress");
  if (!caller.ok()) {
    return Refuse<grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>>(this, "Compress", caller.status());
  }
  return NewCompressReactor(this, ctx);
}

grpc::ServerReadReactor<grpc::ByteBuffer>* RelayService::Forward(grpc::CallbackServerContext* ctx,
                                                                 grpc::ByteBuffer* response) {
  absl::StatusOr<Caller> caller = AuthenticatePeer(*ctx, "forward");
  if (!caller.ok()) return Refuse<grpc::ServerReadReactor<grpc::ByteBuffer>>(this, "Forward", caller.status());
  return NewForwardReactor(this, ctx, response, *std::move(caller));
}

}  // namespace kvrelay
