#include "core/turn.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"

namespace kvrelay {
namespace {

std::string Shape(std::initializer_list<int64_t> dims) {
  return absl::StrCat("[", absl::StrJoin(dims, ","), "]");
}

std::string Name(int layer, absl::string_view part) { return absl::StrCat("layer.", layer, ".", part); }

// Index of the first element whose exponent bits are all ones (NaN or Inf),
// or n. `mask` is the exponent field, which ends just below the sign bit, so
// (x & mask) + lowest bit of mask carries into the sign bit exactly when the
// field is all ones: an AND, an ADD and an OR per element, in U's own width,
// which vectorizes to full-width integer SIMD.
template <typename U>
size_t FirstAllOnes(const U* p, size_t n, U mask) {
  constexpr size_t kBlock = 4096;
  const U low = static_cast<U>(mask & static_cast<U>(~mask + 1));
  const U sign = static_cast<U>(mask + low);
  for (size_t b = 0; b < n; b += kBlock) {
    const size_t e = std::min(n, b + kBlock);
    U acc = 0;
    for (size_t i = b; i < e; ++i) acc |= static_cast<U>((p[i] & mask) + low);
    if (acc & sign) {
      for (size_t i = b; i < e; ++i) {
        if ((p[i] & mask) == mask) return i;
      }
    }
  }
  return n;
}

size_t FirstNonFinite(DType dtype, const uint8_t* data, size_t n) {
  switch (dtype) {
    case DType::kF32:
      return FirstAllOnes(reinterpret_cast<const uint32_t*>(data), n, uint32_t{0x7f800000u});
    case DType::kBF16:
      return FirstAllOnes(reinterpret_cast<const uint16_t*>(data), n, uint16_t{0x7f80u});
    case DType::kF16:
      return FirstAllOnes(reinterpret_cast<const uint16_t*>(data), n, uint16_t{0x7c00u});
  }
  return n;
}

absl::Status CheckKv(const KvTensor& t, int layer, absl::string_view part, const TurnGeometry& geo,
                     int tokens, bool check_values) {
  if (t.dtype() != geo.dtype) {
    return absl::InvalidArgumentError(absl::StrCat(Name(layer, part), ": dtype ", DTypeName(t.dtype()),
                                                   ", expected ", DTypeName(geo.dtype),
                                                   " (dtype of layer.0.prompt.k)"));
  }
  if (t.heads() != geo.kv_heads || t.tokens() != tokens || t.dim() != geo.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        Name(layer, part), ": shape ", Shape({t.heads(), t.tokens(), t.dim()}), ", expected ",
        Shape({geo.kv_heads, tokens, geo.head_dim}), " (from layer.0)"));
  }
  if (!check_values) return absl::OkStatus();
  return CheckKvFinite(t.dtype(), t.bytes().data(), 0, t.elements(), layer, part, t.tokens(), t.dim());
}

// `sc` ([rows, cols], finite and >= 0), named `part` of layer li.
absl::Status CheckMass(const ScoreMatrix& sc, int li, absl::string_view part, int rows, int cols,
                       absl::string_view dims) {
  if (sc.rows != rows || sc.cols != cols || sc.data.size() != static_cast<size_t>(sc.rows) * sc.cols) {
    return absl::InvalidArgumentError(absl::StrCat(Name(li, part), ": shape ", Shape({sc.rows, sc.cols}),
                                                   ", expected ", Shape({rows, cols}), " (", dims, ")"));
  }
  if (AllFiniteNonNegative(sc.data.data(), sc.data.size())) return absl::OkStatus();
  for (int r = 0; r < sc.rows; ++r) {
    for (int c = 0; c < sc.cols; ++c) {
      const float v = sc.at(r, c);
      if (!std::isfinite(v) || v < 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: value %g at [%d,%d], expected a finite attention mass >= 0", Name(li, part), v, r, c));
      }
    }
  }
  return absl::OkStatus();
}

// The history's optional acc and score, and the anchors it must hold.
absl::Status CheckHistoryState(const TurnLayer& layer, int li, const TurnGeometry& geo) {
  auto presence = [&](const ScoreMatrix& sc, bool expected, absl::string_view part) -> absl::Status {
    const bool given = sc.given();
    if (given == expected) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(Name(li, part), given ? ": given" : ": missing",
                                                   ", expected it in every layer or in none (as layer.0)"));
  };
  KVRELAY_RETURN_IF_ERROR(presence(layer.history_acc, geo.history_acc, "history.acc"));
  KVRELAY_RETURN_IF_ERROR(presence(layer.history_score, geo.history_score, "history.score"));
  if (geo.history_acc) {
    KVRELAY_RETURN_IF_ERROR(CheckMass(layer.history_acc, li, "history.acc", geo.kv_heads, geo.n_history,
                                      "kv heads, n_history"));
  }
  if (geo.history_score) {
    if (geo.queries) {
      return absl::InvalidArgumentError(absl::StrCat(
          Name(li, "history.score"), ": given with gen.q, expected none (the relay computes the mass on the "
          "history from the queries)"));
    }
    if (geo.n_history == 0 && layer.history_score.cols > 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          Name(li, "history.score"), ": ", layer.history_score.cols, " tokens given without history, expected none "
          "(or a parent to compose on, whose tokens it covers)"));
    }
    KVRELAY_RETURN_IF_ERROR(CheckMass(layer.history_score, li, "history.score", geo.score_heads, geo.n_history,
                                      "score heads, n_history"));
  }
  if (std::optional<AnchorMiss> miss = FindAnchorMiss(layer.history_pos, geo.history_anchors)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "history_anchors: position ", miss->anchor, " is held ", miss->held, " times by head ", miss->head, " of ",
        Name(li, "history.pos"), ", expected exactly once (every head keeps every anchor of the chain)"));
  }
  return absl::OkStatus();
}

// The layer's scores, or its queries when geo.queries.
absl::Status CheckAttentionInput(const TurnLayer& layer, int li, const TurnGeometry& geo, bool check_values) {
  if (geo.queries) {
    if (layer.scores.given()) {
      return absl::InvalidArgumentError(absl::StrCat(Name(li, "prompt.score"), ": given, expected layer.", li,
                                                     ".gen.q like layer.0 (every layer carries the same one, "
                                                     "never both)"));
    }
    const KvTensor& q = layer.gen_q;
    if (q.dtype() != geo.q_dtype) {
      return absl::InvalidArgumentError(absl::StrCat(Name(li, "gen.q"), ": dtype ", DTypeName(q.dtype()),
                                                     ", expected ", DTypeName(geo.q_dtype),
                                                     " (dtype of layer.0.gen.q)"));
    }
    if (q.heads() != geo.score_heads || q.tokens() != geo.n_gen || q.dim() != geo.head_dim) {
      return absl::InvalidArgumentError(absl::StrCat(
          Name(li, "gen.q"), ": shape ", Shape({q.heads(), q.tokens(), q.dim()}), ", expected ",
          Shape({geo.score_heads, geo.n_gen, geo.head_dim}), " (score heads, n_gen, head_dim)"));
    }
    KVRELAY_RETURN_IF_ERROR(CheckQueryScoreWork(geo, Name(li, "gen.q")));
    if (!check_values) return absl::OkStatus();
    return CheckKvFinite(q.dtype(), q.bytes().data(), 0, q.elements(), li, "gen.q", q.tokens(), q.dim());
  }
  if (layer.has_queries()) {
    return absl::InvalidArgumentError(absl::StrCat(Name(li, "gen.q"), ": given, expected layer.", li,
                                                   ".prompt.score like layer.0 (every layer carries the same "
                                                   "one, never both)"));
  }
  return CheckMass(layer.scores, li, "prompt.score", geo.score_heads, geo.n_prompt, "score heads, n_prompt");
}

}  // namespace

bool AllFiniteNonNegative(const float* p, size_t n) {
  uint32_t bad = 0;
  for (size_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, p + i, sizeof u);
    // Sign clear and exponent not all ones, or exactly -0.0.
    bad |= static_cast<uint32_t>(u >= 0x7f800000u) & static_cast<uint32_t>(u != 0x80000000u);
  }
  return bad == 0;
}

absl::Status CheckKvFinite(DType dtype, const uint8_t* data, size_t first, size_t n, int layer,
                           absl::string_view part, int tokens, int dim) {
  // Non-finite values have an all-ones exponent in every dtype.
  const size_t es = DTypeSize(dtype);
  const size_t bad = first + FirstNonFinite(dtype, data + first * es, n);
  if (bad == first + n) return absl::OkStatus();
  float v;
  ToFloat(dtype, data + bad * es, &v, 1);
  const size_t d = static_cast<size_t>(dim), tok = static_cast<size_t>(tokens);
  return absl::InvalidArgumentError(absl::StrFormat(
      "%s: non-finite value %g at [%d,%d,%d], expected finite values", Name(layer, part), v,
      static_cast<int>(bad / d / tok), static_cast<int>(bad / d % tok), static_cast<int>(bad % d)));
}

absl::Status CheckSoftmaxScale(double scale, absl::string_view field) {
  if (scale >= kMinSoftmaxScale && scale <= kMaxSoftmaxScale) return absl::OkStatus();  // false for NaN
  return absl::InvalidArgumentError(
      absl::StrFormat("%s: %g, expected a finite number in [%g, %g]", field, scale, kMinSoftmaxScale, kMaxSoftmaxScale));
}

absl::Status CheckQueryScoreWork(const TurnGeometry& geo, absl::string_view field) {
  if (!geo.queries) return absl::OkStatus();
  const double steps = geo.n_gen;
  const double work = static_cast<double>(geo.score_heads) * geo.head_dim *
                      (steps * (static_cast<double>(geo.n_history) + geo.n_prompt) + steps * (steps + 1) / 2);
  if (work <= kMaxQueryScoreWork) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat(
      "%s: scoring from these queries takes %.4g multiply-adds per layer (score heads x head_dim x the keys "
      "each generated step sees), expected at most 2^36; send prompt.score instead",
      field, work));
}

double Turn::SoftmaxScale(int head_dim) const {
  return softmax_scale.has_value() ? *softmax_scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
}

int64_t Turn::PromptPos0() const {
  if (prompt_pos0.has_value()) return *prompt_pos0;
  return layers.empty() ? 0 : layers[0].history_k.tokens();
}

absl::StatusOr<TurnGeometry> GeometryOf(const Turn& turn) {
  if (turn.layers.empty()) return absl::InvalidArgumentError("turn: no layers, expected at least 1");
  const TurnLayer& l0 = turn.layers[0];
  TurnGeometry geo;
  geo.dtype = l0.prompt_k.dtype();
  geo.kv_heads = l0.prompt_k.heads();
  geo.head_dim = l0.prompt_k.dim();
  geo.n_prompt = l0.prompt_k.tokens();
  geo.n_gen = l0.gen_k.tokens();
  geo.n_history = l0.history_k.tokens();
  geo.queries = l0.has_queries();
  geo.q_dtype = l0.gen_q.dtype();
  geo.score_heads = geo.queries ? l0.gen_q.heads() : l0.scores.rows;
  geo.history_acc = l0.history_acc.given();
  geo.history_score = l0.history_score.given();
  geo.history_anchors = turn.history_anchors;
  if (geo.queries && l0.scores.given()) {
    return absl::InvalidArgumentError(
        "layer.0.gen.q: given together with layer.0.prompt.score, expected exactly one of the two");
  }
  if (!geo.queries && l0.scores.rows == 0) {
    return absl::InvalidArgumentError(
        "layer.0.prompt.score: missing, expected layer.0.prompt.score or layer.0.gen.q (the queries)");
  }
  if (turn.layers.size() > static_cast<size_t>(kMaxLayers)) {
    return absl::InvalidArgumentError(
        absl::StrCat("turn: ", turn.layers.size(), " layers, expected at most ", kMaxLayers));
  }
  if (turn.softmax_scale.has_value()) KVRELAY_RETURN_IF_ERROR(CheckSoftmaxScale(*turn.softmax_scale, "softmax_scale"));
  KVRELAY_RETURN_IF_ERROR(ValidateGeometry(geo));
  return geo;
}

absl::StatusOr<TurnLayout> LayoutOf(const Turn& turn) {
  TurnLayout s;
  KVRELAY_ASSIGN_OR_RETURN(s.geo, GeometryOf(turn));
  s.layers = static_cast<int>(turn.layers.size());
  s.first_agent = turn.first_agent;
  s.prompt_pos0 = turn.prompt_pos0;
  s.softmax_scale = turn.softmax_scale;
  if (s.geo.history_score) s.history_score_tokens = turn.layers[0].history_score.cols;
  return s;
}

absl::Status CheckAnchorList(const std::vector<int32_t>& anchors, int n_history) {
  if (anchors.empty()) return absl::OkStatus();
  if (n_history == 0) {
    return absl::InvalidArgumentError(absl::StrCat("history_anchors: ", anchors.size(),
                                                   " position ids, expected none for a turn without history"));
  }
  if (anchors.size() > static_cast<size_t>(n_history)) {
    return absl::InvalidArgumentError(absl::StrCat("history_anchors: ", anchors.size(),
                                                   " position ids, expected at most n_history = ", n_history));
  }
  if (const int i = FirstUnorderedId(anchors); i >= 0) {
    return absl::InvalidArgumentError(absl::StrCat("history_anchors: ", anchors[i], " at index ", i,
                                                   ", expected ascending distinct position ids >= 0"));
  }
  return absl::OkStatus();
}

int FirstUnorderedId(absl::Span<const int32_t> ids) {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || (i > 0 && ids[i] <= ids[i - 1])) return static_cast<int>(i);
  }
  return -1;
}

std::optional<AnchorMiss> FindAnchorMiss(const PosTensor& pos, absl::Span<const int32_t> anchors) {
  if (anchors.empty()) return std::nullopt;
  std::vector<int> held(anchors.size());
  for (int h = 0; h < pos.heads; ++h) {
    std::fill(held.begin(), held.end(), 0);
    for (int t = 0; t < pos.tokens; ++t) {
      auto it = std::lower_bound(anchors.begin(), anchors.end(), pos.at(h, t));
      if (it != anchors.end() && *it == pos.at(h, t)) ++held[it - anchors.begin()];
    }
    for (size_t a = 0; a < anchors.size(); ++a) {
      if (held[a] != 1) return AnchorMiss{h, anchors[a], held[a]};
    }
  }
  return std::nullopt;
}

std::string TurnGeometryError(const TurnGeometry& geo, GeometryField field, const std::string& found,
                              const std::string& expected, const void*) {
  const char* what = "";
  switch (field) {
    case GeometryField::kKvHeads: what = "layer.0.prompt.k: kv heads "; break;
    case GeometryField::kHeadDim: what = "layer.0.prompt.k: head_dim "; break;
    case GeometryField::kNPrompt: what = "layer.0.prompt.k: tokens "; break;
    case GeometryField::kNGen: what = "layer.0.gen.k: tokens "; break;
    case GeometryField::kNHistory: what = "layer.0.history.k: tokens "; break;
    case GeometryField::kScoreHeads:
      return absl::StrCat(geo.queries ? "layer.0.gen.q: " : "layer.0.prompt.score: ", found, " score heads, expected ",
                          expected);
    case GeometryField::kQueryDType: what = "layer.0.gen.q: dtype "; break;
  }
  return absl::StrCat(what, found, ", expected ", expected);
}

absl::Status ValidateGeometry(const TurnGeometry& geo, GeometryErrorText text, const void* arg) {
  auto error = [&](GeometryField f, const std::string& found, const std::string& expected) {
    return absl::InvalidArgumentError(text(geo, f, found, expected, arg));
  };
  for (auto [f, v, lo, hi] : {std::tuple<GeometryField, int, int, int>{GeometryField::kKvHeads, geo.kv_heads, 1, kMaxKvHeads},
                              {GeometryField::kHeadDim, geo.head_dim, 1, kMaxHeadDim},
                              {GeometryField::kNPrompt, geo.n_prompt, 0, kMaxTokensPerPart},
                              {GeometryField::kNGen, geo.n_gen, 0, kMaxTokensPerPart},
                              {GeometryField::kNHistory, geo.n_history, 0, kMaxTokensPerPart}}) {
    if (v < lo || v > hi) return error(f, absl::StrCat(v), absl::StrCat(lo, "..", hi));
  }
  KVRELAY_RETURN_IF_ERROR(CheckAnchorList(geo.history_anchors, geo.n_history));
  if (geo.score_heads < geo.kv_heads || geo.score_heads % geo.kv_heads != 0 ||
      geo.score_heads > kMaxScoreHeads) {
    return error(GeometryField::kScoreHeads, absl::StrCat(geo.score_heads),
                 absl::StrCat("a positive multiple of ", geo.kv_heads, " kv heads, at most ", kMaxScoreHeads));
  }
  if (geo.queries && geo.q_dtype != DType::kF32 && geo.q_dtype != geo.dtype) {
    return error(GeometryField::kQueryDType, std::string(DTypeName(geo.q_dtype)),
                 absl::StrCat("F32 or ", DTypeName(geo.dtype), " (the K/V dtype)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateTurnLayer(const TurnLayer& layer, int li, const TurnGeometry& geo,
                               int64_t prompt_pos0, bool check_kv_values) {
  KVRELAY_RETURN_IF_ERROR(ValidateGeometry(geo));
  for (auto [t, part, tokens] :
       {std::tuple<const KvTensor*, const char*, int>{&layer.prompt_k, "prompt.k", geo.n_prompt},
        {&layer.prompt_v, "prompt.v", geo.n_prompt},
        {&layer.gen_k, "gen.k", geo.n_gen},
        {&layer.gen_v, "gen.v", geo.n_gen},
        {&layer.history_k, "history.k", geo.n_history},
        {&layer.history_v, "history.v", geo.n_history}}) {
    absl::Status s = CheckKv(*t, li, part, geo, tokens, check_kv_values);
    if (!s.ok()) return s;
  }
  KVRELAY_RETURN_IF_ERROR(CheckAttentionInput(layer, li, geo, check_kv_values));
  const PosTensor& pos = layer.history_pos;
  if (pos.heads != (geo.n_history ? geo.kv_heads : pos.heads) || pos.tokens != geo.n_history ||
      pos.data.size() != static_cast<size_t>(pos.heads) * pos.tokens) {
    return absl::InvalidArgumentError(absl::StrCat(Name(li, "history.pos"), ": shape ",
                                                   Shape({pos.heads, pos.tokens}), ", expected ",
                                                   Shape({geo.kv_heads, geo.n_history})));
  }
  KVRELAY_RETURN_IF_ERROR(CheckHistoryState(layer, li, geo));
  if (prompt_pos0 < 0) {
    return absl::InvalidArgumentError(absl::StrCat("prompt_pos0: ", prompt_pos0, ", expected >= 0"));
  }
  // The history precedes the prompt: an id at or past prompt_pos0 would give
  // two cached tokens one position.
  for (size_t i = 0; i < pos.data.size(); ++i) {
    if (pos.data[i] < 0 || pos.data[i] >= prompt_pos0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: %d at [%d,%d], expected a position id in [0, prompt_pos0 = %d) (the history precedes the prompt; "
          "set prompt_pos0 past the history's last id)",
          Name(li, "history.pos"), pos.data[i], static_cast<int>(i / pos.tokens), static_cast<int>(i % pos.tokens),
          prompt_pos0));
    }
  }
  const int64_t last = prompt_pos0 + geo.n_prompt + geo.n_gen - 1;  // the last position id
  if (last > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("prompt_pos0: ", prompt_pos0,
                                                   " puts position ids past int32 (last ", last,
                                                   ")"));
  }
  return absl::OkStatus();
}

absl::Status ValidateTurn(const Turn& turn) {
  absl::StatusOr<TurnGeometry> geo = GeometryOf(turn);
  if (!geo.ok()) return geo.status();
  const int64_t pos0 = turn.PromptPos0();
  for (size_t l = 0; l < turn.layers.size(); ++l) {
    absl::Status s = ValidateTurnLayer(turn.layers[l], static_cast<int>(l), *geo, pos0);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

std::vector<double> ReduceScores(const ScoreMatrix& scores, int kv_heads) {
  const int group = scores.rows / kv_heads;
  const int n = scores.cols;
  std::vector<double> out(static_cast<size_t>(kv_heads) * n, 0.0);
  for (int h = 0; h < kv_heads; ++h) {
    double* dst = out.data() + static_cast<size_t>(h) * n;
    for (int g = 0; g < group; ++g) {
      const float* src = scores.data.data() + static_cast<size_t>(h * group + g) * n;
      for (int j = 0; j < n; ++j) dst[j] += static_cast<double>(src[j]);
    }
  }
  return out;
}

}  // namespace kvrelay
