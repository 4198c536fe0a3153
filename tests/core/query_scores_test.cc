// Scores from queries against an independent float64 computation of the
// definition in docs/FORMAT.md (step 0), and the pipeline's handling of
// gen.q and window=.
#include "core/query_scores.h"

#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "core/pipeline.h"
#include "tests/core/test_util.h"

namespace kvrelay {
namespace {

using ::testing::HasSubstr;
using testing::RandomTurn;
using testing::TurnShape;

// A[h][j] straight from the definition, everything in float64; with
// `bound`, how far float32 logits may move each entry: a weight's relative
// error is at most twice the largest logit error of its step, and a float32
// dot product of length d errs by at most (d+2) 2^-24 sum_c |q_c k_c|
// (plus the exponential's and the scaling's roundings).
std::vector<double> Reference(const TurnLayer& layer, const TurnGeometry& geo, double scale, int window,
                              std::vector<double>* bound = nullptr) {
  const int H = geo.kv_heads, S = geo.score_heads, d = geo.head_dim;
  const int nh = geo.n_history, np = geo.n_prompt, ng = geo.n_gen;
  std::vector<double> a(static_cast<size_t>(H) * np, 0.0);
  if (bound) bound->assign(a.size(), 0.0);
  const double eps = std::ldexp(1.0, -24);
  std::vector<float> row(d);
  auto key = [&](int h, int i) {
    std::vector<float> f(d);
    const KvTensor& t = i < nh ? layer.history_k : i < nh + np ? layer.prompt_k : layer.gen_k;
    const int at = i < nh ? i : i < nh + np ? i - nh : i - nh - np;
    t.ReadRow(h, at, f.data());
    return std::vector<double>(f.begin(), f.end());
  };
  for (int q = 0; q < S; ++q) {
    const int h = q / (S / H);
    std::vector<double> mass(np, 0.0), err(np, 0.0);
    for (int t = 0; t < ng; ++t) {
      if (window > 0 && t < ng - window) continue;
      layer.gen_q.ReadRow(q, t, row.data());
      const int seen = nh + np + t + 1;
      std::vector<double> z(seen);
      double dz = 0;  // the step's largest logit error in float32
      for (int i = 0; i < seen; ++i) {
        const std::vector<double> k = key(h, i);
        double dot = 0, abs = 0;
        for (int c = 0; c < d; ++c) {
          dot += static_cast<double>(row[c]) * k[c];
          abs += std::fabs(static_cast<double>(row[c]) * k[c]);
        }
        z[i] = dot * scale;
        dz = std::max(dz, (d + 4) * eps * abs * scale + 4 * eps * std::fabs(z[i]));
      }
      double zmax = z[0];
      for (double x : z) zmax = std::max(zmax, x);
      double sum = 0;
      for (double& x : z) sum += (x = std::exp(x - zmax));
      for (int j = 0; j < np; ++j) {
        const double w = z[nh + j] / sum;
        mass[j] += w;
        err[j] += w * (2 * dz + 8 * eps);
      }
    }
    for (int j = 0; j < np; ++j) {
      a[static_cast<size_t>(h) * np + j] += mass[j];
      if (bound) (*bound)[static_cast<size_t>(h) * np + j] += err[j];
    }
  }
  return a;
}

TEST(QueryScores, MatchTheFloat64Definition) {
  int cases = 0;
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (int group : {1, 4, 5}) {
      for (int history : {0, 7}) {
        for (int window : {0, 2, 100}) {
          TurnShape s;
          s.layers = 1;
          s.kv_heads = 2;
          s.group = group;
          s.head_dim = 32;
          s.n_prompt = 37;
          s.n_gen = 6;
          s.n_history = history;
          s.dtype = dtype;
          s.queries = true;
          s.q_dtype = (group == 4) ? dtype : DType::kF32;
          const uint64_t seed = 100 + cases++;
          Turn turn = RandomTurn(s, seed);
          absl::StatusOr<TurnGeometry> geo = GeometryOf(turn);
          ASSERT_TRUE(geo.ok()) << geo.status();
          for (double scale : {1.0 / std::sqrt(32.0), 0.37}) {
            SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " group=", group, " history=", history, " window=", window,
                                      " scale=", scale, " seed=", seed));
            const std::vector<double> got = QueryScores(turn.layers[0], *geo, scale, window);
            std::vector<double> bound;
            const std::vector<double> want = Reference(turn.layers[0], *geo, scale, window, &bound);
            ASSERT_EQ(got.size(), want.size());
            double total = 0;
            for (size_t i = 0; i < got.size(); ++i) {
              ASSERT_NEAR(got[i], want[i], bound[i] + 1e-300) << "at " << i;
              total += want[i];
            }
            // Each step's weights sum to 1, part of it on the prompt.
            const int steps = window > 0 ? std::min(window, s.n_gen) : s.n_gen;
            EXPECT_LE(total, steps * s.kv_heads * group * (1 + 1e-9));
            EXPECT_GT(total, 0);
          }
        }
      }
    }
  }
}

TEST(QueryScores, AWindowPastTheStepsIsEveryStepAndNoStepsIsZero) {
  TurnShape s;
  s.layers = 1;
  s.queries = true;
  s.n_history = 3;
  Turn turn = RandomTurn(s, 5);
  const TurnGeometry geo = *GeometryOf(turn);
  const double scale = 0.25;
  EXPECT_EQ(QueryScores(turn.layers[0], geo, scale, s.n_gen), QueryScores(turn.layers[0], geo, scale, 0));
  EXPECT_EQ(QueryScores(turn.layers[0], geo, scale, 1 << 24), QueryScores(turn.layers[0], geo, scale, 0));
  EXPECT_NE(QueryScores(turn.layers[0], geo, scale, 1), QueryScores(turn.layers[0], geo, scale, 0));
  s.n_gen = 0;
  turn = RandomTurn(s, 6);
  const std::vector<double> zero = QueryScores(turn.layers[0], *GeometryOf(turn), scale, 0);
  EXPECT_EQ(zero, std::vector<double>(static_cast<size_t>(s.kv_heads) * s.n_prompt, 0.0));
}

TEST(QueryScores, PipelineUsesTheTurnsSoftmaxScale) {
  TurnShape s;
  s.queries = true;
  s.n_prompt = 60;
  Turn turn = RandomTurn(s, 9);
  auto p = Pipeline::Create("h2o-head:k=8");
  ASSERT_TRUE(p.ok());
  absl::StatusOr<Message> dflt = (*p)->Compress(turn);
  ASSERT_TRUE(dflt.ok()) << dflt.status();
  turn.softmax_scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  absl::StatusOr<Message> same = (*p)->Compress(turn);
  ASSERT_TRUE(same.ok());
  EXPECT_EQ(dflt->layers[0].pos.data, same->layers[0].pos.data);
  turn.softmax_scale = 20.0;  // sharper attention picks other tokens
  absl::StatusOr<Message> sharp = (*p)->Compress(turn);
  ASSERT_TRUE(sharp.ok());
  EXPECT_NE(dflt->layers[0].pos.data, sharp->layers[0].pos.data);
  turn.softmax_scale = -1.0;
  EXPECT_EQ((*p)->Compress(turn).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string((*p)->Compress(turn).status().message()),
              HasSubstr("softmax_scale: -1, expected a finite number > 0"));
}

TEST(QueryScores, FullAndGenIgnoreTheQueries) {
  TurnShape s;
  s.queries = true;
  const Turn with_q = RandomTurn(s, 12);
  Turn with_scores = with_q;  // the same K/V, scores (of 1) instead of queries
  for (TurnLayer& l : with_scores.layers) {
    l.gen_q = KvTensor();
    l.scores = ScoreMatrix(s.kv_heads * s.group, s.n_prompt);
    for (float& x : l.scores.data) x = 1;
  }
  for (const char* spec : {"full", "gen:sinks=2"}) {
    SCOPED_TRACE(spec);
    auto p = Pipeline::Create(spec);
    ASSERT_TRUE(p.ok());
    absl::StatusOr<Message> a = (*p)->Compress(with_q), b = (*p)->Compress(with_scores);
    ASSERT_TRUE(a.ok() && b.ok());
    for (size_t l = 0; l < a->layers.size(); ++l) {
      EXPECT_TRUE(a->layers[l].k == b->layers[l].k);
      EXPECT_TRUE(a->layers[l].v == b->layers[l].v);
      EXPECT_EQ(a->layers[l].pos.data, b->layers[l].pos.data);
    }
  }
}

TEST(QueryScores, WindowNeedsQueriesAndAValidValue) {
  TurnShape s;
  const Turn with_scores = RandomTurn(s, 3);
  auto p = Pipeline::Create("h2o-head:k=8,window=4");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ((*p)->spec(), "h2o-head:k=8,sinks=4,recent=0,window=4");
  absl::StatusOr<Message> m = (*p)->Compress(with_scores);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m.status().message(),
            "policy stage 'h2o-head': window=4 scores from the generated steps' queries: expected layer.0.gen.q, "
            "the turn carries layer.0.prompt.score");
  for (const char* bad : {"h2o-layer:window=0", "h2o-head:window=-1", "h2o-head:window=x"}) {
    SCOPED_TRACE(bad);
    absl::StatusOr<std::unique_ptr<Pipeline>> q = Pipeline::Create(bad);
    EXPECT_EQ(q.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(q.status().message()), HasSubstr(": expected an integer in [1, 16777216]"));
  }
  absl::StatusOr<std::unique_ptr<Pipeline>> g = Pipeline::Create("gen:window=4");
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(g.status().message()), HasSubstr("unknown parameter 'window'"));
}

TEST(QueryScores, BothOrNeitherInputIsRefused) {
  TurnShape s;
  s.queries = true;
  Turn turn = RandomTurn(s, 4);
  turn.layers[0].scores = ScoreMatrix(s.kv_heads * s.group, s.n_prompt);
  EXPECT_EQ(ValidateTurn(turn).message(),
            "layer.0.gen.q: given together with layer.0.prompt.score, expected exactly one of the two");
  turn.layers[0].scores = ScoreMatrix();
  turn.layers[1].scores = ScoreMatrix(s.kv_heads * s.group, s.n_prompt);
  EXPECT_THAT(std::string(ValidateTurn(turn).message()),
              HasSubstr("layer.1.prompt.score: given, expected layer.1.gen.q like layer.0"));
  turn.layers[1].scores = ScoreMatrix();
  turn.layers[0].gen_q = KvTensor();
  EXPECT_EQ(ValidateTurn(turn).message(),
            "layer.0.prompt.score: missing, expected layer.0.prompt.score or layer.0.gen.q (the queries)");
}

}  // namespace
}  // namespace kvrelay
