#include "core/internal/gram.h"

#include <cstdlib>
#include <cstring>

#include "core/internal/gram_kernels.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVRELAY_GRAM_AVX2 1
#endif

namespace kvrelay {
namespace internal {

// Defined in gram_avx512.cc; called only when the CPU has AVX-512F.
void GramAvx512(const double* a, int n, int d, double* g);
void GramAvx512(const float* a, int n, int d, float* g);
void SymmetricTimesAvx512(const double* s, int d, const double* x, int m, double* y);
void SymmetricTimesAvx512(const float* s, int d, const float* x, int m, float* y);

namespace {

#if defined(KVRELAY_GRAM_AVX2)
template <typename T> struct Avx2;
template <> struct Avx2<double> {
  using V = __m256d;
  static constexpr int kWidth = 4;
  static V Zero() { return _mm256_setzero_pd(); }
  static V Load(const double* p) { return _mm256_loadu_pd(p); }
  static V Bcast(const double* p) { return _mm256_broadcast_sd(p); }
  static V Fma(V x, V y, V acc) { return _mm256_fmadd_pd(x, y, acc); }
  static void Store(double* p, V v) { _mm256_storeu_pd(p, v); }
};
template <> struct Avx2<float> {
  using V = __m256;
  static constexpr int kWidth = 8;
  static V Zero() { return _mm256_setzero_ps(); }
  static V Load(const float* p) { return _mm256_loadu_ps(p); }
  static V Bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static V Fma(V x, V y, V acc) { return _mm256_fmadd_ps(x, y, acc); }
  static void Store(float* p, V v) { _mm256_storeu_ps(p, v); }
};

bool UseAvx512() {
  static const bool use = [] {
    const char* off = std::getenv("KVRELAY_DISABLE_AVX512");
    if (off != nullptr && *off != '\0' && std::strcmp(off, "0") != 0) return false;
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return use;
}
#endif

template <typename T>
void Dispatch(const T* a, int n, int d, T* g, GramIsa isa) {
#if defined(KVRELAY_GRAM_AVX2)
  if (isa == GramIsa::kBest && UseAvx512()) return GramAvx512(a, n, d, g);
  if (isa != GramIsa::kScalar) return GramTiled<Avx2<T>, 4, 3>(a, n, d, g);
#endif
  GramRowsByEntry(GramOperands(a, n, d, g), 0, d);
}

template <typename T>
void SymmetricDispatch(const T* s, int d, const T* x, int m, T* y, GramIsa isa) {
#if defined(KVRELAY_GRAM_AVX2)
  if (isa == GramIsa::kBest && UseAvx512()) return SymmetricTimesAvx512(s, d, x, m, y);
  if (isa != GramIsa::kScalar) return SymmetricTimesTiled<Avx2<T>, 4, 3>(s, d, x, m, y);
#endif
  Entries(SymmetricOperands(s, d, x, y), 0, m, 0, d);
}

}  // namespace

void SymmetricTimes(const double* s, int d, const double* x, int m, double* y, GramIsa isa) {
  SymmetricDispatch(s, d, x, m, y, isa);
}
void SymmetricTimes(const float* s, int d, const float* x, int m, float* y, GramIsa isa) {
  SymmetricDispatch(s, d, x, m, y, isa);
}

void GramLower(const double* a, int n, int d, double* g, GramIsa isa) { Dispatch(a, n, d, g, isa); }
void GramLower(const float* a, int n, int d, float* g, GramIsa isa) { Dispatch(a, n, d, g, isa); }

}  // namespace internal
}  // namespace kvrelay
