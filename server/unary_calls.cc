// The unary calls of RelayService: Ack, CloseSession, Stats, MessageStatus,
// ReportRecipient.
#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "proto/raw_chunk.h"
#include "proto/status_util.h"
#include "core/status_macros.h"
#include "server/auth.h"
#include "server/forwarder.h"
#include "server/internal/call_util.h"
#include "server/relay_service.h"
#include "server/request_checks.h"
#include "spdlog/spdlog.h"

namespace kvrelay {
namespace {

// Finishes a unary call with `s` (and, when OK, `resp` as the response).
template <typename Response>
void FinishUnaryWith(RelayService* svc, grpc::ServerUnaryReactor* r, const char* rpc, const absl::Status& s,
                     const Response& resp, grpc::ByteBuffer* wire) {
  const grpc::Status g = ToGrpcStatus(s);
  if (g.ok()) *wire = EncodeProto(resp);
  svc->CountRpc(rpc, g);
  r->Finish(g);
}

template <typename Response>
grpc::ServerUnaryReactor* FinishUnary(RelayService* svc, grpc::CallbackServerContext* ctx, const char* rpc,
                                      const absl::Status& s, const Response& resp, grpc::ByteBuffer* wire) {
  grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
  FinishUnaryWith(svc, r, rpc, s, resp, wire);
  return r;
}

}  // namespace

grpc::ServerUnaryReactor* RelayService::Ack(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                            grpc::ByteBuffer* response) {
  v1::AckRequest req;
  // Credentials first: a caller without them learns nothing, not even
  // whether its request was well-formed.
  absl::StatusOr<Caller> caller = AuthenticateAgent(*ctx, "ack");
  absl::Status s = caller.status();
  if (s.ok()) s = ParseRequest(*request, "ack", &req);
  if (s.ok()) s = CheckId("session_id", req.session_id());
  if (s.ok()) s = CheckId("agent", req.agent());
  if (s.ok()) s = CheckId("message_id", req.message_id());
  if (s.ok()) s = CheckActsAs(*ctx, "ack", *caller, "agent", req.agent());
  if (!s.ok()) return FinishUnary(this, ctx, "Ack", s, v1::AckResponse(), response);
  // A durable store answers once the ack is on disk, on its own thread: the
  // call's reaction does not wait for it.
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  store_->AckAsync(req.session_id(), req.agent(), req.message_id(),
                   [this, reactor, response, session = req.session_id(), agent = req.agent(),
                    id = req.message_id()](const absl::Status& st) {
                     if (st.ok() && forwarder_) {
                       MessagePtr m = store_->Find(session, id);
                       if (m && m->forwarded) forwarder_->Report(*m, agent, v1::RECIPIENT_STATE_ACKED);
                     }
                     FinishUnaryWith(this, reactor, "Ack", st, v1::AckResponse(), response);
                   });
  return reactor;
}

// An agent may close a session it sent or received a message in; a peer
// relay (a propagated close) one in which messages passed between the two,
// or one already closed here (the close came back: nothing is left to free).
absl::StatusOr<Caller> RelayService::CheckMayClose(const grpc::CallbackServerContext& ctx,
                                                   const v1::CloseSessionRequest& req) const {
  const std::string& session = req.session_id();
  if (req.propagated()) {
    KVRELAY_ASSIGN_OR_RETURN(Caller peer, AuthenticatePeer(ctx, "close session"));
    if (peer.identity.empty() || store_->IsClosed(session)) return peer;
    for (const std::string& target : store_->Peers(session)) {
      if (peer.PeerIsHost(TargetHost(target))) return peer;
    }
    return Forbid(ctx, "close session",
                  absl::StrCat("session_id: ", peer.Describe(), " exchanged no message of session '", session,
                               "' with this relay"));
  }
  KVRELAY_ASSIGN_OR_RETURN(Caller caller, AuthenticateAgent(ctx, "close session"));
  if (caller.kind != Caller::Kind::kAgent || store_->IsParticipant(session, caller.agent)) return caller;
  return Forbid(ctx, "close session",
                absl::StrCat("session_id: caller is ", caller.Describe(), ", which sent or received no message of "
                             "session '", session, "' here"));
}

grpc::ServerUnaryReactor* RelayService::CloseSession(grpc::CallbackServerContext* ctx,
                                                     const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  v1::CloseSessionRequest req;
  absl::Status s = ParseRequest(*request, "close session", &req);
  // Which credentials apply depends on the request (propagated or not); a
  // caller without any still learns nothing of a malformed one.
  if (!s.ok()) {
    if (absl::Status a = AuthenticateAgent(*ctx, "close session").status(); !a.ok()) s = a;
  }
  if (s.ok()) s = CheckId("session_id", req.session_id());
  absl::StatusOr<Caller> caller = s.ok() ? CheckMayClose(*ctx, req) : absl::StatusOr<Caller>(s);
  if (s.ok()) s = caller.status();
  if (!s.ok()) return FinishUnary(this, ctx, "CloseSession", s, v1::CloseSessionResponse(), response);
  // A durable store answers once the close is on disk, on its own thread:
  // the call's reaction does not wait for it.
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  store_->CloseSessionAndPeersAsync(
      req.session_id(), [this, reactor, response, req, caller = *std::move(caller)](Store::CloseResult r) {
        v1::CloseSessionResponse resp;
        if (r.status.ok()) {  // not OK: a spool that could not record it
          // Not passed back to the relay it came from.
          if (req.propagated() && !caller.identity.empty()) {
            r.peers.erase(std::remove_if(r.peers.begin(), r.peers.end(),
                                         [&](const std::string& t) { return caller.PeerIsHost(TargetHost(t)); }),
                          r.peers.end());
          }
          resp.set_messages_freed(r.messages_freed);
          spdlog::info("session closed session={} messages_freed={} propagated={} passed_on_to={}",
                       req.session_id(), r.messages_freed, req.propagated(), r.first ? r.peers.size() : 0);
          // Passed on only the first time this relay closes it: a close cannot loop.
          if (r.first && forwarder_ && !r.peers.empty()) forwarder_->PropagateClose(req.session_id(), r.peers);
        }
        FinishUnaryWith(this, reactor, "CloseSession", r.status, resp, response);
      });
  return reactor;
}

grpc::ServerUnaryReactor* RelayService::Stats(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                              grpc::ByteBuffer* response) {
  v1::StatsRequest req;
  v1::StatsResponse resp;
  absl::Status s = AuthenticateAgent(*ctx, "stats").status();
  if (s.ok()) s = ParseRequest(*request, "stats", &req);
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

// An agent may read the status of a message it sent or is a recipient of.
absl::Status RelayService::CheckMayReadStatus(const Caller& caller, const v1::MessageStatusRequest& req) const {
  if (caller.kind != Caller::Kind::kAgent) return absl::OkStatus();
  MessagePtr m = store_->Find(req.session_id(), req.message_id());
  if (m && MaySee(*m, caller.agent)) return absl::OkStatus();
  return NotVisibleError("message_id", req.session_id(), req.message_id(), caller.agent);
}

grpc::ServerUnaryReactor* RelayService::MessageStatus(grpc::CallbackServerContext* ctx,
                                                      const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  v1::MessageStatusRequest req;
  absl::StatusOr<Caller> caller = AuthenticateAgent(*ctx, "message status");
  absl::Status s = caller.status();
  if (s.ok()) s = ParseRequest(*request, "message status", &req);
  if (s.ok()) s = CheckId("session_id", req.session_id());
  if (s.ok()) s = CheckId("message_id", req.message_id());
  if (s.ok()) s = CheckMayReadStatus(*caller, req);
  v1::MessageStatusResponse resp;
  if (s.ok()) {
    absl::StatusOr<v1::MessageStatusResponse> r = store_->MessageStatus(req.session_id(), req.message_id());
    if (r.ok()) resp = std::move(*r);
    s = r.status();
  }
  return FinishUnary(this, ctx, "MessageStatus", s, resp, response);
}

grpc::ServerUnaryReactor* RelayService::ReportRecipient(grpc::CallbackServerContext* ctx,
                                                        const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  v1::ReportRecipientRequest req;
  absl::StatusOr<Caller> peer = AuthenticatePeer(*ctx, "report recipient");
  absl::Status s = peer.status();
  if (s.ok()) s = ParseRequest(*request, "report recipient", &req);
  if (s.ok()) s = CheckId("session_id", req.session_id());
  if (s.ok()) s = CheckId("message_id", req.message_id());
  if (s.ok()) s = CheckId("agent", req.agent());
  if (s.ok() && req.state() != v1::RECIPIENT_STATE_DELIVERED && req.state() != v1::RECIPIENT_STATE_ACKED) {
    s = absl::InvalidArgumentError(absl::StrCat("state: ", v1::RecipientState_Name(req.state()),
                                                ", expected RECIPIENT_STATE_DELIVERED or RECIPIENT_STATE_ACKED"));
  }
  MessagePtr m = s.ok() ? store_->Find(req.session_id(), req.message_id()) : nullptr;
  if (s.ok() && !m) {
    s = absl::NotFoundError(absl::StrCat("message_id: '", req.message_id(), "': not held in session '",
                                         req.session_id(), "'"));
  }
  if (s.ok()) {
    auto remote = m->remote.find(req.agent());
    if (remote == m->remote.end()) {
      s = absl::NotFoundError(absl::StrCat("agent: '", req.agent(), "': not a recipient of message '",
                                           req.message_id(), "' on another relay"));
    } else if (!peer->identity.empty() && !peer->PeerIsHost(TargetHost(remote->second))) {
      s = Forbid(*ctx, "report recipient",
                 absl::StrCat("agent: ", peer->Describe(), " is not the relay of agent '", req.agent(), "' (",
                              remote->second, ")"));
    } else {
      Store::RecipientTrack t;
      t.state = req.state();
      store_->TrackRecipient(req.session_id(), req.message_id(), req.agent(), t);
    }
  }
  return FinishUnary(this, ctx, "ReportRecipient", s, v1::ReportRecipientResponse(), response);
}

}  // namespace kvrelay
