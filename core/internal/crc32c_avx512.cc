// Built with -mavx512f -mvpclmulqdq (see core/CMakeLists.txt); entered only
// after a runtime check of the CPU (crc32c.cc).
#include "core/internal/crc32c_fold.h"

#if defined(__AVX512F__) && defined(__VPCLMULQDQ__)
#include <immintrin.h>

// GCC 12 reports the undefined register its own _mm512_broadcast_i32x4 and
// _mm512_extracti32x4_epi32 start from as uninitialized.
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace kvrelay {
namespace internal {
namespace {

__m128i Key128(const Crc32cFoldKey& k) {
  return _mm_set_epi64x(static_cast<long long>(k.lo_lane_key), static_cast<long long>(k.hi_lane_key));
}

__m512i Key512(const Crc32cFoldKey& k) { return _mm512_broadcast_i32x4(Key128(k)); }

// x * x^f + d, reduced to 128 bits per lane (see crc32c_fold.h).
inline __m512i Fold(__m512i x, __m512i key, __m512i d) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, key, 0x00), _mm512_clmulepi64_epi128(x, key, 0x11), d,
                                   0x96);  // a ^ b ^ c
}

}  // namespace

uint32_t Crc32cFoldAvx512(uint32_t state, const uint8_t** p, size_t* n, const Crc32cFoldKeys& keys) {
  const uint8_t* q = *p;
  size_t left = *n;
  // The state enters as an XOR into the first four bytes.
  __m512i x0 = _mm512_xor_si512(_mm512_loadu_si512(q), _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(state))));
  __m512i x1 = _mm512_loadu_si512(q + 64);
  __m512i x2 = _mm512_loadu_si512(q + 128);
  __m512i x3 = _mm512_loadu_si512(q + 192);
  q += 256;
  left -= 256;
  const __m512i by2048 = Key512(keys.by2048);
  for (; left >= 256; left -= 256, q += 256) {
    x0 = Fold(x0, by2048, _mm512_loadu_si512(q));
    x1 = Fold(x1, by2048, _mm512_loadu_si512(q + 64));
    x2 = Fold(x2, by2048, _mm512_loadu_si512(q + 128));
    x3 = Fold(x3, by2048, _mm512_loadu_si512(q + 192));
  }
  const __m512i by512 = Key512(keys.by512);
  __m512i x = Fold(Fold(Fold(x0, by512, x1), by512, x2), by512, x3);
  for (; left >= 64; left -= 64, q += 64) x = Fold(x, by512, _mm512_loadu_si512(q));
  // Lanes 0..2 fold onto lane 3 (by 384, 256 and 128 bits).
  __m512i lane_keys = _mm512_zextsi128_si512(Key128(keys.by384));  // lane 3's key stays 0
  lane_keys = _mm512_inserti32x4(lane_keys, Key128(keys.by256), 1);
  lane_keys = _mm512_inserti32x4(lane_keys, Key128(keys.by128), 2);
  const __m512i t = Fold(x, lane_keys, _mm512_setzero_si512());
  const __m128i y = _mm_xor_si128(_mm_xor_si128(_mm512_castsi512_si128(t), _mm512_extracti32x4_epi32(t, 1)),
                                  _mm_xor_si128(_mm512_extracti32x4_epi32(t, 2), _mm512_extracti32x4_epi32(x, 3)));
  uint64_t c = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(y)));
  c = _mm_crc32_u64(c, static_cast<uint64_t>(_mm_extract_epi64(y, 1)));
  *p = q;
  *n = left;
  return static_cast<uint32_t>(c);
}

}  // namespace internal
}  // namespace kvrelay
#endif  // __AVX512F__ && __VPCLMULQDQ__
