// The input of compression: one agent turn (BRIEF §2).
//
// A turn carries, per layer, the agent's prompt and generated KV, optional
// inherited history with its position ids, and the attention mass that the
// generated steps put on each prompt token. Position ids of the prompt are
// implicit: prompt token j has id prompt_pos0 + j, generated token j has id
// prompt_pos0 + n_prompt + j.
#ifndef KVRELAY_CORE_TURN_H_
#define KVRELAY_CORE_TURN_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/tensor.h"

namespace kvrelay {

struct TurnLayer {
  KvTensor prompt_k, prompt_v;    // [kv_heads, n_prompt, head_dim]
  KvTensor gen_k, gen_v;          // [kv_heads, n_gen, head_dim]
  KvTensor history_k, history_v;  // [kv_heads, n_history, head_dim]; n_history may be 0
  PosTensor history_pos;          // [kv_heads, n_history]
  // The attention input: exactly one of the two, the same in every layer.
  // [score_heads, n_prompt]; score_heads is kv_heads, or a multiple of it
  // (query heads, reduced by summing consecutive groups). Empty (0 rows)
  // when the layer carries gen_q.
  ScoreMatrix scores;
  // [score_heads, n_gen, head_dim], F32 or the K/V dtype: the post-RoPE
  // query of each score head at each generated step, from which the relay
  // computes the scores (docs/FORMAT.md, step 0). Empty (0 heads) when the
  // layer carries scores.
  KvTensor gen_q;
  // Optional, with history, in every layer or none (docs/FORMAT.md):
  // [kv_heads, n_history], the history's accumulated importance as received
  // (absent: 0); and [score_heads, n_history], the attention mass this
  // agent's steps put on the history, only with `scores` (absent: 0).
  ScoreMatrix history_acc;
  ScoreMatrix history_score;

  bool has_queries() const { return gen_q.heads() > 0; }
};

// Geometry shared by every layer of a turn, as established by layer 0.
struct TurnGeometry {
  DType dtype = DType::kBF16;
  int kv_heads = 0;
  int head_dim = 0;
  int score_heads = 0;
  int n_prompt = 0;
  int n_gen = 0;
  int n_history = 0;
  // Scores come from gen_q (in q_dtype) rather than from prompt.score.
  bool queries = false;
  DType q_dtype = DType::kF32;
  // Layers carry history_acc / history_score.
  bool history_acc = false;
  bool history_score = false;
  // Position ids of the chain's anchors that the history holds, ascending;
  // every head of every layer's history holds each exactly once.
  std::vector<int32_t> history_anchors;
};

// A whole turn's layout: its geometry and what a turn holds beside its
// layers. The core's and the wire's one description of a turn before its
// tensors (LayoutOf from a Turn; a request header's geometry carries it).
struct TurnLayout {
  int layers = 0;
  TurnGeometry geo;  // n_history: history tokens carried (0 with a parent)
  bool first_agent = true;
  std::optional<int64_t> prompt_pos0;
  std::optional<double> softmax_scale;  // with geo.queries
  // Columns of every layer's history.score (geo.history_score when > 0):
  // geo.n_history, or with a parent the parent's tokens per head.
  int history_score_tokens = 0;
};

// Bounds on a turn's geometry. Real models stay far below them; they keep a
// hostile header from driving allocations or O(d^3) work that the input's
// size does not pay for.
inline constexpr int kMaxLayers = 1024;
inline constexpr int kMaxKvHeads = 1024;
inline constexpr int kMaxScoreHeads = 16384;
inline constexpr int kMaxHeadDim = 1024;
inline constexpr int kMaxTokensPerPart = 1 << 24;
// The most multiply-adds scoring one layer from queries may take (score
// heads x head_dim x the keys each generated step sees, summed over the
// steps): 2^36, some 600 times a Qwen3-14B turn's layer. Attention is
// quadratic in the tokens, so a small upload could otherwise ask for hours.
inline constexpr double kMaxQueryScoreWork = 68719476736.0;
// InvalidArgument naming `field` when scoring one layer of geometry `geo`
// from queries takes more than kMaxQueryScoreWork multiply-adds (OK for a
// turn with scores). Checked per layer, and by a relay on the header before
// any tensor arrives.
absl::Status CheckQueryScoreWork(const TurnGeometry& geo, absl::string_view field);

// The range of softmax_scale (the logit scale of scores from queries).
// Models use 1/sqrt(head_dim) (1/32 to 1 for head_dim 1024 to 1) or a
// configured multiplier of the same order; a scale outside [1e-6, 1e3] is
// no model's, and a huge one overflows the float32 logits.
inline constexpr double kMinSoftmaxScale = 1e-6;
inline constexpr double kMaxSoftmaxScale = 1e3;

// InvalidArgument naming `field` unless `scale` is a finite number in
// [kMinSoftmaxScale, kMaxSoftmaxScale]. The one check of softmax_scale for
// turn files, turns and the wire.
absl::Status CheckSoftmaxScale(double scale, absl::string_view field);

// The fields of a geometry that ValidateGeometry checks.
enum class GeometryField { kKvHeads, kHeadDim, kNPrompt, kNGen, kNHistory, kScoreHeads, kQueryDType };

// Words an error about `field` of `geo`: `found` (the field's value as
// text) and `expected` (the rule). A turn names its tensors
// (TurnGeometryError: "layer.0.prompt.k: kv heads 0, expected 1..1024"), a
// request header its fields ("header.geometry.kv_heads: 0, expected
// 1..1024").
using GeometryErrorText = std::string (*)(const TurnGeometry& geo, GeometryField field, const std::string& found,
                                          const std::string& expected, const void* arg);
std::string TurnGeometryError(const TurnGeometry& geo, GeometryField field, const std::string& found,
                              const std::string& expected, const void* arg);

// The one check of a turn's geometry, for turns, turn files and request
// headers: InvalidArgument, worded by `text` (called with `arg`), when
// kv_heads, head_dim or a token count is out of the bounds above, score_heads
// is not a positive multiple of kv_heads (at most kMaxScoreHeads), the
// queries' dtype is neither F32 nor the K/V dtype, or history_anchors breaks
// CheckAnchorList.
absl::Status ValidateGeometry(const TurnGeometry& geo, GeometryErrorText text = TurnGeometryError,
                              const void* arg = nullptr);

// InvalidArgument naming history_anchors unless `anchors` is empty, or
// ascending distinct ids >= 0, at most n_history of them, with n_history > 0.
absl::Status CheckAnchorList(const std::vector<int32_t>& anchors, int n_history);

// Whether each of the n floats at p is finite and >= 0 (-0.0 included).
// Branch-free so it vectorizes; a caller that must name the offender looks
// for it only when this is false.
bool AllFiniteNonNegative(const float* p, size_t n);

// The rule for every list of a chain's anchors (history_anchors, a
// message's anchor_pos): ascending distinct position ids >= 0, each held
// exactly once by every head. These two find the first violation; callers
// name the list in their own terms.
//
// The index of the first id that is < 0 or not above the one before it;
// -1 when there is none.
int FirstUnorderedId(absl::Span<const int32_t> ids);
// The first head of `pos` (and anchor) that does not hold an anchor of
// `anchors` exactly once, with how many times it does; nullopt when every
// head holds every anchor once. REQUIRES: FirstUnorderedId(anchors) == -1.
struct AnchorMiss {
  int head = 0;
  int32_t anchor = 0;
  int held = 0;
};
std::optional<AnchorMiss> FindAnchorMiss(const PosTensor& pos, absl::Span<const int32_t> anchors);

struct Turn {
  bool first_agent = true;
  // Position id of the first prompt token. When unset, n_history is used.
  std::optional<int64_t> prompt_pos0;
  // The attention's logit scale, for scores from gen_q. When unset,
  // 1/sqrt(head_dim). In [kMinSoftmaxScale, kMaxSoftmaxScale] (GeometryOf).
  std::optional<double> softmax_scale;
  // Position ids of the chain's anchors in the history (TurnGeometry).
  std::vector<int32_t> history_anchors;
  std::vector<TurnLayer> layers;

  int64_t PromptPos0() const;
  // softmax_scale, or 1/sqrt(head_dim) when unset.
  double SoftmaxScale(int head_dim) const;
};

// Checks `geo` (ValidateGeometry), then one layer against it: shapes, dtypes, score layout, scores
// finite and >= 0, gen_q instead of scores exactly when geo.queries (its
// shape, dtype, finite values, the scoring work within
// kMaxQueryScoreWork), history_acc / history_score exactly when geo says
// (shape, finite and >= 0; history_score never with queries), every head's
// history holding each of geo.history_anchors exactly once, position ranges (history ids in [0, prompt_pos0), the
// last prompt/generated id within int32), and (when check_kv_values) that every
// K/V element is finite. The K/V scan reads every byte of the layer; callers
// that already checked the values (a file reader, a relay checking chunks as
// they arrive) may skip it. Errors are InvalidArgument and name the tensor,
// e.g. "layer.3.prompt.v: shape [8,512,64], expected [8,512,128]".
absl::Status ValidateTurnLayer(const TurnLayer& layer, int layer_index, const TurnGeometry& geo,
                               int64_t prompt_pos0, bool check_kv_values = true);

// Checks elements [first, first + n) of the K/V tensor `part` ("prompt.v")
// of layer `layer`, shape [heads, tokens, dim] in `dtype`, whose element 0
// is at `data`: InvalidArgument naming the tensor, the value and its
// [head, token, dim] index at the first NaN or Inf. For callers that check a
// tensor piece by piece as it arrives (the relay's chunk assembly).
absl::Status CheckKvFinite(DType dtype, const uint8_t* data, size_t first, size_t n, int layer,
                           absl::string_view part, int tokens, int dim);

// Derives the geometry from layer 0 (and the turn's history_anchors).
// InvalidArgument when the turn has no layers or layer 0 is inconsistent in
// itself (among others: both or neither of prompt.score and gen.q, a
// softmax_scale that is not finite and > 0, history_anchors without history
// or not ascending).
absl::StatusOr<TurnGeometry> GeometryOf(const Turn& turn);

// The turn's layout: GeometryOf, with the layer count and the turn's own fields.
absl::StatusOr<TurnLayout> LayoutOf(const Turn& turn);

// GeometryOf + ValidateTurnLayer on every layer.
absl::Status ValidateTurn(const Turn& turn);

// Reduces `scores` [score_heads, n] to per-KV-head scores [kv_heads, n] in
// float64 by summing each group of score_heads/kv_heads consecutive rows in
// ascending order. REQUIRES: score_heads % kv_heads == 0.
std::vector<double> ReduceScores(const ScoreMatrix& scores, int kv_heads);

}  // namespace kvrelay

#endif  // KVRELAY_CORE_TURN_H_
