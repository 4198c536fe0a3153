#include "core/lloyd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/budget.h"
#include "core/dtype.h"
#include "core/format/synthetic.h"
#include "core/format/turn_file.h"
#include "core/message.h"
#include "core/pipeline.h"
#include "core/quant.h"
#include "core/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvrelay {
namespace {

using ::testing::HasSubstr;

double Phi(double x) { return std::exp(-x * x / 2) / std::sqrt(2 * M_PI); }
double Cdf(double x) { return 0.5 * (1 + std::erf(x / std::sqrt(2.0))); }

// Each level is the centroid of N(0,1) over its cell (the Lloyd-Max
// condition), computed in closed form in float64.
TEST(LloydCodebookTest, LevelsAreCentroidsOfTheirCells) {
  for (int bits = 1; bits <= 4; ++bits) {
    absl::Span<const float> half = LloydLevels(bits);
    ASSERT_EQ(half.size(), size_t{1} << (bits - 1));
    std::vector<double> c;
    for (auto it = half.rbegin(); it != half.rend(); ++it) c.push_back(-*it);
    for (float x : half) c.push_back(x);
    for (size_t j = 0; j < c.size(); ++j) {
      const double lo = j == 0 ? -INFINITY : (c[j - 1] + c[j]) / 2;
      const double hi = j + 1 == c.size() ? INFINITY : (c[j] + c[j + 1]) / 2;
      const double centroid = (Phi(lo) - Phi(hi)) / (Cdf(hi) - Cdf(lo));
      EXPECT_NEAR(c[j], centroid, 2e-6) << bits << " bits, level " << j;
    }
  }
}

KvTensor GaussianRows(int heads, int tokens, int dim, uint64_t seed, float scale = 1.0f) {
  KvTensor t(DType::kF32, heads, tokens, dim);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, scale);
  std::vector<float> row(dim);
  for (int h = 0; h < heads; ++h) {
    for (int i = 0; i < tokens; ++i) {
      for (float& x : row) x = n(rng);
      t.WriteRow(h, i, row.data());
    }
  }
  return t;
}

// The relative distortion on Gaussian rows is the Lloyd-Max quantizer's
// (rotation keeps them Gaussian), about 0.3634, 0.1175, 0.03454, 0.009497.
TEST(LloydRowsTest, DistortionIsLloydMaxOnGaussianRows) {
  const double expected[] = {0, 0.3634, 0.1175, 0.03454, 0.009497};
  for (int bits = 1; bits <= 4; ++bits) {
    for (uint64_t seed : {1ull, 77ull}) {
      const KvTensor x = GaussianRows(2, 200, 128, seed);
      QuantizedTensor q;
      ASSERT_TRUE(LloydQuantizeRows(x, bits, seed, "k", &q).ok());
      ASSERT_TRUE(CheckLloydTensor(q, "k", bits, false, 0).ok());
      EXPECT_EQ(q.codes.size(), size_t{2} * 200 * 128 * bits / 8);
      KvTensor y(DType::kF32, 2, 200, 128);
      LloydDecodeRows(q, seed, &y);
      double err = 0, norm = 0;
      std::vector<float> a(128), b(128);
      for (int h = 0; h < 2; ++h) {
        for (int t = 0; t < 200; ++t) {
          x.ReadRow(h, t, a.data());
          y.ReadRow(h, t, b.data());
          for (int i = 0; i < 128; ++i) {
            err += (a[i] - b[i]) * static_cast<double>(a[i] - b[i]);
            norm += a[i] * static_cast<double>(a[i]);
          }
        }
      }
      EXPECT_NEAR(err / norm, expected[bits], 0.12 * expected[bits]) << bits << " bits, seed " << seed;
    }
  }
}

// A wrong seed decodes garbage: the signs are part of the code.
TEST(LloydRowsTest, DecodingNeedsTheSeed) {
  const KvTensor x = GaussianRows(1, 50, 64, 3);
  QuantizedTensor q;
  ASSERT_TRUE(LloydQuantizeRows(x, 4, 11, "v", &q).ok());
  KvTensor right(DType::kF32, 1, 50, 64), wrong(DType::kF32, 1, 50, 64);
  LloydDecodeRows(q, 11, &right);
  LloydDecodeRows(q, 12, &wrong);
  double e_right = 0, e_wrong = 0;
  std::vector<float> a(64), b(64), c(64);
  for (int t = 0; t < 50; ++t) {
    x.ReadRow(0, t, a.data());
    right.ReadRow(0, t, b.data());
    wrong.ReadRow(0, t, c.data());
    for (int i = 0; i < 64; ++i) {
      e_right += std::pow(a[i] - b[i], 2);
      e_wrong += std::pow(a[i] - c[i], 2);
    }
  }
  EXPECT_LT(e_right * 20, e_wrong);
}

TEST(LloydRowsTest, RefusesNonFiniteRowsAndNormsPastFp16) {
  KvTensor x = GaussianRows(2, 4, 64, 5);
  std::vector<float> row(64, 1.0f);
  row[7] = NAN;
  x.WriteRow(1, 3, row.data());
  QuantizedTensor q;
  absl::Status s = LloydQuantizeRows(x, 2, 1, "k", &q);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("k head 1 token 3"));
  std::fill(row.begin(), row.end(), 1e4f);  // norm 8e4 > 65504
  x.WriteRow(1, 3, row.data());
  s = LloydQuantizeRows(x, 2, 1, "v", &q);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("does not fit in fp16"));
}

// Keys per channel remove each channel's offset: a channel with a large
// constant bias costs nothing.
TEST(LloydChannelsTest, ChannelOffsetsAreFree) {
  KvTensor x = GaussianRows(1, 64, 32, 9);
  std::vector<float> row(32);
  for (int t = 0; t < 64; ++t) {
    x.ReadRow(0, t, row.data());
    row[5] += 40.0f;
    x.WriteRow(0, t, row.data());
  }
  QuantizedTensor q;
  ASSERT_TRUE(LloydQuantizeChannels(x, 3, 16, "k", &q).ok());
  ASSERT_TRUE(CheckLloydTensor(q, "k", 3, true, 16).ok());
  KvTensor y(DType::kF32, 1, 64, 32);
  LloydDecodeChannels(q, 16, &y);
  std::vector<float> a(32), b(32);
  double err = 0, var = 0;
  for (int t = 0; t < 64; ++t) {
    x.ReadRow(0, t, a.data());
    y.ReadRow(0, t, b.data());
    err += std::pow(a[5] - b[5], 2);
    var += std::pow(a[5] - 40.0f, 2);
  }
  EXPECT_LT(err / var, 0.06);  // 3-bit Lloyd-Max: ~0.035 of the variance
}

Turn SmallTurn(uint64_t seed, int head_dim = 64) {
  SyntheticTurnOptions o;
  o.layers = 3;
  o.kv_heads = 2;
  o.head_dim = head_dim;
  o.n_prompt = 60;
  o.n_gen = 6;
  o.seed = seed;
  o.queries = seed % 2 == 0;
  absl::StatusOr<Turn> t = MakeSyntheticTurn(o);
  EXPECT_TRUE(t.ok()) << t.status();
  return *std::move(t);
}

Message CompressOrDie(const Turn& turn, const std::string& spec) {
  absl::StatusOr<std::unique_ptr<Pipeline>> p = Pipeline::Create(spec);
  EXPECT_TRUE(p.ok()) << p.status();
  absl::StatusOr<Message> m = (*p)->Compress(turn);
  EXPECT_TRUE(m.ok()) << spec << ": " << m.status();
  return *std::move(m);
}

// Demotion keeps every prompt token: the top k exactly as without it, the
// others decoded from B bits and merged by position.
TEST(DemoteTest, KeepsEveryPromptTokenAndTheTopKUnchanged) {
  for (uint64_t seed : {1ull, 2ull, 3ull}) {
    const Turn turn = SmallTurn(seed);
    const Message evict = CompressOrDie(turn, "h2o-head:k=8");
    Message demote = CompressOrDie(turn, "h2o-head:k=8+demote:bits=3");
    EXPECT_EQ(demote.n_kept, 8);
    EXPECT_EQ(demote.n_demoted, 60 - 4 - 8);
    EXPECT_EQ(demote.demote_bits, 3);
    EXPECT_EQ(demote.layers[0].tokens(), evict.layers[0].tokens() + demote.n_demoted);
    // Bytes: the evicting message plus codes, norms and ids of the demoted.
    const uint64_t per_token = 2 * (64 * 3 / 8 + 2) + 4;
    EXPECT_EQ(demote.sent_bytes, evict.sent_bytes + 3ull * 2 * demote.n_demoted * per_token);
    ASSERT_TRUE(DequantizeMessage(&demote, DType::kBF16).ok());
    EXPECT_EQ(demote.n_kept, 56);
    EXPECT_EQ(demote.n_demoted, 0);
    for (size_t l = 0; l < demote.layers.size(); ++l) {
      const MessageLayer& d = demote.layers[l];
      const MessageLayer& e = evict.layers[l];
      for (int h = 0; h < 2; ++h) {
        // Every prompt id once, ascending, then the generated tokens.
        for (int t = 0; t < 66; ++t) EXPECT_EQ(d.pos.at(h, t), t) << l << " " << h;
        // The kept rows are the evicting message's, bit for bit.
        for (int t = 0; t < e.tokens(); ++t) {
          const int id = e.pos.at(h, t);
          EXPECT_EQ(0, std::memcmp(d.k.row(h, id), e.k.row(h, t), e.k.row_bytes()));
          EXPECT_EQ(0, std::memcmp(d.v.row(h, id), e.v.row(h, t), e.v.row_bytes()));
        }
      }
    }
  }
}

// The fidelity figure of a demoting message lies between eviction's and the
// full cache's (0): the dropped tokens come back, approximately.
TEST(DemoteTest, FidelityBetweenEvictionAndFull) {
  const Turn turn = SmallTurn(2);
  const Message evict = CompressOrDie(turn, "h2o-head:k=8");
  const Message demote = CompressOrDie(turn, "h2o-head:k=8+demote:bits=4");
  ASSERT_TRUE(evict.attention_error && demote.attention_error);
  EXPECT_LT(*demote.attention_error, *evict.attention_error / 4);
}

TEST(DemoteTest, SpecRulesNameTheStage) {
  for (const auto& [spec, what] : std::vector<std::pair<std::string, std::string>>{
           {"h2o-head:k=8+demote+obf:p=4", "exclude each other"},
           {"h2o-head:k=8+obf:p=4+demote", "exclude each other"},
           {"full+demote", "needs h2o-layer, h2o-head or h2o-auto"},
           {"h2o-head+demote:bits=5", "bits=5: expected an integer in [1, 4]"},
           {"h2o-head+int4+demote", "must come before the quantizer"},
           {"h2o-head+demote+demote", "given twice"},
           {"full+lloyd:bits=0", "bits=0"},
           {"full+lloyd:keys=col", "keys=col: expected one of row, channel"},
           {"full+lloyd:group=8", "keys=channel"},
           {"full+lloyd:seed=-1", "seed=-1"},
           {"full+lloyd+int4", "a second quantizer"}}) {
    absl::StatusOr<std::unique_ptr<Pipeline>> p = Pipeline::Create(spec);
    ASSERT_FALSE(p.ok()) << spec;
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << spec;
    EXPECT_THAT(p.status().message(), HasSubstr(what)) << spec;
  }
  absl::StatusOr<std::unique_ptr<Pipeline>> p = Pipeline::Create("h2o-head:k=8+demote+lloyd:bits=3,seed=9");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ((*p)->spec(), "h2o-head:k=8,sinks=4,recent=0+demote:bits=2+lloyd:bits=3,keys=row,seed=9");
}

// Lloyd needs a power-of-two head_dim; a turn of another is refused naming
// the stage, for the quantizer and for demotion alike.
TEST(LloydPipelineTest, RefusesHeadDimThatIsNotAPowerOfTwo) {
  const Turn turn = SmallTurn(1, /*head_dim=*/48);
  for (const char* spec : {"full+lloyd:bits=2", "h2o-head:k=4+demote:bits=2"}) {
    absl::StatusOr<Message> m = (*Pipeline::Create(spec))->Compress(turn);
    ASSERT_FALSE(m.ok()) << spec;
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(m.status().message(), HasSubstr("power-of-two head_dim")) << spec;
  }
}

// Message files hold lloyd and demoted layers and read back equal.
TEST(LloydFileTest, MessageFilesRoundTrip) {
  for (const char* spec : {"full+lloyd:bits=3,seed=4", "full+lloyd:bits=2,keys=channel,group=8",
                           "h2o-head:k=8+demote:bits=2+int4", "h2o-layer:k=4+demote:bits=1",
                           "h2o-head:k=8,recent=2+demote:bits=3+lloyd:bits=4,seed=7"}) {
    const Message m = CompressOrDie(SmallTurn(2), spec);
    std::string bytes;
    ASSERT_TRUE(WriteMessage(m, &bytes).ok()) << spec;
    absl::StatusOr<Message> back =
        ReadMessage(absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
    ASSERT_TRUE(back.ok()) << spec << ": " << back.status();
    EXPECT_EQ(back->n_demoted, m.n_demoted);
    EXPECT_EQ(back->demote_bits, m.demote_bits);
    EXPECT_EQ(back->sent_bytes, m.sent_bytes);
    std::string again;
    ASSERT_TRUE(WriteMessage(*back, &again).ok());
    EXPECT_EQ(again, bytes) << spec;
    // Decoding what was read equals decoding the original.
    absl::StatusOr<Message> a = DecodedMessage(m), b = DecodedMessage(*back);
    ASSERT_TRUE(a.ok() && b.ok());
    for (size_t l = 0; l < a->layers.size(); ++l) {
      EXPECT_EQ(a->layers[l].k.bytes().size(), b->layers[l].k.bytes().size());
      EXPECT_TRUE(std::equal(a->layers[l].k.bytes().begin(), a->layers[l].k.bytes().end(),
                             b->layers[l].k.bytes().begin()));
      EXPECT_EQ(a->layers[l].pos.data, b->layers[l].pos.data);
    }
  }
}

// lloyd:layers= gives each layer its keys' and values' bits: the codes,
// the bytes and the decoded rows are those of lloyd at those bits, layer by
// layer, and the message file carries them (quant_layer_bits).
TEST(LloydLayerBitsTest, EachLayerKeysAndValuesAtTheirOwnBits) {
  const Turn turn = SmallTurn(4);
  const Message m = CompressOrDie(turn, "h2o-head:k=16+demote:bits=1+lloyd:seed=9,layers=41.23.33");
  EXPECT_EQ(m.policy, "h2o-head:k=16,sinks=4,recent=0+demote:bits=1+lloyd:keys=row,seed=9,layers=41.23.33");
  const std::pair<int, int> want[] = {{4, 1}, {2, 3}, {3, 3}};
  for (size_t l = 0; l < 3; ++l) {
    const QuantizedKv& q = *m.layers[l].quant;
    EXPECT_EQ(q.k.bits, want[l].first) << l;
    EXPECT_EQ(q.v.bits, want[l].second) << l;
    EXPECT_EQ(q.VBits(), want[l].second) << l;
    // Each tensor as lloyd at its bits makes it alone.
    for (int b : {want[l].first, want[l].second}) {
      const Message uniform =
          CompressOrDie(turn, absl::StrCat("h2o-head:k=16+demote:bits=1+lloyd:bits=", b, ",seed=9"));
      const QuantizedKv& u = *uniform.layers[l].quant;
      if (b == want[l].first) {
        EXPECT_EQ(q.k.codes, u.k.codes) << l;
      }
      if (b == want[l].second) {
        EXPECT_EQ(q.v.codes, u.v.codes) << l;
      }
    }
  }
  uint64_t sent = 0;
  for (const MessageLayer& layer : m.layers) sent += layer.SentBytes();
  EXPECT_EQ(m.sent_bytes, sent);
  std::string bytes;
  ASSERT_TRUE(WriteMessage(m, &bytes).ok());
  EXPECT_NE(bytes.find("\"quant_layer_bits\":\"41.23.33\""), std::string::npos);
  absl::StatusOr<Message> back =
      ReadMessage(absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
  ASSERT_TRUE(back.ok()) << back.status();
  std::string again;
  ASSERT_TRUE(WriteMessage(*back, &again).ok());
  EXPECT_EQ(again, bytes);
  absl::StatusOr<Message> a = DecodedMessage(m), b = DecodedMessage(*back);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  for (size_t l = 0; l < 3; ++l) EXPECT_TRUE(a->layers[l].v == b->layers[l].v) << l;
  // Uniform bits write no quant_layer_bits.
  ASSERT_TRUE(WriteMessage(CompressOrDie(turn, "full+lloyd:layers=22.22.22"), &bytes).ok());
  EXPECT_EQ(bytes.find("quant_layer_bits"), std::string::npos);
}

// A layer that keeps no token (gen:sinks=0 with nothing generated) has no
// codes and no norms, and decodes to an empty layer.
TEST(LloydLayerBitsTest, LayersWithoutTokensDecode) {
  SyntheticTurnOptions o;
  o.layers = 3;
  o.kv_heads = 2;
  o.head_dim = 16;
  o.n_prompt = 2;
  o.n_gen = 0;
  absl::StatusOr<Turn> turn = MakeSyntheticTurn(o);
  ASSERT_TRUE(turn.ok()) << turn.status();
  for (const char* spec : {"gen:sinks=0+lloyd:layers=21.12.22", "gen:sinks=0+lloyd:bits=3,keys=channel,group=4",
                           "gen:sinks=0+lloyd:bits=1"}) {
    const Message m = CompressOrDie(*turn, spec);
    absl::StatusOr<Message> d = DecodedMessage(m);
    ASSERT_TRUE(d.ok()) << spec << ": " << d.status();
    for (const MessageLayer& layer : d->layers) EXPECT_EQ(layer.k.tokens(), 0) << spec;
  }
}

TEST(LloydLayerBitsTest, RefusalsNameTheEntryAndTheCount) {
  for (const auto& [spec, what] : std::vector<std::pair<std::string, std::string>>{
           {"full+lloyd:layers=45", "layers=45: entry '45' of layer 0, expected two digits 1..4"},
           {"full+lloyd:layers=44.3", "entry '3' of layer 1"},
           {"full+lloyd:layers=", "entry '' of layer 0"},
           {"full+int4:layers=44", "unknown parameter 'layers'"},
           {"full+lloyd:bits=3,layers=44", "bits: given with layers=, expected one of them"}}) {
    absl::StatusOr<std::unique_ptr<Pipeline>> p = Pipeline::Create(spec);
    ASSERT_FALSE(p.ok()) << spec;
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << spec;
    EXPECT_THAT(p.status().message(), HasSubstr(what)) << spec;
  }
  std::unique_ptr<Pipeline> two = *Pipeline::Create("full+lloyd:layers=44.33");
  absl::StatusOr<Message> m = two->Compress(SmallTurn(3));
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("lloyd:layers= gives 2 layers, expected one per layer of the turn (3)"));
  // A relay's message header has one quant_bits: relays refuse it.
  EXPECT_EQ(two->CheckLayerwise().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(two->CheckLayerwise().message(), HasSubstr("compress it offline"));
}

}  // namespace
}  // namespace kvrelay

namespace kvrelay {
namespace {

// auto:budget=F never exceeds F of the bf16 bytes of full, picks exactly
// the setting ChooseBudget names, and a larger budget never gives a larger
// estimated error.
TEST(BudgetTest, FitsTheBudgetAndMoreBudgetNeverEstimatesWorse) {
  std::mt19937_64 rng(2026);
  for (int trial = 0; trial < 6; ++trial) {
    SyntheticTurnOptions o;
    o.layers = 2;
    o.kv_heads = 2;
    o.head_dim = trial % 2 ? 64 : 32;
    o.n_prompt = 40 + static_cast<int>(rng() % 200);
    o.n_gen = 1 + static_cast<int>(rng() % 8);
    o.seed = rng();
    o.queries = trial % 3 == 0;
    o.first_agent = trial != 4;
    absl::StatusOr<Turn> turn = MakeSyntheticTurn(o);
    ASSERT_TRUE(turn.ok()) << turn.status();
    absl::StatusOr<std::vector<BudgetCandidate>> grid = BudgetCandidates(*turn);
    ASSERT_TRUE(grid.ok()) << grid.status();
    double last_error = 2;
    std::uniform_real_distribution<double> u(0.03, 1.0);
    std::vector<double> budgets = {u(rng), u(rng), u(rng), u(rng), 0.1, 1.0};
    std::sort(budgets.begin(), budgets.end());
    for (double f : budgets) {
      const std::string spec = absl::StrCat("auto:budget=", f);
      absl::StatusOr<Message> m = (*Pipeline::Create(spec))->Compress(*turn);
      const uint64_t full = m.ok() ? m->full_bytes : 0;
      absl::StatusOr<BudgetCandidate> best = ChooseBudget(*grid, full ? full : 1, f);
      if (!m.ok()) {
        EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << spec;
        EXPECT_THAT(m.status().message(), HasSubstr("expected budget >= ")) << spec;
        continue;
      }
      ASSERT_TRUE(best.ok()) << spec;
      EXPECT_LE(static_cast<double>(m->sent_bytes), f * static_cast<double>(m->full_bytes)) << spec;
      EXPECT_EQ(m->sent_bytes, best->bytes) << spec << " chose " << best->Spec();
      EXPECT_EQ(m->policy, (*Pipeline::Create(best->Spec()))->spec()) << spec;
      EXPECT_LE(best->error, last_error) << spec;
      last_error = best->error;
    }
  }
}

// The sensitivities predict what lloyd does to the sender's own attention
// output (the fidelity figure, measured with real codes): per layer, the
// error with the keys at B bits (values at 4) within a factor of 1.9 and
// with the values at B bits (keys at 4) within 1.4, and at 1 and 2 bits
// (where the other tensor's 4 bits add little) which of the two is larger
// wherever the prediction differs by a third.
TEST(BudgetTest, SensitivityPredictsTheMeasuredError) {
  SyntheticTurnOptions o;
  o.layers = 3;
  o.kv_heads = 2;
  o.score_heads = 4;
  o.head_dim = 64;
  o.n_prompt = 120;
  o.n_gen = 4;  // every step is sampled
  o.queries = true;
  o.seed = 8;
  absl::StatusOr<Turn> turn = MakeSyntheticTurn(o);
  ASSERT_TRUE(turn.ok()) << turn.status();
  // Layer 0's keys x3, layer 2's x1/3: sharper and flatter attention.
  for (auto [l, f] : {std::pair<int, float>{0, 3.0f}, {2, 1.0f / 3}}) {
    TurnLayer& layer = turn->layers[l];
    for (KvTensor* t : {&layer.prompt_k, &layer.gen_k}) {
      std::vector<float> row(t->dim());
      for (int h = 0; h < t->heads(); ++h) {
        for (int j = 0; j < t->tokens(); ++j) {
          t->ReadRow(h, j, row.data());
          for (float& x : row) x *= f;
          t->WriteRow(h, j, row.data());
        }
      }
    }
  }
  absl::StatusOr<TurnGeometry> geo = GeometryOf(*turn);
  ASSERT_TRUE(geo.ok());
  const std::vector<QuantSensitivity> sens = QuantSensitivities(*turn, *geo);
  ASSERT_EQ(sens.size(), 3u);
  int ordered = 0;
  for (int b = 1; b <= 2; ++b) {
    const Message keys = CompressOrDie(*turn, absl::StrCat("full+lloyd:layers=", b, 4, ".", b, 4, ".", b, 4));
    const Message values = CompressOrDie(*turn, absl::StrCat("full+lloyd:layers=4", b, ".4", b, ".4", b));
    for (int l = 0; l < 3; ++l) {
      const double mk = *keys.layers[l].attention_error, mv = *values.layers[l].attention_error;
      const double pk = sens[l].k[b], pv = sens[l].v[b];
      const std::string where = absl::StrCat("bits ", b, " layer ", l, ": keys predicted ", pk, " measured ", mk,
                                             "; values predicted ", pv, " measured ", mv);
      EXPECT_LT(std::max(pk, mk) / std::min(pk, mk), 1.9) << where;
      EXPECT_LT(std::max(pv, mv) / std::min(pv, mv), 1.4) << where;
      if (std::max(pk, pv) > 1.33 * std::min(pk, pv)) {
        ++ordered;
        EXPECT_EQ(pk > pv, mk > mv) << where;
      }
    }
  }
  EXPECT_GE(ordered, 2);
  // Without queries: nothing measured.
  o.queries = false;
  turn = MakeSyntheticTurn(o);
  geo = GeometryOf(*turn);
  EXPECT_TRUE(QuantSensitivities(*turn, *geo).empty());
}

// The grid's allocations: per selector setting a walk from 1 bit
// everywhere, one bit of one tensor of one layer per step, each step's
// bytes exact (the message its spec makes holds them) and its estimate
// never worse than the step before.
TEST(BudgetTest, AllocationStepsAreExactAndNeverEstimateWorse) {
  SyntheticTurnOptions o;
  o.layers = 3;
  o.kv_heads = 2;
  o.score_heads = 4;
  o.head_dim = 32;
  o.n_prompt = 90;
  o.n_gen = 6;
  o.queries = true;
  o.seed = 3;
  absl::StatusOr<Turn> turn = MakeSyntheticTurn(o);
  ASSERT_TRUE(turn.ok());
  absl::StatusOr<std::vector<BudgetCandidate>> grid = BudgetCandidates(*turn);
  ASSERT_TRUE(grid.ok()) << grid.status();
  const size_t walk = 6 * o.layers + 1;
  ASSERT_EQ(grid->size() % walk, 0u);
  std::mt19937_64 rng(5);
  int mixed = 0, checked = 0;
  for (size_t i = 0; i < grid->size(); ++i) {
    const BudgetCandidate& c = (*grid)[i];
    if (i % walk == 0) {
      for (const auto& b : c.layer_bits) EXPECT_EQ(b, std::make_pair(1, 1));
    } else {
      const BudgetCandidate& prev = (*grid)[i - 1];
      EXPECT_EQ(c.k, prev.k);
      EXPECT_EQ(c.demote_bits, prev.demote_bits);
      EXPECT_LE(c.error, prev.error + 1e-12) << c.Spec();
      int moved = 0;
      for (int l = 0; l < o.layers; ++l) {
        moved += c.layer_bits[l].first - prev.layer_bits[l].first + c.layer_bits[l].second - prev.layer_bits[l].second;
      }
      EXPECT_EQ(moved, 1) << c.Spec();
    }
    bool is_mixed = false;
    for (const auto& b : c.layer_bits) is_mixed = is_mixed || b.first != b.second;
    mixed += is_mixed;
    if (i % walk == walk - 1 || rng() % 8 == 0) {
      const Message m = CompressOrDie(*turn, c.Spec());
      EXPECT_EQ(m.sent_bytes, c.bytes) << c.Spec();
      for (int l = 0; l < o.layers; ++l) {
        EXPECT_EQ(m.layers[l].quant->bits, c.layer_bits[l].first) << c.Spec();
        EXPECT_EQ(m.layers[l].quant->VBits(), c.layer_bits[l].second) << c.Spec();
      }
      ++checked;
    }
  }
  EXPECT_GT(mixed, 0);
  EXPECT_GT(checked, 10);
}

// weight=uniform weighs every prompt token alike: without gen.q its choice
// does not depend on the turn's scores, and the first setting of each walk
// (1 bit everywhere) estimates (sinks + k) / n of the prompt at 1 bit's row
// error and the other tokens at their demotion's error (1 when evicted).
// The default weighs by the scores, and its choice moves with them.
TEST(BudgetTest, UniformWeightIgnoresTheScores) {
  constexpr double kRowError[] = {1.0, 0.6028, 0.3428, 0.1859, 0.0975};
  constexpr double kSinks = 4;
  std::mt19937_64 rng(77);
  int moved = 0;
  for (int trial = 0; trial < 4; ++trial) {
    SyntheticTurnOptions o;
    o.layers = 2;
    o.kv_heads = 2;
    o.head_dim = 32;
    o.n_prompt = 60 + static_cast<int>(rng() % 150);
    o.n_gen = 2;
    o.seed = rng();
    absl::StatusOr<Turn> turn = MakeSyntheticTurn(o);
    ASSERT_TRUE(turn.ok()) << turn.status();
    ASSERT_TRUE(turn->first_agent);
    Turn sharp = *turn;  // the same turn, its attention on a few tokens
    for (TurnLayer& layer : sharp.layers) {
      for (float& x : layer.scores.data) x = (rng() % 16 == 0) ? 50.0f : 0.01f;
    }
    absl::StatusOr<std::vector<BudgetCandidate>> grid = BudgetCandidates(*turn, BudgetWeight::kUniform);
    ASSERT_TRUE(grid.ok()) << grid.status();
    const double n = o.n_prompt;
    int firsts = 0;
    for (const BudgetCandidate& c : *grid) {
      bool first = true;
      for (const auto& b : c.layer_bits) first = first && b == std::make_pair(1, 1);
      if (!first) continue;
      ++firsts;
      const double kept = c.k < 0 ? n : kSinks + c.k;
      const double want = kept / n * kRowError[1] + (n - kept) / n * kRowError[c.demote_bits];
      EXPECT_NEAR(c.error, want, 1e-12) << c.Spec();
    }
    EXPECT_GT(firsts, 4);
    for (double f : {0.08, 0.12, 0.2, 0.35}) {
      const std::string uniform = absl::StrCat("auto:budget=", f, ",weight=uniform");
      absl::StatusOr<Message> a = (*Pipeline::Create(uniform))->Compress(*turn);
      absl::StatusOr<Message> b = (*Pipeline::Create(uniform))->Compress(sharp);
      ASSERT_EQ(a.ok(), b.ok()) << f;
      if (!a.ok()) continue;
      EXPECT_LE(static_cast<double>(a->sent_bytes), f * static_cast<double>(a->full_bytes)) << f;
      EXPECT_EQ(a->policy, b->policy) << f;
      absl::StatusOr<Message> c = (*Pipeline::Create(absl::StrCat("auto:budget=", f)))->Compress(*turn);
      absl::StatusOr<Message> d = (*Pipeline::Create(absl::StrCat("auto:budget=", f)))->Compress(sharp);
      if (c.ok() && d.ok() && c->policy != d->policy) ++moved;
    }
  }
  EXPECT_GT(moved, 0);  // the scores matter to the default: the comparison can fail
}

TEST(BudgetTest, ABudgetBelowTheSmallestSettingNamesTheMinimum) {
  const Turn turn = SmallTurn(1);
  absl::StatusOr<Message> m = (*Pipeline::Create("auto:budget=0.001"))->Compress(turn);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("budget=0.001 is below the smallest setting"));
  EXPECT_THAT(m.status().message(), HasSubstr("expected budget >= 0.0"));
}

TEST(BudgetTest, SpecRulesAndLayerwiseRefusal) {
  for (const auto& [spec, what] : std::vector<std::pair<std::string, std::string>>{
           {"auto", "budget: missing"},
           {"auto:budget=0", "budget=0: expected a decimal number in [1e-06, 1]"},
           {"auto:budget=1.5", "budget=1.5"},
           {"auto:budget=0.1+lloyd:bits=2", "give auto:budget=F alone"},
           {"auto:budget=0.1,k=3", "unknown parameter 'k'"},
           {"auto:budget=0.1,weight=equal", "weight=equal: expected one of attention, uniform"}}) {
    absl::StatusOr<std::unique_ptr<Pipeline>> p = Pipeline::Create(spec);
    ASSERT_FALSE(p.ok()) << spec;
    EXPECT_THAT(p.status().message(), HasSubstr(what)) << spec;
  }
  std::unique_ptr<Pipeline> p = *Pipeline::Create("auto:budget=0.25");
  EXPECT_EQ(p->spec(), "auto:budget=0.25");
  EXPECT_EQ(p->CheckLayerwise().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*Pipeline::Create("auto:budget=0.25,weight=attention"))->spec(), "auto:budget=0.25");
  EXPECT_EQ((*Pipeline::Create("auto:weight=uniform,budget=0.25"))->spec(), "auto:budget=0.25,weight=uniform");
  EXPECT_EQ((*Pipeline::Create("auto:budget=0.25,weight=uniform"))->CheckLayerwise().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE((*Pipeline::Create("h2o-head:k=4+demote+lloyd"))->CheckLayerwise().ok());
}

}  // namespace
}  // namespace kvrelay
