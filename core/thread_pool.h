// A fixed-size pool of worker threads.
//
// Thread-safe. Destruction waits for queued work to finish.
#ifndef KVRELAY_CORE_THREAD_POOL_H_
#define KVRELAY_CORE_THREAD_POOL_H_

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvrelay {

class ThreadPool {
 public:
  // REQUIRES: threads >= 1.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()); }

  // Queues `fn` to run on a worker.
  void Schedule(std::function<void()> fn);

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

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

// Runs fn(0..n-1) on `pool`, or inline in ascending order when pool is null.
void ParallelFor(ThreadPool* pool, size_t n, const std::function<void(size_t)>& fn);

}  // namespace kvrelay

#endif  // KVRELAY_CORE_THREAD_POOL_H_
