#include "server/spool/journal.h"

#include <chrono>
#include <future>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/spool/crash_point.h"
#include "spdlog/spdlog.h"

namespace kvrelay {

Journal::Journal(SpoolFs* fs, std::string dir, const JournalOptions& opts)
    : fs_(fs), dir_(std::move(dir)), path_(dir_ + "/journal"), opts_(opts) {}

absl::StatusOr<std::unique_ptr<Journal>> Journal::Open(SpoolFs* fs, const std::string& dir,
                                                       const JournalOptions& opts, JournalRecovery* recovery) {
  std::unique_ptr<Journal> j(new Journal(fs, dir, opts));
  *recovery = JournalRecovery();
  const std::string tmp = dir + "/journal.tmp";
  if (absl::Status s = fs->Remove(tmp); !s.ok() && !absl::IsNotFound(s)) return s;
  absl::StatusOr<std::string> bytes = fs->ReadFile(j->path_);
  if (absl::IsNotFound(bytes.status())) {
    // A new spool: the header goes in under a temporary name, so that a
    // crash never leaves a journal without one.
    absl::StatusOr<std::unique_ptr<SpoolFile>> f = fs->NewFile(tmp);
    if (!f.ok()) return f.status();
    if (absl::Status s = (*f)->Append(JournalHeader()); !s.ok()) return s;
    if (opts.sync) {
      if (absl::Status s = (*f)->Sync(); !s.ok()) return s;
    }
    if (absl::Status s = (*f)->Close(); !s.ok()) return s;
    if (absl::Status s = fs->Rename(tmp, j->path_); !s.ok()) return s;
    if (opts.sync && opts.sync_dir) {
      if (absl::Status s = fs->SyncDir(dir); !s.ok()) return s;
    }
    recovery->bytes = kJournalHeaderBytes;
  } else if (!bytes.ok()) {
    return bytes.status();
  } else {
    absl::StatusOr<JournalScan> scan = ScanJournal(*bytes);
    if (!scan.ok()) {
      return absl::Status(scan.status().code(), absl::StrCat(j->path_, ": ", scan.status().message()));
    }
    recovery->records = std::move(scan->records);
    recovery->bytes = scan->valid_bytes;
    recovery->torn_bytes = scan->torn_bytes;
    recovery->torn_why = scan->torn_why;
    if (scan->torn_bytes > 0) {
      // A partial last record is what a crash mid-append leaves; anything
      // more is damage, kept for a post-mortem before it is cut off.
      const bool partial_tail = scan->torn_bytes < kRecordHeaderBytes ||
                                absl::StrContains(scan->torn_why, "cut short");
      if (!partial_tail) {
        const std::string q = absl::StrCat(dir, "/quarantine/journal.",
                                           std::chrono::system_clock::now().time_since_epoch().count());
        absl::StatusOr<std::unique_ptr<SpoolFile>> f = fs->NewFile(q);
        if (f.ok() && (*f)->Append(*bytes).ok() && (*f)->Sync().ok() && (*f)->Close().ok()) {
          recovery->quarantined = q;
        }
      }
      if (absl::Status s = fs->Truncate(j->path_, scan->valid_bytes); !s.ok()) return s;
    }
  }
  absl::StatusOr<std::unique_ptr<SpoolFile>> f = fs->AppendFile(j->path_);
  if (!f.ok()) return f.status();
  j->file_ = std::move(*f);
  if (recovery->torn_bytes > 0 && opts.sync) {
    if (absl::Status s = j->file_->Sync(); !s.ok()) return s;
  }
  j->bytes_ = j->compacted_at_ = recovery->bytes;
  return j;
}

Journal::~Journal() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (writer_.joinable()) writer_.join();
  // Never started: whatever was queued fails.
  std::deque<Pending> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    left.swap(queue_);
  }
  for (Pending& p : left) {
    if (p.done) p.done(absl::UnavailableError("spool journal: closed"));
  }
}

void Journal::Start(Snapshot snapshot, OnFailure on_failure) {
  snapshot_ = std::move(snapshot);
  on_failure_ = std::move(on_failure);
  writer_ = std::thread([this] { Loop(); });
}

void Journal::Append(spool::v1::Record record, Done done) {
  absl::Status failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_.ok()) {
      queue_.push_back(Pending{std::move(record), std::move(done)});
      cv_.notify_one();
      return;
    }
    failed = failed_;
  }
  if (done) done(failed);
}

absl::Status Journal::AppendAndWait(spool::v1::Record record) {
  auto p = std::make_shared<std::promise<absl::Status>>();
  std::future<absl::Status> f = p->get_future();
  Append(std::move(record), [p](const absl::Status& s) { p->set_value(s); });
  return f.get();
}

void Journal::StopCompaction() {
  std::unique_lock<std::mutex> lock(mu_);
  compaction_stopped_ = true;
  compaction_done_.wait(lock, [this] { return !compacting_; });
}

absl::Status Journal::health() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_;
}

uint64_t Journal::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

uint64_t Journal::compactions() const {
  std::lock_guard<std::mutex> lock(mu_);
  return compactions_;
}

void Journal::Fail(const absl::Status& s) {
  const absl::Status f = absl::UnavailableError(
      absl::StrCat("spool journal: ", s.message(), "; the spool takes no more writes until the relay restarts"));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_.ok()) return;
    failed_ = f;
  }
  spdlog::error("{}", std::string(f.message()));
  if (on_failure_) on_failure_(f);
}

absl::Status Journal::WriteBatch(const std::string& bytes) {
  if (absl::Status s = file_->Append(bytes); !s.ok()) return s;
  CrashPoint("spool.journal.after_append");
  if (!opts_.sync) return absl::OkStatus();
  const auto t = std::chrono::steady_clock::now();
  absl::Status s = file_->Sync();
  if (opts_.on_sync) opts_.on_sync(std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count());
  return s;
}

void Journal::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping with nothing left
    std::deque<Pending> batch;
    batch.swap(queue_);
    absl::Status st = failed_;
    lock.unlock();
    if (st.ok()) {
      std::string bytes;
      for (const Pending& p : batch) AppendJournalRecord(p.record, &bytes);
      if (absl::Status s = WriteBatch(bytes); !s.ok()) {
        Fail(s);
        st = health();
      } else {
        std::lock_guard<std::mutex> g(mu_);
        bytes_ += bytes.size();
      }
    }
    for (Pending& p : batch) {
      if (p.done) p.done(st);
    }
    lock.lock();
    if (failed_.ok() && snapshot_ && !compaction_stopped_ && bytes_ - compacted_at_ > opts_.compact_bytes) {
      compacting_ = true;
      lock.unlock();
      if (absl::Status s = Compact(); !s.ok()) spdlog::warn("spool journal: compaction failed: {}", s.ToString());
      lock.lock();
      compacting_ = false;
      compaction_done_.notify_all();
    }
  }
}

absl::Status Journal::Compact() {
  // Runs between batches: every record written so far is in the state the
  // snapshot reads, and records queued meanwhile go into the new file.
  const std::vector<spool::v1::Record> records = snapshot_();
  std::string bytes = JournalHeader();
  for (const spool::v1::Record& r : records) AppendJournalRecord(r, &bytes);
  const std::string tmp = dir_ + "/journal.tmp";
  absl::StatusOr<std::unique_ptr<SpoolFile>> f = fs_->NewFile(tmp);
  if (!f.ok()) return f.status();
  absl::Status s = (*f)->Append(bytes);
  if (s.ok() && opts_.sync) s = (*f)->Sync();
  if (s.ok()) s = (*f)->Close();
  if (!s.ok()) {
    (void)fs_->Remove(tmp);
    std::lock_guard<std::mutex> g(mu_);
    compacted_at_ = bytes_;  // try again after as much growth, not after every batch
    return s;
  }
  f->reset();
  if (s = fs_->Rename(tmp, path_); !s.ok()) {
    (void)fs_->Remove(tmp);
    std::lock_guard<std::mutex> g(mu_);
    compacted_at_ = bytes_;
    return s;
  }
  // From the rename on, the new file is the journal.
  if (opts_.sync && opts_.sync_dir) s = fs_->SyncDir(dir_);
  if (!s.ok()) {
    Fail(s);
    return s;
  }
  absl::StatusOr<std::unique_ptr<SpoolFile>> a = fs_->AppendFile(path_);
  if (!a.ok()) {
    Fail(a.status());
    return a.status();
  }
  file_ = std::move(*a);
  std::lock_guard<std::mutex> g(mu_);
  bytes_ = compacted_at_ = bytes.size();
  ++compactions_;
  spdlog::info("spool journal: compacted to {} records, {} bytes", records.size(), bytes.size());
  return absl::OkStatus();
}

}  // namespace kvrelay
