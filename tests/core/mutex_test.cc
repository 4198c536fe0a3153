#include "core/mutex.h"

#include <chrono>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace kvrelay {
namespace {

using std::chrono::steady_clock;

// Increments under the lock from several threads: no increment is lost.
TEST(MutexTest, MutexLockExcludes) {
  Mutex mu;
  long counter = 0;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 100000; ++i) {
        MutexLock lock(&mu);
        ++counter;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(counter, 400000);
}

TEST(MutexTest, TryLockFailsWhileHeld) {
  Mutex mu;
  mu.Lock();
  bool other = true;
  std::thread([&] {
    other = mu.TryLock();
    if (other) mu.Unlock();
  }).join();
  EXPECT_FALSE(other);
  mu.Unlock();
  ASSERT_TRUE(mu.TryLock());
  mu.Unlock();
}

// A wait ends with the condition set by another thread, the lock held again.
TEST(CondVarTest, WaitSeesTheSignalledCondition) {
  Mutex mu;
  CondVar cv;
  bool ready = false;
  int seen = 0;
  std::thread producer([&] {
    MutexLock lock(&mu);
    ready = true;
    cv.SignalAll();
  });
  {
    MutexLock lock(&mu);
    while (!ready) cv.Wait(&mu);
    seen = ready ? 1 : 0;
  }
  producer.join();
  EXPECT_EQ(seen, 1);
}

// WaitUntil returns false only once the deadline has passed, and true when
// signalled in time.
TEST(CondVarTest, WaitUntilReportsTheDeadline) {
  Mutex mu;
  CondVar cv;
  {
    MutexLock lock(&mu);
    const auto deadline = steady_clock::now() + std::chrono::milliseconds(30);
    while (cv.WaitUntil(&mu, deadline)) {
    }  // nobody signals: only the deadline ends it (spurious wakes loop)
    EXPECT_GE(steady_clock::now(), deadline);
  }
  bool flag = false;
  std::thread signaller([&] {
    MutexLock lock(&mu);
    flag = true;
    cv.Signal();
  });
  {
    MutexLock lock(&mu);
    const auto deadline = steady_clock::now() + std::chrono::seconds(60);
    while (!flag) ASSERT_TRUE(cv.WaitUntil(&mu, deadline));
  }
  signaller.join();
}

}  // namespace
}  // namespace kvrelay
