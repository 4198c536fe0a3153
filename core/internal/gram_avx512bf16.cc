// Built with -mavx512f -mavx512bf16 (see core/CMakeLists.txt); entered only
// after a runtime check of the CPU and of the instruction's rounding
// (NativeBf16GramEnabled in gram.cc).
#include "core/internal/gram_kernels.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace kvrelay {
namespace internal {
namespace {

// VDPBF16PS: per float lane, acc + odd * odd, then + even * even.
struct Bf16Pairs {
  using V = __m512;
  using P = __m512bh;
  static constexpr int kWidth = 16;
  static V Zero() { return _mm512_setzero_ps(); }
  static void Store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static P LoadPairs(const uint32_t* p) { return reinterpret_cast<P>(_mm512_loadu_si512(p)); }
  static P BcastPair(const uint32_t* p) { return reinterpret_cast<P>(_mm512_set1_epi32(static_cast<int>(*p))); }
  static V Dot(P x, P w, V acc) { return _mm512_dpbf16_ps(acc, x, w); }
};

}  // namespace

void GramBf16Native(const uint32_t* a, int pairs, int d, float* g) {
  PairGramTiled<Bf16Pairs, 8, 2>(a, pairs, d, g);
}

}  // namespace internal
}  // namespace kvrelay
#endif  // __AVX512BF16__
