#include "server/rpc/fetch_reactor.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/mutex.h"
#include "core/quant.h"
#include "proto/raw_chunk.h"
#include "proto/status_util.h"
#include "proto/wire.h"
#include "server/rpc/internal/call_util.h"
#include "proto/stream_codec.h"
#include "server/mesh/forwarder.h"
#include "server/rpc/request_checks.h"
#include "server/rpc/watchdog.h"
#include "spdlog/spdlog.h"

namespace kvrelay {
namespace {

class FetchReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  // `parsed`: whether the request was a FetchRequest at all (ParseRequest).
  FetchReactor(RelayContext* relay, grpc::CallbackServerContext* ctx, const v1::FetchRequest& req,
               const absl::Status& parsed)
      : relay_(relay), ctx_(ctx), session_(req.session_id()), agent_(req.agent()), auto_ack_(req.auto_ack()) {
    absl::Status s = parsed;
    if (s.ok()) s = CheckId("session_id", session_);
    if (s.ok()) s = CheckId("agent", agent_);
    if (!s.ok()) {
      FinishOnce(ToGrpcStatus(s));
      return;
    }
    // Wait no longer than a day, whatever the deadline (none: infinite).
    const auto remaining = ctx->deadline() - std::chrono::system_clock::now();
    const auto cap = std::chrono::hours(24);
    deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::min<std::chrono::system_clock::duration>(remaining, cap));
    OnWake(Store::Wake::kMessage);
  }

  void OnCancel() override {
    bool finish = false;
    {
      MutexLock lock(&mu_);
      cancelled_ = true;
      if (waiting_ && relay_->store()->CancelWaiter(waiter_)) {
        waiting_ = false;
        finish = true;
      }
    }
    if (finish) FinishOnce(grpc::Status(grpc::CANCELLED, "fetch: cancelled while waiting"));
  }

  void OnWriteDone(bool ok) override {
    reply_idle_->Touch();
    if (!ok) return FinishOnce(grpc::Status(grpc::CANCELLED, "fetch: stream broken while delivering"));
    if (out_->NextChunk<v1::FetchResponse>(&wire_)) return StartWrite(&wire_);
    if (trailer_sent_) return Delivered();
    trailer_sent_ = true;
    wire_ = out_->EncodeTrailer<v1::FetchResponse>();
    // The trailer goes once the store has recorded the delivery.
    relay_->store()->BeforeDelivered(session_, agent_, delivery_.msg->message_id, [this](const absl::Status& s) {
      if (!s.ok()) return FinishOnce(ToGrpcStatus(s));
      StartWrite(&wire_);
    });
  }

  void OnDone() override {
    if (reply_idle_) reply_idle_->Disarm();
    if (decoded_reserved_) relay_->store()->ReleaseInflight(decoded_reserved_);
    delete this;
  }

 private:
  // Tries to take a delivery; otherwise waits (again).
  void OnWake(Store::Wake why) {
    std::optional<grpc::Status> fin;
    std::optional<Store::Delivery> d;
    const grpc::Status shutdown(grpc::UNAVAILABLE, "fetch: the relay is shutting down, retry elsewhere or later");
    {
      MutexLock lock(&mu_);
      waiting_ = false;
      if (cancelled_) {
        fin = grpc::Status(grpc::CANCELLED, "fetch: cancelled while waiting");
      } else if (why == Store::Wake::kTimeout) {
        fin = grpc::Status(grpc::DEADLINE_EXCEEDED,
                           absl::StrCat("fetch: no message for agent '", agent_, "' in session '", session_,
                                        "' before the deadline"));
      } else if (why == Store::Wake::kClosed) {
        fin = grpc::Status(grpc::NOT_FOUND, absl::StrCat("session_id: '", session_,
                                                         "': session closed while waiting (CloseSession)"));
      } else if (why == Store::Wake::kShutdown) {
        fin = shutdown;
      } else {
        d = relay_->store()->FetchOrWait(session_, agent_, deadline_, [this](Store::Wake w) { OnWake(w); },
                                       &waiter_);
        if (!d) {
          if (waiter_ == 0) fin = shutdown;  // the store no longer takes waiters
          else waiting_ = true;
        }
      }
    }
    if (fin) return FinishOnce(*fin);
    if (d) Begin(std::move(*d));
  }

  void Begin(Store::Delivery d) {
    delivery_ = std::move(d);
    // Lloyd codes and demoted tokens are relay formats: agents get them
    // decoded, on a worker (the decode is O(bytes); this thread may be the
    // store's or gRPC's).
    if (AgentsReceiveDecoded(delivery_.msg->msg)) {
      relay_->pool()->Schedule([this] { DecodeAndSend(); });
      return;
    }
    Send(nullptr);
  }

  void DecodeAndSend() {
    const StoredMessage& m = *delivery_.msg;
    absl::StatusOr<Message> dense = DecodedMessage(m.msg);
    if (!dense.ok()) {
      spdlog::error("fetch: session={} message={} does not decode: {}", session_, m.message_id,
                    dense.status().ToString());
      return FinishOnce(grpc::Status(grpc::INTERNAL, absl::StrCat("fetch: the stored message does not decode: ",
                                                                  dense.status().message())));
    }
    auto decoded = std::make_shared<const Message>(*std::move(dense));
    // The decoded copy exists until the client has read it: in flight (the
    // memory exists already, so whatever the limit) until OnDone.
    decoded_reserved_ = RetainedBytes(*decoded);
    relay_->store()->AddInflight(decoded_reserved_);
    Send(std::move(decoded));
  }

  // Starts the delivery of the stored message, or of `decoded` (its dense
  // form) when given.
  void Send(std::shared_ptr<const Message> decoded) {
    const StoredMessage& m = *delivery_.msg;
    out_.emplace();
    if (decoded) {
      out_->Append(MessageDeliveryOrder(*decoded), decoded);
    } else {
      out_->Append(MessageDeliveryOrder(m.msg), delivery_.msg);  // sent from the stored message
    }
    v1::FetchResponse resp;
    v1::MessageHeader* h = resp.mutable_header();
    h->set_message_id(m.message_id);
    h->set_session_id(m.session_id);
    h->set_sender(m.sender);
    h->set_role(m.role);
    h->set_parent_id(m.parent_id);
    FillMessageHeader(decoded ? *decoded : m.msg, h);
    *h->mutable_accounting() = ToProto(m.accounting);
    if (decoded) {  // the header describes what is delivered
      h->mutable_accounting()->set_sent_bytes(decoded->sent_bytes);
      h->mutable_accounting()->set_ratio(decoded->Ratio());
    }
    h->set_delivery_attempt(delivery_.attempt);
    wire_ = EncodeProto(resp);
    // A delivery holds its message (also one its session no longer retains)
    // until the client has read it: a client that stops reading for the idle
    // timeout is cancelled.
    reply_idle_ = relay_->watchdog()->Watch([this] { OnReplyStalled(); });
    StartWrite(&wire_);
  }

  // On the watchdog thread, under reply_idle_->mu: a write has been pending
  // for the timeout. The cancel fails the write and OnWriteDone finishes the
  // call (the client sees gRPC's CANCELLED, so the reason is logged here).
  void OnReplyStalled() {
    if (finished_) return;
    spdlog::info("fetch: session={} message={} to={} not read for {} s (--upload-idle-timeout-seconds), cancelling",
                 session_, delivery_.msg->message_id, agent_, relay_->watchdog()->timeout_seconds());
    ctx_->TryCancel();
  }

  void Delivered() {
    const StoredMessage& m = *delivery_.msg;
    // The watchdog may have cancelled the call just before the last write
    // completed: the client then sees CANCELLED, so nothing counts.
    if (ctx_->IsCancelled()) return FinishOnce(grpc::Status(grpc::CANCELLED, "fetch: cancelled while delivering"));
    // The hop latency: the first complete delivery to this recipient, which
    // may be a later attempt than the first (one cancelled mid-stream).
    const bool first = relay_->store()->MarkDelivered(session_, agent_, m.message_id);
    if (Metrics* mx = relay_->metrics()) {
      mx->AddOutcome("delivered");
      if (first) mx->ObserveDelivered(std::chrono::duration<double>(Clock::now() - m.started).count());
    }
    absl::Status s;
    if (auto_ack_) s = relay_->store()->Ack(session_, agent_, m.message_id);
    if (m.forwarded && relay_->forwarder()) {  // tell the relay it came from, best effort
      if (first) relay_->forwarder()->Report(m, agent_, TrackState::kDelivered);
      if (auto_ack_ && s.ok()) relay_->forwarder()->Report(m, agent_, TrackState::kAcked);
    }
    spdlog::info("fetch delivered session={} message={} to={} attempt={} auto_ack={}", session_, m.message_id,
                 agent_, delivery_.attempt, auto_ack_);
    // An auto-ack can only fail when the session was closed meanwhile: the
    // message was delivered all the same.
    (void)s;
    FinishOnce(grpc::Status::OK);
  }

  void FinishOnce(const grpc::Status& status) {
    if (finished_.exchange(true)) return;
    const grpc::Status s = AsClientSees(*ctx_, status);
    relay_->CountRpc("Fetch", s);
    Finish(s);
  }

  RelayContext* const relay_;
  grpc::CallbackServerContext* const ctx_;
  const std::string session_, agent_;
  const bool auto_ack_;
  Clock::time_point deadline_;
  Mutex mu_;
  bool waiting_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t waiter_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<bool> finished_{false};
  Store::Delivery delivery_;
  std::optional<ChunkStreamWriter> out_;
  uint64_t decoded_reserved_ = 0;  // in flight until OnDone
  bool trailer_sent_ = false;  // the trailer's write has started (or is waiting for the store)
  grpc::ByteBuffer wire_;  // the response being written
  std::shared_ptr<UploadWatchdog::Entry> reply_idle_;  // set before the first write
};

}  // namespace

grpc::ServerWriteReactor<grpc::ByteBuffer>* NewFetchReactor(RelayContext* relay, grpc::CallbackServerContext* ctx,
                                                           const v1::FetchRequest& req, const absl::Status& parsed) {
  return new FetchReactor(relay, ctx, req, parsed);
}

}  // namespace kvrelay
