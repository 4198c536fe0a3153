#include "core/selection.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

#include "gtest/gtest.h"

namespace kvrelay {
namespace {

// Brute force: stable sort by descending score, take k, sort ascending.
std::vector<int> BruteTopK(const std::vector<double>& s, int begin, int end, int k) {
  std::vector<int> idx(end - begin);
  std::iota(idx.begin(), idx.end(), begin);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return s[a] > s[b]; });
  if (k < static_cast<int>(idx.size())) idx.resize(k);
  std::sort(idx.begin(), idx.end());
  return idx;
}

TEST(TopKTest, TiesGoToLowerPosition) {
  const std::vector<double> s = {1, 5, 5, 5, 0, 5};
  EXPECT_EQ(TopK(s, 0, 6, 2), (std::vector<int>{1, 2}));
  EXPECT_EQ(TopK(s, 2, 6, 2), (std::vector<int>{2, 3}));
  EXPECT_EQ(TopK(s, 0, 6, 0), (std::vector<int>{}));
  EXPECT_EQ(TopK(s, 0, 6, 10), (std::vector<int>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(TopK(std::vector<double>(8, 0.0), 0, 8, 3), (std::vector<int>{0, 1, 2}));
}

TEST(TopKTest, MatchesBruteForceOverSeeds) {
  for (int seed = 0; seed < 200; ++seed) {
    std::mt19937 rng(seed);
    const int n = rng() % 60;
    std::vector<double> s(n);
    for (double& x : s) x = static_cast<double>(rng() % 7);  // many ties
    const int begin = n ? static_cast<int>(rng() % (n + 1)) : 0;
    const int k = rng() % 20;
    ASSERT_EQ(TopK(s, begin, n, k), BruteTopK(s, begin, n, k)) << "seed " << seed;
  }
}

TEST(TopKTest, MatchesBruteForceOnHeavyTailedScoresWithZeros) {
  // The shapes the compressor sees: hundreds of candidates, heavy tails, a
  // block of exact zeros (and -0.0, which compares equal), k up to n.
  for (int seed = 0; seed < 100; ++seed) {
    std::mt19937 rng(1000 + seed);
    std::lognormal_distribution<double> tail(0.0, 2.0);
    const int n = 1 + static_cast<int>(rng() % 600);
    std::vector<double> s(n);
    for (int j = 0; j < n; ++j) s[j] = (j % 5 == 0) ? ((j % 10 == 0) ? 0.0 : -0.0) : tail(rng);
    const int begin = static_cast<int>(rng() % n);
    for (int k : {1, 8, 32, n / 2, n - begin - 1, n - begin, n + 3}) {
      ASSERT_EQ(TopK(s, begin, n, k), BruteTopK(s, begin, n, k)) << "seed " << seed << " k " << k;
    }
  }
}

TEST(TopKTest, MatchesBruteForceOnLongRowsOfTiesNegativesAndOutliers) {
  // Rows long enough for the quickselect's rounds: a few distinct levels
  // (runs of ties at every pivot), negatives, infinities, subnormals, -0.0
  // beside 0.0, one outlier above uniform values, and ordered rows (a
  // recency ramp), ascending and descending, whose order the pivots sample.
  std::vector<double> levels = {-std::numeric_limits<double>::infinity(), -3.5, -1e-300, -0.0, 0.0, 4.9e-324,
                                1e-300, 0.25, 0.5, 0.5000000000000001, 7.0, 1e300,
                                std::numeric_limits<double>::infinity()};
  for (int seed = 0; seed < 400; ++seed) {
    std::mt19937 rng(5000 + seed);
    const int n = 17 + static_cast<int>(rng() % 700);
    std::vector<double> s(n);
    std::shuffle(levels.begin(), levels.end(), rng);
    const int distinct = 1 + static_cast<int>(rng() % levels.size());
    for (double& x : s) x = levels[rng() % distinct];
    switch (seed % 4) {
      case 1: {
        std::uniform_real_distribution<double> u(0.0, 1.0);
        for (double& x : s) x = u(rng);
        s[rng() % n] = 1e12;
        break;
      }
      case 2:
        for (int j = 0; j < n; ++j) s[j] = j / 3;  // ascending, with ties
        break;
      case 3:
        for (int j = 0; j < n; ++j) s[j] = n - j;  // descending
        break;
    }
    const int begin = static_cast<int>(rng() % 8);
    const int m = n - begin;
    for (int k : {1, 2, 32, m / 2, 3 * m / 4, m - 2, m - 1}) {
      ASSERT_EQ(TopK(s, begin, n, k), BruteTopK(s, begin, n, k)) << "seed " << seed << " k " << k;
    }
  }
}

TEST(TopKTest, MatchesBruteForceOnLongRowsWithNaN) {
  // Rows longer than the vector passes' blocks and the sampled rounds' small
  // case, any length modulo 4, a few NaN (which rank as -infinity), ties
  // from few levels or a ramp; k from 0 past the row's end.
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (int seed = 0; seed < 300; ++seed) {
    std::mt19937 rng(9000 + seed);
    const int n = 1 + static_cast<int>(rng() % 3000);
    const int levels = 1 + static_cast<int>(rng() % 50);
    std::vector<double> s(n);
    for (int j = 0; j < n; ++j) {
      if (rng() % 100 < 3) {
        s[j] = nan;
      } else if (seed % 5 == 0) {
        s[j] = j / 2;
      } else if (seed % 2) {
        s[j] = static_cast<double>(rng() % levels);
      } else {
        s[j] = std::ldexp(static_cast<double>(rng()), -static_cast<int>(rng() % 40));
      }
    }
    std::vector<double> ranked(s);
    for (double& x : ranked) {
      if (std::isnan(x)) x = -std::numeric_limits<double>::infinity();
    }
    const int begin = static_cast<int>(rng() % n);
    const int m = n - begin;
    for (int k : {0, 1, 3, 32, m / 7, m / 2, m - 1, n}) {
      ASSERT_EQ(TopK(s, begin, n, k), BruteTopK(ranked, begin, n, k)) << "seed " << seed << " k " << k;
    }
  }
}

std::vector<double> RandomScores(int heads, int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::exponential_distribution<double> e(1.0);
  std::vector<double> s(static_cast<size_t>(heads) * n);
  for (double& x : s) x = e(rng);
  return s;
}

TEST(SelectTest, LayerGranularitySharesOneSetAndSkipsSinks) {
  const int heads = 3, n = 50;
  auto s = RandomScores(heads, n, 1);
  for (int h = 0; h < heads; ++h) s[h * n + 0] = 1e9;  // a sink with a huge score stays an anchor
  SelectorOptions o{SelectorKind::kH2oLayer, 8, 4, 0};
  Selection sel = Select(o, s, heads, n, /*first_agent=*/true);
  EXPECT_EQ(sel.n_anchor, 4);
  std::vector<double> layer(n, 0.0);
  for (int h = 0; h < heads; ++h)
    for (int j = 0; j < n; ++j) layer[j] += s[h * n + j];
  const auto expect = BruteTopK(layer, 4, n, 8);
  for (int h = 0; h < heads; ++h) EXPECT_EQ(sel.kept[h], expect);
}

TEST(SelectTest, HeadGranularityPerHeadAndLaterAgentsHaveNoSinks) {
  const int heads = 4, n = 30;
  auto s = RandomScores(heads, n, 2);
  SelectorOptions o{SelectorKind::kH2oHead, 5, 4, 0};
  Selection sel = Select(o, s, heads, n, /*first_agent=*/false);
  EXPECT_EQ(sel.n_anchor, 0);
  for (int h = 0; h < heads; ++h) {
    std::vector<double> row(s.begin() + h * n, s.begin() + (h + 1) * n);
    EXPECT_EQ(sel.kept[h], BruteTopK(row, 0, n, 5)) << "head " << h;
  }
}

TEST(SelectTest, RecentWindowAlwaysKept) {
  const int heads = 2, n = 20;
  auto s = RandomScores(heads, n, 3);
  for (int j = 16; j < 20; ++j) s[j] = s[n + j] = 0;  // recent tokens score zero
  SelectorOptions o{SelectorKind::kH2oHead, 3, 2, 4};
  Selection sel = Select(o, s, heads, n, true);
  for (int h = 0; h < heads; ++h) {
    ASSERT_EQ(sel.kept[h].size(), 7u);
    std::vector<double> row(s.begin() + h * n, s.begin() + (h + 1) * n);
    auto top = BruteTopK(row, 2, 16, 3);
    top.insert(top.end(), {16, 17, 18, 19});
    EXPECT_EQ(sel.kept[h], top);
  }
}

TEST(SelectTest, EdgeCases) {
  // n_prompt < sinks: everything is an anchor, nothing is a candidate.
  auto s = RandomScores(1, 3, 4);
  Selection sel = Select({SelectorKind::kH2oHead, 32, 4, 0}, s, 1, 3, true);
  EXPECT_EQ(sel.n_anchor, 3);
  EXPECT_TRUE(sel.kept[0].empty());
  // k >= candidates: nothing evicted.
  s = RandomScores(2, 10, 5);
  sel = Select({SelectorKind::kH2oLayer, 32, 4, 0}, s, 2, 10, true);
  EXPECT_EQ(sel.kept[0], (std::vector<int>{4, 5, 6, 7, 8, 9}));
  // recent larger than the candidates.
  sel = Select({SelectorKind::kH2oLayer, 1, 0, 100}, s, 2, 10, false);
  EXPECT_EQ(sel.kept[1].size(), 10u);
  // gen keeps no candidate; full keeps all.
  sel = Select({SelectorKind::kGen, 32, 4, 0}, s, 2, 10, true);
  EXPECT_EQ(sel.n_anchor, 4);
  EXPECT_TRUE(sel.kept[0].empty() && sel.kept[1].empty());
  sel = Select({SelectorKind::kFull, 32, 4, 0}, s, 2, 10, false);
  EXPECT_EQ(sel.kept[1].size(), 10u);
  // Empty prompt.
  sel = Select({SelectorKind::kH2oHead, 32, 4, 0}, {}, 2, 0, true);
  EXPECT_EQ(sel.n_anchor, 0);
  EXPECT_TRUE(sel.kept[0].empty());
}

// Brute force of the pooled score: max over the clipped window.
std::vector<double> BruteMaxPool(const std::vector<double>& s, int begin, int end, int pool) {
  std::vector<double> out(s);
  const int r = pool / 2;
  for (int j = begin; j < end; ++j) {
    const int lo = std::max(begin, j - r), hi = std::min(end - 1, j + r);
    out[j] = *std::max_element(s.begin() + lo, s.begin() + hi + 1);
  }
  return out;
}

TEST(MaxPoolTest, MatchesBruteForceOverSeeds) {
  for (int seed = 0; seed < 300; ++seed) {
    std::mt19937 rng(500 + seed);
    const int n = rng() % 70;
    std::vector<double> s(n);
    for (double& x : s) x = (seed % 2) ? static_cast<double>(rng() % 5) : std::ldexp(static_cast<double>(rng() % 1000), -3);
    const int begin = n ? static_cast<int>(rng() % (n + 1)) : 0;
    const int end = begin + (n - begin ? static_cast<int>(rng() % (n - begin + 1)) : 0);
    for (int pool : {1, 3, 5, 7, 2 * n + 1, 2 * n + 5}) {
      ASSERT_EQ(MaxPool(s, begin, end, pool), BruteMaxPool(s, begin, end, pool))
          << "seed " << seed << " pool " << pool << " [" << begin << ", " << end << ")";
    }
  }
}

// Pooled selection, computed by hand. One head's scores over 12 prompt
// tokens; sinks=2 makes 0..1 anchors, recent=2 keeps 10..11, so the top-k
// range is 2..9. The anchors and the recent window score 1000: if they leaked
// into a window, positions 2 and 9 would pool to 1000 and win.
//   a          = [1000 1000 | 7 0 0 9 0 0 0 5 | 1000 1000]
//   P (pool=3) =            [ 7 7 9 9 9 0 5 5 ]   (2 and 9: windows clipped)
constexpr double kHand[12] = {1000, 1000, 7, 0, 0, 9, 0, 0, 0, 5, 1000, 1000};

TEST(SelectPoolTest, HeavyHitterBringsItsNeighboursAndWindowsClipAtTheRange) {
  std::vector<double> a(kHand, kHand + 12);
  EXPECT_EQ(MaxPool(a, 2, 10, 3), (std::vector<double>{1000, 1000, 7, 7, 9, 9, 9, 0, 5, 5, 1000, 1000}));
  SelectorOptions o{SelectorKind::kH2oHead, 3, 2, 2, 3};
  // The heavy hitter 5 brings 4 and 6.
  EXPECT_EQ(Select(o, a, 1, 12, true).kept[0], (std::vector<int>{4, 5, 6, 10, 11}));
  // Then the 7s (2, 3: the window of 2 stops at the range start), then the
  // 5s: 8 and 9 tie, the lower position goes first; 9's window stops at 9.
  o.k = 6;
  EXPECT_EQ(Select(o, a, 1, 12, true).kept[0], (std::vector<int>{2, 3, 4, 5, 6, 8, 10, 11}));
  o.k = 7;
  EXPECT_EQ(Select(o, a, 1, 12, true).kept[0], (std::vector<int>{2, 3, 4, 5, 6, 8, 9, 10, 11}));
  // pool=1: plain top-k.
  o.k = 3;
  o.pool = 1;
  EXPECT_EQ(Select(o, a, 1, 12, true).kept[0], (std::vector<int>{2, 5, 9, 10, 11}));
  // pool=5 (r=2): P = [7 9 9 9 9 9 5 5]; 5's score reaches 3..7, and the
  // ties among them go to the lower positions.
  o.pool = 5;
  EXPECT_EQ(Select(o, a, 1, 12, true).kept[0], (std::vector<int>{3, 4, 5, 10, 11}));
  // A window wider than the range: every P is the range maximum, so the
  // tie rule keeps the first k.
  o.pool = 101;
  EXPECT_EQ(Select(o, a, 1, 12, true).kept[0], (std::vector<int>{2, 3, 4, 10, 11}));
  // A later agent has no anchors: 0 and 1 join the range and pool into 2 (and
  // 1 into 0); the range is 0..9, P = [1000 1000 1000 7 9 9 9 0 5 5].
  o.pool = 3;
  EXPECT_EQ(Select(o, a, 1, 12, false).kept[0], (std::vector<int>{0, 1, 2, 10, 11}));
}

TEST(SelectPoolTest, LayerGranularityPoolsTheLayerScore) {
  // Head 0 carries kHand, head 1 a single heavy hitter at 8. The layer score
  // a = [1000 1000 | 7 0 0 9 0 0 10 5 | 1000 1000] pools to [7 7 9 9 9 10 10 10]
  // over 2..9: the layer keeps 7..9 for both heads, where head 0 alone would
  // keep 4..6.
  std::vector<double> s(24, 0.0);
  std::copy(kHand, kHand + 12, s.begin());
  s[12 + 8] = 10;
  SelectorOptions o{SelectorKind::kH2oLayer, 3, 2, 2, 3};
  const Selection sel = Select(o, s, 2, 12, true);
  EXPECT_EQ(sel.kept[0], (std::vector<int>{7, 8, 9, 10, 11}));
  EXPECT_EQ(sel.kept[1], sel.kept[0]);
  // Per head, head 1 pools its own row: 7, 8, 9.
  o.kind = SelectorKind::kH2oHead;
  const Selection head = Select(o, s, 2, 12, true);
  EXPECT_EQ(head.kept[0], (std::vector<int>{4, 5, 6, 10, 11}));
  EXPECT_EQ(head.kept[1], (std::vector<int>{7, 8, 9, 10, 11}));
}

TEST(SelectPoolTest, PoolOneIsPlainTopKOverSeeds) {
  // pool=1 selects exactly what selection without pooling selects: brute
  // top-k of the raw scores, for both granularities.
  for (int seed = 0; seed < 100; ++seed) {
    std::mt19937 rng(900 + seed);
    const int heads = 1 + rng() % 4, n = rng() % 60;
    auto s = RandomScores(heads, n, seed);
    if (seed % 3 == 0) for (double& x : s) x = std::floor(x * 2);  // ties
    const int k = rng() % 20, sinks = rng() % 6, recent = rng() % 5;
    const bool first = rng() % 2;
    for (SelectorKind kind : {SelectorKind::kH2oLayer, SelectorKind::kH2oHead}) {
      const Selection sel = Select({kind, k, sinks, recent, 1}, s, heads, n, first);
      const int begin = first ? std::min(sinks, n) : 0;
      const int end = n - std::min(recent, n - begin);
      std::vector<double> layer(n, 0.0);
      for (int h = 0; h < heads; ++h)
        for (int j = 0; j < n; ++j) layer[j] += s[h * n + j];
      for (int h = 0; h < heads; ++h) {
        std::vector<double> row = kind == SelectorKind::kH2oLayer
                                      ? layer
                                      : std::vector<double>(s.begin() + h * n, s.begin() + (h + 1) * n);
        auto want = BruteTopK(row, begin, end, k);
        for (int j = end; j < n; ++j) want.push_back(j);
        ASSERT_EQ(sel.kept[h], want) << "seed " << seed << " head " << h;
      }
    }
  }
}

TEST(SelectPoolTest, PooledSelectionMatchesBruteForceOverSeeds) {
  for (int seed = 0; seed < 100; ++seed) {
    std::mt19937 rng(1900 + seed);
    const int heads = 1 + rng() % 3, n = rng() % 60;
    auto s = RandomScores(heads, n, 77 + seed);
    const int k = rng() % 20, sinks = rng() % 6, recent = rng() % 5;
    const int pool = 1 + 2 * static_cast<int>(rng() % 5);
    const Selection sel = Select({SelectorKind::kH2oHead, k, sinks, recent, pool}, s, heads, n, true);
    const int begin = std::min(sinks, n), end = n - std::min(recent, n - begin);
    for (int h = 0; h < heads; ++h) {
      const std::vector<double> row(s.begin() + h * n, s.begin() + (h + 1) * n);
      auto want = BruteTopK(BruteMaxPool(row, begin, end, pool), begin, end, k);
      for (int j = end; j < n; ++j) want.push_back(j);
      ASSERT_EQ(sel.kept[h], want) << "seed " << seed << " head " << h << " pool " << pool;
    }
  }
}

}  // namespace
}  // namespace kvrelay
