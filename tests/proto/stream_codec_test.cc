// The stream codec (proto/stream_codec.h): the upload and delivery orders,
// both readers (every malformed stream with its kind and the status each
// side maps it to), the same kind from both readers for the same fault, and
// the writer, without a relay.
#include "proto/stream_codec.h"

#include <cmath>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/crc32c.h"
#include "core/format/synthetic.h"
#include "core/format/turn_file.h"
#include "core/pipeline.h"
#include "core/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/server/relay_test_util.h"

namespace kvrelay {
namespace {

using ::testing::HasSubstr;

// ------------------------------------------------------------------ upload

using testing::TurnChunks;

struct Fixture {
  Turn turn;
  UploadShape shape;
  std::vector<v1::Chunk> chunks;
};

Fixture Make(int n_history = 0, size_t chunk_bytes = 512) {
  kvrelay::testing::TurnShape s;
  s.layers = 3;
  s.n_history = n_history;
  Fixture f;
  f.turn = kvrelay::testing::RandomTurn(s, 7);
  auto shape = CheckGeometry(testing::ProtoGeometry(f.turn), "header.geometry");
  EXPECT_TRUE(shape.ok()) << shape.status();
  f.shape = *shape;
  f.chunks = TurnChunks(f.turn, chunk_bytes);
  return f;
}

TEST(UploadReaderTest, ReassemblesEveryLayerBitExactInOrder) {
  for (int hist : {0, 6}) {
    Fixture f = Make(hist);
    UploadReader a(f.shape);
    std::vector<int> seen;
    for (const auto& c : f.chunks) {
      ASSERT_TRUE(a.Accept(c).ok());
      for (auto& [l, layer] : a.TakeCompleted()) {
        seen.push_back(l);
        const TurnLayer& want = f.turn.layers[l];
        EXPECT_EQ(layer.prompt_k, want.prompt_k);
        EXPECT_EQ(layer.prompt_v, want.prompt_v);
        EXPECT_EQ(layer.gen_k, want.gen_k);
        EXPECT_EQ(layer.gen_v, want.gen_v);
        EXPECT_EQ(layer.scores.data, want.scores.data);
        EXPECT_EQ(layer.history_k, want.history_k);
        EXPECT_EQ(layer.history_pos, want.history_pos);
      }
    }
    EXPECT_EQ(seen, (std::vector<int>{0, 1, 2}));
    EXPECT_TRUE(a.CheckCommit(testing::TrailerOf(f.chunks)).ok());
  }
}

// A turn with queries sends GEN_Q in PROMPT_SCORE's place; the codec's own
// upload order agrees with the test's independent one.
// ToProto(TurnLayout) is the inverse of CheckGeometry: every geometry that
// passes comes back field for field, its unset optional fields unset.
TEST(CheckGeometryTest, ToProtoGivesTheHeaderBack) {
  std::vector<v1::TurnGeometry> cases;
  v1::TurnGeometry g;
  g.set_layers(3);
  g.set_kv_heads(2);
  g.set_score_heads(6);
  g.set_head_dim(16);
  g.set_dtype(v1::DTYPE_F16);
  g.set_n_prompt(7);
  g.set_n_gen(2);
  cases.push_back(g);
  g.set_first_agent(true);
  g.set_prompt_pos0(0);
  cases.push_back(g);
  g.set_n_history(5);
  g.add_history_anchors(1);
  g.add_history_anchors(3);
  g.set_history_score_tokens(5);
  g.set_prompt_pos0(11);
  cases.push_back(g);
  g.set_history_score_tokens(0);
  g.set_query_dtype(v1::DTYPE_F16);  // the K/V dtype
  g.set_softmax_scale(0.125);
  g.clear_prompt_pos0();
  cases.push_back(g);
  g.set_query_dtype(v1::DTYPE_F32);
  g.set_dtype(v1::DTYPE_F32);
  cases.push_back(g);
  for (const v1::TurnGeometry& want : cases) {
    SCOPED_TRACE(want.ShortDebugString());
    absl::StatusOr<UploadShape> layout = CheckGeometry(want, "header.geometry");
    ASSERT_TRUE(layout.ok()) << layout.status();
    const v1::TurnGeometry back = ToProto(static_cast<const TurnLayout&>(*layout));
    EXPECT_EQ(back.SerializeAsString(), want.SerializeAsString());
    EXPECT_EQ(back.has_prompt_pos0(), want.has_prompt_pos0());
    EXPECT_EQ(back.has_softmax_scale(), want.has_softmax_scale());
  }
}

TEST(UploadReaderTest, QueriesTravelInsteadOfScores) {
  for (DType q : {DType::kF32, DType::kBF16}) {
    for (int hist : {0, 6}) {
      for (int n_gen : {0, 5}) {
        SCOPED_TRACE(absl::StrCat(DTypeName(q), " history=", hist, " n_gen=", n_gen));
        kvrelay::testing::TurnShape s;
        s.layers = 3;
        s.n_history = hist;
        s.n_gen = n_gen;
        s.dtype = DType::kBF16;
        s.queries = true;
        s.q_dtype = q;
        Turn turn = kvrelay::testing::RandomTurn(s, 21);
        turn.softmax_scale = 0.3;
        const v1::TurnGeometry g = testing::ProtoGeometry(turn);
        absl::StatusOr<v1::TurnGeometry> ours = TurnGeometryOf(turn);
        ASSERT_TRUE(ours.ok());
        EXPECT_EQ(ours->SerializeAsString(), g.SerializeAsString());
        absl::StatusOr<UploadShape> shape = CheckGeometry(g, "header.geometry");
        ASSERT_TRUE(shape.ok()) << shape.status();
        EXPECT_TRUE(shape->geo.queries);
        EXPECT_EQ(shape->softmax_scale, 0.3);
        const std::vector<v1::Chunk> chunks = TurnChunks(turn, 256);
        std::vector<TensorRef> order = TurnUploadOrder(turn);
        uint64_t bytes = 0;
        for (const v1::Chunk& c : chunks) {
          EXPECT_NE(c.part(), v1::PART_PROMPT_SCORE);
          bytes += c.data().size();
        }
        EXPECT_EQ(TotalBytes(order), bytes);
        EXPECT_EQ(shape->UploadBytes(), bytes);
        UploadReader r(*shape);
        int seen = 0;
        for (const v1::Chunk& c : chunks) {
          ASSERT_TRUE(r.Accept(c).ok());
          for (auto& [l, layer] : r.TakeCompleted()) {
            ++seen;
            EXPECT_EQ(layer.gen_q, turn.layers[l].gen_q);
            EXPECT_EQ(layer.scores.rows, 0);
            EXPECT_TRUE(ValidateTurnLayer(layer, l, shape->geo, turn.PromptPos0()).ok());
          }
        }
        EXPECT_EQ(seen, 3);
        EXPECT_TRUE(r.CheckCommit(testing::TrailerOf(chunks)).ok());
      }
    }
  }
}

// history.score travels right after each layer's prompt.score, sized by
// history_score_tokens: the uploaded history's tokens, or (publish with a
// parent) the parent's, which the codec cannot know.
TEST(UploadReaderTest, HistoryScoreTravelsAfterThePromptScore) {
  for (auto [hist, tokens] : {std::pair<int, int>{6, 6}, {0, 9}}) {
    SCOPED_TRACE(absl::StrCat("history=", hist, " score tokens=", tokens));
    kvrelay::testing::TurnShape s;
    s.layers = 3;
    s.n_history = hist;
    s.first_agent = hist == 0 ? false : true;
    Turn turn = kvrelay::testing::RandomTurn(s, 27);
    std::mt19937 rng(tokens);
    for (TurnLayer& l : turn.layers) {
      l.history_score = ScoreMatrix(l.scores.rows, tokens);
      for (float& v : l.history_score.data) v = std::uniform_real_distribution<float>(0, 1)(rng);
    }
    const v1::TurnGeometry g = testing::ProtoGeometry(turn);
    absl::StatusOr<v1::TurnGeometry> ours = TurnGeometryOf(turn);
    ASSERT_TRUE(ours.ok()) << ours.status();
    EXPECT_EQ(ours->history_score_tokens(), static_cast<uint32_t>(tokens));
    EXPECT_EQ(ours->SerializeAsString(), g.SerializeAsString());
    absl::StatusOr<UploadShape> shape = CheckGeometry(g, "header.geometry", /*with_parent=*/hist == 0);
    ASSERT_TRUE(shape.ok()) << shape.status();
    EXPECT_TRUE(shape->geo.history_score);
    EXPECT_EQ(shape->history_score_tokens, tokens);
    const std::vector<v1::Chunk> chunks = TurnChunks(turn, 100);
    std::vector<TensorRef> order = TurnUploadOrder(turn);
    for (size_t i = 0; i + 1 < order.size(); ++i) {
      if (order[i].part == v1::PART_PROMPT_SCORE) {
        EXPECT_EQ(order[i + 1].part, v1::PART_HISTORY_SCORE);
      }
    }
    EXPECT_EQ(TotalBytes(order), shape->UploadBytes());
    UploadReader r(*shape);
    int seen = 0;
    for (const v1::Chunk& c : chunks) {
      ASSERT_TRUE(r.Accept(c).ok()) << c.layer() << " " << PartName(c.part());
      for (auto& [l, layer] : r.TakeCompleted()) {
        ++seen;
        EXPECT_EQ(layer.history_score.rows, turn.layers[l].history_score.rows);
        EXPECT_EQ(layer.history_score.cols, tokens);
        EXPECT_EQ(layer.history_score.data, turn.layers[l].history_score.data);
      }
    }
    EXPECT_EQ(seen, 3);
    EXPECT_TRUE(r.CheckCommit(testing::TrailerOf(chunks)).ok());
  }
  kvrelay::testing::TurnShape s;
  s.n_history = 6;
  const v1::TurnGeometry g = testing::ProtoGeometry(kvrelay::testing::RandomTurn(s, 28));
  auto refused = [&](v1::TurnGeometry bad, bool with_parent, const std::string& want) {
    auto r = CheckGeometry(bad, "header.geometry", with_parent);
    ASSERT_FALSE(r.ok()) << want;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(r.status().message(), want);
  };
  v1::TurnGeometry other = g;
  other.set_history_score_tokens(5);
  refused(other, false, "header.geometry.history_score_tokens: 5, expected 0 or n_history (6)");
  other.set_n_history(0);
  refused(other, false, "header.geometry.history_score_tokens: 5, expected 0 (no history: n_history is 0 and there "
                        "is no parent)");
  EXPECT_TRUE(CheckGeometry(other, "header.geometry", /*with_parent=*/true).ok());
  other.set_query_dtype(v1::DTYPE_F32);
  refused(other, true, "header.geometry.history_score_tokens: 5, expected 0 with query_dtype (the relay computes the "
                       "mass on the history from GEN_Q)");
}

TEST(UploadReaderTest, LayerIsReportedAsSoonAsItsLastChunkArrives) {
  Fixture f = Make();
  UploadReader a(f.shape);
  size_t i = 0;
  for (; f.chunks[i].layer() == 0; ++i) {
    EXPECT_TRUE(a.TakeCompleted().empty());
    ASSERT_TRUE(a.Accept(f.chunks[i]).ok());
  }
  EXPECT_EQ(a.TakeCompleted().size(), 1u);
}

StreamError Feed(const Fixture& f, std::vector<v1::Chunk> chunks) {
  UploadReader a(f.shape);
  for (const auto& c : chunks) {
    StreamError e = a.Accept(c);
    if (!e.ok()) return e;
  }
  return a.CheckCommit(testing::TrailerOf(chunks));
}

TEST(UploadReaderTest, BadChunks) {
  Fixture f = Make();
  struct Case {
    const char* name;
    std::function<void(std::vector<v1::Chunk>*)> mutate;
    absl::StatusCode code;
    StreamErrorKind kind;
    const char* needle;
  } cases[] = {
      {"swap", [](auto* c) { std::swap((*c)[1], (*c)[2]); }, absl::StatusCode::kInvalidArgument,
       StreamErrorKind::kOrder, "expected layer 0"},
      {"duplicate", [](auto* c) { c->insert(c->begin() + 1, (*c)[0]); }, absl::StatusCode::kInvalidArgument,
       StreamErrorKind::kOrder, "offset"},
      {"drop", [](auto* c) { c->erase(c->begin() + 1); }, absl::StatusCode::kInvalidArgument,
       StreamErrorKind::kOrder, "expected layer 0"},
      {"wrong part", [](auto* c) { (*c)[0].set_part(v1::PART_GEN_K); }, absl::StatusCode::kInvalidArgument,
       StreamErrorKind::kOrder, "PART_PROMPT_K"},
      {"wrong layer", [](auto* c) { (*c)[0].set_layer(1); }, absl::StatusCode::kInvalidArgument,
       StreamErrorKind::kOrder, "expected layer 0"},
      {"bad crc", [](auto* c) { (*c)[3].set_crc32c((*c)[3].crc32c() ^ 1); }, absl::StatusCode::kDataLoss,
       StreamErrorKind::kChunkCrc, "chunk.crc32c"},
      {"flipped byte", [](auto* c) { (*c)[3].mutable_data()->at(5) ^= 0x40; }, absl::StatusCode::kDataLoss,
       StreamErrorKind::kChunkCrc, "chunk.crc32c"},
      {"empty data", [](auto* c) { (*c)[0].clear_data(); (*c)[0].set_crc32c(0); }, absl::StatusCode::kInvalidArgument,
       StreamErrorKind::kChunkSize, "chunk.data"},
      {"past end", [](auto* c) {
         auto& last = c->back();
         std::string d = last.data() + "xx";
         last.set_data(d);
         last.set_crc32c(Crc32c(d.data(), d.size()));
       }, absl::StatusCode::kInvalidArgument, StreamErrorKind::kChunkSize, "runs past"},
      {"extra chunk", [](auto* c) { c->push_back(c->back()); }, absl::StatusCode::kInvalidArgument,
       StreamErrorKind::kExtraChunk, "expected the commit"},
      {"missing tail", [](auto* c) { c->pop_back(); }, absl::StatusCode::kInvalidArgument,
       StreamErrorKind::kIncomplete, "commit:"},
  };
  for (const auto& tc : cases) {
    std::vector<v1::Chunk> chunks = f.chunks;
    tc.mutate(&chunks);
    StreamError e = Feed(f, chunks);
    EXPECT_EQ(e.kind(), tc.kind) << tc.name << ": " << e.message();
    absl::Status s = UploadStatus(e);
    EXPECT_EQ(s.code(), tc.code) << tc.name << ": " << s;
    EXPECT_NE(s.message().find(tc.needle), std::string::npos) << tc.name << ": " << s;
  }
}

// K/V values are checked for NaN/Inf chunk by chunk, in the chunk that
// completes the element (chunk sizes that split elements included), with
// the tensor and the [head, token, dim] index named as the core names them.
TEST(UploadReaderTest, NonFiniteValueFailsTheChunkThatCompletesIt) {
  std::mt19937_64 rng(11);
  int checked = 0;
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (v1::Part part : {v1::PART_PROMPT_K, v1::PART_PROMPT_V, v1::PART_GEN_V, v1::PART_HISTORY_V}) {
      kvrelay::testing::TurnShape ts;
      ts.layers = 2;
      ts.n_history = 5;
      ts.dtype = dtype;
      Turn t = kvrelay::testing::RandomTurn(ts, rng());
      const int layer = static_cast<int>(rng() % 2);
      TurnLayer& L = t.layers[layer];
      KvTensor* kv = part == v1::PART_PROMPT_K   ? &L.prompt_k
                     : part == v1::PART_PROMPT_V ? &L.prompt_v
                     : part == v1::PART_GEN_V    ? &L.gen_v
                                                 : &L.history_v;
      const int h = static_cast<int>(rng() % kv->heads()), tok = static_cast<int>(rng() % kv->tokens()),
                d = static_cast<int>(rng() % kv->dim());
      std::vector<float> row(kv->dim(), 0.25f);
      row[d] = rng() % 2 ? std::nanf("") : -INFINITY;
      kv->WriteRow(h, tok, row.data());
      const size_t es = DTypeSize(dtype);
      const uint64_t last_byte = ((static_cast<uint64_t>(h) * kv->tokens() + tok) * kv->dim() + d + 1) * es - 1;
      // Odd sizes split elements; every other case splits this very one
      // (its last byte starts the second chunk).
      const size_t chunk_bytes = checked % 2 ? 1 + rng() % 400 : std::max<uint64_t>(1, last_byte);
      const std::vector<v1::Chunk> chunks = TurnChunks(t, chunk_bytes);
      auto shape = CheckGeometry(testing::ProtoGeometry(t), "header.geometry");
      ASSERT_TRUE(shape.ok()) << shape.status();
      UploadReader a(*shape);
      size_t i = 0;
      StreamError e;
      for (; i < chunks.size(); ++i) {
        e = a.Accept(chunks[i]);
        if (!e.ok()) break;
      }
      EXPECT_EQ(e.kind(), StreamErrorKind::kValue);
      const absl::Status st = UploadStatus(e);
      ASSERT_LT(i, chunks.size()) << "never rejected";
      const v1::Chunk& bad = chunks[i];
      EXPECT_EQ(bad.layer(), static_cast<uint32_t>(layer));
      EXPECT_EQ(bad.part(), part);
      EXPECT_LE(bad.offset(), last_byte);
      EXPECT_GT(bad.offset() + bad.data().size(), last_byte);
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
      const std::string want = absl::StrCat("layer.", layer, ".", FilePartName(part), ": non-finite value ");
      EXPECT_EQ(st.message().substr(0, want.size()), want) << st;
      EXPECT_NE(st.message().find(absl::StrCat("at [", h, ",", tok, ",", d, "]")), std::string::npos) << st;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 12);
}

TEST(UploadReaderTest, OversizedChunkIsRejected) {
  kvrelay::testing::TurnShape s;
  s.layers = 1;
  s.n_prompt = 4096;
  s.head_dim = 64;
  Turn t = kvrelay::testing::RandomTurn(s, 1);
  auto shape = CheckGeometry(testing::ProtoGeometry(t), "g");
  ASSERT_TRUE(shape.ok());
  auto chunks = TurnChunks(t, (1 << 20) + 4);
  UploadReader a(*shape);
  const absl::Status st = UploadStatus(a.Accept(chunks[0]));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("expected 1..1048576"), std::string::npos) << st;
}

TEST(UploadReaderTest, BadTrailer) {
  Fixture f = Make();
  UploadReader a(f.shape);
  for (const auto& c : f.chunks) ASSERT_TRUE(a.Accept(c).ok());
  v1::Trailer t = testing::TrailerOf(f.chunks);
  v1::Trailer bad = t;
  bad.set_chunks(t.chunks() + 1);
  EXPECT_EQ(UploadStatus(a.CheckCommit(bad)).code(), absl::StatusCode::kInvalidArgument);
  bad = t;
  bad.set_bytes(t.bytes() - 1);
  EXPECT_EQ(UploadStatus(a.CheckCommit(bad)).code(), absl::StatusCode::kInvalidArgument);
  bad = t;
  bad.set_crc32c(t.crc32c() + 1);
  EXPECT_EQ(UploadStatus(a.CheckCommit(bad)).code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(a.CheckCommit(t).ok());
}

TEST(UploadReaderTest, BadGeometry) {
  Fixture f = Make();
  const v1::TurnGeometry good = testing::ProtoGeometry(f.turn);
  struct Case {
    std::function<void(v1::TurnGeometry*)> mutate;
    const char* field;
  } cases[] = {
      {[](auto* g) { g->set_layers(0); }, "header.geometry.layers: 0"},
      {[](auto* g) { g->set_kv_heads(0); }, "header.geometry.kv_heads: 0"},
      {[](auto* g) { g->set_score_heads(3); }, "header.geometry.score_heads: 3"},
      {[](auto* g) { g->set_head_dim(0); }, "header.geometry.head_dim: 0"},
      {[](auto* g) { g->set_dtype(v1::DTYPE_UNSPECIFIED); },
       "header.geometry.dtype: DTYPE_UNSPECIFIED (0), expected DTYPE_F32, DTYPE_F16 or DTYPE_BF16"},
      {[](auto* g) { g->set_dtype(static_cast<v1::DType>(9)); },
       "header.geometry.dtype: 9, expected DTYPE_F32, DTYPE_F16 or DTYPE_BF16"},
      {[](auto* g) { g->set_prompt_pos0(-1); }, "header.geometry.prompt_pos0"},
      // The bound holds where prompt_pos0 + n_prompt + n_gen overflows int64.
      {[](auto* g) { g->set_prompt_pos0(std::numeric_limits<int64_t>::max()); }, "header.geometry.prompt_pos0"},
      {[](auto* g) { g->set_prompt_pos0(std::numeric_limits<int64_t>::max() - 5); }, "header.geometry.prompt_pos0"},
      {[](auto* g) { g->set_prompt_pos0(int64_t{1} << 31); }, "header.geometry.prompt_pos0"},
      {[](auto* g) { g->set_n_prompt(1u << 30); }, "header.geometry.n_prompt"},
      {[](auto* g) { g->set_query_dtype(v1::DTYPE_F16); },
       "header.geometry.query_dtype: DTYPE_F16, expected DTYPE_UNSPECIFIED (the layers send PROMPT_SCORE) or "
       "DTYPE_F32 (the layers send GEN_Q; the K/V dtype or F32)"},
      {[](auto* g) { g->set_query_dtype(static_cast<v1::DType>(9)); }, "header.geometry.query_dtype: 9, expected"},
      {[](auto* g) { g->set_softmax_scale(-1); }, "header.geometry.softmax_scale: -1, expected a finite number in [1e-06, 1000]"},
      {[](auto* g) { g->set_softmax_scale(0); }, "header.geometry.softmax_scale: 0, expected a finite number in [1e-06, 1000]"},
      {[](auto* g) { g->set_softmax_scale(1e300); }, "header.geometry.softmax_scale: 1e+300, expected a finite number in [1e-06, 1000]"},
      {[](auto* g) { g->set_softmax_scale(std::nan("")); }, "header.geometry.softmax_scale: nan, expected"},
  };
  for (const auto& tc : cases) {
    v1::TurnGeometry g = good;
    tc.mutate(&g);
    auto s = CheckGeometry(g, "header.geometry");
    ASSERT_FALSE(s.ok()) << tc.field;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find(tc.field), std::string::npos) << s.status();
  }
}

// The last position id may be exactly 2^31-1, as in the core and for a
// child continuing after its parent; one more is refused.
TEST(UploadReaderTest, LastPositionIdMayBeInt32Max) {
  Fixture f = Make();
  v1::TurnGeometry g = testing::ProtoGeometry(f.turn);
  const int64_t tokens = int64_t{g.n_prompt()} + g.n_gen();
  g.set_prompt_pos0((int64_t{1} << 31) - tokens);
  EXPECT_TRUE(CheckGeometry(g, "header.geometry").ok());
  g.set_prompt_pos0((int64_t{1} << 31) - tokens + 1);
  auto s = CheckGeometry(g, "header.geometry");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("prompt_pos0 + n_prompt + n_gen <= 2^31"), std::string::npos) << s.status();
}

// The header's geometry is held to the core's bounds, with the
// field and the range named.
TEST(CheckGeometryTest, UsesTheCoreBounds) {
  kvrelay::testing::TurnShape ts;
  const Turn t = kvrelay::testing::RandomTurn(ts, 1);
  const v1::TurnGeometry good = testing::ProtoGeometry(t);
  struct Case {
    std::function<void(v1::TurnGeometry*)> edit;
    std::string want;
  };
  const std::vector<Case> cases = {
      {[](auto* g) { g->set_layers(kMaxLayers + 1); }, "header.geometry.layers: 1025, expected 1..1024"},
      {[](auto* g) { g->set_layers(0); }, "header.geometry.layers: 0, expected 1..1024"},
      {[](auto* g) { g->set_kv_heads(kMaxKvHeads + 1); g->set_score_heads(kMaxKvHeads + 1); },
       "header.geometry.kv_heads: 1025, expected 1..1024"},
      {[](auto* g) { g->set_head_dim(kMaxHeadDim + 1); }, "header.geometry.head_dim: 1025, expected 1..1024"},
      {[](auto* g) { g->set_kv_heads(1); g->set_score_heads(kMaxScoreHeads + 1); },
       "header.geometry.score_heads: 16385, expected a positive multiple of 1 kv heads, at most 16384"},
      {[](auto* g) { g->set_n_prompt(kMaxTokensPerPart + 1); },
       "header.geometry.n_prompt: 16777217, expected 0..16777216"},
      {[](auto* g) { g->set_n_gen(kMaxTokensPerPart + 1); }, "header.geometry.n_gen: 16777217, expected 0..16777216"},
  };
  for (const Case& c : cases) {
    v1::TurnGeometry g = good;
    c.edit(&g);
    auto r = CheckGeometry(g, "header.geometry");
    ASSERT_FALSE(r.ok()) << c.want;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(r.status().message(), c.want);
  }
  v1::TurnGeometry edge = good;
  edge.set_layers(kMaxLayers);
  edge.set_kv_heads(kMaxKvHeads);
  edge.set_score_heads(kMaxKvHeads);
  edge.set_head_dim(kMaxHeadDim);
  auto r = CheckGeometry(edge, "header.geometry");
  ASSERT_TRUE(r.ok()) << r.status();
  // The reservation adds a fixed overhead per layer.
  EXPECT_EQ(r->ReserveBytes(), r->UploadBytes() + kLayerOverheadBytes * kMaxLayers);
  EXPECT_EQ(kLayerOverheadBytes, 1024u);
}

// The chain's anchors in an uploaded history travel in the header; a turn
// with history.acc cannot be uploaded and says so.
TEST(CheckGeometryTest, HistoryAnchorsAndWhatIsNotUploaded) {
  kvrelay::testing::TurnShape ts;
  ts.n_history = 6;
  Turn t = kvrelay::testing::RandomTurn(ts, 2);
  for (TurnLayer& l : t.layers) {
    for (int h = 0; h < ts.kv_heads; ++h) l.history_pos.at(h, 0) = 0;
  }
  t.history_anchors = {0};
  absl::StatusOr<v1::TurnGeometry> g = TurnGeometryOf(t);
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_EQ(g->history_anchors_size(), 1);
  auto shape = CheckGeometry(*g, "header.geometry");
  ASSERT_TRUE(shape.ok()) << shape.status();
  EXPECT_EQ(shape->geo.history_anchors, std::vector<int32_t>{0});
  for (auto [anchors, n_history, want] :
       {std::tuple<std::vector<int32_t>, int, const char*>{
            {3, 1}, 6, "header.geometry.history_anchors: 1 at index 1, expected ascending distinct position ids >= 0"},
        {{0}, 0, "header.geometry.history_anchors: 1 position ids, expected none for a turn without history"}}) {
    v1::TurnGeometry bad = *g;
    bad.mutable_history_anchors()->Assign(anchors.begin(), anchors.end());
    bad.set_n_history(n_history);
    auto r = CheckGeometry(bad, "header.geometry");
    ASSERT_FALSE(r.ok()) << want;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(r.status().message(), want);
  }
  for (TurnLayer& l : t.layers) l.history_acc = ScoreMatrix(ts.kv_heads, 6);
  absl::StatusOr<v1::TurnGeometry> refused = TurnGeometryOf(t);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()),
              ::testing::HasSubstr("layer.0.history.acc: not carried by Publish or Compress"));
}


// ---------------------------------------------------------------- delivery


Turn MakeTurn(uint64_t seed, int n_history = 0, int head_dim = 64) {
  SyntheticTurnOptions o;
  o.layers = 3;
  o.kv_heads = 2;
  o.score_heads = 4;
  o.head_dim = head_dim;
  o.n_prompt = 300;
  o.n_gen = 9;
  o.n_history = n_history;
  o.first_agent = n_history == 0;
  o.seed = seed;
  absl::StatusOr<Turn> t = MakeSyntheticTurn(o);
  EXPECT_TRUE(t.ok()) << t.status();
  return *std::move(t);
}

Message Compress(const Turn& turn, const std::string& policy) {
  auto p = Pipeline::Create(policy);
  EXPECT_TRUE(p.ok()) << p.status();
  absl::StatusOr<Message> m = (*p)->Compress(turn);
  EXPECT_TRUE(m.ok()) << m.status();
  return *std::move(m);
}

// The chunks of a whole stream, and its trailer.
struct Stream {
  std::vector<v1::Chunk> chunks;
  v1::Trailer trailer;
};

Stream Chunk(const std::vector<TensorRef>& tensors, size_t max_chunk) {
  Stream s;
  TrailerBuilder tb;
  v1::Chunk scratch;
  for (const TensorRef& t : tensors) {
    EXPECT_TRUE(ForEachChunk(t, max_chunk, &scratch, [&](const v1::Chunk& c) {
                  tb.Add(c);
                  s.chunks.push_back(c);
                  return absl::OkStatus();
                }).ok());
  }
  s.trailer = tb.Build();
  return s;
}

StreamError AssembleError(const v1::MessageHeader& h, const Stream& s, Message* out) {
  DeliveryReader a;
  if (StreamError e = a.Start(h); !e.ok()) return e;
  for (const v1::Chunk& c : s.chunks) {
    if (StreamError e = a.Add(c); !e.ok()) return e;
  }
  return a.Finish(s.trailer, out);
}

absl::StatusOr<Message> Assemble(const v1::MessageHeader& h, const Stream& s) {
  Message m;
  KVRELAY_RETURN_IF_ERROR(DeliveryStatus(AssembleError(h, s, &m)));
  return m;
}

// The message file of `m` as an agent receives it: without acc, which is
// relay-side state that a delivery does not carry.
std::string Bytes(const Message& m) {
  Message delivered = m;
  for (MessageLayer& l : delivered.layers) l.acc.clear();
  std::string out;
  absl::Status s = WriteMessage(delivered, &out);
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

std::string BytesWithAcc(const Message& m) {
  std::string out;
  absl::Status s = WriteMessage(m, &out);
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

TEST(UploadOrderTest, PartsAndSizesWithoutHistory) {
  Turn turn = MakeTurn(1);
  std::vector<TensorRef> t = TurnUploadOrder(turn);
  ASSERT_EQ(t.size(), 3u * 6);
  const v1::Part parts[] = {v1::PART_PROMPT_K, v1::PART_PROMPT_V,     v1::PART_GEN_K,
                            v1::PART_GEN_V,    v1::PART_PROMPT_SCORE, v1::PART_HISTORY_SCORE};
  for (size_t i = 0; i < t.size(); ++i) {
    EXPECT_EQ(t[i].layer, i / 6);
    EXPECT_EQ(t[i].part, parts[i % 6]);
  }
  EXPECT_EQ(t[0].data.size(), 2u * 300 * 64 * 2);  // bf16
  EXPECT_EQ(t[2].data.size(), 2u * 9 * 64 * 2);
  EXPECT_EQ(t[4].data.size(), 4u * 300 * 4);       // f32 scores [4, 300]
  EXPECT_EQ(t[4].data.data(), reinterpret_cast<const uint8_t*>(turn.layers[0].scores.data.data()));
  EXPECT_EQ(t[5].data.size(), 0u);                 // no history.score: no chunk
}

TEST(UploadOrderTest, HistoryPartsWhenTheTurnHasHistory) {
  Turn turn = MakeTurn(2, /*n_history=*/7);
  std::vector<TensorRef> t = TurnUploadOrder(turn);
  ASSERT_EQ(t.size(), 3u * 9);
  EXPECT_EQ(t[5].part, v1::PART_HISTORY_SCORE);
  EXPECT_EQ(t[6].part, v1::PART_HISTORY_K);
  EXPECT_EQ(t[7].part, v1::PART_HISTORY_V);
  EXPECT_EQ(t[8].part, v1::PART_HISTORY_POS);
  EXPECT_EQ(t[8].data.size(), 2u * 7 * 4);
  EXPECT_EQ(t[9].part, v1::PART_PROMPT_K);
  EXPECT_EQ(t[9].layer, 1u);

  absl::StatusOr<v1::TurnGeometry> g = TurnGeometryOf(turn);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->layers(), 3u);
  EXPECT_EQ(g->kv_heads(), 2u);
  EXPECT_EQ(g->score_heads(), 4u);
  EXPECT_EQ(g->head_dim(), 64u);
  EXPECT_EQ(g->dtype(), v1::DTYPE_BF16);
  EXPECT_EQ(g->n_prompt(), 300u);
  EXPECT_EQ(g->n_gen(), 9u);
  EXPECT_EQ(g->n_history(), 7u);
  EXPECT_FALSE(g->first_agent());
  ASSERT_TRUE(g->has_prompt_pos0());
  EXPECT_EQ(g->prompt_pos0(), 14);
  EXPECT_FALSE(TurnGeometryOf(Turn{}).ok());
}

TEST(ForEachChunkTest, SplitsWithContiguousOffsetsAndCrcs) {
  std::vector<uint8_t> data(2500);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 7 + 3);
  TensorRef t{4, v1::PART_GEN_V, data};
  for (size_t max : {size_t{1}, size_t{1000}, size_t{2500}, kMaxChunkBytes}) {
    Stream s = Chunk({t}, max);
    ASSERT_EQ(s.chunks.size(), (data.size() + max - 1) / max) << max;
    uint64_t off = 0;
    for (const v1::Chunk& c : s.chunks) {
      EXPECT_EQ(c.layer(), 4u);
      EXPECT_EQ(c.part(), v1::PART_GEN_V);
      EXPECT_EQ(c.offset(), off);
      EXPECT_LE(c.data().size(), max);
      EXPECT_EQ(c.crc32c(), Crc32c(c.data().data(), c.data().size()));
      off += c.data().size();
    }
    EXPECT_EQ(off, data.size());
    EXPECT_EQ(s.trailer.chunks(), s.chunks.size());
    EXPECT_EQ(s.trailer.bytes(), data.size());
    EXPECT_EQ(s.trailer.crc32c(), Crc32c(data.data(), data.size()));
  }
  EXPECT_TRUE(Chunk({TensorRef{0, v1::PART_K, {}}}, 10).chunks.empty());
}

TEST(ForEachChunkTest, StopsAtTheSinksError) {
  std::vector<uint8_t> data(100, 1);
  int calls = 0;
  v1::Chunk scratch;
  absl::Status s = ForEachChunk({0, v1::PART_K, data}, 10, &scratch, [&](const v1::Chunk&) {
    return ++calls == 3 ? absl::CancelledError("stop") : absl::OkStatus();
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(calls, 3);
}

// A message delivered in chunks reassembles bit-exactly, for dense and
// quantized messages, with history, and for several chunk sizes.
TEST(DeliveryReaderTest, RoundTripIsBitExact) {
  struct Case {
    std::string policy;
    int n_history;
  };
  const Case cases[] = {{"full", 0},
                        {"gen", 5},
                        {"h2o-head:k=16+obf:p=4", 0},
                        {"h2o-layer:k=8+int4:group=32,rotate=hadamard", 11},
                        {"h2o-head:k=8+int8:group=7", 0},
                        {"h2o-head:k=8+int2", 3}};
  uint64_t seed = 10;
  for (const Case& c : cases) {
    Turn turn = MakeTurn(++seed, c.n_history);
    Message m = Compress(turn, c.policy);
    const std::string want = Bytes(m);
    for (size_t max : {size_t{977}, kMaxChunkBytes}) {
      Stream s = Chunk(MessageDeliveryOrder(m), max);
      absl::StatusOr<Message> got = Assemble(MessageHeaderOf(m), s);
      ASSERT_TRUE(got.ok()) << c.policy << ": " << got.status();
      EXPECT_EQ(Bytes(*got), want) << c.policy << " max_chunk " << max;
      EXPECT_TRUE(got->layers[0].acc.empty());
      EXPECT_EQ(got->anchor_pos, m.anchor_pos);
      EXPECT_EQ(got->policy, m.policy);
      // Relay to relay the acc travels too (acc_tokens, PART_ACC).
      v1::MessageHeader with_acc = MessageHeaderOf(m);
      with_acc.set_acc_tokens(static_cast<uint32_t>(m.layers[0].tokens()));
      absl::StatusOr<Message> relayed = Assemble(with_acc, Chunk(MessageDeliveryOrder(m, /*with_acc=*/true), max));
      ASSERT_TRUE(relayed.ok()) << c.policy << ": " << relayed.status();
      EXPECT_EQ(BytesWithAcc(*relayed), BytesWithAcc(m)) << c.policy << " max_chunk " << max;
      EXPECT_EQ(got->full_bytes, m.full_bytes);
      EXPECT_EQ(got->sent_bytes, m.sent_bytes);
      EXPECT_EQ(got->next_pos, m.next_pos);
    }
  }
}

// next_pos comes from the header; a relay before the field sends 0 and the
// receiver falls back to 1 + the largest position id it holds.
TEST(DeliveryReaderTest, NextPosFromTheHeaderOrTheIds) {
  Turn turn = MakeTurn(31, 0);
  Message m = Compress(turn, "h2o-head:k=4");
  const int64_t held = HeldEnd(m);
  ASSERT_GT(held, 0);
  Stream s = Chunk(MessageDeliveryOrder(m), kMaxChunkBytes);
  for (int64_t header_next : {int64_t{0}, held - 1, held, held + 7, int64_t{1} << 31}) {
    v1::MessageHeader h = MessageHeaderOf(m);
    h.set_next_pos(header_next);
    absl::StatusOr<Message> got = Assemble(h, s);
    ASSERT_TRUE(got.ok()) << header_next << ": " << got.status();
    EXPECT_EQ(got->next_pos, std::max(header_next, held)) << header_next;
  }
}

// A message from another relay is checked for NaN and Inf as it arrives,
// in every tensor of values that decoding multiplies out: dense K/V,
// scales, zeros, norms and the demoted tokens' norms. The tensor and the
// index are named.
TEST(DeliveryReaderTest, NonFiniteValuesAreRefusedNamingTheTensor) {
  struct Case {
    const char* policy;
    v1::Part part;
  };
  const Case cases[] = {{"full", v1::PART_K},
                        {"h2o-head:k=16", v1::PART_V},
                        {"h2o-head:k=16+int4:group=32", v1::PART_K_SCALE},
                        {"h2o-head:k=16+int4:group=32", v1::PART_K_ZERO},
                        {"h2o-head:k=16+int8", v1::PART_V_SCALE},
                        {"h2o-head:k=16+int2", v1::PART_V_ZERO},
                        {"full+lloyd:bits=4", v1::PART_K_SCALE},
                        {"full+lloyd:bits=3", v1::PART_V_SCALE},
                        {"full+lloyd:bits=2,keys=channel,group=8", v1::PART_K_ZERO},
                        {"h2o-head:k=8+demote:bits=2+lloyd:bits=4", v1::PART_DEMOTED_K_NORM},
                        {"h2o-head:k=8+demote:bits=1+int4", v1::PART_DEMOTED_V_NORM}};
  std::mt19937_64 rng(41);
  for (const Case& c : cases) {
    Message m = Compress(MakeTurn(rng()), c.policy);
    const int l = static_cast<int>(rng() % m.layers.size());
    MessageLayer& L = m.layers[l];
    const uint16_t bad = rng() % 2 ? 0x7E00 : 0xFC00;  // fp16 NaN, -Inf
    auto poison = [&](std::vector<uint16_t>* v) {
      ASSERT_FALSE(v->empty()) << c.policy;
      (*v)[rng() % v->size()] = bad;
    };
    switch (c.part) {
      case v1::PART_K:
      case v1::PART_V: {
        KvTensor& t = c.part == v1::PART_K ? L.k : L.v;
        std::vector<float> row(t.dim(), 0.5f);
        row[rng() % t.dim()] = INFINITY;
        t.WriteRow(static_cast<int>(rng() % t.heads()), static_cast<int>(rng() % t.tokens()), row.data());
        break;
      }
      case v1::PART_K_SCALE: poison(&L.quant->k.scale); break;
      case v1::PART_K_ZERO: poison(&L.quant->k.zero); break;
      case v1::PART_V_SCALE: poison(&L.quant->v.scale); break;
      case v1::PART_V_ZERO: poison(&L.quant->v.zero); break;
      case v1::PART_DEMOTED_K_NORM: poison(&L.demoted->k.scale); break;
      case v1::PART_DEMOTED_V_NORM: poison(&L.demoted->v.scale); break;
      default: FAIL() << c.part;
    }
    for (size_t max : {size_t{333}, kMaxChunkBytes}) {
      Message out;
      const StreamError e = AssembleError(MessageHeaderOf(m), Chunk(MessageDeliveryOrder(m), max), &out);
      EXPECT_EQ(e.kind(), StreamErrorKind::kValue) << c.policy << ": " << e.message();
      // A relay receiving a Forward refuses the argument; a client that
      // fetched it got damaged data.
      EXPECT_EQ(DeliveryStatus(e).code(), absl::StatusCode::kDataLoss);
      const absl::Status st = UploadStatus(e);
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.policy << ": " << st;
      const std::string want = absl::StrCat("layer.", l, ".", FilePartName(c.part), ": non-finite value ");
      EXPECT_EQ(st.message().substr(0, want.size()), want) << c.policy << ": " << st;
    }
  }
}

class DeliveryReaderErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    turn_ = MakeTurn(77);
    msg_ = Compress(turn_, "h2o-head:k=16");
    header_ = MessageHeaderOf(msg_);
    stream_ = Chunk(MessageDeliveryOrder(msg_), 1000);
  }
  absl::Status Run() { return Assemble(header_, stream_).status(); }

  Turn turn_;
  Message msg_;
  v1::MessageHeader header_;
  Stream stream_;
};

TEST_F(DeliveryReaderErrors, ChunkCrcMismatchIsDataLoss) {
  stream_.chunks[5].mutable_data()->at(3) ^= 1;
  absl::Status s = Run();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("crc32c"));
}

TEST_F(DeliveryReaderErrors, WrongChunkCrcFieldIsDataLoss) {
  stream_.chunks[0].set_crc32c(stream_.chunks[0].crc32c() + 1);
  EXPECT_EQ(Run().code(), absl::StatusCode::kDataLoss);
}

TEST_F(DeliveryReaderErrors, TrailerMismatchIsDataLoss) {
  Stream orig = stream_;
  stream_.trailer.set_crc32c(stream_.trailer.crc32c() ^ 0x10);
  EXPECT_EQ(Run().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(Run().message(), HasSubstr("trailer.crc32c"));
  stream_ = orig;
  stream_.trailer.set_chunks(stream_.trailer.chunks() + 1);
  EXPECT_THAT(Run().message(), HasSubstr("trailer.chunks"));
  EXPECT_EQ(Run().code(), absl::StatusCode::kDataLoss);
  stream_ = orig;
  stream_.trailer.set_bytes(1);
  EXPECT_EQ(Run().code(), absl::StatusCode::kDataLoss);
}

TEST_F(DeliveryReaderErrors, SwappedChunksAreOutOfOrder) {
  std::swap(stream_.chunks[0], stream_.chunks[1]);
  absl::Status s = Run();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("layer 0 PART_K offset 1000, expected layer 0 PART_K offset 0"));
}

TEST_F(DeliveryReaderErrors, WrongPartIsOutOfOrder) {
  stream_.chunks[0].set_part(v1::PART_V);
  absl::Status s = Run();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("chunk: layer 0 PART_V offset 0, expected layer 0 PART_K offset 0"));
}

TEST_F(DeliveryReaderErrors, DuplicatedChunk) {
  stream_.chunks.insert(stream_.chunks.begin() + 2, stream_.chunks[1]);
  EXPECT_EQ(Run().code(), absl::StatusCode::kDataLoss);
}

TEST_F(DeliveryReaderErrors, MissingLastChunk) {
  stream_.chunks.pop_back();
  absl::Status s = Run();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("tensor bytes received, expected layer 2 PART_POS"));
}

TEST_F(DeliveryReaderErrors, ExtraChunkAfterTheEnd) {
  v1::Chunk extra = stream_.chunks.back();
  extra.set_offset(extra.offset() + extra.data().size());
  stream_.chunks.push_back(extra);
  absl::Status s = Run();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("expected the trailer"));
}

TEST_F(DeliveryReaderErrors, OversizedOrEmptyChunk) {
  Stream orig = stream_;
  stream_.chunks[0].mutable_data()->clear();
  stream_.chunks[0].set_crc32c(0);
  EXPECT_EQ(Run().code(), absl::StatusCode::kDataLoss);
  stream_ = orig;
  // A chunk that runs past its tensor.
  v1::Chunk& last_k = stream_.chunks[0];
  last_k.mutable_data()->append(msg_.layers[0].k.byte_size(), 'x');
  last_k.set_crc32c(Crc32c(last_k.data().data(), last_k.data().size()));
  absl::Status s = Run();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
}

TEST_F(DeliveryReaderErrors, BadHeaders) {
  auto start = [](const v1::MessageHeader& h) {
    DeliveryReader a;
    StreamError e = a.Start(h);
    EXPECT_EQ(e.kind(), StreamErrorKind::kHeader) << e.message();
    return DeliveryStatus(e);
  };
  v1::MessageHeader h = header_;
  h.set_layers(0);
  EXPECT_THAT(start(h).message(), HasSubstr("header.layers: 0, expected >= 1"));
  h = header_;
  h.set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(start(h).code(), absl::StatusCode::kDataLoss);
  h = header_;
  h.set_next_pos(-1);
  EXPECT_THAT(start(h).message(), HasSubstr("header.next_pos: -1, expected 0..2^31"));
  h = header_;
  h.set_next_pos((int64_t{1} << 31) + 1);
  EXPECT_EQ(start(h).code(), absl::StatusCode::kDataLoss);
  h = header_;
  h.set_quant_bits(3);
  EXPECT_THAT(start(h).message(), HasSubstr("quant_bits"));
  h = header_;
  h.set_n_kept(0x7fffffff);
  EXPECT_EQ(start(h).code(), absl::StatusCode::kDataLoss);
  h = header_;
  h.set_layers(1u << 30);
  h.set_kv_heads(1u << 20);
  EXPECT_EQ(start(h).code(), absl::StatusCode::kDataLoss);  // no huge allocation
  // Layers of no tokens weigh 0 bytes: still not billions of them.
  h = header_;
  h.set_n_history(0);
  h.set_n_anchor(0);
  h.set_n_kept(0);
  h.set_n_gen(0);
  h.set_layers(4000000000u);
  EXPECT_THAT(start(h).message(), HasSubstr("header.layers: 4000000000, expected <= 1024"));
  // Sizes that would wrap around 2^64 to a small number.
  h = header_;
  h.set_layers(1);
  h.set_kv_heads(1u << 31);
  h.set_head_dim(1u << 31);
  EXPECT_THAT(start(h).message(), HasSubstr("header.kv_heads: 2147483648, expected <= 1024"));
  h.set_kv_heads(1);
  EXPECT_THAT(start(h).message(), HasSubstr("header.head_dim: 2147483648, expected <= 1024"));
}

TEST_F(DeliveryReaderErrors, SentBytesMustMatchTheTensors) {
  header_.mutable_accounting()->set_sent_bytes(msg_.sent_bytes + 4);
  absl::Status s = Run();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("sent_bytes"));
}

TEST_F(DeliveryReaderErrors, ChunkBeforeHeader) {
  DeliveryReader a;
  StreamError e = a.Add(stream_.chunks[0]);
  EXPECT_EQ(e.kind(), StreamErrorKind::kSequence);
  EXPECT_EQ(DeliveryStatus(e).code(), absl::StatusCode::kDataLoss);
}

// ------------------------------------------------------------ shared rules

// One fault, applied to an upload and to a delivery stream: a mutation of
// the chunks, then (optionally) of the trailer computed over them.
struct Fault {
  const char* name;
  std::function<void(std::vector<v1::Chunk>*)> chunks;
  std::function<void(v1::Trailer*)> trailer;
  StreamErrorKind kind;
};

std::vector<Fault> Faults() {
  auto none = [](std::vector<v1::Chunk>*) {};
  auto keep = [](v1::Trailer*) {};
  return {
      {"swap", [](auto* c) { std::swap((*c)[0], (*c)[1]); }, keep, StreamErrorKind::kOrder},
      {"duplicate", [](auto* c) { c->insert(c->begin() + 1, (*c)[0]); }, keep, StreamErrorKind::kOrder},
      {"drop", [](auto* c) { c->erase(c->begin() + 1); }, keep, StreamErrorKind::kOrder},
      {"wrong part", [](auto* c) { (*c)[0].set_part(v1::PART_UNSPECIFIED); }, keep, StreamErrorKind::kOrder},
      {"wrong layer", [](auto* c) { (*c)[0].set_layer(7); }, keep, StreamErrorKind::kOrder},
      {"bad crc", [](auto* c) { (*c)[2].set_crc32c((*c)[2].crc32c() ^ 1); }, keep, StreamErrorKind::kChunkCrc},
      {"flipped byte", [](auto* c) { (*c)[2].mutable_data()->at(3) ^= 0x40; }, keep, StreamErrorKind::kChunkCrc},
      {"empty data", [](auto* c) { (*c)[0].clear_data(); (*c)[0].set_crc32c(0); }, keep, StreamErrorKind::kChunkSize},
      {"past end",
       [](auto* c) {
         v1::Chunk& last = c->back();
         const std::string d = last.data() + "xx";
         last.set_data(d);
         last.set_crc32c(Crc32c(d.data(), d.size()));
       },
       keep, StreamErrorKind::kChunkSize},
      {"extra chunk",
       [](auto* c) {
         v1::Chunk extra = c->back();
         extra.set_offset(extra.offset() + extra.data().size());
         c->push_back(extra);
       },
       keep, StreamErrorKind::kExtraChunk},
      {"missing tail", [](auto* c) { c->pop_back(); }, keep, StreamErrorKind::kIncomplete},
      {"trailer chunks", none, [](v1::Trailer* t) { t->set_chunks(t->chunks() + 1); }, StreamErrorKind::kTrailerCount},
      {"trailer bytes", none, [](v1::Trailer* t) { t->set_bytes(t->bytes() - 1); }, StreamErrorKind::kTrailerCount},
      {"trailer crc", none, [](v1::Trailer* t) { t->set_crc32c(t->crc32c() ^ 0x10); }, StreamErrorKind::kTrailerCrc},
  };
}

// Both readers apply one rule set: the same fault is the same kind in an
// upload and in a delivery. The upload side answers its caller
// INVALID_ARGUMENT (DATA_LOSS for a CRC32C mismatch); the delivery side
// reports DATA_LOSS whatever the kind.
TEST(SharedRulesTest, SameFaultIsTheSameKindInBothReaders) {
  const Fixture up = Make(/*n_history=*/0, /*chunk_bytes=*/512);
  const Message msg = Compress(MakeTurn(91), "h2o-head:k=16");
  Stream down = Chunk(MessageDeliveryOrder(msg), 1000);
  ASSERT_GT(down.chunks.size(), 3u);
  ASSERT_EQ(down.chunks[0].part(), down.chunks[1].part());  // a tensor of several chunks first
  ASSERT_EQ(up.chunks[0].part(), up.chunks[1].part());
  for (const Fault& f : Faults()) {
    std::vector<v1::Chunk> uc = up.chunks;
    f.chunks(&uc);
    v1::Trailer ut = testing::TrailerOf(uc);
    f.trailer(&ut);
    UploadReader u(up.shape);
    StreamError ue;
    for (const v1::Chunk& c : uc) {
      ue = u.Accept(c);
      if (!ue.ok()) break;
    }
    if (ue.ok()) ue = u.CheckCommit(ut);

    Stream ds{down.chunks, {}};
    f.chunks(&ds.chunks);
    ds.trailer = testing::TrailerOf(ds.chunks);
    f.trailer(&ds.trailer);
    Message out;
    const StreamError de = AssembleError(MessageHeaderOf(msg), ds, &out);

    EXPECT_EQ(ue.kind(), f.kind) << f.name << ": " << StreamErrorKindName(ue.kind()) << " " << ue.message();
    EXPECT_EQ(de.kind(), f.kind) << f.name << ": " << StreamErrorKindName(de.kind()) << " " << de.message();
    const bool crc = f.kind == StreamErrorKind::kChunkCrc || f.kind == StreamErrorKind::kTrailerCrc;
    EXPECT_EQ(UploadStatus(ue).code(), crc ? absl::StatusCode::kDataLoss : absl::StatusCode::kInvalidArgument)
        << f.name;
    EXPECT_EQ(DeliveryStatus(de).code(), absl::StatusCode::kDataLoss) << f.name;
  }
}

TEST(SharedRulesTest, StatusMappingIsOnePerSide) {
  for (int k = static_cast<int>(StreamErrorKind::kHeader); k <= static_cast<int>(StreamErrorKind::kTrailerCrc);
       ++k) {
    const auto kind = static_cast<StreamErrorKind>(k);
    const StreamError e(kind, "what");
    const bool crc = kind == StreamErrorKind::kChunkCrc || kind == StreamErrorKind::kTrailerCrc;
    EXPECT_EQ(UploadStatus(e), crc ? absl::DataLossError("what") : absl::InvalidArgumentError("what"))
        << StreamErrorKindName(kind);
    EXPECT_EQ(DeliveryStatus(e), absl::DataLossError("what")) << StreamErrorKindName(kind);
  }
  EXPECT_TRUE(UploadStatus(StreamError()).ok());
  EXPECT_TRUE(DeliveryStatus(StreamError()).ok());
}

// ------------------------------------------------------------------ orders

TEST(DeliveryOrderTest, LayersInOrderDenseAndQuantized) {
  const Message dense = Compress(MakeTurn(3), "h2o-head:k=16");
  const Message quant = Compress(MakeTurn(4), "h2o-head:k=16+int4:group=32");
  const v1::Part dense_parts[] = {v1::PART_K, v1::PART_V, v1::PART_POS};
  const v1::Part quant_parts[] = {v1::PART_K_CODES, v1::PART_K_SCALE, v1::PART_K_ZERO, v1::PART_V_CODES,
                                  v1::PART_V_SCALE, v1::PART_V_ZERO,  v1::PART_POS};
  for (const Message* m : {&dense, &quant}) {
    const bool q = m->layers[0].quant.has_value();
    const std::vector<TensorRef> all = MessageDeliveryOrder(*m);
    const size_t per = q ? 7 : 3;
    ASSERT_EQ(all.size(), per * m->layers.size());
    for (uint32_t l = 0; l < m->layers.size(); ++l) {
      const std::vector<TensorRef> layer = LayerDeliveryOrder(m->layers[l], l);
      ASSERT_EQ(layer.size(), per);
      for (size_t i = 0; i < per; ++i) {
        EXPECT_EQ(layer[i].layer, l);
        EXPECT_EQ(layer[i].part, q ? quant_parts[i] : dense_parts[i]);
        EXPECT_EQ(layer[i].part, DeliveryParts(q)[i]);
        EXPECT_EQ(all[l * per + i].part, layer[i].part);
        EXPECT_EQ(all[l * per + i].data.data(), layer[i].data.data());
        EXPECT_EQ(all[l * per + i].data.size(), layer[i].data.size());
      }
    }
  }
}

// ------------------------------------------------------------------ writer

// The Chunk or Trailer in an encoded stream message.
template <typename Msg>
Msg Decode(const grpc::ByteBuffer& b) {
  RawMessage raw;
  EXPECT_TRUE(raw.Reset(b));
  Msg m;
  EXPECT_TRUE(raw.ParseAs(&m));
  return m;
}

// A delivery written layer by layer (each appended once it "exists",
// interleaved with writing), with and without holding the message, reads
// back bit-exactly; the trailer comes last, in the response's trailer field.
TEST(ChunkStreamWriterTest, DeliveryLayerByLayerReadsBackBitExact) {
  for (const char* policy : {"full", "h2o-head:k=16+int4:group=32", "full+lloyd:bits=3,seed=5",
                             "h2o-head:k=16+demote:bits=2+int4:group=32",
                             "h2o-layer:k=8+demote:bits=1+lloyd:bits=2,keys=channel,group=8,seed=3",
                             "h2o-head:k=4+demote:bits=3"}) {
    for (bool hold : {false, true}) {
      auto msg = std::make_shared<Message>(Compress(MakeTurn(21), policy));
      ChunkStreamWriter w(/*max_chunk=*/777);
      DeliveryReader r;
      ASSERT_TRUE(r.Start(MessageHeaderOf(*msg)).ok());
      grpc::ByteBuffer b;
      uint64_t chunks = 0;
      for (uint32_t l = 0; l < msg->layers.size(); ++l) {
        EXPECT_FALSE(w.NextChunk<v1::FetchResponse>(&b));  // nothing queued yet
        w.Append(LayerDeliveryOrder(msg->layers[l], l), hold ? msg : nullptr);
        uint64_t n = 0;
        while (w.NextChunk<v1::FetchResponse>(&b, &n)) {
          const v1::FetchResponse resp = Decode<v1::FetchResponse>(b);
          ASSERT_TRUE(resp.has_chunk());
          EXPECT_EQ(resp.chunk().layer(), l);
          EXPECT_EQ(resp.chunk().data().size(), n);
          ASSERT_TRUE(r.Add(resp.chunk()).ok());
          ++chunks;
        }
      }
      const v1::FetchResponse end = Decode<v1::FetchResponse>(w.EncodeTrailer<v1::FetchResponse>());
      ASSERT_TRUE(end.has_trailer());
      EXPECT_EQ(end.trailer().chunks(), chunks);
      EXPECT_TRUE(w.trailer_sent());
      Message got;
      StreamError e = r.Finish(end.trailer(), &got);
      ASSERT_TRUE(e.ok()) << e.message();
      EXPECT_EQ(Bytes(got), Bytes(*msg)) << policy << " hold " << hold;
    }
  }
}

// Each append's hold is kept by its own chunks' messages until gRPC lets go
// of them, and by the writer only until it moves past the append.
TEST(ChunkStreamWriterTest, EachAppendHoldsItsOwnTensors) {
  const Message m = Compress(MakeTurn(22), "full");
  auto h0 = std::make_shared<Message>(m), h1 = std::make_shared<Message>(m);
  std::weak_ptr<Message> w0 = h0, w1 = h1;
  std::optional<ChunkStreamWriter> w(std::in_place);
  w->Append(LayerDeliveryOrder(h0->layers[0], 0), h0);
  w->Append(LayerDeliveryOrder(h1->layers[1], 1), h1);
  h0.reset();
  h1.reset();
  std::vector<grpc::ByteBuffer> layer0, layer1;
  {
    grpc::ByteBuffer b;
    while (w->NextChunk<v1::CompressResponse>(&b)) {
      (Decode<v1::CompressResponse>(b).chunk().layer() == 0 ? layer0 : layer1).push_back(b);
    }
  }
  ASSERT_FALSE(layer0.empty());
  ASSERT_FALSE(layer1.empty());
  EXPECT_FALSE(w0.expired());
  layer0.clear();
  EXPECT_TRUE(w0.expired());
  layer1.clear();
  EXPECT_FALSE(w1.expired());  // the writer's last append
  w.reset();
  EXPECT_TRUE(w1.expired());
}

// The upload writer's stream (chunks as PublishRequest.chunk, the trailer
// as PublishRequest.commit) is what UploadReader reads back, layer by layer.
TEST(ChunkStreamWriterTest, UploadReadsBackBitExact) {
  for (int hist : {0, 6}) {
    const Fixture f = Make(hist);
    ChunkStreamWriter w(/*max_chunk=*/300);
    w.Append(TurnUploadOrder(f.turn), nullptr);
    UploadReader r(f.shape);
    grpc::ByteBuffer b;
    int layers = 0;
    while (w.NextChunk<v1::PublishRequest>(&b)) {
      RawMessage raw;
      ASSERT_TRUE(raw.Reset(b));
      ChunkView c;
      ASSERT_TRUE(raw.AsChunk(v1::PublishRequest::kChunkFieldNumber, &c));
      StreamError e = r.Accept(c);
      ASSERT_TRUE(e.ok()) << e.message();
      for (auto& [l, layer] : r.TakeCompleted()) {
        EXPECT_EQ(l, layers++);
        EXPECT_EQ(layer.prompt_k, f.turn.layers[l].prompt_k);
        EXPECT_EQ(layer.gen_v, f.turn.layers[l].gen_v);
        EXPECT_EQ(layer.scores.data, f.turn.layers[l].scores.data);
        EXPECT_EQ(layer.history_pos, f.turn.layers[l].history_pos);
      }
    }
    EXPECT_EQ(layers, 3);
    const v1::PublishRequest commit = Decode<v1::PublishRequest>(w.EncodeTrailer<v1::PublishRequest>());
    ASSERT_TRUE(commit.has_commit());
    EXPECT_TRUE(r.CheckCommit(commit.commit()).ok());
    EXPECT_EQ(commit.commit().bytes(), f.shape.UploadBytes());
  }
}

// FillNext: every chunk, the trailer once, then false.
TEST(ChunkStreamWriterTest, FillNextEndsAfterTheTrailer) {
  const Message m = Compress(MakeTurn(23), "h2o-head:k=8");
  ChunkStreamWriter w;
  w.Append(MessageDeliveryOrder(m), nullptr);
  grpc::ByteBuffer b;
  int chunks = 0, trailers = 0;
  while (w.FillNext<v1::FetchResponse>(&b)) {
    const v1::FetchResponse r = Decode<v1::FetchResponse>(b);
    EXPECT_EQ(trailers, 0) << "a response after the trailer";
    if (r.has_chunk()) ++chunks;
    if (r.has_trailer()) {
      ++trailers;
      EXPECT_EQ(r.trailer().chunks(), static_cast<uint64_t>(chunks));
    }
  }
  EXPECT_EQ(trailers, 1);
  EXPECT_GT(chunks, 0);
  EXPECT_FALSE(w.FillNext<v1::FetchResponse>(&b));
}

// A second header and anything after the trailer are out of place.
TEST(DeliveryReaderTest, SequenceErrors) {
  const Message m = Compress(MakeTurn(24), "full");
  const Stream s = Chunk(MessageDeliveryOrder(m), kMaxChunkBytes);
  DeliveryReader r;
  Message out;
  EXPECT_EQ(r.Finish(s.trailer, &out).kind(), StreamErrorKind::kSequence);
  ASSERT_TRUE(r.Start(MessageHeaderOf(m)).ok());
  EXPECT_EQ(r.Start(MessageHeaderOf(m)).kind(), StreamErrorKind::kSequence);
  for (const v1::Chunk& c : s.chunks) ASSERT_TRUE(r.Add(c).ok());
  ASSERT_TRUE(r.Finish(s.trailer, &out).ok());
  EXPECT_TRUE(r.done());
  EXPECT_EQ(r.Add(s.chunks[0]).kind(), StreamErrorKind::kSequence);
  EXPECT_EQ(r.Finish(s.trailer, &out).kind(), StreamErrorKind::kSequence);
  EXPECT_EQ(r.Start(MessageHeaderOf(m)).kind(), StreamErrorKind::kSequence);
}
}  // namespace
}  // namespace kvrelay
