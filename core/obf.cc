#include "core/obf.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "Eigen/Dense"

namespace kvrelay {
namespace {

constexpr double kSkipResidual = 1e-10;  // ||R||_F at or below this: skip the head
constexpr double kTiny = 1e-12;

using RowMatrixXf = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

struct Split {
  std::vector<int> del;  // candidate indices not kept
  double a_keep = 0, a_del = 0;
};

Split SplitCandidates(int n_cand, absl::Span<const double> scores, absl::Span<const int> kept) {
  Split s;
  s.del.reserve(n_cand - kept.size());
  size_t ki = 0;
  for (int j = 0; j < n_cand; ++j) {
    if (ki < kept.size() && kept[ki] == j) {
      s.a_keep += scores[j];
      ++ki;
    } else {
      s.a_del += scores[j];
      s.del.push_back(j);
    }
  }
  return s;
}

double ScaleFactor(ScaleMode mode, double a_del, double a_keep) {
  switch (mode) {
    case ScaleMode::kAdOverAs: return a_del / (a_keep + kTiny);
    case ScaleMode::kAdFrac: return a_del / (a_del + a_keep + kTiny);
    case ScaleMode::kAd: return a_del;
    case ScaleMode::kNone: return 1.0;
  }
  return 1.0;
}

std::vector<double> InjectWeights(InjectMode mode, absl::Span<const double> scores,
                                  absl::Span<const int> kept) {
  std::vector<double> w(kept.size(), 1.0);
  if (mode == InjectMode::kAttn) {
    double sum = 0;
    for (int t : kept) sum += scores[t];
    if (sum > kTiny) {
      for (size_t i = 0; i < kept.size(); ++i) w[i] = kept.size() * scores[kept[i]] / sum;
    }
  }
  return w;
}

// Weights w_j of the deleted rows for rbar; uniform when their sum vanishes.
template <typename Scalar>
Eigen::Matrix<Scalar, Eigen::Dynamic, 1> ResidualWeights(absl::Span<const double> scores,
                                                         const std::vector<int>& del) {
  Eigen::Matrix<Scalar, Eigen::Dynamic, 1> w(del.size());
  double sum = 0;
  for (size_t i = 0; i < del.size(); ++i) sum += scores[del[i]];
  for (size_t i = 0; i < del.size(); ++i) {
    w[i] = static_cast<Scalar>(sum > kTiny ? scores[del[i]] / sum : 1.0 / del.size());
  }
  return w;
}

// Orthonormal basis of the column span of `a` (rank-revealing QR).
template <typename Matrix>
Matrix ColumnBasis(const Matrix& a, double rel_tol) {
  Eigen::ColPivHouseholderQR<Matrix> qr(a);
  qr.setThreshold(rel_tol);
  const int r = static_cast<int>(qr.rank());
  Matrix q = Matrix::Identity(a.rows(), r);
  q.applyOnTheLeft(qr.householderQ());
  return q;
}

// Deterministic standard-normal start vectors (SplitMix64 + Box-Muller).
Eigen::MatrixXf StartVectors(int rows, int cols) {
  uint64_t state = 0x9e3779b97f4a7c15ull;
  auto next = [&state] {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (static_cast<double>(z >> 11) + 0.5) * 0x1.0p-53;
  };
  Eigen::MatrixXf x(rows, cols);
  for (int j = 0; j < cols; ++j) {
    for (int i = 0; i < rows; ++i) {
      const double u1 = next(), u2 = next();
      x(i, j) = static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
    }
  }
  return x;
}

ObfHead ExactObf(const ObfOptions& opts, absl::Span<const float> v, int d,
                 absl::Span<const double> scores, absl::Span<const int> kept, const Split& split) {
  ObfHead out;
  out.delta = Eigen::VectorXd::Zero(d);
  const int n_keep = static_cast<int>(kept.size());
  const int n_del = static_cast<int>(split.del.size());
  Eigen::MatrixXd keep_t(d, n_keep);  // V_keep^T
  for (int i = 0; i < n_keep; ++i) {
    for (int c = 0; c < d; ++c) keep_t(c, i) = v[static_cast<size_t>(kept[i]) * d + c];
  }
  Eigen::MatrixXd r(n_del, d);  // becomes R
  for (int i = 0; i < n_del; ++i) {
    for (int c = 0; c < d; ++c) r(i, c) = v[static_cast<size_t>(split.del[i]) * d + c];
  }
  out.q = ColumnBasis(keep_t, 1e-9);
  r -= (r * out.q) * out.q.transpose();
  if (r.norm() <= kSkipResidual) return out;

  Eigen::MatrixXd g = Eigen::MatrixXd::Zero(d, d);
  g.selfadjointView<Eigen::Lower>().rankUpdate(r.transpose());
  Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> es(g);
  const Eigen::VectorXd& lambda = es.eigenvalues();  // ascending
  const double lambda_max = lambda[d - 1];
  int p = 0;
  while (p < opts.p && p < d && lambda[d - 1 - p] > 1e-12 * lambda_max) ++p;
  out.c.resize(p, d);
  for (int i = 0; i < p; ++i) out.c.row(i) = es.eigenvectors().col(d - 1 - i).transpose();

  const Eigen::VectorXd w = ResidualWeights<double>(scores, split.del);
  const Eigen::RowVectorXd rbar = w.transpose() * r;
  const double factor = ScaleFactor(opts.scale, split.a_del, split.a_keep);
  out.delta = factor * ((rbar * out.c.transpose()) * out.c).transpose();
  out.weights = InjectWeights(opts.inject, scores, kept);
  out.applied = true;
  return out;
}

ObfHead FastObf(const ObfOptions& opts, absl::Span<const float> v, int d,
                absl::Span<const double> scores, absl::Span<const int> kept, const Split& split) {
  ObfHead out;
  out.delta = Eigen::VectorXd::Zero(d);
  const int n_keep = static_cast<int>(kept.size());
  const int n_del = static_cast<int>(split.del.size());
  Eigen::Map<const RowMatrixXf> vm(v.data(), v.size() / d, d);
  Eigen::MatrixXf keep_t(d, n_keep);
  for (int i = 0; i < n_keep; ++i) keep_t.col(i) = vm.row(kept[i]).transpose();
  RowMatrixXf del(n_del, d);
  for (int i = 0; i < n_del; ++i) del.row(i) = vm.row(split.del[i]);

  const Eigen::MatrixXf q = ColumnBasis(keep_t, 1e-5);
  out.q = q.cast<double>();
  Eigen::MatrixXf s = Eigen::MatrixXf::Zero(d, d);
  s.selfadjointView<Eigen::Lower>().rankUpdate(del.transpose());
  s.triangularView<Eigen::StrictlyUpper>() = s.transpose();

  auto project = [&q](Eigen::MatrixXf& x) { x.noalias() -= q * (q.transpose() * x); };
  // ||R||_F^2 = trace(P S P) = trace(S) - trace(Q^T S Q).
  const Eigen::MatrixXf sq = s * q;
  const double total = s.trace();
  const double resid2 = total - static_cast<double>((q.transpose() * sq).trace());
  if (resid2 <= std::max(kSkipResidual * kSkipResidual, 1e-10 * total)) return out;

  // rank(P S P) <= min(d - r, n_del): more directions would only add noise.
  const int m = std::min({d - static_cast<int>(q.cols()), n_del, opts.p + opts.oversample});
  if (m < 1) return out;
  Eigen::MatrixXf x = StartVectors(d, m);
  Eigen::MatrixXf y(d, m);
  project(x);
  for (int it = 0; it < opts.iters; ++it) {
    y.noalias() = s * x;
    project(y);
    Eigen::HouseholderQR<Eigen::MatrixXf> qr(y);
    x.setIdentity();
    x.applyOnTheLeft(qr.householderQ());
  }
  // Rayleigh-Ritz on span(x); x is orthonormal and inside the complement.
  y.noalias() = s * x;
  project(y);
  Eigen::MatrixXf t = x.transpose() * y;
  t = (0.5f * (t + t.transpose())).eval();
  Eigen::SelfAdjointEigenSolver<Eigen::MatrixXf> es(t);
  const Eigen::VectorXf& lambda = es.eigenvalues();
  const float lambda_max = std::max(lambda[m - 1], 0.0f);
  int p = 0;
  while (p < opts.p && p < m && lambda[m - 1 - p] > 1e-6f * lambda_max) ++p;
  Eigen::MatrixXf c(p, d);
  for (int i = 0; i < p; ++i) c.row(i) = (x * es.eigenvectors().col(m - 1 - i)).transpose();
  out.c = c.cast<double>();

  // rbar = P V_del^T w.
  const Eigen::VectorXf w = ResidualWeights<float>(scores, split.del);
  Eigen::MatrixXf rbar = del.transpose() * w;
  project(rbar);
  const double factor = ScaleFactor(opts.scale, split.a_del, split.a_keep);
  out.delta = factor * (c.transpose() * (c * rbar)).cast<double>();
  out.weights = InjectWeights(opts.inject, scores, kept);
  out.applied = true;
  return out;
}

}  // namespace

ObfHead ComputeObf(const ObfOptions& opts, absl::Span<const float> v, int n_cand, int d,
                   absl::Span<const double> scores, absl::Span<const int> kept) {
  const Split split = SplitCandidates(n_cand, scores, kept);
  if (kept.empty() || split.del.empty()) {
    ObfHead out;
    out.delta = Eigen::VectorXd::Zero(d);
    return out;
  }
  return opts.mode == ObfMode::kExact ? ExactObf(opts, v, d, scores, kept, split)
                                      : FastObf(opts, v, d, scores, kept, split);
}

}  // namespace kvrelay
