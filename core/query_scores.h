// Scores from queries (docs/FORMAT.md, "Compression semantics", step 0):
// for a turn that carries the generated steps' queries (gen.q) instead of
// precomputed attention scores, the attention mass those steps put on each
// prompt token, as eager attention computes it.
//
// Thread-safe (pure functions).
#ifndef KVRELAY_CORE_QUERY_SCORES_H_
#define KVRELAY_CORE_QUERY_SCORES_H_

#include <vector>

#include "core/turn.h"

namespace kvrelay {

// The reduced scores A[h][j] of step 1 ([kv_heads, n_prompt], float64, row
// h at h * n_prompt): for each score head q, the softmax weights that each
// generated step t in the window puts on prompt token j, over the keys step
// t sees (the history, the prompt, generated steps 0..t of KV head
// q / (S/H)), with logits (q_t . k_i) * scale; summed over t in ascending
// order, then over the group's score heads in ascending order. `window` 0
// takes every step, otherwise the last `window`. Dot products and
// exponentials in float32, sums in float64.
// REQUIRES: geo.queries, ValidateTurnLayer(layer, ..., geo, ...) is OK,
// scale finite and > 0, window >= 0.
std::vector<double> QueryScores(const TurnLayer& layer, const TurnGeometry& geo, double scale, int window);

}  // namespace kvrelay

#endif  // KVRELAY_CORE_QUERY_SCORES_H_
