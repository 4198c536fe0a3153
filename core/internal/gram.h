// Symmetric Gram matrices A^T A for OBF (internal to kvrelay_core).
#ifndef KVRELAY_CORE_INTERNAL_GRAM_H_
#define KVRELAY_CORE_INTERNAL_GRAM_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvrelay {
namespace internal {

// Frees a per-thread buffer once it holds more than 16 MiB, so that one long
// prompt does not pin memory in every worker for good.
template <typename T>
void ReleaseIfLarge(std::vector<T>* b) {
  if (b->capacity() * sizeof(T) > (size_t{16} << 20)) std::vector<T>().swap(*b);
}

// Padding unit of the row stride of the kernels' operands: kGramPad elements.
inline constexpr int kGramPad = 16;

// The row stride for d columns: d rounded up to an odd multiple of kGramPad.
// A stride of a power of two (d = 128) would map a column's entries to a few
// cache sets, and every kernel walks columns.
inline int GramStride(int d) {
  const int units = (d + kGramPad - 1) / kGramPad;
  return (units | 1) * kGramPad;
}

// Which code path runs. Every path (AVX-512, AVX2, scalar) performs the same
// operations in the same order per output entry, so results are
// bit-identical on every CPU; the choice exists so tests can check that.
// kBest: AVX-512 when the CPU has it and the environment variable
// KVRELAY_DISABLE_AVX512 is unset, empty or "0" (read once per process),
// else AVX2; for GramLowerBf16, AVX512_BF16's dot-product instruction where
// NativeBf16GramEnabled(). kAvx512: AVX-512F alone (AVX2 where the CPU or
// build lacks it). kAvx2 is scalar in builds without AVX2.
enum class GramIsa { kBest, kAvx512, kAvx2, kScalar };

// Computes the lower triangle of g = a^T a.
//   a: row-major [n, ld], ld = GramStride(d); columns d..ld-1 must be zero.
//   g: row-major [ld, ld]; g[i * ld + j] for j <= i < d holds
//      sum_t a[t][i] * a[t][j], accumulated with fused multiply-adds in
//      ascending t. Other entries are unspecified.
// Thread-safe. REQUIRES: n >= 0, d >= 0, a and g do not overlap.
void GramLower(const double* a, int n, int d, double* g, GramIsa isa = GramIsa::kBest);
void GramLower(const float* a, int n, int d, float* g, GramIsa isa = GramIsa::kBest);

// Computes the lower triangle of g = a^T a for bfloat16 values stored two
// rows to a 32-bit word, as AVX512_BF16's VDPBF16PS reads them:
//   a: [pairs, ld] words, ld = GramStride(d); word j of pair row p holds the
//      bfloat16 bits of a[2p][j] in its low half and of a[2p + 1][j] in its
//      high half (zero for a missing last row); words d..ld-1 zero.
//   g: float, GramLower's layout; g[i * ld + j] for j <= i < d holds, over
//      the pair rows in ascending p, acc = fma(a[2p+1][i], a[2p+1][j], acc)
//      then acc = fma(a[2p][i], a[2p][j], acc): products of bfloat16 values
//      are exact in float, so this is VDPBF16PS's result and that of plain
//      float FMAs alike. Other entries are unspecified.
// Thread-safe. REQUIRES: pairs >= 0, d >= 0; every value is zero or has a
// magnitude in [2^-40, 2^40]. (Every partial sum is then a multiple of
// 2^-94: never subnormal, so VDPBF16PS's flushing of subnormal inputs and
// results cannot apply, and all paths agree bit for bit.) The floating-point
// rounding mode is the default, round to nearest even: VDPBF16PS ignores
// the mode, the other paths follow it.
void GramLowerBf16(const uint32_t* a, int pairs, int d, float* g, GramIsa isa = GramIsa::kBest);

// True when GramLowerBf16 with kBest uses VDPBF16PS: Avx512Enabled(), the
// CPU has AVX512_BF16, and a check at first use found the instruction to
// round exactly as the fused multiply-adds above (in the default rounding
// mode, as GramLowerBf16 requires). Thread-safe.
bool NativeBf16GramEnabled();

// Computes the lower triangle of a^T b, as GramLower does that of a^T a
// (GramLower(a) is CrossLower(a, a)): g[i * ld + j] for j <= i < d holds
// sum_t a[t][i] * b[t][j] in ascending t; a and b have GramLower's layout.
// Thread-safe. REQUIRES: n >= 0, d >= 0, g overlaps neither a nor b.
void CrossLower(const double* a, const double* b, int n, int d, double* g, GramIsa isa = GramIsa::kBest);
void CrossLower(const float* a, const float* b, int n, int d, float* g, GramIsa isa = GramIsa::kBest);

// Computes y = s x for a symmetric d x d matrix s and m vectors x.
//   s: row-major [d, ld], ld = GramStride(d), the full symmetric matrix; its
//      padding columns are read but reach only the
//      unspecified entries of y.
//   x: column-major [d, m] with column stride ld: x(t, i) = x[i * ld + t].
//   y: same layout as x; y[i * ld + j] for j < d holds
//      sum_t x(t, i) * s[t][j], with fused multiply-adds in ascending t, the
//      same on every CPU. Entries j >= d are unspecified.
// Thread-safe. REQUIRES: d >= 0, m >= 0, y overlaps neither s nor x.
void SymmetricTimes(const double* s, int d, const double* x, int m, double* y, GramIsa isa = GramIsa::kBest);
void SymmetricTimes(const float* s, int d, const float* x, int m, float* y, GramIsa isa = GramIsa::kBest);

// One sweep of right-looking modified Gram-Schmidt over the m columns of x:
// column i is removed from every later column, then normalized.
//   x: column-major [d, m], column stride ld: x(t, i) = x[i * ld + t].
// Returns false, leaving x partly done, as soon as a column keeps no more
// than 1e-3 of the norm it had before the sweep (nearly dependent on the
// columns before it). Every dot product sums in one fixed order (16 lanes
// t mod 16, an 8-element tail into lanes 0..7, a fixed pairwise reduction,
// then the remaining elements), so results are bit-identical on every path.
// Thread-safe. REQUIRES: d >= 0, m >= 0, ld >= d.
bool GramSchmidtSweep(float* x, int d, int m, int ld, GramIsa isa = GramIsa::kBest);

}  // namespace internal
}  // namespace kvrelay

#endif  // KVRELAY_CORE_INTERNAL_GRAM_H_
