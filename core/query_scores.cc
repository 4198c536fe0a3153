#include "core/query_scores.h"

#include <algorithm>
#include <cmath>

#include "Eigen/Core"

namespace kvrelay {
namespace {

// The float64 sum of n floats, in 8 interleaved partial sums (vectorizes;
// one running sum would wait on each addition's latency).
double SumAsDouble(const float* x, int n) {
  double part[8] = {};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) part[k] += x[i + k];
  }
  double sum = 0;
  for (; i < n; ++i) sum += x[i];
  for (double p : part) sum += p;
  return sum;
}

}  // namespace

std::vector<double> QueryScores(const TurnLayer& layer, const TurnGeometry& geo, double scale, int window) {
  using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using ColMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;
  const int heads = geo.kv_heads, d = geo.head_dim;
  const int n_hist = geo.n_history, n_prompt = geo.n_prompt, n_gen = geo.n_gen;
  const int group = geo.score_heads / heads;
  const int t0 = window > 0 ? std::max(0, n_gen - window) : 0;
  const int steps = n_gen - t0;
  const int m = n_hist + n_prompt + n_gen;  // every key of a head
  std::vector<double> out(static_cast<size_t>(heads) * n_prompt, 0.0);
  if (steps == 0 || n_prompt == 0) return out;
  RowMajor keys(m, d), queries(steps, d);
  ColMajor logits(m, steps);
  std::vector<double> mass(n_prompt);
  std::vector<float> e(m);
  for (int h = 0; h < heads; ++h) {
    layer.history_k.ReadRows(h, 0, n_hist, keys.data());
    layer.prompt_k.ReadRows(h, 0, n_prompt, keys.data() + static_cast<size_t>(n_hist) * d);
    layer.gen_k.ReadRows(h, 0, n_gen, keys.data() + static_cast<size_t>(n_hist + n_prompt) * d);
    double* dst = out.data() + static_cast<size_t>(h) * n_prompt;
    for (int g = 0; g < group; ++g) {
      layer.gen_q.ReadRows(h * group + g, t0, steps, queries.data());
      queries *= static_cast<float>(scale);
      logits.noalias() = keys * queries.transpose();
      std::fill(mass.begin(), mass.end(), 0.0);
      for (int s = 0; s < steps; ++s) {
        const int seen = n_hist + n_prompt + t0 + s + 1;
        const auto z = logits.col(s).head(seen).array();
        Eigen::Map<Eigen::ArrayXf> ez(e.data(), seen);
        ez = (z - z.maxCoeff()).exp();  // Eigen's vectorized expf
        const double inv = 1.0 / SumAsDouble(e.data(), seen);
        const float* ep = e.data() + n_hist;
        for (int j = 0; j < n_prompt; ++j) mass[j] += ep[j] * inv;
      }
      for (int j = 0; j < n_prompt; ++j) dst[j] += mass[j];
    }
  }
  return out;
}

}  // namespace kvrelay
