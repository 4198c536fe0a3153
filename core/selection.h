// Token selection: which prompt tokens each KV head keeps (docs/FORMAT.md,
// "Compression semantics", steps 2 and 3).
//
// Pure functions, thread-safe.
#ifndef KVRELAY_CORE_SELECTION_H_
#define KVRELAY_CORE_SELECTION_H_

#include <vector>

#include "absl/types/span.h"

namespace kvrelay {

enum class SelectorKind { kFull, kGen, kH2oLayer, kH2oHead, kH2oAuto };

struct SelectorOptions {
  SelectorKind kind = SelectorKind::kFull;
  int k = 32;       // top-k budget of non-sink, non-recent candidates (>= 0)
  int sinks = 4;    // anchor tokens of the first agent (>= 0)
  int recent = 0;   // last candidates always kept (>= 0)
  int pool = 1;     // odd width of the max-pool over the top-k range (>= 1)
  int window = 0;   // score with the last `window` generated steps (0: all); needs queries
  int hist = -1;    // history candidates kept besides the chain's anchors (-1: all)
  double tau = 0.9; // h2o-auto: per-head selection below this mean normalised entropy
};

struct Selection {
  int n_anchor = 0;  // prompt tokens 0..n_anchor-1 are anchors
  // kept[h]: prompt indices of the kept candidates of head h, ascending.
  // Every head keeps the same number of tokens.
  std::vector<std::vector<int>> kept;
};

// Indices of the `k` largest of scores[begin, end), ties to the lower index,
// returned ascending. All of [begin, end) when k >= end - begin, else
// exactly max(k, 0) indices; a NaN ranks as -infinity.
std::vector<int> TopK(absl::Span<const double> scores, int begin, int end, int k);

// scores with every entry j in [begin, end) replaced by the maximum of
// scores[max(begin, j - pool/2) .. min(end - 1, j + pool/2)]: a max-pool of
// odd width `pool`, centred on j and clipped to [begin, end). Entries outside
// [begin, end) are copied unchanged. REQUIRES: pool >= 1 and odd, 0 <= begin
// <= end <= scores.size(), no NaN in scores[begin, end).
std::vector<double> MaxPool(absl::Span<const double> scores, int begin, int end, int pool);

// h2o-auto's choice for one layer (docs/FORMAT.md, step 3a): true (select
// per head) when the mean over KV heads of the normalised entropy of each
// head's candidate scores head_scores[h][n_anchor..n_prompt) is below tau.
bool AutoPicksHead(absl::Span<const double> head_scores, int kv_heads, int n_prompt, int n_anchor,
                   double tau);

// The history budget (docs/FORMAT.md, step 5a) for one layer: per KV head,
// the indices of the history tokens kept, ascending. `acc` is the
// history's accumulated importance after this turn, [kv_heads, n_history];
// `is_anchor` flags (0 or 1), per head and token, the chain's anchors (the
// same count in every head). Every head keeps its anchors and, when more than `hist`
// candidates remain, `hist` of them: per head by acc (`per_head`), or by
// the sum over heads of the r-th candidate's acc. hist < 0 keeps all.
std::vector<std::vector<int>> SelectHistory(absl::Span<const float> acc, absl::Span<const uint8_t> is_anchor,
                                            int kv_heads, int n_history, int hist, bool per_head);

// Selects for one layer. `head_scores` is the reduced [kv_heads, n_prompt]
// float64 score matrix (see ReduceScores). Anchors are the first
// min(sinks, n_prompt) tokens when `first_agent`, else none. h2o-* rank the
// top-k range (candidates before the recent window) by MaxPool(opts.pool) of
// their scores; docs/FORMAT.md has the rule. kH2oAuto is not taken here:
// resolve it to kH2oHead or kH2oLayer first (AutoPicksHead).
Selection Select(const SelectorOptions& opts, absl::Span<const double> head_scores, int kv_heads,
                 int n_prompt, bool first_agent);

}  // namespace kvrelay

#endif  // KVRELAY_CORE_SELECTION_H_
