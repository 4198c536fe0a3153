// MemoryStore's mesh part, driven through the Store interface: forwarded
// commits (idempotent, per recipient, fenced by closes), closed sessions,
// the outbox's bounds, where a message is per recipient, and which peers
// hold what.
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "server/store/memory_store.h"
#include "tests/server/store/store_test_util.h"

namespace kvrelay {
namespace {

using namespace kvrelay::testing;

std::shared_ptr<StoredMessage> Forwarded(const std::string& session, const std::string& id,
                                         std::vector<std::string> to, uint64_t bytes = 100) {
  auto m = Msg(session, id, std::move(to), bytes);
  m->forwarded = true;
  m->origin = "origin:1";
  return m;
}

absl::StatusOr<Store::ForwardCommitResult> CommitForward(Store& s, std::shared_ptr<StoredMessage> m) {
  const std::vector<std::string> to = m->recipients;
  const Store::PublishTicket t = s.BeginPublish(m->session_id);
  absl::StatusOr<Store::ForwardCommitResult> r = s.CommitForward(std::move(m), to, t);
  s.EndPublish(t);
  return r;
}

// The mailbox of (session, agent) in order, each delivery marked delivered
// and acked (so the next one comes up).
std::vector<std::string> Drain(Store& s, const std::string& session, const std::string& agent) {
  std::vector<std::string> ids;
  while (std::optional<Store::Delivery> d = TryFetch(s, session, agent)) {
    ids.push_back(d->msg->message_id);
    EXPECT_TRUE(s.Ack(session, agent, d->msg->message_id).ok());
  }
  return ids;
}

TEST(MeshStoreTest, CommitForwardOfANewMessageFillsEachMailbox) {
  MemoryStore impl(StoreLimits{}, nullptr);
  Store& s = impl;
  auto r = CommitForward(s, Forwarded("s", "m1", {"b", "c"}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->duplicate);
  ASSERT_EQ(r->recipients.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(r->recipients[i].agent, i == 0 ? "b" : "c");
    EXPECT_TRUE(r->recipients[i].status.ok()) << r->recipients[i].status;
    EXPECT_FALSE(r->recipients[i].duplicate);
  }
  ASSERT_TRUE(r->msg);
  EXPECT_TRUE(r->msg->forwarded);
  EXPECT_EQ(s.Find("s", "m1"), r->msg);
  EXPECT_EQ(s.Stats().mailbox_messages, 2u);
  EXPECT_EQ(s.Stats().store_bytes, 100u);  // held once, however many mailboxes
  EXPECT_EQ(Drain(s, "s", "b"), std::vector<std::string>{"m1"});
  EXPECT_EQ(Drain(s, "s", "c"), std::vector<std::string>{"m1"});
}

// The same id again is a duplicate for the recipients holding it and goes
// into the mailboxes of the others; the message held is the first one.
TEST(MeshStoreTest, CommitForwardIsIdempotentPerRecipient) {
  MemoryStore impl(StoreLimits{}, nullptr);
  Store& s = impl;
  ASSERT_TRUE(CommitForward(s, Forwarded("s", "m1", {"b"}, 100)).ok());
  auto again = CommitForward(s, Forwarded("s", "m1", {"b", "c"}, 999));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->duplicate);
  EXPECT_EQ(again->msg->bytes, 100u);
  ASSERT_EQ(again->recipients.size(), 2u);
  EXPECT_EQ(again->recipients[0].agent, "b");
  EXPECT_TRUE(again->recipients[0].status.ok());
  EXPECT_TRUE(again->recipients[0].duplicate);
  EXPECT_EQ(again->recipients[1].agent, "c");
  EXPECT_TRUE(again->recipients[1].status.ok());
  EXPECT_FALSE(again->recipients[1].duplicate);
  EXPECT_EQ(s.Stats().mailbox_messages, 2u);
  EXPECT_EQ(s.Stats().store_bytes, 100u);
  // A duplicate stays a duplicate after the ack: no second delivery.
  EXPECT_EQ(Drain(s, "s", "b"), std::vector<std::string>{"m1"});
  auto third = CommitForward(s, Forwarded("s", "m1", {"b", "c"}));
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_TRUE(third->recipients[0].duplicate);
  EXPECT_TRUE(third->recipients[1].duplicate);
  EXPECT_EQ(Drain(s, "s", "b"), std::vector<std::string>{});
  EXPECT_EQ(Drain(s, "s", "c"), std::vector<std::string>{"m1"});
}

TEST(MeshStoreTest, AFullMailboxRefusesOnlyItsRecipient) {
  StoreLimits lim;
  lim.max_mailbox_bytes = 150;
  MemoryStore impl(lim, nullptr);
  Store& s = impl;
  ASSERT_TRUE(CommitForward(s, Forwarded("s", "m1", {"b"})).ok());
  auto r = CommitForward(s, Forwarded("s", "m2", {"b", "c"}));
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->recipients.size(), 2u);
  EXPECT_EQ(r->recipients[0].agent, "b");
  EXPECT_EQ(r->recipients[0].status.code(), absl::StatusCode::kResourceExhausted) << r->recipients[0].status;
  EXPECT_TRUE(absl::StrContains(r->recipients[0].status.message(), "mailbox of 'b' in session 's'"))
      << r->recipients[0].status;
  EXPECT_TRUE(absl::StrContains(r->recipients[0].status.message(), "--max-mailbox-bytes=150"))
      << r->recipients[0].status;
  EXPECT_TRUE(r->recipients[1].status.ok()) << r->recipients[1].status;
  EXPECT_EQ(Drain(s, "s", "c"), std::vector<std::string>{"m2"});
  // Once b has room, a retry of the same forward puts it there.
  EXPECT_EQ(Drain(s, "s", "b"), std::vector<std::string>{"m1"});
  auto retry = CommitForward(s, Forwarded("s", "m2", {"b"}));
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_TRUE(retry->duplicate);
  EXPECT_TRUE(retry->recipients[0].status.ok()) << retry->recipients[0].status;
  EXPECT_FALSE(retry->recipients[0].duplicate);
  EXPECT_EQ(Drain(s, "s", "b"), std::vector<std::string>{"m2"});
}

TEST(MeshStoreTest, SessionLimitsFailTheWholeForward) {
  StoreLimits lim;
  lim.max_session_messages = 1;
  MemoryStore impl(lim, nullptr);
  Store& s = impl;
  ASSERT_TRUE(CommitForward(s, Forwarded("s", "m1", {"b"})).ok());
  auto r = CommitForward(s, Forwarded("s", "m2", {"b"}));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "--max-session-messages=1")) << r.status();
  EXPECT_FALSE(s.Find("s", "m2"));
  // The held id is still answered (a retry of a forward that committed).
  EXPECT_TRUE(CommitForward(s, Forwarded("s", "m1", {"c"})).ok());
}

TEST(MeshStoreTest, AForwardOfASessionClosedHereIsRefused) {
  MemoryStore impl(StoreLimits{}, nullptr);
  Store& s = impl;
  ASSERT_TRUE(CommitForward(s, Forwarded("s", "m1", {"b"})).ok());
  s.CloseSessionAndPeers("s");
  auto r = CommitForward(s, Forwarded("s", "m2", {"b"}));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "session 's': closed on this relay")) << r.status();
  // Not even the id it held before the close comes back.
  r = CommitForward(s, Forwarded("s", "m1", {"b"}));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_EQ(s.Stats().sessions, 0u);
  EXPECT_FALSE(s.Find("s", "m1"));
  EXPECT_FALSE(s.Find("s", "m2"));
}

TEST(MeshStoreTest, ACloseDuringAForwardFencesIt) {
  MemoryStore impl(StoreLimits{}, nullptr);
  Store& s = impl;
  const Store::PublishTicket t = s.BeginPublish("s");
  s.CloseSessionAndPeers("s");
  auto r = s.CommitForward(Forwarded("s", "m1", {"b"}), {"b"}, t);
  s.EndPublish(t);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "session 's': closed while this forward was in progress"))
      << r.status();
  EXPECT_EQ(s.Stats().sessions, 0u);
  EXPECT_EQ(s.Stats().mailbox_messages, 0u);
}

TEST(MeshStoreTest, CloseIsFirstOnceAndReturnsThePeers) {
  MemoryStore impl(StoreLimits{}, nullptr);
  Store& s = impl;
  EXPECT_FALSE(s.IsClosed("s"));
  ASSERT_TRUE(Commit(s, Msg("s", "m1", {"b"})).ok());
  s.AddPeer("s", "relay-b:1");
  s.NotePeerHolds("s", "m1", "relay-c:1");  // a peer holding a message is a peer
  s.AddPeer("s", "relay-b:1");
  s.AddPeer("nosuch", "relay-x:1");  // no session: nothing to remember
  Store::CloseResult c = s.CloseSessionAndPeers("s");
  EXPECT_TRUE(c.first);
  EXPECT_EQ(c.messages_freed, 1u);
  EXPECT_EQ(c.peers, (std::vector<std::string>{"relay-b:1", "relay-c:1"}));
  EXPECT_TRUE(s.IsClosed("s"));
  EXPECT_FALSE(s.IsClosed("t"));

  Store::CloseResult again = s.CloseSessionAndPeers("s");
  EXPECT_FALSE(again.first);
  EXPECT_EQ(again.messages_freed, 0u);
  EXPECT_TRUE(again.peers.empty());

  // A session never seen here is closed too (a propagated close may come
  // before any forward), and only once.
  EXPECT_TRUE(s.CloseSessionAndPeers("never").first);
  EXPECT_FALSE(s.CloseSessionAndPeers("never").first);
  EXPECT_TRUE(s.IsClosed("never"));
  Store::CloseResult none = s.CloseSessionAndPeers("nosuch");
  EXPECT_TRUE(none.peers.empty());
}

TEST(MeshStoreTest, APublishHereReopensAClosedSession) {
  MemoryStore impl(StoreLimits{}, nullptr);
  Store& s = impl;
  s.CloseSessionAndPeers("s");
  ASSERT_TRUE(s.IsClosed("s"));
  ASSERT_TRUE(Commit(s, Msg("s", "m1", {"b"})).ok());
  EXPECT_FALSE(s.IsClosed("s"));
  EXPECT_TRUE(CommitForward(s, Forwarded("s", "m2", {"b"})).ok());
  EXPECT_EQ(Drain(s, "s", "b"), (std::vector<std::string>{"m1", "m2"}));
  EXPECT_TRUE(s.CloseSessionAndPeers("s").first) << "reopened, so this close is a first one again";
}

// The store's timer forgets a closed session once the TTL has passed, and
// not before: on a fake clock, each Tick a sweep (every TTL / 4).
TEST(MeshStoreTest, ClosedSessionsAreForgottenAfterTheTtl) {
  FakeTimeSource clock;
  StoreLimits lim;
  lim.session_ttl_seconds = 0.1;
  MemoryStore impl(lim, nullptr, &clock);
  Store& s = impl;
  s.CloseSessionAndPeers("s");
  ASSERT_TRUE(s.IsClosed("s"));
  const uint64_t waits = clock.waits();
  for (int i = 0; i < 3; ++i) Tick(&clock, std::chrono::milliseconds(25));
  EXPECT_GE(clock.waits(), waits + 3) << "the timer did not run a sweep per tick";
  EXPECT_TRUE(s.IsClosed("s")) << "forgotten after 75 ms of a 100 ms TTL";
  for (int i = 0; i < 2; ++i) Tick(&clock, std::chrono::milliseconds(25));
  EXPECT_FALSE(s.IsClosed("s")) << "still closed after 125 ms of a 100 ms TTL";
  EXPECT_TRUE(CommitForward(s, Forwarded("s", "m1", {"b"})).ok());
}

TEST(MeshStoreTest, OutboxBoundsPerDestinationAndInAll) {
  StoreLimits lim;
  lim.max_outbox_bytes = 250;
  lim.max_outbox_bytes_per_destination = 150;
  MemoryStore impl(lim, nullptr);
  Store& s = impl;
  ASSERT_TRUE(s.ReserveOutbox("x:1", 100).ok());
  absl::Status st = s.ReserveOutbox("x:1", 51);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "outbox to 'x:1': 100 bytes waiting + 51 bytes")) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "--max-outbox-bytes-per-destination=150")) << st;
  ASSERT_TRUE(s.ReserveOutbox("x:1", 50).ok());  // exactly at the bound
  ASSERT_TRUE(s.ReserveOutbox("y:1", 100).ok());  // another destination is not blocked by x
  st = s.ReserveOutbox("z:1", 1);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "outbox: 250 bytes waiting for all destinations + 1 bytes")) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "--max-outbox-bytes=250")) << st;
  EXPECT_FALSE(absl::StrContains(st.message(), "per-destination")) << st;
  // Alone over a bound: retrying cannot help, and the message says so.
  st = s.ReserveOutbox("w:1", 151);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "retrying cannot succeed")) << st;

  s.ReleaseOutbox("x:1", 100);
  EXPECT_TRUE(s.ReserveOutbox("z:1", 100).ok());
  EXPECT_EQ(s.ReserveOutbox("z:1", 1).code(), absl::StatusCode::kResourceExhausted);  // 250 in all again
  s.ReleaseOutbox("x:1", 50);
  s.ReleaseOutbox("y:1", 100);
  s.ReleaseOutbox("z:1", 100);
  // Everything released: the whole per-destination bound is free again.
  EXPECT_TRUE(s.ReserveOutbox("x:1", 150).ok());
  EXPECT_TRUE(s.ReserveOutbox("y:1", 100).ok());
}

Store::RecipientTrack Track(TrackState state, const std::string& relay = "r:1", const std::string& reason = "",
                            uint32_t attempts = 0) {
  Store::RecipientTrack t;
  t.state = state;
  t.relay = relay;
  t.reason = reason;
  t.attempts = attempts;
  return t;
}

const Store::RecipientReport& StatusOf(const Store::MessageReport& r, const std::string& agent) {
  for (const Store::RecipientReport& x : r.recipients) {
    if (x.agent == agent) return x;
  }
  ADD_FAILURE() << "no recipient " << agent << " in the report of " << r.recipients.size();
  static const Store::RecipientReport kNone;
  return kNone;
}

Store::RecipientReport StatusNow(const Store& s, const std::string& agent, const std::string& session = "s",
                              const std::string& id = "m1") {
  auto r = s.MessageStatus(session, id);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? StatusOf(*r, agent) : Store::RecipientReport();
}

TEST(MeshStoreTest, MessageStatusOfRecipientsHereFollowsTheirMailbox) {
  MemoryStore impl(StoreLimits{}, nullptr);
  Store& s = impl;
  EXPECT_EQ(s.MessageStatus("s", "m1").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(Commit(s, Msg("s", "m1", {"c", "b"})).ok());
  EXPECT_EQ(s.MessageStatus("s", "nope").status().code(), absl::StatusCode::kNotFound);
  auto r = s.MessageStatus("s", "m1");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->sender, "a");
  ASSERT_EQ(r->recipients.size(), 2u);
  EXPECT_EQ(r->recipients[0].agent, "c");  // the publish's order
  EXPECT_EQ(r->recipients[1].agent, "b");
  for (const auto& x : r->recipients) {
    EXPECT_EQ(x.state, TrackState::kCommitted) << x.agent;
    EXPECT_EQ(x.relay, "") << x.agent;
    EXPECT_EQ(x.attempts, 0u) << x.agent;
  }
  uint64_t w = 0;
  auto d = s.FetchOrWait("s", "b", kNever, [](Store::Wake) {}, &w);
  ASSERT_TRUE(d);
  EXPECT_EQ(StatusNow(s, "b").state, TrackState::kCommitted) << "handed out, not yet written whole";
  s.MarkDelivered("s", "b", "m1");
  EXPECT_EQ(StatusNow(s, "b").state, TrackState::kDelivered);
  EXPECT_EQ(StatusNow(s, "c").state, TrackState::kCommitted);
  ASSERT_TRUE(s.Ack("s", "b", "m1").ok());
  EXPECT_EQ(StatusNow(s, "b").state, TrackState::kAcked);
  EXPECT_EQ(StatusNow(s, "c").state, TrackState::kCommitted);
}

TEST(MeshStoreTest, MessageStatusOfRemoteRecipientsIsTheirTrack) {
  MemoryStore impl(StoreLimits{}, nullptr);
  Store& s = impl;
  auto m = Msg("s", "m1", {"near", "far"});
  m->remote = {{"far", "relay-far:1"}};
  ASSERT_TRUE(Commit(s, m).ok());
  EXPECT_EQ(s.Stats().mailbox_messages, 1u) << "only the recipient here gets a mailbox entry";
  Store::RecipientReport far = StatusNow(s, "far");
  EXPECT_EQ(far.state, TrackState::kQueued) << "not tracked yet: waiting to be forwarded";
  EXPECT_EQ(far.relay, "relay-far:1");
  EXPECT_EQ(StatusNow(s, "near").state, TrackState::kCommitted);

  s.TrackRecipient("s", "m1", "far", Track(TrackState::kQueued, "relay-far:1", "UNAVAILABLE: down", 1));
  far = StatusNow(s, "far");
  EXPECT_EQ(far.state, TrackState::kQueued);
  EXPECT_EQ(far.reason, "UNAVAILABLE: down");
  EXPECT_EQ(far.attempts, 1u);
  s.TrackRecipient("s", "m1", "far", Track(TrackState::kCommitted, "relay-far:1", "", 2));
  far = StatusNow(s, "far");
  EXPECT_EQ(far.state, TrackState::kCommitted);
  EXPECT_EQ(far.relay, "relay-far:1");
  EXPECT_EQ(far.reason, "");
  EXPECT_EQ(far.attempts, 2u);
  // A report from the destination carries no relay and no attempts: both stay.
  s.TrackRecipient("s", "m1", "far", Track(TrackState::kDelivered, "", "", 0));
  far = StatusNow(s, "far");
  EXPECT_EQ(far.state, TrackState::kDelivered);
  EXPECT_EQ(far.relay, "relay-far:1");
  EXPECT_EQ(far.attempts, 2u);
  // Tracking an unknown session or message does nothing.
  s.TrackRecipient("other", "m1", "far", Track(TrackState::kAcked));
  EXPECT_EQ(s.MessageStatus("other", "m1").status().code(), absl::StatusCode::kNotFound);
}

TEST(MeshStoreTest, TrackedStatesNeverGoBackAndADeadLetterIsFinal) {
  MemoryStore impl(StoreLimits{}, nullptr);
  Store& s = impl;
  auto m = Msg("s", "m1", {"x", "y"});
  m->remote = {{"x", "rx:1"}, {"y", "ry:1"}};
  ASSERT_TRUE(Commit(s, m).ok());
  s.TrackRecipient("s", "m1", "x", Track(TrackState::kQueued, "rx:1", "", 0));
  s.TrackRecipient("s", "m1", "x", Track(TrackState::kAcked, "", "", 0));
  // A late forward answer (committed) and a late retry record (queued)
  // after the destination reported the ack: the ack stays.
  s.TrackRecipient("s", "m1", "x", Track(TrackState::kCommitted, "rx:1", "", 1));
  EXPECT_EQ(StatusNow(s, "x").state, TrackState::kAcked);
  s.TrackRecipient("s", "m1", "x", Track(TrackState::kQueued, "rx:1", "UNAVAILABLE: x", 2));
  s.TrackRecipient("s", "m1", "x", Track(TrackState::kDelivered, "", "", 0));
  Store::RecipientReport x = StatusNow(s, "x");
  EXPECT_EQ(x.state, TrackState::kAcked);
  EXPECT_EQ(x.reason, "");

  s.TrackRecipient("s", "m1", "y", Track(TrackState::kQueued, "ry:1", "UNAVAILABLE: y", 3));
  s.TrackRecipient("s", "m1", "y", Track(TrackState::kDeadLettered, "ry:1", "INVALID_ARGUMENT: no", 4));
  for (TrackState later : {TrackState::kQueued, TrackState::kCommitted,
                                    TrackState::kDelivered, TrackState::kAcked,
                                    TrackState::kDeadLettered}) {
    s.TrackRecipient("s", "m1", "y", Track(later, "other:1", "later", 9));
  }
  Store::RecipientReport y = StatusNow(s, "y");
  EXPECT_EQ(y.state, TrackState::kDeadLettered);
  EXPECT_EQ(y.reason, "INVALID_ARGUMENT: no");
  EXPECT_EQ(y.relay, "ry:1");
  EXPECT_EQ(y.attempts, 4u);
}

// A sender gives up (dead letter) only on recipients it has no answer for;
// when the destination's commit or report came first, that state stays.
TEST(MeshStoreTest, ADeadLetterReplacesOnlyAQueuedState) {
  MemoryStore impl(StoreLimits{}, nullptr);
  Store& s = impl;
  auto m = Msg("s", "m1", {"q", "c", "d", "k"});
  m->remote = {{"q", "r:1"}, {"c", "r:1"}, {"d", "r:1"}, {"k", "r:1"}};
  ASSERT_TRUE(Commit(s, m).ok());
  s.TrackRecipient("s", "m1", "q", Track(TrackState::kQueued, "r:1", "UNAVAILABLE: down", 2));
  s.TrackRecipient("s", "m1", "c", Track(TrackState::kCommitted, "r:1", "", 1));
  s.TrackRecipient("s", "m1", "d", Track(TrackState::kDelivered, "", "", 0));
  s.TrackRecipient("s", "m1", "k", Track(TrackState::kAcked, "", "", 0));
  for (const char* agent : {"q", "c", "d", "k"}) {
    s.TrackRecipient("s", "m1", agent, Track(TrackState::kDeadLettered, "r:1", "DEADLINE_EXCEEDED: gave up", 3));
  }
  EXPECT_EQ(StatusNow(s, "q").state, TrackState::kDeadLettered);
  EXPECT_EQ(StatusNow(s, "q").reason, "DEADLINE_EXCEEDED: gave up");
  EXPECT_EQ(StatusNow(s, "c").state, TrackState::kCommitted);
  EXPECT_EQ(StatusNow(s, "c").reason, "");
  EXPECT_EQ(StatusNow(s, "d").state, TrackState::kDelivered);
  EXPECT_EQ(StatusNow(s, "k").state, TrackState::kAcked);
}

TEST(MeshStoreTest, ForwardedMessagesShowTheirRecipientsHere) {
  MemoryStore impl(StoreLimits{}, nullptr);
  Store& s = impl;
  auto m = Forwarded("s", "m1", {"b", "c"});
  ASSERT_TRUE(CommitForward(s, m).ok());
  auto r = s.MessageStatus("s", "m1");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->recipients.size(), 2u);
  EXPECT_EQ(StatusOf(*r, "b").state, TrackState::kCommitted);
  EXPECT_EQ(StatusOf(*r, "c").state, TrackState::kCommitted);
  EXPECT_EQ(Drain(s, "s", "b"), std::vector<std::string>{"m1"});
  EXPECT_EQ(StatusNow(s, "b").state, TrackState::kAcked);
}

TEST(MeshStoreTest, PeerHoldsIsPerSessionMessageAndPeer) {
  MemoryStore impl(StoreLimits{}, nullptr);
  Store& s = impl;
  s.NotePeerHolds("s", "m1", "p:1");  // no session yet: nothing noted
  EXPECT_FALSE(s.PeerHolds("s", "m1", "p:1"));
  ASSERT_TRUE(Commit(s, Msg("s", "m1", {"b"})).ok());
  ASSERT_TRUE(Commit(s, Msg("t", "m1", {"b"})).ok());
  s.NotePeerHolds("s", "m1", "p:1");
  EXPECT_TRUE(s.PeerHolds("s", "m1", "p:1"));
  EXPECT_FALSE(s.PeerHolds("s", "m1", "q:1"));
  EXPECT_FALSE(s.PeerHolds("s", "m2", "p:1"));
  EXPECT_FALSE(s.PeerHolds("t", "m1", "p:1"));
  s.CloseSessionAndPeers("s");
  EXPECT_FALSE(s.PeerHolds("s", "m1", "p:1")) << "a close forgets what peers hold";
}

}  // namespace
}  // namespace kvrelay
