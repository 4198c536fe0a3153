// Token selection: which prompt tokens each KV head keeps (docs/FORMAT.md,
// "Compression semantics", steps 2 and 3).
//
// Pure functions, thread-safe.
#ifndef KVRELAY_CORE_SELECTION_H_
#define KVRELAY_CORE_SELECTION_H_

#include <vector>

#include "absl/types/span.h"

namespace kvrelay {

enum class SelectorKind { kFull, kGen, kH2oLayer, kH2oHead };

struct SelectorOptions {
  SelectorKind kind = SelectorKind::kFull;
  int k = 32;       // top-k budget of non-sink, non-recent candidates (>= 0)
  int sinks = 4;    // anchor tokens of the first agent (>= 0)
  int recent = 0;   // last candidates always kept (>= 0)
  int pool = 1;     // odd width of the max-pool over the top-k range (>= 1)
  int window = 0;   // score with the last `window` generated steps (0: all); needs queries
};

struct Selection {
  int n_anchor = 0;  // prompt tokens 0..n_anchor-1 are anchors
  // kept[h]: prompt indices of the kept candidates of head h, ascending.
  // Every head keeps the same number of tokens.
  std::vector<std::vector<int>> kept;
};

// Indices of the `k` largest of scores[begin, end), ties to the lower index,
// returned ascending. All of [begin, end) when k >= end - begin. REQUIRES: no
// NaN in scores[begin, end).
std::vector<int> TopK(absl::Span<const double> scores, int begin, int end, int k);

// scores with every entry j in [begin, end) replaced by the maximum of
// scores[max(begin, j - pool/2) .. min(end - 1, j + pool/2)]: a max-pool of
// odd width `pool`, centred on j and clipped to [begin, end). Entries outside
// [begin, end) are copied unchanged. REQUIRES: pool >= 1 and odd, 0 <= begin
// <= end <= scores.size(), no NaN in scores[begin, end).
std::vector<double> MaxPool(absl::Span<const double> scores, int begin, int end, int pool);

// Selects for one layer. `head_scores` is the reduced [kv_heads, n_prompt]
// float64 score matrix (see ReduceScores). Anchors are the first
// min(sinks, n_prompt) tokens when `first_agent`, else none. h2o-* rank the
// top-k range (candidates before the recent window) by MaxPool(opts.pool) of
// their scores; docs/FORMAT.md has the rule.
Selection Select(const SelectorOptions& opts, absl::Span<const double> head_scores, int kv_heads,
                 int n_prompt, bool first_agent);

}  // namespace kvrelay

#endif  // KVRELAY_CORE_SELECTION_H_
