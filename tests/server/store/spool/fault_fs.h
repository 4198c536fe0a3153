// A file system in memory that knows what a power loss keeps: a file's
// bytes survive up to its last Sync, and a create, rename or unlink survives
// only once its directory was synced (as on ext4 without data=journal).
// Crash(n) makes the n-th mutating operation from now and every later one
// fail, as if the process died there; PowerLoss() then drops what was not
// durable, and Revive() lets a new process in.
//
// Thread-safe.
#ifndef KVRELAY_TESTS_SERVER_SPOOL_FAULT_FS_H_
#define KVRELAY_TESTS_SERVER_SPOOL_FAULT_FS_H_

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/store/spool/spool_fs.h"

namespace kvrelay::testing {

class FaultFs final : public SpoolFs {
 public:
  // The n-th mutating operation from now (1: the next) and all after it fail.
  void Crash(long n) {
    std::lock_guard<std::mutex> lock(mu_);
    crash_in_ = n;
  }
  // The next `op` ("open", "write", "fdatasync", "rename", "unlink",
  // "truncate", "fsync" of a directory) on a path containing `path_part`
  // fails with `status` (once); the process lives on.
  void FailOn(const std::string& op, const std::string& path_part, absl::Status status) {
    std::lock_guard<std::mutex> lock(mu_);
    fail_op_ = op;
    fail_path_ = path_part;
    fail_status_ = std::move(status);
  }
  // From now until Release, each `op` ("fdatasync" or "unlink") of a path
  // containing `path_part` waits (a slow disk); other operations go on.
  void Hold(const std::string& op, const std::string& path_part) {
    std::lock_guard<std::mutex> lock(mu_);
    hold_op_ = op;
    hold_path_ = path_part;
  }
  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    hold_op_.clear();
    released_.notify_all();
  }
  // How many operations are waiting in Hold now.
  int held() const {
    std::lock_guard<std::mutex> lock(mu_);
    return held_;
  }
  bool dead() const {
    std::lock_guard<std::mutex> lock(mu_);
    return dead_;
  }
  // Keeps only what was durable.
  void PowerLoss() {
    std::lock_guard<std::mutex> lock(mu_);
    names_ = durable_names_;
    for (auto& [path, node] : names_) node->data = node->durable;
  }
  void Revive() {
    std::lock_guard<std::mutex> lock(mu_);
    dead_ = false;
    crash_in_ = 0;
  }
  // Changes a file's bytes in place, durably (for corruption tests).
  void Poke(const std::string& path, const std::string& data) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = names_.find(path);
    if (it == names_.end()) return;
    it->second->data = it->second->durable = data;
  }
  std::string Peek(const std::string& path) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = names_.find(path);
    return it == names_.end() ? std::string() : it->second->data;
  }
  uint64_t ops() const {
    std::lock_guard<std::mutex> lock(mu_);
    return ops_;
  }

  absl::StatusOr<std::unique_ptr<SpoolFile>> NewFile(const std::string& path) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (absl::Status s = StepLocked("open", path); !s.ok()) return s;
    auto node = std::make_shared<Node>();
    names_[path] = node;
    return std::unique_ptr<SpoolFile>(new File(this, node, path));
  }
  absl::StatusOr<std::unique_ptr<SpoolFile>> AppendFile(const std::string& path) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (absl::Status s = StepLocked("open", path); !s.ok()) return s;
    auto it = names_.find(path);
    if (it == names_.end()) return absl::NotFoundError(absl::StrCat("open ", path, ": No such file or directory"));
    return std::unique_ptr<SpoolFile>(new File(this, it->second, path));
  }
  absl::StatusOr<std::string> ReadFile(const std::string& path) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (dead_) return absl::UnavailableError("read: the process is dead");
    auto it = names_.find(path);
    if (it == names_.end()) return absl::NotFoundError(absl::StrCat("open ", path, ": No such file or directory"));
    return it->second->data;
  }
  absl::Status Rename(const std::string& from, const std::string& to) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (absl::Status s = StepLocked("rename", from); !s.ok()) return s;
    auto it = names_.find(from);
    if (it == names_.end()) return absl::NotFoundError(absl::StrCat("rename ", from, ": No such file or directory"));
    names_[to] = it->second;
    names_.erase(from);
    return absl::OkStatus();
  }
  absl::Status Remove(const std::string& path) override {
    std::unique_lock<std::mutex> lock(mu_);
    WaitWhileHeldLocked(lock, "unlink", path);
    if (absl::Status s = StepLocked("unlink", path); !s.ok()) return s;
    if (!names_.erase(path)) return absl::NotFoundError(absl::StrCat("unlink ", path, ": No such file or directory"));
    return absl::OkStatus();
  }
  absl::Status Truncate(const std::string& path, uint64_t size) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (absl::Status s = StepLocked("truncate", path); !s.ok()) return s;
    auto it = names_.find(path);
    if (it == names_.end()) return absl::NotFoundError(absl::StrCat("truncate ", path, ": No such file"));
    it->second->data.resize(size);
    return absl::OkStatus();
  }
  absl::Status SyncDir(const std::string& dir) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (absl::Status s = StepLocked("fsync", dir); !s.ok()) return s;
    const std::string prefix = dir + "/";
    auto in_dir = [&](const std::string& p) {
      return p.compare(0, prefix.size(), prefix) == 0 && p.find('/', prefix.size()) == std::string::npos;
    };
    for (auto it = durable_names_.begin(); it != durable_names_.end();) {
      it = in_dir(it->first) ? durable_names_.erase(it) : std::next(it);
    }
    for (const auto& [p, node] : names_) {
      if (in_dir(p)) durable_names_[p] = node;
    }
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<std::string>> List(const std::string& dir) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (dead_) return absl::UnavailableError("list: the process is dead");
    std::vector<std::string> out;
    const std::string prefix = dir + "/";
    for (const auto& [p, node] : names_) {
      if (p.compare(0, prefix.size(), prefix) == 0 && p.find('/', prefix.size()) == std::string::npos) {
        out.push_back(p.substr(prefix.size()));
      }
    }
    return out;
  }
  absl::Status CreateDir(const std::string& dir) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (dead_) return absl::UnavailableError("mkdir: the process is dead");
    return absl::OkStatus();  // directories exist durably at once
  }
  absl::StatusOr<uint64_t> FileSize(const std::string& path) override {
    absl::StatusOr<std::string> d = ReadFile(path);
    if (!d.ok()) return d.status();
    return d->size();
  }

 private:
  struct Node {
    std::string data, durable;
  };
  class File final : public SpoolFile {
   public:
    File(FaultFs* fs, std::shared_ptr<Node> node, std::string path)
        : fs_(fs), node_(std::move(node)), path_(std::move(path)) {}
    absl::Status Append(absl::string_view data) override {
      std::lock_guard<std::mutex> lock(fs_->mu_);
      if (absl::Status s = fs_->StepLocked("write", path_); !s.ok()) return s;
      node_->data.append(data.data(), data.size());
      return absl::OkStatus();
    }
    absl::Status Sync() override {
      std::unique_lock<std::mutex> lock(fs_->mu_);
      fs_->WaitWhileHeldLocked(lock, "fdatasync", path_);
      if (absl::Status s = fs_->StepLocked("fdatasync", path_); !s.ok()) return s;
      node_->durable = node_->data;
      return absl::OkStatus();
    }
    absl::Status Close() override { return absl::OkStatus(); }

   private:
    FaultFs* const fs_;
    const std::shared_ptr<Node> node_;
    const std::string path_;
  };

  void WaitWhileHeldLocked(std::unique_lock<std::mutex>& lock, const char* op, const std::string& path) {
    auto held = [&] { return hold_op_ == op && path.find(hold_path_) != std::string::npos; };
    if (!held()) return;
    ++held_;
    released_.wait(lock, [&] { return !held(); });
    --held_;
  }

  absl::Status StepLocked(const char* op, const std::string& path) {
    ++ops_;
    if (!dead_ && crash_in_ > 0 && --crash_in_ == 0) dead_ = true;
    if (dead_) return absl::UnavailableError(absl::StrCat(op, " ", path, ": the process is dead"));
    if (!fail_op_.empty() && fail_op_ == op && path.find(fail_path_) != std::string::npos) {
      fail_op_.clear();
      return fail_status_;
    }
    return absl::OkStatus();
  }

  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<Node>> names_, durable_names_;
  std::condition_variable released_;
  std::string fail_op_, fail_path_, hold_op_, hold_path_;
  int held_ = 0;
  absl::Status fail_status_;
  long crash_in_ = 0;
  bool dead_ = false;
  uint64_t ops_ = 0;
};

}  // namespace kvrelay::testing

#endif  // KVRELAY_TESTS_SERVER_SPOOL_FAULT_FS_H_
