#include "server/watchdog.h"

#include <algorithm>
#include <chrono>

namespace kvrelay {

UploadWatchdog::UploadWatchdog(double timeout_seconds)
    : timeout_s_(timeout_seconds),
      timeout_(std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_seconds))) {
  thread_ = std::thread([this] { Loop(); });
}

UploadWatchdog::~UploadWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::shared_ptr<UploadWatchdog::Entry> UploadWatchdog::Watch(std::function<void()> fire) {
  auto e = std::make_shared<Entry>();
  e->fire = std::move(fire);
  std::lock_guard<std::mutex> lock(mu_);
  entries_.push_back(e);
  return e;
}

void UploadWatchdog::Loop() {
  // Checks a few times per timeout (10 ms .. 1 s).
  const auto every = std::clamp<Clock::duration>(timeout_ / 4, std::chrono::milliseconds(10), std::chrono::seconds(1));
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, every);
    if (stop_) break;
    std::vector<std::shared_ptr<Entry>> snapshot = entries_;
    lock.unlock();
    const Clock::time_point now = Clock::now();
    for (const auto& e : snapshot) {
      std::unique_lock<std::mutex> el(e->mu, std::try_to_lock);
      if (!el.owns_lock() || !e->armed || now - e->last < timeout_) continue;  // busy, done or active
      e->armed = false;
      std::function<void()> fire = std::move(e->fire);
      e->fire = nullptr;
      if (fire) fire();
    }
    lock.lock();
    // Forget entries that are disarmed (finished, committed or fired). An
    // entry whose mutex is held is kept for the next round: its holder may
    // be waiting for mu_ in Watch (a reaction that registers a new entry).
    entries_.erase(std::remove_if(entries_.begin(), entries_.end(),
                                  [](const std::shared_ptr<Entry>& e) {
                                    std::unique_lock<std::mutex> el(e->mu, std::try_to_lock);
                                    return el.owns_lock() && !e->armed;
                                  }),
                   entries_.end());
  }
}

}  // namespace kvrelay
