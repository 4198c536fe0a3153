// The Store that holds everything in memory (server/store/store.h has the
// contract): nothing survives a restart. One lock guards the sessions and
// waiters; in-flight bytes are an atomic counter. Its timer thread sweeps
// expired sessions a few times per TTL (10 ms .. 1 s) and fires waiter
// deadlines.
#ifndef KVRELAY_SERVER_STORE_MEMORY_STORE_H_
#define KVRELAY_SERVER_STORE_MEMORY_STORE_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "core/mutex.h"
#include "core/time_source.h"
#include "server/store/store.h"

namespace kvrelay {

class Metrics;

class MemoryStore final : public Store {
 public:
  // `metrics` may be null; it must outlive the store. Sessions' TTL, their
  // sweeps and waiters' deadlines are in `time`'s time (not owned; outlives
  // the store).
  MemoryStore(const StoreLimits& limits, Metrics* metrics, TimeSource* time = TimeSource::Real());
  ~MemoryStore() override;  // stops the timer; pending waiters are dropped without a call

  absl::Status ReserveInflight(uint64_t bytes, absl::string_view what) override;
  void AddInflight(uint64_t bytes) override;
  void ReleaseInflight(uint64_t bytes) override;
  MessagePtr Find(const std::string& session, const std::string& message_id) const override;
  absl::StatusOr<MessagePtr> LookupParent(const std::string& session, const std::string& parent_id,
                                          const std::string& sender) const override;
  absl::Status CheckCanPublish(const std::string& session, const std::vector<std::string>& recipients,
                               uint64_t bytes) const override;
  PublishTicket BeginPublish(const std::string& session) override;
  void EndPublish(const PublishTicket& t) override;
  absl::StatusOr<CommitResult> Commit(std::shared_ptr<StoredMessage> m, const PublishTicket& t) override;
  std::optional<Delivery> FetchOrWait(const std::string& session, const std::string& agent,
                                      Clock::time_point deadline, WakeFn wake, uint64_t* waiter) override;
  bool MarkDelivered(const std::string& session, const std::string& agent, const std::string& message_id) override;
  bool CancelWaiter(uint64_t waiter) override;
  absl::Status Ack(const std::string& session, const std::string& agent, const std::string& message_id) override;
  uint32_t CloseSession(const std::string& session) override;
  void Shutdown() override;
  bool shutting_down() const override;
  void SweepExpired() override;
  void AddReceived(uint64_t bytes) override { received_ += bytes; }
  void AddFailed() override { ++failed_; }
  StoreStats Stats() const override;

  absl::StatusOr<ForwardCommitResult> CommitForward(std::shared_ptr<StoredMessage> m,
                                                    const std::vector<std::string>& recipients,
                                                    const PublishTicket& t) override;
  bool IsClosed(const std::string& session) const override;
  CloseResult CloseSessionAndPeers(const std::string& session) override;
  absl::Status ReserveOutbox(const std::string& target, uint64_t bytes) override;
  void ReleaseOutbox(const std::string& target, uint64_t bytes) override;
  void TrackRecipient(const std::string& session, const std::string& message_id, const std::string& agent,
                      const RecipientTrack& track) override;
  absl::StatusOr<MessageReport> MessageStatus(const std::string& session,
                                              const std::string& message_id) const override;
  bool AddPeer(const std::string& session, const std::string& target) override;
  void NotePeerHolds(const std::string& session, const std::string& message_id, const std::string& target) override;
  bool PeerHolds(const std::string& session, const std::string& message_id, const std::string& target) const override;
  bool IsParticipant(const std::string& session, const std::string& agent) const override;
  std::vector<std::string> Peers(const std::string& session) const override;

  // ---- The durable state, for SpoolStore (server/store/spool_store.h) ----

  // Called under the store's lock at the instant a commit takes effect,
  // before anyone can see it: the message, and the agents it entered the
  // mailboxes of (for a forward of a message held already, those added).
  // Must not block or call the store.
  using CommitHook = std::function<void(const MessagePtr& msg, const std::vector<std::string>& agents)>;
  // Commit and CommitForward with `hook` (not called when nothing was
  // committed: an error, or a duplicate that added no recipient).
  absl::StatusOr<CommitResult> CommitWithHook(std::shared_ptr<StoredMessage> m, const PublishTicket& t,
                                              const CommitHook& hook);
  absl::StatusOr<ForwardCommitResult> CommitForwardWithHook(std::shared_ptr<StoredMessage> m,
                                                            const std::vector<std::string>& recipients,
                                                            const PublishTicket& t, const CommitHook& hook);

  // One session as the spool records it.
  struct SessionState {
    struct Held {
      MessagePtr msg;
      std::set<std::string> local;      // agents with a mailbox entry for it here, ever
      std::set<std::string> delivered;  // of them and others: reached whole (may ack, may name it as parent)
      std::set<std::string> acked;      // of `local`: acked (no longer in the mailbox)
    };
    std::vector<Held> messages;  // in commit order (StoredMessage::spool_seq)
    std::map<std::string, std::map<std::string, RecipientTrack>> tracks;  // message_id -> remote agent
    std::set<std::string> peers;
    std::set<std::pair<std::string, std::string>> peer_holds;  // (message_id, relay)
  };
  struct State {
    std::map<std::string, SessionState> sessions;
    std::vector<std::string> closed;  // sessions closed here, still remembered
  };
  // The state, consistent under the store's lock. Waiters, publishes in
  // progress, in-flight bytes and counters are not part of it.
  State Export() const;
  // Loads `state` as it is, limits unchecked (they held when it was
  // recorded); sessions start a fresh TTL. REQUIRES: nothing was committed
  // or closed yet.
  void Restore(const State& state);
  // Called (under the store's lock: it must not block or call the store)
  // whenever a session is freed: closed (expired = false) or idle past the
  // TTL (expired = true). REQUIRES: set before the store is used.
  void SetEraseListener(std::function<void(const std::string& session, bool expired)> fn) {
    MutexLock lock(&mu_);
    erase_listener_ = std::move(fn);
  }

 private:
  struct Entry {
    MessagePtr msg;
    uint32_t attempts = 0;
  };
  struct Mailbox {
    std::deque<Entry> entries;  // unacked, oldest first
    uint64_t bytes = 0;
  };
  struct Session {
    std::map<std::string, MessagePtr> messages;
    std::map<std::string, Mailbox> mailboxes;
    std::set<std::pair<std::string, std::string>> delivered;  // (message_id, agent)
    uint64_t bytes = 0;  // every retained message
    Clock::time_point last_active;
    // Agents with a mailbox entry for a message (ever): its recipients here.
    std::map<std::string, std::set<std::string>> local;  // message_id -> agents
    std::map<std::string, std::map<std::string, RecipientTrack>> tracks;  // message_id -> remote agent
    std::set<std::string> peers;                                          // relays holding a part
    std::set<std::pair<std::string, std::string>> peer_holds;             // (message_id, relay)
  };
  struct Waiter {
    std::string session, agent;
    Clock::time_point deadline;
    WakeFn wake;
  };

  void TimerLoop();
  // Restarts the idle time of `session` if it exists. REQUIRES: mu_ held.
  void TouchLocked(const std::string& session) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseSessionLocked(std::map<std::string, Session>::iterator it, bool expired) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PublishGaugesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sets kvrelay_fetches_waiting to the waiters held; after every change of waiters_.
  void PublishWaitersLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes the waiters `take` accepts, appending their wakes to *wakes (to
  // be called after mu_ is released), and publishes the gauge when any went.
  void TakeWaitersLocked(absl::FunctionRef<bool(const Waiter&)> take, std::vector<WakeFn>* wakes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PublishInflight();
  absl::Status CheckBytesLocked(const std::string& session, const Session* s,
                                const std::vector<std::string>& recipients, uint64_t bytes,
                                absl::string_view what) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Clock::duration Ttl() const;
  // FAILED_PRECONDITION when the ticket's session was closed after it was
  // taken (`what`: "publish" or "forward"). REQUIRES: mu_ held.
  absl::Status CheckNotClosedSinceLocked(const PublishTicket& t, absl::string_view what) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Puts `msg` into `agent`'s mailbox and wakes its waiters into `wakes`.
  void AddToMailboxLocked(Session& s, const MessagePtr& msg, const std::string& agent, std::vector<WakeFn>* wakes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SweepClosedLocked(Clock::time_point now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const StoreLimits limits_;
  Metrics* const metrics_;
  TimeSource* const time_;
  mutable Mutex mu_;
  CondVar cv_;
  std::map<std::string, Session> sessions_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Waiter> waiters_ ABSL_GUARDED_BY(mu_);
  uint64_t next_waiter_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t mailbox_messages_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t mailbox_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t store_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t committed_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t acked_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t full_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t sent_ ABSL_GUARDED_BY(mu_) = 0;
  // Publish fencing. A session with publishes in progress has an entry:
  // their count and the sequence number of its last close meanwhile (0:
  // none); a ticket holds close_seq_ as it was when the publish began.
  struct Publishing {
    int in_progress = 0;
    uint64_t last_close = 0;
  };
  uint64_t close_seq_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, Publishing> publishing_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> inflight_{0}, received_{0}, failed_{0}, delivered_{0};
  Mutex gauge_mu_;  // orders in-flight gauge updates
  // Sessions closed here, remembered for the TTL (bounded: the oldest are
  // forgotten first past kMaxClosedSessions).
  std::map<std::string, Clock::time_point> closed_ ABSL_GUARDED_BY(mu_);
  std::deque<std::pair<Clock::time_point, std::string>> closed_order_ ABSL_GUARDED_BY(mu_);
  // The outbox: bytes reserved per destination and in all.
  std::map<std::string, uint64_t> outbox_bytes_ ABSL_GUARDED_BY(mu_);
  uint64_t outbox_total_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t outbox_messages_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  std::function<void(const std::string&, bool)> erase_listener_ ABSL_GUARDED_BY(mu_);
  std::thread timer_;
};

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_STORE_MEMORY_STORE_H_
