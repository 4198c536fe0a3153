// Built with -mavx512f (see core/CMakeLists.txt); entered only after a
// runtime check of the CPU (gram.cc).
#include "core/internal/gram_kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>

// GCC 12 reports its own _mm512_castps512_ps256 (an extract from an
// undefined register) as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

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

// EmulatedPairs' integer helpers for GramLowerBf16.
struct Avx512Words : Avx512<float> {
  static __m512i LoadWords(const uint32_t* p) { return _mm512_loadu_si512(p); }
  static __m512i BcastWord(const uint32_t* p) { return _mm512_set1_epi32(static_cast<int>(*p)); }
  static __m512 SplitOdd(__m512i w) {
    return _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  static __m512 SplitEven(__m512i w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); }
};

// The AVX2 order (gram.cc): lanes 0..7 of the 16-lane sum are its first
// accumulator, lanes 8..15 its second.
struct Avx512SweepOps {
  static float Dot(const float* a, const float* b, int n) {
    __m512 acc = _mm512_setzero_ps();
    int t = 0;
    for (; t + 16 <= n; t += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + t), _mm512_loadu_ps(b + t), acc);
    if (t + 8 <= n) {
      const __mmask16 low = 0xff;
      acc = _mm512_mask3_fmadd_ps(_mm512_maskz_loadu_ps(low, a + t), _mm512_maskz_loadu_ps(low, b + t), acc, low);
      t += 8;
    }
    const __m512 sum = _mm512_add_ps(acc, _mm512_shuffle_f32x4(acc, acc, 0x4e));  // lane l + lane l+8
    const __m256 s = _mm512_castps512_ps256(sum);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    float r = _mm_cvtss_f32(h);
    for (; t < n; ++t) r = Fma(a[t], b[t], r);
    return r;
  }
  static void SubtractScaled(float r, const float* a, float* b, int n) {
    const __m512 rv = _mm512_set1_ps(r);
    int t = 0;
    for (; t + 16 <= n; t += 16) {
      _mm512_storeu_ps(b + t, _mm512_fnmadd_ps(rv, _mm512_loadu_ps(a + t), _mm512_loadu_ps(b + t)));
    }
    if (t < n) {
      const __mmask16 k = static_cast<__mmask16>((1u << (n - t)) - 1);
      _mm512_mask_storeu_ps(b + t, k, _mm512_fnmadd_ps(rv, _mm512_maskz_loadu_ps(k, a + t), _mm512_maskz_loadu_ps(k, b + t)));
    }
  }
  static void Scale(float f, float* a, int n) {
    const __m512 fv = _mm512_set1_ps(f);
    int t = 0;
    for (; t + 16 <= n; t += 16) _mm512_storeu_ps(a + t, _mm512_mul_ps(fv, _mm512_loadu_ps(a + t)));
    if (t < n) {
      const __mmask16 k = static_cast<__mmask16>((1u << (n - t)) - 1);
      _mm512_mask_storeu_ps(a + t, k, _mm512_mul_ps(fv, _mm512_maskz_loadu_ps(k, a + t)));
    }
  }
};

}  // namespace

bool GramSchmidtSweepAvx512(float* x, int d, int m, int ld, float* scratch) {
  return GramSchmidtSweepImpl<Avx512SweepOps>(x, d, m, ld, scratch);
}

void GramAvx512(const double* a, const double* b, int n, int d, double* g) {
  GramTiled<Avx512<double>, 8, 3>(a, b, n, d, g);
}
void GramAvx512(const float* a, const float* b, int n, int d, float* g) {
  GramTiled<Avx512<float>, 8, 2>(a, b, n, d, g);
}
void GramBf16Avx512(const uint32_t* a, int pairs, int d, float* g) {
  PairGramTiled<EmulatedPairs<Avx512Words>, 8, 2>(a, pairs, d, g);
}
void SymmetricTimesAvx512(const double* s, int d, const double* x, int m, double* y) {
  SymmetricTimesTiled<Avx512<double>, 4, 3>(s, d, x, m, y);
}
void SymmetricTimesAvx512(const float* s, int d, const float* x, int m, float* y) {
  SymmetricTimesTiled<Avx512<float>, 6, 3>(s, d, x, m, y);
}

}  // namespace internal
}  // namespace kvrelay
#endif  // __AVX512F__
