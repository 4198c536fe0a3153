#include "core/selection.h"

#include <algorithm>
#include <numeric>

namespace kvrelay {

std::vector<int> TopK(absl::Span<const double> scores, int begin, int end, int k) {
  std::vector<int> idx(std::max(0, end - begin));
  std::iota(idx.begin(), idx.end(), begin);
  if (k < static_cast<int>(idx.size())) {
    auto better = [&scores](int a, int b) {
      return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
    };
    std::nth_element(idx.begin(), idx.begin() + k, idx.end(), better);
    idx.resize(std::max(0, k));
  }
  std::sort(idx.begin(), idx.end());
  return idx;
}

Selection Select(const SelectorOptions& opts, absl::Span<const double> head_scores, int kv_heads,
                 int n_prompt, bool first_agent) {
  Selection sel;
  sel.n_anchor = first_agent ? std::min(std::max(opts.sinks, 0), n_prompt) : 0;
  const int begin = sel.n_anchor;
  const int n_cand = n_prompt - begin;
  sel.kept.assign(kv_heads, {});

  switch (opts.kind) {
    case SelectorKind::kGen:
      return sel;
    case SelectorKind::kFull:
      for (auto& kept : sel.kept) {
        kept.resize(n_cand);
        std::iota(kept.begin(), kept.end(), begin);
      }
      return sel;
    case SelectorKind::kH2oLayer:
    case SelectorKind::kH2oHead:
      break;
  }

  const int recent = std::min(std::max(opts.recent, 0), n_cand);
  const int top_end = n_prompt - recent;
  auto select_one = [&](absl::Span<const double> scores) {
    std::vector<int> kept = TopK(scores, begin, top_end, opts.k);
    for (int j = top_end; j < n_prompt; ++j) kept.push_back(j);
    return kept;
  };

  if (opts.kind == SelectorKind::kH2oLayer) {
    std::vector<double> layer(n_prompt, 0.0);
    for (int h = 0; h < kv_heads; ++h) {
      for (int j = 0; j < n_prompt; ++j) layer[j] += head_scores[static_cast<size_t>(h) * n_prompt + j];
    }
    std::vector<int> kept = select_one(layer);
    for (auto& k : sel.kept) k = kept;
  } else {
    for (int h = 0; h < kv_heads; ++h) {
      sel.kept[h] = select_one(head_scores.subspan(static_cast<size_t>(h) * n_prompt, n_prompt));
    }
  }
  return sel;
}

}  // namespace kvrelay
