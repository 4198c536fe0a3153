#include "core/budget.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/query_scores.h"
#include "core/status_macros.h"

namespace kvrelay {

namespace {

// The relative error of a row quantized by lloyd at B bits: the square root
// of the Lloyd-Max distortion of N(0, 1) (docs/FORMAT.md, "Byte budget").
// Index 0: an evicted row, which the recipient misses whole.
constexpr double kRowError[] = {1.0, 0.6028, 0.3428, 0.1859, 0.0975};

constexpr int kGridK[] = {4, 8, 16, 32, 64, 128, 256, 512, 1024};

constexpr int kSinks = 4;  // the selector's default, which the grid keeps

bool IsPowerOfTwo(int n) { return n > 0 && (n & (n - 1)) == 0; }

// Per (layer, head): the prompt candidates' attention shares, sorted
// descending, as prefix sums (prefix[i] = share of the i largest), and
// the anchors' share.
struct HeadMass {
  double anchors = 0;
  std::vector<double> prefix;
};

}  // namespace

std::string BudgetCandidate::Spec() const {
  std::string out = k < 0 ? "full" : absl::StrCat("h2o-head:k=", k);
  if (demote_bits > 0) absl::StrAppend(&out, "+demote:bits=", demote_bits);
  absl::StrAppend(&out, "+lloyd:bits=", bits);
  return out;
}

absl::StatusOr<std::vector<BudgetCandidate>> BudgetCandidates(const Turn& turn) {
  KVRELAY_RETURN_IF_ERROR(ValidateTurn(turn));
  KVRELAY_ASSIGN_OR_RETURN(const TurnGeometry geo, GeometryOf(turn));
  const int H = geo.kv_heads, d = geo.head_dim, n = geo.n_prompt;
  if (!IsPowerOfTwo(d) || d < 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        "auto: the lloyd quantizer of every setting needs a power-of-two head_dim >= 8, got head_dim=", d));
  }
  const int s = turn.first_agent ? std::min(kSinks, n) : 0;
  const int c = n - s;
  std::vector<HeadMass> mass;
  mass.reserve(turn.layers.size() * H);
  for (size_t l = 0; l < turn.layers.size(); ++l) {
    const TurnLayer& layer = turn.layers[l];
    std::vector<double> a;  // [H, n]
    if (geo.queries) {
      KVRELAY_ASSIGN_OR_RETURN(std::vector<double> all,
                               QueryMass(layer, geo, turn.SoftmaxScale(d), /*window=*/0));
      const size_t m = static_cast<size_t>(geo.n_history) + n + geo.n_gen;
      a.resize(static_cast<size_t>(H) * n);
      for (int h = 0; h < H; ++h) {
        std::copy_n(all.begin() + h * m + geo.n_history, n, a.begin() + static_cast<size_t>(h) * n);
      }
    } else {
      a = ReduceScores(layer.scores, H);
    }
    for (int h = 0; h < H; ++h) {
      const double* row = a.data() + static_cast<size_t>(h) * n;
      double total = 0;
      for (int j = 0; j < n; ++j) total += row[j];
      HeadMass hm;
      std::vector<double> cand(row + s, row + n);
      if (total > 0) {
        for (double& x : cand) x /= total;
        for (int j = 0; j < s; ++j) hm.anchors += row[j] / total;
      } else {  // no attention measured: every token alike
        std::fill(cand.begin(), cand.end(), n ? 1.0 / n : 0.0);
        hm.anchors = n ? static_cast<double>(s) / n : 0.0;
      }
      std::sort(cand.begin(), cand.end(), std::greater<double>());
      hm.prefix.assign(cand.size() + 1, 0.0);
      for (size_t i = 0; i < cand.size(); ++i) hm.prefix[i + 1] = hm.prefix[i] + cand[i];
      mass.push_back(std::move(hm));
    }
  }
  const uint64_t L = turn.layers.size();
  const uint64_t other = static_cast<uint64_t>(geo.n_history) + s + geo.n_gen;  // always kept at B bits
  auto row_bytes = [d](int bits) { return 2 * (static_cast<uint64_t>(d) * bits / 8 + 2) + 4; };
  std::vector<BudgetCandidate> grid;
  std::vector<int> ks = {-1};
  for (int k : kGridK) {
    if (k < c) ks.push_back(k);
  }
  for (int k : ks) {
    const int kept = k < 0 ? c : k;
    for (int bits = 1; bits <= 4; ++bits) {
      for (int dem = 0; dem < (k < 0 ? 1 : bits); ++dem) {
        BudgetCandidate cand;
        cand.k = k;
        cand.bits = bits;
        cand.demote_bits = dem;
        const uint64_t dropped = static_cast<uint64_t>(c - kept);
        cand.bytes = L * H * ((other + kept) * row_bytes(bits) + (dem > 0 ? dropped * row_bytes(dem) : 0));
        double err = 0;
        for (const HeadMass& hm : mass) {
          const double kept_share = hm.anchors + hm.prefix[kept];
          const double rest = hm.prefix.back() - hm.prefix[kept];
          err += kept_share * kRowError[bits] + rest * kRowError[dem];
        }
        cand.error = mass.empty() ? 0 : err / static_cast<double>(mass.size());
        grid.push_back(cand);
      }
    }
  }
  return grid;
}

absl::StatusOr<BudgetCandidate> ChooseBudget(const std::vector<BudgetCandidate>& grid, uint64_t full_bytes,
                                             double budget) {
  const BudgetCandidate* best = nullptr;
  uint64_t least = UINT64_MAX;
  const double cap = budget * static_cast<double>(full_bytes);
  for (const BudgetCandidate& c : grid) {
    least = std::min(least, c.bytes);
    if (static_cast<double>(c.bytes) > cap) continue;
    if (best == nullptr || std::tie(c.error, c.bytes) < std::tie(best->error, best->bytes)) best = &c;
  }
  if (best == nullptr) {
    const double need = full_bytes ? static_cast<double>(least) / static_cast<double>(full_bytes) : 0.0;
    return absl::InvalidArgumentError(absl::StrFormat(
        "policy stage 'auto': budget=%g is below the smallest setting this turn allows, expected budget >= %.6f "
        "(%d bytes of %d)",
        budget, need, least, full_bytes));
  }
  return *best;
}

}  // namespace kvrelay
