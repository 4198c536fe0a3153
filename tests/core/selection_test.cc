#include "core/selection.h"

#include <algorithm>
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

}  // namespace
}  // namespace kvrelay
