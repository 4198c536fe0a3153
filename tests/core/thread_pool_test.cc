#include "core/thread_pool.h"

#include <atomic>
#include <stdexcept>
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

TEST(ThreadPoolTest, NullPoolRunsInline) {
  std::vector<size_t> order;
  ParallelFor(nullptr, 4, [&](size_t i) { order.push_back(i); });
  EXPECT_EQ(order, (std::vector<size_t>{0, 1, 2, 3}));
}

}  // namespace
}  // namespace kvrelay
