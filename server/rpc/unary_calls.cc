#include "server/rpc/unary_calls.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "proto/raw_chunk.h"
#include "proto/status_util.h"
#include "core/status_macros.h"
#include "server/auth/auth.h"
#include "server/mesh/forwarder.h"
#include "server/rpc/internal/call_util.h"
#include "server/rpc/request_checks.h"
#include "spdlog/spdlog.h"

namespace kvrelay {
namespace {

// Finishes a unary call with `s` (and, when OK, `resp` as the response).
template <typename Response>
void FinishUnaryWith(RelayContext* relay, grpc::ServerUnaryReactor* r, const char* rpc, const absl::Status& s,
                     const Response& resp, grpc::ByteBuffer* wire) {
  const grpc::Status g = ToGrpcStatus(s);
  if (g.ok()) *wire = EncodeProto(resp);
  relay->CountRpc(rpc, g);
  r->Finish(g);
}

template <typename Response>
grpc::ServerUnaryReactor* FinishUnary(RelayContext* relay, grpc::CallbackServerContext* ctx, const char* rpc,
                                      const absl::Status& s, const Response& resp, grpc::ByteBuffer* wire) {
  grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
  FinishUnaryWith(relay, r, rpc, s, resp, wire);
  return r;
}

// An agent may close a session it sent or received a message in; a peer
// relay (a propagated close) one in which messages passed between the two,
// or one already closed here (the close came back: nothing is left to free).
absl::StatusOr<Caller> CheckMayClose(const RelayContext* relay, const grpc::CallbackServerContext& ctx,
                                     const v1::CloseSessionRequest& req) {
  const std::string& session = req.session_id();
  if (req.propagated()) {
    KVRELAY_ASSIGN_OR_RETURN(Caller peer, relay->AuthenticatePeer(ctx, "close session"));
    if (peer.identity.empty() || relay->store()->IsClosed(session)) return peer;
    for (const std::string& target : relay->store()->Peers(session)) {
      if (peer.PeerIsHost(TargetHost(target))) return peer;
    }
    return relay->Forbid(ctx, "close session",
                  absl::StrCat("session_id: ", peer.Describe(), " exchanged no message of session '", session,
                               "' with this relay"));
  }
  KVRELAY_ASSIGN_OR_RETURN(Caller caller, relay->AuthenticateAgent(ctx, "close session"));
  if (caller.kind != Caller::Kind::kAgent || relay->store()->IsParticipant(session, caller.agent)) return caller;
  return relay->Forbid(ctx, "close session",
                absl::StrCat("session_id: caller is ", caller.Describe(), ", which sent or received no message of "
                             "session '", session, "' here"));
}

// An agent may read the status of a message it sent or is a recipient of.
absl::Status CheckMayReadStatus(const RelayContext* relay, const Caller& caller,
                                const v1::MessageStatusRequest& req) {
  if (caller.kind != Caller::Kind::kAgent) return absl::OkStatus();
  MessagePtr m = relay->store()->Find(req.session_id(), req.message_id());
  if (m && MaySee(*m, caller.agent)) return absl::OkStatus();
  return NotVisibleError("message_id", req.session_id(), req.message_id(), caller.agent);
}

}  // namespace

grpc::ServerUnaryReactor* HandleAck(RelayContext* relay, grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                            grpc::ByteBuffer* response) {
  v1::AckRequest req;
  // Credentials first: a caller without them learns nothing, not even
  // whether its request was well-formed.
  absl::StatusOr<Caller> caller = relay->AuthenticateAgent(*ctx, "ack");
  absl::Status s = caller.status();
  if (s.ok()) s = ParseRequest(*request, "ack", &req);
  if (s.ok()) s = CheckId("session_id", req.session_id());
  if (s.ok()) s = CheckId("agent", req.agent());
  if (s.ok()) s = CheckId("message_id", req.message_id());
  if (s.ok()) s = relay->CheckActsAs(*ctx, "ack", *caller, "agent", req.agent());
  if (!s.ok()) return FinishUnary(relay, ctx, "Ack", s, v1::AckResponse(), response);
  // A durable store answers once the ack is on disk, on its own thread: the
  // call's reaction does not wait for it.
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  relay->store()->AckAsync(req.session_id(), req.agent(), req.message_id(),
                   [relay, reactor, response, session = req.session_id(), agent = req.agent(),
                    id = req.message_id()](const absl::Status& st) {
                     if (st.ok() && relay->forwarder()) {
                       MessagePtr m = relay->store()->Find(session, id);
                       if (m && m->forwarded) relay->forwarder()->Report(*m, agent, TrackState::kAcked);
                     }
                     FinishUnaryWith(relay, reactor, "Ack", st, v1::AckResponse(), response);
                   });
  return reactor;
}

grpc::ServerUnaryReactor* HandleCloseSession(RelayContext* relay, grpc::CallbackServerContext* ctx,
                                                     const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  v1::CloseSessionRequest req;
  absl::Status s = ParseRequest(*request, "close session", &req);
  // Which credentials apply depends on the request (propagated or not); a
  // caller without any still learns nothing of a malformed one.
  if (!s.ok()) {
    if (absl::Status a = relay->AuthenticateAgent(*ctx, "close session").status(); !a.ok()) s = a;
  }
  if (s.ok()) s = CheckId("session_id", req.session_id());
  absl::StatusOr<Caller> caller = s.ok() ? CheckMayClose(relay, *ctx, req) : absl::StatusOr<Caller>(s);
  if (s.ok()) s = caller.status();
  if (!s.ok()) return FinishUnary(relay, ctx, "CloseSession", s, v1::CloseSessionResponse(), response);
  // A durable store answers once the close is on disk, on its own thread:
  // the call's reaction does not wait for it.
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  relay->store()->CloseSessionAndPeersAsync(
      req.session_id(), [relay, reactor, response, req, caller = *std::move(caller)](Store::CloseResult r) {
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
          if (r.first && relay->forwarder() && !r.peers.empty()) relay->forwarder()->PropagateClose(req.session_id(), r.peers);
        }
        FinishUnaryWith(relay, reactor, "CloseSession", r.status, resp, response);
      });
  return reactor;
}

grpc::ServerUnaryReactor* HandleStats(RelayContext* relay, grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                              grpc::ByteBuffer* response) {
  v1::StatsRequest req;
  v1::StatsResponse resp;
  absl::Status s = relay->AuthenticateAgent(*ctx, "stats").status();
  if (s.ok()) s = ParseRequest(*request, "stats", &req);
  if (s.ok()) {
    const StoreStats st = relay->store()->Stats();
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
  return FinishUnary(relay, ctx, "Stats", s, resp, response);
}

grpc::ServerUnaryReactor* HandleMessageStatus(RelayContext* relay, grpc::CallbackServerContext* ctx,
                                                      const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  v1::MessageStatusRequest req;
  absl::StatusOr<Caller> caller = relay->AuthenticateAgent(*ctx, "message status");
  absl::Status s = caller.status();
  if (s.ok()) s = ParseRequest(*request, "message status", &req);
  if (s.ok()) s = CheckId("session_id", req.session_id());
  if (s.ok()) s = CheckId("message_id", req.message_id());
  if (s.ok()) s = CheckMayReadStatus(relay, *caller, req);
  v1::MessageStatusResponse resp;
  if (s.ok()) {
    absl::StatusOr<Store::MessageReport> r = relay->store()->MessageStatus(req.session_id(), req.message_id());
    if (r.ok()) {
      resp.set_sender(r->sender);
      resp.set_forwarded_by(r->forwarded_by);
      for (const Store::RecipientReport& x : r->recipients) {
        v1::RecipientStatus* y = resp.add_recipients();
        y->set_agent(x.agent);
        y->set_state(static_cast<v1::RecipientState>(x.state));  // the same values
        y->set_relay(x.relay);
        y->set_reason(x.reason);
        y->set_attempts(x.attempts);
      }
    }
    s = r.status();
  }
  return FinishUnary(relay, ctx, "MessageStatus", s, resp, response);
}

grpc::ServerUnaryReactor* HandleReportRecipient(RelayContext* relay, grpc::CallbackServerContext* ctx,
                                                        const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  v1::ReportRecipientRequest req;
  absl::StatusOr<Caller> peer = relay->AuthenticatePeer(*ctx, "report recipient");
  absl::Status s = peer.status();
  if (s.ok()) s = ParseRequest(*request, "report recipient", &req);
  if (s.ok()) s = CheckId("session_id", req.session_id());
  if (s.ok()) s = CheckId("message_id", req.message_id());
  if (s.ok()) s = CheckId("agent", req.agent());
  if (s.ok() && req.state() != v1::RECIPIENT_STATE_DELIVERED && req.state() != v1::RECIPIENT_STATE_ACKED) {
    s = absl::InvalidArgumentError(absl::StrCat("state: ", v1::RecipientState_Name(req.state()),
                                                ", expected RECIPIENT_STATE_DELIVERED or RECIPIENT_STATE_ACKED"));
  }
  MessagePtr m = s.ok() ? relay->store()->Find(req.session_id(), req.message_id()) : nullptr;
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
      s = relay->Forbid(*ctx, "report recipient",
                 absl::StrCat("agent: ", peer->Describe(), " is not the relay of agent '", req.agent(), "' (",
                              remote->second, ")"));
    } else {
      Store::RecipientTrack t;
      t.state = static_cast<TrackState>(req.state());  // DELIVERED or ACKED, checked above
      relay->store()->TrackRecipient(req.session_id(), req.message_id(), req.agent(), t);
    }
  }
  return FinishUnary(relay, ctx, "ReportRecipient", s, v1::ReportRecipientResponse(), response);
}

}  // namespace kvrelay
