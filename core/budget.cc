#include "core/budget.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <numeric>
#include <tuple>
#include <vector>

#include "Eigen/Dense"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/message.h"
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

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// Fills `*k`, then `*v`, with random signs (+1 or -1) from a fixed seed
// (splitmix64, 64 signs per draw).
void RandomSigns(RowMatrix* k, RowMatrix* v) {
  uint64_t state = 0x6b76726c6179ULL;
  for (RowMatrix* sm : {k, v}) {
    float* p = sm->data();
    for (Eigen::Index i = 0; i < sm->size(); i += 64) {
      state += 0x9e3779b97f4a7c15ULL;
      uint64_t z = state;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
      z ^= z >> 31;
      for (Eigen::Index b = 0; b < 64 && i + b < sm->size(); ++b) p[i + b] = (z >> b) & 1 ? 1.0f : -1.0f;
    }
  }
}

// The prompt tokens' attention per kv head, [H, n]: from the queries (the
// mass of the full causal attention) or the precomputed scores.
absl::StatusOr<std::vector<double>> PromptAttention(const Turn& turn, const TurnLayer& layer,
                                                    const TurnGeometry& geo) {
  const int H = geo.kv_heads, n = geo.n_prompt;
  if (!geo.queries) return ReduceScores(layer.scores, H);
  KVRELAY_ASSIGN_OR_RETURN(std::vector<double> all,
                           QueryMass(layer, geo, turn.SoftmaxScale(geo.head_dim), /*window=*/0));
  const size_t m = static_cast<size_t>(geo.n_history) + n + geo.n_gen;
  std::vector<double> a(static_cast<size_t>(H) * n);
  for (int h = 0; h < H; ++h) {
    std::copy_n(all.begin() + h * m + geo.n_history, n, a.begin() + static_cast<size_t>(h) * n);
  }
  return a;
}

// One head's row of n prompt shares, the first s of them sinks.
HeadMass MassOfHead(const double* row, int n, int s) {
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
  return hm;
}

// Every (layer, head)'s HeadMass, layer-major.
absl::StatusOr<std::vector<HeadMass>> HeadMasses(const Turn& turn, const TurnGeometry& geo, int s,
                                                 BudgetWeight weight) {
  const int H = geo.kv_heads, n = geo.n_prompt;
  std::vector<HeadMass> mass;
  mass.reserve(turn.layers.size() * H);
  if (weight == BudgetWeight::kUniform) {  // every (layer, head) alike
    const std::vector<double> ones(static_cast<size_t>(n), 1.0);
    mass.assign(turn.layers.size() * H, MassOfHead(ones.data(), n, s));
    return mass;
  }
  for (const TurnLayer& layer : turn.layers) {
    KVRELAY_ASSIGN_OR_RETURN(const std::vector<double> a, PromptAttention(turn, layer, geo));
    for (int h = 0; h < H; ++h) mass.push_back(MassOfHead(a.data() + static_cast<size_t>(h) * n, n, s));
  }
  return mass;
}

// f[l][tensor][B]: the relative error of layer l's keys (0) or values (1)
// at B bits: lloyd's row error, scaled by the layer's measured
// sensitivity against the mean over layers (without gen.q: the row error).
using LayerErrors = std::vector<std::array<std::array<double, 5>, 2>>;

LayerErrors RelativeErrors(const Turn& turn, const TurnGeometry& geo) {
  const uint64_t L = turn.layers.size();
  LayerErrors f(L);
  const std::vector<QuantSensitivity> sens = QuantSensitivities(turn, geo);
  for (int b = 1; b <= 4; ++b) {
    double mean = 0;
    for (const QuantSensitivity& x : sens) mean += (x.k[b] + x.v[b]) / 2;
    mean = sens.empty() ? 0 : mean / static_cast<double>(sens.size());
    for (uint64_t l = 0; l < L; ++l) {
      const bool measured = !sens.empty() && mean > 0 && std::isfinite(mean);
      f[l][0][b] = kRowError[b] * (measured ? sens[l].k[b] / mean : 1.0);
      f[l][1][b] = kRowError[b] * (measured ? sens[l].v[b] / mean : 1.0);
    }
  }
  return f;
}

// What every candidate of a turn is built from.
struct GridInputs {
  std::vector<HeadMass> mass;  // per (layer, head), layer-major
  LayerErrors f;
  uint64_t layers = 0, heads = 0;
  int head_dim = 0;
  int c = 0;           // prompt candidates per head (the prompt less the sinks)
  uint64_t other = 0;  // rows per head always kept at the quantizer's bits
};

// The candidates of h2o-head k (-1: full) with demoted rows of `dem` bits
// (0: evicted): 1 bit for keys and values everywhere, then one step at a
// time one more bit for one layer's keys or values, the one with the
// largest gain among each tensor's next bit (ties: fewer bits, then the
// lower layer, keys first). The order depends on the turn only, so a
// larger budget takes a longer prefix of it.
void AppendCandidates(const GridInputs& in, int k, int dem, std::vector<BudgetCandidate>* grid) {
  const uint64_t L = in.layers, H = in.heads;
  const std::vector<HeadMass>& mass = in.mass;
  const LayerErrors& f = in.f;
  const uint64_t row_bytes_1 = static_cast<uint64_t>(in.head_dim) / 8;  // one bit of one row's codes
  // A demoted row: K and V codes, two fp16 norms, its position id.
  const uint64_t demoted_row = 2 * (static_cast<uint64_t>(in.head_dim) * dem / 8 + 2) + 4;
  const int kept = k < 0 ? in.c : k;
  const uint64_t rows = in.other + kept;  // per head, at the quantizer's bits
  const uint64_t dropped = static_cast<uint64_t>(in.c - kept);
  BudgetCandidate cand;
  cand.k = k;
  cand.demote_bits = dem;
  cand.layer_bits.assign(L, {1, 1});
  cand.bytes = L * H * (rows * (2 * row_bytes_1 + 2 * 2 + 4) + (dem > 0 ? dropped * demoted_row : 0));
  double err = 0;
  std::vector<double> kept_mass(L, 0.0);
  for (size_t i = 0; i < mass.size(); ++i) {
    const HeadMass& hm = mass[i];
    kept_mass[i / H] += hm.anchors + hm.prefix[kept];
    err += (hm.prefix.back() - hm.prefix[kept]) * kRowError[dem];
  }
  for (uint64_t l = 0; l < L; ++l) err += kept_mass[l] * (f[l][0][1] + f[l][1][1]) / 2;
  const uint64_t step_bytes = H * rows * row_bytes_1;
  const double n_heads = mass.empty() ? 1.0 : static_cast<double>(mass.size());
  auto gain = [&](uint64_t l, int tensor, int from) {
    return kept_mass[l] * (f[l][tensor][from] - f[l][tensor][from + 1]) / 2;
  };
  cand.error = mass.empty() ? 0 : std::max(0.0, err / n_heads);
  grid->push_back(cand);
  for (uint64_t n_steps = 0; n_steps < 6 * L; ++n_steps) {
    double best_gain = -INFINITY;
    int best_from = 5;
    uint64_t best_l = 0;
    int best_tensor = 0;
    for (uint64_t l = 0; l < L; ++l) {
      for (int tensor = 0; tensor < 2; ++tensor) {
        const int from = tensor == 0 ? cand.layer_bits[l].first : cand.layer_bits[l].second;
        if (from >= 4) continue;
        const double g = gain(l, tensor, from);
        if (std::tie(g, best_from) > std::tie(best_gain, from)) {
          best_gain = g;
          best_from = from;
          best_l = l;
          best_tensor = tensor;
        }
      }
    }
    std::pair<int, int>& b = cand.layer_bits[best_l];
    ++(best_tensor == 0 ? b.first : b.second);
    cand.bytes += step_bytes;
    err -= best_gain;
    cand.error = mass.empty() ? 0 : std::max(0.0, err / n_heads);
    grid->push_back(cand);
  }
}

}  // namespace

std::string BudgetCandidate::Spec() const {

  std::string out = k < 0 ? "full" : absl::StrCat("h2o-head:k=", k);
  if (demote_bits > 0) absl::StrAppend(&out, "+demote:bits=", demote_bits);
  const bool uniform =
      std::all_of(layer_bits.begin(), layer_bits.end(), [&](const std::pair<int, int>& b) {
        return b.first == b.second && b == layer_bits.front();
      });
  if (uniform && !layer_bits.empty()) {
    absl::StrAppend(&out, "+lloyd:bits=", layer_bits.front().first);
  } else {
    absl::StrAppend(&out, "+lloyd:layers=", FormatLayerBits(layer_bits));
  }
  return out;
}

std::vector<QuantSensitivity> QuantSensitivities(const Turn& turn, const TurnGeometry& geo) {
  if (!geo.queries || geo.n_gen == 0 || geo.kv_heads == 0) return {};
  const size_t L = turn.layers.size();
  const int H = geo.kv_heads, d = geo.head_dim, group = geo.score_heads / H;
  const int m = geo.n_history + geo.n_prompt + geo.n_gen;
  const float scale = static_cast<float>(turn.SoftmaxScale(d));
  const int steps = std::min(kSensitivitySteps, geo.n_gen);
  std::vector<int> step_t(steps);
  for (int i = 0; i < steps; ++i) {
    step_t[i] = steps == 1 ? geo.n_gen - 1 : static_cast<int>(static_cast<int64_t>(i) * (geo.n_gen - 1) / (steps - 1));
  }
  const int rows = group * steps;
  // The directions rows move in: one matrix for keys and one for values,
  // scaled per row below.
  RowMatrix sign_k(m, d), sign_v(m, d);
  RandomSigns(&sign_k, &sign_v);
  std::vector<QuantSensitivity> out(L);
  RowMatrix keys(m, d), vals(m, d), q(rows, d);
  for (size_t l = 0; l < L; ++l) {
    const TurnLayer& layer = turn.layers[l];
    QuantSensitivity& sens = out[l];
    int counted = 0;
    for (int h = 0; h < H; ++h) {
      // The cache in position order: history, prompt, generated.
      int row = 0;
      for (const auto& [kt, vt] : {std::pair<const KvTensor*, const KvTensor*>{&layer.history_k, &layer.history_v},
                                   {&layer.prompt_k, &layer.prompt_v},
                                   {&layer.gen_k, &layer.gen_v}}) {
        if (kt->tokens() == 0) continue;
        kt->ReadRows(h, 0, kt->tokens(), keys.data() + static_cast<size_t>(row) * d);
        vt->ReadRows(h, 0, vt->tokens(), vals.data() + static_cast<size_t>(row) * d);
        row += kt->tokens();
      }
      for (int g = 0; g < group; ++g) {
        for (int i = 0; i < steps; ++i) layer.gen_q.ReadRow(h * group + g, step_t[i], q.data() + (g * steps + i) * d);
      }
      // A row x moved by e|x| (e: lloyd's relative error at B bits) in a
      // direction of random signs: per row, |x| / sqrt(d) times the signs.
      const Eigen::RowVectorXf k_unit = keys.rowwise().norm().transpose() / std::sqrt(static_cast<float>(d));
      const Eigen::VectorXf v_unit = vals.rowwise().norm() / std::sqrt(static_cast<float>(d));
      const RowMatrix logits = (q * keys.transpose()) * scale;
      const RowMatrix shift = ((q * sign_k.transpose()) * scale).array().rowwise() * k_unit.array();
      auto softmax = [&](const RowMatrix& x) {
        RowMatrix a = RowMatrix::Zero(rows, m);
        for (int r = 0; r < rows; ++r) {
          const int seen = geo.n_history + geo.n_prompt + step_t[r % steps] + 1;  // causal
          const float top = x.row(r).head(seen).maxCoeff();
          a.row(r).head(seen) = (x.row(r).head(seen).array() - top).exp();
          a.row(r).head(seen) /= a.row(r).head(seen).sum();
        }
        return a;
      };
      const RowMatrix a = softmax(logits);
      const RowMatrix o = a * vals;
      // Values: o moves by e * (a . v_unit) signs, linear in e.
      const RowMatrix dv = (a.array().rowwise() * v_unit.transpose().array()).matrix() * sign_v;
      std::vector<RowMatrix> ob(5);
      for (int b = 1; b <= 4; ++b) ob[b] = softmax(logits + static_cast<float>(kRowError[b]) * shift) * vals;
      for (int r = 0; r < rows; ++r) {
        const double oo = o.row(r).norm();
        if (!(oo > 0) || !std::isfinite(oo)) continue;
        ++counted;
        for (int b = 1; b <= 4; ++b) {
          sens.k[b] += (ob[b].row(r) - o.row(r)).norm() / oo;
          sens.v[b] += kRowError[b] * dv.row(r).norm() / oo;
        }
      }
    }
    for (int b = 1; b <= 4; ++b) {
      sens.k[b] = counted ? sens.k[b] / counted : 0.0;
      sens.v[b] = counted ? sens.v[b] / counted : 0.0;
    }
  }
  return out;
}

absl::StatusOr<std::vector<BudgetCandidate>> BudgetCandidates(const Turn& turn, BudgetWeight weight) {
  KVRELAY_RETURN_IF_ERROR(ValidateTurn(turn));
  KVRELAY_ASSIGN_OR_RETURN(const TurnGeometry geo, GeometryOf(turn));
  const int d = geo.head_dim, n = geo.n_prompt;
  if (!IsPowerOfTwo(d) || d < 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        "auto: the lloyd quantizer of every setting needs a power-of-two head_dim >= 8, got head_dim=", d));
  }
  const int s = turn.first_agent ? std::min(kSinks, n) : 0;
  GridInputs in;
  KVRELAY_ASSIGN_OR_RETURN(in.mass, HeadMasses(turn, geo, s, weight));
  in.f = RelativeErrors(turn, geo);
  in.layers = turn.layers.size();
  in.heads = static_cast<uint64_t>(geo.kv_heads);
  in.head_dim = d;
  in.c = n - s;
  in.other = static_cast<uint64_t>(geo.n_history) + s + geo.n_gen;
  std::vector<BudgetCandidate> grid;
  std::vector<int> ks = {-1};
  for (int k : kGridK) {
    if (k < in.c) ks.push_back(k);
  }
  for (int k : ks) {
    for (int dem = 0; dem < (k < 0 ? 1 : 4); ++dem) AppendCandidates(in, k, dem, &grid);
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
