// The relay's store: sessions, committed messages, per-recipient mailboxes
// with acknowledgement state, and Fetch waiters. Store is the interface;
// MemoryStore (server/store/memory_store.h) holds everything in memory.
//
// A session holds its committed messages (kept until the session closes or
// expires, so that later publishes can name them as parents) and one
// mailbox per recipient agent: the deliveries not yet acknowledged, oldest
// first. Delivery is at least once: FetchOrWait hands out the oldest
// unacknowledged delivery every time until it is acked.
//
// A session expires when it has been idle (no commit, fetch or ack) for
// the TTL; a timer thread sweeps expired sessions and fires waiter
// deadlines. Limits fail with RESOURCE_EXHAUSTED, never grow the store:
// bytes in flight, unacked bytes per mailbox, messages per session, and the
// bytes of every retained message (acked ones too, kept as potential
// parents) per session and in the whole store.
//
// Thread-safe. Wake callbacks run on the committing thread or on the timer
// thread, never under the store's lock; they must not block.
#ifndef KVRELAY_SERVER_STORE_STORE_H_
#define KVRELAY_SERVER_STORE_STORE_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/message.h"

namespace kvrelay {

using Clock = std::chrono::steady_clock;

// Where a message is for one of its recipients. The values are the wire's
// (kvrelay.v1.RecipientState) and the spool's, and their order is the order
// of progress (MergeTrack); a dead letter is final.
enum class TrackState : int {
  kUnspecified = 0,  // a recipient here whose copy was dropped unread
  kQueued = 1,       // waiting in this relay's outbox
  kCommitted = 2,    // in the recipient's mailbox, here or at its relay
  kDelivered = 3,    // the recipient received it whole
  kAcked = 4,        // the recipient acknowledged it
  kDeadLettered = 5  // given up
};
// "queued", "dead_lettered", ...
const char* TrackStateName(TrackState s);

// A committed message. Immutable once committed (shared by every delivery).
struct StoredMessage {
  std::string session_id, message_id, sender, role, parent_id;
  std::vector<std::string> recipients;
  std::string requested_policy;  // header.policy as published ("": the role's default)
  // header.geometry as published, checked (proto/wire.h ToProto gives it
  // back field for field); none when a forward carried none.
  std::optional<TurnLayout> layout;
  Message msg;                // the composed message
  Accounting accounting;      // as returned by Publish (core/message.h)
  std::string family;         // PolicyFamily(policy), the metrics label
  uint64_t bytes = 0;         // bytes held against the limits: RetainedBytes(msg)
  Clock::time_point started;  // the publish's first request
  // Recipients whose mailbox is on another relay, with that relay's target:
  // the message is forwarded there. Every other recipient has its mailbox
  // here.
  std::map<std::string, std::string> remote;
  // Forwarded here by another relay (so never forwarded again), and that
  // relay's --advertise target ("" when it has none).
  bool forwarded = false;
  std::string origin;
  // The certificate identity (the SAN matching --peer-identity) of the
  // relay that forwarded it here over mTLS; "" otherwise.
  std::string forwarded_by;
  // Its file in the spool (server/store/spool_store.h): msg/<seq>.kvm; 0 in a
  // store without a spool.
  uint64_t spool_seq = 0;
};
using MessagePtr = std::shared_ptr<const StoredMessage>;

// Who may learn that a message exists (read its status, name it as a
// parent): its sender and its recipients.
bool MaySee(const StoredMessage& m, absl::string_view agent);

// The one answer to `agent` about message `message_id` of `session` when it
// may not see it (MaySee is false) or the message does not exist: the same
// code and words either way, so that no call tells an outsider whether an id
// exists. NOT_FOUND "FIELD: no message 'ID' visible to agent \"AGENT\" in
// session 'SESSION'".
absl::Status NotVisibleError(absl::string_view field, absl::string_view session, absl::string_view message_id,
                             absl::string_view agent);

// Bookkeeping a retained message holds beyond its tensors (ids, routing, the
// layer objects' headers), counted with them against the mailbox, session
// and store limits so that a message without tokens is not free.
constexpr uint64_t kMessageOverheadBytes = 1024;

// What a committed message holds against the limits: its tensor bytes
// (the sent bytes plus its acc, 4 bytes per token and head, which agents
// never receive) plus kMessageOverheadBytes plus kLayerOverheadBytes per
// layer.
uint64_t RetainedBytes(uint64_t tensor_bytes, uint64_t layers);
inline uint64_t RetainedBytes(const Message& msg) {
  uint64_t acc = 0;
  for (const MessageLayer& l : msg.layers) acc += 4 * static_cast<uint64_t>(l.acc.size());
  return RetainedBytes(msg.sent_bytes + acc, msg.layers.size());
}

struct StoreLimits {
  uint64_t max_inflight_bytes = 4ull << 30;
  uint64_t max_mailbox_bytes = 2ull << 30;  // per (session, agent)
  uint32_t max_session_messages = 1024;
  uint64_t max_session_bytes = 8ull << 30;  // retained messages of one session
  uint64_t max_store_bytes = 16ull << 30;   // retained messages, all sessions
  double session_ttl_seconds = 3600;
  uint64_t max_outbox_bytes = 4ull << 30;                  // messages waiting to be forwarded
  uint64_t max_outbox_bytes_per_destination = 1ull << 30;  // of them, to one relay
};

struct StoreStats {
  uint64_t committed = 0, failed = 0, delivered = 0, acked = 0;
  uint64_t received_bytes = 0, full_bytes = 0, sent_bytes = 0;
  uint64_t sessions = 0, mailbox_messages = 0, mailbox_bytes = 0, inflight_bytes = 0;
  uint64_t store_bytes = 0;  // every retained message, acked or not
  uint64_t fetch_waiters = 0;  // FetchOrWait calls waiting for a delivery now
};

// The outbox's part of the store: the bounds of what waits to be forwarded
// to other relays, and where each forwarded message is for each of its
// recipients there. Its clients: the forwarder, MessageStatus and
// ReportRecipient. Thread-safe.
// The committed messages by id: what the mesh reads of the mailboxes.
class MessageIndex {
 public:
  virtual ~MessageIndex() = default;
  // The committed message `message_id` of `session`, or null.
  virtual MessagePtr Find(const std::string& session, const std::string& message_id) const = 0;
};

class Outbox {
 public:
  virtual ~Outbox() = default;

  // The outbox's bounds: reserves `bytes` of messages waiting to be
  // forwarded to `target`. RESOURCE_EXHAUSTED naming
  // --max-outbox-bytes-per-destination or --max-outbox-bytes otherwise.
  [[nodiscard]] virtual absl::Status ReserveOutbox(const std::string& target, uint64_t bytes) = 0;
  // REQUIRES: `bytes` were reserved for `target`.
  virtual void ReleaseOutbox(const std::string& target, uint64_t bytes) = 0;

  // Records where a message published here is for one of its recipients on
  // another relay. A later state never goes back to an earlier one
  // (queued < committed < delivered < acked), and a dead letter is final.
  // A dead letter only replaces queued: once the destination committed the
  // message (or reported it delivered or acked), that state stays.
  struct RecipientTrack {
    TrackState state = TrackState::kQueued;
    std::string relay;   // the recipient's relay
    std::string reason;  // "CODE: message" of a dead letter or the last failed attempt
    uint32_t attempts = 0;
  };
  // Applies `next` to `*cur` by the rule above (what TrackRecipient does to
  // a recipient tracked already).
  static void MergeTrack(RecipientTrack* cur, const RecipientTrack& next);
  virtual void TrackRecipient(const std::string& session, const std::string& message_id, const std::string& agent,
                              const RecipientTrack& track) = 0;
  // Where message `message_id` is for each of its recipients, in the
  // publish's order: tracked for those on other relays, from the mailboxes
  // for those here. NOT_FOUND for an unknown session or message.
  struct RecipientReport {
    std::string agent;
    // UNSPECIFIED: a recipient here whose copy was dropped unread.
    TrackState state = TrackState::kUnspecified;
    std::string relay;   // its relay, for a recipient on another relay
    std::string reason;  // as RecipientTrack's
    uint32_t attempts = 0;
  };
  struct MessageReport {
    std::string sender;
    std::string forwarded_by;  // the relay it came from ("": published here)
    std::vector<RecipientReport> recipients;
  };
  virtual absl::StatusOr<MessageReport> MessageStatus(const std::string& session,
                                                      const std::string& message_id) const = 0;
};

// Which other relays hold a part of each session and which of its
// messages: CloseSession is passed on to them, and a message they hold is
// a base for ancestor elision. Its clients: the forwarder, the Forward
// call and CloseSession. Thread-safe.
class PeerBook {
 public:
  virtual ~PeerBook() = default;

  // Another relay holds a part of `session` (CloseSession is passed on to
  // it). False, recording nothing, when this relay holds no such session.
  virtual bool AddPeer(const std::string& session, const std::string& target) = 0;
  // Relay `target` holds message `message_id` of `session` (it was forwarded
  // there, or came from there): a base for ancestor elision.
  virtual void NotePeerHolds(const std::string& session, const std::string& message_id,
                             const std::string& target) = 0;
  virtual bool PeerHolds(const std::string& session, const std::string& message_id,
                         const std::string& target) const = 0;
  // Whether `agent` sent, or is a recipient of, a message of `session` held
  // here (who may close a session).
  virtual bool IsParticipant(const std::string& session, const std::string& agent) const = 0;
  // The relays of AddPeer for `session`: those holding a part of it and
  // those that forwarded a part of it here. Empty for an unknown session.
  virtual std::vector<std::string> Peers(const std::string& session) const = 0;
};

// The store's interface: sessions and their mailboxes here, with the
// outbox and the peer book of the mesh (above). Implementations:
// MemoryStore (server/store/memory_store.h) and SpoolStore
// (server/store/spool_store.h), which makes it durable.
class Store : public MessageIndex, public Outbox, public PeerBook {
 public:
  Store() = default;
  // Pending waiters are dropped without a call.
  virtual ~Store() = default;
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // Reserves upload memory. RESOURCE_EXHAUSTED past max_inflight_bytes; its
  // message starts with `what` (e.g. "upload of 5 tensor bytes + 1024
  // bookkeeping") followed by the total.
  [[nodiscard]] virtual absl::Status ReserveInflight(uint64_t bytes, absl::string_view what = "upload") = 0;
  // Counts memory that is already held (e.g. a reply being streamed) in
  // flight, whatever the limit. Undo with ReleaseInflight.
  virtual void AddInflight(uint64_t bytes) = 0;
  virtual void ReleaseInflight(uint64_t bytes) = 0;


  // The parent named by a publish of `sender`: a message of `session` that
  // was delivered to `sender`. NotVisibleError (NOT_FOUND) when there is no
  // such message or `sender` may not see it (MaySee); FAILED_PRECONDITION
  // when it may, but the message was not delivered to it (yet).
  virtual absl::StatusOr<MessagePtr> LookupParent(const std::string& session, const std::string& parent_id,
                                                  const std::string& sender) const = 0;

  // Early limit check for a publish about to start whose message will hold
  // at least `bytes`: RESOURCE_EXHAUSTED when the session is full, or
  // `bytes` more would not fit a recipient's mailbox, the session's or the
  // store's byte limit.
  virtual absl::Status CheckCanPublish(const std::string& session, const std::vector<std::string>& recipients,
                                       uint64_t bytes = 0) const = 0;

  // A publish in progress on `session`, from its header until EndPublish:
  // the session does not expire meanwhile, and a CloseSession in between
  // fences it (Commit fails). Copyable token; pass it back unchanged.
  struct PublishTicket {
    std::string session;
    uint64_t close_seq = 0;  // closes before the publish began
  };
  virtual PublishTicket BeginPublish(const std::string& session) = 0;
  // REQUIRES: `t` came from BeginPublish and is ended once.
  virtual void EndPublish(const PublishTicket& t) = 0;

  // Makes `m` visible to its recipients, atomically. When the id is
  // already committed returns the existing message and duplicate = true.
  // RESOURCE_EXHAUSTED for the session and mailbox limits;
  // FAILED_PRECONDITION when the session was closed after `t` began.
  // REQUIRES: t.session == m->session_id.
  struct CommitResult {
    MessagePtr msg;
    bool duplicate = false;
  };
  virtual absl::StatusOr<CommitResult> Commit(std::shared_ptr<StoredMessage> m, const PublishTicket& t) = 0;

  struct Delivery {
    MessagePtr msg;
    uint32_t attempt = 0;  // 1 on the first delivery
  };
  // Why a waiter was woken.
  enum class Wake {
    kMessage,   // a message for (session, agent) was committed: call FetchOrWait again
    kTimeout,   // the deadline passed
    kClosed,    // CloseSession closed the session
    kShutdown,  // the relay is shutting down (Shutdown)
  };
  // Called once.
  using WakeFn = std::function<void(Wake why)>;
  // Hands out the oldest unacknowledged delivery for (session, agent). If
  // there is none, registers `wake` and sets *waiter (for CancelWaiter);
  // after Shutdown it registers nothing and sets *waiter to 0 instead. The
  // message counts as delivered (for Ack and as a parent) only once the
  // caller reports the whole stream written (MarkDelivered).
  virtual std::optional<Delivery> FetchOrWait(const std::string& session, const std::string& agent,
                                              Clock::time_point deadline, WakeFn wake, uint64_t* waiter) = 0;
  // Records that `message_id` reached `agent` whole (the delivery's trailer
  // was written): from now on `agent` may ack it and publish with it as
  // parent. Counts a delivery. True if it is the first complete delivery of
  // that message to that agent. No effect (false) on a session closed
  // meanwhile.
  virtual bool MarkDelivered(const std::string& session, const std::string& agent,
                             const std::string& message_id) = 0;
  // Called before the last write of a delivery (its trailer): `ready` runs
  // once (maybe on another thread, must not block) when the trailer may go.
  // A durable store records the delivery first, so that an agent that got
  // the whole message may ack it after a restart; an error (the spool takes
  // no writes) fails the delivery.
  virtual void BeforeDelivered(const std::string& session, const std::string& agent, const std::string& message_id,
                               std::function<void(const absl::Status&)> ready) {
    ready(absl::OkStatus());
  }

  // Unregisters a waiter. True if it was still registered: its wake will
  // never run. False if it already ran or is running.
  virtual bool CancelWaiter(uint64_t waiter) = 0;

  // Removes `message_id` from `agent`'s mailbox. OK when already acked.
  // NOT_FOUND when the session is unknown, and NotVisibleError (NOT_FOUND,
  // the same words for both) when the message is unknown or `agent` is not
  // one of its recipients here; FAILED_PRECONDITION when it was never delivered
  // to `agent` (an ack cannot skip a message unseen).
  virtual absl::Status Ack(const std::string& session, const std::string& agent,
                           const std::string& message_id) = 0;
  // Ack, answered through `done` (called once, maybe on another thread,
  // must not block): a store that makes the ack durable answers once it is,
  // without blocking the caller meanwhile.
  virtual void AckAsync(const std::string& session, const std::string& agent, const std::string& message_id,
                        std::function<void(const absl::Status&)> done) {
    done(Ack(session, agent, message_id));
  }

  // Frees the session and wakes its waiters (Wake::kClosed); returns the
  // number of messages it held. Publishes of the session in progress
  // (between BeginPublish and EndPublish) fail at Commit. Idempotent.
  virtual uint32_t CloseSession(const std::string& session) = 0;

  // Wakes every waiter (Wake::kShutdown); later FetchOrWait calls never
  // wait. Deliveries already held can still be fetched. Idempotent.
  virtual void Shutdown() = 0;
  // Whether Shutdown was called.
  virtual bool shutting_down() const = 0;

  // Drops sessions idle past the TTL (also runs on the timer thread), but
  // none with a publish in progress or a Fetch waiting on it (waiting is
  // activity: the session's idle time restarts when the waiter leaves).
  virtual void SweepExpired() = 0;

  // Counted in Stats(): bytes received by uploads, and failed publishes.
  virtual void AddReceived(uint64_t bytes) = 0;
  virtual void AddFailed() = 0;

  virtual StoreStats Stats() const = 0;

  // ---- The mesh: forwarded messages, the outbox, where messages are ----

  // One recipient's answer of CommitForward.
  struct RecipientResult {
    std::string agent;
    absl::Status status;     // OK, or RESOURCE_EXHAUSTED for its full mailbox
    bool duplicate = false;  // its mailbox here held the message already
  };
  struct ForwardCommitResult {
    MessagePtr msg;          // the message as held (the earlier one for a duplicate)
    bool duplicate = false;  // the id was held already
    std::vector<RecipientResult> recipients;  // in the order given
  };
  // Commits a message forwarded by another relay into the mailboxes of
  // `recipients` here, idempotently: when the id is held already, it goes
  // into the mailboxes that do not hold it yet (the caller has checked that
  // the headers match). Per recipient: OK, duplicate, or RESOURCE_EXHAUSTED
  // when its mailbox is full. The session's message and byte limits and the
  // store's fail the whole call (RESOURCE_EXHAUSTED); a close after `t`
  // began fails it with FAILED_PRECONDITION. The message's origin relay
  // becomes a peer of the session holding it (AddPeer, NotePeerHolds) in
  // the same step, before any recipient can fetch it.
  virtual absl::StatusOr<ForwardCommitResult> CommitForward(std::shared_ptr<StoredMessage> m,
                                                            const std::vector<std::string>& recipients,
                                                            const PublishTicket& t) = 0;

  // Whether `session` was closed here (CloseSession) within the session
  // TTL; forwards of it are then refused. A publish here reopens it.
  virtual bool IsClosed(const std::string& session) const = 0;

  // What CloseSession did.
  struct CloseResult {
    // OK, or why the close did not take effect (a spool that takes no more
    // writes: UNAVAILABLE).
    absl::Status status;
    uint32_t messages_freed = 0;
    bool first = false;              // the session was not closed here already
    std::vector<std::string> peers;  // relays that hold a part of it (AddPeer)
  };
  // Frees the session like CloseSession and remembers it as closed for the
  // session TTL (IsClosed).
  virtual CloseResult CloseSessionAndPeers(const std::string& session) = 0;
  // CloseSessionAndPeers, answered through `done` (called once, maybe on
  // another thread, never with a lock of the store held; must not block): a
  // store that makes the close durable answers once it is, without blocking
  // the caller meanwhile.
  virtual void CloseSessionAndPeersAsync(const std::string& session, std::function<void(CloseResult)> done) {
    done(CloseSessionAndPeers(session));
  }

  uint64_t inflight_bytes() const { return Stats().inflight_bytes; }
  uint64_t store_bytes() const { return Stats().store_bytes; }
};

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_STORE_STORE_H_
