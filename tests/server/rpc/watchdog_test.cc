// UploadWatchdog on a fake clock: which entries fire, and when.
#include "server/rpc/watchdog.h"

#include <atomic>
#include <chrono>
#include <memory>

#include "gtest/gtest.h"
#include "tests/testlib/fake_time_source.h"

namespace kvrelay {
namespace {

using std::chrono::milliseconds;

class WatchdogTest : public ::testing::Test {
 protected:
  // Timeout 400 ms: the watchdog looks every 100 ms.
  static constexpr milliseconds kEvery{100};

  // One look of the watchdog: its tick fires, it checks the entries and
  // waits again.
  void Look() {
    ASSERT_TRUE(clock_.AwaitWaiters(1)) << "the watchdog is not waiting for its tick";
    clock_.Advance(kEvery);
    ASSERT_TRUE(clock_.AwaitWaiters(1)) << "the watchdog did not come back to wait";
  }

  std::shared_ptr<UploadWatchdog::Entry> Watch(std::atomic<int>* fired) {
    return watchdog_.Watch([fired] { fired->fetch_add(1); });
  }

  FakeTimeSource clock_;
  UploadWatchdog watchdog_{0.4, &clock_};
};

TEST_F(WatchdogTest, AnIdleEntryFiresOnceAfterTheTimeoutAndNotBefore) {
  std::atomic<int> fired{0};
  auto e = Watch(&fired);
  for (int i = 0; i < 3; ++i) {
    Look();
    EXPECT_EQ(fired.load(), 0) << "after " << (i + 1) * kEvery.count() << " ms of a 400 ms timeout";
  }
  Look();  // 400 ms idle
  EXPECT_EQ(fired.load(), 1);
  for (int i = 0; i < 5; ++i) Look();
  EXPECT_EQ(fired.load(), 1) << "fired more than once";
}

TEST_F(WatchdogTest, ActivityRestartsTheTimeout) {
  std::atomic<int> fired{0};
  auto e = Watch(&fired);
  for (int i = 0; i < 12; ++i) {
    Look();
    if (i % 3 == 2) e->Touch();  // active every 300 ms
  }
  EXPECT_EQ(fired.load(), 0);
  for (int i = 0; i < 4; ++i) Look();  // then idle for 400 ms
  EXPECT_EQ(fired.load(), 1);
}

TEST_F(WatchdogTest, ADisarmedEntryNeverFires) {
  std::atomic<int> fired{0};
  auto e = Watch(&fired);
  e->Disarm();
  for (int i = 0; i < 10; ++i) Look();
  EXPECT_EQ(fired.load(), 0);
}

// An entry whose mutex is held (a reaction in progress) is skipped, and
// fires at the first look after it is released.
TEST_F(WatchdogTest, ABusyEntryIsSkippedUntilReleased) {
  std::atomic<int> fired{0};
  auto e = Watch(&fired);
  e->mu.Lock();
  for (int i = 0; i < 8; ++i) Look();
  EXPECT_EQ(fired.load(), 0);
  e->mu.Unlock();
  Look();
  EXPECT_EQ(fired.load(), 1);
}

}  // namespace
}  // namespace kvrelay
