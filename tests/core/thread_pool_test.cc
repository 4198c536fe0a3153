#include "core/thread_pool.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <thread>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvrelay {
namespace {

TEST(ThreadPoolTest, ParallelForRunsEveryIndexOnce) {
  for (int threads : {1, 2, 5}) {
    ThreadPool pool(threads);
    for (size_t n : {0u, 1u, 2u, 7u, 1000u}) {
      std::vector<std::atomic<int>> hits(n);
      pool.ParallelFor(n, [&](size_t i) { hits[i].fetch_add(1); });
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << threads << " " << n << " " << i;
    }
  }
}

TEST(ThreadPoolTest, ConcurrentParallelForCallers) {
  ThreadPool pool(3);
  std::atomic<long> sum{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] { pool.ParallelFor(500, [&](size_t i) { sum += static_cast<long>(i); }); });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(sum.load(), 4L * 499 * 500 / 2);
}

TEST(ThreadPoolTest, ExceptionsReachTheCallerAfterEveryIndexRan) {
  ThreadPool pool(2);
  std::vector<std::atomic<int>> hits(64);
  EXPECT_THROW(pool.ParallelFor(64,
                                [&](size_t i) {
                                  hits[i].fetch_add(1);
                                  if (i % 7 == 3) throw std::runtime_error("boom");
                                }),
               std::runtime_error);
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);
  // The pool still works.
  std::atomic<int> n{0};
  pool.ParallelFor(10, [&](size_t) { ++n; });
  EXPECT_EQ(n.load(), 10);
}

// A lane at its limit leaves the other workers to the other lanes: a task
// queued behind a blocked lane's backlog starts at once.
TEST(ThreadPoolTest, LaneLimitLeavesWorkersToOtherLanes) {
  ThreadPool pool(2);
  auto a = pool.NewLane(1), b = pool.NewLane(2);
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  int a_running = 0, a_peak = 0, a_done = 0;
  for (int i = 0; i < 5; ++i) {
    pool.Schedule(a, [&] {
      std::unique_lock<std::mutex> lock(mu);
      a_peak = std::max(a_peak, ++a_running);
      cv.notify_all();
      cv.wait(lock, [&] { return release; });
      --a_running;
      ++a_done;
    });
  }
  {
    // a's first task holds a worker before b arrives.
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(10), [&] { return a_running == 1; }));
  }
  std::promise<void> b_ran;
  pool.Schedule(b, [&] { b_ran.set_value(); });
  ASSERT_EQ(b_ran.get_future().wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_FALSE(pool.WaitIdle(std::chrono::milliseconds(0)));  // a's first task holds a worker
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(a_running, 1);
    release = true;
  }
  cv.notify_all();
  ASSERT_TRUE(pool.WaitIdle(std::chrono::seconds(10)));
  EXPECT_EQ(a_peak, 1);
  EXPECT_EQ(a_done, 5);
}

// Lanes with queued tasks are served in turn, one task each, in FIFO order
// within a lane.
TEST(ThreadPoolTest, LanesAreServedRoundRobin) {
  ThreadPool pool(1);
  std::promise<void> gate;
  std::shared_future<void> open = gate.get_future().share();
  pool.Schedule([open] { open.wait(); });  // holds the worker while the lanes fill
  auto a = pool.NewLane(4), b = pool.NewLane(4);
  std::mutex mu;
  std::string order;
  for (int i = 0; i < 3; ++i) {
    pool.Schedule(a, [&, i] {
      std::lock_guard<std::mutex> lock(mu);
      order += "a" + std::to_string(i);
    });
  }
  for (int i = 0; i < 3; ++i) {
    pool.Schedule(b, [&, i] {
      std::lock_guard<std::mutex> lock(mu);
      order += "b" + std::to_string(i);
    });
  }
  gate.set_value();
  ASSERT_TRUE(pool.WaitIdle(std::chrono::seconds(10)));
  EXPECT_EQ(order, "a0b0a1b1a2b2");
}

// Destruction runs every queued task, those of lanes at their limit too.
TEST(ThreadPoolTest, DestructionDrainsEveryLane) {
  std::atomic<int> ran{0};
  {
    ThreadPool pool(3);
    auto a = pool.NewLane(1);
    for (int i = 0; i < 20; ++i) pool.Schedule(a, [&] { ++ran; });
    for (int i = 0; i < 20; ++i) pool.Schedule([&] { ++ran; });
  }
  EXPECT_EQ(ran.load(), 40);
}

// Destruction while a lane at its limit still has a queued task: once that
// task is taken the ring is empty, and every waiting worker must wake to
// exit (no task finishing on them notifies them).
TEST(ThreadPoolTest, DestructionWakesEveryWaitingWorker) {
  for (int round = 0; round < 20; ++round) {
    auto pool = std::make_unique<ThreadPool>(3);
    auto lane = pool->NewLane(1);
    std::promise<void> gate, started;
    std::shared_future<void> open = gate.get_future().share();
    pool->Schedule(lane, [open, &started] {
      started.set_value();
      open.wait();
    });
    pool->Schedule(lane, [] {});
    started.get_future().wait();  // t0 holds a worker; the other two wait on the lane's limit
    auto done = std::make_shared<std::promise<void>>();
    std::future<void> destroyed = done->get_future();
    std::thread destroyer([p = pool.release(), done] {
      delete p;
      done->set_value();
    });
    gate.set_value();  // t0 ends during or before the destruction
    if (destroyed.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
      destroyer.detach();
      FAIL() << "the pool's destructor did not return (round " << round << ")";
    }
    destroyer.join();
  }
}

TEST(ThreadPoolTest, NullPoolRunsInline) {
  std::vector<size_t> order;
  ParallelFor(nullptr, 4, [&](size_t i) { order.push_back(i); });
  EXPECT_EQ(order, (std::vector<size_t>{0, 1, 2, 3}));
}

}  // namespace
}  // namespace kvrelay
