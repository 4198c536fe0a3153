// Eventually: waits for a condition another thread makes true, with a
// deadline, instead of sleeping for a guessed time.
//
//   ASSERT_TRUE(Eventually([&] { return store->inflight_bytes() == 0; }));
//
// Polls `cond` every millisecond or so until it holds (true) or `timeout`
// passes (false). For conditions with no event to wait on (counters of the
// relay under test, a gauge); where the code under test takes a TimeSource,
// FakeTimeSource's AwaitWaiters is the better synchronization point.
#ifndef KVRELAY_TESTS_TESTLIB_EVENTUALLY_H_
#define KVRELAY_TESTS_TESTLIB_EVENTUALLY_H_

#include <chrono>
#include <thread>

namespace kvrelay {

template <typename Cond>
bool Eventually(Cond cond, std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (!cond()) {
    if (std::chrono::steady_clock::now() >= until) return cond();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

}  // namespace kvrelay

#endif  // KVRELAY_TESTS_TESTLIB_EVENTUALLY_H_
