#include "core/query_scores.h"

#include <algorithm>
#include <cmath>
#include <tuple>

#include "Eigen/Core"
#include "core/quant.h"

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

// Softmax of the first `seen` entries of `z` in place (float32 exponentials,
// float64 sum); the entries past them become 0.
void MaskedSoftmax(float* z, int seen, int m) {
  Eigen::Map<Eigen::ArrayXf> head(z, seen);
  head = (head - head.maxCoeff()).exp();
  head *= static_cast<float>(1.0 / SumAsDouble(z, seen));
  std::fill(z + seen, z + m, 0.0f);
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
  // One GEMM per KV head for the whole group of score heads: the columns
  // are (score head g, step s) at g * steps + s.
  RowMajor keys(m, d), queries(static_cast<Eigen::Index>(group) * steps, d);
  ColMajor logits(m, static_cast<Eigen::Index>(group) * steps);
  std::vector<double> mass(n_prompt);
  std::vector<float> e(m);
  for (int h = 0; h < heads; ++h) {
    layer.history_k.ReadRows(h, 0, n_hist, keys.data());
    layer.prompt_k.ReadRows(h, 0, n_prompt, keys.data() + static_cast<size_t>(n_hist) * d);
    layer.gen_k.ReadRows(h, 0, n_gen, keys.data() + static_cast<size_t>(n_hist + n_prompt) * d);
    double* dst = out.data() + static_cast<size_t>(h) * n_prompt;
    for (int g = 0; g < group; ++g) {
      layer.gen_q.ReadRows(h * group + g, t0, steps, queries.data() + static_cast<size_t>(g) * steps * d);
    }
    queries *= static_cast<float>(scale);
    logits.noalias() = keys * queries.transpose();
    for (int g = 0; g < group; ++g) {
      std::fill(mass.begin(), mass.end(), 0.0);
      for (int s = 0; s < steps; ++s) {
        const int seen = n_hist + n_prompt + t0 + s + 1;
        const auto z = logits.col(static_cast<Eigen::Index>(g) * steps + s).head(seen).array();
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

absl::StatusOr<double> AttentionOutputError(const TurnLayer& layer, const TurnGeometry& geo,
                                            const MessageLayer& msg, double scale) {
  using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using ColMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;
  const int heads = geo.kv_heads, d = geo.head_dim;
  const int n_hist = geo.n_history, n_prompt = geo.n_prompt, n_gen = geo.n_gen;
  const int group = geo.score_heads / heads;
  if (n_gen == 0) return 0.0;
  KvTensor decoded_k, decoded_v;
  const KvTensor* mk = &msg.k;
  const KvTensor* mv = &msg.v;
  if (msg.quant) {
    if (absl::Status s = DequantizeKv(*msg.quant, geo.dtype, &decoded_k, &decoded_v); !s.ok()) return s;
    mk = &decoded_k;
    mv = &decoded_v;
  }
  const int m_full = n_hist + n_prompt + n_gen, m_msg = msg.tokens();
  const int before_gen = m_msg - n_gen;  // the message's tokens every step sees
  // As in QueryScores, one GEMM per KV head for the group's score heads:
  // columns (g, t) at g * n_gen + t.
  const Eigen::Index cols = static_cast<Eigen::Index>(group) * n_gen;
  RowMajor kf(m_full, d), vf(m_full, d), km(m_msg, d), vm(m_msg, d), q(cols, d);
  ColMajor wf(m_full, cols), wm(m_msg, cols), of(d, cols), om(d, cols);
  double total = 0;
  for (int h = 0; h < heads; ++h) {
    int at = 0;
    for (const auto& [k, v, n] : {std::tuple<const KvTensor&, const KvTensor&, int>{layer.history_k, layer.history_v, n_hist},
                                  {layer.prompt_k, layer.prompt_v, n_prompt},
                                  {layer.gen_k, layer.gen_v, n_gen}}) {
      k.ReadRows(h, 0, n, kf.data() + static_cast<size_t>(at) * d);
      v.ReadRows(h, 0, n, vf.data() + static_cast<size_t>(at) * d);
      at += n;
    }
    mk->ReadRows(h, 0, m_msg, km.data());
    mv->ReadRows(h, 0, m_msg, vm.data());
    for (int g = 0; g < group; ++g) {
      layer.gen_q.ReadRows(h * group + g, 0, n_gen, q.data() + static_cast<size_t>(g) * n_gen * d);
    }
    q *= static_cast<float>(scale);
    wf.noalias() = kf * q.transpose();
    wm.noalias() = km * q.transpose();
    for (Eigen::Index c = 0; c < cols; ++c) {
      const int t = static_cast<int>(c % n_gen);
      MaskedSoftmax(wf.data() + static_cast<size_t>(c) * m_full, n_hist + n_prompt + t + 1, m_full);
      MaskedSoftmax(wm.data() + static_cast<size_t>(c) * m_msg, before_gen + t + 1, m_msg);
    }
    of.noalias() = vf.transpose() * wf;
    om.noalias() = vm.transpose() * wm;
    for (Eigen::Index c = 0; c < cols; ++c) {
      double full = 0, diff = 0;
      for (int i = 0; i < d; ++i) {
        const double a = of(i, c), b = om(i, c);
        full += a * a;
        diff += (b - a) * (b - a);
      }
      total += full > 0 ? std::sqrt(diff / full) : (diff > 0 ? 1.0 : 0.0);
    }
  }
  return total / (static_cast<double>(geo.score_heads) * n_gen);
}

}  // namespace kvrelay
