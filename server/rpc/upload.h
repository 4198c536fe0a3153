// The upload half that Publish and Compress share: the Upload (in-flight
// reservation, chunk assembly, per-layer compression), the ReadGate that
// resumes a paused reactor, and the UploadReactor base.
#ifndef KVRELAY_SERVER_RPC_UPLOAD_H_
#define KVRELAY_SERVER_RPC_UPLOAD_H_

#include <algorithm>
#include <atomic>
#include <functional>
#include <memory>
#include <optional>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/history.h"
#include "core/mutex.h"
#include "core/pipeline.h"
#include "core/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "kvrelay/v1/relay.pb.h"
#include "proto/raw_chunk.h"
#include "proto/stream_codec.h"
#include "server/rpc/internal/request_stream.h"
#include "server/rpc/pending.h"
#include "server/rpc/relay_context.h"
#include "server/rpc/request_checks.h"
#include "server/store/store.h"
#include "server/rpc/watchdog.h"

namespace kvrelay {

// The parent's tokens as the dense history each layer's compression holds:
// K and V in the upload's dtype plus position ids, every layer.
uint64_t DenseHistoryBytes(const UploadShape& shape, const StoredMessage& parent);

// The receiving half shared by Publish and Compress: geometry, in-flight
// reservation, chunk assembly, per-layer compression, commit checks.
class Upload {
 public:
  explicit Upload(RelayContext* relay) : relay_(relay) {}

  // Starts after a checked header. Refuses an upload whose compression
  // would take more than --max-upload-work multiply-adds (CheckUploadWork,
  // RESOURCE_EXHAUSTED) before anything is reserved or read. Reserves
  // shape.ReserveBytes() plus, with a parent, the parent's dense (decoded)
  // size: every layer's compression holds the parent's layer as dense
  // history while it runs.
  // `observer` (may be empty) sees each layer once compressed.
  absl::Status Start(const UploadShape& shape, std::shared_ptr<const Pipeline> pipeline, MessagePtr parent,
                     int64_t prompt_pos0, PendingCompression::LayerObserver observer = nullptr) {
    TurnGeometry geo = shape.geo;  // as each layer's compression sees it
    if (parent) SetHistoryGeometry(parent->msg, &geo);
    KVRELAY_RETURN_IF_ERROR(
        CheckUploadWork(*pipeline, geo, shape.layers, shape.first_agent, relay_->config().max_upload_work));
    const uint64_t history = parent ? DenseHistoryBytes(shape, *parent) : 0;
    const uint64_t bytes = shape.ReserveBytes() + history;
    KVRELAY_RETURN_IF_ERROR(relay_->store()->ReserveInflight(
        bytes, absl::StrCat("upload of ", shape.UploadBytes(), " tensor bytes + ",
                            shape.ReserveBytes() - shape.UploadBytes(), " bookkeeping",
                            parent ? absl::StrCat(" + ", history, " of parent '", parent->message_id,
                                                  "' decoded as history")
                                   : "")));
    assembler_.emplace(shape);
    pending_ = std::make_shared<PendingCompression>(std::move(pipeline), shape, std::move(parent), prompt_pos0,
                                                    relay_->pool(), relay_->store(), bytes);
    if (observer) pending_->ObserveLayers(std::move(observer));
    if (auto observe = relay_->layer_observer()) pending_->set_outstanding_observer(std::move(observe));
    SubmitCompleted();
    return absl::OkStatus();
  }

  bool started() const { return pending_ != nullptr; }

  absl::Status Chunk(const ChunkView& c) {
    KVRELAY_RETURN_IF_ERROR(UploadStatus(assembler_->Accept(c)));
    relay_->store()->AddReceived(c.size);
    if (relay_->metrics()) relay_->metrics()->AddReceived(c.size);
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
    const int bound = std::max(2, relay_->pool()->size());
    return pending_ && pending_->PauseIfBusy(bound, std::move(resume));
  }

 private:
  void SubmitCompleted() {
    for (auto& [l, layer] : assembler_->TakeCompleted()) pending_->Submit(l, std::move(layer));
  }

  RelayContext* relay_;
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
  std::function<void()> resume ABSL_GUARDED_BY(idle->mu);  // runs under it; cleared in OnDone

  static std::function<void()> Resumer(const std::shared_ptr<ReadGate>& gate) {
    return [gate] {
      MutexLock lock(&gate->idle->mu);
      if (gate->resume) gate->resume();
    };
  }
};

// The upload half that Publish and Compress share: the request stream
// (RequestStreamReactor's read loop) into an Upload, the idle watchdog and
// backpressure. Derived supplies OnHeader(header) (which may finish the
// call, e.g. a duplicate publish), Complete() (on a worker once every layer
// is compressed) and Fail(status), befriends ReadLoop, and finishes only through
// TryFinish(). Derived's constructor calls StartUpload() last, once it is
// whole.
template <typename Derived, typename Reactor, typename Request>
class UploadReactor : public RequestStreamReactor<Derived, Reactor, Request> {
 public:
  void OnCancel() override { CancelUpload(); }

 protected:
  using ReadLoop = RequestStreamReactor<Derived, Reactor, Request>;  // Derived befriends it
  using ReadLoop::ctx_;
  using ReadLoop::finished_;
  using ReadLoop::idle_;
  using ReadLoop::relay_;
  using ReadLoop::rpc_;

  UploadReactor(RelayContext* relay, grpc::CallbackServerContext* ctx, const char* rpc)
      : ReadLoop(relay, ctx, rpc), upload_(relay), started_(Clock::now()) {}

  void StartUpload() {
    this->WatchIdle();  // fires, and a worker resumes, under the entry's mutex
    gate_ = std::make_shared<ReadGate>(idle_);
    {
      MutexLock lock(&gate_->idle->mu);
      gate_->resume = [this] {
        idle_->mu.AssertHeld();
        OnResume();
      };
    }
    this->StartReading();
  }

  // From OnDone: neither the watchdog nor a worker may call in any more.
  void StopWatching() {
    MutexLock lock(&idle_->mu);
    idle_->armed = false;
    idle_->fire = nullptr;
    gate_->idle->mu.AssertHeld();  // the same entry as idle_
    gate_->resume = nullptr;       // a worker may still hold the gate
  }

  // Stops the compression still running: its remaining layers are skipped.
  void CancelUpload() {
    MutexLock lock(&mu_);
    if (auto p = upload_.pending()) p->Cancel();
  }

  // Drops the upload: its in-flight reservation returns once queued layers
  // drain, not when gRPC gets around to OnDone.
  void DropUpload() {
    MutexLock lock(&mu_);
    upload_ = Upload(relay_);
  }

  // True exactly once: the caller is the one to Finish the call.
  bool TryFinish() { return !finished_.exchange(true); }

  // upload_ is replaced (Start, DropUpload) under mu_, which CancelUpload
  // (OnCancel, on any thread) holds to read it; the reactor's own reactions
  // read it without the lock, since only they replace it.
  Mutex mu_;
  Upload upload_;
  const Clock::time_point started_;

 private:
  friend ReadLoop;
  Derived& self() { return static_cast<Derived&>(*this); }

  bool started() const { return upload_.started(); }

  absl::Status Cancelled() const {
    return absl::CancelledError(absl::StrCat(
        rpc_, relay_->store()->shutting_down()
                  ? ": cancelled (by the client, or by the relay's shutdown at the end of its grace period)"
                  : ": cancelled by the client"));
  }

  absl::Status OnChunk(const ChunkView& c) { return upload_.Chunk(c); }

  void OnCommit(const v1::Trailer& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(idle_->mu) {
    if (absl::Status s = upload_.Commit(t); !s.ok()) return self().Fail(s);
    idle_->armed = false;  // uploaded: compression is not idleness
    upload_.pending()->WhenDone([this] { self().Complete(); });
  }

  // Under idle_->mu, after a read: reads on, unless backpressure pauses
  // the upload until a worker calls OnResume.
  void ReadNext() ABSL_EXCLUSIVE_LOCKS_REQUIRED(idle_->mu) {
    if (upload_.PauseIfBusy(ReadGate::Resumer(gate_))) {
      relay_->CountBackpressurePause();
      idle_->last = Clock::time_point::max();  // our pause, not the client's idleness
      return;
    }
    this->StartReading();
  }

  // On a worker, under idle_->mu: a paused upload's layers drained below the
  // bound (or were skipped after a cancel: the read then fails and ends the
  // call). Nothing else finishes the call while it is paused.
  void OnResume() ABSL_EXCLUSIVE_LOCKS_REQUIRED(idle_->mu) {
    if (finished_) return;
    idle_->TouchLocked();
    this->StartReading();
  }

  // On the watchdog thread, under idle_->mu: nothing arrived for the timeout.
  void OnIdle() ABSL_EXCLUSIVE_LOCKS_REQUIRED(idle_->mu) {
    if (finished_) return;
    self().Fail(absl::DeadlineExceededError(absl::StrFormat(
        "%s: upload idle for %g s (--upload-idle-timeout-seconds), expected %s", rpc_,
        relay_->watchdog()->timeout_seconds(), upload_.started() ? "chunks or the commit" : "the header")));
  }

  std::shared_ptr<ReadGate> gate_;
};

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_RPC_UPLOAD_H_
