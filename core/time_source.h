// TimeSource: the relay's steady time and its timed waits, as one seam that
// tests replace (leveldb's Env::NowMicros in spirit). Components that run a
// timer thread (the upload watchdog, watched files, the store's sweeps and
// the forwarder's backoff) read the time and wait for deadlines through a
// TimeSource; production uses Real(), tests a fake clock they advance
// (tests/testlib/fake_time_source.h), so that no test sleeps to let a timer
// fire.
//
// Thread-safe: every method may be called from any thread.
#ifndef KVRELAY_CORE_TIME_SOURCE_H_
#define KVRELAY_CORE_TIME_SOURCE_H_

#include <chrono>

#include "core/mutex.h"

namespace kvrelay {

class TimeSource {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  using Duration = std::chrono::steady_clock::duration;

  virtual ~TimeSource() = default;

  // The current steady time.
  virtual TimePoint Now() = 0;

  // Releases `mu`, waits until `cv` is signalled or Now() reaches
  // `deadline`, and takes `mu` again. False when the deadline was reached.
  // May wake spuriously: callers loop on their condition.
  virtual bool WaitUntil(CondVar* cv, Mutex* mu, TimePoint deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) = 0;

  // WaitUntil(Now() + timeout).
  bool WaitFor(CondVar* cv, Mutex* mu, Duration timeout) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return WaitUntil(cv, mu, Now() + timeout);
  }

  // std::chrono::steady_clock. Never null; lives for the process.
  static TimeSource* Real();
};

}  // namespace kvrelay

#endif  // KVRELAY_CORE_TIME_SOURCE_H_
