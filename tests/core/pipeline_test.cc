#include "core/pipeline.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"

namespace kvrelay {
namespace {

using ::testing::HasSubstr;
using testing::RandomTurn;
using testing::TurnShape;

void ExpectSpecError(const std::string& spec, const std::string& substr) {
  auto p = Pipeline::Create(spec);
  ASSERT_FALSE(p.ok()) << spec;
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << spec;
  EXPECT_THAT(std::string(p.status().message()), HasSubstr(substr)) << spec;
}

TEST(PipelineSpecTest, Canonical) {
  auto p = Pipeline::Create("h2o-head:k=16+obf:mode=fast,p=4+int4:rotate=hadamard");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ((*p)->spec(),
            "h2o-head:k=16,sinks=4,recent=0+obf:p=4,mode=fast,inject=uniform,scale=ad_over_as,"
            "iters=12,oversample=10+int4:group=32,rotate=hadamard");
  EXPECT_EQ((*Pipeline::Create("full"))->spec(), "full");
  EXPECT_EQ((*Pipeline::Create("gen:sinks=2"))->spec(), "gen:sinks=2");
  // The canonical spec parses back to itself.
  auto again = Pipeline::Create((*p)->spec());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)->spec(), (*p)->spec());
}

TEST(PipelineSpecTest, ErrorsNameTheToken) {
  ExpectSpecError("", "empty spec");
  ExpectSpecError("h2o-head++int4", "stage 2 is empty");
  ExpectSpecError("h2o-heads:k=3", "'h2o-heads': unknown stage");
  ExpectSpecError("h2o-head:k=abc", "k=abc: expected an integer in [0,");
  ExpectSpecError("h2o-head:k=-1", "k=-1: expected an integer");
  ExpectSpecError("h2o-head:kk=3", "unknown parameter 'kk'");
  ExpectSpecError("h2o-head:k", "parameter 'k', expected key=value");
  ExpectSpecError("h2o-head:k=1,k=2", "parameter 'k' given twice");
  ExpectSpecError("full:k=3", "'full': unknown parameter 'k' (this stage takes none)");
  ExpectSpecError("h2o-head+h2o-layer", "'h2o-layer': a second selector");
  ExpectSpecError("obf+h2o-head", "'obf': must follow a selector");
  ExpectSpecError("int4", "'int4': must follow a selector");
  ExpectSpecError("gen+obf", "'obf': needs h2o-layer, h2o-head or h2o-auto");
  ExpectSpecError("full+obf", "'obf': needs h2o-layer, h2o-head or h2o-auto");
  ExpectSpecError("h2o-head+int4+obf", "'obf': must come before the quantizer");
  ExpectSpecError("h2o-head+obf+obf", "'obf': given twice");
  ExpectSpecError("h2o-head+int4+int8", "'int8': a second quantizer");
  ExpectSpecError("h2o-head+obf:mode=slow", "mode=slow: expected one of exact, fast");
  ExpectSpecError("h2o-head+obf:p=0", "p=0: expected an integer in [1,");
  ExpectSpecError("h2o-head+obf:scale=half", "scale=half: expected one of ad_over_as, ad_frac, ad, none");
  ExpectSpecError("h2o-head+int8:rotate=hadamard", "rotate=hadamard applies to int4 and int2 only");
  // The fast path's parameters with the exact path: refused, not dropped.
  ExpectSpecError("h2o-head+obf:iters=5", "'obf': iters: applies to mode=fast only");
  ExpectSpecError("h2o-head+obf:mode=exact,oversample=3", "'obf': oversample: applies to mode=fast only");
  EXPECT_TRUE(Pipeline::Create("h2o-head+obf:mode=fast,iters=5,oversample=3").ok());
  // Offline use takes the relay's length limit.
  const std::string padded = "h2o-head:k=" + std::string(kMaxSpecBytes, '0') + "5";
  ExpectSpecError(padded, absl::StrCat("policy: ", padded.size(), " bytes, expected at most 1024"));
  EXPECT_TRUE(Pipeline::Create("h2o-head:k=" + std::string(kMaxSpecBytes - 12, '0') + "5").ok());
  ExpectSpecError("h2o-head+int4:group=0", "group=0: expected an integer in [1,");
  // No spaces or control bytes anywhere.
  ExpectSpecError("h2o-head:k=32 ", "policy: byte 13 is a space (0x20), expected printable ASCII without spaces");
  ExpectSpecError("h2o-head: k=32", "policy: byte 9 is a space");
  ExpectSpecError("h2o-head:k=32\n", "byte 13 is not printable ASCII (0x0a)");
  ExpectSpecError("h2o-head:k=3\xc3\xa9", "byte 12 is not printable ASCII (0xc3)");
  ExpectSpecError("h2o-head:k=", "k=: expected an integer in [0,");
  ExpectSpecError("h2o-head:k=+3", "policy stage 'h2o-head': k=: expected an integer");  // '+' joins stages
}

TEST(PipelineSpecTest, PoolMustBeOddAndPositive) {
  for (const char* bad : {"0", "2", "-1", "abc", "", "4", "1.0", "33554435"}) {
    for (const char* sel : {"h2o-head", "h2o-layer"}) {
      const std::string spec = absl::StrCat(sel, ":k=8,pool=", bad, "+obf");
      auto p = Pipeline::Create(spec);
      ASSERT_FALSE(p.ok()) << spec;
      EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << spec;
      EXPECT_EQ(p.status().message(),
                absl::StrCat("policy stage '", sel, "': pool=", bad, ": expected an odd integer in [1, 33554433]"))
          << spec;
    }
  }
  // Only the h2o selectors take it.
  ExpectSpecError("gen:pool=3", "'gen': unknown parameter 'pool' (known: sinks)");
  ExpectSpecError("full:pool=3", "'full': unknown parameter 'pool' (this stage takes none)");
  ExpectSpecError("h2o-head+obf:pool=3", "'obf': unknown parameter 'pool'");
  EXPECT_TRUE(Pipeline::Create("h2o-head:pool=33554433").ok());
}

TEST(PipelineSpecTest, CanonicalListsPoolOnlyWhenNotOne) {
  // pool=1 is no pooling: the canonical spec is the one from before pool existed.
  for (const char* spec : {"h2o-head:k=16", "h2o-head:k=16,pool=1", "h2o-head:pool=1,k=16,recent=0"}) {
    EXPECT_EQ((*Pipeline::Create(spec))->spec(), "h2o-head:k=16,sinks=4,recent=0") << spec;
  }
  auto p = Pipeline::Create("h2o-layer:pool=5,k=8+obf");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ((*p)->spec(), "h2o-layer:k=8,sinks=4,recent=0,pool=5+obf:p=8,mode=exact,inject=uniform,scale=ad_over_as");
  EXPECT_EQ((*p)->config().select.pool, 5);
  auto again = Pipeline::Create((*p)->spec());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ((*again)->spec(), (*p)->spec());
}

TEST(PipelineSpecTest, RegistryIsExtensible) {
  Registry r;
  ASSERT_TRUE(RegisterBuiltins(&r).ok());
  EXPECT_EQ(RegisterBuiltins(&r).code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(r.Register("top8", Registry::Kind::kSelector, [](const StageSpec&, PipelineConfig* c) {
                 c->select.kind = SelectorKind::kH2oHead;
                 c->select.k = 8;
                 return absl::OkStatus();
               }).ok());
  auto p = Pipeline::Create("top8+obf", r);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ((*p)->config().select.k, 8);
  EXPECT_EQ(Pipeline::Create("top8").status().code(), absl::StatusCode::kInvalidArgument);
}

Message MustCompress(const std::string& spec, const Turn& turn, ThreadPool* pool = nullptr) {
  auto p = Pipeline::Create(spec);
  EXPECT_TRUE(p.ok()) << p.status();
  auto m = (*p)->Compress(turn, pool);
  EXPECT_TRUE(m.ok()) << m.status();
  return *std::move(m);
}

TEST(PipelineTest, FullIsBitExactIdentity) {
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    TurnShape s;
    s.dtype = dt;
    s.n_history = 6;
    const Turn turn = RandomTurn(s, 42);
    const Message m = MustCompress("full", turn);
    ASSERT_EQ(m.layers.size(), 2u);
    const int n = 6 + 40 + 5;
    for (size_t l = 0; l < m.layers.size(); ++l) {
      const TurnLayer& in = turn.layers[l];
      const MessageLayer& out = m.layers[l];
      ASSERT_EQ(out.k.tokens(), n);
      for (int h = 0; h < 2; ++h) {
        int t = 0;
        auto check = [&](const KvTensor& k, const KvTensor& v, int j, int32_t pos) {
          ASSERT_EQ(std::memcmp(out.k.row(h, t), k.row(h, j), k.row_bytes()), 0);
          ASSERT_EQ(std::memcmp(out.v.row(h, t), v.row(h, j), v.row_bytes()), 0);
          ASSERT_EQ(out.pos.at(h, t), pos);
          ++t;
        };
        for (int j = 0; j < 6; ++j) check(in.history_k, in.history_v, j, in.history_pos.at(h, j));
        const int32_t pos0 = static_cast<int32_t>(turn.PromptPos0());
        for (int j = 0; j < 40; ++j) check(in.prompt_k, in.prompt_v, j, pos0 + j);
        for (int j = 0; j < 5; ++j) check(in.gen_k, in.gen_v, j, pos0 + 40 + j);
      }
    }
    EXPECT_EQ(m.full_bytes, m.sent_bytes);
    EXPECT_EQ(m.full_bytes, 2ull * 2 * n * (2 * 16 * DTypeSize(dt) + 4));
  }
}

TEST(PipelineTest, GenKeepsNoPromptBeyondSinks) {
  for (bool first : {true, false}) {
    TurnShape s;
    s.first_agent = first;
    s.n_history = 3;
    const Turn turn = RandomTurn(s, 7);
    const Message m = MustCompress("gen", turn);
    EXPECT_EQ(m.n_anchor, first ? 4 : 0);
    EXPECT_EQ(m.n_kept, 0);
    for (const MessageLayer& l : m.layers) {
      for (int h = 0; h < l.pos.heads; ++h) {
        for (int t = 0; t < l.pos.tokens; ++t) {
          const int32_t pos = l.pos.at(h, t);
          const int64_t pos0 = turn.PromptPos0();
          const bool prompt = t >= 3 && pos >= pos0 && pos < pos0 + 40;
          if (prompt) {
            EXPECT_TRUE(first && pos < pos0 + 4) << "prompt position " << pos << " kept";
          }
        }
      }
    }
  }
}

// next_pos is where the turn ended, also when nothing was generated and the
// prompt's tail was evicted (then it lies past every id the message holds).
TEST(PipelineTest, NextPosIsTheTurnsEnd) {
  TurnShape s;
  s.n_gen = 0;
  Turn turn = RandomTurn(s, 19);
  turn.prompt_pos0 = 300;
  for (TurnLayer& l : turn.layers) {
    for (int h = 0; h < l.scores.rows; ++h) {
      for (int j = 0; j < s.n_prompt; ++j) l.scores.at(h, j) = j < 20 ? 1.0f + j : 0.0f;
    }
  }
  for (const char* spec : {"full", "gen", "h2o-layer:k=6", "h2o-head:k=6+obf:p=2", "h2o-head:k=6+int4"}) {
    SCOPED_TRACE(spec);
    const Message m = MustCompress(spec, turn);
    EXPECT_EQ(m.next_pos, 340);
    EXPECT_EQ(NextPosition(m), 340);
  }
  EXPECT_EQ(HeldEnd(MustCompress("h2o-head:k=6", turn)), 320) << "the tail (ids 320..339) is evicted";
  EXPECT_EQ(HeldEnd(MustCompress("full", turn)), 340);
  // With history (ids below prompt_pos0) the turn still ends after its prompt.
  s.n_history = 3;
  Turn with_history = RandomTurn(s, 20);
  with_history.prompt_pos0 = 500;
  for (TurnLayer& l : with_history.layers) l.history_pos.at(1, 2) = 499;
  EXPECT_EQ(MustCompress("h2o-head:k=6", with_history).next_pos, 540);
}

TEST(PipelineTest, SelectionComposesInOrderWithPositions) {
  TurnShape s;
  s.n_history = 5;
  s.kv_heads = 3;
  s.group = 2;
  Turn turn = RandomTurn(s, 9);
  turn.prompt_pos0 = 1000;
  const Message m = MustCompress("h2o-head:k=6,recent=2", turn);
  EXPECT_EQ(m.n_history, 5);
  EXPECT_EQ(m.n_anchor, 4);
  EXPECT_EQ(m.n_kept, 8);
  EXPECT_EQ(m.n_gen, 5);
  for (size_t l = 0; l < m.layers.size(); ++l) {
    const std::vector<double> sc = ReduceScores(turn.layers[l].scores, 3);
    for (int h = 0; h < 3; ++h) {
      const MessageLayer& ml = m.layers[l];
      ASSERT_EQ(ml.pos.tokens, 5 + 4 + 8 + 5);
      for (int j = 0; j < 4; ++j) EXPECT_EQ(ml.pos.at(h, 5 + j), 1000 + j);
      std::vector<int> kept;
      for (int i = 0; i < 8; ++i) kept.push_back(ml.pos.at(h, 9 + i) - 1000);
      EXPECT_TRUE(std::is_sorted(kept.begin(), kept.end()));
      EXPECT_EQ(kept[6], 38);
      EXPECT_EQ(kept[7], 39);
      // Every kept non-recent token outscores every evicted non-recent candidate.
      double min_kept = 1e300, max_del = -1;
      for (int j = 4; j < 38; ++j) {
        const double v = sc[h * 40 + j];
        if (std::find(kept.begin(), kept.end(), j) != kept.end()) min_kept = std::min(min_kept, v);
        else max_del = std::max(max_del, v);
      }
      EXPECT_GE(min_kept, max_del);
      for (int j = 0; j < 5; ++j) EXPECT_EQ(ml.pos.at(h, 17 + j), 1040 + j);
      // Keys are never changed: kept key rows are the prompt rows.
      for (int i = 0; i < 8; ++i)
        EXPECT_EQ(std::memcmp(ml.k.row(h, 9 + i), turn.layers[l].prompt_k.row(h, kept[i]), 16 * 4), 0);
    }
  }
}

TEST(PipelineTest, OutputIdenticalForEveryThreadCount) {
  TurnShape s;
  s.layers = 5;
  s.kv_heads = 4;
  s.head_dim = 32;
  s.n_prompt = 120;
  s.dtype = DType::kBF16;
  const Turn turn = RandomTurn(s, 11);
  for (const char* spec : {"h2o-head:k=16+obf", "h2o-layer:k=16+obf:mode=fast,inject=attn+int4:rotate=hadamard",
                           "h2o-head+obf:mode=fast+int2:group=8"}) {
    const Message base = MustCompress(spec, turn);
    for (int threads : {1, 2, 3, 8}) {
      ThreadPool pool(threads);
      const Message m = MustCompress(spec, turn, &pool);
      ASSERT_EQ(m.layers.size(), base.layers.size());
      for (size_t l = 0; l < m.layers.size(); ++l) {
        EXPECT_TRUE(m.layers[l].k == base.layers[l].k);
        EXPECT_TRUE(m.layers[l].v == base.layers[l].v);
        EXPECT_TRUE(m.layers[l].pos == base.layers[l].pos);
        ASSERT_EQ(m.layers[l].quant.has_value(), base.layers[l].quant.has_value());
        if (m.layers[l].quant) {
          EXPECT_EQ(m.layers[l].quant->k.codes, base.layers[l].quant->k.codes);
          EXPECT_EQ(m.layers[l].quant->v.codes, base.layers[l].quant->v.codes);
          EXPECT_EQ(m.layers[l].quant->v.scale, base.layers[l].quant->v.scale);
        }
      }
      EXPECT_EQ(m.sent_bytes, base.sent_bytes);
    }
  }
}

TEST(PipelineTest, PoolOneIsBitIdenticalToNoPool) {
  for (int seed = 0; seed < 6; ++seed) {
    TurnShape s;
    s.kv_heads = 1 + seed % 3;
    s.n_prompt = 20 + 13 * seed;
    s.n_history = seed % 2 ? 3 : 0;
    s.first_agent = seed % 3 != 0;
    s.dtype = seed % 2 ? DType::kBF16 : DType::kF32;
    const Turn turn = RandomTurn(s, 100 + seed);
    for (const char* base : {"h2o-head:k=7", "h2o-layer:k=5,recent=3", "h2o-head:k=9,sinks=2+obf:inject=attn",
                             "h2o-layer:k=6+obf:mode=fast", "h2o-head:k=4,recent=2+obf+int4:group=8"}) {
      std::string pooled(base);
      const size_t stage_end = pooled.find('+');
      pooled.insert(stage_end == std::string::npos ? pooled.size() : stage_end, ",pool=1");
      const Message a = MustCompress(base, turn);
      const Message b = MustCompress(pooled, turn);
      EXPECT_EQ(a.policy, b.policy) << pooled;
      EXPECT_EQ(a.sent_bytes, b.sent_bytes) << pooled;
      EXPECT_EQ(a.n_kept, b.n_kept) << pooled;
      ASSERT_EQ(a.layers.size(), b.layers.size());
      for (size_t l = 0; l < a.layers.size(); ++l) {
        EXPECT_TRUE(a.layers[l].k == b.layers[l].k) << pooled << " layer " << l;
        EXPECT_TRUE(a.layers[l].v == b.layers[l].v) << pooled << " layer " << l;
        EXPECT_TRUE(a.layers[l].pos == b.layers[l].pos) << pooled << " layer " << l;
        ASSERT_EQ(a.layers[l].quant.has_value(), b.layers[l].quant.has_value());
        if (a.layers[l].quant) {
          EXPECT_EQ(a.layers[l].quant->k.codes, b.layers[l].quant->k.codes);
          EXPECT_EQ(a.layers[l].quant->v.codes, b.layers[l].quant->v.codes);
          EXPECT_EQ(a.layers[l].quant->k.scale, b.layers[l].quant->k.scale);
          EXPECT_EQ(a.layers[l].quant->v.scale, b.layers[l].quant->v.scale);
        }
      }
    }
  }
}

TEST(PipelineTest, PoolKeepsTheSameCountAndComposesInOrder) {
  TurnShape s;
  s.n_prompt = 50;
  const Turn turn = RandomTurn(s, 21);
  const Message plain = MustCompress("h2o-head:k=6,recent=2+obf", turn);
  const Message pooled = MustCompress("h2o-head:k=6,recent=2,pool=5+obf", turn);
  EXPECT_EQ(pooled.n_kept, plain.n_kept);
  EXPECT_EQ(pooled.sent_bytes, plain.sent_bytes);
  for (const MessageLayer& l : pooled.layers) {
    for (int h = 0; h < 2; ++h) {
      std::vector<int> kept;
      for (int i = 0; i < 8; ++i) kept.push_back(l.pos.at(h, 4 + i));
      EXPECT_TRUE(std::is_sorted(kept.begin(), kept.end()));
      EXPECT_EQ(kept[6], 48);
      EXPECT_EQ(kept[7], 49);
    }
  }
}

TEST(PipelineTest, ByteAccountingAddsUp) {
  TurnShape s;
  s.n_history = 10;
  s.dtype = DType::kBF16;
  const Turn turn = RandomTurn(s, 13);
  const Message full = MustCompress("full", turn);
  for (const char* spec : {"gen", "h2o-layer:k=8", "h2o-head:k=8+obf", "h2o-head:k=8+int8", "h2o-head:k=8+int2:group=4"}) {
    const Message m = MustCompress(spec, turn);
    EXPECT_EQ(m.full_bytes, full.sent_bytes) << spec;
    uint64_t sum = 0;
    for (const MessageLayer& l : m.layers) sum += l.SentBytes();
    EXPECT_EQ(m.sent_bytes, sum) << spec;
    const uint64_t tokens = m.n_history + m.n_anchor + m.n_kept + m.n_gen;
    if (!m.layers[0].quant) {
      EXPECT_EQ(m.sent_bytes, 2ull * 2 * tokens * (2 * 16 * 2 + 4)) << spec;
    }
    EXPECT_LT(m.sent_bytes, full.sent_bytes) << spec;
  }
}

TEST(PipelineTest, ObfChangesOnlyKeptValues) {
  TurnShape s;
  s.n_prompt = 60;
  s.head_dim = 32;
  const Turn turn = RandomTurn(s, 17);
  const Message plain = MustCompress("h2o-head:k=8", turn);
  const Message obf = MustCompress("h2o-head:k=8+obf", turn);
  for (size_t l = 0; l < plain.layers.size(); ++l) {
    EXPECT_TRUE(plain.layers[l].k == obf.layers[l].k);
    EXPECT_TRUE(plain.layers[l].pos == obf.layers[l].pos);
    const auto& a = plain.layers[l].v;
    const auto& b = obf.layers[l].v;
    for (int h = 0; h < a.heads(); ++h) {
      for (int t = 0; t < a.tokens(); ++t) {
        const bool kept = t >= 4 && t < 12;
        const bool same = std::memcmp(a.row(h, t), b.row(h, t), a.row_bytes()) == 0;
        EXPECT_EQ(same, !kept) << "layer " << l << " head " << h << " token " << t;
      }
    }
  }
}

TEST(PipelineTest, ObfOverflowIsAnErrorNotInf) {
  // h2o-layer keeps tokens that only head 0 attends to; head 1 has A_keep = 0
  // and A_del > 0, so ad_over_as scales its delta by ~1e12: beyond F16.
  TurnShape s;
  s.dtype = DType::kF16;
  s.layers = 1;
  s.group = 1;
  Turn turn = RandomTurn(s, 23);
  ScoreMatrix& sc = turn.layers[0].scores;
  for (int j = 0; j < 40; ++j) {
    sc.at(0, j) = j < 12 ? 100.f : 0.f;
    sc.at(1, j) = j < 12 ? 0.f : 1.f;
  }
  auto m = (*Pipeline::Create("h2o-layer:k=8+obf"))->Compress(turn);
  ASSERT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("layer.0.prompt.v: obf backfill overflows F16 at head 1"));
  // A bounded scale mode compresses the same turn.
  EXPECT_TRUE((*Pipeline::Create("h2o-layer:k=8+obf:scale=ad_frac"))->Compress(turn).ok());
}

// A quantization error names the layer it happened in, as OBF's does.
TEST(PipelineTest, QuantErrorsNameTheLayer) {
  TurnShape s;
  s.dtype = DType::kF32;
  s.layers = 3;
  Turn turn = RandomTurn(s, 29);
  const float huge = -1e6f;  // no fp16 zero point at or below it
  std::memcpy(turn.layers[2].gen_k.row(1, 0) + 3 * sizeof(float), &huge, sizeof(huge));
  for (const char* policy : {"gen+int4", "h2o-head:k=8+int8"}) {
    auto m = (*Pipeline::Create(policy))->Compress(turn);
    ASSERT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << policy << ": " << m.status();
    EXPECT_THAT(std::string(m.status().message()), ::testing::StartsWith("layer.2: quant: k head 1")) << m.status();
  }
}

TEST(PipelineTest, RejectsInvalidTurnsAndOptions) {
  TurnShape s;
  Turn turn = RandomTurn(s, 19);
  turn.layers[1].scores.at(0, 0) = -3;
  auto p = Pipeline::Create("h2o-head");
  auto m = (*p)->Compress(turn);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("layer.1.prompt.score"));

  s.head_dim = 24;
  turn = RandomTurn(s, 20);
  m = (*Pipeline::Create("h2o-head+int4:rotate=hadamard"))->Compress(turn);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("rotate"));
}

// The kernel summary names one OBF path, then the bfloat16 dot product if
// used, then one CRC32C path; with KVRELAY_DISABLE_AVX512 set it names no
// AVX-512 kernel.
TEST(PipelineTest, KernelSummaryNamesThePathsInUse) {
  const std::string k = KernelSummary();
  const std::vector<std::string> parts = absl::StrSplit(k, '+');
  ASSERT_GE(parts.size(), 2u) << k;
  EXPECT_TRUE(parts[0] == "avx512" || parts[0] == "avx2" || parts[0] == "scalar") << k;
  EXPECT_EQ(parts.back().rfind("crc32c-", 0), 0u) << k;
  if (parts.size() == 3) {
    EXPECT_EQ(parts[1], "bf16-dot") << k;
  }
  EXPECT_LE(parts.size(), 3u) << k;
  const char* off = std::getenv("KVRELAY_DISABLE_AVX512");
  if (off != nullptr && *off != '\0' && std::string(off) != "0") {
    EXPECT_EQ(k.find("avx512"), std::string::npos) << k;
    EXPECT_EQ(k.find("bf16"), std::string::npos) << k;
    EXPECT_EQ(k.find("vpclmulqdq"), std::string::npos) << k;
  }
}

}  // namespace
}  // namespace kvrelay
