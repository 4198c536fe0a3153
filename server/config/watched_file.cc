#include "server/config/watched_file.h"

#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/mutex.h"
#include "core/status_macros.h"
#include "spdlog/spdlog.h"

namespace kvrelay {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(flag, "=", path, ": cannot open it"));
  std::ostringstream s;
  s << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(flag, "=", path, ": read error"));
  return s.str();
}

}  // namespace

WatchedFile::WatchedFile(const std::string& flag, const std::string& path, std::chrono::milliseconds interval,
                         Apply apply, Keeping keeping, TimeSource* time)
    : flag_(flag),
      path_(path),
      interval_(interval),
      apply_(std::move(apply)),
      keeping_(std::move(keeping)),
      time_(time) {}

absl::StatusOr<std::unique_ptr<WatchedFile>> WatchedFile::Start(const std::string& flag, const std::string& path,
                                                                std::chrono::milliseconds interval, Apply apply,
                                                                Keeping keeping, TimeSource* time) {
  std::unique_ptr<WatchedFile> w(
      new WatchedFile(flag, path, interval, std::move(apply), std::move(keeping), time));
  if (absl::Status s = w->ReloadNow(); !s.ok()) return s;
  w->poller_ = std::thread([p = w.get()] { p->PollLoop(); });
  return w;
}

WatchedFile::~WatchedFile() {
  {
    MutexLock lock(&poll_mu_);
    stop_ = true;
  }
  poll_cv_.SignalAll();
  if (poller_.joinable()) poller_.join();
}

absl::Status WatchedFile::ReloadNow() {
  // Read under the lock, so that a slower reload never applies an older
  // read after a newer one.
  MutexLock lock(&reload_mu_);
  absl::StatusOr<std::string> content = ReadFile(flag_, path_);
  if (!content.ok()) return content.status();
  if (loads_.load() > 0 && *content == content_) return absl::OkStatus();
  // Remember a refused content too, so that it is reported once, not every poll.
  content_ = std::move(*content);
  absl::Status s = apply_(content_);
  if (s.ok()) loads_.fetch_add(1);
  return s;
}

void WatchedFile::PollLoop() {
  MutexLock lock(&poll_mu_);
  absl::Status last;
  for (;;) {
    const TimeSource::TimePoint next = time_->Now() + interval_;
    while (!stop_ && time_->WaitUntil(&poll_cv_, &poll_mu_, next)) {
    }
    if (stop_) break;
    poll_mu_.Unlock();
    const uint64_t loads = loads_.load();
    absl::Status s = ReloadNow();
    polls_.fetch_add(1);
    if (!s.ok() && s != last) {
      spdlog::warn("{}; keeping {}", std::string(s.message()), keeping_ ? keeping_() : std::string("the last good one"));
    } else if (s.ok() && loads_.load() != loads) {
      spdlog::info("reloaded {}={}", flag_, path_);
    }
    last = s;
    poll_mu_.Lock();
  }
}

}  // namespace kvrelay
