// FakeTimeSource: a TimeSource whose time moves only when a test advances
// it, for testing timer threads without sleeping.
//
//   FakeTimeSource clock;
//   WatchedFile ... (uses &clock)
//   ASSERT_TRUE(clock.AwaitWaiters(1));      // the poller waits for its tick
//   clock.Advance(interval);                 // fires it...
//   ASSERT_TRUE(clock.AwaitWaiters(1));      // ...and it has polled and waits again
//
// A thread in WaitUntil is a "waiter" until its deadline is reached by
// Advance (or it is signalled). Advance removes the waiters it fires at
// once, so AwaitWaiters(n) after Advance returns only once the fired
// threads have done their work and are waiting again: the test's
// synchronization point, instead of a sleep.
//
// Thread-safe.
#ifndef KVRELAY_TESTS_TESTLIB_FAKE_TIME_SOURCE_H_
#define KVRELAY_TESTS_TESTLIB_FAKE_TIME_SOURCE_H_

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <optional>
#include <vector>

#include "core/mutex.h"
#include "core/time_source.h"

namespace kvrelay {

class FakeTimeSource final : public TimeSource {
 public:
  // Starts at the real steady time of its construction (so that deadlines
  // a test computes from the real clock keep their meaning), and from then
  // on moves only when advanced.
  FakeTimeSource() : now_(std::chrono::steady_clock::now()) {}

  TimePoint Now() override {
    MutexLock lock(&mu_);
    return now_;
  }

  bool WaitUntil(CondVar* cv, Mutex* mu, TimePoint deadline) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    Waiter w{cv, mu, deadline};
    {
      MutexLock lock(&mu_);
      if (now_ >= deadline) return false;
      waiters_.push_back(&w);
      ++waits_;
      changed_.SignalAll();
    }
    // `mu` stays held from the registration until Wait releases it, and
    // Advance takes `mu` before it signals: no wake-up is lost.
    cv->Wait(mu);
    MutexLock lock(&mu_);
    Forget(&w);
    changed_.SignalAll();
    return now_ < deadline;
  }

  // Moves the time forward by `d` and wakes the waiters whose deadline it
  // reached. REQUIRES: the caller holds none of the waiters' mutexes.
  void Advance(Duration d) {
    std::vector<Waiter> fired;
    {
      MutexLock lock(&mu_);
      now_ += d;
      for (auto it = waiters_.begin(); it != waiters_.end();) {
        if ((*it)->deadline <= now_) {
          fired.push_back(**it);
          it = waiters_.erase(it);
        } else {
          ++it;
        }
      }
      changed_.SignalAll();
    }
    for (const Waiter& w : fired) {
      MutexLock lock(w.mu);
      w.cv->SignalAll();
    }
  }

  // Advances to the earliest deadline a thread waits for, waking it (and
  // any other due then). False, moving nothing, when no thread waits.
  bool AdvanceToNextDeadline() {
    Duration d;
    {
      MutexLock lock(&mu_);
      if (waiters_.empty()) return false;
      TimePoint first = waiters_[0]->deadline;
      for (const Waiter* w : waiters_) first = std::min(first, w->deadline);
      d = std::max(Duration::zero(), first - now_);
    }
    Advance(d);
    return true;
  }

  // Waits (in real time, up to `timeout`) until at least `n` threads wait
  // on this clock. False on the timeout.
  bool AwaitWaiters(size_t n, std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
    const auto until = std::chrono::steady_clock::now() + timeout;
    MutexLock lock(&mu_);
    while (waiters_.size() < n) {
      if (!changed_.WaitUntil(&mu_, until)) return waiters_.size() >= n;
    }
    return true;
  }

  // The earliest deadline a thread waits for now; none when no thread waits.
  // A thread that was signalled to wait for another deadline (e.g. a timer
  // told of an earlier one) still shows its old deadline until it waits
  // again: a test waits for the deadline it expects.
  std::optional<TimePoint> next_deadline() {
    MutexLock lock(&mu_);
    std::optional<TimePoint> first;
    for (const Waiter* w : waiters_) {
      if (!first || w->deadline < *first) first = w->deadline;
    }
    return first;
  }

  // Threads waiting now.
  size_t waiters() {
    MutexLock lock(&mu_);
    return waiters_.size();
  }
  // WaitUntil calls that waited, in all.
  uint64_t waits() {
    MutexLock lock(&mu_);
    return waits_;
  }

 private:
  struct Waiter {
    CondVar* cv;
    Mutex* mu;
    TimePoint deadline;
  };

  void Forget(Waiter* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (auto it = waiters_.begin(); it != waiters_.end(); ++it) {
      if (*it == w) {
        waiters_.erase(it);
        return;
      }
    }
  }

  Mutex mu_;
  CondVar changed_;
  TimePoint now_ ABSL_GUARDED_BY(mu_);
  std::vector<Waiter*> waiters_ ABSL_GUARDED_BY(mu_);
  uint64_t waits_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvrelay

#endif  // KVRELAY_TESTS_TESTLIB_FAKE_TIME_SOURCE_H_
