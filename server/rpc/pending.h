// The compression of one upload in progress: each layer is handed to the
// worker pool as soon as its chunks are in, so compression overlaps the
// upload; the message is assembled once every layer is done.
//
// With a parent message, every layer's history is the parent's composed
// layer (decoded when the parent is quantized), so the result is
// [parent; anchors if first agent; kept prompt; generated].
//
// Layers run in the upload's own lane of the pool (ThreadPool::NewLane):
// lanes are served in turn, and one upload compresses at most
// max(1, workers - 1) layers at once, so a large upload leaves a worker to
// the others' layers. Cancel (or the first failed layer) stops the layers
// running within about one GEMM block (LayerContext::cancelled).
//
// Thread-safe. Holds the upload's in-flight reservation and releases it on
// destruction, i.e. once the reactor and every queued layer let go of it.
#ifndef KVRELAY_SERVER_RPC_PENDING_H_
#define KVRELAY_SERVER_RPC_PENDING_H_

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "core/message.h"
#include "core/mutex.h"
#include "core/pipeline.h"
#include "core/thread_pool.h"
#include "proto/stream_codec.h"
#include "server/store/store.h"

namespace kvrelay {

class PendingCompression : public std::enable_shared_from_this<PendingCompression> {
 public:
  // `geo` is the upload's geometry; with `parent` its n_history must be 0
  // and becomes the parent's token count. `store` (may be null) gets
  // `reserved` in-flight bytes back on destruction.
  PendingCompression(std::shared_ptr<const Pipeline> pipeline, const UploadShape& shape, MessagePtr parent,
                     int64_t prompt_pos0, ThreadPool* pool, Store* store, uint64_t reserved);
  ~PendingCompression();

  // Called on the worker with each layer as soon as it is compressed, in
  // the order they finish. The layer's buffers stay where they are until
  // the message is destroyed (TakeMessage moves them, it does not copy).
  // Must not block, nor call into this object. REQUIRES: set before the
  // first Submit.
  using LayerObserver = std::function<void(int l, const MessageLayer& layer)>;
  void ObserveLayers(LayerObserver observer) { observer_ = std::move(observer); }

  // Validates (K/V values included) and compresses layer `l` on the pool.
  void Submit(int l, TurnLayer layer);

  // Skips layers not yet started and stops those running (they fail with
  // CancelledError at their next check, between heads or GEMM blocks).
  void Cancel() { cancelled_ = true; }

  // The first error of any layer so far.
  absl::Status status() const;

  // Calls `done` once every submitted layer has finished: right away on
  // this thread if they have, else on the worker that finishes last.
  void WhenDone(std::function<void()> done);

  // Backpressure: false when fewer than `bound` submitted layers are
  // unfinished (go on reading). Otherwise true, and `resume` is called once,
  // on the worker that brings them below `bound` (finished or skipped when
  // cancelled). The caller must not read on until then, and `resume` must
  // cope with a caller that is gone (it may outlive the upload's reactor).
  bool PauseIfBusy(int bound, std::function<void()> resume);

  // The most submitted-but-unfinished layers seen at once.
  int max_outstanding() const;

  // Calls `observe` after each Submit with the number of submitted but
  // unfinished layers, on the submitting thread, outside the lock.
  // REQUIRES: set before the first Submit.
  void set_outstanding_observer(std::function<void(int outstanding)> observe) { observe_ = std::move(observe); }

  // The composed message; its next_pos (a child's default prompt_pos0) is the
  // turn's end, prompt_pos0 + n_prompt + n_gen (also when the prompt's last
  // tokens were evicted and nothing was generated), or 1 + the largest
  // position id held if that is larger. REQUIRES: WhenDone fired,
  // status().ok() and every layer submitted.
  Message TakeMessage();

  // Worker seconds spent so far.
  double compress_seconds() const;

  // The geometry of the compressed turn (history included).
  const TurnGeometry& geometry() const { return geo_; }

 private:
  void RunLayer(int l, TurnLayer layer);

  const std::shared_ptr<const Pipeline> pipeline_;
  TurnGeometry geo_;
  const bool first_agent_;
  const int64_t prompt_pos0_;
  const double softmax_scale_;  // 0: 1/sqrt(head_dim)
  const MessagePtr parent_;
  ThreadPool* const pool_;
  const std::shared_ptr<ThreadPool::Lane> lane_;  // this upload's layers
  Store* const store_;
  const uint64_t reserved_;
  std::atomic<bool> cancelled_{false};

  mutable Mutex mu_;
  std::vector<std::optional<MessageLayer>> out_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  int outstanding_ ABSL_GUARDED_BY(mu_) = 0;
  int max_outstanding_ ABSL_GUARDED_BY(mu_) = 0;
  int resume_below_ ABSL_GUARDED_BY(mu_) = 0;
  std::function<void()> resume_ ABSL_GUARDED_BY(mu_);  // set while the reader is paused
  std::function<void(int)> observe_;  // set before the first Submit, then read-only
  double seconds_ ABSL_GUARDED_BY(mu_) = 0;
  std::function<void()> done_ ABSL_GUARDED_BY(mu_);
  LayerObserver observer_;  // set before the first Submit, then read-only
};

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_RPC_PENDING_H_
