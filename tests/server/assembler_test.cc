// Chunk assembly: order, offsets, sizes, CRCs and the commit trailer.
#include "server/assembler.h"

#include <cmath>
#include <functional>
#include <random>

#include "absl/strings/str_cat.h"

#include "gtest/gtest.h"
#include "relay_test_util.h"
#include "tests/core/test_util.h"

namespace kvrelay {
namespace {

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

TEST(AssemblerTest, ReassemblesEveryLayerBitExactInOrder) {
  for (int hist : {0, 6}) {
    Fixture f = Make(hist);
    TurnAssembler a(f.shape);
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

TEST(AssemblerTest, LayerIsReportedAsSoonAsItsLastChunkArrives) {
  Fixture f = Make();
  TurnAssembler a(f.shape);
  size_t i = 0;
  for (; f.chunks[i].layer() == 0; ++i) {
    EXPECT_TRUE(a.TakeCompleted().empty());
    ASSERT_TRUE(a.Accept(f.chunks[i]).ok());
  }
  EXPECT_EQ(a.TakeCompleted().size(), 1u);
}

absl::Status Feed(const Fixture& f, std::vector<v1::Chunk> chunks) {
  TurnAssembler a(f.shape);
  for (const auto& c : chunks) {
    absl::Status s = a.Accept(c);
    if (!s.ok()) return s;
  }
  return a.CheckCommit(testing::TrailerOf(chunks));
}

TEST(AssemblerTest, BadChunks) {
  Fixture f = Make();
  struct Case {
    const char* name;
    std::function<void(std::vector<v1::Chunk>*)> mutate;
    absl::StatusCode code;
    const char* needle;
  } cases[] = {
      {"swap", [](auto* c) { std::swap((*c)[1], (*c)[2]); }, absl::StatusCode::kInvalidArgument, "expected layer 0"},
      {"duplicate", [](auto* c) { c->insert(c->begin() + 1, (*c)[0]); }, absl::StatusCode::kInvalidArgument, "offset"},
      {"drop", [](auto* c) { c->erase(c->begin() + 1); }, absl::StatusCode::kInvalidArgument, "expected layer 0"},
      {"wrong part", [](auto* c) { (*c)[0].set_part(v1::PART_GEN_K); }, absl::StatusCode::kInvalidArgument, "PART_PROMPT_K"},
      {"wrong layer", [](auto* c) { (*c)[0].set_layer(1); }, absl::StatusCode::kInvalidArgument, "expected layer 0"},
      {"bad crc", [](auto* c) { (*c)[3].set_crc32c((*c)[3].crc32c() ^ 1); }, absl::StatusCode::kDataLoss, "chunk.crc32c"},
      {"flipped byte", [](auto* c) { (*c)[3].mutable_data()->at(5) ^= 0x40; }, absl::StatusCode::kDataLoss, "chunk.crc32c"},
      {"empty data", [](auto* c) { (*c)[0].clear_data(); (*c)[0].set_crc32c(0); }, absl::StatusCode::kInvalidArgument, "chunk.data"},
      {"past end", [](auto* c) {
         auto& last = c->back();
         std::string d = last.data() + "xx";
         last.set_data(d);
         last.set_crc32c(Crc32c(d.data(), d.size()));
       }, absl::StatusCode::kInvalidArgument, "runs past"},
      {"extra chunk", [](auto* c) { c->push_back(c->back()); }, absl::StatusCode::kInvalidArgument, "expected the commit"},
      {"missing tail", [](auto* c) { c->pop_back(); }, absl::StatusCode::kInvalidArgument, "commit:"},
  };
  for (const auto& tc : cases) {
    std::vector<v1::Chunk> chunks = f.chunks;
    tc.mutate(&chunks);
    absl::Status s = Feed(f, chunks);
    EXPECT_EQ(s.code(), tc.code) << tc.name << ": " << s;
    EXPECT_NE(s.message().find(tc.needle), std::string::npos) << tc.name << ": " << s;
  }
}

// K/V values are checked for NaN/Inf chunk by chunk, in the chunk that
// completes the element (chunk sizes that split elements included), with
// the tensor and the [head, token, dim] index named as the core names them.
TEST(AssemblerTest, NonFiniteValueFailsTheChunkThatCompletesIt) {
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
      TurnAssembler a(*shape);
      size_t i = 0;
      absl::Status st;
      for (; i < chunks.size(); ++i) {
        st = a.Accept(chunks[i]);
        if (!st.ok()) break;
      }
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

TEST(AssemblerTest, OversizedChunkIsRejected) {
  kvrelay::testing::TurnShape s;
  s.layers = 1;
  s.n_prompt = 4096;
  s.head_dim = 64;
  Turn t = kvrelay::testing::RandomTurn(s, 1);
  auto shape = CheckGeometry(testing::ProtoGeometry(t), "g");
  ASSERT_TRUE(shape.ok());
  auto chunks = TurnChunks(t, (1 << 20) + 4);
  TurnAssembler a(*shape);
  absl::Status st = a.Accept(chunks[0]);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("expected 1..1048576"), std::string::npos) << st;
}

TEST(AssemblerTest, BadTrailer) {
  Fixture f = Make();
  TurnAssembler a(f.shape);
  for (const auto& c : f.chunks) ASSERT_TRUE(a.Accept(c).ok());
  v1::Trailer t = testing::TrailerOf(f.chunks);
  v1::Trailer bad = t;
  bad.set_chunks(t.chunks() + 1);
  EXPECT_EQ(a.CheckCommit(bad).code(), absl::StatusCode::kInvalidArgument);
  bad = t;
  bad.set_bytes(t.bytes() - 1);
  EXPECT_EQ(a.CheckCommit(bad).code(), absl::StatusCode::kInvalidArgument);
  bad = t;
  bad.set_crc32c(t.crc32c() + 1);
  EXPECT_EQ(a.CheckCommit(bad).code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(a.CheckCommit(t).ok());
}

TEST(AssemblerTest, BadGeometry) {
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
TEST(AssemblerTest, LastPositionIdMayBeInt32Max) {
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

// Review 2a/3b: the header's geometry is held to the core's bounds, with the
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
       "header.geometry.score_heads: 16385, expected a positive multiple of kv_heads (1), at most 16384"},
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

}  // namespace
}  // namespace kvrelay
