#include "core/format/turn_file.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/format/safetensors.h"
#include "core/format/synthetic.h"
#include "core/history.h"
#include "core/pipeline.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"

namespace kvrelay {
namespace {

using ::testing::HasSubstr;
using testing::RandomTurn;
using testing::TurnShape;

std::string TempPath(const std::string& name) {
  return ::testing::TempDir() + "/" + name + "_" + std::to_string(getpid()) + ".safetensors";
}

void ExpectSameTurn(const Turn& a, const Turn& b) {
  EXPECT_EQ(a.first_agent, b.first_agent);
  EXPECT_EQ(a.prompt_pos0, b.prompt_pos0);
  ASSERT_EQ(a.layers.size(), b.layers.size());
  for (size_t l = 0; l < a.layers.size(); ++l) {
    SCOPED_TRACE(l);
    const TurnLayer &x = a.layers[l], &y = b.layers[l];
    EXPECT_TRUE(x.prompt_k == y.prompt_k);
    EXPECT_TRUE(x.prompt_v == y.prompt_v);
    EXPECT_TRUE(x.gen_k == y.gen_k);
    EXPECT_TRUE(x.gen_v == y.gen_v);
    EXPECT_TRUE(x.history_k == y.history_k);
    EXPECT_TRUE(x.history_v == y.history_v);
    EXPECT_TRUE(x.history_pos == y.history_pos);
    EXPECT_EQ(x.scores.rows, y.scores.rows);
    EXPECT_EQ(x.scores.cols, y.scores.cols);
    EXPECT_EQ(x.scores.data, y.scores.data);
    EXPECT_TRUE(x.gen_q == y.gen_q);
  }
  EXPECT_EQ(a.softmax_scale, b.softmax_scale);
}

void ExpectSameMessage(const Message& a, const Message& b) {
  EXPECT_EQ(a.policy, b.policy);
  EXPECT_EQ(a.dtype, b.dtype);
  EXPECT_EQ(a.kv_heads, b.kv_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.n_history, b.n_history);
  EXPECT_EQ(a.n_anchor, b.n_anchor);
  EXPECT_EQ(a.n_kept, b.n_kept);
  EXPECT_EQ(a.n_gen, b.n_gen);
  EXPECT_EQ(a.full_bytes, b.full_bytes);
  EXPECT_EQ(a.sent_bytes, b.sent_bytes);
  EXPECT_EQ(a.next_pos, b.next_pos);
  ASSERT_EQ(a.layers.size(), b.layers.size());
  for (size_t l = 0; l < a.layers.size(); ++l) {
    SCOPED_TRACE(l);
    const MessageLayer &x = a.layers[l], &y = b.layers[l];
    EXPECT_TRUE(x.pos == y.pos);
    ASSERT_EQ(x.quant.has_value(), y.quant.has_value());
    if (!x.quant) {
      EXPECT_TRUE(x.k == y.k);
      EXPECT_TRUE(x.v == y.v);
      continue;
    }
    const QuantizedKv &p = *x.quant, &q = *y.quant;
    EXPECT_EQ(p.bits, q.bits);
    EXPECT_EQ(p.group, q.group);
    EXPECT_EQ(p.rotate, q.rotate);
    EXPECT_EQ(p.dtype, q.dtype);
    for (auto [s, t] : {std::pair{&p.k, &q.k}, std::pair{&p.v, &q.v}}) {
      EXPECT_EQ(s->bits, t->bits);
      EXPECT_EQ(s->heads, t->heads);
      EXPECT_EQ(s->tokens, t->tokens);
      EXPECT_EQ(s->dim, t->dim);
      EXPECT_EQ(s->codes, t->codes);
      EXPECT_EQ(s->scale, t->scale);
      EXPECT_EQ(s->zero, t->zero);
    }
  }
}

std::string MustWriteTurn(const Turn& turn) {
  std::string out;
  absl::Status s = WriteTurn(turn, &out);
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

std::string MustWriteMessage(const Message& msg) {
  std::string out;
  absl::Status s = WriteMessage(msg, &out);
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

Message Compress(const Turn& turn, const std::string& spec) {
  auto p = Pipeline::Create(spec);
  EXPECT_TRUE(p.ok()) << p.status();
  absl::StatusOr<Message> m = (*p)->Compress(turn);
  EXPECT_TRUE(m.ok()) << m.status();
  return *std::move(m);
}

// Rewrites a valid file: `edit` may change, drop or add tensors (adding
// buffers to `store` to keep them alive) and metadata.
using Edit =
    std::function<void(std::vector<StTensor>*, StMetadata*, std::deque<std::string>* store)>;
std::string Edited(const std::string& bytes, const Edit& edit) {
  absl::StatusOr<SafetensorsReader> r = SafetensorsReader::ParseView(AsBytes(bytes));
  EXPECT_TRUE(r.ok()) << r.status();
  std::vector<StTensor> tensors = r->tensors();
  StMetadata meta = r->metadata();
  std::deque<std::string> store;
  edit(&tensors, &meta, &store);
  absl::StatusOr<std::string> out = SerializeSafetensors(tensors, meta);
  EXPECT_TRUE(out.ok()) << out.status();
  return *out;
}

StTensor* Named(std::vector<StTensor>* ts, const std::string& name) {
  for (StTensor& t : *ts) {
    if (t.name == name) return &t;
  }
  ADD_FAILURE() << "no tensor " << name;
  static StTensor dummy;
  return &dummy;
}

void Drop(std::vector<StTensor>* ts, const std::string& name) {
  size_t before = ts->size();
  ts->erase(
      std::remove_if(ts->begin(), ts->end(), [&](const StTensor& t) { return t.name == name; }),
      ts->end());
  EXPECT_EQ(ts->size() + 1, before) << name;
}

// A span of `n` bytes owned by `store`.
absl::Span<const uint8_t> Bytes(std::deque<std::string>* store, std::string data) {
  store->push_back(std::move(data));
  return AsBytes(store->back());
}

void ExpectTurnInvalid(const std::string& bytes, const std::string& substr) {
  absl::StatusOr<Turn> t = ReadTurn(AsBytes(bytes));
  ASSERT_FALSE(t.ok()) << "read unexpectedly";
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
  EXPECT_THAT(std::string(t.status().message()), HasSubstr(substr));
}

void ExpectMessageInvalid(const std::string& bytes, const std::string& substr) {
  absl::StatusOr<Message> m = ReadMessage(AsBytes(bytes));
  ASSERT_FALSE(m.ok()) << "read unexpectedly";
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_THAT(std::string(m.status().message()), HasSubstr(substr));
}

// Layers 3, kv heads 2, score heads 4, head dim 16, prompt 40, gen 5,
// history 4, BF16.
Turn GoodTurn() {
  TurnShape s;
  s.layers = 3;
  s.n_history = 4;
  s.dtype = DType::kBF16;
  return RandomTurn(s, 7);
}

// ---- Turn round trips ----

TEST(TurnFileTest, RoundTripEveryDtypeWithAndWithoutHistory) {
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (int history : {0, 6}) {
      SCOPED_TRACE(absl::StrCat(DTypeName(d), " history=", history));
      TurnShape s;
      s.dtype = d;
      s.n_history = history;
      s.layers = 3;
      s.group = 4;
      s.first_agent = history == 0;
      Turn turn = RandomTurn(s, 11 + history);
      if (history) turn.prompt_pos0 = 99;
      const std::string bytes = MustWriteTurn(turn);
      absl::StatusOr<Turn> back = ReadTurn(AsBytes(bytes));
      ASSERT_TRUE(back.ok()) << back.status();
      ExpectSameTurn(turn, *back);
      // Deterministic: writing the read turn gives the same bytes.
      EXPECT_EQ(MustWriteTurn(*back), bytes);
    }
  }
}

TEST(TurnFileTest, FileRoundTripMatchesBuffer) {
  const Turn turn = GoodTurn();
  const std::string path = TempPath("turn");
  ASSERT_TRUE(WriteTurnFile(turn, path).ok());
  absl::StatusOr<std::string> file = ReadFileToString(path);
  ASSERT_TRUE(file.ok());
  EXPECT_EQ(*file, MustWriteTurn(turn));
  absl::StatusOr<Turn> back = ReadTurnFile(path);
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSameTurn(turn, *back);
  std::remove(path.c_str());
}

TEST(TurnFileTest, MetadataDefaultsWhenAbsent) {
  TurnShape s;
  Turn turn = RandomTurn(s, 3);
  const std::string bytes =
      Edited(MustWriteTurn(turn), [](auto*, StMetadata* m, auto*) { m->clear(); });
  absl::StatusOr<Turn> back = ReadTurn(AsBytes(bytes));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->first_agent);
  EXPECT_FALSE(back->prompt_pos0.has_value());
}

TEST(TurnFileTest, MetadataValuesAreParsed) {
  const std::string bytes = Edited(MustWriteTurn(GoodTurn()), [](auto*, StMetadata* m, auto*) {
    (*m)["first_agent"] = "false";
    (*m)["prompt_pos0"] = "1234";
    (*m)["model"] = "ignored";
  });
  absl::StatusOr<Turn> back = ReadTurn(AsBytes(bytes));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_FALSE(back->first_agent);
  EXPECT_EQ(back->prompt_pos0, 1234);
}

TEST(TurnFileTest, SyntheticTurnsAreValidAndDeterministic) {
  SyntheticTurnOptions o;
  o.n_history = 10;
  o.score_heads = 8;
  absl::StatusOr<Turn> a = MakeSyntheticTurn(o);
  absl::StatusOr<Turn> b = MakeSyntheticTurn(o);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(ValidateTurn(*a).ok());
  EXPECT_EQ(MustWriteTurn(*a), MustWriteTurn(*b));
  o.seed = 2;
  absl::StatusOr<Turn> c = MakeSyntheticTurn(o);
  ASSERT_TRUE(c.ok());
  EXPECT_NE(MustWriteTurn(*a), MustWriteTurn(*c));
  for (int h = 0; h < o.kv_heads; ++h) {
    for (int t = 1; t < o.n_history; ++t) {
      EXPECT_LT(a->layers[0].history_pos.at(h, t - 1), a->layers[0].history_pos.at(h, t));
    }
  }
  o.score_heads = 3;
  EXPECT_EQ(MakeSyntheticTurn(o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TurnFileTest, WriteRejectsInvalidTurn) {
  std::string out;
  absl::Status s = WriteTurn(Turn{}, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("no layers"));
}

// ---- Malformed turns: one case each ----

TEST(TurnFileMalformedTest, NotSafetensors) {
  ExpectTurnInvalid("short", "safetensors: file is 5 bytes");
}

TEST(TurnFileMalformedTest, NoLayers) {
  ExpectTurnInvalid(Edited(MustWriteTurn(GoodTurn()),
                           [](std::vector<StTensor>* ts, auto*, auto*) { ts->clear(); }),
                    "no layer tensors");
}

// ---- Turns with queries (gen.q) ----

Turn QueryTurn(DType kv, DType q) {
  TurnShape s;
  s.layers = 3;
  s.n_history = 4;
  s.dtype = kv;
  s.queries = true;
  s.q_dtype = q;
  return RandomTurn(s, 8);
}

TEST(TurnFileTest, QueriesAndSoftmaxScaleRoundTrip) {
  for (DType kv : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (DType q : {DType::kF32, kv}) {
      SCOPED_TRACE(absl::StrCat(DTypeName(kv), " q ", DTypeName(q)));
      Turn turn = QueryTurn(kv, q);
      turn.softmax_scale = 0.1 / 3;  // needs all 17 digits to read back
      const std::string bytes = MustWriteTurn(turn);
      absl::StatusOr<Turn> back = ReadTurn(AsBytes(bytes));
      ASSERT_TRUE(back.ok()) << back.status();
      ExpectSameTurn(turn, *back);
      EXPECT_EQ(MustWriteTurn(*back), bytes);
    }
  }
}

TEST(TurnFileMalformedTest, BothScoresAndQueries) {
  const std::string with_scores = MustWriteTurn(GoodTurn());
  const std::string with_queries = MustWriteTurn(QueryTurn(DType::kBF16, DType::kF32));
  absl::StatusOr<SafetensorsReader> q = SafetensorsReader::ParseView(AsBytes(with_queries));
  ASSERT_TRUE(q.ok());
  ExpectTurnInvalid(Edited(with_scores,
                           [&](std::vector<StTensor>* ts, auto*, auto*) {
                             StTensor t = *q->Find("layer.1.gen.q");
                             ts->push_back(t);
                           }),
                    "layer.1.gen.q: given together with layer.1.prompt.score, expected exactly one of the two");
}

TEST(TurnFileMalformedTest, QueriesInSomeLayersOnly) {
  const std::string with_scores = MustWriteTurn(GoodTurn());
  const std::string with_queries = MustWriteTurn(QueryTurn(DType::kBF16, DType::kF32));
  absl::StatusOr<SafetensorsReader> q = SafetensorsReader::ParseView(AsBytes(with_queries));
  ASSERT_TRUE(q.ok());
  ExpectTurnInvalid(Edited(with_scores,
                           [&](std::vector<StTensor>* ts, auto*, auto*) {
                             Drop(ts, "layer.2.prompt.score");
                             ts->push_back(*q->Find("layer.2.gen.q"));
                           }),
                    "layer.2.gen.q: given, expected layer.2.prompt.score like layer.0");
}

TEST(TurnFileMalformedTest, QueriesOfAnotherDtypeOrShape) {
  const std::string bytes = MustWriteTurn(QueryTurn(DType::kBF16, DType::kBF16));
  ExpectTurnInvalid(Edited(bytes, [](std::vector<StTensor>* ts, auto*,
                                     auto*) { Named(ts, "layer.0.gen.q")->dtype = StDType::kF16; }),
                    "layer.0.gen.q: dtype F16, expected F32 or BF16 (the K/V dtype)");
  ExpectTurnInvalid(Edited(bytes,
                           [](std::vector<StTensor>* ts, auto*, auto*) {
                             StTensor* t = Named(ts, "layer.1.gen.q");
                             t->shape = {t->shape[0] * t->shape[1], 1, t->shape[2]};
                           }),
                    "layer.1.gen.q: shape [20,1,16], expected [4,5,16] (score heads, n_gen, head_dim)");
  ExpectTurnInvalid(Edited(bytes,
                           [](std::vector<StTensor>* ts, auto*, auto*) {
                             StTensor* t = Named(ts, "layer.0.gen.q");
                             t->shape = {t->shape[1], t->shape[0], t->shape[2]};  // [5, 4, 16]
                           }),
                    "layer.0.gen.q: 5 score heads, expected a positive multiple of 2 kv heads");
}

TEST(TurnFileMalformedTest, BadSoftmaxScale) {
  for (const char* v : {"0", "-0.1", "inf", "nan", "abc", "", "1e300", "1001", "9e-7"}) {
    SCOPED_TRACE(v);
    ExpectTurnInvalid(Edited(MustWriteTurn(QueryTurn(DType::kBF16, DType::kF32)),
                             [v](std::vector<StTensor>*, StMetadata* meta, auto*) { (*meta)["softmax_scale"] = v; }),
                      absl::StrCat("metadata softmax_scale: \"", v, "\", expected a finite decimal number in [1e-06, 1000]"));
  }
}

TEST(TurnFileMalformedTest, UnknownTensorName) {
  ExpectTurnInvalid(Edited(MustWriteTurn(GoodTurn()),
                           [](std::vector<StTensor>* ts, auto*, auto*) {
                             Named(ts, "layer.1.gen.v")->name = "layer.1.gen.w";
                           }),
                    "layer.1.gen.w: unknown tensor name, expected layer.{l}.{prompt.k");
}

TEST(TurnFileMalformedTest, ForeignTensorName) {
  ExpectTurnInvalid(Edited(MustWriteTurn(GoodTurn()),
                           [](std::vector<StTensor>* ts, auto*, auto* store) {
                             StTensor extra;
                             extra.name = "lm_head.weight";
                             extra.dtype = StDType::kU8;
                             extra.shape = {1};
                             extra.data = Bytes(store, "x");
                             ts->push_back(extra);
                           }),
                    "lm_head.weight: unknown tensor name");
}

TEST(TurnFileMalformedTest, NonCanonicalLayerIndex) {
  ExpectTurnInvalid(Edited(MustWriteTurn(GoodTurn()),
                           [](std::vector<StTensor>* ts, auto*, auto*) {
                             Named(ts, "layer.1.gen.v")->name = "layer.01.gen.v";
                           }),
                    "layer.01.gen.v: unknown tensor name");
}

TEST(TurnFileMalformedTest, LayerGap) {
  // Layers 0 and 2 only.
  ExpectTurnInvalid(Edited(MustWriteTurn(GoodTurn()),
                           [](std::vector<StTensor>* ts, auto*, auto*) {
                             std::vector<StTensor> keep;
                             for (StTensor& t : *ts) {
                               if (t.name.rfind("layer.1.", 0) != 0) keep.push_back(t);
                             }
                             *ts = keep;
                           }),
                    "layer.1: no tensors, but layer.2 exists; layers must run 0..L-1 without gaps");
}

TEST(TurnFileMalformedTest, MissingRequiredTensor) {
  ExpectTurnInvalid(
      Edited(MustWriteTurn(GoodTurn()),
             [](std::vector<StTensor>* ts, auto*, auto*) { Drop(ts, "layer.2.prompt.score"); }),
      "layer.2.prompt.score: missing, expected it or layer.2.gen.q (the queries) in every layer");
}

TEST(TurnFileMalformedTest, HistoryNotInEveryLayer) {
  ExpectTurnInvalid(Edited(MustWriteTurn(GoodTurn()),
                           [](std::vector<StTensor>* ts, auto*, auto*) {
                             Drop(ts, "layer.1.history.k");
                             Drop(ts, "layer.1.history.v");
                             Drop(ts, "layer.1.history.pos");
                           }),
                    "layer.1.history.k: missing, but layer.0 has history (history must be in "
                    "every layer or none)");
}

TEST(TurnFileMalformedTest, HistoryWithoutPositions) {
  ExpectTurnInvalid(
      Edited(MustWriteTurn(GoodTurn()),
             [](std::vector<StTensor>* ts, auto*, auto*) { Drop(ts, "layer.0.history.pos"); }),
      "layer.0.history.pos: missing, required with history");
}

TEST(TurnFileMalformedTest, PositionsWithoutHistory) {
  TurnShape s;
  s.layers = 1;
  ExpectTurnInvalid(
      Edited(MustWriteTurn(RandomTurn(s, 5)),
             [](std::vector<StTensor>* ts, auto*, auto* store) {
               StTensor pos;
               pos.name = "layer.0.history.pos";
               pos.dtype = StDType::kI32;
               pos.shape = {2, 1};
               pos.data = Bytes(store, std::string(8, '\0'));
               ts->push_back(pos);
             }),
      "layer.0.history.k: missing, required with history (layer.0.history.pos is present)");
}

// A turn for a parent carries its mass on the parent's tokens without
// history of its own: read only when asked (TurnFileOptions::on_parent),
// its shape checked when composed.
TEST(TurnFileTest, HistoryScoreForAParent) {
  TurnShape s;
  s.layers = 2;
  s.first_agent = false;
  const Message parent = Compress(RandomTurn(s, 8), "h2o-head:k=6");
  const int n = parent.layers[0].tokens();
  auto with_score = [&](int tokens) {
    return Edited(MustWriteTurn(RandomTurn(s, 9)), [&](std::vector<StTensor>* ts, auto*, auto* store) {
      for (int l = 0; l < s.layers; ++l) {
        StTensor t;
        t.name = absl::StrCat("layer.", l, ".history.score");
        t.dtype = StDType::kF32;
        t.shape = {static_cast<int64_t>(s.kv_heads * s.group), static_cast<int64_t>(tokens)};
        std::string data(4 * t.shape[0] * t.shape[1], '\0');
        for (size_t i = 0; i < data.size() / 4; ++i) {
          const float v = 0.25f * static_cast<float>(i % 5);
          std::memcpy(&data[4 * i], &v, 4);
        }
        t.data = Bytes(store, std::move(data));
        ts->push_back(t);
      }
    });
  };
  const std::string file = with_score(n);
  ExpectTurnInvalid(file, "layer.0.history.score: given without history, expected none (or a parent to compose on: "
                          "kvrelayctl compress --parent, or publish --parent)");
  TurnFileOptions on_parent;
  on_parent.on_parent = true;
  absl::StatusOr<Turn> t = ReadTurn(AsBytes(file), on_parent);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->layers[1].history_score.cols, n);
  EXPECT_EQ(t->layers[1].history_score.at(0, 1), 0.25f);
  // Standalone, the turn is not valid: the score needs the history it covers.
  absl::Status alone = ValidateTurn(*t);
  EXPECT_EQ(alone.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(alone.message()), HasSubstr(absl::StrCat("layer.0.history.score: ", n, " tokens given without history")));
  ASSERT_TRUE(ComposeOnParent(parent, &*t).ok());
  EXPECT_TRUE(ValidateTurn(*t).ok());
  // Covering another number of tokens: refused when composed.
  absl::StatusOr<Turn> other = ReadTurn(AsBytes(with_score(n + 2)), on_parent);
  ASSERT_TRUE(other.ok()) << other.status();
  absl::Status st = ComposeOnParent(parent, &*other);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), absl::StrCat("layer.0.history.score: ", n + 2, " tokens, expected the parent's ", n,
                                       " (its tokens per head)"));
  // In every layer or none, as with history: checked on the composed turn.
  absl::StatusOr<Turn> partial = ReadTurn(
      AsBytes(Edited(file, [](std::vector<StTensor>* ts, auto*, auto*) { Drop(ts, "layer.1.history.score"); })),
      on_parent);
  ASSERT_TRUE(partial.ok()) << partial.status();
  ASSERT_TRUE(ComposeOnParent(parent, &*partial).ok());
  EXPECT_EQ(ValidateTurn(*partial).message(),
            "layer.1.history.score: missing, expected it in every layer or in none (as layer.0)");
}

TEST(TurnFileMalformedTest, KvDtypeNotFloat) {
  ExpectTurnInvalid(Edited(MustWriteTurn(GoodTurn()),
                           [](std::vector<StTensor>* ts, auto*, auto*) {
                             Named(ts, "layer.0.prompt.k")->dtype = StDType::kI16;
                           }),
                    "layer.0.prompt.k: dtype I16, expected F32, F16 or BF16");
}

TEST(TurnFileMalformedTest, KvDtypeF64Rejected) {
  ExpectTurnInvalid(Edited(MustWriteTurn(GoodTurn()),
                           [](std::vector<StTensor>* ts, auto*, auto* store) {
                             StTensor* t = Named(ts, "layer.0.prompt.k");
                             t->dtype = StDType::kF64;
                             t->data = Bytes(store, std::string(t->data.size() * 4, '\0'));
                           }),
                    "layer.0.prompt.k: dtype F64, expected F32, F16 or BF16");
}

TEST(TurnFileMalformedTest, KvDtypeMismatch) {
  ExpectTurnInvalid(Edited(MustWriteTurn(GoodTurn()),
                           [](std::vector<StTensor>* ts, auto*, auto*) {
                             Named(ts, "layer.1.gen.v")->dtype = StDType::kF16;
                           }),
                    "layer.1.gen.v: dtype F16, expected BF16 (dtype of layer.0.prompt.k)");
}

TEST(TurnFileMalformedTest, ScoreDtypeNotF32) {
  ExpectTurnInvalid(Edited(MustWriteTurn(GoodTurn()),
                           [](std::vector<StTensor>* ts, auto*, auto*) {
                             StTensor* t = Named(ts, "layer.2.prompt.score");
                             t->dtype = StDType::kBF16;
                             t->data = t->data.subspan(0, t->data.size() / 2);
                           }),
                    "layer.2.prompt.score: dtype BF16, expected F32");
}

TEST(TurnFileMalformedTest, PosDtypeNotI32) {
  ExpectTurnInvalid(Edited(MustWriteTurn(GoodTurn()),
                           [](std::vector<StTensor>* ts, auto*, auto*) {
                             Named(ts, "layer.0.history.pos")->dtype = StDType::kU32;
                           }),
                    "layer.0.history.pos: dtype U32, expected I32");
}

TEST(TurnFileMalformedTest, WrongRank) {
  ExpectTurnInvalid(
      Edited(MustWriteTurn(GoodTurn()),
             [](std::vector<StTensor>* ts, auto*, auto*) {
               Named(ts, "layer.0.prompt.v")->shape = {2, 40 * 16};
             }),
      "layer.0.prompt.v: shape [2,640], expected rank 3 [kv_heads, tokens, head_dim]");
}

TEST(TurnFileMalformedTest, ShapeMismatchAcrossLayers) {
  ExpectTurnInvalid(Edited(MustWriteTurn(GoodTurn()),
                           [](std::vector<StTensor>* ts, auto*, auto*) {
                             Named(ts, "layer.2.prompt.v")->shape = {2, 80, 8};
                           }),
                    "layer.2.prompt.v: shape [2,80,8], expected [2,40,16]");
}

TEST(TurnFileMalformedTest, ScoreShapeMismatch) {
  ExpectTurnInvalid(Edited(MustWriteTurn(GoodTurn()),
                           [](std::vector<StTensor>* ts, auto*, auto*) {
                             Named(ts, "layer.1.prompt.score")->shape = {2, 80};
                           }),
                    "layer.1.prompt.score: shape [2,80], expected [4,40]");
}

TEST(TurnFileMalformedTest, NonFiniteValue) {
  ExpectTurnInvalid(Edited(MustWriteTurn(GoodTurn()),
                           [](std::vector<StTensor>* ts, auto*, auto* store) {
                             StTensor* t = Named(ts, "layer.1.gen.k");
                             std::string data(t->data.begin(), t->data.end());
                             data[0] = '\x80';  // bf16 0x7f80 = +inf (little-endian)
                             data[1] = '\x7f';
                             t->data = Bytes(store, data);
                           }),
                    "layer.1.gen.k: non-finite value inf at [0,0,0]");
}

TEST(TurnFileMalformedTest, NegativeScore) {
  ExpectTurnInvalid(Edited(MustWriteTurn(GoodTurn()),
                           [](std::vector<StTensor>* ts, auto*, auto* store) {
                             StTensor* t = Named(ts, "layer.0.prompt.score");
                             std::string data(t->data.begin(), t->data.end());
                             const float minus_one = -1.0f;
                             std::memcpy(data.data() + 4, &minus_one, 4);
                             t->data = Bytes(store, data);
                           }),
                    "layer.0.prompt.score: value -1 at [0,1]");
}

TEST(TurnFileMalformedTest, BadFirstAgent) {
  ExpectTurnInvalid(Edited(MustWriteTurn(GoodTurn()),
                           [](auto*, StMetadata* m, auto*) { (*m)["first_agent"] = "yes"; }),
                    "metadata first_agent: \"yes\", expected \"true\" or \"false\"");
  ExpectTurnInvalid(Edited(MustWriteTurn(GoodTurn()),
                           [](auto*, StMetadata* m, auto*) { (*m)["first_agent"] = "True"; }),
                    "metadata first_agent: \"True\"");
}

TEST(TurnFileMalformedTest, BadPromptPos0) {
  for (const char* v : {"-3", "12a", "", " 5", "+5", "1.5", "99999999999999999999999"}) {
    SCOPED_TRACE(v);
    ExpectTurnInvalid(
        Edited(MustWriteTurn(GoodTurn()),
               [&](auto*, StMetadata* m, auto*) { (*m)["prompt_pos0"] = v; }),
        absl::StrCat("metadata prompt_pos0: \"", v, "\", expected a decimal integer >= 0"));
  }
}

TEST(TurnFileMalformedTest, PromptPos0PastInt32) {
  ExpectTurnInvalid(Edited(MustWriteTurn(GoodTurn()),
                           [](auto*, StMetadata* m, auto*) { (*m)["prompt_pos0"] = "2147483640"; }),
                    "prompt_pos0: 2147483640 puts position ids past int32");
}

TEST(TurnFileMalformedTest, MessageIsNotATurn) {
  const std::string msg = MustWriteMessage(Compress(GoodTurn(), "full"));
  ExpectTurnInvalid(
      msg, "file is a kvrelay message (metadata format=kvrelay.message.v2), expected a turn");
}

TEST(TurnFileMalformedTest, FileErrorsNameThePath) {
  const std::string path = TempPath("bad_turn");
  const std::string bytes = Edited(MustWriteTurn(GoodTurn()),
                                   [](auto*, StMetadata* m, auto*) { (*m)["first_agent"] = "1"; });
  std::FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  std::fwrite(bytes.data(), 1, bytes.size(), f);
  std::fclose(f);
  absl::StatusOr<Turn> t = ReadTurnFile(path);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(t.status().message()), HasSubstr(path + ": metadata first_agent"));
  std::remove(path.c_str());
  EXPECT_EQ(ReadTurnFile(path).status().code(), absl::StatusCode::kNotFound);
}

// ---- Message round trips ----

TEST(MessageFileTest, DenseRoundTrip) {
  for (const char* spec : {"full", "gen", "h2o-head:k=8", "h2o-layer:k=8+obf:p=4"}) {
    SCOPED_TRACE(spec);
    const Message msg = Compress(GoodTurn(), spec);
    const std::string bytes = MustWriteMessage(msg);
    absl::StatusOr<Message> back = ReadMessage(AsBytes(bytes));
    ASSERT_TRUE(back.ok()) << back.status();
    ExpectSameMessage(msg, *back);
    EXPECT_EQ(MustWriteMessage(*back), bytes);
    EXPECT_EQ(back->sent_bytes, back->layers[0].SentBytes() * back->layers.size());
  }
}

TEST(MessageFileTest, QuantizedRoundTrip) {
  for (const char* spec : {"h2o-head:k=8+int8:group=8", "h2o-layer:k=8+int4:group=16",
                           "full+int2:group=7,rotate=hadamard", "gen+int4:rotate=hadamard"}) {
    SCOPED_TRACE(spec);
    const Message msg = Compress(GoodTurn(), spec);
    ASSERT_TRUE(msg.layers[0].quant.has_value());
    const std::string bytes = MustWriteMessage(msg);
    absl::StatusOr<Message> back = ReadMessage(AsBytes(bytes));
    ASSERT_TRUE(back.ok()) << back.status();
    ExpectSameMessage(msg, *back);
    EXPECT_EQ(MustWriteMessage(*back), bytes);
    absl::StatusOr<SafetensorsReader> file = SafetensorsReader::ParseView(AsBytes(bytes));
    ASSERT_TRUE(file.ok());
    EXPECT_TRUE(file->GetMetadata("quant_bits").has_value());
    EXPECT_NE(file->Find("layer.0.k.codes"), nullptr);
    EXPECT_EQ(file->Find("layer.0.k"), nullptr);
  }
}

TEST(MessageFileTest, MetadataKeys) {
  const Message msg = Compress(GoodTurn(), "h2o-head:k=8+int4:group=8");
  const std::string bytes = MustWriteMessage(msg);
  absl::StatusOr<SafetensorsReader> file = SafetensorsReader::ParseView(AsBytes(bytes));
  ASSERT_TRUE(file.ok());
  std::vector<std::string> keys;
  for (const auto& [k, v] : file->metadata()) keys.push_back(k);
  EXPECT_THAT(keys, ::testing::UnorderedElementsAre(
                        "format", "policy", "dtype", "n_history", "n_anchor", "n_kept", "n_gen",
                        "full_bytes", "sent_bytes", "next_pos", "anchor_pos", "quant_bits", "quant_group",
                        "quant_rotate"));
  EXPECT_EQ(*file->GetMetadata("format"), "kvrelay.message.v2");
  // GoodTurn: 4 history tokens before it, first agent: its own 4 anchors.
  EXPECT_EQ(*file->GetMetadata("anchor_pos"), "8,9,10,11");
  EXPECT_EQ(*file->GetMetadata("dtype"), "BF16");
  EXPECT_EQ(*file->GetMetadata("n_kept"), "8");
  EXPECT_EQ(*file->GetMetadata("quant_bits"), "4");
  EXPECT_EQ(*file->GetMetadata("quant_rotate"), "false");
  EXPECT_EQ(*file->GetMetadata("policy"), msg.policy);
  EXPECT_TRUE(IsMessageFile(*file));
}

// next_pos survives a round trip when the turn's tail was evicted; a file
// without the key (older writers) reads as 1 + the largest id held.
TEST(MessageFileTest, NextPosRoundTrip) {
  TurnShape s;
  s.n_gen = 0;
  Turn turn = RandomTurn(s, 8);
  for (TurnLayer& l : turn.layers) {
    for (int h = 0; h < l.scores.rows; ++h) {
      for (int j = 30; j < s.n_prompt; ++j) l.scores.at(h, j) = 0.0f;
    }
  }
  const Message msg = Compress(turn, "h2o-head:k=8,recent=0");
  ASSERT_EQ(msg.next_pos, 40);
  ASSERT_LT(HeldEnd(msg), 40);
  const std::string bytes = MustWriteMessage(msg);
  absl::StatusOr<Message> back = ReadMessage(AsBytes(bytes));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->next_pos, 40);
  absl::StatusOr<Message> old = ReadMessage(
      AsBytes(Edited(bytes, [](auto*, StMetadata* m, auto*) { m->erase("next_pos"); })));
  ASSERT_TRUE(old.ok()) << old.status();
  EXPECT_EQ(old->next_pos, HeldEnd(msg));
  // A hand-built message without next_pos is written with the ids' end.
  Message bare = msg;
  bare.next_pos = 0;
  absl::StatusOr<Message> bare_back = ReadMessage(AsBytes(MustWriteMessage(bare)));
  ASSERT_TRUE(bare_back.ok()) << bare_back.status();
  EXPECT_EQ(bare_back->next_pos, HeldEnd(msg));
}

TEST(MessageFileTest, FileRoundTrip) {
  const Message msg = Compress(GoodTurn(), "h2o-head:k=8+int4:group=8");
  const std::string path = TempPath("msg");
  ASSERT_TRUE(WriteMessageFile(msg, path).ok());
  absl::StatusOr<Message> back = ReadMessageFile(path);
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSameMessage(msg, *back);
  std::remove(path.c_str());
}

TEST(MessageFileTest, WriteRejectsInconsistentMessages) {
  std::string out;
  absl::Status s = WriteMessage(Message{}, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("no layers"));

  Message m = Compress(GoodTurn(), "h2o-head:k=8");
  m.sent_bytes += 1;
  s = WriteMessage(m, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("sent_bytes"));

  m = Compress(GoodTurn(), "h2o-head:k=8");
  m.n_kept += 1;
  s = WriteMessage(m, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("layer.0.pos: shape"));

  m = Compress(GoodTurn(), "h2o-head:k=8");
  m.dtype = DType::kF16;
  s = WriteMessage(m, &out);
  EXPECT_THAT(std::string(s.message()), HasSubstr("layer.0.k: dtype BF16, expected F16"));
}

// ---- Malformed messages: one case each ----

std::string DenseMessage() { return MustWriteMessage(Compress(GoodTurn(), "h2o-head:k=8")); }
std::string QuantMessage() {
  return MustWriteMessage(Compress(GoodTurn(), "h2o-head:k=8+int4:group=8"));
}

// A version 1 file (before acc and anchor_pos) reads with acc = 0 and the
// anchors of its own anchor part; composed on as a parent, its history's
// acc is 0 and its anchors are kept by a history budget.
TEST(MessageFileTest, Version1ReadsAsAccZero) {
  TurnShape s;
  s.layers = 2;
  const Turn first = RandomTurn(s, 3);
  const Message v2 = Compress(first, "h2o-head:k=8");
  const std::string v1 = Edited(MustWriteMessage(v2), [](std::vector<StTensor>* ts, StMetadata* m, auto*) {
    (*m)["format"] = "kvrelay.message.v1";
    m->erase("anchor_pos");
    for (int l = 0; l < 2; ++l) Drop(ts, absl::StrCat("layer.", l, ".acc"));
  });
  absl::StatusOr<Message> old = ReadMessage(AsBytes(v1));
  ASSERT_TRUE(old.ok()) << old.status();
  EXPECT_TRUE(old->layers[0].acc.empty());
  EXPECT_EQ(old->anchor_pos, v2.anchor_pos);  // the first agent's own anchors
  EXPECT_EQ(old->anchor_pos, (std::vector<int32_t>{0, 1, 2, 3}));
  // acc in a v1 file is refused; a v2 file without acc reads as acc = 0.
  const std::string bad = Edited(v1, [&](std::vector<StTensor>* ts, auto*, auto*) {
    StTensor acc = *Named(ts, "layer.0.pos");
    acc.name = "layer.0.acc";
    acc.dtype = StDType::kF32;
    ts->push_back(acc);
  });
  EXPECT_THAT(std::string(ReadMessage(AsBytes(bad)).status().message()),
              HasSubstr("layer.0.acc: unexpected in a kvrelay.message.v1 file"));

  // A v1 file whose anchor part the other heads or layers do not hold
  // (found by the fuzzer): no anchors known, and it writes back as v2.
  const std::string odd = Edited(v1, [](std::vector<StTensor>* ts, auto*, std::deque<std::string>* store) {
    StTensor* pos = Named(ts, "layer.1.pos");
    store->emplace_back(reinterpret_cast<const char*>(pos->data.data()), pos->data.size());
    const int32_t moved = -7;  // head 0 of layer 1 no longer holds anchor 0
    std::memcpy(store->back().data(), &moved, sizeof moved);
    pos->data = AsBytes(store->back());
  });
  absl::StatusOr<Message> odd_msg = ReadMessage(AsBytes(odd));
  ASSERT_TRUE(odd_msg.ok()) << odd_msg.status();
  EXPECT_TRUE(odd_msg->anchor_pos.empty());
  std::string rewritten;
  ASSERT_TRUE(WriteMessage(*odd_msg, &rewritten).ok());
  EXPECT_TRUE(ReadMessage(AsBytes(rewritten)).ok());

  Turn child = RandomTurn(s, 4);
  ASSERT_TRUE(ComposeOnParent(*old, &child).ok());
  for (const TurnLayer& l : child.layers) {
    for (float a : l.history_acc.data) ASSERT_EQ(a, 0.0f);
  }
  const Message m = Compress(child, "h2o-head:k=8,hist=2");
  EXPECT_EQ(m.anchor_pos, (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(m.n_history, 4 + 2);
  for (int h = 0; h < m.kv_heads; ++h) {
    for (int j = 0; j < 4; ++j) EXPECT_EQ(m.layers[0].pos.at(h, j), j);  // the anchors, first
  }
}

TEST(MessageFileMalformedTest, TurnIsNotAMessage) {
  ExpectMessageInvalid(
      MustWriteTurn(GoodTurn()),
      "metadata format: missing, expected \"kvrelay.message.v2\" (is this a turn?)");
}

TEST(MessageFileMalformedTest, WrongFormat) {
  ExpectMessageInvalid(Edited(DenseMessage(), [](auto*, StMetadata* m,
                                                 auto*) { (*m)["format"] = "kvrelay.message.v3"; }),
                       "metadata format: \"kvrelay.message.v3\", expected \"kvrelay.message.v2\" or "
                       "\"kvrelay.message.v1\"");
}

TEST(MessageFileMalformedTest, MissingPolicy) {
  ExpectMessageInvalid(
      Edited(DenseMessage(), [](auto*, StMetadata* m, auto*) { m->erase("policy"); }),
      "metadata policy: missing");
}

TEST(MessageFileMalformedTest, BadDtype) {
  ExpectMessageInvalid(
      Edited(DenseMessage(), [](auto*, StMetadata* m, auto*) { (*m)["dtype"] = "I32"; }),
      "metadata dtype: \"I32\", expected F32, F16 or BF16");
}

TEST(MessageFileMalformedTest, BadTokenCount) {
  ExpectMessageInvalid(
      Edited(DenseMessage(), [](auto*, StMetadata* m, auto*) { (*m)["n_kept"] = "eight"; }),
      "metadata n_kept: \"eight\", expected a decimal integer >= 0");
  ExpectMessageInvalid(
      Edited(DenseMessage(), [](auto*, StMetadata* m, auto*) { m->erase("n_gen"); }),
      "metadata n_gen: missing");
}

TEST(MessageFileMalformedTest, TokenCountsDisagreeWithTensors) {
  ExpectMessageInvalid(
      Edited(DenseMessage(), [](auto*, StMetadata* m, auto*) { (*m)["n_kept"] = "9"; }),
      "layer.0.pos: shape [2,21], expected [2,22]");
}

TEST(MessageFileMalformedTest, BadByteCounts) {
  ExpectMessageInvalid(
      Edited(DenseMessage(), [](auto*, StMetadata* m, auto*) { (*m)["full_bytes"] = "-1"; }),
      "metadata full_bytes: \"-1\", expected a decimal integer >= 0");
  ExpectMessageInvalid(
      Edited(DenseMessage(), [](auto*, StMetadata* m, auto*) { (*m)["sent_bytes"] = "5"; }),
      "metadata sent_bytes: \"5\", expected \"");
}

TEST(MessageFileMalformedTest, BadNextPos) {
  // GoodTurn: prompt_pos0 8, 40 prompt + 5 generated tokens, so next_pos
  // must be at least 53.
  ExpectMessageInvalid(
      Edited(DenseMessage(), [](auto*, StMetadata* m, auto*) { (*m)["next_pos"] = "48"; }),
      "metadata next_pos: \"48\", expected a decimal integer 53..2^31 (1 + the largest position id held");
  ExpectMessageInvalid(
      Edited(DenseMessage(), [](auto*, StMetadata* m, auto*) { (*m)["next_pos"] = "-1"; }),
      "metadata next_pos: \"-1\", expected a decimal integer 53..2^31");
  ExpectMessageInvalid(
      Edited(DenseMessage(), [](auto*, StMetadata* m, auto*) { (*m)["next_pos"] = "2147483649"; }),
      "metadata next_pos: \"2147483649\", expected a decimal integer 53..2^31");
}

TEST(MessageFileMalformedTest, PartialQuantMetadata) {
  ExpectMessageInvalid(
      Edited(QuantMessage(), [](auto*, StMetadata* m, auto*) { m->erase("quant_group"); }),
      "metadata quant_group: missing");
}

TEST(MessageFileMalformedTest, BadQuantBits) {
  ExpectMessageInvalid(
      Edited(QuantMessage(), [](auto*, StMetadata* m, auto*) { (*m)["quant_bits"] = "3"; }),
      "metadata quant_bits: \"3\", expected 2, 4 or 8");
}

TEST(MessageFileMalformedTest, BadQuantRotate) {
  ExpectMessageInvalid(
      Edited(QuantMessage(), [](auto*, StMetadata* m, auto*) { (*m)["quant_rotate"] = "no"; }),
      "metadata quant_rotate: \"no\", expected \"true\" or \"false\"");
}

// Options no decoder takes (DequantizeKv would refuse them): refused on read.
TEST(MessageFileMalformedTest, QuantOptionsThatCannotBeDecoded) {
  ExpectMessageInvalid(Edited(QuantMessage(),
                              [](auto*, StMetadata* m, auto*) {
                                (*m)["quant_bits"] = "8";
                                (*m)["quant_rotate"] = "true";
                              }),
                       "metadata quant_*: quant: rotate=hadamard needs 4 or 2 bits, got bits=8");
}

// A message with no tokens costs no bytes whatever its header claims; the
// turn's bounds on kv heads and head_dim still apply (head_dim * bits
// overflowed int when the message was written back).
TEST(MessageFileMalformedTest, GeometryBeyondTheTurnBounds) {
  auto empty = [](int64_t heads, int64_t dim) {
    return [heads, dim](std::vector<StTensor>* ts, StMetadata* m, auto*) {
      for (const char* key : {"n_history", "n_anchor", "n_kept", "n_gen", "sent_bytes"}) (*m)[key] = "0";
      m->erase("next_pos");
      (*m)["anchor_pos"] = "";
      for (StTensor& t : *ts) {
        t.data = {};
        if (t.shape.size() == 2) t.shape = {heads, 0};
        if (t.shape.size() == 3) t.shape = {heads, 0, dim};
      }
    };
  };
  ExpectMessageInvalid(Edited(DenseMessage(), empty(1025, 16)), "expected 1..1024 kv heads");
  ExpectMessageInvalid(Edited(DenseMessage(), empty(2, 2147483647)), "expected head_dim in 1..1024");
  // At the bounds it reads, and writes back.
  absl::StatusOr<Message> m = ReadMessage(AsBytes(Edited(DenseMessage(), empty(1024, 1024))));
  ASSERT_TRUE(m.ok()) << m.status();
  std::string out;
  EXPECT_TRUE(WriteMessage(*m, &out).ok());
}

TEST(MessageFileMalformedTest, DenseTensorInQuantizedMessage) {
  ExpectMessageInvalid(
      Edited(QuantMessage(), [](std::vector<StTensor>* ts, auto*,
                                auto*) { Named(ts, "layer.1.k.codes")->name = "layer.1.k"; }),
      "layer.1.k: unexpected in this message (by its quant_* and n_demoted metadata), expected k.codes, k.scale, k.zero");
}

TEST(MessageFileMalformedTest, PackedTensorInDenseMessage) {
  ExpectMessageInvalid(Edited(QuantMessage(),
                              [](auto*, StMetadata* m, auto*) {
                                m->erase("quant_bits");
                                m->erase("quant_group");
                                m->erase("quant_rotate");
                              }),
                       "unexpected in this message (by its quant_* and n_demoted metadata), expected k, v, pos");
}

TEST(MessageFileMalformedTest, MissingTensor) {
  ExpectMessageInvalid(Edited(DenseMessage(), [](std::vector<StTensor>* ts, auto*,
                                                 auto*) { Drop(ts, "layer.2.v"); }),
                       "layer.2.v: missing, required in every layer");
}

TEST(MessageFileMalformedTest, UnknownTensorName) {
  ExpectMessageInvalid(
      Edited(DenseMessage(), [](std::vector<StTensor>* ts, auto*,
                                auto*) { Named(ts, "layer.0.v")->name = "layer.0.w"; }),
      "layer.0.w: unknown tensor name");
}

TEST(MessageFileMalformedTest, KvDtypeDisagreesWithMetadata) {
  ExpectMessageInvalid(
      Edited(DenseMessage(), [](std::vector<StTensor>* ts, auto*,
                                auto*) { Named(ts, "layer.1.v")->dtype = StDType::kF16; }),
      "layer.1.v: dtype F16, expected BF16 (metadata dtype)");
}

TEST(MessageFileMalformedTest, PosDtype) {
  ExpectMessageInvalid(
      Edited(DenseMessage(), [](std::vector<StTensor>* ts, auto*,
                                auto*) { Named(ts, "layer.0.pos")->dtype = StDType::kU32; }),
      "layer.0.pos: dtype U32, expected I32");
}

TEST(MessageFileMalformedTest, KvShapeMismatch) {
  ExpectMessageInvalid(Edited(DenseMessage(),
                              [](std::vector<StTensor>* ts, auto*, auto*) {
                                Named(ts, "layer.2.k")->shape = {2, 42, 8};
                              }),
                       "layer.2.k: shape [2,42,8], expected [2,21,16]");
}

TEST(MessageFileMalformedTest, KeyScaleShape) {
  ExpectMessageInvalid(Edited(QuantMessage(),
                              [](std::vector<StTensor>* ts, auto*, auto*) {
                                StTensor* t = Named(ts, "layer.1.k.scale");
                                t->shape = {2, 1, t->shape[1] * t->shape[2]};
                              }),
                       "layer.1.k.scale: shape [2,1,48], expected [2,3,16]");
}

TEST(MessageFileMalformedTest, CodesDtype) {
  ExpectMessageInvalid(
      Edited(QuantMessage(), [](std::vector<StTensor>* ts, auto*,
                                auto*) { Named(ts, "layer.0.v.codes")->dtype = StDType::kI8; }),
      "layer.0.v.codes: dtype I8, expected U8");
}

}  // namespace
}  // namespace kvrelay

namespace kvrelay {
namespace {

// Truncations and byte flips of valid files must give a status, never a
// crash (run under ASan/UBSan to make this meaningful).
TEST(FormatRobustnessTest, CorruptedFilesNeverCrash) {
  const std::string files[] = {MustWriteTurn(GoodTurn()),
                               MustWriteMessage(Compress(GoodTurn(), "h2o-head:k=8")),
                               MustWriteMessage(Compress(GoodTurn(), "h2o-head:k=8+int4:group=8"))};
  uint64_t state = 12345;
  auto next = [&state] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return state >> 33;
  };
  int failures = 0, total = 0;
  for (const std::string& good : files) {
    for (size_t len = 0; len < good.size(); len += 1 + good.size() / 97) {
      const std::string cut = good.substr(0, len);
      failures += !ReadTurn(AsBytes(cut)).ok();
      failures += !ReadMessage(AsBytes(cut)).ok();
      total += 2;
    }
    for (int i = 0; i < 400; ++i) {
      std::string bad = good;
      // Mostly hit the header, where the structure is.
      const size_t limit = i % 4 == 0 ? bad.size() : std::min<size_t>(bad.size(), 2048);
      for (int flips = 1 + next() % 3; flips > 0; --flips) {
        bad[next() % limit] = static_cast<char>(next() & 0xff);
      }
      (void)ReadTurn(AsBytes(bad));
      (void)ReadMessage(AsBytes(bad));
    }
  }
  EXPECT_EQ(failures, total);  // every strict truncation is an error
}

}  // namespace
}  // namespace kvrelay
