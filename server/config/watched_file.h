// A configuration file that is re-read when its content changes, so that a
// ConfigMap or Secret update (an atomic rename or a symlink swap) takes
// effect without a restart.
//
// A background thread reads the file every `interval` and, when its bytes
// differ from the last read, hands them to `apply`. A content `apply`
// refuses keeps what was applied last; the refusal is logged once (not on
// every poll) together with `keeping` (what stays in effect).
//
// Thread-safe. `apply` runs on the creating thread (the first load) and then
// on the poller, never two at once.
#ifndef KVRELAY_SERVER_CONFIG_WATCHED_FILE_H_
#define KVRELAY_SERVER_CONFIG_WATCHED_FILE_H_

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/mutex.h"
#include "core/time_source.h"

namespace kvrelay {

class WatchedFile {
 public:
  // Applies a content read from the file; an error keeps the previous one.
  using Apply = std::function<absl::Status(const std::string& content)>;
  // What stays in effect after a refused content, for the log line.
  using Keeping = std::function<std::string()>;

  // Reads `path` once (a file that cannot be read or that `apply` refuses is
  // the error, naming `flag`), then polls it every `interval` of `time`
  // (not owned; outlives this). `flag` is e.g. "--route-file".
  static absl::StatusOr<std::unique_ptr<WatchedFile>> Start(const std::string& flag, const std::string& path,
                                                            std::chrono::milliseconds interval, Apply apply,
                                                            Keeping keeping, TimeSource* time = TimeSource::Real());
  ~WatchedFile();  // stops the poller
  WatchedFile(const WatchedFile&) = delete;
  WatchedFile& operator=(const WatchedFile&) = delete;

  // Reads the file now: OK when its content was applied or is what was read
  // last time (a refused content is returned once, the first time it is
  // read); the error otherwise.
  absl::Status ReloadNow();
  // How many contents were applied, the start-up load included.
  uint64_t loads() const { return loads_.load(); }
  // How many times the poller has read the file.
  uint64_t polls() const { return polls_.load(); }
  const std::string& path() const { return path_; }

 private:
  WatchedFile(const std::string& flag, const std::string& path, std::chrono::milliseconds interval, Apply apply,
              Keeping keeping, TimeSource* time);
  void PollLoop();

  const std::string flag_, path_;
  const std::chrono::milliseconds interval_;
  const Apply apply_;
  const Keeping keeping_;
  TimeSource* const time_;
  Mutex reload_mu_;  // one reload at a time
  std::string content_ ABSL_GUARDED_BY(reload_mu_);  // the last content read
  std::atomic<uint64_t> loads_{0};
  std::atomic<uint64_t> polls_{0};
  Mutex poll_mu_;
  CondVar poll_cv_;
  bool stop_ ABSL_GUARDED_BY(poll_mu_) = false;
  std::thread poller_;
};

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_CONFIG_WATCHED_FILE_H_
