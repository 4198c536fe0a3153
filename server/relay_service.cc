#include "server/relay_service.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>
#include <optional>
#include <random>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/text_format.h"
#include "core/pipeline.h"
#include "core/status_macros.h"
#include "proto/raw_chunk.h"
#include "proto/status_util.h"
#include "proto/stream_codec.h"
#include "proto/wire.h"
#include "server/pending.h"
#include "spdlog/spdlog.h"

namespace kvrelay {
namespace {

// The spec bound (kMaxSpecBytes), checked before parsing so that the error
// names the header field. Specs are tens of bytes; the bound keeps error
// messages (which quote the spec) and log lines small, and under the 8 KiB of
// trailing metadata gRPC clients accept by default.
absl::Status CheckPolicyLength(const std::string& policy) {
  if (policy.size() <= kMaxSpecBytes) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("header.policy: ", policy.size(), " bytes, expected at most ", kMaxSpecBytes));
}

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Whether the call's deadline has passed (none: never). gRPC's deadline
// timer may fire a little before ctx.deadline() reads as past: within
// kDeadlineSlack counts as passed.
constexpr std::chrono::milliseconds kDeadlineSlack(20);
bool DeadlinePassed(const grpc::CallbackServerContext& ctx) {
  return ctx.deadline() <= std::chrono::system_clock::now() + kDeadlineSlack;
}

// `s` as the client sees it: gRPC cancels a call at its deadline (a waiting
// Fetch, possibly before the store's own timer; an upload mid-stream; a
// reply being written), and the client gets DEADLINE_EXCEEDED, so a
// CANCELLED after the deadline is that. Every reactor's FinishOnce applies it.
grpc::Status AsClientSees(const grpc::CallbackServerContext& ctx, const grpc::Status& s) {
  if (s.error_code() != grpc::CANCELLED || !DeadlinePassed(ctx)) return s;
  return grpc::Status(grpc::DEADLINE_EXCEEDED, absl::StrCat(s.error_message(), " (the call's deadline passed)"));
}

void FillAccounting(const Message& m, uint64_t received, double compress_s, double commit_s,
                    v1::Accounting* a) {
  a->set_received_bytes(received);
  a->set_full_bytes(m.full_bytes);
  a->set_sent_bytes(m.sent_bytes);
  a->set_ratio(m.Ratio());
  a->set_compress_seconds(compress_s);
  a->set_commit_seconds(commit_s);
  a->set_policy(m.policy);
}

// The parent's tokens as the dense history each layer's compression holds:
// K and V in the upload's dtype plus position ids, every layer.
uint64_t DenseHistoryBytes(const UploadShape& shape, const StoredMessage& parent) {
  const uint64_t tokens = parent.msg.layers.empty() ? 0 : parent.msg.layers[0].tokens();
  return static_cast<uint64_t>(shape.layers) * shape.geo.kv_heads * tokens *
         (2ull * shape.geo.head_dim * DTypeSize(shape.geo.dtype) + 4);
}

// A field's value for an error message; "unset" for an optional one not set.
std::string FieldText(const google::protobuf::Message& m, const google::protobuf::FieldDescriptor* f) {
  if (f->has_presence() && !m.GetReflection()->HasField(m, f)) return "unset";
  std::string out;
  google::protobuf::TextFormat::PrintFieldValueToString(m, f, -1, &out);
  return out;
}

// OK when `h` asks for what the committed `prior` holds (sender, recipients
// in any order, role, policy as requested, parent, geometry): a retry of
// the same publish. ALREADY_EXISTS naming the first field that differs
// otherwise. The tensor data is not compared (a retry is answered before it
// arrives).
absl::Status CheckSamePublish(const v1::PublishHeader& h, const StoredMessage& prior) {
  auto differs = [&](absl::string_view field, absl::string_view now, absl::string_view then) {
    return absl::AlreadyExistsError(absl::StrCat(
        "header.message_id: '", prior.message_id, "' is already committed in session '", prior.session_id,
        "' with ", field, " ", then, ", this publish has ", now,
        "; reuse a message id only to retry the same publish"));
  };
  auto quoted = [](absl::string_view v) { return absl::StrCat("'", absl::CHexEscape(v), "'"); };
  if (h.sender() != prior.sender) return differs("header.sender", quoted(h.sender()), quoted(prior.sender));
  std::vector<std::string> now(h.recipients().begin(), h.recipients().end()), then = prior.recipients;
  std::sort(now.begin(), now.end());
  std::sort(then.begin(), then.end());
  if (now != then) {
    return differs("header.recipients", absl::StrCat("[", absl::StrJoin(now, ","), "]"),
                   absl::StrCat("[", absl::StrJoin(then, ","), "]"));
  }
  if (h.role() != prior.role) return differs("header.role", quoted(h.role()), quoted(prior.role));
  if (h.policy() != prior.requested_policy) {
    return differs("header.policy", quoted(h.policy()), quoted(prior.requested_policy));
  }
  if (h.parent_id() != prior.parent_id) {
    return differs("header.parent_id", quoted(h.parent_id()), quoted(prior.parent_id));
  }
  const google::protobuf::Descriptor* d = v1::TurnGeometry::descriptor();
  for (int i = 0; i < d->field_count(); ++i) {
    const std::string a = FieldText(h.geometry(), d->field(i)), b = FieldText(prior.geometry, d->field(i));
    if (a != b) return differs(absl::StrCat("header.geometry.", d->field(i)->name()), a, b);
  }
  return absl::OkStatus();
}

// The receiving half shared by Publish and Compress: geometry, in-flight
// reservation, chunk assembly, per-layer compression, commit checks.
class Upload {
 public:
  explicit Upload(RelayService* svc) : svc_(svc) {}

  // Starts after a checked header.
  // Reserves shape.ReserveBytes() plus, with a parent, the parent's dense
  // (decoded) size: every layer's compression holds the parent's layer as
  // dense history while it runs.
  absl::Status Start(const UploadShape& shape, std::shared_ptr<const Pipeline> pipeline, MessagePtr parent,
                     int64_t prompt_pos0) {
    const uint64_t history = parent ? DenseHistoryBytes(shape, *parent) : 0;
    const uint64_t bytes = shape.ReserveBytes() + history;
    KVRELAY_RETURN_IF_ERROR(svc_->store()->ReserveInflight(
        bytes, absl::StrCat("upload of ", shape.UploadBytes(), " tensor bytes + ",
                            shape.ReserveBytes() - shape.UploadBytes(), " bookkeeping",
                            parent ? absl::StrCat(" + ", history, " of parent '", parent->message_id,
                                                  "' decoded as history")
                                   : "")));
    assembler_.emplace(shape);
    pending_ = std::make_shared<PendingCompression>(std::move(pipeline), shape, std::move(parent), prompt_pos0,
                                                    svc_->pool(), svc_->store(), bytes);
    SubmitCompleted();
    return absl::OkStatus();
  }

  bool started() const { return pending_ != nullptr; }

  absl::Status Chunk(const ChunkView& c) {
    KVRELAY_RETURN_IF_ERROR(UploadStatus(assembler_->Accept(c)));
    svc_->store()->AddReceived(c.size);
    if (svc_->metrics()) svc_->metrics()->AddReceived(c.size);
    SubmitCompleted();
    return pending_->status();  // a layer may already have failed
  }

  absl::Status Commit(const v1::Trailer& t) { return UploadStatus(assembler_->CheckCommit(t)); }

  std::shared_ptr<PendingCompression> pending() const { return pending_; }
  uint64_t received() const { return assembler_ ? assembler_->bytes_received() : 0; }

  // Backpressure: true when max(2, workers) of the upload's layers are
  // queued or compressing; then the reactor reads no further until `resume`
  // runs (on a worker), and HTTP/2 flow control holds the client back.
  bool PauseIfBusy(std::function<void()> resume) {
    const int bound = std::max(2, svc_->pool()->size());
    return pending_ && pending_->PauseIfBusy(bound, std::move(resume));
  }

 private:
  void SubmitCompleted() {
    for (auto& [l, layer] : assembler_->TakeCompleted()) pending_->Submit(l, std::move(layer));
  }

  RelayService* svc_;
  std::optional<UploadReader> assembler_;
  std::shared_ptr<PendingCompression> pending_;
};

// What a worker calls to resume a reactor paused by backpressure. The
// reactor is deleted in OnDone, possibly before the paused upload's layers
// drain: like the idle watchdog, the worker goes through this shared gate,
// under the watchdog entry's mutex, and finds `resume` cleared once the
// reactor is done. The reactor's `resume` itself checks that it has not
// finished (no StartRead after Finish).
struct ReadGate {
  explicit ReadGate(std::shared_ptr<UploadWatchdog::Entry> e) : idle(std::move(e)) {}
  const std::shared_ptr<UploadWatchdog::Entry> idle;
  std::function<void()> resume;  // guarded by idle->mu; runs under it; cleared in OnDone

  static std::function<void()> Resumer(const std::shared_ptr<ReadGate>& gate) {
    return [gate] {
      std::lock_guard<std::mutex> lock(gate->idle->mu);
      if (gate->resume) gate->resume();
    };
  }
};

// The bytes a composed message of `shape` with `n_history` history tokens
// holds at least (RetainedBytes): every token's position ids, its K/V rows
// dense or as quantized codes (scales and zeros not counted), and the
// bookkeeping. Exact for dense policies.
uint64_t MinComposedBytes(const Pipeline& p, const UploadShape& shape, int n_history) {
  TurnGeometry g = shape.geo;
  g.n_history = n_history;
  Message counts;
  p.CountTokens(g, shape.first_agent, &counts);
  const uint64_t tokens = static_cast<uint64_t>(counts.n_history) + counts.n_anchor + counts.n_kept + counts.n_gen;
  const uint64_t row = p.config().quant ? static_cast<uint64_t>(g.head_dim) * p.config().quant->bits / 8
                                        : static_cast<uint64_t>(g.head_dim) * DTypeSize(g.dtype);
  return RetainedBytes(static_cast<uint64_t>(shape.layers) * g.kv_heads * tokens * (2 * row + 4),
                       static_cast<uint64_t>(shape.layers));
}

absl::Status CheckPolicyFor(const Pipeline& p, const TurnGeometry& geo, const std::string& field) {
  if (p.config().quant) {
    absl::Status s = ValidateQuantOptions(*p.config().quant, geo.head_dim);
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat(field, ": ", s.message()));
  }
  return absl::OkStatus();
}

// The upload half that Publish and Compress share: the request stream's
// header / chunks / commit protocol, the idle watchdog and backpressure.
// Derived supplies OnHeader(header) (which may finish the call, e.g. a
// duplicate publish), Complete() (on a worker once every layer is
// compressed) and Fail(status), and finishes only through TryFinish().
// Derived's constructor calls StartUpload() last, once it is whole.
// Requests arrive raw: a chunk is read straight out of gRPC's slices
// (RawMessage::AsChunk), anything else is parsed as a Request.
template <typename Derived, typename Reactor, typename Request>
class UploadReactor : public Reactor {
 public:
  void OnReadDone(bool ok) override {
    std::lock_guard<std::mutex> activity(idle_->mu);  // no idle firing during the reaction
    idle_->last = Clock::now();
    if (finished_) return;  // failed meanwhile (idle): read no further
    if (!ok) {
      if (ctx_->IsCancelled()) {
        const char* by = svc_->store()->shutting_down()
                             ? ": cancelled (by the client, or by the relay's shutdown at the end of its grace period)"
                             : ": cancelled by the client";
        return self().Fail(absl::CancelledError(absl::StrCat(rpc_, by)));
      }
      return self().Fail(absl::InvalidArgumentError(
          absl::StrCat(rpc_, upload_.started() ? ": stream ended before the commit, expected a commit trailer"
                                               : ": empty stream, expected a header first")));
    }
    if (!raw_.Reset(wire_)) return self().Fail(absl::InvalidArgumentError(absl::StrCat(rpc_, ": unreadable request")));
    absl::Status s;
    if (raw_.AsChunk(Request::kChunkFieldNumber, &chunk_)) {
      s = OnChunk(chunk_);
    } else if (!raw_.ParseAs(&req_)) {
      return self().Fail(absl::InvalidArgumentError(absl::StrCat(
          rpc_, ": request of ", raw_.size(), " bytes is not a kvrelay.v1.", Request::descriptor()->name(),
          " (malformed, or a string field that is not UTF-8)")));
    } else {
      switch (req_.kind_case()) {
        case Request::kHeader:
          if (upload_.started()) {
            s = absl::InvalidArgumentError("header: a second header, expected chunks or the commit");
          } else {
            s = self().OnHeader(req_.header());
            if (finished_) return;  // e.g. a duplicate publish: already answered
          }
          break;
        case Request::kChunk:
          chunk_ = ChunkView::Of(req_.chunk());
          s = OnChunk(chunk_);
          break;
        case Request::kCommit:
          if (!upload_.started()) {
            s = absl::InvalidArgumentError("commit: before the header, expected the header first");
            break;
          }
          s = upload_.Commit(req_.commit());
          if (s.ok()) {
            idle_->armed = false;  // uploaded: compression is not idleness
            upload_.pending()->WhenDone([this] { self().Complete(); });
            return;
          }
          break;
        default:
          s = absl::InvalidArgumentError("request: none of header, chunk, commit is set");
      }
    }
    if (!s.ok()) return self().Fail(s);
    ReleaseRequest();
    ReadNext();
  }

  void OnCancel() override { CancelUpload(); }

 protected:
  UploadReactor(RelayService* svc, grpc::CallbackServerContext* ctx, const char* rpc)
      : svc_(svc), ctx_(ctx), rpc_(rpc), upload_(svc), started_(Clock::now()) {}

  void StartUpload() {
    idle_ = svc_->watchdog()->Watch([this] { OnIdle(); });
    gate_ = std::make_shared<ReadGate>(idle_);
    gate_->resume = [this] { OnResume(); };
    this->StartRead(&wire_);
  }

  // From OnDone: neither the watchdog nor a worker may call in any more.
  void StopWatching() {
    std::lock_guard<std::mutex> lock(idle_->mu);
    idle_->armed = false;
    idle_->fire = nullptr;
    gate_->resume = nullptr;  // a worker may still hold the gate
  }

  // Stops the compression still running: its remaining layers are skipped.
  void CancelUpload() {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto p = upload_.pending()) p->Cancel();
  }

  // Drops the upload: its in-flight reservation returns once queued layers
  // drain, not when gRPC gets around to OnDone.
  void DropUpload() {
    std::lock_guard<std::mutex> lock(mu_);
    upload_ = Upload(svc_);
  }

  // True exactly once: the caller is the one to Finish the call.
  bool TryFinish() { return !finished_.exchange(true); }

  RelayService* const svc_;
  grpc::CallbackServerContext* const ctx_;
  const char* const rpc_;  // "publish" or "compress", for messages
  grpc::ByteBuffer wire_;  // the request being read
  RawMessage raw_;         // wire_'s slices
  ChunkView chunk_;        // a chunk request: views into raw_ (or req_)
  Request req_;            // any other request, parsed
  std::mutex mu_;  // guards upload_ against OnCancel
  Upload upload_;
  std::atomic<bool> finished_{false};
  const Clock::time_point started_;

 private:
  Derived& self() { return static_cast<Derived&>(*this); }

  // Drops the handled request's gRPC slices (a chunk's MiB) before the next
  // read, which a backpressure pause may delay.
  void ReleaseRequest() {
    chunk_ = ChunkView();
    raw_.Reset(grpc::ByteBuffer());
    wire_.Clear();
    req_.Clear();
  }

  absl::Status OnChunk(const ChunkView& c) {
    if (!upload_.started()) return absl::InvalidArgumentError("chunk: before the header, expected the header first");
    return upload_.Chunk(c);
  }

  // Under idle_->mu, after a read: reads on, unless backpressure pauses
  // the upload until a worker calls OnResume.
  void ReadNext() {
    if (upload_.PauseIfBusy(ReadGate::Resumer(gate_))) {
      idle_->last = Clock::time_point::max();  // our pause, not the client's idleness
      return;
    }
    this->StartRead(&wire_);
  }

  // On a worker, under idle_->mu: a paused upload's layers drained below the
  // bound (or were skipped after a cancel: the read then fails and ends the
  // call). Nothing else finishes the call while it is paused.
  void OnResume() {
    if (finished_) return;
    idle_->last = Clock::now();
    this->StartRead(&wire_);
  }

  // On the watchdog thread, under idle_->mu: nothing arrived for the timeout.
  void OnIdle() {
    if (finished_) return;
    self().Fail(absl::DeadlineExceededError(absl::StrFormat(
        "%s: upload idle for %g s (--upload-idle-timeout-seconds), expected %s", rpc_,
        svc_->watchdog()->timeout_seconds(), upload_.started() ? "chunks or the commit" : "the header")));
  }

  std::shared_ptr<UploadWatchdog::Entry> idle_;
  std::shared_ptr<ReadGate> gate_;
};

// ---------------------------------------------------------------- Publish

class PublishReactor final
    : public UploadReactor<PublishReactor, grpc::ServerReadReactor<grpc::ByteBuffer>, v1::PublishRequest> {
 public:
  PublishReactor(RelayService* svc, grpc::CallbackServerContext* ctx, grpc::ByteBuffer* resp)
      : UploadReactor(svc, ctx, "publish"), wire_resp_(resp) {
    StartUpload();
  }

  void OnDone() override {
    StopWatching();
    if (ticket_) svc_->store()->EndPublish(*ticket_);
    delete this;
  }

 private:
  friend class UploadReactor;

  absl::Status OnHeader(const v1::PublishHeader& h) {
    header_ = h;  // for the logs, also when it is rejected
    KVRELAY_RETURN_IF_ERROR(CheckId("header.session_id", h.session_id()));
    // From here a CloseSession of the session fences this publish.
    ticket_ = svc_->store()->BeginPublish(h.session_id());
    if (!h.message_id().empty()) KVRELAY_RETURN_IF_ERROR(CheckId("header.message_id", h.message_id()));
    KVRELAY_RETURN_IF_ERROR(CheckId("header.sender", h.sender()));
    if (h.recipients_size() == 0) {
      return absl::InvalidArgumentError("header.recipients: empty, expected at least one agent");
    }
    if (h.recipients_size() > kMaxRecipients) {
      return absl::InvalidArgumentError(absl::StrCat("header.recipients: ", h.recipients_size(),
                                                     " agents, expected 1..", kMaxRecipients));
    }
    absl::flat_hash_map<std::string, int> seen;
    for (int i = 0; i < h.recipients_size(); ++i) {
      KVRELAY_RETURN_IF_ERROR(CheckId(absl::StrCat("header.recipients[", i, "]"), h.recipients(i)));
      auto [it, fresh] = seen.emplace(h.recipients(i), i);
      if (!fresh) {
        return absl::InvalidArgumentError(absl::StrCat("header.recipients[", i, "]: '", h.recipients(i),
                                                       "' repeats recipients[", it->second,
                                                       "], expected distinct agents"));
      }
    }
    if (h.role().size() > 128) {
      return absl::InvalidArgumentError(absl::StrCat("header.role: ", h.role().size(), " bytes, expected at most 128"));
    }
    if (!h.parent_id().empty()) KVRELAY_RETURN_IF_ERROR(CheckId("header.parent_id", h.parent_id()));
    if (!h.has_geometry()) return absl::InvalidArgumentError("header.geometry: missing, expected the turn's geometry");
    if (header_.message_id().empty()) header_.set_message_id(svc_->NewMessageId());
    resp_.set_message_id(header_.message_id());

    // Idempotency: a committed id answers with the original accounting, if
    // this is a retry of the same publish.
    if (MessagePtr prior = svc_->store()->Find(header_.session_id(), header_.message_id())) {
      KVRELAY_RETURN_IF_ERROR(CheckSamePublish(header_, *prior));
      ReplyDuplicate(prior);
      return absl::OkStatus();
    }
    KVRELAY_ASSIGN_OR_RETURN(UploadShape shape, CheckGeometry(h.geometry(), "header.geometry"));
    KVRELAY_RETURN_IF_ERROR(CheckPolicyLength(h.policy()));
    const std::string& spec = h.policy().empty() ? svc_->config().PolicyForRole(h.role()) : h.policy();
    absl::StatusOr<std::unique_ptr<Pipeline>> pipeline = Pipeline::Create(spec);
    if (!pipeline.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(h.policy().empty() ? "policy (role default)" : "header.policy",
                                                     " '", spec, "': ", pipeline.status().message()));
    }
    KVRELAY_RETURN_IF_ERROR(CheckPolicyFor(**pipeline, shape.geo, "header.policy"));
    MessagePtr parent;
    int64_t pos0 = shape.prompt_pos0.value_or(shape.geo.n_history);
    if (!h.parent_id().empty()) {
      if (shape.geo.n_history != 0) {
        return absl::InvalidArgumentError(absl::StrCat("header.geometry.n_history: ", shape.geo.n_history,
                                                       ", expected 0 with parent_id (the relay supplies the history)"));
      }
      if (shape.first_agent) {
        return absl::InvalidArgumentError(
            "header.geometry.first_agent: true, expected false with parent_id (the parent holds the anchors)");
      }
      KVRELAY_ASSIGN_OR_RETURN(parent, svc_->store()->LookupParent(h.session_id(), h.parent_id(), h.sender()));
      const Message& pm = parent->msg;
      if (static_cast<int>(pm.layers.size()) != shape.layers || pm.kv_heads != shape.geo.kv_heads ||
          pm.head_dim != shape.geo.head_dim || pm.dtype != shape.geo.dtype) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "header.parent_id: '%s' has %d layers x %d kv_heads x head_dim %d %s, expected the geometry's "
            "%d x %d x %d %s",
            h.parent_id(), pm.layers.size(), pm.kv_heads, pm.head_dim, std::string(DTypeName(pm.dtype)),
            shape.layers, shape.geo.kv_heads, shape.geo.head_dim, std::string(DTypeName(shape.geo.dtype))));
      }
      if (shape.prompt_pos0 && *shape.prompt_pos0 < parent->msg.next_pos) {
        return absl::InvalidArgumentError(absl::StrCat(
            "header.geometry.prompt_pos0: ", *shape.prompt_pos0, ", expected >= ", parent->msg.next_pos,
            " (where the parent '", h.parent_id(), "' ended: its history would share position ids with this "
            "prompt), or unset to continue there"));
      }
      if (!shape.prompt_pos0) {
        pos0 = parent->msg.next_pos;  // computed when the parent was compressed
        if (pos0 + shape.geo.n_prompt + shape.geo.n_gen - 1 > std::numeric_limits<int32_t>::max()) {
          return absl::InvalidArgumentError(absl::StrCat("header.geometry.prompt_pos0: ", pos0,
                                                         " (after the parent) puts position ids past int32"));
        }
      }
    }
    std::vector<std::string> recipients(h.recipients().begin(), h.recipients().end());
    // The composed message ([parent; kept prompt; generated]) must fit the
    // mailboxes and the session's and store's byte limits: refuse it before
    // anything is uploaded or reserved.
    const int n_history = parent ? (parent->msg.layers.empty() ? 0 : parent->msg.layers[0].tokens())
                                 : shape.geo.n_history;
    KVRELAY_RETURN_IF_ERROR(svc_->store()->CheckCanPublish(h.session_id(), recipients,
                                                           MinComposedBytes(**pipeline, shape, n_history)));
    std::shared_ptr<const Pipeline> shared(std::move(*pipeline));
    std::lock_guard<std::mutex> lock(mu_);
    return upload_.Start(shape, std::move(shared), std::move(parent), pos0);
  }

  void ReplyDuplicate(const MessagePtr& prior) {
    resp_.set_message_id(prior->message_id);
    *resp_.mutable_accounting() = prior->accounting;
    resp_.set_duplicate(true);
    if (svc_->metrics()) svc_->metrics()->AddOutcome("duplicate");
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
    m->geometry = header_.geometry();
    // A call already over (cancelled, or its deadline passed: the client
    // has its error) must not commit a message its sender thinks failed.
    if (ctx_->IsCancelled()) return Fail(absl::CancelledError("publish: cancelled before the commit"));
    m->msg = pending->TakeMessage();
    m->family = PolicyFamily(m->msg.policy);
    m->bytes = RetainedBytes(m->msg);
    m->started = started_;
    const double compress_s = pending->compress_seconds();
    FillAccounting(m->msg, upload_.received(), compress_s, SecondsSince(started_), &m->accounting);
    absl::StatusOr<Store::CommitResult> r = svc_->store()->Commit(m, *ticket_);
    if (!r.ok()) return Fail(r.status());
    if (r->duplicate) {  // the same id committed while this one uploaded
      if (absl::Status same = CheckSamePublish(header_, *r->msg); !same.ok()) return Fail(same);
      return ReplyDuplicate(r->msg);
    }
    const StoredMessage& c = *r->msg;
    resp_.set_message_id(c.message_id);
    *resp_.mutable_accounting() = c.accounting;
    if (Metrics* mx = svc_->metrics()) {
      mx->AddCommitted(c.family, c.msg.full_bytes, c.msg.sent_bytes);
      mx->AddOutcome("committed");
      mx->ObserveCompress(compress_s);
      mx->ObserveVisible(c.accounting.commit_seconds());
    }
    spdlog::info("publish committed session={} message={} from={} recipients={} policy={} full={} sent={} "
                 "ratio={:.2f} compress_s={:.4f} commit_s={:.4f}",
                 c.session_id, c.message_id, c.sender, c.recipients.size(), c.msg.policy, c.msg.full_bytes,
                 c.msg.sent_bytes, c.msg.Ratio(), compress_s, c.accounting.commit_seconds());
    FinishOnce(grpc::Status::OK);
  }

  void Fail(const absl::Status& s) {
    CancelUpload();
    svc_->store()->AddFailed();
    if (svc_->metrics()) svc_->metrics()->AddOutcome("failed");
    spdlog::info("publish failed session={} message={}: {}", header_.session_id(), header_.message_id(),
                 s.ToString());
    FinishOnce(ToGrpcStatus(s));
  }

  void FinishOnce(const grpc::Status& status) {
    if (!TryFinish()) return;
    const grpc::Status s = AsClientSees(*ctx_, status);
    svc_->CountRpc("Publish", s);
    DropUpload();
    if (s.ok()) *wire_resp_ = EncodeProto(resp_);
    Finish(s);
  }

  grpc::ByteBuffer* const wire_resp_;
  v1::PublishResponse resp_;
  v1::PublishHeader header_;
  std::optional<Store::PublishTicket> ticket_;  // from the header on; ended in OnDone
};

// ------------------------------------------------------------------ Fetch

class FetchReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  // `parsed`: whether the request was a FetchRequest at all (ParseRequest).
  FetchReactor(RelayService* svc, grpc::CallbackServerContext* ctx, const v1::FetchRequest& req,
               const absl::Status& parsed)
      : svc_(svc), ctx_(ctx), session_(req.session_id()), agent_(req.agent()), auto_ack_(req.auto_ack()) {
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
      std::lock_guard<std::mutex> lock(mu_);
      cancelled_ = true;
      if (waiting_ && svc_->store()->CancelWaiter(waiter_)) {
        waiting_ = false;
        finish = true;
      }
    }
    if (finish) FinishOnce(grpc::Status(grpc::CANCELLED, "fetch: cancelled while waiting"));
  }

  void OnWriteDone(bool ok) override {
    reply_idle_->Touch();
    if (!ok) return FinishOnce(grpc::Status(grpc::CANCELLED, "fetch: stream broken while delivering"));
    if (out_->FillNext<v1::FetchResponse>(&wire_)) return StartWrite(&wire_);
    Delivered();
  }

  void OnDone() override {
    if (reply_idle_) reply_idle_->Disarm();
    delete this;
  }

 private:
  // Tries to take a delivery; otherwise waits (again).
  void OnWake(Store::Wake why) {
    std::optional<grpc::Status> fin;
    std::optional<Store::Delivery> d;
    const grpc::Status shutdown(grpc::UNAVAILABLE, "fetch: the relay is shutting down, retry elsewhere or later");
    {
      std::lock_guard<std::mutex> lock(mu_);
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
        d = svc_->store()->FetchOrWait(session_, agent_, deadline_, [this](Store::Wake w) { OnWake(w); },
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
    const StoredMessage& m = *delivery_.msg;
    out_.emplace();
    out_->Append(MessageDeliveryOrder(m.msg), delivery_.msg);  // sent from the stored message
    v1::FetchResponse resp;
    v1::MessageHeader* h = resp.mutable_header();
    h->set_message_id(m.message_id);
    h->set_session_id(m.session_id);
    h->set_sender(m.sender);
    h->set_role(m.role);
    h->set_parent_id(m.parent_id);
    FillMessageHeader(m.msg, h);
    *h->mutable_accounting() = m.accounting;
    h->set_delivery_attempt(delivery_.attempt);
    wire_ = EncodeProto(resp);
    // A delivery holds its message (also one its session no longer retains)
    // until the client has read it: a client that stops reading for the idle
    // timeout is cancelled.
    reply_idle_ = svc_->watchdog()->Watch([this] { OnReplyStalled(); });
    StartWrite(&wire_);
  }

  // On the watchdog thread, under reply_idle_->mu: a write has been pending
  // for the timeout. The cancel fails the write and OnWriteDone finishes the
  // call (the client sees gRPC's CANCELLED, so the reason is logged here).
  void OnReplyStalled() {
    if (finished_) return;
    spdlog::info("fetch: session={} message={} to={} not read for {} s (--upload-idle-timeout-seconds), cancelling",
                 session_, delivery_.msg->message_id, agent_, svc_->watchdog()->timeout_seconds());
    ctx_->TryCancel();
  }

  void Delivered() {
    const StoredMessage& m = *delivery_.msg;
    // The watchdog may have cancelled the call just before the last write
    // completed: the client then sees CANCELLED, so nothing counts.
    if (ctx_->IsCancelled()) return FinishOnce(grpc::Status(grpc::CANCELLED, "fetch: cancelled while delivering"));
    // The hop latency: the first complete delivery to this recipient, which
    // may be a later attempt than the first (one cancelled mid-stream).
    const bool first = svc_->store()->MarkDelivered(session_, agent_, m.message_id);
    if (Metrics* mx = svc_->metrics()) {
      mx->AddOutcome("delivered");
      if (first) mx->ObserveDelivered(std::chrono::duration<double>(Clock::now() - m.started).count());
    }
    absl::Status s;
    if (auto_ack_) s = svc_->store()->Ack(session_, agent_, m.message_id);
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
    svc_->CountRpc("Fetch", s);
    Finish(s);
  }

  RelayService* const svc_;
  grpc::CallbackServerContext* const ctx_;
  const std::string session_, agent_;
  const bool auto_ack_;
  Clock::time_point deadline_;
  std::mutex mu_;
  bool waiting_ = false, cancelled_ = false;
  uint64_t waiter_ = 0;
  std::atomic<bool> finished_{false};
  Store::Delivery delivery_;
  std::optional<ChunkStreamWriter> out_;
  grpc::ByteBuffer wire_;  // the response being written
  std::shared_ptr<UploadWatchdog::Entry> reply_idle_;  // set before the first write
};

// --------------------------------------------------------------- Compress

class CompressReactor final
    : public UploadReactor<CompressReactor, grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                           v1::CompressRequest> {
 public:
  CompressReactor(RelayService* svc, grpc::CallbackServerContext* ctx) : UploadReactor(svc, ctx, "compress") {
    StartUpload();
  }

  void OnWriteDone(bool ok) override {
    reply_idle_->Touch();
    if (!ok) return FinishOnce(grpc::Status(grpc::CANCELLED, "compress: stream broken while delivering"));
    if (out_->FillNext<v1::CompressResponse>(&out_wire_)) return StartWrite(&out_wire_);
    FinishOnce(grpc::Status::OK);
  }

  void OnDone() override {
    StopWatching();
    if (reply_idle_) reply_idle_->Disarm();
    if (out_reserved_) svc_->store()->ReleaseInflight(out_reserved_);
    delete this;
  }

 private:
  friend class UploadReactor;

  absl::Status OnHeader(const v1::CompressHeader& h) {
    if (h.policy().empty()) return absl::InvalidArgumentError("header.policy: empty, expected a pipeline spec");
    if (!h.has_geometry()) return absl::InvalidArgumentError("header.geometry: missing, expected the turn's geometry");
    KVRELAY_ASSIGN_OR_RETURN(UploadShape shape, CheckGeometry(h.geometry(), "header.geometry"));
    KVRELAY_RETURN_IF_ERROR(CheckPolicyLength(h.policy()));
    absl::StatusOr<std::unique_ptr<Pipeline>> pipeline = Pipeline::Create(h.policy());
    if (!pipeline.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("header.policy '", h.policy(), "': ", pipeline.status().message()));
    }
    KVRELAY_RETURN_IF_ERROR(CheckPolicyFor(**pipeline, shape.geo, "header.policy"));
    std::shared_ptr<const Pipeline> shared(std::move(*pipeline));
    std::lock_guard<std::mutex> lock(mu_);
    return upload_.Start(shape, std::move(shared), nullptr, shape.prompt_pos0.value_or(shape.geo.n_history));
  }

  void Complete() {
    std::shared_ptr<PendingCompression> pending = upload_.pending();
    absl::Status s = pending->status();
    if (!s.ok()) return Fail(s);
    auto msg = std::make_shared<Message>(pending->TakeMessage());
    const double compress_s = pending->compress_seconds();
    const uint64_t received = upload_.received();
    // The reply is held until OnDone: count it in flight (the memory exists
    // already, so whatever the limit) before the upload's reservation goes.
    out_reserved_ = RetainedBytes(*msg);
    svc_->store()->AddInflight(out_reserved_);
    pending.reset();
    {
      std::lock_guard<std::mutex> lock(mu_);
      upload_ = Upload(svc_);  // releases the upload's reservation
    }
    if (Metrics* mx = svc_->metrics()) mx->ObserveCompress(compress_s);
    out_.emplace();
    out_->Append(MessageDeliveryOrder(*msg), msg);
    v1::CompressResponse resp;
    v1::MessageHeader* h = resp.mutable_header();
    FillMessageHeader(*msg, h);
    FillAccounting(*msg, received, compress_s, SecondsSince(started_), h->mutable_accounting());
    out_wire_ = EncodeProto(resp);
    // The reply holds its memory (and in-flight bytes) until the client has
    // read it: a client that stops reading for the idle timeout is cancelled.
    reply_idle_ = svc_->watchdog()->Watch([this] { OnReplyStalled(); });
    StartWrite(&out_wire_);
  }

  // On the watchdog thread, under reply_idle_->mu: a write has been pending
  // for the timeout. Finish may not be called with a write pending; the
  // cancel fails the write, and OnWriteDone finishes the call (the client
  // sees gRPC's CANCELLED, so the reason is logged here).
  void OnReplyStalled() {
    if (finished_) return;
    spdlog::info("compress: the reply was not read for {} s (--upload-idle-timeout-seconds), cancelling",
                 svc_->watchdog()->timeout_seconds());
    ctx_->TryCancel();
  }

  void Fail(const absl::Status& s) {
    CancelUpload();
    DropUpload();
    FinishOnce(ToGrpcStatus(s));
  }

  void FinishOnce(const grpc::Status& status) {
    if (!TryFinish()) return;
    const grpc::Status s = AsClientSees(*ctx_, status);
    svc_->CountRpc("Compress", s);
    Finish(s);
  }

  grpc::ByteBuffer out_wire_;  // the response being written
  std::optional<ChunkStreamWriter> out_;
  uint64_t out_reserved_ = 0;  // in flight until OnDone
  std::shared_ptr<UploadWatchdog::Entry> reply_idle_;  // set before the first write
};

}  // namespace

absl::Status CheckId(const std::string& field, const std::string& v) {
  if (v.empty() || v.size() > 128) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", v.size(), " bytes, expected [A-Za-z0-9._:-]{1,128}"));
  }
  for (char c : v) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                    c == '_' || c == ':' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": '", absl::CHexEscape(v), "', expected [A-Za-z0-9._:-]{1,128}"));
    }
  }
  return absl::OkStatus();
}

RelayService::RelayService(const ServerConfig& config, Store* store, ThreadPool* pool, Metrics* metrics)
    : config_(config), store_(store), pool_(pool), metrics_(metrics), id_salt_(std::random_device{}() * 0x9e3779b97f4a7c15ull ^ static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count())),
      watchdog_(config.upload_idle_timeout_seconds) {}

UploadWatchdog::UploadWatchdog(double timeout_seconds)
    : timeout_s_(timeout_seconds),
      timeout_(std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_seconds))) {
  thread_ = std::thread([this] { Loop(); });
}

UploadWatchdog::~UploadWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::shared_ptr<UploadWatchdog::Entry> UploadWatchdog::Watch(std::function<void()> fire) {
  auto e = std::make_shared<Entry>();
  e->fire = std::move(fire);
  std::lock_guard<std::mutex> lock(mu_);
  entries_.push_back(e);
  return e;
}

void UploadWatchdog::Loop() {
  // Checks a few times per timeout (10 ms .. 1 s).
  const auto every = std::clamp<Clock::duration>(timeout_ / 4, std::chrono::milliseconds(10), std::chrono::seconds(1));
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, every);
    if (stop_) break;
    std::vector<std::shared_ptr<Entry>> snapshot = entries_;
    lock.unlock();
    const Clock::time_point now = Clock::now();
    for (const auto& e : snapshot) {
      std::unique_lock<std::mutex> el(e->mu, std::try_to_lock);
      if (!el.owns_lock() || !e->armed || now - e->last < timeout_) continue;  // busy, done or active
      e->armed = false;
      std::function<void()> fire = std::move(e->fire);
      e->fire = nullptr;
      if (fire) fire();
    }
    lock.lock();
    // Forget entries that are disarmed (finished, committed or fired). An
    // entry whose mutex is held is kept for the next round: its holder may
    // be waiting for mu_ in Watch (a reaction that registers a new entry).
    entries_.erase(std::remove_if(entries_.begin(), entries_.end(),
                                  [](const std::shared_ptr<Entry>& e) {
                                    std::unique_lock<std::mutex> el(e->mu, std::try_to_lock);
                                    return el.owns_lock() && !e->armed;
                                  }),
                   entries_.end());
  }
}

std::string RelayService::NewMessageId() {
  return absl::StrFormat("m-%016x-%d", id_salt_, id_counter_.fetch_add(1) + 1);
}

void RelayService::CountRpc(const char* method, const grpc::Status& s) const {
  if (metrics_) metrics_->AddRpc(method, s.error_code());
}

grpc::ServerReadReactor<grpc::ByteBuffer>* RelayService::Publish(grpc::CallbackServerContext* ctx,
                                                                 grpc::ByteBuffer* response) {
  return new PublishReactor(this, ctx, response);
}

namespace {

// Parses a raw request as `Request`: INVALID_ARGUMENT naming the message
// type when the bytes are not one.
template <typename Request>
absl::Status ParseRequest(const grpc::ByteBuffer& wire, absl::string_view rpc, Request* req) {
  RawMessage raw;
  if (raw.Reset(wire) && raw.ParseAs(req)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(rpc, ": the request is not a kvrelay.v1.", Request::descriptor()->name(),
                   " (malformed, or a string field that is not UTF-8)"));
}

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

grpc::ServerWriteReactor<grpc::ByteBuffer>* RelayService::Fetch(grpc::CallbackServerContext* ctx,
                                                               const grpc::ByteBuffer* request) {
  v1::FetchRequest req;
  const absl::Status parsed = ParseRequest(*request, "fetch", &req);
  return new FetchReactor(this, ctx, req, parsed);
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* RelayService::Compress(
    grpc::CallbackServerContext* ctx) {
  return new CompressReactor(this, ctx);
}

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
