// The Store that survives a restart (kill -9, OOM kill, power loss with
// --fsync=always): a MemoryStore for serving, and under it a spool
// directory that records every commit, delivery, ack, close and forward
// state before the call that made it returns OK.
//
// What "accepted" means:
//   - Commit (Publish) and CommitForward (a forward here) return OK only
//     once the message is durable: its file written and synced, renamed into
//     place, the directory synced, and its commit record synced in the
//     journal. A forward's commit goes out only after Commit returned, so no
//     destination holds a message whose publish failed.
//   - Ack returns OK only once the ack is durable; a message acked OK is
//     never delivered again, also after a restart.
//   - CloseSession returns once the close is durable (a tombstone that
//     refuses forwards for the TTL after a restart too); dead letters are
//     durable before they are reported.
//   - The outbox: a message's recipients on other relays stay in it until
//     the destination answered (after making the message durable there); a
//     restart resumes their forwards (RecoveredOutbox).
//   - A delivery is durable before its last write (the trailer) goes out, so
//     that an agent that got a whole message can ack it after a restart. A
//     delivery cut after that point counts as delivered after a restart
//     too (the agent may then ack a message it did not get whole).
// A crash before any of these returned loses nothing that was accepted; the
// call may or may not have taken effect, and its retry with the same ids is
// answered as a duplicate or done then.
//
// Layout of DIR (mode 0700, files 0600): LOCK (flock: one relay per spool),
// journal (spool_format.h), msg/<seq>.kvm (one file per message, seq in 16
// hex digits), msg/<seq>.tmp (a file being written), quarantine/ (damaged
// files, never served). A message file goes once its session is closed or
// expired (acked messages stay until then: they may still be parents).
//
// Memory: every retained message is also held in memory, as without a
// spool, so the cache is the store itself, bounded by --max-store-bytes and
// the other store limits; the spool holds at most the same messages.
//
// Errors: a full disk (ENOSPC) or a spool over --max-spool-bytes is
// RESOURCE_EXHAUSTED; any other I/O error of a message file fails that call
// with UNAVAILABLE and leaves nothing visible. A failed journal write or
// sync, or a failed directory sync, is not retried (the kernel may have
// dropped the data it could not write): the spool takes no more writes,
// every mutating call fails with UNAVAILABLE, and the failure callback
// tells the server to report NOT_SERVING until it is restarted.
//
// Thread-safe, like every Store.
#ifndef KVRELAY_SERVER_STORE_SPOOL_STORE_H_
#define KVRELAY_SERVER_STORE_SPOOL_STORE_H_

#include <atomic>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/mutex.h"
#include "core/time_source.h"
#include "core/thread_pool.h"
#include "server/store/memory_store.h"
#include "server/store/spool/journal.h"
#include "server/store/spool/spool_format.h"
#include "server/store/spool/spool_fs.h"
#include "server/store/store.h"

namespace kvrelay {

struct SpoolOptions {
  std::string dir;
  // --fsync=always (true) or never (false: for benchmarks; a power loss
  // loses what the kernel had not written).
  bool fsync = true;
  uint64_t max_spool_bytes = 0;  // 0: no limit but the disk's
  uint64_t compact_bytes = 64 << 20;
  // The body of the message files written (--wire-codec: rans codes them).
  // Files of either form are read whatever this says.
  MessageBody message_body = MessageBody::kPlain;
  // --spool-salvage: start on a journal damaged beyond a torn tail (see
  // Open) by keeping its intact records and moving every message file they
  // do not name to quarantine/, instead of refusing to start.
  bool salvage = false;
  // Tests only: the file layer (null: the real file system), and a negative
  // control that leaves out every directory sync.
  SpoolFs* fs = nullptr;
  bool sync_dir = true;
};

// What start-up found in the spool.
struct SpoolRecovery {
  double seconds = 0, crc_seconds = 0;
  uint64_t messages = 0, sessions = 0, closed = 0, outbox = 0;
  uint64_t bytes = 0;        // message files and journal
  uint64_t orphans = 0;      // files removed: temporaries, never committed, or of freed sessions
  // Message files no intact journal record names, found when the journal
  // was damaged, salvaged or missing: their commit may have been
  // acknowledged, so they were moved to quarantine/ unchanged, not removed.
  uint64_t unproven = 0;
  bool salvaged = false;     // the journal's damage was salvaged (SpoolOptions::salvage)
  uint64_t quarantined = 0;  // message files whose check failed (moved to quarantine/)
  uint64_t missing = 0;      // messages the journal names whose file is gone
  uint64_t torn_bytes = 0;   // cut off the journal's end
  std::string torn_why;
};

struct SpoolReplay;  // the journal replayed (spool_store.cc)

class SpoolStore final : public Store {
 public:
  // Opens (creating it when missing) and recovers the spool in
  // options.dir. FAILED_PRECONDITION when another process holds it or it
  // has a format version this relay does not know (nothing is changed);
  // the I/O error otherwise. `metrics` may be null and must outlive the store.
  //
  // A CRC-valid message file whose commit may have been acknowledged is
  // never removed. A torn journal tail (damage after which no intact record
  // follows) is cut off; if it was more than one record cut short by the end
  // of the file, the message files no intact record names go to quarantine/
  // rather than being removed as never committed. A journal damaged in the
  // middle (an intact record after the damaged one), one whose header is
  // not a journal's, or a missing journal while msg/ holds message files is
  // FAILED_PRECONDITION with nothing changed, naming --spool-salvage; with
  // options.salvage the intact records are recovered and every message file
  // they do not name is moved to quarantine/ (SpoolRecovery::unproven).
  static absl::StatusOr<std::unique_ptr<SpoolStore>> Open(const StoreLimits& limits, const SpoolOptions& options,
                                                          Metrics* metrics, TimeSource* time = TimeSource::Real());
  ~SpoolStore() override;

  const SpoolRecovery& recovery() const { return recovery_; }

  // A forward to resume after a restart: `agents` of `msg` on relay
  // `target` had no answer from it yet.
  struct PendingForward {
    MessagePtr msg;
    std::string target;
    std::vector<std::string> agents;
  };
  // The outbox as recovered (the same list every call).
  const std::vector<PendingForward>& RecoveredOutbox() const { return outbox_; }

  // Called once, on the journal's thread, when the spool stops taking
  // writes. REQUIRES: set before the store is used.
  void SetOnFailure(std::function<void(const absl::Status&)> fn) { on_failure_ = std::move(fn); }
  // OK, or why the spool takes no more writes.
  absl::Status health() const;

  absl::Status ReserveInflight(uint64_t bytes, absl::string_view what) override {
    return mem_->ReserveInflight(bytes, what);
  }
  void AddInflight(uint64_t bytes) override { mem_->AddInflight(bytes); }
  void ReleaseInflight(uint64_t bytes) override { mem_->ReleaseInflight(bytes); }
  MessagePtr Find(const std::string& session, const std::string& message_id) const override {
    return mem_->Find(session, message_id);
  }
  absl::StatusOr<MessagePtr> LookupParent(const std::string& session, const std::string& parent_id,
                                          const std::string& sender) const override {
    return mem_->LookupParent(session, parent_id, sender);
  }
  absl::Status CheckCanPublish(const std::string& session, const std::vector<std::string>& recipients,
                               uint64_t bytes) const override;
  PublishTicket BeginPublish(const std::string& session) override { return mem_->BeginPublish(session); }
  void EndPublish(const PublishTicket& t) override { mem_->EndPublish(t); }
  absl::StatusOr<CommitResult> Commit(std::shared_ptr<StoredMessage> m, const PublishTicket& t) override;
  std::optional<Delivery> FetchOrWait(const std::string& session, const std::string& agent,
                                      Clock::time_point deadline, WakeFn wake, uint64_t* waiter) override {
    return mem_->FetchOrWait(session, agent, deadline, std::move(wake), waiter);
  }
  bool MarkDelivered(const std::string& session, const std::string& agent, const std::string& message_id) override;
  void BeforeDelivered(const std::string& session, const std::string& agent, const std::string& message_id,
                       std::function<void(const absl::Status&)> ready) override;
  bool CancelWaiter(uint64_t waiter) override { return mem_->CancelWaiter(waiter); }
  absl::Status Ack(const std::string& session, const std::string& agent, const std::string& message_id) override;
  void AckAsync(const std::string& session, const std::string& agent, const std::string& message_id,
                std::function<void(const absl::Status&)> done) override;
  uint32_t CloseSession(const std::string& session) override { return CloseSessionAndPeers(session).messages_freed; }
  void Shutdown() override { mem_->Shutdown(); }
  bool shutting_down() const override { return mem_->shutting_down(); }
  void SweepExpired() override { mem_->SweepExpired(); }
  void AddReceived(uint64_t bytes) override { mem_->AddReceived(bytes); }
  void AddFailed() override { mem_->AddFailed(); }
  StoreStats Stats() const override { return mem_->Stats(); }
  absl::StatusOr<ForwardCommitResult> CommitForward(std::shared_ptr<StoredMessage> m,
                                                    const std::vector<std::string>& recipients,
                                                    const PublishTicket& t) override;
  bool IsClosed(const std::string& session) const override { return mem_->IsClosed(session); }
  CloseResult CloseSessionAndPeers(const std::string& session) override;
  void CloseSessionAndPeersAsync(const std::string& session, std::function<void(CloseResult)> done) override;
  absl::Status ReserveOutbox(const std::string& target, uint64_t bytes) override {
    return mem_->ReserveOutbox(target, bytes);
  }
  void ReleaseOutbox(const std::string& target, uint64_t bytes) override { mem_->ReleaseOutbox(target, bytes); }
  void TrackRecipient(const std::string& session, const std::string& message_id, const std::string& agent,
                      const RecipientTrack& track) override;
  absl::StatusOr<MessageReport> MessageStatus(const std::string& session,
                                              const std::string& message_id) const override {
    return mem_->MessageStatus(session, message_id);
  }
  bool AddPeer(const std::string& session, const std::string& target) override;
  void NotePeerHolds(const std::string& session, const std::string& message_id, const std::string& target) override;
  bool PeerHolds(const std::string& session, const std::string& message_id,
                 const std::string& target) const override {
    return mem_->PeerHolds(session, message_id, target);
  }
  bool IsParticipant(const std::string& session, const std::string& agent) const override {
    return mem_->IsParticipant(session, agent);
  }
  std::vector<std::string> Peers(const std::string& session) const override { return mem_->Peers(session); }

 private:
  SpoolStore(const StoreLimits& limits, const SpoolOptions& options, Metrics* metrics, TimeSource* time);
  // Opens the spool: takes its lock, replays the journal, loads the
  // message files it committed, and restores the store from them.
  absl::Status Recover();
  // Recover's steps, in order.
  absl::Status OpenDirectories();
  // Opens (or repairs, or salvages) the journal; its intact records.
  absl::StatusOr<std::vector<spool::v1::Record>> OpenJournal();
  // Loads the message files `model` names into `state` (dropping from
  // `model` those missing or damaged, which are counted and quarantined)
  // and removes every other file.
  absl::Status LoadMessageFiles(SpoolReplay* model, MemoryStore::State* state);
  // The sequence numbers of the message files present that `wanted` holds;
  // removes temporary files and those of no wanted message (orphans).
  absl::StatusOr<std::set<uint64_t>> SweepMessageDir(
      const std::map<uint64_t, std::pair<std::string, std::string>>& wanted, SpoolReplay* model);
  // Message file `seq`, which the journal says holds `session`/`id`, and its
  // size in `*size`. nullopt when it is damaged or holds another message: it
  // is then quarantined. An error (a newer format) refuses to start.
  absl::StatusOr<std::optional<SpoolMessage>> ReadMessageFile(uint64_t seq, const std::string& session,
                                                              const std::string& id, uint64_t* size);
  // Tracks, peers and the outbox of the sessions in `state`.
  void RestoreSessions(const SpoolReplay& model, MemoryStore::State* state);
  // Logs recovery_ and sets its metrics.
  void ReportRecovery();
  // Moves every message file that no commit in `intact` names to
  // quarantine/ (under a name not taken there) and syncs both folders: the
  // journal is about to lose records that may have committed them.
  absl::Status QuarantineUnproven(const std::vector<spool::v1::Record>& intact);
  // Writes `m`'s file under its temporary name and syncs it; returns its seq.
  absl::StatusOr<uint64_t> WriteTemp(const StoredMessage& m);
  // Renames the temporary file into place and syncs the directory.
  absl::Status Publish(uint64_t seq);
  void RemoveMessageFile(uint64_t seq, bool temp);
  // Records the commit (in the journal's queue) at the instant it takes
  // effect, and sets *durable to say when the record is durable.
  MemoryStore::CommitHook CommitHook(std::shared_ptr<std::promise<absl::Status>>* durable);
  // Queues `r`; the future says when it is durable.
  std::shared_ptr<std::promise<absl::Status>> Durable(spool::v1::Record r);
  absl::Status Writable() const;
  std::vector<spool::v1::Record> Snapshot() const;
  // The message files of `session`, no longer counted as its; removed by
  // RemoveMessageFiles once the record that freed the session is durable.
  std::set<uint64_t> TakeSessionFiles(const std::string& session);
  void RemoveMessageFiles(const std::set<uint64_t>& seqs);
  void AddSpoolBytes(int64_t delta);  // to the message files' bytes
  // The message files and the journal, as --max-spool-bytes counts them.
  uint64_t SpoolBytes() const;
  // RESOURCE_EXHAUSTED naming --max-spool-bytes when `bytes` more would not
  // fit (`what` says whose bytes they are).
  absl::Status CheckSpoolRoom(uint64_t bytes, absl::string_view what) const;
  absl::Status SyncTimed(SpoolFile* f);
  std::string MessagePath(uint64_t seq, bool temp) const;

  const SpoolOptions options_;
  // The most tensor bytes a coded message file may decode to: the store's
  // --max-store-bytes (no larger message fits in it).
  const uint64_t max_message_bytes_;
  SpoolFs* const fs_;
  Metrics* const metrics_;
  const std::string msg_dir_;
  std::unique_ptr<MemoryStore> mem_;
  std::unique_ptr<Journal> journal_;
  // Removes the files of closed and expired sessions once their record is
  // durable, off the journal's writer thread (whose next batch would
  // otherwise wait on the unlinks). Destroyed after the journal, whose
  // callbacks queue work here.
  std::unique_ptr<ThreadPool> deleter_ = std::make_unique<ThreadPool>(1);
  int lock_fd_ = -1;
  SpoolRecovery recovery_;
  std::vector<PendingForward> outbox_;
  std::function<void(const absl::Status&)> on_failure_;

  // Orders commits, forward commits and closes: their records reach the
  // journal in the order they took effect in memory.
  Mutex commit_mu_;
  std::atomic<uint64_t> next_seq_{1};
  std::atomic<int64_t> file_bytes_total_{0};  // the message files' bytes
  mutable Mutex files_mu_;
  std::map<std::string, std::set<uint64_t>> files_ ABSL_GUARDED_BY(files_mu_);  // session -> its message files
  std::map<uint64_t, uint64_t> file_bytes_ ABSL_GUARDED_BY(files_mu_);          // seq -> size
  std::atomic<bool> failed_{false};
  absl::Status dir_failure_ ABSL_GUARDED_BY(files_mu_);  // a failed directory sync
};

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_STORE_SPOOL_STORE_H_
