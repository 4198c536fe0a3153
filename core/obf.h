// Orthogonal backfill (OBF) of one KV head's kept values (BRIEF §4).
//
// Pure functions, thread-safe.
#ifndef KVRELAY_CORE_OBF_H_
#define KVRELAY_CORE_OBF_H_

#include <vector>

#include "Eigen/Core"
#include "absl/types/span.h"

namespace kvrelay {

enum class ObfMode { kExact, kFast };
enum class InjectMode { kUniform, kAttn };
enum class ScaleMode { kAdOverAs, kAdFrac, kAd, kNone };

struct ObfOptions {
  int p = 8;                 // rank of the residual subspace C (>= 1)
  ObfMode mode = ObfMode::kExact;
  InjectMode inject = InjectMode::kUniform;
  ScaleMode scale = ScaleMode::kAdOverAs;
  int iters = 12;            // fast path: subspace iterations (>= 1)
  int oversample = 10;       // fast path: extra directions (>= 0)
};

// What OBF computed for one head. `applied` is false when the head was
// skipped (nothing kept, nothing deleted, or ||R||_F <= 1e-10); then
// `delta` is zero and `weights` empty.
struct ObfHead {
  bool applied = false;
  Eigen::VectorXd delta;    // [d]
  Eigen::MatrixXd q;        // [d, r] orthonormal basis of span(V_keep)
  Eigen::MatrixXd c;        // [p', d] orthonormal rows spanning the residual subspace
  std::vector<double> weights;  // per kept candidate: V_t += weights[t] * delta
};

// Computes OBF for one head.
//   v:      row-major [n_cand, d] value rows of the candidates, in float
//   scores: [n_cand] that head's float64 scores of the candidates
//   kept:   ascending indices into the candidates (0..n_cand-1) that are kept
ObfHead ComputeObf(const ObfOptions& opts, absl::Span<const float> v, int n_cand, int d,
                   absl::Span<const double> scores, absl::Span<const int> kept);

}  // namespace kvrelay

#endif  // KVRELAY_CORE_OBF_H_
