#include "core/internal/gram.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvrelay {
namespace internal {
namespace {

// Row-major [n, GramStride(d)] with zero padding, random values scaled so that
// entries span several binades.
template <typename T>
std::vector<T> RandomRows(std::mt19937* rng, int n, int d) {
  std::normal_distribution<double> n01(0, 1);
  const int ld = GramStride(d);
  std::vector<T> a(static_cast<size_t>(n) * ld, T(0));
  for (int t = 0; t < n; ++t) {
    for (int i = 0; i < d; ++i) a[static_cast<size_t>(t) * ld + i] = static_cast<T>(n01(*rng) * std::exp(n01(*rng)));
  }
  return a;
}

template <typename T>
void CheckShapes(uint32_t seed) {
  std::mt19937 rng(seed);
  const int shapes[][2] = {{0, 5}, {1, 1}, {3, 7}, {17, 16}, {40, 23}, {476, 128}, {33, 96}, {9, 130}, {64, 200}};
  for (const auto& shape : shapes) {
    const int n = shape[0], d = shape[1];
    SCOPED_TRACE(testing::Message() << "n=" << n << " d=" << d);
    const int ld = GramStride(d);
    ASSERT_EQ(ld % kGramPad, 0);
    ASSERT_EQ(ld / kGramPad % 2, 1);
    ASSERT_GE(ld, d);
    const std::vector<T> a = RandomRows<T>(&rng, n, d);
    std::vector<T> best(static_cast<size_t>(ld) * ld, T(-1)), avx2(best), scalar(best);
    GramLower(a.data(), n, d, best.data(), GramIsa::kBest);
    GramLower(a.data(), n, d, avx2.data(), GramIsa::kAvx2);
    GramLower(a.data(), n, d, scalar.data(), GramIsa::kScalar);
    for (int i = 0; i < d; ++i) {
      for (int j = 0; j <= i; ++j) {
        const size_t at = static_cast<size_t>(i) * ld + j;
        // Independent float64 reference with a bound on float rounding.
        double ref = 0, abs_sum = 0;
        for (int t = 0; t < n; ++t) {
          const double x = a[static_cast<size_t>(t) * ld + i], y = a[static_cast<size_t>(t) * ld + j];
          ref += x * y;
          abs_sum += std::abs(x * y);
        }
        const double eps = std::numeric_limits<T>::epsilon();
        ASSERT_LE(std::abs(best[at] - ref), (n + 1) * eps * abs_sum + 1e-300) << "(" << i << "," << j << ")";
        // Same operations in the same order on every code path: bit-identical.
        ASSERT_EQ(0, std::memcmp(&best[at], &scalar[at], sizeof(T))) << "(" << i << "," << j << ")";
        ASSERT_EQ(0, std::memcmp(&avx2[at], &scalar[at], sizeof(T))) << "(" << i << "," << j << ")";
      }
    }
  }
}

TEST(GramTest, DoubleMatchesReferenceAndIsIdenticalOnEveryPath) {
  for (uint32_t seed = 1; seed <= 5; ++seed) CheckShapes<double>(seed);
}

TEST(GramTest, FloatMatchesReferenceAndIsIdenticalOnEveryPath) {
  for (uint32_t seed = 1; seed <= 5; ++seed) CheckShapes<float>(seed);
}

// Products and sums of small integers are exact in double: so is the Gram.
TEST(GramTest, DoubleIsExactOnIntegers) {
  const int n = 300, d = 37, ld = GramStride(d);
  std::vector<double> a(static_cast<size_t>(n) * ld, 0.0);
  for (int t = 0; t < n; ++t)
    for (int i = 0; i < d; ++i) a[static_cast<size_t>(t) * ld + i] = (t * 31 + i * 17) % 23 - 11;
  std::vector<double> g(static_cast<size_t>(ld) * ld);
  GramLower(a.data(), n, d, g.data());
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j <= i; ++j) {
      long long want = 0;
      for (int t = 0; t < n; ++t) want += static_cast<long long>(((t * 31 + i * 17) % 23 - 11)) * ((t * 31 + j * 17) % 23 - 11);
      ASSERT_EQ(g[static_cast<size_t>(i) * ld + j], static_cast<double>(want)) << i << "," << j;
    }
  }
}


TEST(SymmetricTimesTest, MatchesReferenceAndIsIdenticalOnEveryPath) {
  std::mt19937 rng(7);
  std::normal_distribution<float> n01(0, 1);
  const int shapes[][2] = {{1, 1}, {5, 3}, {16, 18}, {96, 18}, {96, 1}, {100, 7}, {33, 40}, {0, 4}, {7, 0}};
  for (const auto& shape : shapes) {
    const int d = shape[0], m = shape[1];
    SCOPED_TRACE(testing::Message() << "d=" << d << " m=" << m);
    const int ld = GramStride(d);
    std::vector<float> s(static_cast<size_t>(ld) * ld, 0.0f), x(static_cast<size_t>(ld) * m, 0.0f);
    for (int i = 0; i < d; ++i)
      for (int j = 0; j <= i; ++j) s[static_cast<size_t>(i) * ld + j] = s[static_cast<size_t>(j) * ld + i] = n01(rng);
    for (int i = 0; i < m; ++i)
      for (int t = 0; t < d; ++t) x[static_cast<size_t>(i) * ld + t] = n01(rng);
    std::vector<float> best(x.size() + 1, -1.0f), avx2(best), scalar(best);
    SymmetricTimes(s.data(), d, x.data(), m, best.data(), GramIsa::kBest);
    SymmetricTimes(s.data(), d, x.data(), m, avx2.data(), GramIsa::kAvx2);
    SymmetricTimes(s.data(), d, x.data(), m, scalar.data(), GramIsa::kScalar);
    EXPECT_EQ(best.back(), -1.0f) << "wrote past the end";
    for (int i = 0; i < m; ++i) {
      for (int j = 0; j < d; ++j) {
        const size_t at = static_cast<size_t>(i) * ld + j;
        double ref = 0, abs_sum = 0;
        for (int t = 0; t < d; ++t) {
          const double p = static_cast<double>(x[static_cast<size_t>(i) * ld + t]) * s[static_cast<size_t>(t) * ld + j];
          ref += p;
          abs_sum += std::abs(p);
        }
        ASSERT_LE(std::abs(best[at] - ref), (d + 1) * 6e-8 * abs_sum + 1e-30) << "(" << j << "," << i << ")";
        ASSERT_EQ(0, std::memcmp(&best[at], &scalar[at], sizeof(float))) << "(" << j << "," << i << ")";
        ASSERT_EQ(0, std::memcmp(&avx2[at], &scalar[at], sizeof(float))) << "(" << j << "," << i << ")";
      }
    }
  }
}

}  // namespace
}  // namespace internal
}  // namespace kvrelay
