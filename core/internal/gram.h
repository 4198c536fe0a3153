// Symmetric Gram matrices A^T A for OBF (internal to kvrelay_core).
#ifndef KVRELAY_CORE_INTERNAL_GRAM_H_
#define KVRELAY_CORE_INTERNAL_GRAM_H_

namespace kvrelay {
namespace internal {

// Padding unit of GramLower's row stride: kGramPad elements.
inline constexpr int kGramPad = 16;

// Rounds d up to a multiple of kGramPad.
inline int GramStride(int d) { return (d + kGramPad - 1) / kGramPad * kGramPad; }

// Computes the lower triangle of g = a^T a.
//   a: row-major [n, ld], ld = GramStride(d); columns d..ld-1 must be zero.
//   g: row-major [ld, ld]; g[i * ld + j] for j <= i < d holds
//      sum_t a[t][i] * a[t][j], accumulated with fused multiply-adds in
//      ascending t. Other entries are unspecified.
// Every code path (AVX-512, AVX2, scalar) performs the same operations in the
// same order per entry, so the result is bit-identical on every CPU; `isa`
// exists so tests can check that. kAvx2 falls back to scalar in builds
// without AVX2.
// Thread-safe. REQUIRES: n >= 0, 0 <= d, a and g do not overlap.
enum class GramIsa { kBest, kAvx2, kScalar };  // kBest: AVX-512 when the CPU has it

void GramLower(const double* a, int n, int d, double* g, GramIsa isa = GramIsa::kBest);
void GramLower(const float* a, int n, int d, float* g, GramIsa isa = GramIsa::kBest);

}  // namespace internal
}  // namespace kvrelay

#endif  // KVRELAY_CORE_INTERNAL_GRAM_H_
