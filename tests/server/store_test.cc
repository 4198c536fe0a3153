// The in-memory store: commit, at-least-once delivery, ack, idempotency,
// parents, limits, TTL, close, waiters.
#include "server/store.h"

#include <atomic>
#include <thread>

#include "gtest/gtest.h"

namespace kvrelay {
namespace {

std::shared_ptr<StoredMessage> Msg(const std::string& session, const std::string& id, std::vector<std::string> to,
                                   uint64_t bytes = 100) {
  auto m = std::make_shared<StoredMessage>();
  m->session_id = session;
  m->message_id = id;
  m->sender = "a";
  m->recipients = std::move(to);
  m->bytes = bytes;
  m->msg.sent_bytes = bytes;
  m->msg.full_bytes = 4 * bytes;
  return m;
}

const Clock::time_point kNever = Clock::now() + std::chrono::hours(1);

std::optional<Store::Delivery> TryFetch(Store& s, const std::string& session, const std::string& agent) {
  uint64_t w = 0;
  auto d = s.FetchOrWait(session, agent, kNever, [](bool) {}, &w);
  if (!d) {
    EXPECT_TRUE(s.CancelWaiter(w));
  }
  return d;
}

TEST(StoreTest, DeliversOldestUnackedUntilAcked) {
  Store s(StoreLimits{}, nullptr);
  ASSERT_TRUE(s.Commit(Msg("s", "m1", {"b"})).ok());
  ASSERT_TRUE(s.Commit(Msg("s", "m2", {"b"})).ok());
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
  Store s(StoreLimits{}, nullptr);
  EXPECT_EQ(s.Ack("s", "b", "m1").code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(s.Commit(Msg("s", "m1", {"b"})).ok());
  EXPECT_EQ(s.Ack("s", "b", "nope").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.Ack("s", "c", "m1").code(), absl::StatusCode::kNotFound);
}

TEST(StoreTest, FanOutGivesEachRecipientItsOwnDelivery) {
  Store s(StoreLimits{}, nullptr);
  ASSERT_TRUE(s.Commit(Msg("s", "m1", {"b", "c"})).ok());
  EXPECT_EQ(s.Stats().mailbox_messages, 2u);
  ASSERT_TRUE(s.Ack("s", "b", "m1").ok());
  auto d = TryFetch(s, "s", "c");
  ASSERT_TRUE(d);
  EXPECT_EQ(d->msg->message_id, "m1");
  EXPECT_FALSE(TryFetch(s, "s", "b"));
}

TEST(StoreTest, DuplicateCommitKeepsTheOriginal) {
  Store s(StoreLimits{}, nullptr);
  auto r1 = s.Commit(Msg("s", "m1", {"b"}, 100));
  auto r2 = s.Commit(Msg("s", "m1", {"b"}, 999));
  ASSERT_TRUE(r1.ok() && r2.ok());
  EXPECT_FALSE(r1->duplicate);
  EXPECT_TRUE(r2->duplicate);
  EXPECT_EQ(r2->msg->bytes, 100u);
  EXPECT_EQ(s.Stats().mailbox_messages, 1u);
}

TEST(StoreTest, ParentMustBeDeliveredToTheSender) {
  Store s(StoreLimits{}, nullptr);
  EXPECT_EQ(s.LookupParent("s", "m1", "b").status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(s.Commit(Msg("s", "m1", {"b"})).ok());
  EXPECT_EQ(s.LookupParent("s", "m1", "b").status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(TryFetch(s, "s", "b"));
  EXPECT_TRUE(s.LookupParent("s", "m1", "b").ok());
  EXPECT_EQ(s.LookupParent("s", "m1", "c").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.LookupParent("other", "m1", "b").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.LookupParent("s", "m2", "b").status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(StoreTest, LimitsAreResourceExhausted) {
  StoreLimits lim;
  lim.max_session_messages = 2;
  lim.max_mailbox_bytes = 250;
  lim.max_inflight_bytes = 1000;
  Store s(lim, nullptr);
  ASSERT_TRUE(s.Commit(Msg("s", "m1", {"b"})).ok());
  ASSERT_TRUE(s.Commit(Msg("s", "m2", {"c"})).ok());
  EXPECT_EQ(s.Commit(Msg("s", "m3", {"d"})).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.CheckCanPublish("s", {"d"}).code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(s.Commit(Msg("t", "m1", {"b"}, 200)).ok());
  EXPECT_EQ(s.Commit(Msg("t", "m2", {"b"}, 100)).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.Stats().mailbox_messages, 3u);
  EXPECT_TRUE(s.ReserveInflight(600).ok());
  EXPECT_EQ(s.ReserveInflight(600).code(), absl::StatusCode::kResourceExhausted);
  s.ReleaseInflight(600);
  EXPECT_EQ(s.inflight_bytes(), 0u);
}

TEST(StoreTest, CloseFreesEverything) {
  Store s(StoreLimits{}, nullptr);
  ASSERT_TRUE(s.Commit(Msg("s", "m1", {"b", "c"})).ok());
  ASSERT_TRUE(s.Commit(Msg("s", "m2", {"b"})).ok());
  EXPECT_EQ(s.CloseSession("s"), 2u);
  EXPECT_EQ(s.CloseSession("s"), 0u);
  const StoreStats st = s.Stats();
  EXPECT_EQ(st.sessions, 0u);
  EXPECT_EQ(st.mailbox_messages, 0u);
  EXPECT_EQ(st.mailbox_bytes, 0u);
  EXPECT_FALSE(s.Find("s", "m1"));
}

TEST(StoreTest, IdleSessionsExpire) {
  StoreLimits lim;
  lim.session_ttl_seconds = 0.2;
  Store s(lim, nullptr);
  ASSERT_TRUE(s.Commit(Msg("s", "m1", {"b"})).ok());
  const auto until = Clock::now() + std::chrono::seconds(5);
  while (s.Stats().sessions > 0 && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(s.Stats().sessions, 0u);
  EXPECT_EQ(s.Stats().mailbox_messages, 0u);
}

TEST(StoreTest, WaiterWakesOnCommitAndOnDeadline) {
  Store s(StoreLimits{}, nullptr);
  std::atomic<int> woke{-1};
  uint64_t w = 0;
  EXPECT_FALSE(s.FetchOrWait("s", "b", kNever, [&](bool t) { woke = t; }, &w));
  ASSERT_TRUE(s.Commit(Msg("s", "m1", {"c"})).ok());  // another agent: no wake
  EXPECT_EQ(woke.load(), -1);
  ASSERT_TRUE(s.Commit(Msg("s", "m2", {"b"})).ok());
  EXPECT_EQ(woke.load(), 0);
  EXPECT_FALSE(s.CancelWaiter(w));

  std::atomic<int> timed{-1};
  EXPECT_FALSE(s.FetchOrWait("s", "z", Clock::now() + std::chrono::milliseconds(50), [&](bool t) { timed = t; }, &w));
  const auto until = Clock::now() + std::chrono::seconds(5);
  while (timed.load() < 0 && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(timed.load(), 1);

  EXPECT_FALSE(s.FetchOrWait("s", "y", kNever, [&](bool) { FAIL() << "cancelled waiter ran"; }, &w));
  EXPECT_TRUE(s.CancelWaiter(w));
  ASSERT_TRUE(s.Commit(Msg("s", "m3", {"y"})).ok());
}

}  // namespace
}  // namespace kvrelay
