#include "core/turn.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "absl/strings/str_cat.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"

namespace kvrelay {
namespace {

using ::testing::HasSubstr;
using testing::RandomTurn;
using testing::TurnShape;

void ExpectInvalid(const Turn& turn, const std::string& substr) {
  absl::Status s = ValidateTurn(turn);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(substr));
}

TEST(TurnTest, RandomTurnsAreValid) {
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16}) {
    TurnShape s;
    s.dtype = d;
    s.n_history = 7;
    EXPECT_TRUE(ValidateTurn(RandomTurn(s, 1)).ok());
  }
}

// Every bit pattern with an all-ones exponent (NaN with any payload or sign,
// +-Inf) is found at its exact position, in every dtype, past the scan's
// 4096-element blocks; the largest finite values and all other patterns pass.
TEST(TurnTest, FindsEveryNonFinitePatternAtItsPosition) {
  std::mt19937 rng(7);
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16}) {
    const size_t width = DTypeSize(d);
    const uint32_t exp_mask = d == DType::kF32 ? 0x7f800000u : d == DType::kF16 ? 0x7c00u : 0x7f80u;
    const uint32_t sign = d == DType::kF32 ? 0x80000000u : 0x8000u;
    TurnShape s;
    s.dtype = d;
    s.layers = 1;
    s.n_prompt = 600;  // 2 heads x 600 x 16 > 4096 elements
    const Turn good = RandomTurn(s, 3);
    const uint32_t low = exp_mask & (~exp_mask + 1);
    const uint32_t mant = (sign - 1) & ~exp_mask;
    // The largest finite magnitudes, both signs, everywhere: still valid.
    Turn t = good;
    absl::Span<uint8_t> bytes = t.layers[0].prompt_k.mutable_bytes();
    for (size_t i = 0; i < bytes.size() / width; i += 97) {
      const uint32_t v = (exp_mask - low) | mant | ((i & 1) ? sign : 0u);  // +-largest finite
      std::memcpy(bytes.data() + i * width, &v, width);
    }
    EXPECT_TRUE(ValidateTurn(t).ok()) << DTypeName(d) << ": " << ValidateTurn(t);
    for (int trial = 0; trial < 40; ++trial) {
      t = good;
      bytes = t.layers[0].prompt_k.mutable_bytes();
      const size_t n = bytes.size() / width;
      const size_t at = rng() % n;
      uint32_t v = exp_mask | ((rng() & 1) ? sign : 0u);
      if (trial % 2) v |= (rng() | 1u) & mant;  // NaN with a payload
      std::memcpy(bytes.data() + at * width, &v, width);
      const int h = static_cast<int>(at / (600 * 16)), tok = static_cast<int>(at / 16 % 600),
                c = static_cast<int>(at % 16);
      const absl::Status st = ValidateTurn(t);
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << DTypeName(d) << " at " << at;
      EXPECT_THAT(std::string(st.message()),
                  HasSubstr(absl::StrCat("at [", h, ",", tok, ",", c, "]")))
          << DTypeName(d) << " pattern " << std::hex << v;
    }
  }
}

TEST(TurnTest, RejectsEachBadInput) {
  TurnShape s;
  s.layers = 3;
  s.n_history = 4;
  const Turn good = RandomTurn(s, 2);

  ExpectInvalid(Turn{}, "no layers");

  Turn t = good;
  t.layers[2].prompt_v = KvTensor(DType::kF32, 2, 40, 8);
  ExpectInvalid(t, "layer.2.prompt.v: shape [2,40,8], expected [2,40,16]");

  t = good;
  t.layers[1].gen_k = KvTensor(DType::kBF16, 2, 5, 16);
  ExpectInvalid(t, "layer.1.gen.k: dtype BF16, expected F32");

  t = good;
  t.layers[1].history_v = KvTensor(DType::kF32, 2, 3, 16);
  ExpectInvalid(t, "layer.1.history.v: shape [2,3,16], expected [2,4,16]");

  t = good;
  float nan = std::nanf("");
  t.layers[2].prompt_k.WriteRow(1, 3, std::vector<float>(16, nan).data());
  ExpectInvalid(t, "layer.2.prompt.k: non-finite value nan at [1,3,0]");

  t = good;
  float inf[16] = {0};
  inf[5] = INFINITY;
  t.layers[0].gen_v.WriteRow(0, 2, inf);
  ExpectInvalid(t, "layer.0.gen.v: non-finite value inf at [0,2,5]");

  t = good;
  t.layers[1].scores.at(3, 7) = -1.f;
  ExpectInvalid(t, "layer.1.prompt.score: value -1 at [3,7]");

  t = good;
  t.layers[0].scores.at(0, 0) = nan;
  ExpectInvalid(t, "layer.0.prompt.score: value nan at [0,0]");

  // Every bit pattern class, anywhere in the matrix: only finite values >= 0
  // (-0.0 included) pass, and the first offender is named.
  for (float bad : {-1e-30f, -1.f, -INFINITY, INFINITY, nan, -nan, -std::numeric_limits<float>::denorm_min()}) {
    t = good;
    t.layers[2].scores.at(1, 39) = bad;
    t.layers[2].scores.at(2, 0) = -1.f;  // a later one is not reported
    const absl::Status st = ValidateTurn(t);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(st.message().find("layer.2.prompt.score: value "), std::string::npos) << st;
    EXPECT_NE(st.message().find(" at [1,39]"), std::string::npos) << st;
  }
  t = good;
  t.layers[1].scores.at(0, 5) = -0.f;
  t.layers[1].scores.at(3, 0) = std::numeric_limits<float>::max();
  t.layers[1].scores.at(3, 1) = std::numeric_limits<float>::denorm_min();
  EXPECT_TRUE(ValidateTurn(t).ok());

  t = good;
  t.layers[0].scores = ScoreMatrix(3, 40);
  ExpectInvalid(t, "layer.0.prompt.score: 3 score heads, expected a positive multiple of 2");

  t = good;
  t.layers[1].scores = ScoreMatrix(4, 39);
  ExpectInvalid(t, "layer.1.prompt.score: shape [4,39], expected [4,40]");

  t = good;
  t.layers[2].history_pos = PosTensor(2, 3);
  ExpectInvalid(t, "layer.2.history.pos: shape [2,3], expected [2,4]");

  t = good;
  t.layers[1].history_pos.at(1, 2) = -3;
  ExpectInvalid(t, "layer.1.history.pos: -3 at [1,2], expected a position id in [0, prompt_pos0 = 8)");

  // The history precedes the prompt: an id at prompt_pos0 would share it.
  t = good;
  t.layers[1].history_pos.at(0, 3) = 8;
  ExpectInvalid(t, "layer.1.history.pos: 8 at [0,3], expected a position id in [0, prompt_pos0 = 8) (the history "
                   "precedes the prompt");
  t.prompt_pos0 = 9;
  EXPECT_TRUE(ValidateTurn(t).ok());

  t = good;
  t.prompt_pos0 = -1;
  ExpectInvalid(t, "prompt_pos0: -1, expected >= 0");

  t = good;
  t.prompt_pos0 = 2147483640;
  ExpectInvalid(t, "past int32");

  // The last position id may be INT32_MAX itself, not one more.
  const int64_t ids = s.n_prompt + s.n_gen;
  t = good;
  t.prompt_pos0 = std::numeric_limits<int32_t>::max() - (ids - 1);
  EXPECT_TRUE(ValidateTurn(t).ok()) << ValidateTurn(t);
  t.prompt_pos0 = *t.prompt_pos0 + 1;
  ExpectInvalid(t, "past int32 (last 2147483648)");
}

TEST(TurnTest, GeometryIsBounded) {
  // Empty tensors with huge head counts cost nothing to send but would drive
  // allocations and loops: the geometry bounds reject them up front.
  Turn t;
  TurnLayer l;
  l.prompt_k = l.prompt_v = l.gen_k = l.gen_v = KvTensor(DType::kF32, 4000, 0, 1);
  l.history_k = l.history_v = KvTensor(DType::kF32, 4000, 0, 1);
  l.scores = ScoreMatrix(4000, 0);
  t.layers.push_back(l);
  ExpectInvalid(t, "kv heads 4000, expected 1..1024");
  t.layers[0] = TurnLayer();
  for (KvTensor* k : {&t.layers[0].prompt_k, &t.layers[0].prompt_v, &t.layers[0].gen_k,
                      &t.layers[0].gen_v, &t.layers[0].history_k, &t.layers[0].history_v}) {
    *k = KvTensor(DType::kF32, 2, 0, 100000);
  }
  t.layers[0].scores = ScoreMatrix(2, 0);
  ExpectInvalid(t, "head_dim 100000, expected 1..1024");
  TurnGeometry geo;
  geo.kv_heads = 8;
  geo.head_dim = 128;
  geo.score_heads = 1 << 20;
  EXPECT_EQ(ValidateGeometry(geo).code(), absl::StatusCode::kInvalidArgument);
  geo.score_heads = 40;
  EXPECT_TRUE(ValidateGeometry(geo).ok());
  geo.kv_heads = 0;
  EXPECT_EQ(ValidateGeometry(geo).code(), absl::StatusCode::kInvalidArgument);
}

TEST(TurnTest, ReduceScoresSumsConsecutiveGroups) {
  ScoreMatrix s(6, 3);  // 6 query heads, 2 kv heads: groups {0,1,2}, {3,4,5}
  for (int r = 0; r < 6; ++r)
    for (int c = 0; c < 3; ++c) s.at(r, c) = static_cast<float>(1 << r) * (c + 1);
  const std::vector<double> red = ReduceScores(s, 2);
  ASSERT_EQ(red.size(), 6u);
  for (int c = 0; c < 3; ++c) {
    EXPECT_EQ(red[c], 7.0 * (c + 1));
    EXPECT_EQ(red[3 + c], 56.0 * (c + 1));
  }
  EXPECT_EQ(ReduceScores(s, 6)[17], 96.0);
}

TEST(TurnTest, PromptPos0DefaultsToHistoryLength) {
  TurnShape s;
  s.n_history = 9;
  Turn t = RandomTurn(s, 3);
  t.prompt_pos0.reset();
  EXPECT_EQ(t.PromptPos0(), 9);
  t.prompt_pos0 = 100;
  EXPECT_EQ(t.PromptPos0(), 100);
}

}  // namespace
}  // namespace kvrelay
