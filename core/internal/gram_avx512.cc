// Built with -mavx512f (see core/CMakeLists.txt); entered only after a
// runtime check of the CPU (gram.cc).
#include "core/internal/gram_kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>

namespace kvrelay {
namespace internal {
namespace {

template <typename T> struct Avx512;
template <> struct Avx512<double> {
  using V = __m512d;
  static constexpr int kWidth = 8;
  static V Zero() { return _mm512_setzero_pd(); }
  static V Load(const double* p) { return _mm512_loadu_pd(p); }
  static V Bcast(const double* p) { return _mm512_set1_pd(*p); }
  static V Fma(V x, V y, V acc) { return _mm512_fmadd_pd(x, y, acc); }
  static void Store(double* p, V v) { _mm512_storeu_pd(p, v); }
};
template <> struct Avx512<float> {
  using V = __m512;
  static constexpr int kWidth = 16;
  static V Zero() { return _mm512_setzero_ps(); }
  static V Load(const float* p) { return _mm512_loadu_ps(p); }
  static V Bcast(const float* p) { return _mm512_set1_ps(*p); }
  static V Fma(V x, V y, V acc) { return _mm512_fmadd_ps(x, y, acc); }
  static void Store(float* p, V v) { _mm512_storeu_ps(p, v); }
};

}  // namespace

void GramAvx512(const double* a, int n, int d, double* g) { GramTiled<Avx512<double>, 8, 3>(a, n, d, g); }
void GramAvx512(const float* a, int n, int d, float* g) { GramTiled<Avx512<float>, 8, 2>(a, n, d, g); }
void SymmetricTimesAvx512(const double* s, int d, const double* x, int m, double* y) {
  SymmetricTimesTiled<Avx512<double>, 4, 3>(s, d, x, m, y);
}
void SymmetricTimesAvx512(const float* s, int d, const float* x, int m, float* y) {
  SymmetricTimesTiled<Avx512<float>, 6, 3>(s, d, x, m, y);
}

}  // namespace internal
}  // namespace kvrelay
#endif  // __AVX512F__
