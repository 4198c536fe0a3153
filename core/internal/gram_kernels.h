// Register-tiled Gram kernels, included by gram.cc (AVX2 baseline) and by
// gram_avx512.cc (compiled with -mavx512f). Everything has internal linkage,
// so each translation unit keeps the copy built for its own instruction set.
#ifndef KVRELAY_CORE_INTERNAL_GRAM_KERNELS_H_
#define KVRELAY_CORE_INTERNAL_GRAM_KERNELS_H_

#include <cmath>

#include "core/internal/gram.h"

namespace kvrelay {
namespace internal {
namespace {  // NOLINT(build/namespaces): one copy per instruction set

// g[i][j] for j in [j0, j0 + cols) of rows [i0, i0 + rows), one entry at a time.
template <typename T>
void GramEntries(const T* a, int n, int ld, int i0, int rows, int j0, int cols, T* g) {
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      T acc = 0;
      const T* p = a;
      for (int t = 0; t < n; ++t, p += ld) acc = std::fma(p[i0 + r], p[j0 + c], acc);
      g[(i0 + r) * ld + j0 + c] = acc;
    }
  }
}

// kRows x kVecs vector accumulators over all t; every lane is one entry of
// g summed in t order, as in GramEntries. Loads stay inside the padded row
// because ld is a multiple of every vector width.
template <typename Isa, int kRows, int kVecs, typename T>
inline void Tile(const T* a, int n, int ld, int i0, int j0, T* g) {
  typename Isa::V acc[kRows][kVecs];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kVecs; ++c) acc[r][c] = Isa::Zero();
  const T* p = a;
  for (int t = 0; t < n; ++t, p += ld) {
    typename Isa::V b[kVecs];
    for (int c = 0; c < kVecs; ++c) b[c] = Isa::Load(p + j0 + c * Isa::kWidth);
    for (int r = 0; r < kRows; ++r) {
      const typename Isa::V x = Isa::Bcast(p + i0 + r);
      for (int c = 0; c < kVecs; ++c) acc[r][c] = Isa::Fma(x, b[c], acc[r][c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kVecs; ++c) Isa::Store(g + (i0 + r) * ld + j0 + c * Isa::kWidth, acc[r][c]);
}

// The lower triangle by blocks of kRows rows: each block covers columns
// [0, i0 + kRows) with tiles of kVecs vectors, the last one narrower if
// that is enough.
template <typename Isa, int kRows, int kVecs, typename T>
inline void GramTiled(const T* a, int n, int d, T* g) {
  static_assert(kVecs >= 1 && kVecs <= 3, "tiles of 1 to 3 vectors");
  const int ld = GramStride(d);
  constexpr int kW = Isa::kWidth;
  int i0 = 0;
  for (; i0 + kRows <= d; i0 += kRows) {
    const int end = i0 + kRows;
    for (int j0 = 0; j0 < end; j0 += kVecs * kW) {
      const int vecs = (end - j0 + kW - 1) / kW;
      if (vecs >= kVecs) {
        Tile<Isa, kRows, kVecs>(a, n, ld, i0, j0, g);
      } else if (vecs == 2) {
        Tile<Isa, kRows, 2>(a, n, ld, i0, j0, g);
      } else {
        Tile<Isa, kRows, 1>(a, n, ld, i0, j0, g);
      }
    }
  }
  for (int i = i0; i < d; ++i) GramEntries(a, n, ld, i, 1, 0, i + 1, g);
}

}  // namespace
}  // namespace internal
}  // namespace kvrelay

#endif  // KVRELAY_CORE_INTERNAL_GRAM_KERNELS_H_
