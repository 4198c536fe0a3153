// MemoryStore, driven through the Store interface: commit, at-least-once
// delivery, ack, idempotency, parents, limits, TTL, close, waiters.
#include "server/store/memory_store.h"

#include <atomic>
#include <thread>

#include "gtest/gtest.h"
#include "proto/wire.h"
#include "server/metrics/metrics.h"
#include "tests/server/store/store_test_util.h"
#include "tests/testlib/eventually.h"
#include "tests/testlib/fake_time_source.h"

namespace kvrelay {
namespace {

using namespace kvrelay::testing;

TEST(StoreTest, AccountingCrossesTheWireUnchanged) {
  Message m;
  m.full_bytes = 1000;
  m.sent_bytes = 250;
  m.policy = "h2o-head:k=32";
  Accounting a = AccountingOf(m, 1200, 0.5, 0.75);
  EXPECT_EQ(a.ratio, 4.0);
  EXPECT_FALSE(a.attention_error.has_value());
  v1::Accounting p = ToProto(a);
  EXPECT_FALSE(p.has_attention_error()) << "unset stays unset";
  EXPECT_EQ(p.received_bytes(), 1200u);
  EXPECT_EQ(p.policy(), "h2o-head:k=32");
  m.attention_error = 0.0;  // set, and zero
  a = AccountingOf(m, 1200, 0.5, 0.75);
  p = ToProto(a);
  ASSERT_TRUE(p.has_attention_error());
  const Accounting back = AccountingFromProto(p);
  EXPECT_EQ(ToProto(back).SerializeAsString(), p.SerializeAsString());
  EXPECT_EQ(back.attention_error, std::optional<double>(0.0));
  EXPECT_EQ(back.commit_seconds, 0.75);
  EXPECT_EQ(back.compress_seconds, 0.5);
  EXPECT_EQ(back.full_bytes, 1000u);
  EXPECT_EQ(back.sent_bytes, 250u);
}

TEST(StoreTest, DeliversOldestUnackedUntilAcked) {
  MemoryStore impl(StoreLimits{}, nullptr);
  Store& s = impl;
  ASSERT_TRUE(Commit(s, Msg("s", "m1", {"b"})).ok());
  ASSERT_TRUE(Commit(s, Msg("s", "m2", {"b"})).ok());
  auto d = TryFetch(s, "s", "b");
  ASSERT_TRUE(d);
  EXPECT_EQ(d->msg->message_id, "m1");
  EXPECT_EQ(d->attempt, 1u);
  d = TryFetch(s, "s", "b");
  EXPECT_EQ(d->msg->message_id, "m1");
  EXPECT_EQ(d->attempt, 2u);
  ASSERT_TRUE(s.Ack("s", "b", "m1").ok());
  EXPECT_TRUE(s.Ack("s", "b", "m1").ok());  // idempotent
  d = TryFetch(s, "s", "b");
  EXPECT_EQ(d->msg->message_id, "m2");
  ASSERT_TRUE(s.Ack("s", "b", "m2").ok());
  EXPECT_FALSE(TryFetch(s, "s", "b"));
  EXPECT_EQ(s.Stats().mailbox_messages, 0u);
  EXPECT_EQ(s.Stats().mailbox_bytes, 0u);
}

TEST(StoreTest, AckUnknownIsNotFound) {
  MemoryStore impl(StoreLimits{}, nullptr);
  Store& s = impl;
  EXPECT_EQ(s.Ack("s", "b", "m1").code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(Commit(s, Msg("s", "m1", {"b"})).ok());
  EXPECT_EQ(s.Ack("s", "b", "nope").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.Ack("s", "c", "m1").code(), absl::StatusCode::kNotFound);
  // An agent that is no recipient cannot tell an existing id from a missing
  // one by acking it.
  EXPECT_EQ(s.Ack("s", "c", "m1"), NotVisibleError("message_id", "s", "m1", "c"));
  EXPECT_EQ(s.Ack("s", "c", "m9"), NotVisibleError("message_id", "s", "m9", "c"));
}

// An ack names a message the agent fetched: acking one still queued would
// drop it unseen (an agent's bookkeeping off by one loses a message).
TEST(StoreTest, AckOfAMessageNotYetDeliveredIsFailedPrecondition) {
  MemoryStore impl(StoreLimits{}, nullptr);
  Store& s = impl;
  ASSERT_TRUE(Commit(s, Msg("s", "q1", {"b"})).ok());
  ASSERT_TRUE(Commit(s, Msg("s", "q2", {"b"})).ok());
  absl::Status st = s.Ack("s", "b", "q2");
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("message_id: 'q2': not delivered to 'b' yet"), std::string::npos) << st;
  EXPECT_EQ(s.Stats().mailbox_messages, 2u);  // nothing dropped
  auto d = TryFetch(s, "s", "b");
  ASSERT_TRUE(d);
  EXPECT_EQ(d->msg->message_id, "q1");
  ASSERT_TRUE(s.Ack("s", "b", "q1").ok());
  d = TryFetch(s, "s", "b");
  ASSERT_TRUE(d);
  EXPECT_EQ(d->msg->message_id, "q2");
  EXPECT_TRUE(s.Ack("s", "b", "q2").ok());
  EXPECT_EQ(s.Stats().mailbox_messages, 0u);
}

// A delivery handed out but never written whole (the stream broke, or the
// client stopped reading) is not a delivery: no ack, no parent.
TEST(StoreTest, OnlyACompleteDeliveryCanBeAckedOrBeAParent) {
  MemoryStore impl(StoreLimits{}, nullptr);
  Store& s = impl;
  ASSERT_TRUE(Commit(s, Msg("s", "m1", {"b"})).ok());
  uint64_t w = 0;
  auto d = s.FetchOrWait("s", "b", kNever, [](Store::Wake) {}, &w);
  ASSERT_TRUE(d);
  EXPECT_EQ(s.Ack("s", "b", "m1").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.LookupParent("s", "m1", "b").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.Stats().delivered, 0u);
  s.MarkDelivered("s", "b", "m1");
  EXPECT_EQ(s.Stats().delivered, 1u);
  EXPECT_TRUE(s.LookupParent("s", "m1", "b").ok());
  EXPECT_TRUE(s.Ack("s", "b", "m1").ok());
  s.MarkDelivered("gone", "b", "m1");  // a session closed meanwhile: counted, nothing else
  EXPECT_EQ(s.Stats().delivered, 2u);
}

TEST(StoreTest, FanOutGivesEachRecipientItsOwnDelivery) {
  MemoryStore impl(StoreLimits{}, nullptr);
  Store& s = impl;
  ASSERT_TRUE(Commit(s, Msg("s", "m1", {"b", "c"})).ok());
  EXPECT_EQ(s.Stats().mailbox_messages, 2u);
  ASSERT_TRUE(TryFetch(s, "s", "b"));
  ASSERT_TRUE(s.Ack("s", "b", "m1").ok());
  auto d = TryFetch(s, "s", "c");
  ASSERT_TRUE(d);
  EXPECT_EQ(d->msg->message_id, "m1");
  EXPECT_FALSE(TryFetch(s, "s", "b"));
}

TEST(StoreTest, DuplicateCommitKeepsTheOriginal) {
  MemoryStore impl(StoreLimits{}, nullptr);
  Store& s = impl;
  auto r1 = Commit(s, Msg("s", "m1", {"b"}, 100));
  auto r2 = Commit(s, Msg("s", "m1", {"b"}, 999));
  ASSERT_TRUE(r1.ok() && r2.ok());
  EXPECT_FALSE(r1->duplicate);
  EXPECT_TRUE(r2->duplicate);
  EXPECT_EQ(r2->msg->bytes, 100u);
  EXPECT_EQ(s.Stats().mailbox_messages, 1u);
}

// A parent must be delivered to the sender. To an agent that may not see it
// (neither its sender nor a recipient), a parent that exists and one that
// does not get the same NOT_FOUND.
TEST(StoreTest, ParentMustBeDeliveredToTheSender) {
  MemoryStore impl(StoreLimits{}, nullptr);
  Store& s = impl;
  EXPECT_EQ(s.LookupParent("s", "m1", "b").status(), NotVisibleError("header.parent_id", "s", "m1", "b"));
  ASSERT_TRUE(Commit(s, Msg("s", "m1", {"b"})).ok());
  EXPECT_EQ(s.LookupParent("s", "m1", "b").status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(TryFetch(s, "s", "b"));
  EXPECT_TRUE(s.LookupParent("s", "m1", "b").ok());
  EXPECT_EQ(s.LookupParent("s", "m1", "c").status(), NotVisibleError("header.parent_id", "s", "m1", "c"));
  EXPECT_EQ(s.LookupParent("other", "m1", "b").status(), NotVisibleError("header.parent_id", "other", "m1", "b"));
  EXPECT_EQ(s.LookupParent("s", "m2", "b").status(), NotVisibleError("header.parent_id", "s", "m2", "b"));
  EXPECT_EQ(NotVisibleError("f", "s", "m2", "b").code(), absl::StatusCode::kNotFound);
}

TEST(StoreTest, LimitsAreResourceExhausted) {
  StoreLimits lim;
  lim.max_session_messages = 2;
  lim.max_mailbox_bytes = 250;
  lim.max_inflight_bytes = 1000;
  MemoryStore impl(lim, nullptr);
  Store& s = impl;
  ASSERT_TRUE(Commit(s, Msg("s", "m1", {"b"})).ok());
  ASSERT_TRUE(Commit(s, Msg("s", "m2", {"c"})).ok());
  EXPECT_EQ(Commit(s, Msg("s", "m3", {"d"})).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.CheckCanPublish("s", {"d"}).code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(Commit(s, Msg("t", "m1", {"b"}, 200)).ok());
  EXPECT_EQ(Commit(s, Msg("t", "m2", {"b"}, 100)).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.Stats().mailbox_messages, 3u);
  EXPECT_TRUE(s.ReserveInflight(600).ok());
  EXPECT_EQ(s.ReserveInflight(600).code(), absl::StatusCode::kResourceExhausted);
  s.ReleaseInflight(600);
  EXPECT_EQ(s.inflight_bytes(), 0u);
  // A refusal says when waiting for room cannot help, and only then.
  constexpr absl::string_view kAlone = "the request alone is over the limit, so retrying cannot succeed";
  EXPECT_TRUE(s.ReserveInflight(600).ok());
  EXPECT_EQ(s.ReserveInflight(600).message().find(kAlone), std::string::npos);
  EXPECT_NE(s.ReserveInflight(1001).message().find(kAlone), std::string::npos);
  s.ReleaseInflight(600);
  EXPECT_EQ(Commit(s, Msg("t", "m2", {"b"}, 100)).status().message().find(kAlone), std::string::npos);
  const absl::Status big = Commit(s, Msg("u", "m1", {"b"}, 251)).status();
  EXPECT_EQ(big.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(big.message().find("--max-mailbox-bytes=250; " + std::string(kAlone)), std::string::npos) << big;
}

TEST(StoreTest, CloseFreesEverything) {
  MemoryStore impl(StoreLimits{}, nullptr);
  Store& s = impl;
  ASSERT_TRUE(Commit(s, Msg("s", "m1", {"b", "c"})).ok());
  ASSERT_TRUE(Commit(s, Msg("s", "m2", {"b"})).ok());
  EXPECT_EQ(s.CloseSession("s"), 2u);
  EXPECT_EQ(s.CloseSession("s"), 0u);
  const StoreStats st = s.Stats();
  EXPECT_EQ(st.sessions, 0u);
  EXPECT_EQ(st.mailbox_messages, 0u);
  EXPECT_EQ(st.mailbox_bytes, 0u);
  EXPECT_FALSE(s.Find("s", "m1"));
}

// The timer sweeps every TTL / 4 (50 ms here) of the store's time.
TEST(StoreTest, IdleSessionsExpire) {
  FakeTimeSource clock;
  StoreLimits lim;
  lim.session_ttl_seconds = 0.2;
  MemoryStore impl(lim, nullptr, &clock);
  Store& s = impl;
  ASSERT_TRUE(Commit(s, Msg("s", "m1", {"b"})).ok());
  const uint64_t waits = clock.waits();
  for (int i = 0; i < 3; ++i) Tick(&clock, std::chrono::milliseconds(50));
  EXPECT_GE(clock.waits(), waits + 3) << "the timer did not run a sweep per tick";
  EXPECT_EQ(s.Stats().sessions, 1u) << "expired after 150 ms of a 200 ms TTL";
  for (int i = 0; i < 2; ++i) Tick(&clock, std::chrono::milliseconds(50));
  EXPECT_EQ(s.Stats().sessions, 0u) << "not expired after 250 ms of a 200 ms TTL";
  EXPECT_EQ(s.Stats().mailbox_messages, 0u);
}

// A Fetch waiting on a session keeps it from expiring (its messages stay
// there as parents), and the idle time restarts when the waiter leaves: an
// agent polling with short waits never sees its session vanish.
TEST(StoreTest, AWaitingFetchKeepsItsSessionAlive) {
  FakeTimeSource clock;
  StoreLimits lim;
  lim.session_ttl_seconds = 0.2;
  MemoryStore impl(lim, nullptr, &clock);
  Store& s = impl;
  ASSERT_TRUE(Commit(s, Msg("s", "m1", {"b"})).ok());
  ASSERT_TRUE(Commit(s, Msg("t", "m1", {"b"})).ok());
  std::atomic<int> woken{0};
  uint64_t w = 0;
  EXPECT_FALSE(s.FetchOrWait("s", "c", kNever, [&](Store::Wake) { ++woken; }, &w));
  for (int i = 0; i < 16; ++i) Tick(&clock, std::chrono::milliseconds(50));  // 4 TTLs, 16 sweeps
  s.SweepExpired();
  EXPECT_EQ(woken, 0);
  EXPECT_TRUE(s.Find("s", "m1"));
  EXPECT_FALSE(s.Find("t", "m1")) << "no waiter: expired";
  ASSERT_TRUE(s.CancelWaiter(w));
  s.SweepExpired();
  EXPECT_TRUE(s.Find("s", "m1")) << "the idle time restarts when the waiter leaves";
  for (int i = 0; i < 3; ++i) Tick(&clock, std::chrono::milliseconds(50));
  EXPECT_TRUE(s.Find("s", "m1")) << "expired 150 ms after the waiter left, of a 200 ms TTL";
  for (int i = 0; i < 2; ++i) Tick(&clock, std::chrono::milliseconds(50));
  EXPECT_FALSE(s.Find("s", "m1"));
}

TEST(StoreTest, CloseFencesPublishesInProgress) {
  MemoryStore impl(StoreLimits{}, nullptr);
  Store& s = impl;
  ASSERT_TRUE(Commit(s, Msg("s", "m1", {"b"})).ok());
  const Store::PublishTicket before = s.BeginPublish("s");
  const Store::PublishTicket other = s.BeginPublish("t");
  EXPECT_EQ(s.CloseSession("s"), 1u);
  const Store::PublishTicket after = s.BeginPublish("s");
  // Begun before the close: refused, and the closed session stays closed.
  auto r = s.Commit(Msg("s", "m2", {"b"}), before);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_NE(r.status().message().find("session 's': closed while this publish was in progress"), std::string::npos)
      << r.status();
  EXPECT_EQ(s.Stats().sessions, 0u);
  EXPECT_FALSE(s.Find("s", "m2"));
  // Another session, and a publish begun after the close, are not affected.
  EXPECT_TRUE(s.Commit(Msg("t", "m1", {"b"}), other).ok());
  EXPECT_TRUE(s.Commit(Msg("s", "m3", {"b"}), after).ok());
  s.EndPublish(before);
  s.EndPublish(other);
  s.EndPublish(after);
  // With nothing in progress the close is forgotten: a new publish commits.
  EXPECT_EQ(s.CloseSession("s"), 1u);
  EXPECT_TRUE(Commit(s, Msg("s", "m4", {"b"})).ok());
  EXPECT_EQ(s.Stats().committed, 4u);
}

TEST(StoreTest, CloseBetweenTwoPublishesOfOneSession) {
  MemoryStore impl(StoreLimits{}, nullptr);
  Store& s = impl;
  const Store::PublishTicket a = s.BeginPublish("s");
  s.CloseSession("s");  // the session holds nothing yet: still a fence for `a`
  const Store::PublishTicket b = s.BeginPublish("s");
  EXPECT_EQ(s.Commit(Msg("s", "a", {"x"}), a).status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(s.Commit(Msg("s", "b", {"x"}), b).ok());  // reopens the session
  s.EndPublish(a);
  // A second close, with `b` (committed) and `c` still in progress, fences `c`.
  const Store::PublishTicket c = s.BeginPublish("s");
  EXPECT_EQ(s.CloseSession("s"), 1u);
  EXPECT_EQ(s.Commit(Msg("s", "c", {"x"}), c).status().code(), absl::StatusCode::kFailedPrecondition);
  s.EndPublish(b);
  s.EndPublish(c);
  EXPECT_EQ(s.Stats().sessions, 0u);
  EXPECT_TRUE(Commit(s, Msg("s", "d", {"x"})).ok());  // no publish left: the fences are gone
  EXPECT_EQ(s.Stats().committed, 2u);
}

TEST(StoreTest, SessionsWithAPublishInProgressDoNotExpire) {
  FakeTimeSource clock;
  StoreLimits lim;
  lim.session_ttl_seconds = 0.1;
  MemoryStore impl(lim, nullptr, &clock);
  Store& s = impl;
  ASSERT_TRUE(Commit(s, Msg("s", "m1", {"b"})).ok());
  const Store::PublishTicket t = s.BeginPublish("s");
  for (int i = 0; i < 16; ++i) Tick(&clock, std::chrono::milliseconds(25));  // 4 TTLs, 16 sweeps
  s.SweepExpired();
  EXPECT_EQ(s.Stats().sessions, 1u);
  EXPECT_TRUE(s.Find("s", "m1"));  // still there to be a parent
  ASSERT_TRUE(s.Commit(Msg("s", "m2", {"b"}), t).ok());
  s.EndPublish(t);
  for (int i = 0; i < 6; ++i) Tick(&clock, std::chrono::milliseconds(25));
  EXPECT_EQ(s.Stats().sessions, 0u);  // idle again: expires
}

TEST(StoreTest, WaiterWakesOnCommitAndOnDeadline) {
  FakeTimeSource clock;
  MemoryStore impl(StoreLimits{}, nullptr, &clock);
  Store& s = impl;
  std::atomic<int> woke{-1};
  uint64_t w = 0;
  EXPECT_EQ(s.Stats().fetch_waiters, 0u);
  EXPECT_FALSE(s.FetchOrWait("s", "b", kNever, [&](Store::Wake t) { woke = static_cast<int>(t); }, &w));
  EXPECT_EQ(s.Stats().fetch_waiters, 1u);
  ASSERT_TRUE(Commit(s, Msg("s", "m1", {"c"})).ok());  // another agent: no wake
  EXPECT_EQ(woke.load(), -1);
  ASSERT_TRUE(Commit(s, Msg("s", "m2", {"b"})).ok());
  EXPECT_EQ(woke.load(), 0);
  EXPECT_EQ(s.Stats().fetch_waiters, 0u);
  EXPECT_FALSE(s.CancelWaiter(w));

  std::atomic<int> timed{-1};
  const Clock::time_point due = clock.Now() + std::chrono::milliseconds(50);
  EXPECT_FALSE(s.FetchOrWait("s", "z", due, [&](Store::Wake t) { timed = static_cast<int>(t); }, &w));
  // The waiter signals the timer, which then waits for the waiter's deadline.
  ASSERT_TRUE(Eventually([&] { return clock.next_deadline() == due; })) << "the timer did not take the deadline";
  Tick(&clock, std::chrono::milliseconds(49));
  EXPECT_EQ(timed.load(), -1) << "woken before its deadline";
  Tick(&clock, std::chrono::milliseconds(1));
  EXPECT_EQ(timed.load(), 1);

  EXPECT_FALSE(s.FetchOrWait("s", "y", kNever, [&](Store::Wake) { FAIL() << "cancelled waiter ran"; }, &w));
  EXPECT_EQ(s.Stats().fetch_waiters, 1u);
  EXPECT_TRUE(s.CancelWaiter(w));
  EXPECT_EQ(s.Stats().fetch_waiters, 0u);
  ASSERT_TRUE(Commit(s, Msg("s", "m3", {"y"})).ok());
}

// Review 3a: CloseSession wakes the session's waiters (also those waiting
// on a session that holds nothing yet); others keep waiting.
TEST(StoreTest, CloseSessionWakesItsWaiters) {
  MemoryStore impl(StoreLimits{}, nullptr);
  Store& s = impl;
  ASSERT_TRUE(Commit(s, Msg("s", "m1", {"c"})).ok());
  std::atomic<int> b{-1}, z{-1}, other{-1};
  uint64_t wb = 0, wz = 0, wo = 0;
  EXPECT_FALSE(s.FetchOrWait("s", "b", kNever, [&](Store::Wake w) { b = static_cast<int>(w); }, &wb));
  EXPECT_FALSE(s.FetchOrWait("empty", "z", kNever, [&](Store::Wake w) { z = static_cast<int>(w); }, &wz));
  EXPECT_FALSE(s.FetchOrWait("t", "b", kNever, [&](Store::Wake w) { other = static_cast<int>(w); }, &wo));
  EXPECT_EQ(s.CloseSession("s"), 1u);
  EXPECT_EQ(b.load(), static_cast<int>(Store::Wake::kClosed));
  EXPECT_EQ(z.load(), -1);
  EXPECT_EQ(s.CloseSession("empty"), 0u);
  EXPECT_EQ(z.load(), static_cast<int>(Store::Wake::kClosed));
  EXPECT_EQ(other.load(), -1);
  EXPECT_FALSE(s.CancelWaiter(wb));
  EXPECT_TRUE(s.CancelWaiter(wo));
}

// Review 3a: Shutdown wakes every waiter and later fetches never wait, but
// held deliveries can still be fetched.
TEST(StoreTest, ShutdownWakesEveryWaiterAndRefusesNewOnes) {
  MemoryStore impl(StoreLimits{}, nullptr);
  Store& s = impl;
  ASSERT_TRUE(Commit(s, Msg("s", "m1", {"c"})).ok());
  std::atomic<int> a{-1}, b{-1};
  uint64_t w = 0;
  EXPECT_FALSE(s.FetchOrWait("s", "b", kNever, [&](Store::Wake x) { a = static_cast<int>(x); }, &w));
  EXPECT_FALSE(s.FetchOrWait("u", "v", kNever, [&](Store::Wake x) { b = static_cast<int>(x); }, &w));
  s.Shutdown();
  EXPECT_EQ(a.load(), static_cast<int>(Store::Wake::kShutdown));
  EXPECT_EQ(b.load(), static_cast<int>(Store::Wake::kShutdown));
  w = 99;
  EXPECT_FALSE(s.FetchOrWait("s", "b", kNever, [&](Store::Wake) { FAIL() << "registered after shutdown"; }, &w));
  EXPECT_EQ(w, 0u);
  EXPECT_TRUE(s.FetchOrWait("s", "c", kNever, [](Store::Wake) {}, &w));
}

// Review 2c: every retained message counts against the session's and the
// store's byte limits, acked or not, until its session goes.
TEST(StoreTest, SessionAndStoreByteLimitsCountAckedMessages) {
  StoreLimits lim;
  lim.max_session_bytes = 250;
  lim.max_store_bytes = 400;
  MemoryStore impl(lim, nullptr);
  Store& s = impl;
  ASSERT_TRUE(Commit(s, Msg("s1", "m1", {"b"})).ok());
  ASSERT_TRUE(Commit(s, Msg("s1", "m2", {"b"})).ok());
  ASSERT_TRUE(TryFetch(s, "s1", "b"));
  ASSERT_TRUE(s.Ack("s1", "b", "m1").ok());
  ASSERT_TRUE(TryFetch(s, "s1", "b"));
  ASSERT_TRUE(s.Ack("s1", "b", "m2").ok());
  EXPECT_EQ(s.Stats().mailbox_bytes, 0u);
  EXPECT_EQ(s.store_bytes(), 200u);
  EXPECT_EQ(s.Stats().store_bytes, 200u);
  auto r = Commit(s, Msg("s1", "m3", {"b"}));
  ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("--max-session-bytes=250"), std::string::npos) << r.status();
  absl::Status early = s.CheckCanPublish("s1", {"b"}, 51);
  EXPECT_EQ(early.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(early.message().find("--max-session-bytes=250"), std::string::npos) << early;
  EXPECT_TRUE(s.CheckCanPublish("s1", {"b"}, 50).ok());
  ASSERT_TRUE(Commit(s, Msg("s2", "m1", {"b"})).ok());
  ASSERT_TRUE(Commit(s, Msg("s2", "m2", {"b"})).ok());
  EXPECT_EQ(s.store_bytes(), 400u);
  r = Commit(s, Msg("s3", "m1", {"b"}, 1));
  ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("--max-store-bytes=400"), std::string::npos) << r.status();
  EXPECT_EQ(s.CheckCanPublish("s3", {"b"}, 1).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.Stats().sessions, 2u);  // the refused commit left no session behind
  EXPECT_EQ(s.CloseSession("s1"), 2u);
  EXPECT_EQ(s.store_bytes(), 200u);
  EXPECT_TRUE(Commit(s, Msg("s3", "m1", {"b"}, 1)).ok());
}

// Review 2b: the up-front check takes the message's size into account.
TEST(StoreTest, CheckCanPublishCountsTheComingMessageAgainstMailboxes) {
  StoreLimits lim;
  lim.max_mailbox_bytes = 300;
  MemoryStore impl(lim, nullptr);
  Store& s = impl;
  EXPECT_EQ(s.CheckCanPublish("new", {"b"}, 301).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(s.CheckCanPublish("new", {"b"}, 300).ok());
  ASSERT_TRUE(Commit(s, Msg("s", "m1", {"b"}, 200)).ok());
  absl::Status st = s.CheckCanPublish("s", {"c", "b"}, 101);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("mailbox of 'b'"), std::string::npos) << st;
  EXPECT_NE(st.message().find("--max-mailbox-bytes=300"), std::string::npos) << st;
  EXPECT_TRUE(s.CheckCanPublish("s", {"c", "b"}, 100).ok());
}

double GaugeValue(Metrics& m, const std::string& name) {
  for (const auto& fam : m.registry()->Collect()) {
    if (fam.name == name && !fam.metric.empty()) return fam.metric[0].gauge.value;
  }
  ADD_FAILURE() << "no gauge " << name;
  return -1;
}

// Review 3c: the in-flight gauge ends at the counter's exact value however
// reservations and releases interleave.
TEST(StoreTest, InflightGaugeIsExactUnderConcurrency) {
  Metrics m;
  StoreLimits lim;
  lim.max_inflight_bytes = 1ull << 40;
  MemoryStore impl(lim, &m);
  Store& s = impl;
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&s, t] {
      for (int i = 0; i < 2000; ++i) {
        const uint64_t n = 1 + (i * 7919 + t) % 4096;
        ASSERT_TRUE(s.ReserveInflight(n).ok());
        s.ReleaseInflight(n);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(s.inflight_bytes(), 0u);
  EXPECT_EQ(GaugeValue(m, "kvrelay_inflight_bytes"), 0.0);
  ASSERT_TRUE(s.ReserveInflight(12345).ok());
  s.AddInflight(5);
  EXPECT_EQ(GaugeValue(m, "kvrelay_inflight_bytes"), 12350.0);
  s.ReleaseInflight(12350);
  EXPECT_EQ(GaugeValue(m, "kvrelay_inflight_bytes"), 0.0);
  // The store-bytes gauge follows commits and closes.
  ASSERT_TRUE(Commit(s, Msg("s", "m1", {"b"}, 700)).ok());
  EXPECT_EQ(GaugeValue(m, "kvrelay_store_bytes"), 700.0);
  s.CloseSession("s");
  EXPECT_EQ(GaugeValue(m, "kvrelay_store_bytes"), 0.0);
}

double Outcome(Metrics& m, const std::string& outcome) {
  for (const auto& fam : m.registry()->Collect()) {
    if (fam.name != "kvrelay_messages_total") continue;
    for (const auto& metric : fam.metric) {
      for (const auto& l : metric.label) {
        if (l.name == "outcome" && l.value == outcome) return metric.counter.value;
      }
    }
  }
  ADD_FAILURE() << "no outcome " << outcome;
  return -1;
}

// Unacknowledged deliveries a close drops are counted (outcome "closed"),
// as expiry's are ("expired"): committed x recipients reconciles.
TEST(StoreTest, CloseCountsTheUnackedDeliveriesItDrops) {
  Metrics m;
  MemoryStore impl(StoreLimits{}, &m);
  Store& s = impl;
  ASSERT_TRUE(Commit(s, Msg("s", "m1", {"b", "c"})).ok());
  ASSERT_TRUE(Commit(s, Msg("s", "m2", {"b"})).ok());
  ASSERT_TRUE(TryFetch(s, "s", "c"));
  ASSERT_TRUE(s.Ack("s", "c", "m1").ok());
  EXPECT_EQ(s.CloseSession("s"), 2u);
  EXPECT_EQ(Outcome(m, "closed"), 2.0);  // m1 and m2 to b
  EXPECT_EQ(Outcome(m, "expired"), 0.0);
  EXPECT_EQ(s.CloseSession("s"), 0u);
  EXPECT_EQ(Outcome(m, "closed"), 2.0);
}

}  // namespace
}  // namespace kvrelay
