#include "server/rpc/watchdog.h"

#include <algorithm>
#include <chrono>

#include "core/mutex.h"

namespace kvrelay {

UploadWatchdog::UploadWatchdog(double timeout_seconds, TimeSource* time)
    : time_(time),
      timeout_s_(timeout_seconds),
      timeout_(std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_seconds))) {
  thread_ = std::thread([this] { Loop(); });
}

UploadWatchdog::~UploadWatchdog() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.SignalAll();
  thread_.join();
}

std::shared_ptr<UploadWatchdog::Entry> UploadWatchdog::Watch(std::function<void()> fire) {
  auto e = std::make_shared<Entry>(time_);
  {
    MutexLock entry_lock(&e->mu);  // not shared yet; the lock states the rule
    e->TouchLocked();
    e->fire = std::move(fire);
  }
  MutexLock lock(&mu_);
  entries_.push_back(e);
  return e;
}

void UploadWatchdog::Loop() {
  // Checks a few times per timeout (10 ms .. 1 s).
  const auto every = std::clamp<Clock::duration>(timeout_ / 4, std::chrono::milliseconds(10), std::chrono::seconds(1));
  MutexLock lock(&mu_);
  while (!stop_) {
    time_->WaitFor(&cv_, &mu_, every);
    if (stop_) break;
    std::vector<std::shared_ptr<Entry>> snapshot = entries_;
    mu_.Unlock();
    const Clock::time_point now = time_->Now();
    for (const auto& e : snapshot) {
      if (!e->mu.TryLock()) continue;  // busy: a reaction holds it
      if (e->armed && now - e->last >= timeout_) {  // else done or active
        e->armed = false;
        std::function<void()> fire = std::move(e->fire);
        e->fire = nullptr;
        if (fire) fire();
      }
      e->mu.Unlock();
    }
    mu_.Lock();
    // Forget entries that are disarmed (finished, committed or fired). An
    // entry whose mutex is held is kept for the next round: its holder may
    // be waiting for mu_ in Watch (a reaction that registers a new entry).
    entries_.erase(std::remove_if(entries_.begin(), entries_.end(),
                                  [](const std::shared_ptr<Entry>& e) {
                                    if (!e->mu.TryLock()) return false;
                                    const bool disarmed = !e->armed;
                                    e->mu.Unlock();
                                    return disarmed;
                                  }),
                   entries_.end());
  }
}

}  // namespace kvrelay
