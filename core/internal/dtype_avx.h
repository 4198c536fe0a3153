// Eight K/V elements at a time in AVX2 registers, converted exactly as
// core/dtype.h's ToFloat and FromFloatSaturating convert them (internal to
// kvrelay_core; lloyd_kernels_test checks the two agree bit for bit).
#ifndef KVRELAY_CORE_INTERNAL_DTYPE_AVX_H_
#define KVRELAY_CORE_INTERNAL_DTYPE_AVX_H_

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>

#include "core/dtype.h"

namespace kvrelay {
namespace internal {

// Elements i..i+7 of a row stored as kDtype, as float32 (exact).
template <DType kDtype>
inline __m256 LoadAsFloat8(const void* src, int i) {
  if constexpr (kDtype == DType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(src) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(src) + i));
    if constexpr (kDtype == DType::kF16) {
      return _mm256_cvtph_ps(h);
    } else {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  }
}

// Stores v as elements i..i+7 of a row of kDtype: clamped to the dtype's
// finite range (F16 and BF16; NaN stays NaN), then rounded to nearest even,
// NaN quieted for BF16.
template <DType kDtype>
inline void StoreSaturating8(__m256 v, void* dst, int i) {
  if constexpr (kDtype == DType::kF32) {
    _mm256_storeu_ps(static_cast<float*>(dst) + i, v);
  } else {
    const __m256 limit = _mm256_set1_ps(kDtype == DType::kF16 ? 65504.0f : 0x1.fep127f);
    // max/min return their second operand when either is NaN.
    v = _mm256_min_ps(limit, _mm256_max_ps(_mm256_xor_ps(limit, _mm256_set1_ps(-0.0f)), v));
    __m128i h;
    if constexpr (kDtype == DType::kF16) {
      h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    } else {
      const __m256i u = _mm256_castps_si256(v);
      const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                             _mm256_set1_epi32(0x7f800000));
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
      const __m256i rounded =
          _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
      const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
      const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
      h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(dst) + i), h);
  }
}

}  // namespace internal
}  // namespace kvrelay

#endif  // defined(__AVX2__) && defined(__F16C__)
#endif  // KVRELAY_CORE_INTERNAL_DTYPE_AVX_H_
