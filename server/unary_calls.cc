// The unary calls of RelayService: Ack, CloseSession, Stats.
#include "absl/status/status.h"
#include "proto/raw_chunk.h"
#include "proto/status_util.h"
#include "server/internal/call_util.h"
#include "server/relay_service.h"
#include "server/request_checks.h"
#include "spdlog/spdlog.h"

namespace kvrelay {
namespace {

// Finishes a unary call with `s` (and, when OK, `resp` as the response).
template <typename Response>
grpc::ServerUnaryReactor* FinishUnary(RelayService* svc, grpc::CallbackServerContext* ctx, const char* rpc,
                                      const absl::Status& s, const Response& resp, grpc::ByteBuffer* wire) {
  const grpc::Status g = ToGrpcStatus(s);
  if (g.ok()) *wire = EncodeProto(resp);
  svc->CountRpc(rpc, g);
  grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
  r->Finish(g);
  return r;
}

}  // namespace

grpc::ServerUnaryReactor* RelayService::Ack(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                            grpc::ByteBuffer* response) {
  v1::AckRequest req;
  absl::Status s = ParseRequest(*request, "ack", &req);
  if (s.ok()) s = CheckId("session_id", req.session_id());
  if (s.ok()) s = CheckId("agent", req.agent());
  if (s.ok()) s = CheckId("message_id", req.message_id());
  if (s.ok()) s = store_->Ack(req.session_id(), req.agent(), req.message_id());
  return FinishUnary(this, ctx, "Ack", s, v1::AckResponse(), response);
}

grpc::ServerUnaryReactor* RelayService::CloseSession(grpc::CallbackServerContext* ctx,
                                                     const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  v1::CloseSessionRequest req;
  v1::CloseSessionResponse resp;
  absl::Status s = ParseRequest(*request, "close session", &req);
  if (s.ok()) s = CheckId("session_id", req.session_id());
  if (s.ok()) {
    resp.set_messages_freed(store_->CloseSession(req.session_id()));
    spdlog::info("session closed session={} messages_freed={}", req.session_id(), resp.messages_freed());
  }
  return FinishUnary(this, ctx, "CloseSession", s, resp, response);
}

grpc::ServerUnaryReactor* RelayService::Stats(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                              grpc::ByteBuffer* response) {
  v1::StatsRequest req;
  v1::StatsResponse resp;
  const absl::Status s = ParseRequest(*request, "stats", &req);
  if (s.ok()) {
    const StoreStats st = store_->Stats();
    resp.set_messages_committed(st.committed);
    resp.set_messages_failed(st.failed);
    resp.set_messages_delivered(st.delivered);
    resp.set_messages_acked(st.acked);
    resp.set_received_bytes(st.received_bytes);
    resp.set_full_bytes(st.full_bytes);
    resp.set_sent_bytes(st.sent_bytes);
    resp.set_sessions(st.sessions);
    resp.set_mailbox_messages(st.mailbox_messages);
    resp.set_mailbox_bytes(st.mailbox_bytes);
    resp.set_inflight_bytes(st.inflight_bytes);
    resp.set_store_bytes(st.store_bytes);
    resp.set_version(KVRELAY_VERSION);
  }
  return FinishUnary(this, ctx, "Stats", s, resp, response);
}

}  // namespace kvrelay
