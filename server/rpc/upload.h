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
    MutexLock activity(&idle_->mu);  // no idle firing during the reaction
    idle_->TouchLocked();
    if (finished_) return;  // failed meanwhile (idle): read no further
    if (!ok) {
      if (ctx_->IsCancelled()) {
        const char* by = relay_->store()->shutting_down()
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
  UploadReactor(RelayContext* relay, grpc::CallbackServerContext* ctx, const char* rpc)
      : relay_(relay), ctx_(ctx), rpc_(rpc), upload_(relay), started_(Clock::now()) {}

  void StartUpload() {
    // The watchdog fires, and a worker resumes, under the entry's mutex.
    idle_ = relay_->watchdog()->Watch([this] {
      idle_->mu.AssertHeld();
      OnIdle();
    });
    gate_ = std::make_shared<ReadGate>(idle_);
    {
      MutexLock lock(&gate_->idle->mu);
      gate_->resume = [this] {
        idle_->mu.AssertHeld();
        OnResume();
      };
    }
    this->StartRead(&wire_);
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

  RelayContext* const relay_;
  grpc::CallbackServerContext* const ctx_;
  const char* const rpc_;  // "publish" or "compress", for messages
  grpc::ByteBuffer wire_;  // the request being read
  RawMessage raw_;         // wire_'s slices
  ChunkView chunk_;        // a chunk request: views into raw_ (or req_)
  Request req_;            // any other request, parsed
  // upload_ is replaced (Start, DropUpload) under mu_, which CancelUpload
  // (OnCancel, on any thread) holds to read it; the reactor's own reactions
  // read it without the lock, since only they replace it.
  Mutex mu_;
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
  void ReadNext() ABSL_EXCLUSIVE_LOCKS_REQUIRED(idle_->mu) {
    if (upload_.PauseIfBusy(ReadGate::Resumer(gate_))) {
      relay_->CountBackpressurePause();
      idle_->last = Clock::time_point::max();  // our pause, not the client's idleness
      return;
    }
    this->StartRead(&wire_);
  }

  // On a worker, under idle_->mu: a paused upload's layers drained below the
  // bound (or were skipped after a cancel: the read then fails and ends the
  // call). Nothing else finishes the call while it is paused.
  void OnResume() ABSL_EXCLUSIVE_LOCKS_REQUIRED(idle_->mu) {
    if (finished_) return;
    idle_->TouchLocked();
    this->StartRead(&wire_);
  }

  // On the watchdog thread, under idle_->mu: nothing arrived for the timeout.
  void OnIdle() ABSL_EXCLUSIVE_LOCKS_REQUIRED(idle_->mu) {
    if (finished_) return;
    self().Fail(absl::DeadlineExceededError(absl::StrFormat(
        "%s: upload idle for %g s (--upload-idle-timeout-seconds), expected %s", rpc_,
        relay_->watchdog()->timeout_seconds(), upload_.started() ? "chunks or the commit" : "the header")));
  }

  std::shared_ptr<UploadWatchdog::Entry> idle_;
  std::shared_ptr<ReadGate> gate_;
};

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_RPC_UPLOAD_H_
