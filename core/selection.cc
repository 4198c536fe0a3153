#include "core/selection.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvrelay {

namespace {

// The comparisons the branch-free passes make: _mm256_cmp_pd's predicates,
// and the same values without AVX2.
#if defined(__AVX2__)
constexpr int kAbove = _CMP_GT_OQ, kBelow = _CMP_LT_OQ, kAtLeast = _CMP_GE_OQ;
#else
constexpr int kAbove = 0, kBelow = 1, kAtLeast = 2;
#endif

// Below this many values a round of splitting costs more than it saves.
constexpr size_t kSelectDirect = 32;

// A NaN (which callers never pass) ranks as -infinity, so that every
// order below is total and TopK keeps exactly k indices whatever the scores.
inline double Rank(double x) { return std::isnan(x) ? -std::numeric_limits<double>::infinity() : x; }

// A pivot for finding the `need`-th largest (1-based) of src[0, n), n >
// kSelectDirect: a value of src that, judged from 15 evenly spaced samples,
// lies a little beyond the need-th largest on the side of the shorter
// remainder, so that one split leaves the wanted value on the short side
// (the top few of a long row keep about 2k values, not n/2).
double SampledPivot(const double* src, size_t n, size_t need) {
  static constexpr size_t kSamples = 15;
  std::array<double, kSamples> s;
  for (size_t i = 0; i < kSamples; ++i) s[i] = src[(2 * i + 1) * n / (2 * kSamples)];
  std::sort(s.begin(), s.end(), std::greater<double>());
  // r: the rank (1-based, descending) of the sample taken. The need-th
  // largest sits near rank need * (kSamples + 1) / n of the sample; one
  // rank further toward the shorter side makes overshooting it unlikely.
  // From the top for the m-th largest; from the bottom, mirrored, for the
  // m-th smallest.
  auto rank = [n](size_t m) { return std::min(kSamples, (m * (kSamples + 1) + n - 1) / n + 1); };
  const size_t r = 2 * need <= n ? rank(need) : kSamples + 1 - rank(n - need + 1);
  return s[r - 1];
}

// The k-th largest of a range and how many values of the range are above
// it and equal to it.
struct KthValue {
  double value = 0;
  size_t above = 0;
  size_t equal = 0;
};

#if defined(__AVX2__)
// For each 4-bit mask, the 32-bit lanes that move the set 64-bit lanes
// (or, for ints, the set 32-bit lanes) to the front, in order.
struct CompactTables {
  alignas(32) int32_t pd[16][8];
  alignas(16) int32_t epi32[16][4];
  CompactTables() {
    for (int m = 0; m < 16; ++m) {
      int w = 0;
      for (int b = 0; b < 4; ++b) {
        if (!(m >> b & 1)) continue;
        pd[m][2 * w] = 2 * b;
        pd[m][2 * w + 1] = 2 * b + 1;
        epi32[m][w] = b;
        ++w;
      }
      for (; w < 4; ++w) {
        pd[m][2 * w] = pd[m][2 * w + 1] = 0;
        epi32[m][w] = 0;
      }
    }
  }
};
const CompactTables& Tables() {
  static const CompactTables t;
  return t;
}
#endif

// Copies the values x of src[0, n) with `x kCmp pivot` (kCmp: _CMP_GT_OQ or
// _CMP_LT_OQ, or their scalar meaning without AVX2) into out, in order, and
// returns how many there are. Every slot of out[0, n) may be written.
// Branch-free: four values at a time are moved to the front of a vector by
// a table lookup and stored whole, and the count moves past the kept ones.
template <int kCmp>
size_t Compact(const double* src, size_t n, double* out, double pivot) {
  size_t m = 0, i = 0;
#if defined(__AVX2__)
  const CompactTables& t = Tables();
  const __m256d p = _mm256_set1_pd(pivot);
  for (; i + 4 <= n; i += 4) {
    const __m256d x = _mm256_loadu_pd(src + i);
    const int mask = _mm256_movemask_pd(_mm256_cmp_pd(x, p, kCmp));
    const __m256i perm = _mm256_load_si256(reinterpret_cast<const __m256i*>(t.pd[mask]));
    _mm256_storeu_pd(out + m, _mm256_castps_pd(_mm256_permutevar8x32_ps(_mm256_castpd_ps(x), perm)));
    m += static_cast<size_t>(__builtin_popcount(mask));
  }
#endif
  for (; i < n; ++i) {
    const double x = src[i];
    out[m] = x;
    m += kCmp == kAbove ? x > pivot : x < pivot;
  }
  return m;
}

// Whether any of s[0, n) is NaN.
bool AnyNan(const double* s, size_t n) {
  size_t i = 0;
  bool nan = false;
#if defined(__AVX2__)
  __m256d acc = _mm256_setzero_pd();
  for (; i + 4 <= n; i += 4) {
    const __m256d x = _mm256_loadu_pd(s + i);
    acc = _mm256_or_pd(acc, _mm256_cmp_pd(x, x, _CMP_UNORD_Q));
  }
  nan = _mm256_movemask_pd(acc) != 0;
#endif
  for (; i < n; ++i) nan |= std::isnan(s[i]);
  return nan;
}

// Appends begin + j to idx at *c for every j in [j0, j1) with `s[j] kCmp
// kth` (kCmp: kAbove or kAtLeast), in order. REQUIRES: idx has 4 free
// slots past the last index kept (whole vectors of 4 are stored).
template <int kCmp>
void AppendIndices(const double* s, int j0, int j1, double kth, int begin, int* idx, int* c) {
  int j = j0, w = *c;
#if defined(__AVX2__)
  const CompactTables& t = Tables();
  const __m256d v = _mm256_set1_pd(kth);
  for (; j + 4 <= j1; j += 4) {
    const int mask = _mm256_movemask_pd(_mm256_cmp_pd(_mm256_loadu_pd(s + j), v, kCmp));
    const __m128i lanes = _mm_load_si128(reinterpret_cast<const __m128i*>(t.epi32[mask]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(idx + w), _mm_add_epi32(lanes, _mm_set1_epi32(begin + j)));
    w += __builtin_popcount(mask);
  }
#endif
  for (; j < j1; ++j) {
    idx[w] = begin + j;
    w += kCmp == kAbove ? s[j] > kth : s[j] >= kth;
  }
  *c = w;
}

// The `need`-th largest (1-based, 1 <= need <= n) of a[0, n), a unchanged,
// no NaN. Each round takes a sampled pivot and copies only the side of it
// that the samples say holds the wanted rank, the shorter side, into the
// buffer the values are not in; when the samples misjudge, a second pass
// copies the other side, and the values equal to the pivot, counted from
// the two, may end it at once. Once two rounds have each kept more than 7/8
// of the range (an order the samples misjudge), or few values remain,
// std::nth_element finishes. Every value equal to the result stays in the
// range kept, so the counts come from it.
KthValue KthLargest(const double* a, size_t n, size_t need) {
  thread_local std::vector<double> buf[2];
  buf[0].resize(n);
  buf[1].resize(n);
  const double* src = a;
  int next = 0;      // the buffer the next round writes
  size_t above = 0;  // values dropped above the range kept
  int bad_rounds = 2;
  while (n > kSelectDirect && bad_rounds > 0) {
    const double pivot = SampledPivot(src, n, need);
    double* out = buf[next].data();
    const size_t before = n;
    size_t hi, lo;
    if (2 * need <= n) {
      hi = Compact<kAbove>(src, n, out, pivot);
      if (need <= hi) {
        n = hi;
      } else {
        lo = Compact<kBelow>(src, n, out, pivot);
        if (need <= n - lo) return {pivot, above + hi, n - lo - hi};
        need -= n - lo;
        above += n - lo;
        n = lo;
      }
    } else {
      lo = Compact<kBelow>(src, n, out, pivot);
      if (need > n - lo) {
        need -= n - lo;
        above += n - lo;
        n = lo;
      } else {
        hi = Compact<kAbove>(src, n, out, pivot);
        if (need > hi) return {pivot, above + hi, n - lo - hi};
        n = hi;
      }
    }
    src = out;
    next = 1 - next;
    bad_rounds -= n > before - before / 8;
  }
  double* v = buf[next].data();
  std::copy_n(src, n, v);
  std::nth_element(v, v + (need - 1), v + n, std::greater<double>());
  KthValue kth{v[need - 1], above, 0};
  for (size_t i = 0; i < n; ++i) {
    kth.above += v[i] > kth.value;
    kth.equal += v[i] == kth.value;
  }
  return kth;
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
  // and as many of the values equal to it as fit, lowest positions first:
  // those up to position `last_tie`.
  const double* s = scores.data() + begin;
  if (AnyNan(s, static_cast<size_t>(n))) {
    thread_local std::vector<double> ranked;
    ranked.resize(n);
    for (int j = 0; j < n; ++j) ranked[j] = Rank(s[j]);
    s = ranked.data();
  }
  const KthValue kth = KthLargest(s, static_cast<size_t>(n), static_cast<size_t>(k));
  const size_t ties = static_cast<size_t>(k) - kth.above;
  int last_tie = n - 1;
  if (kth.equal > ties) {
    size_t seen = 0;
    for (int j = 0; j < n; ++j) {
      if (s[j] == kth.value && ++seen == ties) {
        last_tie = j;
        break;
      }
    }
  }
  // Exactly k are kept; whole vectors of 4 may be stored past the last.
  idx.resize(static_cast<size_t>(k) + 4);
  int c = 0;
  AppendIndices<kAtLeast>(s, 0, last_tie + 1, kth.value, begin, idx.data(), &c);
  AppendIndices<kAbove>(s, last_tie + 1, n, kth.value, begin, idx.data(), &c);
  idx.resize(static_cast<size_t>(k));
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

std::vector<std::vector<int>> SelectHistory(absl::Span<const float> acc, absl::Span<const uint8_t> is_anchor,
                                            int kv_heads, int n_history, int hist, bool per_head) {
  std::vector<std::vector<int>> kept(kv_heads);
  int c = 0;  // candidates per head (the same in every head: each holds every anchor once)
  for (int i = 0; i < n_history; ++i) c += kv_heads > 0 && !is_anchor[i];
  auto keep_all = [n_history](std::vector<int>* k) {
    k->resize(n_history);
    std::iota(k->begin(), k->end(), 0);
  };
  if (hist < 0 || c <= hist) {
    for (auto& k : kept) keep_all(&k);
    return kept;
  }
  // Per head: its candidates' token indices, ascending, and its anchors'.
  // Branch-free: every index is written to both lists and counted in one.
  const size_t stride = static_cast<size_t>(n_history) + 1;
  thread_local std::vector<int> cand, anchors, tokens;
  thread_local std::vector<double> score;
  cand.resize(kv_heads * stride);
  anchors.resize(kv_heads * stride);
  score.assign(c, 0.0);
  std::vector<bool> counted(kv_heads);  // the head holds c candidates, as head 0
  for (int h = 0; h < kv_heads; ++h) {
    int* row = cand.data() + h * stride;
    int* arow = anchors.data() + h * stride;
    const uint8_t* flags = is_anchor.data() + static_cast<size_t>(h) * n_history;
    int r = 0, a = 0;
    for (int i = 0; i < n_history; ++i) {
      row[r] = i;
      arow[a] = i;
      r += flags[i] == 0;
      a += flags[i] != 0;
    }
    counted[h] = r == c;
  }
  // The kept candidates' ranks in ascending order: per head, or one ranking
  // by the sum over heads that every head shares.
  std::vector<int> ranks;
  if (!per_head) {
    for (int h = 0; h < kv_heads; ++h) {
      if (!counted[h]) continue;
      const int* row = cand.data() + h * stride;
      const float* hacc = acc.data() + static_cast<size_t>(h) * n_history;
      for (int r = 0; r < c; ++r) score[r] += hacc[row[r]];
    }
    ranks = TopK(score, 0, c, hist);
  }
  for (int h = 0; h < kv_heads; ++h) {
    // A head with another count of anchors (which a validated turn never
    // has) keeps its whole history; the caller refuses the unequal counts.
    if (!counted[h]) {
      keep_all(&kept[h]);
      continue;
    }
    const int* row = cand.data() + h * stride;
    if (per_head) {
      const float* hacc = acc.data() + static_cast<size_t>(h) * n_history;
      for (int r = 0; r < c; ++r) score[r] = hacc[row[r]];
      ranks = TopK(score, 0, c, hist);
    }
    // The anchors and the kept candidates, merged in token order.
    tokens.resize(ranks.size());
    for (size_t i = 0; i < ranks.size(); ++i) tokens[i] = row[ranks[i]];
    const int* arow = anchors.data() + h * stride;
    const int n_anchor = n_history - c;
    kept[h].resize(static_cast<size_t>(n_anchor) + tokens.size());
    std::merge(arow, arow + n_anchor, tokens.begin(), tokens.end(), kept[h].begin());
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
