#include "core/obf.h"

#include <cmath>
#include <cstring>
#include <random>

#include "Eigen/Dense"
#include "core/selection.h"
#include "gtest/gtest.h"

namespace kvrelay {
namespace {

using Eigen::MatrixXd;
using Eigen::VectorXd;

struct Case {
  int n_cand, d;
  std::vector<float> v;       // [n_cand, d]
  std::vector<double> score;  // [n_cand]
  std::vector<int> kept;
};

// Low-rank-plus-noise values (as real KV rows are), heavy-tailed scores:
// `rank` random directions, the r-th with coefficients N(0, 1) / divisor(r),
// plus N(0, noise^2) in every entry; the top-k scores kept.
Case LowRankCase(uint32_t seed, int n_cand, int d, int k, int rank, float noise, float (*divisor)(int)) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n01(0.f, 1.f);
  std::exponential_distribution<double> expo(1.0);
  Case c{n_cand, d, std::vector<float>(static_cast<size_t>(n_cand) * d), std::vector<double>(n_cand), {}};
  MatrixXd basis = MatrixXd::NullaryExpr(rank, d, [&] { return n01(rng); });
  for (int j = 0; j < n_cand; ++j) {
    for (int i = 0; i < d; ++i) c.v[j * d + i] = noise * n01(rng);
    for (int r = 0; r < rank; ++r) {
      const float a = n01(rng) / divisor(r);
      for (int i = 0; i < d; ++i) c.v[j * d + i] += a * static_cast<float>(basis(r, i));
    }
    const double e = expo(rng);
    c.score[j] = e * e * e;
  }
  c.kept = TopK(c.score, 0, n_cand, k);
  return c;
}

Case RandomCase(uint32_t seed, int n_cand, int d, int k) {
  return LowRankCase(seed, n_cand, d, k, std::max(2, d / 3), 0.05f, [](int r) { return 1.0f + r; });
}

// The exact and the fast path's results for one case.
struct ExactAndFast {
  ObfHead exact, fast;
};
ExactAndFast ComputeBoth(const Case& c) {
  ObfOptions exact, fast;
  fast.mode = ObfMode::kFast;
  return {ComputeObf(exact, c.v, c.n_cand, c.d, c.score, c.kept),
          ComputeObf(fast, c.v, c.n_cand, c.d, c.score, c.kept)};
}

// Independent float64 reference: Q from an SVD of V_keep, C from an SVD of R.
VectorXd ReferenceDelta(const ObfOptions& o, const Case& c, MatrixXd* c_out = nullptr) {
  const int d = c.d;
  std::vector<int> del;
  double a_keep = 0, a_del = 0;
  for (int j = 0, ki = 0; j < c.n_cand; ++j) {
    if (ki < static_cast<int>(c.kept.size()) && c.kept[ki] == j) {
      a_keep += c.score[j];
      ++ki;
    } else {
      a_del += c.score[j];
      del.push_back(j);
    }
  }
  MatrixXd keep(c.kept.size(), d), vdel(del.size(), d);
  for (size_t i = 0; i < c.kept.size(); ++i)
    for (int x = 0; x < d; ++x) keep(i, x) = c.v[c.kept[i] * d + x];
  for (size_t i = 0; i < del.size(); ++i)
    for (int x = 0; x < d; ++x) vdel(i, x) = c.v[del[i] * d + x];
  Eigen::JacobiSVD<MatrixXd> svk(keep, Eigen::ComputeThinV);
  int r = 0;
  while (r < svk.singularValues().size() && svk.singularValues()[r] > 1e-9 * svk.singularValues()[0]) ++r;
  const MatrixXd q = svk.matrixV().leftCols(r);
  // (Eigen's blocked product of an empty inner dimension divides by zero.)
  const MatrixXd res = r == 0 ? vdel : MatrixXd(vdel - vdel * q * q.transpose());
  if (res.norm() <= 1e-10) return VectorXd::Zero(d);
  Eigen::JacobiSVD<MatrixXd> svr(res, Eigen::ComputeThinV);
  int p = 0;
  while (p < o.p && p < svr.singularValues().size() &&
         svr.singularValues()[p] > 1e-6 * svr.singularValues()[0])
    ++p;
  const MatrixXd cm = svr.matrixV().leftCols(p).transpose();
  if (c_out) *c_out = cm;
  VectorXd w(del.size());
  double sw = 0;
  for (size_t i = 0; i < del.size(); ++i) sw += (w[i] = c.score[del[i]]);
  if (sw <= 1e-12) w.setConstant(1.0), sw = del.size();
  const VectorXd rbar = res.transpose() * w / sw;
  double f = 1;
  if (o.scale == ScaleMode::kAdOverAs) f = a_del / (a_keep + 1e-12);
  if (o.scale == ScaleMode::kAdFrac) f = a_del / (a_del + a_keep + 1e-12);
  if (o.scale == ScaleMode::kAd) f = a_del;
  return f * cm.transpose() * (cm * rbar);
}

MatrixXd KeepMatrix(const Case& c) {
  MatrixXd keep(c.kept.size(), c.d);
  for (size_t i = 0; i < c.kept.size(); ++i)
    for (int x = 0; x < c.d; ++x) keep(i, x) = c.v[c.kept[i] * c.d + x];
  return keep;
}

TEST(ObfTest, ExactMatchesIndependentSvdReference) {
  for (uint32_t seed = 0; seed < 60; ++seed) {
    std::mt19937 rng(seed);
    const int d = 8 << (rng() % 4);  // 8..64
    const int n = 10 + rng() % 120;
    const int k = 1 + rng() % std::min(n - 1, 40);
    Case c = RandomCase(seed, n, d, k);
    for (ScaleMode sm : {ScaleMode::kAdOverAs, ScaleMode::kAdFrac, ScaleMode::kAd, ScaleMode::kNone}) {
      ObfOptions o;
      o.p = 1 + rng() % 10;
      o.scale = sm;
      const ObfHead got = ComputeObf(o, c.v, n, d, c.score, c.kept);
      const VectorXd ref = ReferenceDelta(o, c);
      ASSERT_LE((got.delta - ref).norm(), 1e-9 * std::max(1.0, ref.norm()))
          << "seed " << seed << " d=" << d << " n=" << n << " k=" << k << " p=" << o.p;
    }
  }
}

TEST(ObfTest, DeltaIsOrthogonalToKeptSpanAndInsideC) {
  for (uint32_t seed = 100; seed < 140; ++seed) {
    Case c = RandomCase(seed, 200, 64, 16);
    for (ObfMode mode : {ObfMode::kExact, ObfMode::kFast}) {
      ObfOptions o;
      o.mode = mode;
      const ObfHead h = ComputeObf(o, c.v, c.n_cand, c.d, c.score, c.kept);
      ASSERT_TRUE(h.applied);
      const double dn = h.delta.norm();
      ASSERT_GT(dn, 0);
      const double tol = mode == ObfMode::kExact ? 1e-10 : 1e-4;
      const MatrixXd keep = KeepMatrix(c);
      EXPECT_LE((keep * h.delta).norm(), tol * keep.norm() * dn) << "seed " << seed;
      EXPECT_LE((h.delta - h.c.transpose() * (h.c * h.delta)).norm(), tol * dn) << "seed " << seed;
      EXPECT_LE((h.c * h.c.transpose() - MatrixXd::Identity(h.c.rows(), h.c.rows())).norm(), tol * 10);
      EXPECT_LE((h.c * h.q).norm(), tol * 10);
      EXPECT_EQ(h.c.rows(), o.p);
    }
  }
}

TEST(ObfTest, FastPathAgreesWithExact) {
  for (uint32_t seed = 200; seed < 230; ++seed) {
    const auto [e, f] = ComputeBoth(RandomCase(seed, 300, 128, 32));
    EXPECT_LE((e.delta - f.delta).norm(), 1e-3 * e.delta.norm()) << "seed " << seed;
  }
}

// A steep residual spectrum (20 directions whose singular values halve from
// one to the next, little noise, two kept rows): the wanted directions of G
// span eight orders of magnitude, where float32 products between the
// fast path's orthonormalizations lose the small ones first. Measured at
// most 2.7e-4 (orthonormalizing after every product or every second one);
// after every fourth, 1e-2 in the median.
TEST(ObfTest, FastPathAgreesWithExactOnSteepSpectra) {
  for (uint32_t seed = 400; seed < 430; ++seed) {
    const Case c = LowRankCase(seed, 300, 128, 2, 20, 1e-6f, [](int r) { return std::ldexp(1.0f, r); });
    const auto [e, f] = ComputeBoth(c);
    ASSERT_TRUE(e.applied && f.applied) << "seed " << seed;
    EXPECT_LE((e.delta - f.delta).norm(), 1e-3 * e.delta.norm()) << "seed " << seed;
  }
}

// Values that are bfloat16 numbers (BF16 turns) take the fast path's
// bfloat16 Gram; it agrees with the exact path as the float one does, for
// an odd and an even number of deleted rows, values scaled far from one,
// and values too small to count (flushed to zero in that Gram).
TEST(ObfTest, FastPathAgreesWithExactOnBf16Values) {
  auto to_bf16 = [](float x) {
    uint32_t b;
    std::memcpy(&b, &x, sizeof(b));
    b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;  // round to nearest even
    std::memcpy(&x, &b, sizeof(b));
    return x;
  };
  for (uint32_t seed = 300; seed < 320; ++seed) {
    Case c = RandomCase(seed, 300 + seed % 2, 128, 32);
    const float scale = std::ldexp(1.0f, static_cast<int>(seed % 5) * 20 - 20);
    for (size_t i = 0; i < c.v.size(); ++i) {
      c.v[i] = to_bf16(c.v[i]) * scale;
      if (i % 97 == 0) c.v[i] = std::ldexp(1.0f, -50) * scale;  // below 2^-40 of the largest
    }
    const auto [e, f] = ComputeBoth(c);
    ASSERT_TRUE(e.applied && f.applied) << "seed " << seed;
    // Measured up to 4e-5; a deleted row left out of the Gram gives 7e-3 or more.
    EXPECT_LE((e.delta - f.delta).norm(), 2e-4 * e.delta.norm()) << "seed " << seed;
    EXPECT_LE((e.c * f.c.transpose()).jacobiSvd().singularValues().minCoeff(), 1.0 + 1e-4);
    EXPECT_GE((e.c * f.c.transpose()).jacobiSvd().singularValues().minCoeff(), 1.0 - 1e-3) << "seed " << seed;
  }
}

TEST(ObfTest, FastPathHandlesHugeValuesAndLargeP) {
  Case c = RandomCase(31, 200, 64, 16);
  ObfOptions exact, fast;
  fast.mode = ObfMode::kFast;
  const ObfHead e0 = ComputeObf(exact, c.v, c.n_cand, c.d, c.score, c.kept);
  const float scale = std::ldexp(1.0f, 60);  // ~1.2e18: the float32 Gram would overflow
  for (float& x : c.v) x *= scale;
  const ObfHead e = ComputeObf(exact, c.v, c.n_cand, c.d, c.score, c.kept);
  const ObfHead f = ComputeObf(fast, c.v, c.n_cand, c.d, c.score, c.kept);
  ASSERT_TRUE(e.applied && f.applied);
  EXPECT_LE((e.delta - static_cast<double>(scale) * e0.delta).norm(), 1e-9 * e.delta.norm());
  EXPECT_LE((e.delta - f.delta).norm(), 1e-3 * e.delta.norm());
  // p above 64 (the exact path's bisection works on blocks of shifts).
  exact.p = 100;
  Case big = RandomCase(32, 400, 128, 20);
  const ObfHead h = ComputeObf(exact, big.v, big.n_cand, big.d, big.score, big.kept);
  EXPECT_EQ(h.c.rows(), 100);
  const VectorXd ref = ReferenceDelta(exact, big);
  EXPECT_LE((h.delta - ref).norm(), 1e-9 * ref.norm());
}

TEST(ObfTest, InjectWeights) {
  Case c = RandomCase(5, 40, 16, 6);
  ObfOptions o;
  ObfHead h = ComputeObf(o, c.v, c.n_cand, c.d, c.score, c.kept);
  EXPECT_EQ(h.weights, std::vector<double>(6, 1.0));
  o.inject = InjectMode::kAttn;
  h = ComputeObf(o, c.v, c.n_cand, c.d, c.score, c.kept);
  double sa = 0;
  for (int t : c.kept) sa += c.score[t];
  for (size_t i = 0; i < c.kept.size(); ++i) EXPECT_DOUBLE_EQ(h.weights[i], 6 * c.score[c.kept[i]] / sa);
}

TEST(ObfTest, SkipsAndDegenerateCases) {
  ObfOptions o;
  // d < k: V_keep spans everything, R = 0.
  Case c = RandomCase(9, 40, 8, 12);
  ObfHead h = ComputeObf(o, c.v, c.n_cand, c.d, c.score, c.kept);
  EXPECT_FALSE(h.applied);
  EXPECT_EQ(h.delta.norm(), 0.0);
  // Nothing deleted / nothing kept.
  c = RandomCase(10, 10, 16, 10);
  EXPECT_FALSE(ComputeObf(o, c.v, c.n_cand, c.d, c.score, c.kept).applied);
  EXPECT_FALSE(ComputeObf(o, c.v, c.n_cand, c.d, c.score, {}).applied);
  // Zero scores: uniform residual weights; ad_over_as gives factor 0, none gives 1.
  c = RandomCase(11, 50, 16, 5);
  std::fill(c.score.begin(), c.score.end(), 0.0);
  h = ComputeObf(o, c.v, c.n_cand, c.d, c.score, c.kept);
  EXPECT_EQ(h.delta.norm(), 0.0);
  o.scale = ScaleMode::kNone;
  h = ComputeObf(o, c.v, c.n_cand, c.d, c.score, c.kept);
  const VectorXd ref = ReferenceDelta(o, c);
  EXPECT_GT(ref.norm(), 0);
  EXPECT_LE((h.delta - ref).norm(), 1e-9 * ref.norm());
}

TEST(ObfTest, RankDeficientKeptValues) {
  Case c = RandomCase(12, 60, 32, 8);
  // Kept rows 1..3 copy kept row 0 and row 4 is twice row 0 (exact in
  // float): rank 4 of 8 (rows 0, 5, 6, 7).
  const int d = c.d;
  auto row = [&](int i) { return &c.v[c.kept[i] * d]; };
  for (int i = 1; i <= 3; ++i) std::copy(row(0), row(0) + d, row(i));
  for (int x = 0; x < d; ++x) row(4)[x] = 2 * row(0)[x];
  for (ObfMode mode : {ObfMode::kExact, ObfMode::kFast}) {
    ObfOptions o;
    o.mode = mode;
    const ObfHead h = ComputeObf(o, c.v, c.n_cand, d, c.score, c.kept);
    EXPECT_EQ(h.q.cols(), 4) << "mode " << static_cast<int>(mode);
    const VectorXd ref = ReferenceDelta(ObfOptions{}, c);
    EXPECT_LE((h.delta - ref).norm(), (mode == ObfMode::kExact ? 1e-7 : 1e-3) * ref.norm());
  }
}

// Every kept row zero: span(V_keep) = {0}, r = 0, and R is V_del itself.
TEST(ObfTest, KeptValuesAllZero) {
  for (int d : {16, 64, 128}) {
    Case c = RandomCase(13 + d, 90, d, 6);
    for (int i : c.kept) std::fill(&c.v[i * d], &c.v[i * d] + d, 0.0f);
    const VectorXd ref = ReferenceDelta(ObfOptions{}, c);
    ASSERT_GT(ref.norm(), 0);
    for (ObfMode mode : {ObfMode::kExact, ObfMode::kFast}) {
      ObfOptions o;
      o.mode = mode;
      const ObfHead h = ComputeObf(o, c.v, c.n_cand, d, c.score, c.kept);
      ASSERT_TRUE(h.applied) << "d=" << d << " mode " << static_cast<int>(mode);
      EXPECT_EQ(h.q.cols(), 0);
      EXPECT_EQ(h.c.rows(), o.p);
      EXPECT_LE((h.delta - ref).norm(), (mode == ObfMode::kExact ? 1e-7 : 1e-3) * ref.norm()) << "d=" << d;
    }
    // Deleted rows tiny too (the exact path then measures R itself) or zero.
    for (float scale : {1e-14f, 0.0f}) {  // ||R||_F ~1e-12: below the 1e-10 skip
      Case z = c;
      for (float& x : z.v) x *= scale;
      for (ObfMode mode : {ObfMode::kExact, ObfMode::kFast}) {
        ObfOptions o;
        o.mode = mode;
        const ObfHead h = ComputeObf(o, z.v, z.n_cand, d, z.score, z.kept);
        EXPECT_FALSE(h.applied) << "d=" << d << " scale " << scale << " mode " << static_cast<int>(mode);
        EXPECT_EQ(h.delta.norm(), 0.0);
      }
    }
  }
}

// Deleted rows that V_keep (nearly) spans, with the kept score 0 so that
// ad_over_as multiplies the residual by ~1e12: float32's rounding of G would
// be backfilled as if it were signal, so the fast path defers to the exact
// one below its resolution.
TEST(ObfTest, FastPathAgreesWhereFloatCannotResolveR) {
  for (int d : {16, 128}) {
    for (float noise : {0.0f, 1e-4f}) {
      std::mt19937 rng(d);
      std::normal_distribution<float> n01(0.f, 1.f);
      const int n = 200;
      Case c{n, d, std::vector<float>(static_cast<size_t>(n) * d), std::vector<double>(n, 1.0), {}};
      std::vector<float> base(static_cast<size_t>(2) * d);
      for (float& x : base) x = n01(rng);
      for (int j = 0; j < n; ++j) {
        const float a = n01(rng), b = n01(rng);
        for (int x = 0; x < d; ++x) c.v[j * d + x] = a * base[x] + b * base[d + x] + noise * n01(rng);
      }
      c.kept = {3, 7, 11};
      for (int t : c.kept) c.score[t] = 0;
      ObfOptions exact, fast;
      fast.mode = ObfMode::kFast;
      const ObfHead he = ComputeObf(exact, c.v, n, d, c.score, c.kept);
      const ObfHead hf = ComputeObf(fast, c.v, n, d, c.score, c.kept);
      EXPECT_EQ(hf.applied, he.applied) << "d=" << d << " noise " << noise;
      EXPECT_LE((hf.delta - he.delta).norm(), 1e-3 * std::max(1.0, he.delta.norm())) << "d=" << d << " noise " << noise;
    }
  }
}

// Subnormal values: no float scale brings them to unit size.
TEST(ObfTest, FastPathHandlesSubnormalValues) {
  for (float scale : {1e-40f, 1e-44f}) {
    std::vector<float> v(16);  // 4 rows of d = 4
    for (int i = 0; i < 16; ++i) v[i] = scale * static_cast<float>((i * 7 % 5) - 2 + (i % 3));
    for (ObfMode mode : {ObfMode::kExact, ObfMode::kFast}) {
      ObfOptions o;
      o.p = 2;
      o.mode = mode;
      const ObfHead h = ComputeObf(o, v, 4, 4, std::vector<double>(4, 1.0), std::vector<int>{0});
      EXPECT_FALSE(h.applied) << scale << " mode " << static_cast<int>(mode);  // ||R||_F far below 1e-10
      EXPECT_TRUE(h.delta.allFinite());
      EXPECT_TRUE(h.q.allFinite());
    }
  }
}

// Values at the float limit: the exact path's C may come out empty.
TEST(ObfTest, HugeEqualRowsGiveAFiniteResult) {
  const float big = std::numeric_limits<float>::max();
  const std::vector<float> v(6, big);  // two rows of d = 3
  for (ObfMode mode : {ObfMode::kExact, ObfMode::kFast}) {
    ObfOptions o;
    o.mode = mode;
    const ObfHead h = ComputeObf(o, v, 2, 3, std::vector<double>{1.0, 1.0}, std::vector<int>{0});
    EXPECT_TRUE(h.delta.allFinite()) << static_cast<int>(mode);
  }
}

// Deleted rows ~1e-10 of the kept ones: the fast path's vectors are tiny
// but must not overflow (their squared norms are below 1/FLT_MAX).
TEST(ObfTest, FastPathTinyResiduals) {
  for (uint32_t seed = 0; seed < 10; ++seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> n01(0.f, 1.f);
    const int d = 16 << (seed % 3), n = 2 + seed % 7;
    Case c{n, d, std::vector<float>(static_cast<size_t>(n) * d), std::vector<double>(n, 1.0), {0}};
    c.v[0] = 1.0f;  // kept row e_0
    for (int j = 1; j < n; ++j)
      for (int x = 0; x < d; ++x) c.v[j * d + x] = 5e-11f * n01(rng);
    const VectorXd ref = ReferenceDelta(ObfOptions{}, c);
    ASSERT_GT(ref.norm(), 0);
    ObfOptions o;
    o.mode = ObfMode::kFast;
    const ObfHead h = ComputeObf(o, c.v, n, d, c.score, c.kept);
    ASSERT_TRUE(h.applied) << "seed " << seed;
    EXPECT_EQ(h.c.rows(), std::min(o.p, n - 1)) << "seed " << seed;
    EXPECT_LE((h.delta - ref).norm(), 1e-3 * ref.norm()) << "seed " << seed << " d=" << d << " n=" << n;
  }
}

// G's top eigenvalue repeated exactly p times (the deleted rows are 2 e_i
// for 8 axes, then e_i for 4 more, each three times; the kept row is
// orthogonal to all of them): the top-p subspace is still unique, and both
// modes must find all of it (a Krylov method from one start vector would
// find one direction of each eigenspace).
TEST(ObfTest, RepeatedEigenvalues) {
  for (int d : {16, 64}) {
    const int n = 1 + 3 * 12;  // one kept row, three copies of 12 deleted rows
    Case c{n, d, std::vector<float>(static_cast<size_t>(n) * d, 0.0f), std::vector<double>(n), {0}};
    for (int x = 0; x < d - 12; ++x) c.v[x] = 0.25f * static_cast<float>(1 + x % 3);  // the kept row
    for (int j = 1; j < n; ++j) {
      const int axis = (j - 1) % 12;           // rows 2 e_0..2 e_7, then e_8..e_11
      c.v[j * d + d - 1 - axis] = axis < 8 ? 2.0f : 1.0f;
      c.score[j] = 1.0 + 0.1 * j;
    }
    c.score[0] = 5.0;
    const VectorXd ref = ReferenceDelta(ObfOptions{}, c);
    ASSERT_GT(ref.norm(), 0);
    for (ObfMode mode : {ObfMode::kExact, ObfMode::kFast}) {
      ObfOptions o;
      o.mode = mode;
      const ObfHead h = ComputeObf(o, c.v, n, d, c.score, c.kept);
      ASSERT_TRUE(h.applied) << "d=" << d << " mode " << static_cast<int>(mode);
      EXPECT_EQ(h.c.rows(), 8) << "d=" << d << " mode " << static_cast<int>(mode);
      EXPECT_LE((h.delta - ref).norm(), 1e-4 * ref.norm()) << "d=" << d << " mode " << static_cast<int>(mode);
    }
  }
}

}  // namespace
}  // namespace kvrelay
