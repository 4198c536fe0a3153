#include "core/selection.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>

namespace kvrelay {

namespace {

// Moves the values of a[0, n) for which pred(x) holds to the front, in no
// particular order; returns how many there are. Branch-free: every value is
// swapped into place whether it moves or not, so the loop does not
// mispredict on scattered scores the way a branching partition does (about
// every other comparison).
template <typename Pred>
size_t PartitionFront(double* a, size_t n, Pred pred) {
  size_t w = 0;
  for (size_t i = 0; i < n; ++i) {
    const double x = a[i];
    a[i] = a[w];
    a[w] = x;
    w += pred(x);
  }
  return w;
}

// The `need`-th largest of a[0, n) (1-based; a is reordered). Quickselect
// with the median of the values at n/4, n/2 and 3n/4 as pivot and a
// three-way split (above, equal to, below the pivot), so runs of equal
// scores end it at once. Once two rounds have each kept more than 7/8 of
// the range (an order the pivots sample badly), std::nth_element finishes.
double KthLargest(double* a, size_t n, size_t need) {
  int bad_rounds = 2;
  while (n > 16 && bad_rounds > 0) {
    double x = a[n / 4], y = a[n / 2], z = a[n - 1 - n / 4];
    if (x > y) std::swap(x, y);
    if (y > z) std::swap(y, z);
    if (x > y) std::swap(x, y);
    const double pivot = y;
    const size_t before = n;
    const size_t above = PartitionFront(a, n, [pivot](double v) { return v > pivot; });
    if (need <= above) {
      n = above;
    } else {
      const size_t equal = PartitionFront(a + above, n - above, [pivot](double v) { return v == pivot; });
      if (need <= above + equal) return pivot;
      a += above + equal;
      n -= above + equal;
      need -= above + equal;
    }
    bad_rounds -= n > before - before / 8;
  }
  std::nth_element(a, a + (need - 1), a + n, std::greater<double>());
  return a[need - 1];
}

}  // namespace

std::vector<int> TopK(absl::Span<const double> scores, int begin, int end, int k) {
  const int n = std::max(0, end - begin);
  std::vector<int> idx;
  if (k >= n) {
    idx.resize(n);
    std::iota(idx.begin(), idx.end(), begin);
    return idx;
  }
  if (k <= 0) return idx;
  // The k-th largest value, then one ascending pass: everything above it,
  // and as many of the values equal to it as fit, lowest positions first.
  // A NaN (which callers never pass) ranks as -infinity, so the result
  // holds exactly k indices whatever the scores.
  auto rank = [](double x) { return x == x ? x : -std::numeric_limits<double>::infinity(); };
  thread_local std::vector<double> values;
  values.resize(n);
  for (int j = begin; j < end; ++j) values[j - begin] = rank(scores[j]);
  const double kth = KthLargest(values.data(), values.size(), static_cast<size_t>(k));
  int ties = k;
  for (int j = begin; j < end; ++j) ties -= rank(scores[j]) > kth;
  idx.reserve(k);
  for (int j = begin; j < end; ++j) {
    const double x = rank(scores[j]);
    if (x > kth || (x == kth && ties-- > 0)) idx.push_back(j);
  }
  return idx;
}

std::vector<double> MaxPool(absl::Span<const double> scores, int begin, int end, int pool) {
  std::vector<double> out(scores.begin(), scores.end());
  const int64_t r = pool / 2;
  if (r <= 0 || end - begin <= 1) return out;
  // Sliding-window maximum: `window` holds indices of [j - r, next) whose scores
  // decrease strictly from front to back; its front is the window's maximum.
  // Each index is pushed and popped at most once.
  std::vector<int> window(end - begin);
  int front = 0, back = 0;
  int next = begin;
  for (int j = begin; j < end; ++j) {
    const int hi = static_cast<int>(std::min<int64_t>(end - 1, j + r));
    for (; next <= hi; ++next) {
      while (back > front && scores[window[back - 1]] <= scores[next]) --back;
      window[back++] = next;
    }
    while (window[front] < j - r) ++front;
    out[j] = scores[window[front]];
  }
  return out;
}

bool AutoPicksHead(absl::Span<const double> head_scores, int kv_heads, int n_prompt, int n_anchor,
                   double tau) {
  const int c = n_prompt - n_anchor;
  double sum_e = 0;
  for (int h = 0; h < kv_heads; ++h) {
    const double* a = head_scores.data() + static_cast<size_t>(h) * n_prompt + n_anchor;
    double total = 0;
    for (int j = 0; j < c; ++j) total += a[j];
    double e = 1;
    if (c >= 2 && total > 0) {
      double ent = 0;
      for (int j = 0; j < c; ++j) {
        const double p = a[j] / total;
        if (p > 0) ent -= p * std::log(p);
      }
      e = ent / std::log(static_cast<double>(c));
    }
    sum_e += e;
  }
  return sum_e / kv_heads < tau;
}

std::vector<std::vector<int>> SelectHistory(absl::Span<const float> acc, const std::vector<bool>& is_anchor,
                                            int kv_heads, int n_history, int hist, bool per_head) {
  std::vector<std::vector<int>> kept(kv_heads);
  int c = 0;  // candidates per head (the same in every head: each holds every anchor once)
  for (int i = 0; i < n_history; ++i) c += kv_heads > 0 && !is_anchor[i];
  if (hist < 0 || c <= hist) {
    for (auto& k : kept) {
      k.resize(n_history);
      std::iota(k.begin(), k.end(), 0);
    }
    return kept;
  }
  // Per head: its candidates' token indices, ascending, and their scores.
  thread_local std::vector<int> cand;
  thread_local std::vector<double> score;
  cand.resize(static_cast<size_t>(kv_heads) * c);
  score.assign(c, 0.0);
  for (int h = 0; h < kv_heads; ++h) {
    int* row = cand.data() + static_cast<size_t>(h) * c;
    int r = 0;
    for (int i = 0; i < n_history; ++i) {
      if (!is_anchor[static_cast<size_t>(h) * n_history + i]) row[r++] = i;
    }
  }
  // The kept candidates' ranks in ascending order: per head, or one ranking
  // by the sum over heads that every head shares.
  std::vector<int> ranks;
  if (!per_head) {
    for (int h = 0; h < kv_heads; ++h) {
      const int* row = cand.data() + static_cast<size_t>(h) * c;
      for (int r = 0; r < c; ++r) score[r] += acc[static_cast<size_t>(h) * n_history + row[r]];
    }
    ranks = TopK(score, 0, c, hist);
  }
  for (int h = 0; h < kv_heads; ++h) {
    const int* row = cand.data() + static_cast<size_t>(h) * c;
    if (per_head) {
      for (int r = 0; r < c; ++r) score[r] = acc[static_cast<size_t>(h) * n_history + row[r]];
      ranks = TopK(score, 0, c, hist);
    }
    // The anchors and the kept candidates, merged in token order.
    std::vector<int>& out = kept[h];
    out.reserve(static_cast<size_t>(n_history - c) + ranks.size());
    size_t next = 0;
    for (int i = 0; i < n_history; ++i) {
      if (is_anchor[static_cast<size_t>(h) * n_history + i]) {
        out.push_back(i);
      } else if (next < ranks.size() && row[ranks[next]] == i) {
        out.push_back(i);
        ++next;
      }
    }
  }
  return kept;
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
    case SelectorKind::kH2oAuto:
      break;
  }

  const int recent = std::min(std::max(opts.recent, 0), n_cand);
  const int top_end = n_prompt - recent;
  auto select_one = [&](absl::Span<const double> scores) {
    std::vector<int> kept;
    if (opts.pool > 1 && opts.k < top_end - begin) {
      kept = TopK(MaxPool(scores, begin, top_end, opts.pool), begin, top_end, opts.k);
    } else {
      kept = TopK(scores, begin, top_end, opts.k);
    }
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
