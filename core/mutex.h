// Mutex, MutexLock and CondVar: a std::mutex and std::condition_variable
// that clang's thread-safety analysis (-Wthread-safety) understands, in the
// style of leveldb's port::Mutex.
//
//   class Queue {
//    public:
//     void Push(int v) {
//       MutexLock lock(&mu_);
//       items_.push_back(v);
//       cv_.SignalAll();
//     }
//     int Pop() {
//       MutexLock lock(&mu_);
//       while (items_.empty()) cv_.Wait(&mu_);
//       ...
//     }
//    private:
//     Mutex mu_;
//     CondVar cv_;
//     std::deque<int> items_ ABSL_GUARDED_BY(mu_);
//   };
//
// Members a mutex guards carry ABSL_GUARDED_BY(mu_); functions that expect
// it held carry ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_). The analysis does not
// look into lambdas, so waits are written as loops in the function that
// holds the lock rather than with predicates.
//
// These wrap the standard types (pthreads underneath), which ThreadSanitizer
// intercepts; absl::Mutex would hide the synchronization from TSan where
// abseil itself is not instrumented (Debian's is not).
//
// Thread-safety: as std::mutex and std::condition_variable.
#ifndef KVRELAY_CORE_MUTEX_H_
#define KVRELAY_CORE_MUTEX_H_

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "absl/base/thread_annotations.h"

namespace kvrelay {

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  // True when the lock was taken.
  bool TryLock() ABSL_EXCLUSIVE_TRYLOCK_FUNCTION(true) { return mu_.try_lock(); }
  // Tells the analysis that the caller holds the lock (checks nothing at run
  // time): for a function the analysis cannot follow, e.g. one called back
  // under the lock through std::function.
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK() {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds `mu` for the enclosing scope.
class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

// A condition variable used with one Mutex. Waits may wake spuriously:
// callers loop on their condition.
class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  // Releases `mu`, waits for a signal and takes `mu` again.
  void Wait(Mutex* mu) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();
  }
  // As Wait, until `deadline` at most. False when the deadline passed.
  template <typename Clock, typename Duration>
  bool WaitUntil(Mutex* mu, const std::chrono::time_point<Clock, Duration>& deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    const bool woken = cv_.wait_until(lock, deadline) == std::cv_status::no_timeout;
    lock.release();
    return woken;
  }
  // As Wait, for `timeout` at most. False when it passed.
  template <typename Rep, typename Period>
  bool WaitFor(Mutex* mu, const std::chrono::duration<Rep, Period>& timeout) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return WaitUntil(mu, std::chrono::steady_clock::now() + timeout);
  }

  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace kvrelay

#endif  // KVRELAY_CORE_MUTEX_H_
