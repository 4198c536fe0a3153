#include "core/internal/gram.h"

#include <cmath>
#include <cstdlib>
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

TEST(CrossLowerTest, MatchesReferenceAndIsIdenticalOnEveryPath) {
  std::mt19937 rng(3);
  const int shapes[][2] = {{64, 96}, {1, 1}, {5, 17}, {33, 40}, {0, 8}, {12, 130}};
  for (const auto& shape : shapes) {
    const int n = shape[0], d = shape[1], ld = GramStride(d);
    SCOPED_TRACE(testing::Message() << "n=" << n << " d=" << d);
    const std::vector<float> a = RandomRows<float>(&rng, n, d), b = RandomRows<float>(&rng, n, d);
    std::vector<float> best(static_cast<size_t>(ld) * ld, -1.0f), avx2(best), scalar(best);
    CrossLower(a.data(), b.data(), n, d, best.data(), GramIsa::kBest);
    CrossLower(a.data(), b.data(), n, d, avx2.data(), GramIsa::kAvx2);
    CrossLower(a.data(), b.data(), n, d, scalar.data(), GramIsa::kScalar);
    for (int i = 0; i < d; ++i) {
      for (int j = 0; j <= i; ++j) {
        const size_t at = static_cast<size_t>(i) * ld + j;
        double ref = 0, abs_sum = 0;
        for (int t = 0; t < n; ++t) {
          const double p = static_cast<double>(a[static_cast<size_t>(t) * ld + i]) * b[static_cast<size_t>(t) * ld + j];
          ref += p;
          abs_sum += std::abs(p);
        }
        ASSERT_LE(std::abs(best[at] - ref), (n + 1) * 6e-8 * abs_sum + 1e-30) << "(" << i << "," << j << ")";
        ASSERT_EQ(0, std::memcmp(&best[at], &scalar[at], sizeof(float))) << "(" << i << "," << j << ")";
        ASSERT_EQ(0, std::memcmp(&avx2[at], &scalar[at], sizeof(float))) << "(" << i << "," << j << ")";
      }
    }
  }
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

// Columns of a column-major [d, m] matrix with column stride ld.
double ColumnDot(const std::vector<float>& x, int ld, int d, int i, int j) {
  double s = 0;
  for (int t = 0; t < d; ++t) s += static_cast<double>(x[static_cast<size_t>(i) * ld + t]) * x[static_cast<size_t>(j) * ld + t];
  return s;
}

TEST(GramSchmidtSweepTest, OrthonormalSameSpanAndIdenticalOnEveryPath) {
  std::mt19937 rng(11);
  std::normal_distribution<float> n01(0, 1);
  // d covers every tail: full blocks of 16, an 8-element block, single elements.
  const int shapes[][2] = {{96, 18}, {56, 12}, {1, 1}, {7, 3}, {8, 8}, {16, 5}, {25, 9}, {130, 70}, {40, 0}};
  for (const auto& shape : shapes) {
    const int d = shape[0], m = shape[1];
    SCOPED_TRACE(testing::Message() << "d=" << d << " m=" << m);
    const int ld = GramStride(d);
    std::vector<float> x(static_cast<size_t>(ld) * m + 1, -7.0f);
    for (int i = 0; i < m; ++i)
      for (int t = 0; t < d; ++t) x[static_cast<size_t>(i) * ld + t] = n01(rng) * (1 + i);
    std::vector<float> best(x), avx2(x), scalar(x);
    // Two sweeps, as OBF's last iteration runs them: orthonormal to float precision.
    for (int sweep = 0; sweep < 2; ++sweep) {
      ASSERT_TRUE(GramSchmidtSweep(best.data(), d, m, ld, GramIsa::kBest));
      ASSERT_TRUE(GramSchmidtSweep(avx2.data(), d, m, ld, GramIsa::kAvx2));
      ASSERT_TRUE(GramSchmidtSweep(scalar.data(), d, m, ld, GramIsa::kScalar));
      ASSERT_EQ(0, std::memcmp(best.data(), scalar.data(), best.size() * sizeof(float)));
      ASSERT_EQ(0, std::memcmp(avx2.data(), scalar.data(), avx2.size() * sizeof(float)));
    }
    for (int i = 0; i < m; ++i) {
      for (int t = d; t < ld && i + 1 < m; ++t) ASSERT_EQ(best[static_cast<size_t>(i) * ld + t], -7.0f) << "padding";
      for (int j = 0; j <= i; ++j) {
        ASSERT_NEAR(ColumnDot(best, ld, d, i, j), i == j ? 1.0 : 0.0, 2e-6) << i << "," << j;
      }
      // Column i of the input lies in the span of output columns 0..i.
      double norm2 = 0, in_span = 0;
      for (int t = 0; t < d; ++t) norm2 += static_cast<double>(x[static_cast<size_t>(i) * ld + t]) * x[static_cast<size_t>(i) * ld + t];
      for (int j = 0; j <= i; ++j) {
        double c = 0;
        for (int t = 0; t < d; ++t) c += static_cast<double>(x[static_cast<size_t>(i) * ld + t]) * best[static_cast<size_t>(j) * ld + t];
        in_span += c * c;
      }
      ASSERT_NEAR(in_span / norm2, 1.0, 1e-5) << i;
    }
    ASSERT_EQ(best.back(), -7.0f) << "wrote past the last column";
  }
}

// Norms far below 1/sqrt(FLT_MAX): no factor may overflow.
TEST(GramSchmidtSweepTest, TinyColumnsStayFinite) {
  std::mt19937 rng(12);
  std::normal_distribution<float> n01(0, 1);
  const int d = 16, m = 3, ld = GramStride(d);
  std::vector<float> x(static_cast<size_t>(ld) * m, 0.0f);
  for (int i = 0; i < m; ++i)
    for (int t = 0; t < d; ++t) x[static_cast<size_t>(i) * ld + t] = 1e-20f * n01(rng);
  for (GramIsa isa : {GramIsa::kBest, GramIsa::kAvx2, GramIsa::kScalar}) {
    std::vector<float> y(x);
    ASSERT_TRUE(GramSchmidtSweep(y.data(), d, m, ld, isa));
    ASSERT_TRUE(GramSchmidtSweep(y.data(), d, m, ld, isa));
    for (int i = 0; i < m; ++i)
      for (int j = 0; j <= i; ++j) ASSERT_NEAR(ColumnDot(y, ld, d, i, j), i == j ? 1.0 : 0.0, 2e-6) << i << "," << j;
  }
}

TEST(GramSchmidtSweepTest, StopsOnANearlyDependentColumn) {
  const int d = 40, m = 4, ld = GramStride(d);
  std::vector<float> x(static_cast<size_t>(ld) * m, 0.0f);
  for (int t = 0; t < d; ++t) {
    x[t] = 1.0f + t;
    x[static_cast<size_t>(ld) + t] = 0.5f * (1.0f + t);  // column 1 = column 0 / 2
    x[static_cast<size_t>(2) * ld + t] = static_cast<float>(t % 3);
    x[static_cast<size_t>(3) * ld + t] = static_cast<float>(t % 5);
  }
  for (GramIsa isa : {GramIsa::kBest, GramIsa::kAvx2, GramIsa::kScalar}) {
    std::vector<float> y(x);
    EXPECT_FALSE(GramSchmidtSweep(y.data(), d, m, ld, isa));
  }
}


// bfloat16 bits: zero, or a random sign and mantissa with an exponent in
// [min_exp, max_exp].
uint16_t RandomBf16(std::mt19937* rng, int min_exp, int max_exp) {
  std::uniform_int_distribution<int> exp(min_exp, max_exp), bits(0, 0xff), zero(0, 15);
  if (zero(*rng) == 0) return 0;
  const int b = bits(*rng);
  return static_cast<uint16_t>(((b & 0x80) << 8) | ((127 + exp(*rng)) << 7) | (b & 0x7f));
}

float Bf16Value(uint16_t h) {
  const uint32_t u = uint32_t{h} << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// GramLowerBf16 on values over its whole allowed range and on values near
// one: bit-identical on every path (VDPBF16PS where the CPU has it, the
// AVX-512F and AVX2 emulations, scalar), the documented order of fused
// multiply-adds, and within float rounding of a float64 reference.
TEST(GramBf16Test, MatchesReferenceAndIsIdenticalOnEveryPath) {
  std::mt19937 rng(7);
  const int shapes[][2] = {{0, 5}, {1, 1}, {3, 7}, {17, 16}, {40, 23}, {476, 128}, {33, 96}, {9, 130}, {64, 200}};
  for (const int range : {3, 40}) {
    for (const auto& shape : shapes) {
      const int n = shape[0], d = shape[1], ld = GramStride(d), pairs = (n + 1) / 2;
      SCOPED_TRACE(testing::Message() << "n=" << n << " d=" << d << " range=2^" << range);
      std::vector<float> rows(static_cast<size_t>(n) * d);
      for (float& x : rows) x = Bf16Value(RandomBf16(&rng, -range, range));
      std::vector<uint32_t> a(static_cast<size_t>(pairs) * ld, 0);
      for (int t = 0; t < n; ++t) {
        for (int j = 0; j < d; ++j) {
          uint32_t bits;
          std::memcpy(&bits, &rows[static_cast<size_t>(t) * d + j], sizeof(bits));
          a[static_cast<size_t>(t / 2) * ld + j] |= t % 2 ? bits : bits >> 16;
        }
      }
      std::vector<float> best(static_cast<size_t>(ld) * ld, -1), avx512(best), avx2(best), scalar(best);
      GramLowerBf16(a.data(), pairs, d, best.data(), GramIsa::kBest);
      GramLowerBf16(a.data(), pairs, d, avx512.data(), GramIsa::kAvx512);
      GramLowerBf16(a.data(), pairs, d, avx2.data(), GramIsa::kAvx2);
      GramLowerBf16(a.data(), pairs, d, scalar.data(), GramIsa::kScalar);
      auto value = [&](int t, int i) { return t < n ? rows[static_cast<size_t>(t) * d + i] : 0.0f; };
      for (int i = 0; i < d; ++i) {
        for (int j = 0; j <= i; ++j) {
          const size_t at = static_cast<size_t>(i) * ld + j;
          float order = 0;
          double ref = 0, abs_sum = 0;
          for (int p = 0; p < pairs; ++p) {
            order = std::fma(value(2 * p + 1, i), value(2 * p + 1, j), order);
            order = std::fma(value(2 * p, i), value(2 * p, j), order);
          }
          for (int t = 0; t < n; ++t) {
            ref += double{value(t, i)} * value(t, j);
            abs_sum += std::abs(double{value(t, i)} * value(t, j));
          }
          const double eps = std::numeric_limits<float>::epsilon();
          ASSERT_LE(std::abs(best[at] - ref), (n + 1) * eps * abs_sum) << "(" << i << "," << j << ")";
          ASSERT_EQ(0, std::memcmp(&best[at], &order, sizeof(float))) << "(" << i << "," << j << ")";
          ASSERT_EQ(0, std::memcmp(&avx512[at], &order, sizeof(float))) << "(" << i << "," << j << ")";
          ASSERT_EQ(0, std::memcmp(&avx2[at], &order, sizeof(float))) << "(" << i << "," << j << ")";
          ASSERT_EQ(0, std::memcmp(&scalar[at], &order, sizeof(float))) << "(" << i << "," << j << ")";
        }
      }
    }
  }
}

// Where the CPU has AVX512_BF16 the instruction is used: its start-up check
// against the emulation passed.
TEST(GramBf16Test, NativeInstructionUsedWhereTheCpuHasIt) {
#if defined(__x86_64__)
  const char* off = std::getenv("KVRELAY_DISABLE_AVX512");
  if (off != nullptr && *off != '\0' && std::strcmp(off, "0") != 0) {
    EXPECT_FALSE(NativeBf16GramEnabled());
    return;
  }
  if (__builtin_cpu_supports("avx512bf16")) {
    EXPECT_TRUE(NativeBf16GramEnabled());
  } else {
    EXPECT_FALSE(NativeBf16GramEnabled());
  }
#else
  EXPECT_FALSE(NativeBf16GramEnabled());
#endif
}

}  // namespace
}  // namespace internal
}  // namespace kvrelay
