// The Walsh-Hadamard butterflies on 8-float AVX vectors, shared by the
// rotations of core/quant.cc and core/lloyd.cc (internal to kvrelay_core).
//
// The transform of n = 8 * kVecs floats held in kVecs vectors (element i in
// lane i % 8 of vector i / 8) runs the stages h = 1, 2, 4, ..., n/2 in that
// order, and every butterfly of a stage makes a + b and a - b of the same
// two values as the scalar loop
//   for (h = 1; h < n; h *= 2) for each pair (j, j + h): x[j] = a + b, x[j + h] = a - b;
// does, so its results are bit-identical to that loop's.
#ifndef KVRELAY_CORE_INTERNAL_HADAMARD_AVX_H_
#define KVRELAY_CORE_INTERNAL_HADAMARD_AVX_H_

#if defined(__AVX__)
#include <immintrin.h>

namespace kvrelay {
namespace internal {

// Stages h = 1, 2, 4 inside one vector. Lane j of the lower half of a pair
// gets x_{j+h} + x_j (= x_j + x_{j+h}), lane j+h gets x_j + (-x_{j+h}) (=
// x_j - x_{j+h}): the negation is exact, and so is the commuted sum.
inline __m256 HadamardInVector(__m256 v) {
  const __m256 odd = _mm256_castsi256_ps(_mm256_setr_epi32(0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN));
  const __m256 pairs = _mm256_castsi256_ps(_mm256_setr_epi32(0, 0, INT32_MIN, INT32_MIN, 0, 0, INT32_MIN, INT32_MIN));
  const __m256 upper = _mm256_castsi256_ps(_mm256_setr_epi32(0, 0, 0, 0, INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN));
  v = _mm256_add_ps(_mm256_permute_ps(v, 0xB1), _mm256_xor_ps(v, odd));  // swap neighbours
  v = _mm256_add_ps(_mm256_permute_ps(v, 0x4E), _mm256_xor_ps(v, pairs));  // swap pairs
  return _mm256_add_ps(_mm256_permute2f128_ps(v, v, 0x01), _mm256_xor_ps(v, upper));  // swap halves
}

// Stages h = 8 * kH, 16 * kH, ... between whole vectors j and j + kH.
template <int kVecs, int kH>
inline void HadamardVectorStages(__m256* v) {
  if constexpr (kH < kVecs) {
#pragma GCC unroll 32
    for (int p = 0; p < kVecs / 2; ++p) {
      const int j = (p / kH) * 2 * kH + p % kH;
      const __m256 a = v[j], b = v[j + kH];
      v[j] = _mm256_add_ps(a, b);
      v[j + kH] = _mm256_sub_ps(a, b);
    }
    HadamardVectorStages<kVecs, 2 * kH>(v);
  }
}

// The unnormalized transform of the 8 * kVecs floats in v, in place.
template <int kVecs>
inline void HadamardInRegisters(__m256* v) {
#pragma GCC unroll 32
  for (int q = 0; q < kVecs; ++q) v[q] = HadamardInVector(v[q]);
  HadamardVectorStages<kVecs, 1>(v);
}

// The butterfly stages of spans 64, 128, ... below `h_end` of an
// unnormalised Hadamard transform of the `n` floats at `work` (n a
// multiple of 2 * h_end), whose 64-float blocks are already transformed.
inline void HadamardStagesFrom64(float* work, int n, int h_end) {
  for (int h = 64; h < h_end; h *= 2) {
    for (int i = 0; i < n; i += 2 * h) {
      for (int j = i; j < i + h; j += 8) {
        const __m256 a = _mm256_loadu_ps(work + j), b = _mm256_loadu_ps(work + j + h);
        _mm256_storeu_ps(work + j, _mm256_add_ps(a, b));
        _mm256_storeu_ps(work + j + h, _mm256_sub_ps(a, b));
      }
    }
  }
}

}  // namespace internal
}  // namespace kvrelay

#endif  // defined(__AVX__)
#endif  // KVRELAY_CORE_INTERNAL_HADAMARD_AVX_H_
