// A fixed-size pool of worker threads.
//
// Tasks wait in lanes: Schedule(fn) uses the pool's default lane, and a
// caller that submits a stream of tasks of its own (one upload's layers)
// takes a lane with NewLane. Free workers serve the lanes with waiting
// tasks in turn (round-robin, one task each), so one lane's backlog does not
// delay another lane's next task by more than the tasks already running; a
// lane runs at most its `max_running` tasks at once, leaving the other
// workers to the other lanes. Within a lane tasks start in FIFO order.
//
// Thread-safe. Destruction waits for queued work to finish.
#ifndef KVRELAY_CORE_THREAD_POOL_H_
#define KVRELAY_CORE_THREAD_POOL_H_

#include <chrono>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "core/mutex.h"

namespace kvrelay {

class ThreadPool {
 public:
  // A queue of tasks the pool serves in turn with the other lanes. Owned
  // by the caller (a shared_ptr); queued tasks keep it alive.
  class Lane;

  // REQUIRES: threads >= 1.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()); }

  // Queues `fn` to run on a worker, in the default lane (no running limit).
  void Schedule(std::function<void()> fn);

  // A new lane whose tasks run at most `max_running` (>= 1; less counts
  // as 1) at a time.
  std::shared_ptr<Lane> NewLane(int max_running);

  // Queues `fn` in `lane`. REQUIRES: lane from this pool's NewLane.
  void Schedule(const std::shared_ptr<Lane>& lane, std::function<void()> fn);

  // True once no task is queued or running, false if that did not happen
  // within `timeout`. For tests and shutdown diagnostics.
  bool WaitIdle(std::chrono::milliseconds timeout);

  // Runs fn(0) .. fn(n-1), spread over the workers and the calling thread,
  // and returns when all have finished. Each index runs exactly once. If fn
  // throws, the other indices still run and the first exception is rethrown
  // here. May be called from several threads at once, but not from inside a
  // pool task.
  void ParallelFor(size_t n, const std::function<void(size_t)>& fn);

  // The number of hardware threads (at least 1).
  static int HardwareThreads();

 private:
  void WorkerLoop();
  // The first lane in ring_ that may start a task; null if none.
  std::shared_ptr<Lane> NextLane() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool IdleLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Mutex mu_;
  CondVar cv_;       // a task may start, or stop_
  CondVar idle_cv_;  // the pool may have become idle
  // Lanes with queued tasks, in serving order; a served lane moves to the back.
  std::deque<std::shared_ptr<Lane>> ring_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<Lane> default_lane_;
  int running_ ABSL_GUARDED_BY(mu_) = 0;  // tasks running, all lanes
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

// Runs fn(0..n-1) on `pool`, or inline in ascending order when pool is null.
void ParallelFor(ThreadPool* pool, size_t n, const std::function<void(size_t)>& fn);

}  // namespace kvrelay

#endif  // KVRELAY_CORE_THREAD_POOL_H_
