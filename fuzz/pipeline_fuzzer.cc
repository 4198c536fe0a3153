// The pipeline's math on random turns: small geometries of every dtype,
// scores or queries, history with anchors, accumulated importance and
// history scores, values drawn from the edges of each dtype (±0,
// subnormals, the largest finite value, magnitudes whose products overflow
// float32), random softmax scales across the allowed range, through a random
// valid policy of every stage. Every turn either compresses into a message
// that keeps the output invariants (CheckLayerOutput, equal token counts,
// byte accounting, a finite fidelity figure) and writes and reads back as a
// message file, or is refused as InvalidArgument. Internal (an invariant the
// pipeline broke), a crash, or a sanitizer report is a finding.
#include <cmath>
#include <cstdlib>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <fuzzer/FuzzedDataProvider.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/format/turn_file.h"
#include "core/pipeline.h"
#include "fuzz/fuzz_check.h"

namespace kvrelay {
namespace {

// The largest finite value of `dtype`, as a float.
float MaxOf(DType dtype) {
  switch (dtype) {
    case DType::kF16: return 65504.0f;
    case DType::kBF16: return 3.3895313892515355e38f;
    default: return std::numeric_limits<float>::max();
  }
}

// One value of a tensor: from a palette of edges, or a scaled normal-ish
// value, always finite in `dtype` (clamped to its largest value).
class Values {
 public:
  Values(FuzzedDataProvider* in, DType dtype) : in_(in), max_(MaxOf(dtype)) {
    static const float kScales[] = {1.0f, 1e-30f, 1e-40f, 1e4f, 1e17f, 1e19f, 1e20f, 3e38f};
    scale_ = kScales[in_->ConsumeIntegralInRange<int>(0, sizeof kScales / sizeof kScales[0] - 1)];
    mode_ = in_->ConsumeIntegralInRange<int>(0, 2);
  }

  float Next() {
    float x;
    if (mode_ == 0) {
      static const float kEdges[] = {0.0f, -0.0f, 1.0f, -1.0f, 1e-45f, -1e-45f, 1.17549435e-38f, 1e19f, -1e19f,
                                     3.4028235e38f, -3.4028235e38f, 65504.0f, 0.5f};
      x = kEdges[in_->ConsumeIntegralInRange<int>(0, sizeof kEdges / sizeof kEdges[0] - 1)];
    } else {
      // A small signed integer times the tensor's scale: correlated rows
      // and exact ties are common.
      x = static_cast<float>(in_->ConsumeIntegralInRange<int>(-8, 8)) * scale_;
      if (mode_ == 2) x += static_cast<float>(in_->ConsumeIntegralInRange<int>(0, 255)) * (scale_ / 256);
    }
    if (!std::isfinite(x) || std::fabs(x) > max_) x = std::copysign(max_, x);
    return x;
  }

 private:
  FuzzedDataProvider* in_;
  float max_;
  float scale_ = 1;
  int mode_ = 0;
};

void Fill(FuzzedDataProvider* in, KvTensor* t) {
  Values v(in, t->dtype());
  std::vector<float> row(t->dim());
  for (int h = 0; h < t->heads(); ++h) {
    for (int j = 0; j < t->tokens(); ++j) {
      for (float& x : row) x = v.Next();
      t->WriteRow(h, j, row.data());
    }
  }
}

// Nonnegative scores (a value of -x is taken as x).
void Fill(FuzzedDataProvider* in, ScoreMatrix* m) {
  Values v(in, DType::kF32);
  for (float& x : m->data) x = std::fabs(v.Next());
}

std::string Selector(FuzzedDataProvider* in, bool queries) {
  static const char* const kKinds[] = {"full", "gen", "h2o-head", "h2o-layer", "h2o-auto"};
  const std::string kind = kKinds[in->ConsumeIntegralInRange<int>(0, 4)];
  if (kind == "full") return kind;
  std::vector<std::string> params;
  auto maybe = [&](const char* key, int lo, int hi) {
    if (in->ConsumeBool()) params.push_back(absl::StrCat(key, "=", in->ConsumeIntegralInRange<int>(lo, hi)));
  };
  maybe("sinks", 0, 6);
  if (kind != "gen") {
    maybe("k", 0, 40);
    maybe("recent", 0, 6);
    if (in->ConsumeBool()) params.push_back(absl::StrCat("pool=", 2 * in->ConsumeIntegralInRange<int>(0, 3) + 1));
    if (queries) maybe("window", 1, 6);
    maybe("hist", 0, 12);
    if (kind == "h2o-auto" && in->ConsumeBool()) {
      params.push_back(absl::StrCat("tau=", in->ConsumeIntegralInRange<int>(0, 10) / 10.0));
    }
  }
  return params.empty() ? kind : absl::StrCat(kind, ":", absl::StrJoin(params, ","));
}

std::string Policy(FuzzedDataProvider* in, bool queries) {
  std::string spec = Selector(in, queries);
  if (spec.rfind("h2o", 0) == 0 && in->ConsumeBool()) {
    static const char* const kScale[] = {"ad_over_as", "ad_frac", "ad", "none"};
    const bool fast = in->ConsumeBool();
    absl::StrAppend(&spec, "+obf:p=", in->ConsumeIntegralInRange<int>(1, 6), ",mode=", fast ? "fast" : "exact",
                    ",inject=", in->ConsumeBool() ? "attn" : "uniform", ",scale=",
                    kScale[in->ConsumeIntegralInRange<int>(0, 3)]);
    if (fast) absl::StrAppend(&spec, ",iters=", in->ConsumeIntegralInRange<int>(1, 12));
  }
  if (in->ConsumeBool()) {
    static const char* const kBits[] = {"int8", "int4", "int2"};
    absl::StrAppend(&spec, "+", kBits[in->ConsumeIntegralInRange<int>(0, 2)], ":group=",
                    in->ConsumeIntegralInRange<int>(1, 40), ",rotate=", in->ConsumeBool() ? "hadamard" : "none");
  }
  return spec;
}

Turn MakeTurn(FuzzedDataProvider* in, bool queries) {
  static const DType kDTypes[] = {DType::kF32, DType::kF16, DType::kBF16};
  const DType dtype = kDTypes[in->ConsumeIntegralInRange<int>(0, 2)];
  const int layers = in->ConsumeIntegralInRange<int>(1, 2);
  const int heads = in->ConsumeIntegralInRange<int>(1, 3);
  const int group = in->ConsumeIntegralInRange<int>(1, 3);
  const int d = 1 << in->ConsumeIntegralInRange<int>(0, 4);  // 1..16; powers of two for rotate=hadamard
  const int n_prompt = in->ConsumeIntegralInRange<int>(0, 48);
  const int n_gen = in->ConsumeIntegralInRange<int>(0, 6);
  const int n_hist = in->ConsumeIntegralInRange<int>(0, 10);
  const DType q_dtype = in->ConsumeBool() ? DType::kF32 : dtype;
  const bool anchor = n_hist > 0 && in->ConsumeBool();
  const bool hist_acc = n_hist > 0 && in->ConsumeBool();
  const bool hist_score = n_hist > 0 && !queries && in->ConsumeBool();
  Turn turn;
  turn.first_agent = in->ConsumeBool();
  turn.prompt_pos0 = 2 * n_hist + in->ConsumeIntegralInRange<int>(0, 3);
  if (queries && in->ConsumeBool()) {
    static const double kScales[] = {1e-6, 1e-3, 0.25, 1, 30, 1e3};
    turn.softmax_scale = kScales[in->ConsumeIntegralInRange<int>(0, 5)];
  }
  if (anchor) turn.history_anchors = {0};
  for (int l = 0; l < layers; ++l) {
    TurnLayer layer;
    layer.prompt_k = KvTensor(dtype, heads, n_prompt, d);
    layer.prompt_v = KvTensor(dtype, heads, n_prompt, d);
    layer.gen_k = KvTensor(dtype, heads, n_gen, d);
    layer.gen_v = KvTensor(dtype, heads, n_gen, d);
    layer.history_k = KvTensor(dtype, heads, n_hist, d);
    layer.history_v = KvTensor(dtype, heads, n_hist, d);
    for (KvTensor* t : {&layer.prompt_k, &layer.prompt_v, &layer.gen_k, &layer.gen_v, &layer.history_k,
                        &layer.history_v}) {
      Fill(in, t);
    }
    // Distinct ids below prompt_pos0; id 0 first in every head (the anchor).
    layer.history_pos = PosTensor(heads, n_hist);
    for (int h = 0; h < heads; ++h) {
      for (int j = 0; j < n_hist; ++j) layer.history_pos.at(h, j) = j == 0 ? 0 : 2 * j + (h % 2);
    }
    if (queries) {
      layer.gen_q = KvTensor(q_dtype, heads * group, n_gen, d);
      Fill(in, &layer.gen_q);
    } else {
      layer.scores = ScoreMatrix(heads * group, n_prompt);
      Fill(in, &layer.scores);
    }
    if (hist_acc) {
      layer.history_acc = ScoreMatrix(heads, n_hist);
      Fill(in, &layer.history_acc);
    }
    if (hist_score) {
      layer.history_score = ScoreMatrix(heads * group, n_hist);
      Fill(in, &layer.history_score);
    }
    turn.layers.push_back(std::move(layer));
  }
  return turn;
}

void CheckMessage(const Pipeline& p, const Turn& turn, const Message& m) {
  const absl::StatusOr<TurnGeometry> geo = GeometryOf(turn);
  FUZZ_CHECK(geo.ok());
  FUZZ_CHECK(m.layers.size() == turn.layers.size());
  uint64_t sent = 0;
  for (size_t l = 0; l < m.layers.size(); ++l) {
    FUZZ_CHECK(CheckLayerOutput(m.layers[l], *geo, m, turn.PromptPos0(), static_cast<int>(l)).ok());
    sent += m.layers[l].SentBytes();
  }
  FUZZ_CHECK(sent == m.sent_bytes);
  if (m.attention_error) FUZZ_CHECK(std::isfinite(*m.attention_error) && *m.attention_error >= 0);
  FUZZ_CHECK(m.next_pos >= HeldEnd(m));
  // What a relay commits, it can write and read back.
  std::string file;
  FUZZ_CHECK(WriteMessage(m, &file).ok());
  const absl::StatusOr<Message> back = ReadMessage(AsBytes(file));
  FUZZ_CHECK(back.ok());
  FUZZ_CHECK(back->n_kept == m.n_kept && back->n_history == m.n_history && back->layers.size() == m.layers.size());
  FUZZ_CHECK(back->sent_bytes == m.sent_bytes);
  (void)p;
}

}  // namespace
}  // namespace kvrelay

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvrelay;
  FuzzedDataProvider in(data, size);
  const bool queries = in.ConsumeBool();
  const std::string spec = Policy(&in, queries);
  const Turn turn = MakeTurn(&in, queries);
  absl::StatusOr<std::unique_ptr<Pipeline>> p = Pipeline::Create(spec);
  if (!p.ok()) {
    FUZZ_CHECK(p.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  absl::StatusOr<Message> m = (*p)->Compress(turn);
  if (std::getenv("KVRELAY_FUZZ_VERBOSE")) {
    std::fprintf(stderr, "pipeline %s: %s\n", spec.c_str(), m.ok() ? "OK" : m.status().ToString().c_str());
  }
  if (!m.ok()) {
    if (m.status().code() != absl::StatusCode::kInvalidArgument) {
      std::fprintf(stderr, "policy %s: %s\n", spec.c_str(), m.status().ToString().c_str());
    }
    FUZZ_CHECK(m.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  CheckMessage(**p, turn, *m);
  return 0;
}
