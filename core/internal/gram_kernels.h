// Register-tiled kernels behind gram.h, included by gram.cc (AVX2 baseline)
// and by gram_avx512.cc (compiled with -mavx512f). Everything has internal
// linkage, so each translation unit keeps the copy built for its own
// instruction set.
#ifndef KVRELAY_CORE_INTERNAL_GRAM_KERNELS_H_
#define KVRELAY_CORE_INTERNAL_GRAM_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "core/internal/gram.h"

namespace kvrelay {
namespace internal {
namespace {  // NOLINT(build/namespaces): one copy per instruction set

// Compiler builtins, not std::fma: an inline library function emitted in the
// AVX-512 translation unit could be the copy the linker keeps for everyone.
inline double Fma(double x, double y, double z) { return __builtin_fma(x, y, z); }
inline float Fma(float x, float y, float z) { return __builtin_fmaf(x, y, z); }

// Both kernels compute out[i][j] = sum_t b[t * bt + i * br] * v[t * lv + j]
// with fused multiply-adds in ascending t: the Gram with b = v = a, and the
// symmetric product with b = x (column i of x is row i of the output) and
// v = the symmetric matrix.
template <typename T>
struct Operands {
  const T* b;
  int bt, br;
  const T* v;
  int lv;
  int n;  // terms t
  T* out;
  int ldo;
};

template <typename T>
void Entries(const Operands<T>& o, int i0, int rows, int j0, int cols) {
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      T acc = 0;
      for (int t = 0; t < o.n; ++t) {
        acc = Fma(o.b[static_cast<size_t>(t) * o.bt + static_cast<size_t>(i0 + r) * o.br],
                       o.v[static_cast<size_t>(t) * o.lv + j0 + c], acc);
      }
      o.out[static_cast<size_t>(i0 + r) * o.ldo + j0 + c] = acc;
    }
  }
}

// kRows x kVecs vector accumulators over all t; every lane is one output
// entry summed in t order, exactly as Entries does. Loads and stores stay
// inside padded rows because lv and ldo are multiples of every vector width.
template <typename Isa, int kRows, int kVecs, typename T>
inline void Tile(const Operands<T>& o, int i0, int j0) {
  typename Isa::V acc[kRows][kVecs];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kVecs; ++c) acc[r][c] = Isa::Zero();
  const T* b = o.b + static_cast<size_t>(i0) * o.br;
  const T* v = o.v + j0;
  for (int t = 0; t < o.n; ++t, b += o.bt, v += o.lv) {
    typename Isa::V w[kVecs];
    for (int c = 0; c < kVecs; ++c) w[c] = Isa::Load(v + c * Isa::kWidth);
    for (int r = 0; r < kRows; ++r) {
      const typename Isa::V x = Isa::Bcast(b + static_cast<size_t>(r) * o.br);
      for (int c = 0; c < kVecs; ++c) acc[r][c] = Isa::Fma(x, w[c], acc[r][c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kVecs; ++c)
      Isa::Store(o.out + static_cast<size_t>(i0 + r) * o.ldo + j0 + c * Isa::kWidth, acc[r][c]);
}

// Output rows [i0, i0 + kRows), columns [0, j_end): tiles of kVecs vectors,
// the last one narrower if that is enough.
template <typename Isa, int kRows, int kVecs, typename Ops>
inline void RowBlock(const Ops& o, int i0, int j_end) {
  static_assert(kVecs >= 1 && kVecs <= 3, "tiles of 1 to 3 vectors");
  constexpr int kW = Isa::kWidth;
  for (int j0 = 0; j0 < j_end; j0 += kVecs * kW) {
    const int vecs = (j_end - j0 + kW - 1) / kW;
    if (vecs >= kVecs) {
      Tile<Isa, kRows, kVecs>(o, i0, j0);
    } else if (vecs == 2) {
      Tile<Isa, kRows, 2>(o, i0, j0);
    } else {
      Tile<Isa, kRows, 1>(o, i0, j0);
    }
  }
}

// CrossLower's operands (GramLower's with b = a): both walked by row t.
template <typename T>
Operands<T> GramOperands(const T* a, const T* b, int n, int d, T* g) {
  const int ld = GramStride(d);
  return Operands<T>{a, ld, 1, b, ld, n, g, ld};
}

// Rows i0.. of the lower triangle one entry at a time (the scalar path, and
// the rows a tiled path leaves over).
template <typename T>
void GramRowsByEntry(const Operands<T>& o, int i0, int d) {
  for (int i = i0; i < d; ++i) Entries(o, i, 1, 0, i + 1);
}

// SymmetricTimes' operands: b = x (column i of x is row i of the output),
// v = the symmetric matrix.
template <typename T>
Operands<T> SymmetricOperands(const T* s, int d, const T* x, T* y) {
  const int ld = GramStride(d);
  return Operands<T>{x, 1, ld, s, ld, d, y, ld};
}

// The lower triangle of a^T b (see CrossLower) by blocks of kRows rows.
template <typename Isa, int kRows, int kVecs, typename T>
inline void GramTiled(const T* a, const T* b, int n, int d, T* g) {
  const Operands<T> o = GramOperands(a, b, n, d, g);
  int i0 = 0;
  for (; i0 + kRows <= d; i0 += kRows) RowBlock<Isa, kRows, kVecs>(o, i0, i0 + kRows);
  GramRowsByEntry(o, i0, d);
}

// y = s x for symmetric s (see SymmetricTimes); output column i is row i of
// `out`. Blocks of kRows columns, then blocks of one.
template <typename Isa, int kRows, int kVecs, typename T>
inline void SymmetricTimesTiled(const T* s, int d, const T* x, int m, T* y) {
  const Operands<T> o = SymmetricOperands(s, d, x, y);
  int i0 = 0;
  for (; i0 + kRows <= m; i0 += kRows) RowBlock<Isa, kRows, kVecs>(o, i0, d);
  for (; i0 < m; ++i0) RowBlock<Isa, 1, kVecs>(o, i0, d);
}

// GramLowerBf16's operands: pair rows of bfloat16 values (see gram.h).
struct PairOperands {
  const uint32_t* a;
  int ld;
  int pairs;
  float* out;
};

// The two float values a pair word holds.
inline float OddValue(uint32_t w) { return __builtin_bit_cast(float, w & 0xffff0000u); }
inline float EvenValue(uint32_t w) { return __builtin_bit_cast(float, w << 16); }

// Output entries one at a time, in GramLowerBf16's order.
inline void PairRowsByEntry(const PairOperands& o, int i0, int d) {
  for (int i = i0; i < d; ++i) {
    for (int j = 0; j <= i; ++j) {
      float acc = 0;
      for (int p = 0; p < o.pairs; ++p) {
        const uint32_t* row = o.a + static_cast<size_t>(p) * o.ld;
        acc = Fma(OddValue(row[i]), OddValue(row[j]), acc);
        acc = Fma(EvenValue(row[i]), EvenValue(row[j]), acc);
      }
      o.out[static_cast<size_t>(i) * o.ld + j] = acc;
    }
  }
}

// Isa's pair operations: P holds kWidth pair words (loaded or broadcast),
// Dot adds both products to acc, the odd row's first.
template <typename Isa, int kRows, int kVecs>
inline void Tile(const PairOperands& o, int i0, int j0) {
  typename Isa::V acc[kRows][kVecs];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kVecs; ++c) acc[r][c] = Isa::Zero();
  const uint32_t* row = o.a;
  for (int p = 0; p < o.pairs; ++p, row += o.ld) {
    typename Isa::P w[kVecs];
    for (int c = 0; c < kVecs; ++c) w[c] = Isa::LoadPairs(row + j0 + c * Isa::kWidth);
    for (int r = 0; r < kRows; ++r) {
      const typename Isa::P x = Isa::BcastPair(row + i0 + r);
      for (int c = 0; c < kVecs; ++c) acc[r][c] = Isa::Dot(x, w[c], acc[r][c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kVecs; ++c)
      Isa::Store(o.out + static_cast<size_t>(i0 + r) * o.ld + j0 + c * Isa::kWidth, acc[r][c]);
}

// Pair operations emulated with float FMAs, for an Isa of float vectors
// that also provides the integer helpers SplitOdd and SplitEven.
template <typename Isa>
struct EmulatedPairs : Isa {
  struct P {
    typename Isa::V odd, even;
  };
  static P LoadPairs(const uint32_t* p) { return Split(Isa::LoadWords(p)); }
  static P BcastPair(const uint32_t* p) { return Split(Isa::BcastWord(p)); }
  static typename Isa::V Dot(const P& x, const P& w, typename Isa::V acc) {
    return Isa::Fma(x.even, w.even, Isa::Fma(x.odd, w.odd, acc));
  }

 private:
  template <typename Words>
  static P Split(Words w) {
    return P{Isa::SplitOdd(w), Isa::SplitEven(w)};
  }
};

template <typename Isa, int kRows, int kVecs>
inline void PairGramTiled(const uint32_t* a, int pairs, int d, float* g) {
  const PairOperands o{a, GramStride(d), pairs, g};
  int i0 = 0;
  for (; i0 + kRows <= d; i0 += kRows) RowBlock<Isa, kRows, kVecs>(o, i0, i0 + kRows);
  PairRowsByEntry(o, i0, d);
}

// The dot product's fixed order (see GramSchmidtSweep) reduced from its
// eight partial sums, as the AVX2 horizontal reduction does it.
inline float ReduceEight(const float* s) {
  const float h0 = s[0] + s[4], h1 = s[1] + s[5], h2 = s[2] + s[6], h3 = s[3] + s[7];
  return (h0 + h2) + (h1 + h3);
}

// Scalar reference of the vector paths' dot product and update.
struct ScalarSweepOps {
  static float Dot(const float* a, const float* b, int n) {
    float lane[16] = {};
    int t = 0;
    for (; t + 16 <= n; t += 16)
      for (int l = 0; l < 16; ++l) lane[l] = Fma(a[t + l], b[t + l], lane[l]);
    if (t + 8 <= n) {
      for (int l = 0; l < 8; ++l) lane[l] = Fma(a[t + l], b[t + l], lane[l]);
      t += 8;
    }
    float s[8];
    for (int l = 0; l < 8; ++l) s[l] = lane[l] + lane[l + 8];
    float r = ReduceEight(s);
    for (; t < n; ++t) r = Fma(a[t], b[t], r);
    return r;
  }
  // b -= r a, one rounding per element.
  static void SubtractScaled(float r, const float* a, float* b, int n) {
    for (int t = 0; t < n; ++t) b[t] = Fma(-r, a[t], b[t]);
  }
  static void Scale(float f, float* a, int n) {
    for (int t = 0; t < n; ++t) a[t] *= f;
  }
};

// before: scratch for m floats (allocated by the caller, outside the
// AVX-512 translation unit).
template <typename Ops>
bool GramSchmidtSweepImpl(float* x, int d, int m, int ld, float* before) {
  for (int j = 0; j < m; ++j) {
    const float* cj = x + static_cast<size_t>(j) * ld;
    before[j] = __builtin_sqrtf(Ops::Dot(cj, cj, d));
  }
  // Column i is removed from the later ones before it is normalized, as
  // ((c_i . c_j) / |c_i|) / |c_i| c_i: the updates then wait for one dot
  // product instead of a square root, a division and a pass over c_i.
  // Dividing by |c_i| twice, not by |c_i|^2 once, keeps columns whose norm
  // is below ~1e-19 from overflowing the factor.
  for (int i = 0; i < m; ++i) {
    float* ci = x + static_cast<size_t>(i) * ld;
    const float after = __builtin_sqrtf(Ops::Dot(ci, ci, d));
    if (!(after > 1e-3f * before[i])) return false;
    const float inv = 1.0f / after;
    for (int j = i + 1; j < m; ++j) {
      float* cj = x + static_cast<size_t>(j) * ld;
      Ops::SubtractScaled(Ops::Dot(ci, cj, d) * inv * inv, ci, cj, d);
    }
    Ops::Scale(inv, ci, d);
  }
  return true;
}

}  // namespace
}  // namespace internal
}  // namespace kvrelay

#endif  // KVRELAY_CORE_INTERNAL_GRAM_KERNELS_H_
