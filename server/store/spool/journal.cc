#include "server/store/spool/journal.h"

#include <algorithm>
#include <chrono>
#include <future>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/mutex.h"
#include "core/status_macros.h"
#include "server/store/spool/crash_point.h"
#include "spdlog/spdlog.h"

namespace kvrelay {

namespace {

constexpr char kRefusal[] =
    "; refusing to start with nothing changed, so that no acknowledged message is lost. To start anyway, "
    "start once with --spool-salvage: it keeps the journal's intact records and moves every message file "
    "they do not name to quarantine/";

// Writes `bytes` as DIR/journal whole: under a temporary name, synced, then
// renamed into place, so that a crash leaves either file, never part of one.
absl::Status WriteWhole(SpoolFs* fs, const std::string& dir, const JournalOptions& opts, const std::string& bytes) {
  const std::string tmp = dir + "/journal.tmp";
  absl::StatusOr<std::unique_ptr<SpoolFile>> f = fs->NewFile(tmp);
  if (!f.ok()) return f.status();
  if (absl::Status s = (*f)->Append(bytes); !s.ok()) return s;
  if (opts.sync) {
    if (absl::Status s = (*f)->Sync(); !s.ok()) return s;
  }
  if (absl::Status s = (*f)->Close(); !s.ok()) return s;
  if (absl::Status s = fs->Rename(tmp, dir + "/journal"); !s.ok()) return s;
  if (opts.sync && opts.sync_dir) return fs->SyncDir(dir);
  return absl::OkStatus();
}

// A synced copy of a damaged journal in DIR/quarantine/ ("" if it failed).
std::string Quarantine(SpoolFs* fs, const std::string& dir, const std::string& bytes) {
  const std::string q =
      absl::StrCat(dir, "/quarantine/journal.", std::chrono::system_clock::now().time_since_epoch().count());
  absl::StatusOr<std::unique_ptr<SpoolFile>> f = fs->NewFile(q);
  if (f.ok() && (*f)->Append(bytes).ok() && (*f)->Sync().ok() && (*f)->Close().ok()) return q;
  return "";
}

// What a journal's bytes hold, or why they are refused (nothing changed
// yet). `*bad_header`: salvaged past a header that is not a journal's.
absl::StatusOr<JournalScan> Judge(const std::string& path, const std::string& bytes, const JournalOptions& opts,
                                  bool* bad_header) {
  absl::StatusOr<JournalScan> scan = ScanJournal(bytes);
  *bad_header = absl::IsDataLoss(scan.status());
  if (!scan.ok() && !*bad_header) {
    return absl::Status(scan.status().code(), absl::StrCat(path, ": ", scan.status().message()));
  }
  if (*bad_header && !opts.salvage) {
    return absl::FailedPreconditionError(absl::StrCat(path, ": ", scan.status().message(), kRefusal));
  }
  if (*bad_header) return ScanJournalRecords(bytes);
  if (scan->intact_after > 0 && !opts.salvage) {
    return absl::FailedPreconditionError(absl::StrCat(path, ": damaged in the middle: ", scan->torn_why,
                                                      ", then intact records again from offset ", scan->intact_after,
                                                      " (of ", bytes.size(), " bytes)", kRefusal));
  }
  return scan;
}

}  // namespace

Journal::Journal(SpoolFs* fs, std::string dir, const JournalOptions& opts)
    : fs_(fs), dir_(std::move(dir)), path_(dir_ + "/journal"), opts_(opts) {}

absl::StatusOr<std::unique_ptr<Journal>> Journal::Open(SpoolFs* fs, const std::string& dir,
                                                       const JournalOptions& opts, JournalRecovery* recovery) {
  std::unique_ptr<Journal> j(new Journal(fs, dir, opts));
  *recovery = JournalRecovery();
  absl::StatusOr<std::string> bytes = fs->ReadFile(j->path_);
  if (!bytes.ok() && !absl::IsNotFound(bytes.status())) return bytes.status();
  if (!bytes.ok() && !opts.create) {
    return absl::FailedPreconditionError(
        absl::StrCat(j->path_, ": missing, while message files are present that only it proves committed",
                     kRefusal));
  }
  JournalScan scan;
  bool bad_header = false;
  if (bytes.ok()) {
    KVRELAY_ASSIGN_OR_RETURN(scan, Judge(j->path_, *bytes, opts, &bad_header));
  }
  const std::string tmp = dir + "/journal.tmp";
  if (absl::Status s = fs->Remove(tmp); !s.ok() && !absl::IsNotFound(s)) return s;
  if (!bytes.ok()) {
    // No journal: nothing is proven. The header goes in under a temporary
    // name, so that a crash never leaves a journal without one.
    recovery->created = true;
    recovery->complete = false;
    if (opts.before_repair) KVRELAY_RETURN_IF_ERROR(opts.before_repair({}));
    KVRELAY_RETURN_IF_ERROR(WriteWhole(fs, dir, opts, JournalHeader()));
    recovery->bytes = kJournalHeaderBytes;
  } else {
    KVRELAY_RETURN_IF_ERROR(j->Repair(*bytes, std::move(scan), bad_header, recovery));
  }
  KVRELAY_ASSIGN_OR_RETURN(j->file_, fs->AppendFile(j->path_));
  if (recovery->torn_bytes > 0 && opts.sync) KVRELAY_RETURN_IF_ERROR(j->file_->Sync());
  {
    MutexLock lock(&j->mu_);
    j->bytes_ = j->compacted_at_ = recovery->bytes;
  }
  return j;
}

absl::Status Journal::Repair(const std::string& bytes, JournalScan scan, bool bad_header,
                             JournalRecovery* recovery) {
  recovery->salvaged = bad_header || scan.intact_after > 0;
  // A record cut short by the end of the file is what a crash during an
  // append leaves, never acknowledged; but bit rot in the length of a whole,
  // acknowledged last record reads the same. So any cut tail counts as
  // incomplete: the files no intact record names go to quarantine/, never
  // away.
  recovery->complete = !bad_header && scan.torn_bytes == 0;
  recovery->records = std::move(scan.records);
  recovery->torn_bytes = scan.torn_bytes;
  recovery->torn_why = scan.torn_why;
  if (bad_header) {
    recovery->torn_why = absl::StrCat("a damaged header", scan.torn_why.empty() ? "" : "; ", scan.torn_why);
  }
  if (!recovery->complete) {
    // Kept for a post-mortem, and the message files the intact records do
    // not name put out of the way, before anything is cut.
    recovery->quarantined = Quarantine(fs_, dir_, bytes);
    if (opts_.before_repair) KVRELAY_RETURN_IF_ERROR(opts_.before_repair(recovery->records));
  }
  if (bad_header) {
    const size_t from = std::min<size_t>(bytes.size(), kJournalHeaderBytes);
    const std::string fresh = JournalHeader() + bytes.substr(from, scan.valid_bytes - from);
    KVRELAY_RETURN_IF_ERROR(WriteWhole(fs_, dir_, opts_, fresh));
    recovery->bytes = fresh.size();
    return absl::OkStatus();
  }
  recovery->bytes = scan.valid_bytes;
  if (scan.torn_bytes > 0) KVRELAY_RETURN_IF_ERROR(fs_->Truncate(path_, scan.valid_bytes));
  return absl::OkStatus();
}

Journal::~Journal() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.SignalAll();
  if (writer_.joinable()) writer_.join();
  // Never started: whatever was queued fails.
  std::deque<Pending> left;
  {
    MutexLock lock(&mu_);
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
    MutexLock lock(&mu_);
    if (failed_.ok()) {
      queue_.push_back(Pending{std::move(record), std::move(done)});
      cv_.Signal();
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
  MutexLock lock(&mu_);
  compaction_stopped_ = true;
  while (compacting_) {
    ++compaction_stop_waiters_;
    compaction_done_.Wait(&mu_);
    --compaction_stop_waiters_;
  }
}

int Journal::compaction_stop_waiters() const {
  MutexLock lock(&mu_);
  return compaction_stop_waiters_;
}

absl::Status Journal::health() const {
  MutexLock lock(&mu_);
  return failed_;
}

uint64_t Journal::bytes() const {
  MutexLock lock(&mu_);
  return bytes_;
}

uint64_t Journal::compactions() const {
  MutexLock lock(&mu_);
  return compactions_;
}

void Journal::Fail(const absl::Status& s) {
  const absl::Status f = absl::UnavailableError(
      absl::StrCat("spool journal: ", s.message(), "; the spool takes no more writes until the relay restarts"));
  {
    MutexLock lock(&mu_);
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
  MutexLock lock(&mu_);
  for (;;) {
    while (!stop_ && queue_.empty()) cv_.Wait(&mu_);
    if (queue_.empty()) return;  // stopping with nothing left
    std::deque<Pending> batch;
    batch.swap(queue_);
    absl::Status st = failed_;
    mu_.Unlock();
    if (st.ok()) {
      std::string bytes;
      for (const Pending& p : batch) AppendJournalRecord(p.record, &bytes);
      if (absl::Status s = WriteBatch(bytes); !s.ok()) {
        Fail(s);
        st = health();
      } else {
        MutexLock g(&mu_);
        bytes_ += bytes.size();
      }
    }
    for (Pending& p : batch) {
      if (p.done) p.done(st);
    }
    mu_.Lock();
    if (failed_.ok() && snapshot_ && !compaction_stopped_ && bytes_ - compacted_at_ > opts_.compact_bytes) {
      compacting_ = true;
      mu_.Unlock();
      if (absl::Status s = Compact(); !s.ok()) spdlog::warn("spool journal: compaction failed: {}", s.ToString());
      mu_.Lock();
      compacting_ = false;
      compaction_done_.SignalAll();
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
    MutexLock g(&mu_);
    compacted_at_ = bytes_;  // try again after as much growth, not after every batch
    return s;
  }
  f->reset();
  if (s = fs_->Rename(tmp, path_); !s.ok()) {
    (void)fs_->Remove(tmp);
    MutexLock g(&mu_);
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
  MutexLock g(&mu_);
  bytes_ = compacted_at_ = bytes.size();
  ++compactions_;
  spdlog::info("spool journal: compacted to {} records, {} bytes", records.size(), bytes.size());
  return absl::OkStatus();
}

}  // namespace kvrelay
