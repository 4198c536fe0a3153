// Token selection: which prompt tokens each KV head keeps (BRIEF §4).
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

// Selects for one layer. `head_scores` is the reduced [kv_heads, n_prompt]
// float64 score matrix (see ReduceScores). Anchors are the first
// min(sinks, n_prompt) tokens when `first_agent`, else none.
Selection Select(const SelectorOptions& opts, absl::Span<const double> head_scores, int kv_heads,
                 int n_prompt, bool first_agent);

}  // namespace kvrelay

#endif  // KVRELAY_CORE_SELECTION_H_
