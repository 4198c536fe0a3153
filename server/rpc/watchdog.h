// The idle watchdog of the relay's streams.
#ifndef KVRELAY_SERVER_RPC_WATCHDOG_H_
#define KVRELAY_SERVER_RPC_WATCHDOG_H_

#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "core/mutex.h"
#include "core/time_source.h"
#include "server/store/store.h"

namespace kvrelay {

// Cancels uploads (Publish, Compress) that send nothing for the idle
// timeout, and replies (Fetch, Compress) whose client reads nothing for as
// long. A reactor holds its Entry's mutex while it reacts to a read or a
// completed write and touches `last`; the watchdog fires an armed entry that has been idle past
// the timeout under that mutex (skipping it while the reactor is busy), so a
// firing never overlaps a reaction, and OnDone disarms it under the mutex
// before the reactor goes away. The watchdog never waits for an Entry's
// mutex, so a reaction may call Watch while holding one.
class UploadWatchdog {
 public:
  struct Entry {
    explicit Entry(TimeSource* t) : time(t) {}

    TimeSource* const time;  // the watchdog's
    Mutex mu;
    Clock::time_point last ABSL_GUARDED_BY(mu);
    bool armed ABSL_GUARDED_BY(mu) = true;
    std::function<void()> fire ABSL_GUARDED_BY(mu);  // runs once, under mu

    // Marks activity now (e.g. a reply's write completed).
    void Touch() {
      MutexLock lock(&mu);
      TouchLocked();
    }
    void TouchLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { last = time->Now(); }
    // No firing from now on (e.g. from OnDone, before the reactor goes).
    void Disarm() {
      MutexLock lock(&mu);
      armed = false;
      fire = nullptr;
    }
  };
  // Checks the entries a few times per timeout of `time` (not owned;
  // outlives this).
  explicit UploadWatchdog(double timeout_seconds, TimeSource* time = TimeSource::Real());
  ~UploadWatchdog();
  UploadWatchdog(const UploadWatchdog&) = delete;
  UploadWatchdog& operator=(const UploadWatchdog&) = delete;

  std::shared_ptr<Entry> Watch(std::function<void()> fire);
  double timeout_seconds() const { return timeout_s_; }

 private:
  void Loop();
  TimeSource* const time_;
  const double timeout_s_;
  const Clock::duration timeout_;
  Mutex mu_;
  CondVar cv_;
  std::vector<std::shared_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_RPC_WATCHDOG_H_
