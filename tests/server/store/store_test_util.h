// Helpers for the tests that drive MemoryStore through the Store interface.
#ifndef KVRELAY_TESTS_SERVER_STORE_TEST_UTIL_H_
#define KVRELAY_TESTS_SERVER_STORE_TEST_UTIL_H_

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "server/store/store.h"
#include "tests/testlib/fake_time_source.h"

namespace kvrelay::testing {

// A message of `bytes` sent bytes (and 4x as many full bytes) from "a" to `to`.
inline std::shared_ptr<StoredMessage> Msg(const std::string& session, const std::string& id,
                                          std::vector<std::string> to, uint64_t bytes = 100) {
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

// Moves `clock` forward by `d` and returns once the store's timer thread
// has handled whatever that made due (sweeps, waiter deadlines) and waits
// again: the store's time, without sleeping. REQUIRES: the store's timer is
// the only thread that waits on `clock`.
inline void Tick(FakeTimeSource* clock, Clock::duration d) {
  ASSERT_TRUE(clock->AwaitWaiters(1)) << "the store's timer is not waiting";
  clock->Advance(d);
  ASSERT_TRUE(clock->AwaitWaiters(1)) << "the store's timer did not come back to wait";
}

inline const Clock::time_point kNever = Clock::now() + std::chrono::hours(1);

// A whole publish: begin, commit, end.
inline absl::StatusOr<Store::CommitResult> Commit(Store& s, std::shared_ptr<StoredMessage> m) {
  const Store::PublishTicket t = s.BeginPublish(m->session_id);
  absl::StatusOr<Store::CommitResult> r = s.Commit(std::move(m), t);
  s.EndPublish(t);
  return r;
}

// Takes a delivery and, as a Fetch does once its stream is written, marks it
// delivered.
inline std::optional<Store::Delivery> TryFetch(Store& s, const std::string& session, const std::string& agent) {
  uint64_t w = 0;
  auto d = s.FetchOrWait(session, agent, kNever, [](Store::Wake) {}, &w);
  if (!d) {
    EXPECT_TRUE(s.CancelWaiter(w));
  } else {
    s.MarkDelivered(session, agent, d->msg->message_id);
  }
  return d;
}

}  // namespace kvrelay::testing

#endif  // KVRELAY_TESTS_SERVER_STORE_TEST_UTIL_H_
