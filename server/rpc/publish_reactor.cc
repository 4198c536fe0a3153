#include "server/rpc/publish_reactor.h"

#include <map>
#include <memory>
#include <optional>

#include "core/mutex.h"
#include "core/pipeline.h"
#include "core/status_macros.h"
#include "proto/raw_chunk.h"
#include "proto/status_util.h"
#include "absl/strings/str_join.h"
#include "proto/wire.h"
#include "server/mesh/forwarder.h"
#include "server/rpc/internal/call_util.h"
#include "server/rpc/publish_plan.h"
#include "server/rpc/request_checks.h"
#include "server/mesh/routing.h"
#include "server/rpc/upload.h"
#include "spdlog/spdlog.h"

namespace kvrelay {
namespace {

class PublishReactor final
    : public UploadReactor<PublishReactor, grpc::ServerReadReactor<grpc::ByteBuffer>, v1::PublishRequest> {
 public:
  PublishReactor(RelayContext* relay, grpc::CallbackServerContext* ctx, grpc::ByteBuffer* resp, Caller caller)
      : UploadReactor(relay, ctx, "publish"), wire_resp_(resp), caller_(std::move(caller)) {
    StartUpload();
  }

  void OnDone() override {
    if (source_) source_->Resolve(nullptr);  // no effect once committed
    StopWatching();
    if (ticket_) relay_->store()->EndPublish(*ticket_);
    delete this;
  }

 private:
  friend class UploadReactor;
  friend ReadLoop;

  // On a relay with routes, a pod speaks only for the agents that live in
  // it: the sender must have no route, or a route to this relay.
  absl::Status CheckSenderIsLocal(const std::string& sender) {
    if (!relay_->routes() || !relay_->routes()->enabled()) return absl::OkStatus();
    absl::StatusOr<std::optional<std::string>> r = relay_->routes()->Resolve(sender, "header.sender");
    if (r.ok() && !r->has_value()) return absl::OkStatus();
    return relay_->Forbid(*ctx_, "publish",
                        absl::StrCat("header.sender: agent \"", sender, "\" is not local to this relay (",
                                     r.ok() ? absl::StrCat("it routes to ", **r) : std::string(r.status().message()),
                                     "); publish at the agent's own relay"));
  }

  absl::Status OnHeader(const v1::PublishHeader& h) {
    header_ = h;  // for the logs, also when it is rejected
    KVRELAY_RETURN_IF_ERROR(CheckId("header.sender", h.sender()));
    KVRELAY_RETURN_IF_ERROR(relay_->CheckActsAs(*ctx_, "publish", caller_, "header.sender", h.sender()));
    KVRELAY_RETURN_IF_ERROR(CheckSenderIsLocal(h.sender()));
    KVRELAY_RETURN_IF_ERROR(CheckId("header.session_id", h.session_id()));
    // From here a CloseSession of the session fences this publish.
    ticket_ = relay_->store()->BeginPublish(h.session_id());
    KVRELAY_ASSIGN_OR_RETURN(
        PublishPlan plan,
        PlanPublish(h, PlanInputs{relay_->config(), *relay_->store(), [this] { return relay_->NewMessageId(); },
                                  relay_->routes()}));
    header_ = plan.header;
    resp_.set_message_id(header_.message_id());
    if (plan.duplicate) {
      ReplyDuplicate(plan.duplicate);
      return absl::OkStatus();
    }
    layout_ = plan.shape;
    if (plan.remote.empty()) {
      MutexLock lock(&mu_);
      return upload_.Start(plan.shape, std::move(plan.pipeline), std::move(plan.parent), plan.prompt_pos0);
    }
    return StartWithForwards(std::move(plan));
  }

  // A publish with recipients on other relays: reserves the outbox for each
  // destination, starts the upload, and starts one forward per destination
  // at once; each forward streams the layers as they are compressed and
  // sends its commit once the message is committed here.
  absl::Status StartWithForwards(PublishPlan plan) {
    Forwarder* fwd = relay_->forwarder();
    if (!fwd) return absl::InternalError("publish: recipients on other relays, but this relay cannot forward");
    std::vector<std::string> reserved;
    auto release = [&] {
      for (const std::string& t : reserved) relay_->store()->ReleaseOutbox(t, plan.min_bytes);
    };
    for (const auto& [target, agents] : plan.remote) {
      absl::Status s = relay_->store()->ReserveOutbox(target, plan.min_bytes);
      if (!s.ok()) {
        release();
        return absl::ResourceExhaustedError(absl::StrCat("header.recipients (", absl::StrJoin(agents, ","),
                                                         " on relay ", target, "): ", s.message()));
      }
      reserved.push_back(target);
    }
    const v1::ForwardHeader fh = ForwardHeaderFor(plan);
    source_ = std::make_shared<ForwardSource>(plan.shape.layers, nullptr);
    std::weak_ptr<ForwardSource> weak = source_;
    absl::Status s;
    {
      MutexLock lock(&mu_);
      s = upload_.Start(plan.shape, std::move(plan.pipeline), std::move(plan.parent), plan.prompt_pos0,
                        [weak](int l, const MessageLayer& layer) {
                          if (auto src = weak.lock()) src->SetLayer(l, layer);
                        });
      if (s.ok()) source_->AddOwner(upload_.pending());  // the layers live there until the commit
    }
    if (!s.ok()) {
      release();
      source_->Resolve(nullptr);
      return s;
    }
    for (auto& [target, agents] : plan.remote) {
      for (const std::string& a : agents) remote_[a] = target;
      fwd->Enqueue(target, agents, fh, source_, plan.min_bytes);
    }
    return absl::OkStatus();
  }

  void ReplyDuplicate(const MessagePtr& prior) {
    resp_.set_message_id(prior->message_id);
    *resp_.mutable_accounting() = ToProto(prior->accounting);
    resp_.set_duplicate(true);
    if (relay_->metrics()) relay_->metrics()->AddOutcome("duplicate");
    spdlog::info("publish duplicate session={} message={}", prior->session_id, prior->message_id);
    FinishOnce(grpc::Status::OK);
  }

  // Runs once every layer is compressed, on a worker (or inline).
  void Complete() {
    std::shared_ptr<PendingCompression> pending = upload_.pending();
    absl::Status s = pending->status();
    if (!s.ok()) return Fail(s);
    auto m = std::make_shared<StoredMessage>();
    m->session_id = header_.session_id();
    m->message_id = header_.message_id();
    m->sender = header_.sender();
    m->role = header_.role();
    m->parent_id = header_.parent_id();
    m->recipients.assign(header_.recipients().begin(), header_.recipients().end());
    m->requested_policy = header_.policy();
    m->layout = layout_;
    m->remote = remote_;
    // A call already over (cancelled, or its deadline passed: the client
    // has its error) must not commit a message its sender thinks failed.
    if (ctx_->IsCancelled()) return Fail(absl::CancelledError("publish: cancelled before the commit"));
    m->msg = pending->TakeMessage();
    if (source_) source_->AddOwner(m);  // the layers' buffers moved into m
    m->family = PolicyFamily(m->msg.policy);
    m->bytes = RetainedBytes(m->msg);
    m->started = started_;
    const double compress_s = pending->compress_seconds();
    m->accounting = AccountingOf(m->msg, upload_.received(), compress_s, SecondsSince(started_));
    absl::StatusOr<Store::CommitResult> r = relay_->store()->Commit(m, *ticket_);
    if (!r.ok()) return Fail(r.status());
    if (r->duplicate) {  // the same id committed while this one uploaded: its forwards go
      if (source_) source_->Resolve(nullptr);
      if (absl::Status same = CheckSamePublish(header_, *r->msg); !same.ok()) return Fail(same);
      return ReplyDuplicate(r->msg);
    }
    if (source_) source_->Resolve(r->msg);  // the forwards send their commits
    const StoredMessage& c = *r->msg;
    resp_.set_message_id(c.message_id);
    *resp_.mutable_accounting() = ToProto(c.accounting);
    if (Metrics* mx = relay_->metrics()) {
      mx->AddCommitted(c.family, c.msg.full_bytes, c.msg.sent_bytes);
      mx->AddOutcome("committed");
      mx->ObserveCompress(compress_s);
      mx->ObserveVisible(c.accounting.commit_seconds);
      if (c.msg.attention_error) mx->ObserveAttentionError(c.family, *c.msg.attention_error);
      uint64_t head = 0, layer = 0;
      for (const MessageLayer& l : c.msg.layers) {
        head += l.granularity == Granularity::kHead;
        layer += l.granularity == Granularity::kLayer;
      }
      if (head + layer > 0) mx->AddAutoGranularity(head, layer);
    }
    spdlog::info("publish committed session={} message={} from={} recipients={} policy={} full={} sent={} "
                 "ratio={:.2f} compress_s={:.4f} commit_s={:.4f}",
                 c.session_id, c.message_id, c.sender, c.recipients.size(), c.msg.policy, c.msg.full_bytes,
                 c.msg.sent_bytes, c.msg.Ratio(), compress_s, c.accounting.commit_seconds);
    FinishOnce(grpc::Status::OK);
  }

  void Fail(const absl::Status& s) {
    if (source_) source_->Resolve(nullptr);  // the forwards are cancelled: nothing reaches a destination
    CancelUpload();
    relay_->NoteUploadFailure("publish", s);
    // A refusal (counted and logged as one) is no failed message.
    if (s.code() != absl::StatusCode::kPermissionDenied) {
      relay_->store()->AddFailed();
      if (relay_->metrics()) relay_->metrics()->AddOutcome("failed");
      spdlog::info("publish failed session={} message={}: {}", header_.session_id(), header_.message_id(),
                   s.ToString());
    }
    FinishOnce(ToGrpcStatus(s));
  }

  void FinishOnce(const grpc::Status& status) {
    if (!TryFinish()) return;
    const grpc::Status s = AsClientSees(*ctx_, status);
    relay_->CountRpc("Publish", s);
    DropUpload();
    if (s.ok()) *wire_resp_ = EncodeProto(resp_);
    Finish(s);
  }

  grpc::ByteBuffer* const wire_resp_;
  const Caller caller_;
  v1::PublishResponse resp_;
  v1::PublishHeader header_;
  TurnLayout layout_;  // header_.geometry as checked (CheckGeometry)
  std::optional<Store::PublishTicket> ticket_;  // from the header on; ended in OnDone
  std::shared_ptr<ForwardSource> source_;        // with recipients on other relays
  std::map<std::string, std::string> remote_;    // recipient -> its relay
};

}  // namespace

grpc::ServerReadReactor<grpc::ByteBuffer>* NewPublishReactor(RelayContext* relay, grpc::CallbackServerContext* ctx,
                                                            grpc::ByteBuffer* response, Caller caller) {
  return new PublishReactor(relay, ctx, response, std::move(caller));
}

}  // namespace kvrelay
