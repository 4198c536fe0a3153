// Accumulated importance (acc), the history budget (hist=) and h2o-auto,
// against independent float64 computations of docs/FORMAT.md steps 3a, 5
// and 5a.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"
#include "core/history.h"
#include "core/message.h"
#include "core/pipeline.h"
#include "core/query_scores.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"

namespace kvrelay {
namespace {

using ::testing::HasSubstr;
using testing::RandomTurn;
using testing::TurnShape;

Message MustCompress(const Turn& turn, const std::string& spec) {
  auto p = Pipeline::Create(spec);
  EXPECT_TRUE(p.ok()) << p.status();
  absl::StatusOr<Message> m = (*p)->Compress(turn);
  EXPECT_TRUE(m.ok()) << spec << ": " << m.status();
  return m.ok() ? *std::move(m) : Message();
}

absl::Status CompressStatus(const Turn& turn, const std::string& spec) {
  auto p = Pipeline::Create(spec);
  if (!p.ok()) return p.status();
  return (*p)->Compress(turn).status();
}

// Sum over score heads of group h, in float64.
double GroupSum(const ScoreMatrix& sc, int h, int group, int j) {
  double s = 0;
  for (int g = 0; g < group; ++g) s += sc.at(h * group + g, j);
  return s;
}

// A turn with `n_hist` history tokens per head whose first two ids (0 and
// 2) are the chain's anchors in every head, random history.acc and (for
// prompt.score turns) history.score.
Turn HistoryTurn(uint64_t seed, int n_hist, bool first_agent, bool with_score, bool with_acc = true) {
  TurnShape s;
  s.layers = 2;
  s.kv_heads = 3;
  s.group = 2;
  s.head_dim = 8;
  s.n_prompt = 20;
  s.n_gen = 4;
  s.n_history = n_hist;
  s.first_agent = first_agent;
  Turn turn = RandomTurn(s, seed);
  std::mt19937_64 rng(seed * 31 + 5);
  std::exponential_distribution<float> expo(1.f);
  turn.history_anchors = {0, 2};
  for (TurnLayer& l : turn.layers) {
    for (int h = 0; h < s.kv_heads; ++h) {
      l.history_pos.at(h, 0) = 0;
      l.history_pos.at(h, 1) = 2;
    }
    if (with_acc) {
      l.history_acc = ScoreMatrix(s.kv_heads, n_hist);
      for (float& x : l.history_acc.data) x = expo(rng);
    }
    if (with_score) {
      l.history_score = ScoreMatrix(s.kv_heads * s.group, n_hist);
      for (float& x : l.history_score.data) x = expo(rng);
    }
  }
  return turn;
}

// acc after this turn for history token i of head h (FORMAT.md step 5).
float HistoryAcc(const TurnLayer& l, int h, int group, int i) {
  double a = l.history_acc.rows ? l.history_acc.at(h, i) : 0.0;
  if (l.history_score.rows) a += GroupSum(l.history_score, h, group, i);
  return static_cast<float>(a);
}

TEST(Acc, EveryTokenOfAPromptScoreTurn) {
  for (bool first : {true, false}) {
    for (bool with_score : {true, false}) {
      const Turn turn = HistoryTurn(11 + first + 2 * with_score, 10, first, with_score);
      for (const char* spec : {"h2o-head:k=5", "h2o-layer:k=5,recent=2+obf:p=2", "full", "gen"}) {
        SCOPED_TRACE(absl::StrCat(spec, " first=", first, " score=", with_score));
        const Message m = MustCompress(turn, spec);
        ASSERT_EQ(m.layers.size(), turn.layers.size());
        const int group = 2, nh = 10, n = m.layers[0].tokens();
        EXPECT_EQ(m.n_history, nh);  // no budget: the history passes whole
        for (size_t l = 0; l < m.layers.size(); ++l) {
          const TurnLayer& in = turn.layers[l];
          const MessageLayer& out = m.layers[l];
          ASSERT_EQ(out.acc.size(), static_cast<size_t>(3) * n);
          for (int h = 0; h < 3; ++h) {
            for (int t = 0; t < n; ++t) {
              const float got = out.acc[static_cast<size_t>(h) * n + t];
              float want;
              if (t < nh) {
                want = HistoryAcc(in, h, group, t);
                EXPECT_EQ(out.pos.at(h, t), in.history_pos.at(h, t));
              } else if (t < n - 4) {
                const int j = out.pos.at(h, t) - static_cast<int>(turn.PromptPos0());
                want = static_cast<float>(GroupSum(in.scores, h, group, j));
              } else {
                want = 0;  // generated: no queries, no mass
              }
              ASSERT_EQ(got, want) << "layer " << l << " head " << h << " token " << t;
            }
          }
        }
        // The chain's anchors: the history's, and the first agent's own.
        std::vector<int32_t> anchors = {0, 2};
        if (first) {
          for (int j = 0; j < 4; ++j) anchors.push_back(static_cast<int32_t>(turn.PromptPos0() + j));
        }
        EXPECT_EQ(m.anchor_pos, anchors);
      }
    }
  }
}

// Generated tokens get the mass of the steps that see them; the history's
// acc grows by the mass the queries put on it.
TEST(Acc, FromQueriesIsTheMassOnEveryKey) {
  TurnShape s;
  s.layers = 1;
  s.kv_heads = 2;
  s.group = 4;
  s.head_dim = 16;
  s.n_prompt = 17;
  s.n_gen = 6;
  s.n_history = 5;
  s.queries = true;
  s.first_agent = false;
  Turn turn = RandomTurn(s, 3);
  turn.layers[0].history_acc = ScoreMatrix(2, 5);
  for (size_t i = 0; i < 10; ++i) turn.layers[0].history_acc.data[i] = 0.25f * i;
  const Message m = MustCompress(turn, "h2o-head:k=4,window=4");
  absl::StatusOr<TurnGeometry> geo = GeometryOf(turn);
  ASSERT_TRUE(geo.ok());
  const std::vector<double> mass = QueryMass(turn.layers[0], *geo, turn.SoftmaxScale(16), 4).value();
  const int m_keys = 5 + 17 + 6, n = m.layers[0].tokens();
  ASSERT_EQ(n, 5 + 4 + 6);
  for (int h = 0; h < 2; ++h) {
    for (int t = 0; t < n; ++t) {
      const int32_t pos = m.layers[0].pos.at(h, t);
      int key;  // index among the layer's keys
      double before = 0;
      if (t < 5) {
        key = t;
        before = turn.layers[0].history_acc.at(h, t);
      } else {
        key = 5 + (pos - static_cast<int>(turn.PromptPos0()));
      }
      const float want = static_cast<float>(before + mass[static_cast<size_t>(h) * m_keys + key]);
      ASSERT_EQ(m.layers[0].acc[static_cast<size_t>(h) * n + t], want) << "head " << h << " token " << t;
    }
    // The window: generated tokens before it are seen only by steps in it.
    EXPECT_GT(m.layers[0].acc[static_cast<size_t>(h) * n + n - 1], 0);
  }
}

// hist=K keeps the anchors and the K candidates of highest acc (per head,
// or per layer by the sum over heads), ties to the earlier token.
TEST(HistoryBudget, KeepsTheAnchorsAndTheTopKByAcc) {
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    const bool first = seed % 2;
    const Turn turn = HistoryTurn(seed, 14, first, /*with_score=*/seed % 3 != 0);
    const int K = static_cast<int>(seed % 5);
    for (bool per_head : {true, false}) {
      const std::string spec = absl::StrCat(per_head ? "h2o-head" : "h2o-layer", ":k=5,hist=", K);
      SCOPED_TRACE(absl::StrCat(spec, " seed=", seed));
      const Message m = MustCompress(turn, spec);
      EXPECT_EQ(m.n_history, 2 + K);
      for (size_t l = 0; l < m.layers.size(); ++l) {
        const TurnLayer& in = turn.layers[l];
        const int n = m.layers[l].tokens();
        std::vector<std::vector<int>> want(3);
        std::vector<double> layer_score(12, 0.0);  // candidates are tokens 2..13
        for (int h = 0; h < 3; ++h) {
          for (int r = 0; r < 12; ++r) layer_score[r] += HistoryAcc(in, h, 2, 2 + r);
        }
        for (int h = 0; h < 3; ++h) {
          std::vector<int> order(12);
          std::iota(order.begin(), order.end(), 0);
          auto score = [&](int r) { return per_head ? double{HistoryAcc(in, h, 2, 2 + r)} : layer_score[r]; };
          std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return score(a) > score(b); });
          want[h] = {0, 1};
          for (int i = 0; i < K; ++i) want[h].push_back(2 + order[i]);
          std::sort(want[h].begin(), want[h].end());
          for (size_t t = 0; t < want[h].size(); ++t) {
            const int i = want[h][t];
            ASSERT_EQ(m.layers[l].pos.at(h, static_cast<int>(t)), in.history_pos.at(h, i)) << "head " << h;
            ASSERT_EQ(m.layers[l].acc[static_cast<size_t>(h) * n + t], HistoryAcc(in, h, 2, i));
            std::vector<float> got(8), src(8);
            m.layers[l].k.ReadRow(h, static_cast<int>(t), got.data());
            in.history_k.ReadRow(h, i, src.data());
            ASSERT_EQ(got, src);
          }
        }
      }
    }
  }
}

TEST(HistoryBudget, ABudgetAtLeastTheHistoryChangesNothing) {
  const Turn turn = HistoryTurn(9, 8, false, true);
  for (const char* base : {"h2o-head:k=5", "h2o-layer:k=5+obf:p=2+int4:group=4"}) {
    const std::string spec(base);
    const size_t plus = spec.find('+');
    const std::string with = plus == std::string::npos ? spec + ",hist=6"
                                                       : spec.substr(0, plus) + ",hist=6" + spec.substr(plus);
    SCOPED_TRACE(with);
    const Message a = MustCompress(turn, spec), b = MustCompress(turn, with);
    ASSERT_EQ(a.layers.size(), b.layers.size());
    EXPECT_EQ(a.sent_bytes, b.sent_bytes);
    for (size_t l = 0; l < a.layers.size(); ++l) {
      EXPECT_EQ(a.layers[l].pos, b.layers[l].pos);
      EXPECT_EQ(a.layers[l].acc, b.layers[l].acc);
      if (!a.layers[l].quant) {
        EXPECT_TRUE(std::equal(a.layers[l].v.bytes().begin(), a.layers[l].v.bytes().end(),
                               b.layers[l].v.bytes().begin(), b.layers[l].v.bytes().end()));
      } else {
        EXPECT_EQ(a.layers[l].quant->v.codes, b.layers[l].quant->v.codes);
      }
    }
  }
}

// A chain: the child's history is the parent's message; its acc goes on
// growing, the anchors travel, and the budget keeps the history flat.
TEST(HistoryBudget, AChainStaysFlatAndKeepsItsAnchors) {
  TurnShape s;
  s.layers = 2;
  s.kv_heads = 2;
  s.group = 2;
  s.head_dim = 8;
  s.n_prompt = 30;
  s.n_gen = 5;
  const std::string spec = "h2o-head:k=6,hist=10";
  Message parent;
  std::vector<uint64_t> sent;
  for (int hop = 0; hop < 6; ++hop) {
    s.first_agent = hop == 0;
    Turn turn = RandomTurn(s, 40 + hop);
    if (hop > 0) {
      ASSERT_TRUE(ComposeOnParent(parent, &turn).ok());
      // This agent's mass on the history, as an agent with eager attention
      // would report it.
      for (TurnLayer& l : turn.layers) {
        l.history_score = ScoreMatrix(4, parent.layers[0].tokens());
        for (size_t i = 0; i < l.history_score.data.size(); ++i) l.history_score.data[i] = 0.01f * (i % 7);
      }
    }
    const Message m = MustCompress(turn, spec);
    EXPECT_EQ(m.anchor_pos, (std::vector<int32_t>{0, 1, 2, 3})) << "hop " << hop;
    if (hop > 0) {
      EXPECT_EQ(m.n_history, std::min(parent.layers[0].tokens(), 4 + 10));
      // Every parent token kept carries its acc plus this turn's mass.
      for (size_t l = 0; l < m.layers.size(); ++l) {
        const MessageLayer& p = parent.layers[l];
        const MessageLayer& c = m.layers[l];
        for (int h = 0; h < 2; ++h) {
          for (int t = 0; t < m.n_history; ++t) {
            const int32_t pos = c.pos.at(h, t);
            int i = 0;
            while (p.pos.at(h, i) != pos) ++i;
            const float want = static_cast<float>(double{p.acc[static_cast<size_t>(h) * p.tokens() + i]} +
                                                  GroupSum(turn.layers[l].history_score, h, 2, i));
            ASSERT_EQ(c.acc[static_cast<size_t>(h) * c.tokens() + t], want);
          }
        }
      }
    }
    sent.push_back(m.sent_bytes);
    parent = m;
  }
  // 4 anchors + 10 history, 6 kept, 5 generated from the third hop on.
  for (size_t i = 2; i < sent.size(); ++i) EXPECT_EQ(sent[i], sent[2]) << "hop " << i;
}

// h2o-auto: per-head top-k where the mean normalised entropy of the
// candidates' scores is below tau, else per layer.
TEST(Auto, ChoosesByTheMeanNormalisedEntropy) {
  TurnShape s;
  s.layers = 3;
  s.kv_heads = 2;
  s.group = 1;
  s.head_dim = 8;
  s.n_prompt = 24;
  s.n_gen = 3;
  Turn turn = RandomTurn(s, 5);
  // Layer 0: one heavy token per head (concentrated); layer 1: uniform;
  // layer 2: the random heavy-tailed scores.
  for (float& x : turn.layers[0].scores.data) x = 0.01f;
  turn.layers[0].scores.at(0, 7) = 50;
  turn.layers[0].scores.at(1, 15) = 50;
  for (float& x : turn.layers[1].scores.data) x = 1;
  auto entropy = [&](int l) {
    double mean = 0;
    for (int h = 0; h < 2; ++h) {
      double total = 0, e = 0;
      for (int j = 4; j < 24; ++j) total += turn.layers[l].scores.at(h, j);
      for (int j = 4; j < 24; ++j) {
        const double p = turn.layers[l].scores.at(h, j) / total;
        if (p > 0) e -= p * std::log(p);
      }
      mean += e / std::log(20.0) / 2;
    }
    return mean;
  };
  EXPECT_LT(entropy(0), 0.5);
  EXPECT_NEAR(entropy(1), 1.0, 1e-12);
  for (double tau : {0.0, 0.9, 1.0}) {
    const std::string spec = absl::StrCat("h2o-auto:k=6,tau=", tau, "+obf:p=2");
    SCOPED_TRACE(spec);
    const Message a = MustCompress(turn, spec);
    const Message head = MustCompress(turn, "h2o-head:k=6+obf:p=2");
    const Message layer = MustCompress(turn, "h2o-layer:k=6+obf:p=2");
    for (int l = 0; l < 3; ++l) {
      const bool per_head = entropy(l) < tau;
      EXPECT_EQ(a.layers[l].granularity, per_head ? Granularity::kHead : Granularity::kLayer) << "layer " << l;
      const MessageLayer& want = per_head ? head.layers[l] : layer.layers[l];
      EXPECT_EQ(a.layers[l].pos, want.pos) << "layer " << l;
      EXPECT_TRUE(std::equal(a.layers[l].v.bytes().begin(), a.layers[l].v.bytes().end(), want.v.bytes().begin(),
                             want.v.bytes().end()))
          << "layer " << l;
    }
  }
}

TEST(Auto, CanonicalSpecAndBadTau) {
  auto p = Pipeline::Create("h2o-auto:k=8,tau=0.85,hist=16");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ((*p)->spec(), "h2o-auto:k=8,sinks=4,recent=0,tau=0.85,hist=16");
  auto d = Pipeline::Create("h2o-auto");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ((*d)->spec(), "h2o-auto:k=32,sinks=4,recent=0,tau=0.9");
  for (const char* bad : {"h2o-auto:tau=1.5", "h2o-auto:tau=-0.1", "h2o-auto:tau=abc", "h2o-auto:tau=nan"}) {
    auto q = Pipeline::Create(bad);
    ASSERT_FALSE(q.ok()) << bad;
    EXPECT_EQ(q.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(q.status().message()), HasSubstr("expected a decimal number in [0, 1]")) << bad;
  }
  for (const char* bad : {"h2o-head:hist=-1", "h2o-layer:hist=x", "h2o-head:tau=0.5", "full:hist=3", "gen:hist=3"}) {
    auto q = Pipeline::Create(bad);
    ASSERT_FALSE(q.ok()) << bad;
    EXPECT_EQ(q.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(HistoryInputs, BadShapesAndCombinationsAreInvalidArgument) {
  struct Case {
    const char* what;
    std::function<void(Turn*)> edit;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"acc shape", [](Turn* t) { t->layers[1].history_acc = ScoreMatrix(3, 9); },
       "layer.1.history.acc: shape [3,9], expected [3,10]"},
      {"score shape", [](Turn* t) { t->layers[0].history_score = ScoreMatrix(3, 10); },
       "layer.0.history.score: shape [3,10], expected [6,10]"},
      {"acc in one layer", [](Turn* t) { t->layers[1].history_acc = ScoreMatrix(); },
       "layer.1.history.acc: missing, expected it in every layer or in none"},
      {"negative acc", [](Turn* t) { t->layers[0].history_acc.at(2, 4) = -1; },
       "layer.0.history.acc: value -1 at [2,4], expected a finite attention mass >= 0"},
      {"nan score", [](Turn* t) { t->layers[1].history_score.at(5, 0) = std::nanf(""); },
       "layer.1.history.score: value nan at [5,0]"},
      {"anchor not held", [](Turn* t) { t->history_anchors = {0, 4}; },
       "history_anchors: position 4 is held 0 times by head 1 of layer.0.history.pos"},
      {"anchors not ascending", [](Turn* t) { t->history_anchors = {2, 0}; },
       "history_anchors: 0 at index 1, expected ascending distinct position ids >= 0"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Turn turn = HistoryTurn(21, 10, false, true);
    c.edit(&turn);
    const absl::Status s = CompressStatus(turn, "h2o-head:k=5,hist=3");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.message));
  }
  // Anchors without history.
  TurnShape s;
  Turn plain = RandomTurn(s, 1);
  plain.history_anchors = {3};
  EXPECT_THAT(std::string(CompressStatus(plain, "h2o-head").message()),
              HasSubstr("history_anchors: 1 position ids, expected none for a turn without history"));
  // history.score with queries: the relay computes that mass itself.
  s.queries = true;
  s.n_history = 4;
  Turn q = RandomTurn(s, 2);
  for (TurnLayer& l : q.layers) l.history_score = ScoreMatrix(4, 4);
  const absl::Status st = CompressStatus(q, "h2o-head");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("layer.0.history.score: given with gen.q, expected none"));
}

TEST(ComposeOnParent, RefusesAMismatchedTurn) {
  TurnShape s;
  const Message parent = MustCompress(RandomTurn(s, 1), "h2o-head:k=4");
  Turn other = RandomTurn(s, 2);
  other.layers.pop_back();
  EXPECT_THAT(std::string(ComposeOnParent(parent, &other).message()), HasSubstr("parent: 2 layers"));
  Turn early = RandomTurn(s, 3);
  early.prompt_pos0 = 3;
  EXPECT_THAT(std::string(ComposeOnParent(parent, &early).message()), HasSubstr("prompt_pos0: 3, expected >= 45"));
}

}  // namespace
}  // namespace kvrelay
