// The spool's journal: an append-only file of CRC32C-checked records
// (spool_format.h) that records everything but the messages' tensors:
// commits, deliveries, acks, closes, expiries, the outbox's states and the
// relays that hold a part of a session.
//
// One writer thread takes whatever records are queued, writes them with one
// write and (JournalOptions::sync) one fdatasync, then calls each record's
// callback: group commit. A record is durable when its callback says OK.
//
// A failed write or sync is not retried (what the kernel dropped on a failed
// fsync is gone, and the file's state is unknown): the journal stops
// taking records for good, every queued and later Append fails with
// UNAVAILABLE, and the failure callback runs once. The relay then reports
// NOT_SERVING until it is restarted, when recovery reads what is durable.
//
// Compaction: once the file has grown by JournalOptions::compact_bytes
// since it was last written whole, the writer asks the snapshot callback
// for records that rebuild the current state, writes them to
// DIR/journal.tmp, syncs it, renames it over DIR/journal and syncs DIR.
// A crash at any step leaves one whole journal.
//
// Thread-safe. Callbacks run on the writer thread and must not block on
// the journal.
#ifndef KVRELAY_SERVER_STORE_SPOOL_JOURNAL_H_
#define KVRELAY_SERVER_STORE_SPOOL_JOURNAL_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/mutex.h"
#include "kvrelay/spool/v1/spool.pb.h"
#include "server/store/spool/spool_format.h"
#include "server/store/spool/spool_fs.h"

namespace kvrelay {

struct JournalOptions {
  bool sync = true;                   // fdatasync each batch (--fsync=always)
  bool sync_dir = true;               // fsync the directory after a rename; false only in tests (a negative control)
  uint64_t compact_bytes = 64 << 20;  // growth that triggers a compaction
  std::function<void(double seconds)> on_sync;  // told how long each batch's fdatasync took
  // Damage that is not a torn tail (below): false refuses it, true salvages.
  bool salvage = false;
  // Whether Open may write a new journal where there is none; false makes a
  // missing journal FAILED_PRECONDITION (the spool holds message files that
  // only a journal proves committed).
  bool create = true;
  // Called by Open before it changes the journal, when the journal does not
  // prove every commit that may have been acknowledged
  // (JournalRecovery::complete is false), with the intact records. The spool
  // moves the message files they do not name to quarantine/ here, so that
  // no crash after the journal is repaired can make those files look never
  // committed. An error fails Open and leaves the journal as it was.
  std::function<absl::Status(const std::vector<spool::v1::Record>& intact)> before_repair;
};

// What opening the journal found.
struct JournalRecovery {
  std::vector<spool::v1::Record> records;  // the intact records, in order
  uint64_t bytes = 0;                      // the journal's size after recovery
  uint64_t torn_bytes = 0;                 // cut off the end (a torn or damaged tail)
  std::string torn_why;
  std::string quarantined;                 // where the damaged journal was copied ("": nowhere)
  // Every record that may have been acknowledged is in `records`: the file
  // ended cleanly or in one record cut short by its end (an append a crash
  // interrupted, never acknowledged). False when a damaged record was cut
  // off, damage was salvaged, or there was no journal.
  bool complete = true;
  bool created = false;   // there was no journal: a new one was written
  bool salvaged = false;  // damage in the middle or a damaged header, salvaged
};

class Journal {
 public:
  using Done = std::function<void(const absl::Status&)>;
  using Snapshot = std::function<std::vector<spool::v1::Record>()>;
  using OnFailure = std::function<void(const absl::Status&)>;

  // Opens DIR/journal, creating it when missing (and opts.create), and
  // reads it into `*recovery`; a leftover DIR/journal.tmp is removed.
  //
  // A torn tail, damage after which no intact record follows, is cut off
  // (after copying the whole damaged file to DIR/quarantine/ and calling
  // opts.before_repair when more than one record cut short by the end of
  // the file is lost).
  //
  // Damage in the middle (a damaged record followed by an intact one), a
  // header that is not a journal's, and a missing journal without
  // opts.create are FAILED_PRECONDITION, the file left untouched, unless
  // opts.salvage: then the file is copied to DIR/quarantine/,
  // opts.before_repair is called with the intact prefix (the records before
  // the damage; for a damaged header, those after it; none for a missing
  // journal), and the journal is rewritten to hold just those records.
  //
  // FAILED_PRECONDITION for a journal of an unknown format version (left
  // untouched, salvage or not).
  // REQUIRES: DIR and DIR/quarantine exist. `fs` outlives the journal.
  static absl::StatusOr<std::unique_ptr<Journal>> Open(SpoolFs* fs, const std::string& dir,
                                                       const JournalOptions& opts, JournalRecovery* recovery);
  // Writes what is queued, then stops the writer.
  ~Journal();
  Journal(const Journal&) = delete;
  Journal& operator=(const Journal&) = delete;

  // Starts the writer thread. REQUIRES: called once, before Append.
  void Start(Snapshot snapshot, OnFailure on_failure);

  // Queues `record`; `done` (may be null) is called once it is durable or
  // has failed.
  void Append(spool::v1::Record record, Done done = nullptr);
  // Appends `record` and waits until it is durable or has failed.
  absl::Status AppendAndWait(spool::v1::Record record);

  // No compaction starts after this returns, and one in progress has
  // finished: the snapshot callback is not called again. Records are still
  // written. Call it before whatever the snapshot reads goes away.
  void StopCompaction();
  // Callers of StopCompaction waiting now for the compaction in progress to
  // finish; e.g. for a test that must know such a caller is held.
  int compaction_stop_waiters() const;

  // OK, or the failure that stopped the journal.
  absl::Status health() const;
  uint64_t bytes() const;
  uint64_t compactions() const;

 private:
  Journal(SpoolFs* fs, std::string dir, const JournalOptions& opts);
  // Fills `*recovery` from the scan of the journal's `bytes` and cuts what
  // it lost (rewriting the file whole when `bad_header`), calling
  // before_repair first when that may be acknowledged records.
  absl::Status Repair(const std::string& bytes, JournalScan scan, bool bad_header, JournalRecovery* recovery);
  void Loop();
  absl::Status WriteBatch(const std::string& bytes);
  // Rewrites the journal from the snapshot; an error before the rename
  // leaves the old journal in use, one after it fails the journal.
  absl::Status Compact();
  void Fail(const absl::Status& s);

  struct Pending {
    spool::v1::Record record;
    Done done;
  };

  SpoolFs* const fs_;
  const std::string dir_, path_;
  const JournalOptions opts_;
  Snapshot snapshot_;
  OnFailure on_failure_;
  std::unique_ptr<SpoolFile> file_;  // the writer's

  mutable Mutex mu_;
  CondVar cv_;
  std::deque<Pending> queue_ ABSL_GUARDED_BY(mu_);
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool compaction_stopped_ ABSL_GUARDED_BY(mu_) = false;
  bool compacting_ ABSL_GUARDED_BY(mu_) = false;
  CondVar compaction_done_;
  int compaction_stop_waiters_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t compacted_at_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t compactions_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread writer_;
};

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_STORE_SPOOL_JOURNAL_H_
