#include "server/rpc/compress_reactor.h"

#include <memory>
#include <optional>

#include "absl/strings/str_cat.h"
#include "core/mutex.h"
#include "core/pipeline.h"
#include "core/quant.h"
#include "core/status_macros.h"
#include "proto/raw_chunk.h"
#include "proto/status_util.h"
#include "proto/wire.h"
#include "server/rpc/internal/call_util.h"
#include "proto/stream_codec.h"
#include "server/rpc/request_checks.h"
#include "server/rpc/upload.h"
#include "spdlog/spdlog.h"

namespace kvrelay {
namespace {

class CompressReactor final
    : public UploadReactor<CompressReactor, grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                           v1::CompressRequest> {
 public:
  CompressReactor(RelayContext* relay, grpc::CallbackServerContext* ctx) : UploadReactor(relay, ctx, "compress") {
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
    if (out_reserved_) relay_->store()->ReleaseInflight(out_reserved_);
    delete this;
  }

 private:
  friend class UploadReactor;
  friend ReadLoop;

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
    MutexLock lock(&mu_);
    return upload_.Start(shape, std::move(shared), nullptr, shape.prompt_pos0.value_or(shape.geo.n_history));
  }

  void Complete() {
    std::shared_ptr<PendingCompression> pending = upload_.pending();
    absl::Status s = pending->status();
    if (!s.ok()) return Fail(s);
    auto msg = std::make_shared<Message>(pending->TakeMessage());
    // Lloyd codes and demoted tokens are relay formats: the caller gets them
    // decoded; the accounting then describes what is delivered.
    if (AgentsReceiveDecoded(*msg)) {
      absl::StatusOr<Message> dense = DecodedMessage(*msg);
      if (!dense.ok()) return Fail(dense.status());
      *msg = *std::move(dense);
    }
    const double compress_s = pending->compress_seconds();
    const uint64_t received = upload_.received();
    // The reply is held until OnDone: count it in flight (the memory exists
    // already, so whatever the limit) before the upload's reservation goes.
    out_reserved_ = RetainedBytes(*msg);
    relay_->store()->AddInflight(out_reserved_);
    pending.reset();
    {
      MutexLock lock(&mu_);
      upload_ = Upload(relay_);  // releases the upload's reservation
    }
    if (Metrics* mx = relay_->metrics()) mx->ObserveCompress(compress_s);
    out_.emplace();
    out_->Append(MessageDeliveryOrder(*msg), msg);
    v1::CompressResponse resp;
    v1::MessageHeader* h = resp.mutable_header();
    FillMessageHeader(*msg, h);
    *h->mutable_accounting() = ToProto(AccountingOf(*msg, received, compress_s, SecondsSince(started_)));
    out_wire_ = EncodeProto(resp);
    // The reply holds its memory (and in-flight bytes) until the client has
    // read it: a client that stops reading for the idle timeout is cancelled.
    reply_idle_ = relay_->watchdog()->Watch([this] { OnReplyStalled(); });
    StartWrite(&out_wire_);
  }

  // On the watchdog thread, under reply_idle_->mu: a write has been pending
  // for the timeout. Finish may not be called with a write pending; the
  // cancel fails the write, and OnWriteDone finishes the call (the client
  // sees gRPC's CANCELLED, so the reason is logged here).
  void OnReplyStalled() {
    if (finished_) return;
    spdlog::info("compress: the reply was not read for {} s (--upload-idle-timeout-seconds), cancelling",
                 relay_->watchdog()->timeout_seconds());
    ctx_->TryCancel();
  }

  void Fail(const absl::Status& s) {
    CancelUpload();
    relay_->NoteUploadFailure("compress", s);
    DropUpload();
    FinishOnce(ToGrpcStatus(s));
  }

  void FinishOnce(const grpc::Status& status) {
    if (!TryFinish()) return;
    const grpc::Status s = AsClientSees(*ctx_, status);
    relay_->CountRpc("Compress", s);
    Finish(s);
  }

  grpc::ByteBuffer out_wire_;  // the response being written
  std::optional<ChunkStreamWriter> out_;
  uint64_t out_reserved_ = 0;  // in flight until OnDone
  std::shared_ptr<UploadWatchdog::Entry> reply_idle_;  // set before the first write
};

}  // namespace

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* NewCompressReactor(RelayContext* relay,
                                                                               grpc::CallbackServerContext* ctx) {
  return new CompressReactor(relay, ctx);
}

}  // namespace kvrelay
