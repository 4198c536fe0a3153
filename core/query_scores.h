// Scores from queries (docs/FORMAT.md, "Compression semantics", step 0):
// for a turn that carries the generated steps' queries (gen.q) instead of
// precomputed attention scores, the attention mass those steps put on each
// prompt token, as eager attention computes it; and, from the same queries,
// how much a compressed layer changes the sender's own attention output.
//
// Thread-safe (pure functions).
#ifndef KVRELAY_CORE_QUERY_SCORES_H_
#define KVRELAY_CORE_QUERY_SCORES_H_

#include <atomic>
#include <vector>

#include "absl/status/statusor.h"
#include "core/message.h"
#include "core/turn.h"

namespace kvrelay {

// The reduced scores A[h][j] of step 1 ([kv_heads, n_prompt], float64, row
// h at h * n_prompt): for each score head q, the softmax weights that each
// generated step t in the window puts on prompt token j, over the keys step
// t sees (the history, the prompt, generated steps 0..t of KV head
// q / (S/H)), with logits (q_t . k_i) * scale; summed over t in ascending
// order, then over the group's score heads in ascending order. `window` 0
// takes every step, otherwise the last `window`. Dot products and
// exponentials in float32, sums in float64. InvalidArgument naming `gen.q`,
// the score head and the step when a step's float32 logits overflow (an
// infinite logit; docs/FORMAT.md, "Scores from queries"): the result is
// then never NaN or infinite.
// REQUIRES: geo.queries, ValidateTurnLayer(layer, ..., geo, ...) is OK,
// scale finite and > 0, window >= 0.
absl::StatusOr<std::vector<double>> QueryScores(const TurnLayer& layer, const TurnGeometry& geo, double scale,
                                                int window);

// As QueryScores, for every key of the layer: [kv_heads, m] with m =
// n_history + n_prompt + n_gen, row h at h * m, columns in the cache's
// order (history, prompt, generated). Generated token j gets the weights of
// the steps in the window that see it (t >= j); QueryScores is the prompt's
// columns. Same errors and REQUIRES. CancelledError once `cancelled` (may
// be null) is true, checked between heads and GEMM column blocks.
absl::StatusOr<std::vector<double>> QueryMass(const TurnLayer& layer, const TurnGeometry& geo, double scale,
                                              int window, const std::atomic<bool>* cancelled = nullptr);

// The fidelity figure of one compressed layer (docs/FORMAT.md, "Fidelity"):
// the mean over score heads and generated steps of |o_msg - o_full| /
// |o_full|. o_full is step t's attention output (softmax of the logits as
// above, times the values) over the whole cache the step sees; o_msg the
// same query's output over the message's tokens it would see (the history,
// the anchors, the kept prompt tokens, generated steps 0..t), with the
// message's keys and values as the recipient holds them: OBF's values, and
// quantized ones decoded into the turn's dtype. A step with o_full = 0
// counts 0 when o_msg = 0 too, else 1. Float32 dot products and outputs,
// float64 norms and mean. 0 when n_gen = 0. InvalidArgument naming `gen.q`,
// the score head and the step when a logit or an output overflows float32,
// so the figure is always finite.
// REQUIRES: geo.queries, ValidateTurnLayer(layer, ...) is OK, `msg` is the
// pipeline's output for `layer`, scale finite and > 0. CancelledError once
// `cancelled` (may be null) is true, checked between heads and GEMM column
// blocks.
absl::StatusOr<double> AttentionOutputError(const TurnLayer& layer, const TurnGeometry& geo,
                                            const MessageLayer& msg, double scale,
                                            const std::atomic<bool>* cancelled = nullptr);

}  // namespace kvrelay

#endif  // KVRELAY_CORE_QUERY_SCORES_H_
