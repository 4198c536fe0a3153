#include "core/thread_pool.h"

#include <atomic>
#include <exception>
#include <limits>
#include <memory>

#include "core/mutex.h"

namespace kvrelay {

class ThreadPool::Lane {
 public:
  explicit Lane(int max_running) : max_running(max_running < 1 ? 1 : max_running) {}

 private:
  friend class ThreadPool;
  const int max_running;
  // Guarded by the pool's mu_.
  std::deque<std::function<void()>> tasks;
  int running = 0;
  bool in_ring = false;  // queued in ring_ (exactly when tasks is not empty)
};

ThreadPool::ThreadPool(int threads) : default_lane_(new Lane(std::numeric_limits<int>::max())) {
  if (threads < 1) threads = 1;
  workers_.reserve(threads);
  for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.SignalAll();
  for (auto& t : workers_) t.join();
}

std::shared_ptr<ThreadPool::Lane> ThreadPool::NewLane(int max_running) {
  return std::shared_ptr<Lane>(new Lane(max_running));
}

void ThreadPool::Schedule(std::function<void()> fn) { Schedule(default_lane_, std::move(fn)); }

void ThreadPool::Schedule(const std::shared_ptr<Lane>& lane, std::function<void()> fn) {
  {
    MutexLock lock(&mu_);
    lane->tasks.push_back(std::move(fn));
    if (!lane->in_ring) {
      lane->in_ring = true;
      ring_.push_back(lane);
    }
  }
  cv_.Signal();
}

std::shared_ptr<ThreadPool::Lane> ThreadPool::NextLane() {
  for (auto it = ring_.begin(); it != ring_.end(); ++it) {
    if ((*it)->running < (*it)->max_running) {
      std::shared_ptr<Lane> lane = std::move(*it);
      ring_.erase(it);
      return lane;
    }
  }
  return nullptr;
}

bool ThreadPool::IdleLocked() const { return running_ == 0 && ring_.empty(); }

bool ThreadPool::WaitIdle(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  MutexLock lock(&mu_);
  while (!IdleLocked()) {
    if (!idle_cv_.WaitUntil(&mu_, deadline)) return IdleLocked();
  }
  return true;
}

void ThreadPool::WorkerLoop() {
  MutexLock lock(&mu_);
  for (;;) {
    std::shared_ptr<Lane> lane;
    // A lane at its limit waits for one of its tasks to finish (which
    // notifies), not for stop_: destruction drains every queued task.
    while ((lane = NextLane()) == nullptr && !(stop_ && ring_.empty())) cv_.Wait(&mu_);
    if (!lane) return;
    std::function<void()> fn = std::move(lane->tasks.front());
    lane->tasks.pop_front();
    if (lane->tasks.empty()) {
      lane->in_ring = false;
    } else {
      ring_.push_back(lane);  // its next task waits for the other lanes' turns
    }
    ++lane->running;
    ++running_;
    // Stopping and nothing left to start: the waiting workers may exit (the
    // predicate above just became true for them without a notification).
    if (stop_ && ring_.empty()) cv_.SignalAll();
    mu_.Unlock();
    fn();
    fn = nullptr;  // the task's captures go before the lane is released
    mu_.Lock();
    --running_;
    // A lane that was at its limit may start its next task now.
    if (lane->running-- == lane->max_running && lane->in_ring) cv_.Signal();
    if (stop_ && ring_.empty()) cv_.SignalAll();
    if (IdleLocked()) idle_cv_.SignalAll();
  }
}

void ThreadPool::ParallelFor(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  struct State {
    std::atomic<size_t> next{0};
    std::atomic<size_t> done{0};
    Mutex mu;
    CondVar cv;
    std::exception_ptr error ABSL_GUARDED_BY(mu);  // the first exception thrown by fn
  };
  auto state = std::make_shared<State>();
  const size_t n_total = n;
  auto drain = [state, n_total, &fn] {
    size_t finished = 0;
    for (size_t i; (i = state->next.fetch_add(1)) < n_total;) {
      try {
        fn(i);
      } catch (...) {
        MutexLock lock(&state->mu);
        if (!state->error) state->error = std::current_exception();
      }
      ++finished;
    }
    if (finished && state->done.fetch_add(finished) + finished == n_total) {
      MutexLock lock(&state->mu);
      state->cv.SignalAll();
    }
  };
  const size_t helpers = std::min(n - 1, workers_.size());
  for (size_t i = 0; i < helpers; ++i) Schedule(drain);
  drain();
  MutexLock lock(&state->mu);
  while (state->done.load() != n_total) state->cv.Wait(&state->mu);
  if (state->error) std::rethrow_exception(state->error);
}

int ThreadPool::HardwareThreads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n ? static_cast<int>(n) : 1;
}

void ParallelFor(ThreadPool* pool, size_t n, const std::function<void(size_t)>& fn) {
  if (pool == nullptr) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  pool->ParallelFor(n, fn);
}

}  // namespace kvrelay
