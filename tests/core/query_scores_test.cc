// Scores from queries against an independent float64 computation of the
// definition in docs/FORMAT.md (step 0), and the pipeline's handling of
// gen.q and window=.
#include "core/query_scores.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "core/pipeline.h"
#include "core/quant.h"
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
// ReferenceMass: the same over every key, [H, m] (history, prompt,
// generated); Reference: the prompt's columns.
std::vector<double> ReferenceMass(const TurnLayer& layer, const TurnGeometry& geo, double scale, int window,
                                  std::vector<double>* bound = nullptr) {
  const int H = geo.kv_heads, S = geo.score_heads, d = geo.head_dim;
  const int nh = geo.n_history, np = geo.n_prompt, ng = geo.n_gen;
  const int m = nh + np + ng;
  std::vector<double> a(static_cast<size_t>(H) * m, 0.0);
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
    std::vector<double> mass(m, 0.0), err(m, 0.0);
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
      for (int i = 0; i < seen; ++i) {
        const double w = z[i] / sum;
        mass[i] += w;
        err[i] += w * (2 * dz + 8 * eps);
      }
    }
    for (int i = 0; i < m; ++i) {
      a[static_cast<size_t>(h) * m + i] += mass[i];
      if (bound) (*bound)[static_cast<size_t>(h) * m + i] += err[i];
    }
  }
  return a;
}

std::vector<double> Reference(const TurnLayer& layer, const TurnGeometry& geo, double scale, int window,
                              std::vector<double>* bound = nullptr) {
  const int H = geo.kv_heads, np = geo.n_prompt, nh = geo.n_history;
  const size_t m = static_cast<size_t>(nh) + np + geo.n_gen;
  std::vector<double> full_bound;
  const std::vector<double> full = ReferenceMass(layer, geo, scale, window, bound ? &full_bound : nullptr);
  std::vector<double> a(static_cast<size_t>(H) * np);
  if (bound) bound->resize(a.size());
  for (int h = 0; h < H; ++h) {
    for (int j = 0; j < np; ++j) {
      a[static_cast<size_t>(h) * np + j] = full[h * m + nh + j];
      if (bound) (*bound)[static_cast<size_t>(h) * np + j] = full_bound[h * m + nh + j];
    }
  }
  return a;
}

// The mass on the history and on the generated tokens (acc, FORMAT.md
// step 5): every key a step sees, generated token j only from steps t >= j.
TEST(QueryMass, MatchesTheFloat64DefinitionOnEveryKey) {
  int cases = 0;
  for (int group : {1, 4, 5}) {
    for (int window : {0, 3}) {
      TurnShape s;
      s.layers = 1;
      s.kv_heads = 2;
      s.group = group;
      s.head_dim = 16;
      s.n_prompt = 23;
      s.n_gen = 7;
      s.n_history = 9;
      s.dtype = DType::kBF16;
      s.queries = true;
      const uint64_t seed = 700 + cases++;
      Turn turn = RandomTurn(s, seed);
      absl::StatusOr<TurnGeometry> geo = GeometryOf(turn);
      ASSERT_TRUE(geo.ok()) << geo.status();
      SCOPED_TRACE(absl::StrCat("group=", group, " window=", window, " seed=", seed));
      const double scale = 0.21;
      const std::vector<double> got = QueryMass(turn.layers[0], *geo, scale, window).value();
      std::vector<double> bound;
      const std::vector<double> want = ReferenceMass(turn.layers[0], *geo, scale, window, &bound);
      ASSERT_EQ(got.size(), want.size());
      const int m = s.n_history + s.n_prompt + s.n_gen;
      for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], bound[i] + 1e-300) << "at " << i;
      // A step sees generated tokens 0..t only: the last one gets its own
      // step's weight alone (with the window: if that step is in it).
      for (int h = 0; h < s.kv_heads; ++h) {
        const double last = got[static_cast<size_t>(h) * m + m - 1];
        EXPECT_GT(last, 0);
        EXPECT_LE(last, group * (1 + 1e-9));
      }
      // Every step's weights sum to 1 over the keys it sees.
      double total = 0;
      for (double x : got) total += x;
      const int steps = window > 0 ? window : s.n_gen;
      EXPECT_NEAR(total, steps * s.kv_heads * group, 1e-6 * steps * s.kv_heads * group);
    }
  }
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
            const std::vector<double> got = QueryScores(turn.layers[0], *geo, scale, window).value();
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
  EXPECT_EQ(QueryScores(turn.layers[0], geo, scale, s.n_gen).value(), QueryScores(turn.layers[0], geo, scale, 0).value());
  EXPECT_EQ(QueryScores(turn.layers[0], geo, scale, 1 << 24).value(), QueryScores(turn.layers[0], geo, scale, 0).value());
  EXPECT_NE(QueryScores(turn.layers[0], geo, scale, 1).value(), QueryScores(turn.layers[0], geo, scale, 0).value());
  s.n_gen = 0;
  turn = RandomTurn(s, 6);
  const std::vector<double> zero = QueryScores(turn.layers[0], *GeometryOf(turn), scale, 0).value();
  EXPECT_EQ(zero, std::vector<double>(static_cast<size_t>(s.kv_heads) * s.n_prompt, 0.0));
}

// A KV head whose logits do not fit one 64 MiB block is computed in column
// blocks (one crossing from one score head to the next): the same mass as
// each score head computed alone (to float32 rounding of the logits).
TEST(QueryScores, BlocksOfColumnsGiveTheSameMass) {
  TurnShape s;
  s.layers = 1;
  s.kv_heads = 1;
  s.group = 2;
  s.head_dim = 8;
  s.n_prompt = 40000;
  s.n_gen = 250;  // 2 x 250 columns x 40,250 keys > 2^24 floats
  s.queries = true;
  const Turn turn = RandomTurn(s, 77);
  const TurnGeometry geo = *GeometryOf(turn);
  const std::vector<double> both = QueryScores(turn.layers[0], geo, 0.1, 0).value();
  std::vector<double> sum(both.size(), 0.0);
  for (int g = 0; g < 2; ++g) {
    Turn one = turn;
    one.layers[0].gen_q = KvTensor(s.q_dtype, 1, s.n_gen, s.head_dim);
    for (int t = 0; t < s.n_gen; ++t) one.layers[0].gen_q.CopyRow(0, t, turn.layers[0].gen_q, g, t);
    TurnGeometry g1 = geo;
    g1.score_heads = 1;
    const std::vector<double> m = QueryScores(one.layers[0], g1, 0.1, 0).value();
    for (size_t j = 0; j < m.size(); ++j) sum[j] += m[j];
  }
  // The GEMMs differ in shape, so the float32 logits may round differently.
  for (size_t j = 0; j < both.size(); ++j) ASSERT_NEAR(both[j], sum[j], 1e-5 * std::max(sum[j], 1e-6)) << j;
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
              HasSubstr("softmax_scale: -1, expected a finite number in [1e-06, 1000]"));
  turn.softmax_scale = 1e300;
  EXPECT_THAT(std::string((*p)->Compress(turn).status().message()),
              HasSubstr("softmax_scale: 1e+300, expected a finite number in [1e-06, 1000]"));
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

TEST(QueryScores, WorkPastTheBoundIsRefused) {
  // 1 score head x head_dim 1, 2^20 prompt tokens and 2^17 steps: about
  // 2^37 multiply-adds from an upload of a few MB.
  TurnShape s;
  s.layers = 1;
  s.kv_heads = 1;
  s.group = 1;
  s.head_dim = 1;
  s.n_prompt = 1 << 20;
  s.n_gen = 1 << 17;
  s.queries = true;
  const Turn turn = RandomTurn(s, 3);
  EXPECT_THAT(std::string(ValidateTurn(turn).message()),
              HasSubstr("layer.0.gen.q: scoring from these queries takes 1.46e+11 multiply-adds per layer"));
  s.n_gen = 1 << 15;  // 2^35: accepted
  EXPECT_TRUE(ValidateTurn(RandomTurn(s, 3)).ok());
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

// The fidelity figure from the definition, in float64, from the turn and
// the message's keys and values as the recipient holds them.
double ReferenceError(const TurnLayer& layer, const TurnGeometry& geo, const MessageLayer& msg, double scale) {
  const int H = geo.kv_heads, S = geo.score_heads, d = geo.head_dim;
  const int nh = geo.n_history, np = geo.n_prompt, ng = geo.n_gen;
  KvTensor mk = msg.k, mv = msg.v;
  if (msg.quant) {
    EXPECT_TRUE(DequantizeKv(*msg.quant, geo.dtype, &mk, &mv).ok());
  }
  const int m_msg = msg.tokens();
  auto row = [&](const KvTensor& t, int h, int i) {
    std::vector<float> f(d);
    t.ReadRow(h, i, f.data());
    return std::vector<double>(f.begin(), f.end());
  };
  auto full_kv = [&](int h, int i, bool value) {
    if (i < nh) return row(value ? layer.history_v : layer.history_k, h, i);
    if (i < nh + np) return row(value ? layer.prompt_v : layer.prompt_k, h, i - nh);
    return row(value ? layer.gen_v : layer.gen_k, h, i - nh - np);
  };
  auto output = [&](const std::vector<double>& q, int seen, const std::function<std::vector<double>(int, bool)>& kv) {
    std::vector<double> z(seen), o(d, 0.0);
    for (int i = 0; i < seen; ++i) {
      const std::vector<double> k = kv(i, false);
      double dot = 0;
      for (int c = 0; c < d; ++c) dot += q[c] * k[c];
      z[i] = dot * scale;
    }
    const double zmax = *std::max_element(z.begin(), z.end());
    double sum = 0;
    for (double& x : z) sum += (x = std::exp(x - zmax));
    for (int i = 0; i < seen; ++i) {
      const std::vector<double> v = kv(i, true);
      for (int c = 0; c < d; ++c) o[c] += z[i] / sum * v[c];
    }
    return o;
  };
  double total = 0;
  for (int qh = 0; qh < S; ++qh) {
    const int h = qh / (S / H);
    for (int t = 0; t < ng; ++t) {
      const std::vector<double> q = row(layer.gen_q, qh, t);
      const std::vector<double> of = output(q, nh + np + t + 1, [&](int i, bool v) { return full_kv(h, i, v); });
      const std::vector<double> om =
          output(q, m_msg - ng + t + 1, [&](int i, bool v) { return row(v ? mv : mk, h, i); });
      double full = 0, diff = 0;
      for (int c = 0; c < d; ++c) {
        full += of[c] * of[c];
        diff += (om[c] - of[c]) * (om[c] - of[c]);
      }
      total += std::sqrt(diff / full);
    }
  }
  return total / (S * ng);
}

TEST(AttentionOutputError, MatchesTheFloat64DefinitionAndIsZeroForFull) {
  int seed = 40;
  for (const char* spec : {"full", "h2o-head:k=6", "h2o-layer:k=6+obf:p=4", "h2o-head:k=6+obf:p=4,mode=fast+int4",
                           "gen:sinks=2"}) {
    for (int group : {1, 4}) {
      for (int history : {0, 5}) {
        TurnShape s;
        s.layers = 2;
        s.group = group;
        s.head_dim = 32;
        s.n_prompt = 30;
        s.n_gen = 5;
        s.n_history = history;
        s.dtype = DType::kBF16;
        s.queries = true;
        Turn turn = RandomTurn(s, ++seed);
        turn.softmax_scale = 0.05;  // moderate logits: a non-trivial softmax
        SCOPED_TRACE(absl::StrCat(spec, " group=", group, " history=", history, " seed=", seed));
        auto p = Pipeline::Create(spec);
        ASSERT_TRUE(p.ok());
        absl::StatusOr<Message> m = (*p)->Compress(turn);
        ASSERT_TRUE(m.ok()) << m.status();
        ASSERT_TRUE(m->attention_error.has_value());
        const TurnGeometry geo = *GeometryOf(turn);
        double sum = 0;
        for (size_t l = 0; l < turn.layers.size(); ++l) {
          const MessageLayer& ml = m->layers[l];
          ASSERT_TRUE(ml.attention_error.has_value());
          const double want = ReferenceError(turn.layers[l], geo, ml, 0.05);
          EXPECT_NEAR(*ml.attention_error, want, 1e-5 + 1e-4 * want) << "layer " << l;
          if (std::string(spec) == "full") {
            EXPECT_LT(*ml.attention_error, 1e-6);
          } else {
            EXPECT_GT(*ml.attention_error, 1e-4);
          }
          sum += *ml.attention_error;
        }
        EXPECT_DOUBLE_EQ(*m->attention_error, sum / turn.layers.size());
      }
    }
  }
}

TEST(AttentionOutputError, OnlyForTurnsWithQueries) {
  TurnShape s;
  auto p = Pipeline::Create("h2o-head:k=8");
  ASSERT_TRUE(p.ok());
  absl::StatusOr<Message> m = (*p)->Compress(RandomTurn(s, 1));
  ASSERT_TRUE(m.ok());
  EXPECT_FALSE(m->attention_error.has_value());
  EXPECT_FALSE(m->layers[0].attention_error.has_value());
  s.queries = true;
  s.n_gen = 0;  // no steps: nothing to compare, the figure is 0
  m = (*p)->Compress(RandomTurn(s, 2));
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->attention_error, 0.0);
}

}  // namespace
}  // namespace kvrelay
