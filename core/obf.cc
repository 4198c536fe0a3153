#include "core/obf.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "Eigen/Dense"
#include "core/internal/gram.h"

namespace kvrelay {
namespace {

constexpr double kSkipResidual = 1e-10;  // ||R||_F at or below this: skip the head
constexpr double kTiny = 1e-12;
// The fast path's smallest residual energy, relative to V_del's (see FastObf).
constexpr double kFastResolution = 1e-3;

using RowMatrixXf = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// A rows x cols view of padded storage: consecutive columns (rows, for a
// row-major M) are `ld` elements apart. M may be const-qualified.
template <typename M>
using Strided = Eigen::Map<M, 0, Eigen::OuterStride<>>;
template <typename M, typename Scalar>
Strided<M> StridedView(Scalar* data, int rows, int cols, int ld) {
  return Strided<M>(data, rows, cols, Eigen::OuterStride<>(ld));
}

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

// A per-thread ld x ld buffer for a Gram kernel's output; the next call on
// this thread overwrites it.
template <typename Scalar>
Scalar* GramBuffer(int ld) {
  thread_local std::vector<Scalar> g;
  g.resize(static_cast<size_t>(ld) * ld);
  return g.data();
}

// Copies the lower triangle of the d x d matrix g (stride ld) to its upper
// one and returns the full matrix as a view.
template <typename Scalar>
Strided<const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>> MirrorLower(Scalar* g, int d, int ld) {
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j < i; ++j) g[static_cast<size_t>(j) * ld + i] = g[static_cast<size_t>(i) * ld + j];
  }
  return StridedView<const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>>(g, d, d, ld);
}

// The rows `idx` of the row-major [*, d] floats `v`, converted to Scalar
// and multiplied by `scale`, in a per-thread row-major buffer whose stride is
// padded with zeros for GramLower (released when the object dies, see
// internal::ReleaseIfLarge).
template <typename Scalar>
class PaddedRows {
 public:
  using RowMajor = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using ColMajor = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>;

  PaddedRows(const float* v, int d, const std::vector<int>& idx, Scalar scale = 1)
      : n_(static_cast<int>(idx.size())), d_(d), ld_(internal::GramStride(d_)) {
    buf().resize(static_cast<size_t>(n_) * ld_);
    for (int i = 0; i < n_; ++i) {
      Scalar* row = buf().data() + static_cast<size_t>(i) * ld_;
      const float* src = v + static_cast<size_t>(idx[i]) * d_;
      for (int j = 0; j < d_; ++j) row[j] = static_cast<Scalar>(src[j]) * scale;
      for (int j = d_; j < ld_; ++j) row[j] = Scalar(0);
    }
  }
  ~PaddedRows() {
    internal::ReleaseIfLarge(&buf());
  }
  PaddedRows(const PaddedRows&) = delete;
  PaddedRows& operator=(const PaddedRows&) = delete;

  Strided<RowMajor> rows() { return StridedView<RowMajor>(buf().data(), n_, d_, ld_); }

  // The full symmetric Gram rows^T rows, d x d, as a view of a per-thread
  // buffer that the next call on this thread overwrites.
  Strided<const ColMajor> Gram() {
    Scalar* g = GramBuffer<Scalar>(ld_);
    internal::GramLower(buf().data(), n_, d_, g);
    return MirrorLower(g, d_, ld_);
  }

 private:
  static std::vector<Scalar>& buf() {
    thread_local std::vector<Scalar> b;
    return b;
  }
  int n_, d_, ld_;
};

// The rows `idx` of the row-major [*, d] floats `v`, times `scale`, as
// bfloat16 pairs in a per-thread buffer for GramLowerBf16, when that is
// exact: every scaled value is a bfloat16 value (BF16 turns). Scaled
// magnitudes below 2^-40 become zero, as GramLowerBf16 requires (the caller
// scales the largest into [1/2, 1), so these are below 2^-40 of it and
// count for nothing in a float Gram).
class PairRows {
 public:
  // Returns false, leaving the buffer unspecified, when some scaled value
  // has more than bfloat16's 8 significant bits.
  bool Pack(const float* v, int d, const std::vector<int>& idx, float scale) {
    n_ = static_cast<int>(idx.size());
    d_ = d;
    ld_ = internal::GramStride(d);
    const int pairs = (n_ + 1) / 2;
    buf().resize(static_cast<size_t>(pairs) * ld_);
    uint32_t low_bits = 0;
    auto bits = [scale, &low_bits](float x) {
      x *= scale;
      if (std::abs(x) < 0x1p-40f) x = 0;
      uint32_t b;
      std::memcpy(&b, &x, sizeof(b));
      low_bits |= b;
      return b;
    };
    for (int p = 0; p < pairs; ++p) {
      uint32_t* out = buf().data() + static_cast<size_t>(p) * ld_;
      const float* even = v + static_cast<size_t>(idx[2 * p]) * d;
      if (2 * p + 1 < n_) {
        const float* odd = v + static_cast<size_t>(idx[2 * p + 1]) * d;
        for (int j = 0; j < d; ++j) out[j] = (bits(odd[j]) & 0xffff0000u) | bits(even[j]) >> 16;
      } else {
        for (int j = 0; j < d; ++j) out[j] = bits(even[j]) >> 16;
      }
      std::fill(out + d, out + ld_, 0u);
      if ((low_bits & 0xffffu) != 0) return false;
    }
    return true;
  }
  ~PairRows() {
    internal::ReleaseIfLarge(&buf());
  }

  // As PaddedRows::Gram.
  Strided<const Eigen::MatrixXf> Gram() {
    float* g = GramBuffer<float>(ld_);
    internal::GramLowerBf16(buf().data(), (n_ + 1) / 2, d_, g);
    return MirrorLower(g, d_, ld_);
  }

 private:
  static std::vector<uint32_t>& buf() {
    thread_local std::vector<uint32_t> b;
    return b;
  }
  int n_ = 0, d_ = 0, ld_ = 0;
};

// max |p[i]| over n finite floats (0 when n = 0).
float MaxAbs(const float* p, size_t n) {
  size_t i = 0;
  float m = 0;
#if defined(__AVX2__)
  const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    m0 = _mm256_max_ps(m0, _mm256_and_ps(mask, _mm256_loadu_ps(p + i)));
    m1 = _mm256_max_ps(m1, _mm256_and_ps(mask, _mm256_loadu_ps(p + i + 8)));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(m0, m1));
  for (float l : lanes) m = std::max(m, l);
#endif
  for (; i < n; ++i) m = std::max(m, std::abs(p[i]));
  return m;
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

// Sturm counts for several shifts at once: count[e] = number of eigenvalues
// of the symmetric tridiagonal (a, b) below x[e]. The shifts are
// independent, so they go through the recurrence side by side, kLanes at a
// time, which hides the division latency.
void CountBelow(const Eigen::VectorXd& a, const Eigen::VectorXd& b2, const double* x, int k,
                double pivmin, int* count) {
  constexpr int kLanes = 8;
  const int n = static_cast<int>(a.size());
  for (int e0 = 0; e0 < k; e0 += kLanes) {
    double xs[kLanes], q[kLanes], c[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      xs[l] = x[std::min(e0 + l, k - 1)];
      const double t = a[0] - xs[l];
      q[l] = std::abs(t) < pivmin ? -pivmin : t;
      c[l] = q[l] < 0 ? 1.0 : 0.0;
    }
#if defined(__AVX2__)
    // The same operations as the scalar loop below, four lanes per vector.
    static_assert(kLanes == 8, "two vectors of four");
    const __m256d sign = _mm256_set1_pd(-0.0), piv = _mm256_set1_pd(pivmin);
    const __m256d neg_piv = _mm256_set1_pd(-pivmin), zero = _mm256_setzero_pd(), one = _mm256_set1_pd(1.0);
    __m256d x0 = _mm256_loadu_pd(xs), x1 = _mm256_loadu_pd(xs + 4);
    __m256d q0 = _mm256_loadu_pd(q), q1 = _mm256_loadu_pd(q + 4);
    __m256d c0 = _mm256_loadu_pd(c), c1 = _mm256_loadu_pd(c + 4);
    for (int i = 1; i < n; ++i) {
      const __m256d ai = _mm256_set1_pd(a[i]), bi = _mm256_set1_pd(b2[i - 1]);
      __m256d t0 = _mm256_sub_pd(_mm256_sub_pd(ai, x0), _mm256_div_pd(bi, q0));
      __m256d t1 = _mm256_sub_pd(_mm256_sub_pd(ai, x1), _mm256_div_pd(bi, q1));
      q0 = _mm256_blendv_pd(t0, neg_piv, _mm256_cmp_pd(_mm256_andnot_pd(sign, t0), piv, _CMP_LT_OQ));
      q1 = _mm256_blendv_pd(t1, neg_piv, _mm256_cmp_pd(_mm256_andnot_pd(sign, t1), piv, _CMP_LT_OQ));
      c0 = _mm256_add_pd(c0, _mm256_and_pd(_mm256_cmp_pd(q0, zero, _CMP_LT_OQ), one));
      c1 = _mm256_add_pd(c1, _mm256_and_pd(_mm256_cmp_pd(q1, zero, _CMP_LT_OQ), one));
    }
    _mm256_storeu_pd(c, c0);
    _mm256_storeu_pd(c + 4, c1);
#else
    for (int i = 1; i < n; ++i) {
      const double ai = a[i], bi = b2[i - 1];
      for (int l = 0; l < kLanes; ++l) {
        const double t = ai - xs[l] - bi / q[l];
        q[l] = std::abs(t) < pivmin ? -pivmin : t;
        c[l] += q[l] < 0 ? 1.0 : 0.0;
      }
    }
#endif
    for (int l = 0; l < kLanes && e0 + l < k; ++l) count[e0 + l] = static_cast<int>(c[l]);
  }
}

// The eigenvalues of the symmetric tridiagonal T (`diag`, `sub`) in
// [lo, hi] (Gershgorin bounds; |lo|, |hi| <= norm), largest first: the top
// `p` by Sturm bisection, all at once, keeping only those > 0 and > rel_tol
// times the largest.
std::vector<double> TopTridiagonalEigenvalues(const Eigen::VectorXd& diag, const Eigen::VectorXd& sub, int p,
                                              double rel_tol, double lo, double hi, double norm) {
  const int n = static_cast<int>(diag.size());
  const double pivmin = std::numeric_limits<double>::min() * 4 / std::numeric_limits<double>::epsilon();
  const double eps = std::numeric_limits<double>::epsilon();
  // Eigenvalue e (0 = largest) is the (n-1-e)-th smallest, so count(x) <=
  // n-1-e below it.
  const int k = std::min(p, n);
  const Eigen::VectorXd sub2 = sub.cwiseProduct(sub);
  std::vector<double> a(k, lo), b(k, hi), mid(k);
  std::vector<int> count(k);
  while (b[0] - a[0] > 2 * eps * norm) {
    for (int e = 0; e < k; ++e) mid[e] = 0.5 * (a[e] + b[e]);
    CountBelow(diag, sub2, mid.data(), k, pivmin, count.data());
    for (int e = 0; e < k; ++e) {
      if (count[e] <= n - 1 - e) a[e] = mid[e]; else b[e] = mid[e];
    }
  }
  std::vector<double> lambda;
  for (int e = 0; e < k; ++e) {
    const double l = 0.5 * (a[e] + b[e]);
    if (!(l > 0) || (!lambda.empty() && !(l > rel_tol * lambda[0]))) break;
    lambda.push_back(l);
  }
  return lambda;
}

// T - lambda*I (T: `diag`, `sub`) factored by LU with partial pivoting
// (LAPACK dgttrf), for the solves of inverse iteration.
struct TridiagonalLu {
  std::vector<double> dl, dd, du, du2;  // dd holds the reciprocals of U's diagonal
  std::vector<int> piv;

  // Pivots below `tiny` in magnitude are raised to it (an exact eigenvalue
  // makes T - lambda*I singular).
  void Factor(const Eigen::VectorXd& diag, const Eigen::VectorXd& sub, double lambda, double tiny) {
    const int n = static_cast<int>(diag.size());
    dl.resize(n);
    dd.resize(n);
    du.resize(n);
    du2.resize(n);
    piv.resize(n);
    for (int i = 0; i < n; ++i) dd[i] = diag[i] - lambda;
    for (int i = 0; i + 1 < n; ++i) dl[i] = du[i] = sub[i];
    for (int i = 0; i + 1 < n; ++i) {
      du2[i] = 0;
      if (std::abs(dd[i]) >= std::abs(dl[i])) {
        piv[i] = i;
        if (dd[i] != 0) {
          const double f = dl[i] / dd[i];
          dl[i] = f;
          dd[i + 1] -= f * du[i];
        }
      } else {
        piv[i] = i + 1;
        const double f = dd[i] / dl[i];
        dd[i] = dl[i];
        dl[i] = f;
        const double t = du[i];
        du[i] = dd[i + 1];
        dd[i + 1] = t - f * dd[i + 1];
        if (i + 2 < n) {
          du2[i] = du[i + 1];
          du[i + 1] = -f * du[i + 1];
        }
      }
    }
    for (int i = 0; i < n; ++i) {
      if (std::abs(dd[i]) < tiny) dd[i] = dd[i] < 0 ? -tiny : tiny;
      dd[i] = 1.0 / dd[i];  // the U solves below multiply
    }
  }

  // v <- (T - lambda*I)^-1 v.
  void Solve(Eigen::VectorXd* v) const {
    const int n = static_cast<int>(dd.size());
    Eigen::VectorXd& x = *v;
    for (int i = 0; i + 1 < n; ++i) {  // L solve
      const int ip = piv[i];
      const double t = x[ip == i ? i + 1 : i] - dl[i] * x[ip];
      x[i] = x[ip];
      x[i + 1] = t;
    }
    for (int i = n - 1; i >= 0; --i) {  // U solve
      double s = x[i];
      if (i + 1 < n) s -= du[i] * x[i + 1];
      if (i + 2 < n) s -= du2[i] * x[i + 2];
      x[i] = s * dd[i];
    }
  }
};

// Top-`p` eigenvectors (as columns, by descending eigenvalue) of the
// symmetric matrix `g`, leaving out eigenvalues at or below rel_tol times
// the largest. Householder tridiagonalization; the wanted eigenvalues by
// Sturm bisection; their vectors by inverse iteration with Gram-Schmidt;
// then the back-transformation. The O(d^3) eigenvector accumulation of a
// full solver is never done.
Eigen::MatrixXd TopEigenvectors(const Eigen::MatrixXd& g, int p, double rel_tol) {
  const int n = static_cast<int>(g.rows());
  // Reused per thread: its d x d workspace would otherwise be a fresh
  // (page-faulting) allocation for every head.
  thread_local Eigen::Tridiagonalization<Eigen::MatrixXd> tri;
  tri.compute(g);
  const Eigen::VectorXd diag = tri.diagonal();
  const Eigen::VectorXd sub = tri.subDiagonal();
  double lo = diag[0], hi = diag[0];
  for (int i = 0; i < n; ++i) {
    const double r = (i > 0 ? std::abs(sub[i - 1]) : 0) + (i + 1 < n ? std::abs(sub[i]) : 0);
    lo = std::min(lo, diag[i] - r);
    hi = std::max(hi, diag[i] + r);
  }
  const double norm = std::max(std::abs(lo), std::abs(hi));
  if (norm == 0) return Eigen::MatrixXd(n, 0);
  const std::vector<double> lambda = TopTridiagonalEigenvalues(diag, sub, p, rel_tol, lo, hi, norm);
  const int want = static_cast<int>(lambda.size());
  Eigen::MatrixXd x(n, want);
  if (want == 0) return x;  // no positive eigenvalue (G = 0, or not finite)
  TridiagonalLu lu;
  for (int e = 0; e < want; ++e) {
    lu.Factor(diag, sub, lambda[e], norm * std::numeric_limits<double>::epsilon());
    Eigen::VectorXd v(n);
    for (int i = 0; i < n; ++i) v[i] = 1.0 + 0.01 * ((i * 7919 + e * 104729) % 101);
    for (int it = 0; it < 3; ++it) {
      lu.Solve(&v);
      for (int j = 0; j < e; ++j) v -= x.col(j).dot(v) * x.col(j);
      v /= v.norm();
    }
    x.col(e) = v;
  }
  // Back-transformation Q x, one reflector at a time: for 8 vectors this is
  // 2.5x faster than Eigen's blocked HouseholderSequence product at d = 96.
  const Eigen::MatrixXd& packed = tri.packedMatrix();
  const Eigen::VectorXd& tau = tri.householderCoefficients();
  Eigen::VectorXd workspace(want);
  for (int k = n - 2; k >= 0; --k) {
    const int m = n - k - 1;
    x.bottomRows(m).applyHouseholderOnTheLeft(packed.col(k).tail(m - 1), tau[k], workspace.data());
  }
  return x;
}

// Column-major [rows, cols] view of a padded buffer (column stride ld).
using PaddedCols = Strided<Eigen::MatrixXf>;

// Orthonormalizes the columns of y into x: `passes` sweeps of modified
// Gram-Schmidt (a second one restores orthogonality to float precision), or
// Householder QR when a column is nearly dependent on the ones before it.
// The inner iterations need only a well conditioned basis; the
// Rayleigh-Ritz step gets two passes.
void Orthonormalize(const PaddedCols& y, int passes, PaddedCols* x) {
  *x = y;
  bool ok = true;
  for (int pass = 0; pass < passes && ok; ++pass) {
    ok = internal::GramSchmidtSweep(x->data(), static_cast<int>(x->rows()), static_cast<int>(x->cols()),
                                    static_cast<int>(x->outerStride()));
  }
  if (ok) return;
  const Eigen::MatrixXf dense = y;
  Eigen::HouseholderQR<Eigen::MatrixXf> qr(dense);
  Eigen::MatrixXf q = Eigen::MatrixXf::Identity(dense.rows(), dense.cols());
  q.applyOnTheLeft(qr.householderQ());
  *x = q;
}

void Finish(const ObfOptions& opts, absl::Span<const double> scores, absl::Span<const int> kept,
            const Split& split, const Eigen::VectorXd& rbar, ObfHead* out) {
  const double factor = ScaleFactor(opts.scale, split.a_del, split.a_keep);
  out->delta = factor * (out->c.transpose() * (out->c * rbar));
  out->weights = InjectWeights(opts.inject, scores, kept);
  out->applied = true;
}

// The orthogonal complement of span(V_keep) in the basis the QR's first r
// Householder reflectors give: H = H_0 ... H_{r-1} = I - Y T Y^T (compact WY
// form), whose first r columns span V_keep's rows and whose last d - r
// columns are an orthonormal basis of the complement. Working there, the
// eigenproblem of G = P S P shrinks from d x d to (d - r) x (d - r).
template <typename Matrix>
class Complement {
 public:
  using Scalar = typename Matrix::Scalar;
  using Vector = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;

  Complement(const Eigen::ColPivHouseholderQR<Matrix>& qr, int r)
      : d_(static_cast<int>(qr.rows())), r_(r), y_(Matrix::Zero(d_, r)), t_(Matrix::Zero(r, r)) {
    const Matrix& qrm = qr.matrixQR();
    for (int j = 0; j < r; ++j) {
      y_(j, j) = 1;
      y_.col(j).tail(d_ - j - 1) = qrm.col(j).tail(d_ - j - 1);
      const Scalar tau = qr.hCoeffs()[j];
      t_(j, j) = tau;
      if (j > 0) {  // LAPACK dlarft, forward and columnwise
        const Vector v = y_.leftCols(j).transpose() * y_.col(j);
        const Vector tv = t_.topLeftCorner(j, j).template triangularView<Eigen::Upper>() * v;
        t_.col(j).head(j) = -tau * tv;
      }
    }
  }

  // The trailing m x m block (m = d - r) of H^T S H for symmetric S:
  // H^T S H = S - Y Z^T - Z Y^T with W = S Y T, Z = W - Y (T^T Y^T W) / 2.
  // s: the full S, row-major with stride GramStride(d) (PaddedRows::Gram).
  // Returns the block in full as a view of a per-thread buffer that the next
  // call on this thread overwrites: stride GramStride(m), zero padding
  // columns (SymmetricTimes' layout).
  Strided<const Matrix> ReduceGram(const Scalar* s) const {
    const int m = d_ - r_, ld = internal::GramStride(d_), ldm = internal::GramStride(m);
    thread_local std::vector<Scalar> g, cross;
    g.resize(static_cast<size_t>(ldm) * m);
    // With r = 0, H = I and there is nothing to subtract (nor may Eigen's
    // blocked products run with an empty inner dimension).
    if (r_ > 0) TrailingUpdate(s, &cross);
    for (int i = 0; i < m; ++i) {
      const Scalar* srow = s + static_cast<size_t>(r_ + i) * ld + r_;
      Scalar* grow = g.data() + static_cast<size_t>(i) * ldm;
      for (int j = 0; j <= i; ++j) {
        grow[j] = r_ > 0 ? srow[j] - cross[static_cast<size_t>(i) * ldm + j] : srow[j];
        g[static_cast<size_t>(j) * ldm + i] = grow[j];
      }
      for (int j = m; j < ldm; ++j) grow[j] = Scalar(0);
    }
    return StridedView<const Matrix>(g.data(), m, m, ldm);
  }

  // H's first r columns, I[:, :r] - Y T Y[:r, :]^T: an orthonormal basis of
  // span(V_keep), d x r.
  Matrix Basis() const {
    if (r_ == 0) return Matrix(d_, 0);
    Matrix q = -(y_ * (t_.template triangularView<Eigen::Upper>() * y_.topRows(r_).transpose()));
    q.topRows(r_).diagonal().array() += Scalar(1);
    return q;
  }

  // Complement coordinates (columns of x, (d - r) rows) to R^d: H [0; x].
  Matrix Expand(const Matrix& x) const {
    if (r_ == 0) return x;  // H = I
    if (x.cols() == 0) return Matrix(d_, 0);
    Matrix out = Matrix::Zero(d_, x.cols());
    out.bottomRows(d_ - r_) = x;
    const Matrix tx = t_.template triangularView<Eigen::Upper>() * (y_.bottomRows(d_ - r_).transpose() * x);
    out.noalias() -= y_ * tx;
    return out;
  }

 private:
  // Lower triangle of Y_b Z_b^T + Z_b Y_b^T (the trailing rows, m of them)
  // into *cross, row-major with stride GramStride(m): one product over 2r
  // terms, [Y_b Z_b] [Z_b Y_b]^T, each term a row of a CrossLower operand.
  // REQUIRES: r > 0.
  void TrailingUpdate(const Scalar* s, std::vector<Scalar>* cross) const {
    const int m = d_ - r_, ld = internal::GramStride(d_), ldm = internal::GramStride(m);
    thread_local std::vector<Scalar> ybuf, wbuf, terms_a, terms_b;
    ybuf.resize(static_cast<size_t>(ld) * r_);
    wbuf.resize(static_cast<size_t>(ld) * r_);
    const Matrix yt = y_ * t_.template triangularView<Eigen::Upper>();
    StridedView<Matrix>(ybuf.data(), d_, r_, ld) = yt;
    internal::SymmetricTimes(s, d_, ybuf.data(), r_, wbuf.data());  // W = S Y T
    const auto w = StridedView<const Matrix>(wbuf.data(), d_, r_, ld);
    const Matrix mm = yt.transpose() * w;
    terms_a.assign(static_cast<size_t>(2 * r_) * ldm, Scalar(0));
    terms_b.assign(static_cast<size_t>(2 * r_) * ldm, Scalar(0));
    auto ya = StridedView<Matrix>(terms_a.data(), m, r_, ldm);
    auto za = StridedView<Matrix>(terms_a.data() + static_cast<size_t>(r_) * ldm, m, r_, ldm);
    ya = y_.bottomRows(m);
    za.noalias() = w.bottomRows(m) - Scalar(0.5) * (y_.bottomRows(m) * mm);
    StridedView<Matrix>(terms_b.data(), m, r_, ldm) = za;
    StridedView<Matrix>(terms_b.data() + static_cast<size_t>(r_) * ldm, m, r_, ldm) = ya;
    cross->resize(static_cast<size_t>(ldm) * ldm);
    internal::CrossLower(terms_a.data(), terms_b.data(), 2 * r_, m, cross->data());
  }

  int d_, r_;
  Matrix y_;  // d x r, unit lower trapezoidal
  Matrix t_;  // r x r, upper triangular
};

ObfHead ExactObf(const ObfOptions& opts, absl::Span<const float> v, int d,
                 absl::Span<const double> scores, absl::Span<const int> kept, const Split& split) {
  ObfHead out;
  out.delta = Eigen::VectorXd::Zero(d);
  const int n_keep = static_cast<int>(kept.size());
  Eigen::Map<const RowMatrixXf> vm(v.data(), v.size() / d, d);
  Eigen::MatrixXd keep_t(d, n_keep);  // V_keep^T
  for (int i = 0; i < n_keep; ++i) keep_t.col(i) = vm.row(kept[i]).transpose().cast<double>();
  // The deleted rows are the largest buffer: a per-thread one, since a fresh
  // allocation per head costs page faults.
  PaddedRows<double> del_rows(v.data(), d, split.del);
  const auto del = del_rows.rows();
  Eigen::ColPivHouseholderQR<Eigen::MatrixXd> qr(keep_t);
  qr.setThreshold(1e-9);
  const int r = static_cast<int>(qr.rank());
  const Complement<Eigen::MatrixXd> h(qr, r);
  out.q = h.Basis();
  if (r == d) return out;  // V_keep spans everything: R = 0

  const auto s = del_rows.Gram();
  const Eigen::MatrixXd g = h.ReduceGram(s.data());  // R^T R in the complement basis, (d-r) x (d-r)
  // ||R||_F^2 = trace(G); near zero the trace loses digits, so decide on R itself.
  if (g.trace() <= std::max(1e-8 * s.trace(), 1e-18)) {
    const Eigen::MatrixXd res = del - (del * out.q) * out.q.transpose();
    if (res.norm() <= kSkipResidual) return out;
  }
  out.c = h.Expand(TopEigenvectors(g, opts.p, 1e-12)).transpose();
  const Eigen::VectorXd w = ResidualWeights<double>(scores, split.del);
  Eigen::VectorXd rbar = del.transpose() * w;
  rbar -= out.q * (out.q.transpose() * rbar);
  Finish(opts, scores, kept, split, rbar, &out);
  return out;
}

// The top eigenvectors of the symmetric G (dc x dc, float32, column
// stride ld; its trace `trace`), at most `p` of them, by `iters` products
// with a block of m start vectors and a Rayleigh-Ritz step; directions whose
// Ritz value is below 1e-6 of the largest are left out.
// REQUIRES: 1 <= m <= dc; trace > 0.
Eigen::MatrixXf SubspaceTopEigenvectors(const float* g, int dc, int ld, int m, int p, int iters, double trace) {
  // The blocks of vectors, in padded per-thread buffers for SymmetricTimes.
  thread_local std::vector<float> xbuf, ybuf;
  thread_local Eigen::MatrixXf start;
  if (start.rows() != dc || start.cols() != m) start = StartVectors(dc, m);
  xbuf.resize(static_cast<size_t>(ld) * m);
  ybuf.resize(static_cast<size_t>(ld) * m);
  PaddedCols x = StridedView<Eigen::MatrixXf>(xbuf.data(), dc, m, ld);
  PaddedCols y = StridedView<Eigen::MatrixXf>(ybuf.data(), dc, m, ld);
  x = start;
  // The block is orthonormalized after every second product, and after the
  // last: span(G (G X)) is span(G^2 X) in exact arithmetic, and in float32
  // one product more between orthonormalizations leaves the result as
  // accurate on steep spectra as orthonormalizing after each (three more do
  // not). The product that is not orthonormalized is scaled by a power of
  // two (exactly) in [1 / (2 trace(G)), 1 / trace(G)): a column of the
  // orthonormal block comes out no longer than lambda_max / trace(G) <= 1,
  // and the next product cannot underflow where G is tiny.
  int trace_exp = 0;
  std::frexp(trace, &trace_exp);
  const float unit = std::ldexp(1.0f, std::clamp(-trace_exp, -126, 126));
  for (int it = 0; it < iters; ++it) {
    internal::SymmetricTimes(g, dc, xbuf.data(), m, ybuf.data());
    const int left = iters - 1 - it;  // products after this one
    if (left % 2 == 1) {
      x = y * unit;
    } else {
      Orthonormalize(y, /*passes=*/left == 0 ? 2 : 1, &x);
    }
  }
  // Rayleigh-Ritz on span(x).
  internal::SymmetricTimes(g, dc, xbuf.data(), m, ybuf.data());
  Eigen::MatrixXf t = x.transpose() * y;
  t = (0.5f * (t + t.transpose())).eval();
  Eigen::SelfAdjointEigenSolver<Eigen::MatrixXf> es(t);
  const Eigen::VectorXf& lambda = es.eigenvalues();
  const float lambda_max = std::max(lambda[m - 1], 0.0f);
  int kept = 0;
  while (kept < p && kept < m && lambda[m - 1 - kept] > 1e-6f * lambda_max) ++kept;
  return x * es.eigenvectors().rightCols(kept).rowwise().reverse();
}

ObfHead FastObf(const ObfOptions& opts, absl::Span<const float> v, int d,
                absl::Span<const double> scores, absl::Span<const int> kept, const Split& split) {
  ObfHead out;
  out.delta = Eigen::VectorXd::Zero(d);
  const int n_keep = static_cast<int>(kept.size());
  const int n_del = static_cast<int>(split.del.size());
  Eigen::Map<const RowMatrixXf> vm(v.data(), v.size() / d, d);
  // Scale by a power of two (exact) so that the float32 Gram cannot overflow
  // for large values (BF16 and F32 hold up to ~3e38); delta is scaled back.
  const float vmax = MaxAbs(v.data(), v.size());  // kept and deleted rows
  // Subnormal values: no float power of two brings them to unit scale.
  if (vmax > 0 && vmax < std::numeric_limits<float>::min()) return ExactObf(opts, v, d, scores, kept, split);
  int exponent = 0;
  std::frexp(vmax, &exponent);
  const float to_unit = vmax > 0 ? std::ldexp(1.0f, -exponent) : 1.0f;
  const double from_unit = vmax > 0 ? std::ldexp(1.0, exponent) : 1.0;
  Eigen::MatrixXf keep_t(d, n_keep);
  for (int i = 0; i < n_keep; ++i) keep_t.col(i) = vm.row(kept[i]).transpose() * to_unit;
  // The deleted rows for the Gram: bfloat16 pairs where exact (half the
  // multiply instructions on CPUs with AVX512_BF16; same speed as floats
  // elsewhere), else padded floats; per-thread buffers (see ExactObf).
  PairRows pair_rows;
  std::optional<PaddedRows<float>> del_rows;
  if (!pair_rows.Pack(v.data(), d, split.del, to_unit)) del_rows.emplace(v.data(), d, split.del, to_unit);

  Eigen::ColPivHouseholderQR<Eigen::MatrixXf> qr(keep_t);
  qr.setThreshold(1e-5);
  const int r = static_cast<int>(qr.rank());
  const Complement<Eigen::MatrixXf> h(qr, r);
  const Eigen::MatrixXf q = h.Basis();
  out.q = q.cast<double>();
  if (r == d) return out;
  const auto s = del_rows ? del_rows->Gram() : pair_rows.Gram();
  // G = P S P in the complement basis of span(V_keep), (d - r) x (d - r),
  // padded for SymmetricTimes.
  const auto g = h.ReduceGram(s.data());
  const int dc = d - r, ld = static_cast<int>(g.outerStride());
  // G comes from S by cancellation, so its float32 rounding is ~1e-7 of
  // S's size: a residual below kFastResolution of V_del's energy (e.g. rows
  // that V_keep nearly spans) is left to the exact path. Above it, trace(G)
  // = ||R||_F^2 is resolved well enough for the skip rule, in the values'
  // own units.
  const double trace = g.trace();
  if (trace <= kFastResolution * s.trace()) return ExactObf(opts, v, d, scores, kept, split);
  if (trace * from_unit * from_unit <= kSkipResidual * kSkipResidual) return out;

  // rank(G) <= min(d - r, n_del): more directions would only add noise.
  const int m = std::min({dc, n_del, opts.p + opts.oversample});
  const Eigen::MatrixXf ritz = SubspaceTopEigenvectors(g.data(), dc, ld, m, opts.p, opts.iters, trace);
  out.c = h.Expand(ritz).transpose().cast<double>();

  const Eigen::VectorXf w = ResidualWeights<float>(scores, split.del);
  Eigen::VectorXf rbar = Eigen::VectorXf::Zero(d);
  for (int i = 0; i < n_del; ++i) rbar.noalias() += (w[i] * to_unit) * vm.row(split.del[i]).transpose();
  rbar -= q * (q.transpose() * rbar);
  Finish(opts, scores, kept, split, rbar.cast<double>() * from_unit, &out);
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
