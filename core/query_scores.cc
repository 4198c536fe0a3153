#include "core/query_scores.h"

#include <algorithm>
#include <cmath>

#include "Eigen/Core"
#include "absl/strings/str_cat.h"
#include "core/internal/pipeline_checks.h"
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

// Rows of KV head h of the cache every step may see, [history; prompt;
// generated], from the keys (or the values) into `out` (m x d floats).
// Parts of 0 rows read nothing.
void ReadCache(const TurnLayer& layer, int h, bool values, float* out) {
  const KvTensor* parts[] = {values ? &layer.history_v : &layer.history_k, values ? &layer.prompt_v : &layer.prompt_k,
                             values ? &layer.gen_v : &layer.gen_k};
  for (const KvTensor* t : parts) {
    t->ReadRows(h, 0, t->tokens(), out);
    out += static_cast<size_t>(t->tokens()) * t->dim();
  }
}

// Steps first..first+steps-1 of the queries of KV head h's group of score
// heads into `out`, score head by score head (group * steps x d floats),
// multiplied by `scale`.
void ReadGroupQueries(const TurnLayer& layer, int h, int group, int first, int steps, double scale,
                      Eigen::Ref<Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>> out) {
  const int d = static_cast<int>(out.cols());
  for (int g = 0; g < group; ++g) {
    layer.gen_q.ReadRows(h * group + g, first, steps, out.data() + static_cast<size_t>(g) * steps * d);
  }
  out *= static_cast<float>(scale);
}

// Columns per GEMM block: all `cols` when m * cols floats fit
// kMaxBlockFloats (64 MiB) and the block's work fits kMaxBlockWork, else as
// many as fit, at least 1. The work of a logit is head_dim multiply-adds
// plus its exponential, counted as 16; kMaxBlockWork (2^26) is a few
// milliseconds of one core, the most a cancelled caller waits for the next
// check of its flag.
constexpr Eigen::Index kMaxBlockFloats = Eigen::Index{1} << 24;
constexpr Eigen::Index kMaxBlockWork = Eigen::Index{1} << 26;
Eigen::Index BlockColumns(Eigen::Index m, Eigen::Index d, Eigen::Index cols) {
  m = std::max<Eigen::Index>(m, 1);
  const Eigen::Index by_memory = kMaxBlockFloats / m, by_work = kMaxBlockWork / (m * (d + 16));
  return std::max<Eigen::Index>(1, std::min({cols, by_memory, by_work}));
}

bool IsCancelled(const std::atomic<bool>* cancelled) {
  return cancelled != nullptr && cancelled->load(std::memory_order_relaxed);
}

// The error for a step whose attention overflows float32.
absl::Status LogitOverflow(int score_head, int step) {
  return absl::InvalidArgumentError(absl::StrCat(
      "gen.q: the attention of score head ", score_head, " at generated step ", step,
      " overflows float32 (a logit q.k*softmax_scale or an output beyond +-3.4e38), expected keys, values and "
      "queries of a model's range"));
}

}  // namespace

absl::StatusOr<std::vector<double>> QueryMass(const TurnLayer& layer, const TurnGeometry& geo, double scale,
                                              int window, const std::atomic<bool>* cancelled) {
  using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using ColMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;
  const int heads = geo.kv_heads, d = geo.head_dim;
  const int n_hist = geo.n_history, n_prompt = geo.n_prompt, n_gen = geo.n_gen;
  const int group = geo.score_heads / heads;
  const int t0 = window > 0 ? std::max(0, n_gen - window) : 0;
  const int steps = n_gen - t0;
  const int m = n_hist + n_prompt + n_gen;  // every key of a head
  std::vector<double> out(static_cast<size_t>(heads) * m, 0.0);
  if (steps == 0 || m == 0) return out;
  // The columns of one KV head are (score head g, step s) at g * steps + s:
  // a GEMM covers a block of them (BlockColumns), the whole group when it
  // is small; the cancel flag is checked between blocks.
  const Eigen::Index cols = static_cast<Eigen::Index>(group) * steps;
  const Eigen::Index block = BlockColumns(m, d, cols);
  RowMajor keys(m, d), queries(cols, d);
  ColMajor logits(m, block);
  std::vector<double> mass(m);
  // Eigen-aligned: a vectorized exp takes scalar steps up to the first
  // aligned element, which must not depend on where the heap put the
  // buffer (the scalar and vector exp differ in the last bit).
  Eigen::ArrayXf e(m);
  for (int h = 0; h < heads; ++h) {
    ReadCache(layer, h, /*values=*/false, keys.data());
    ReadGroupQueries(layer, h, group, t0, steps, scale, queries);
    double* dst = out.data() + static_cast<size_t>(h) * m;
    for (Eigen::Index c0 = 0; c0 < cols; c0 += block) {
      if (IsCancelled(cancelled)) return absl::CancelledError("gen.q: scoring cancelled");
      const Eigen::Index nb = std::min(block, cols - c0);
      logits.leftCols(nb).noalias() = keys * queries.middleRows(c0, nb).transpose();
      for (Eigen::Index c = c0; c < c0 + nb; ++c) {
        const int s = static_cast<int>(c % steps);
        if (s == 0) std::fill(mass.begin(), mass.end(), 0.0);
        const int seen = n_hist + n_prompt + t0 + s + 1;
        const auto z = logits.col(c - c0).head(seen).array();
        Eigen::Map<Eigen::ArrayXf> ez(e.data(), seen);
        ez = (z - z.maxCoeff()).exp();  // Eigen's vectorized expf
        const double sum = SumAsDouble(e.data(), seen);
        // An infinite logit makes z - max NaN (a NaN one propagates): the sum
        // is finite (>= 1) exactly when no logit overflowed upwards.
        if (!std::isfinite(sum) && internal::FiniteChecksOn()) return LogitOverflow(h * group + static_cast<int>(c / steps), t0 + s);
        const double inv = 1.0 / sum;
        for (int i = 0; i < seen; ++i) mass[i] += e[i] * inv;
        // The score head's last step: its mass joins the group's sum.
        if (s == steps - 1) {
          for (int i = 0; i < m; ++i) dst[i] += mass[i];
        }
      }
    }
  }
  return out;
}

absl::StatusOr<std::vector<double>> QueryScores(const TurnLayer& layer, const TurnGeometry& geo, double scale,
                                                int window) {
  const int heads = geo.kv_heads, n_prompt = geo.n_prompt;
  const size_t m = static_cast<size_t>(geo.n_history) + n_prompt + geo.n_gen;
  absl::StatusOr<std::vector<double>> all = QueryMass(layer, geo, scale, window);
  if (!all.ok()) return all.status();
  const std::vector<double>& mass = *all;
  std::vector<double> out(static_cast<size_t>(heads) * n_prompt);
  for (int h = 0; h < heads; ++h) {
    std::copy_n(mass.begin() + h * m + geo.n_history, n_prompt, out.begin() + static_cast<size_t>(h) * n_prompt);
  }
  return out;
}

absl::StatusOr<double> AttentionOutputError(const TurnLayer& layer, const TurnGeometry& geo,
                                            const MessageLayer& msg, double scale,
                                            const std::atomic<bool>* cancelled) {
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
  // As in QueryScores: columns (g, t) at g * n_gen + t, in GEMM blocks.
  const Eigen::Index cols = static_cast<Eigen::Index>(group) * n_gen;
  const Eigen::Index block = BlockColumns(m_full, d, cols);
  RowMajor kf(m_full, d), vf(m_full, d), km(m_msg, d), vm(m_msg, d), q(cols, d);
  ColMajor wf(m_full, block), wm(m_msg, block), of(d, block), om(d, block);
  double total = 0;
  for (int h = 0; h < heads; ++h) {
    ReadCache(layer, h, /*values=*/false, kf.data());
    ReadCache(layer, h, /*values=*/true, vf.data());
    mk->ReadRows(h, 0, m_msg, km.data());
    mv->ReadRows(h, 0, m_msg, vm.data());
    ReadGroupQueries(layer, h, group, 0, n_gen, scale, q);
    for (Eigen::Index c0 = 0; c0 < cols; c0 += block) {
      if (IsCancelled(cancelled)) return absl::CancelledError("fidelity: cancelled");
      const Eigen::Index nb = std::min(block, cols - c0);
      wf.leftCols(nb).noalias() = kf * q.middleRows(c0, nb).transpose();
      wm.leftCols(nb).noalias() = km * q.middleRows(c0, nb).transpose();
      for (Eigen::Index c = 0; c < nb; ++c) {
        const int t = static_cast<int>((c0 + c) % n_gen);
        MaskedSoftmax(wf.data() + static_cast<size_t>(c) * m_full, n_hist + n_prompt + t + 1, m_full);
        MaskedSoftmax(wm.data() + static_cast<size_t>(c) * m_msg, before_gen + t + 1, m_msg);
      }
      of.leftCols(nb).noalias() = vf.transpose() * wf.leftCols(nb);
      om.leftCols(nb).noalias() = vm.transpose() * wm.leftCols(nb);
      for (Eigen::Index c = 0; c < nb; ++c) {
        double full = 0, diff = 0;
        for (int i = 0; i < d; ++i) {
          const double a = of(i, c), b = om(i, c);
          full += a * a;
          diff += (b - a) * (b - a);
        }
        // NaN or infinite: a logit (of the turn's keys or the message's) or
        // an output overflowed float32.
        if ((!std::isfinite(full) || !std::isfinite(diff)) && internal::FiniteChecksOn()) {
          return LogitOverflow(h * group + static_cast<int>((c0 + c) / n_gen), static_cast<int>((c0 + c) % n_gen));
        }
        total += full > 0 ? std::sqrt(diff / full) : (diff > 0 ? 1.0 : 0.0);
      }
    }
  }
  return total / (static_cast<double>(geo.score_heads) * n_gen);
}

}  // namespace kvrelay
