#include "server/rpc/pending.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "core/history.h"
#include "core/mutex.h"
#include "core/quant.h"

namespace kvrelay {

PendingCompression::PendingCompression(std::shared_ptr<const Pipeline> pipeline, const UploadShape& shape,
                                       MessagePtr parent, int64_t prompt_pos0, ThreadPool* pool, Store* store,
                                       uint64_t reserved)
    : pipeline_(std::move(pipeline)),
      geo_(shape.geo),
      first_agent_(shape.first_agent),
      prompt_pos0_(prompt_pos0),
      softmax_scale_(shape.softmax_scale.value_or(0)),
      parent_(std::move(parent)),
      pool_(pool),
      lane_(pool->NewLane(std::max(1, pool->size() - 1))),
      store_(store),
      reserved_(reserved),
      out_(shape.layers) {
  if (parent_) SetHistoryGeometry(parent_->msg, &geo_);
}

PendingCompression::~PendingCompression() {
  if (store_ && reserved_) store_->ReleaseInflight(reserved_);
}

void PendingCompression::Submit(int l, TurnLayer layer) {
  int outstanding;
  {
    MutexLock lock(&mu_);
    outstanding = ++outstanding_;
    max_outstanding_ = std::max(max_outstanding_, outstanding);
  }
  if (observe_) observe_(outstanding);
  auto self = shared_from_this();
  // std::function needs a copyable callable: hold the layer by shared_ptr.
  auto holder = std::make_shared<TurnLayer>(std::move(layer));
  pool_->Schedule(lane_, [self, l, holder]() mutable {
    TurnLayer local = std::move(*holder);
    holder.reset();
    self->RunLayer(l, std::move(local));
  });
}

void PendingCompression::RunLayer(int l, TurnLayer layer) {
  absl::Status st;
  std::optional<MessageLayer> result;
  const auto t0 = std::chrono::steady_clock::now();
  if (cancelled_.load() || !status().ok()) {
    st = absl::CancelledError("publish: cancelled");
  } else {
    if (parent_) st = SetHistoryFromMessage(parent_->msg, l, geo_.dtype, &layer);
    // The UploadReader checked every uploaded K/V element as its chunk arrived;
    // the history taken from a parent (dequantized, maybe) is checked here.
    if (st.ok()) st = ValidateTurnLayer(layer, l, geo_, prompt_pos0_, /*check_kv_values=*/false);
    if (parent_) {
      for (auto [t, part] : {std::pair<const KvTensor*, const char*>{&layer.history_k, "history.k"},
                             {&layer.history_v, "history.v"}}) {
        if (!st.ok()) break;
        st = CheckKvFinite(t->dtype(), t->bytes().data(), 0, t->elements(), l, part, t->tokens(), t->dim());
      }
    }
    if (st.ok()) {
      LayerContext ctx;
      ctx.layer = l;
      ctx.first_agent = first_agent_;
      ctx.prompt_pos0 = prompt_pos0_;
      ctx.softmax_scale = softmax_scale_;
      ctx.cancelled = &cancelled_;
      absl::StatusOr<MessageLayer> r = pipeline_->CompressLayer(layer, geo_, ctx, /*pool=*/nullptr);
      if (r.ok()) result = std::move(*r);
      else st = r.status();
    }
  }
  // Free the upload's tensors before reporting.
  layer = TurnLayer();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::function<void()> done, resume;
  {
    MutexLock lock(&mu_);
    seconds_ += secs;
    if (!st.ok() && status_.ok()) {
      status_ = st;
      cancelled_ = true;  // the upload has failed: its other layers stop
    }
    if (result) {
      out_[l] = std::move(result);
      // Under mu_: TakeMessage cannot move the layer while it is observed.
      if (observer_) observer_(l, *out_[l]);
    }
    --outstanding_;
    if (resume_ && outstanding_ < resume_below_) {
      resume = std::move(resume_);
      resume_ = nullptr;
    }
    if (outstanding_ == 0 && done_) done = std::move(done_);
  }
  if (resume) resume();  // never together with `done`: no commit is read while paused
  if (done) done();
}

absl::Status PendingCompression::status() const {
  MutexLock lock(&mu_);
  return status_;
}

void PendingCompression::WhenDone(std::function<void()> done) {
  auto self = shared_from_this();  // `done` may drop the caller's reference
  {
    MutexLock lock(&mu_);
    if (outstanding_ > 0) {
      done_ = std::move(done);
      return;
    }
  }
  done();
}

bool PendingCompression::PauseIfBusy(int bound, std::function<void()> resume) {
  MutexLock lock(&mu_);
  if (outstanding_ < bound) return false;
  resume_below_ = bound;
  resume_ = std::move(resume);
  return true;
}

int PendingCompression::max_outstanding() const {
  MutexLock lock(&mu_);
  return max_outstanding_;
}

double PendingCompression::compress_seconds() const {
  MutexLock lock(&mu_);
  return seconds_;
}

Message PendingCompression::TakeMessage() {
  MutexLock lock(&mu_);
  std::vector<MessageLayer> layers;
  layers.reserve(out_.size());
  for (auto& l : out_) layers.push_back(std::move(*l));
  return pipeline_->Compose(geo_, first_agent_, prompt_pos0_, std::move(layers));
}

}  // namespace kvrelay
