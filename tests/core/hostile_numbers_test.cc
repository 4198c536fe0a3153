// Turns whose finite numbers overflow what the pipeline computes from them:
// every policy either refuses them (InvalidArgument naming the tensor) or
// produces a message that keeps every invariant, and each of the two
// checks (finite values, output invariants) stops them on its own.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "core/internal/pipeline_checks.h"
#include "core/pipeline.h"
#include "core/selection.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"

namespace kvrelay {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
using testing::RandomTurn;
using testing::TurnShape;

// Turns one of the pipeline's checks off for the scope.
class CheckOff {
 public:
  explicit CheckOff(std::atomic<bool>* check) : check_(check) { check_->store(false); }
  ~CheckOff() { check_->store(true); }

 private:
  std::atomic<bool>* check_;
};

// A turn with queries whose keys and queries are scaled by `factor`: finite
// float32 values whose products q.k overflow float32 once factor^2 * d is
// past 3.4e38.
// With `head0_only`, only KV head 0's keys and its score heads' queries:
// before the finite checks, head 0's NaN attention kept fewer tokens than
// head 1, whose rows were then written past the buffer sized from head 0.
Turn HugeQueryTurn(float factor, uint64_t seed, bool head0_only = false) {
  TurnShape s;
  s.queries = true;
  s.n_prompt = 48;
  s.n_gen = 6;
  Turn turn = RandomTurn(s, seed);
  for (TurnLayer& l : turn.layers) {
    for (KvTensor* t : {&l.prompt_k, &l.gen_k, &l.gen_q}) {
      const int heads = head0_only ? t->heads() / s.kv_heads : t->heads();
      std::vector<float> row(t->dim());
      for (int h = 0; h < heads; ++h) {
        for (int j = 0; j < t->tokens(); ++j) {
          t->ReadRow(h, j, row.data());
          for (float& x : row) x *= factor;
          t->WriteRow(h, j, row.data());
        }
      }
    }
  }
  return turn;
}

const char* const kPolicies[] = {
    "full",          "gen",          "h2o-head:k=8",          "h2o-layer:k=8",       "h2o-auto:k=8",
    "h2o-head:k=8,window=2", "h2o-head:k=8+obf:p=2", "h2o-layer:k=8+obf:p=2,mode=fast", "h2o-head:k=8+int4",
    "full+int2",
};

TEST(HostileNumbers, OverflowingLogitsAreRefusedNamingTheQueries) {
  const Turn turn = HugeQueryTurn(1e20f, 1);
  for (const char* spec : kPolicies) {
    SCOPED_TRACE(spec);
    auto p = Pipeline::Create(spec);
    ASSERT_TRUE(p.ok()) << p.status();
    absl::StatusOr<Message> m = (*p)->Compress(turn);
    ASSERT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
    EXPECT_THAT(std::string(m.status().message()), StartsWith("layer.0.gen.q: the attention of score head "));
    EXPECT_THAT(std::string(m.status().message()), HasSubstr("overflows float32"));
  }
}

// Values near the edge (the 1e19): refused, or a message that keeps
// every invariant (Compress checks them; a broken one would be Internal).
TEST(HostileNumbers, ValuesNearTheEdgeAreRefusedOrConsistent) {
  for (float factor : {1e17f, 1e18f, 1e19f, 3e19f}) {
    const Turn turn = HugeQueryTurn(factor, 2);
    for (const char* spec : kPolicies) {
      SCOPED_TRACE(std::string(spec) + " x" + std::to_string(factor));
      auto p = Pipeline::Create(spec);
      ASSERT_TRUE(p.ok());
      absl::StatusOr<Message> m = (*p)->Compress(turn);
      if (!m.ok()) {
        EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
        continue;
      }
      for (const MessageLayer& l : m->layers) {
        EXPECT_EQ(l.tokens(), m->n_history + m->n_anchor + m->n_kept + m->n_gen);
        if (l.attention_error) {
          EXPECT_TRUE(std::isfinite(*l.attention_error));
        }
      }
    }
  }
}

// Without the finite checks the NaN attention reaches the selection; the
// output invariants alone stop it, as Internal (under AddressSanitizer in
// scripts/sanitize.sh: no write past a buffer either).
TEST(HostileNumbers, InvariantCheckAloneStopsOverflowingLogits) {
  CheckOff off(&internal::PipelineChecksForTesting().finite);
  for (bool head0_only : {false, true}) {
    const Turn turn = HugeQueryTurn(1e20f, 3, head0_only);
    for (const char* spec : {"h2o-head:k=8", "h2o-layer:k=8", "h2o-auto:k=8", "h2o-head:k=8,hist=2"}) {
      SCOPED_TRACE(std::string(spec) + (head0_only ? " head 0" : " every head"));
      absl::StatusOr<Message> m = (*Pipeline::Create(spec))->Compress(turn);
      ASSERT_EQ(m.status().code(), absl::StatusCode::kInternal) << m.status();
      EXPECT_THAT(std::string(m.status().message()), HasSubstr("pipeline invariant violated"));
      EXPECT_TRUE(IsInvariantViolation(m.status()));
    }
  }
}

// Without the output invariants the finite checks alone stop it, before
// any selection.
TEST(HostileNumbers, FiniteCheckAloneStopsOverflowingLogits) {
  CheckOff off(&internal::PipelineChecksForTesting().invariants);
  for (bool head0_only : {false, true}) {
    const Turn turn = HugeQueryTurn(1e20f, 3, head0_only);
    for (const char* spec : {"h2o-head:k=8", "h2o-layer:k=8", "h2o-auto:k=8", "h2o-head:k=8+int4"}) {
      SCOPED_TRACE(std::string(spec) + (head0_only ? " head 0" : " every head"));
      absl::StatusOr<Message> m = (*Pipeline::Create(spec))->Compress(turn);
      ASSERT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
      EXPECT_THAT(std::string(m.status().message()), StartsWith("layer.0.gen.q: "));
      EXPECT_FALSE(IsInvariantViolation(m.status()));
    }
  }
}

// prompt.score values are each finite, but a group's sum is past float32:
// the accumulated importance the message would carry is refused.
TEST(HostileNumbers, ScoresWhoseGroupSumOverflowsAreRefused) {
  TurnShape s;
  s.group = 4;
  Turn turn = RandomTurn(s, 4);
  for (TurnLayer& l : turn.layers) {
    for (float& x : l.scores.data) x = std::numeric_limits<float>::max();
  }
  for (const char* spec : {"h2o-head:k=8", "h2o-layer:k=8", "full"}) {
    SCOPED_TRACE(spec);
    absl::StatusOr<Message> m = (*Pipeline::Create(spec))->Compress(turn);
    ASSERT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
    EXPECT_THAT(std::string(m.status().message()), StartsWith("layer.0.prompt.score: the accumulated importance"));
  }
  // A group of one keeps the largest float32: accepted.
  s.group = 1;
  turn = RandomTurn(s, 4);
  for (TurnLayer& l : turn.layers) {
    for (float& x : l.scores.data) x = std::numeric_limits<float>::max();
  }
  EXPECT_TRUE((*Pipeline::Create("h2o-head:k=8"))->Compress(turn).ok());
}

TEST(HostileNumbers, TopKKeepsExactlyKWhateverTheScores) {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  const std::vector<double> scores = {nan, 1, nan, -inf, inf, 2, nan, 0, -0.0, nan, 5, nan};
  for (int k = 0; k <= static_cast<int>(scores.size()); ++k) {
    const std::vector<int> kept = TopK(scores, 0, static_cast<int>(scores.size()), k);
    ASSERT_EQ(kept.size(), static_cast<size_t>(k));
    EXPECT_TRUE(std::is_sorted(kept.begin(), kept.end()));
    EXPECT_EQ(std::adjacent_find(kept.begin(), kept.end()), kept.end());
  }
  // NaN ranks as -infinity: the six largest numbers first.
  EXPECT_EQ(TopK(scores, 0, 12, 6), (std::vector<int>{1, 4, 5, 7, 8, 10}));
  EXPECT_EQ(TopK(scores, 0, 12, 4), (std::vector<int>{1, 4, 5, 10}));
}

// CheckLayerOutput names each broken invariant of a layer, as Internal.
TEST(HostileNumbers, CheckLayerOutputNamesTheBrokenInvariant) {
  TurnShape s;
  const Turn turn = RandomTurn(s, 5);
  const TurnGeometry geo = *GeometryOf(turn);
  for (const char* spec : {"h2o-head:k=8", "h2o-layer:k=8+int4"}) {
    SCOPED_TRACE(spec);
    absl::StatusOr<Message> m = (*Pipeline::Create(spec))->Compress(turn);
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_TRUE(CheckLayerOutput(m->layers[1], geo, *m, 0, 1).ok());
    struct Case {
      const char* what;
      std::function<void(MessageLayer*)> edit;
    };
    const Case cases[] = {
        {"pos holds", [](MessageLayer* l) { l->pos.tokens -= 1; }},
        {"holds kept prompt token 1", [&](MessageLayer* l) { std::swap(l->pos.at(0, m->n_anchor), l->pos.at(0, m->n_anchor + 1)); }},
        {"holds anchor 0", [](MessageLayer* l) { l->pos.at(1, 0) = 7; }},
        {"holds generated token", [](MessageLayer* l) { l->pos.data.back() += 1; }},
        {"acc holds a value", [](MessageLayer* l) { l->acc[3] = std::numeric_limits<float>::quiet_NaN(); }},
        {"acc holds 1 values", [](MessageLayer* l) { l->acc.resize(1); }},
        {m->layers[1].quant ? "the quantized layer: quant: v of shape" : "v is", [](MessageLayer* l) {
           if (l->quant) {
             l->quant->v.scale.pop_back();
           } else {
             l->v = KvTensor(l->v.dtype(), l->v.heads(), l->v.tokens() - 1, l->v.dim());
           }
         }},
    };
    for (const Case& c : cases) {
      SCOPED_TRACE(c.what);
      MessageLayer l = m->layers[1];
      c.edit(&l);
      const absl::Status st = CheckLayerOutput(l, geo, *m, 0, 1);
      EXPECT_EQ(st.code(), absl::StatusCode::kInternal);
      EXPECT_THAT(std::string(st.message()), StartsWith("layer.1: pipeline invariant violated: "));
      EXPECT_THAT(std::string(st.message()), HasSubstr(c.what));
    }
  }
}

}  // namespace
}  // namespace kvrelay
