#include "core/internal/gram.h"

#include <cstring>
#include <vector>

#include "core/internal/cpu.h"
#include "core/internal/gram_kernels.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVRELAY_GRAM_AVX2 1
#endif

namespace kvrelay {
namespace internal {

// Defined in gram_avx512.cc; called only when the CPU has AVX-512F.
void GramAvx512(const double* a, const double* b, int n, int d, double* g);
void GramAvx512(const float* a, const float* b, int n, int d, float* g);
void SymmetricTimesAvx512(const double* s, int d, const double* x, int m, double* y);
void SymmetricTimesAvx512(const float* s, int d, const float* x, int m, float* y);
bool GramSchmidtSweepAvx512(float* x, int d, int m, int ld, float* scratch);
void GramBf16Avx512(const uint32_t* a, int pairs, int d, float* g);
// Defined in gram_avx512bf16.cc; called only when the CPU has AVX512_BF16.
void GramBf16Native(const uint32_t* a, int pairs, int d, float* g);

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

struct Avx2SweepOps {
  static float Dot(const float* a, const float* b, int n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int t = 0;
    for (; t + 16 <= n; t += 16) {
      s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + t), _mm256_loadu_ps(b + t), s0);
      s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + t + 8), _mm256_loadu_ps(b + t + 8), s1);
    }
    if (t + 8 <= n) {
      s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + t), _mm256_loadu_ps(b + t), s0);
      t += 8;
    }
    float r = ReduceEight8(_mm256_add_ps(s0, s1));
    for (; t < n; ++t) r = Fma(a[t], b[t], r);
    return r;
  }
  static void SubtractScaled(float r, const float* a, float* b, int n) {
    const __m256 rv = _mm256_set1_ps(r);
    int t = 0;
    for (; t + 8 <= n; t += 8) {
      _mm256_storeu_ps(b + t, _mm256_fnmadd_ps(rv, _mm256_loadu_ps(a + t), _mm256_loadu_ps(b + t)));
    }
    for (; t < n; ++t) b[t] = Fma(-r, a[t], b[t]);
  }
  static void Scale(float f, float* a, int n) {
    const __m256 fv = _mm256_set1_ps(f);
    int t = 0;
    for (; t + 8 <= n; t += 8) _mm256_storeu_ps(a + t, _mm256_mul_ps(fv, _mm256_loadu_ps(a + t)));
    for (; t < n; ++t) a[t] *= f;
  }
  // ReduceEight on the lanes of s.
  static float ReduceEight8(__m256 s) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
  }
};

#endif

template <typename T>
void Dispatch(const T* a, const T* b, int n, int d, T* g, GramIsa isa) {
#if defined(KVRELAY_GRAM_AVX2)
#if defined(KVRELAY_AVX512_KERNELS)
  if (isa != GramIsa::kAvx2 && isa != GramIsa::kScalar && Avx512Enabled()) return GramAvx512(a, b, n, d, g);
#endif
  if (isa != GramIsa::kScalar) return GramTiled<Avx2<T>, 4, 3>(a, b, n, d, g);
#endif
  GramRowsByEntry(GramOperands(a, b, n, d, g), 0, d);
}

template <typename T>
void SymmetricDispatch(const T* s, int d, const T* x, int m, T* y, GramIsa isa) {
#if defined(KVRELAY_GRAM_AVX2)
#if defined(KVRELAY_AVX512_KERNELS)
  if (isa != GramIsa::kAvx2 && isa != GramIsa::kScalar && Avx512Enabled()) return SymmetricTimesAvx512(s, d, x, m, y);
#endif
  if (isa != GramIsa::kScalar) return SymmetricTimesTiled<Avx2<T>, 4, 3>(s, d, x, m, y);
#endif
  Entries(SymmetricOperands(s, d, x, y), 0, m, 0, d);
}

#if defined(KVRELAY_GRAM_AVX2) && defined(KVRELAY_AVX512_KERNELS) && defined(KVRELAY_AVX512BF16_KERNEL)
// VDPBF16PS against the AVX-512F emulation on pair rows whose values span
// the whole range GramLowerBf16 allows, with cancelling signs.
bool NativeMatchesEmulation() {
  constexpr int kPairs = 37, kD = 48;
  const int ld = GramStride(kD);
  std::vector<uint32_t> a(static_cast<size_t>(kPairs) * ld, 0);
  uint64_t state = 0x2545f4914f6cdd1dull;
  auto bf16 = [&state] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const uint32_t bits = static_cast<uint32_t>(state >> 33);
    const uint32_t exponent = 127 - 40 + bits % 81;  // 2^-40 .. 2^40
    return static_cast<uint16_t>(((bits >> 8) & 0x8000u) | (exponent << 7) | ((bits >> 12) & 0x7fu));
  };
  for (int p = 0; p < kPairs; ++p) {
    for (int j = 0; j < kD; ++j) a[static_cast<size_t>(p) * ld + j] = bf16() | uint32_t{bf16()} << 16;
  }
  std::vector<float> native(static_cast<size_t>(ld) * ld, 0), emulated(native);
  GramBf16Native(a.data(), kPairs, kD, native.data());
  GramBf16Avx512(a.data(), kPairs, kD, emulated.data());
  for (int i = 0; i < kD; ++i) {
    const size_t row = static_cast<size_t>(i) * ld;
    if (std::memcmp(&native[row], &emulated[row], sizeof(float) * (i + 1)) != 0) return false;
  }
  return true;
}
#endif

}  // namespace

bool NativeBf16GramEnabled() {
#if defined(KVRELAY_GRAM_AVX2) && defined(KVRELAY_AVX512_KERNELS) && defined(KVRELAY_AVX512BF16_KERNEL)
  static const bool use = Avx512Enabled() && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512bf16") && NativeMatchesEmulation();
  return use;
#else
  return false;
#endif
}

void GramLowerBf16(const uint32_t* a, int pairs, int d, float* g, GramIsa isa) {
#if defined(KVRELAY_GRAM_AVX2)
#if defined(KVRELAY_AVX512_KERNELS)
#if defined(KVRELAY_AVX512BF16_KERNEL)
  if (isa == GramIsa::kBest && NativeBf16GramEnabled()) return GramBf16Native(a, pairs, d, g);
#endif
  if (isa != GramIsa::kAvx2 && isa != GramIsa::kScalar && Avx512Enabled()) return GramBf16Avx512(a, pairs, d, g);
#endif
  if (isa != GramIsa::kScalar) {
    // Splitting each word in the kernel costs AVX2 more than it saves: the
    // float Gram over the rows in the order odd, even (2p+1, 2p, ...) does
    // the same fused multiply-adds in the same order.
    thread_local std::vector<float> rows;
    const int ld = GramStride(d);
    rows.resize(static_cast<size_t>(2 * pairs) * ld);
    for (int p = 0; p < pairs; ++p) {
      const uint32_t* in = a + static_cast<size_t>(p) * ld;
      float* odd = rows.data() + static_cast<size_t>(2 * p) * ld;
      float* even = odd + ld;
      for (int j = 0; j < ld; ++j) {
        odd[j] = OddValue(in[j]);
        even[j] = EvenValue(in[j]);
      }
    }
    GramTiled<Avx2<float>, 4, 3>(rows.data(), rows.data(), 2 * pairs, d, g);
    ReleaseIfLarge(&rows);
    return;
  }
#endif
  PairRowsByEntry(PairOperands{a, GramStride(d), pairs, g}, 0, d);
}

bool GramSchmidtSweep(float* x, int d, int m, int ld, GramIsa isa) {
  constexpr int kOnStack = 64;
  float on_stack[kOnStack];
  std::vector<float> on_heap;
  float* scratch = on_stack;
  if (m > kOnStack) {
    on_heap.resize(m);
    scratch = on_heap.data();
  }
#if defined(KVRELAY_GRAM_AVX2)
#if defined(KVRELAY_AVX512_KERNELS)
  if (isa != GramIsa::kAvx2 && isa != GramIsa::kScalar && Avx512Enabled()) {
    return GramSchmidtSweepAvx512(x, d, m, ld, scratch);
  }
#endif
  if (isa != GramIsa::kScalar) return GramSchmidtSweepImpl<Avx2SweepOps>(x, d, m, ld, scratch);
#endif
  return GramSchmidtSweepImpl<ScalarSweepOps>(x, d, m, ld, scratch);
}

void SymmetricTimes(const double* s, int d, const double* x, int m, double* y, GramIsa isa) {
  SymmetricDispatch(s, d, x, m, y, isa);
}
void SymmetricTimes(const float* s, int d, const float* x, int m, float* y, GramIsa isa) {
  SymmetricDispatch(s, d, x, m, y, isa);
}

void GramLower(const double* a, int n, int d, double* g, GramIsa isa) { Dispatch(a, a, n, d, g, isa); }
void GramLower(const float* a, int n, int d, float* g, GramIsa isa) { Dispatch(a, a, n, d, g, isa); }
void CrossLower(const double* a, const double* b, int n, int d, double* g, GramIsa isa) {
  Dispatch(a, b, n, d, g, isa);
}
void CrossLower(const float* a, const float* b, int n, int d, float* g, GramIsa isa) {
  Dispatch(a, b, n, d, g, isa);
}

}  // namespace internal
}  // namespace kvrelay
