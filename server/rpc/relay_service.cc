#include "server/rpc/relay_service.h"

#include "absl/strings/str_cat.h"
#include "proto/status_util.h"
#include "server/auth/auth.h"
#include "server/rpc/unary_calls.h"
#include "server/rpc/compress_reactor.h"
#include "server/rpc/fetch_reactor.h"
#include "server/rpc/forward_reactor.h"
#include "server/rpc/internal/call_util.h"
#include "server/rpc/publish_reactor.h"
#include "server/rpc/request_checks.h"

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
Base* Refuse(const RelayContext* relay, const char* method, const absl::Status& s) {
  const grpc::Status g = ToGrpcStatus(s);
  relay->CountRpc(method, g);
  return new RefusedReactor<Base>(g);
}

}  // namespace

RelayService::RelayService(const ServerConfig& config, Store* store, ThreadPool* pool, Metrics* metrics,
                           Forwarder* forwarder, const RouteTable* routes, const Authenticator* auth,
                           TimeSource* time)
    : relay_(config, store, pool, metrics, forwarder, routes, auth, time) {}

grpc::ServerReadReactor<grpc::ByteBuffer>* RelayService::Publish(grpc::CallbackServerContext* ctx,
                                                                 grpc::ByteBuffer* response) {
  absl::StatusOr<Caller> caller = relay_.AuthenticateAgent(*ctx, "publish");
  if (!caller.ok()) return Refuse<grpc::ServerReadReactor<grpc::ByteBuffer>>(&relay_, "Publish", caller.status());
  return NewPublishReactor(&relay_, ctx, response, *std::move(caller));
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* RelayService::Fetch(grpc::CallbackServerContext* ctx,
                                                               const grpc::ByteBuffer* request) {
  v1::FetchRequest req;
  absl::StatusOr<Caller> caller = relay_.AuthenticateAgent(*ctx, "fetch");
  absl::Status s = caller.status();
  if (s.ok()) s = ParseRequest(*request, "fetch", &req);
  if (s.ok()) s = CheckId("agent", req.agent());
  if (s.ok()) s = relay_.CheckActsAs(*ctx, "fetch", *caller, "agent", req.agent());
  return NewFetchReactor(&relay_, ctx, req, s);
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* RelayService::Compress(
    grpc::CallbackServerContext* ctx) {
  absl::StatusOr<Caller> caller = relay_.AuthenticateAgent(*ctx, "compress");
  if (!caller.ok()) {
    return Refuse<grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>>(&relay_, "Compress", caller.status());
  }
  return NewCompressReactor(&relay_, ctx);
}

grpc::ServerReadReactor<grpc::ByteBuffer>* RelayService::Forward(grpc::CallbackServerContext* ctx,
                                                                 grpc::ByteBuffer* response) {
  absl::StatusOr<Caller> caller = relay_.AuthenticatePeer(*ctx, "forward");
  if (!caller.ok()) return Refuse<grpc::ServerReadReactor<grpc::ByteBuffer>>(&relay_, "Forward", caller.status());
  return NewForwardReactor(&relay_, ctx, response, *std::move(caller));
}

grpc::ServerUnaryReactor* RelayService::Ack(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                            grpc::ByteBuffer* response) {
  return HandleAck(&relay_, ctx, request, response);
}

grpc::ServerUnaryReactor* RelayService::CloseSession(grpc::CallbackServerContext* ctx,
                                                     const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return HandleCloseSession(&relay_, ctx, request, response);
}

grpc::ServerUnaryReactor* RelayService::Stats(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                              grpc::ByteBuffer* response) {
  return HandleStats(&relay_, ctx, request, response);
}

grpc::ServerUnaryReactor* RelayService::MessageStatus(grpc::CallbackServerContext* ctx,
                                                      const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return HandleMessageStatus(&relay_, ctx, request, response);
}

grpc::ServerUnaryReactor* RelayService::ReportRecipient(grpc::CallbackServerContext* ctx,
                                                        const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return HandleReportRecipient(&relay_, ctx, request, response);
}

}  // namespace kvrelay
