#include "core/crc32c.h"

#include <array>
#include <cstring>

#if defined(__SSE4_2__)
#include <nmmintrin.h>
#endif

namespace kvrelay {
#if !defined(__SSE4_2__)
namespace {

constexpr uint32_t kPoly = 0x82f63b78u;  // reflected Castagnoli polynomial

std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    t[i] = c;
  }
  return t;
}

}  // namespace
#endif

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
#if defined(__SSE4_2__)
  uint64_t c64 = c;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c64 = _mm_crc32_u64(c64, v);
  }
  c = static_cast<uint32_t>(c64);
  for (; n > 0; --n, ++p) c = _mm_crc32_u8(c, *p);
#else
  static const std::array<uint32_t, 256> table = MakeTable();
  for (; n > 0; --n, ++p) c = table[(c ^ *p) & 0xffu] ^ (c >> 8);
#endif
  return ~c;
}

namespace {

// GF(2) 32x32 matrices as 32 column vectors (zlib's crc32_combine method).
uint32_t MatrixTimes(const uint32_t* mat, uint32_t vec) {
  uint32_t sum = 0;
  for (; vec; vec >>= 1, ++mat) {
    if (vec & 1) sum ^= *mat;
  }
  return sum;
}

void MatrixSquare(uint32_t* square, const uint32_t* mat) {
  for (int n = 0; n < 32; ++n) square[n] = MatrixTimes(mat, mat[n]);
}

}  // namespace

uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  if (len_b == 0) return crc_a;
  uint32_t even[32], odd[32];
  odd[0] = 0x82f63b78u;  // the operator for one zero bit
  for (int n = 1; n < 32; ++n) odd[n] = 1u << (n - 1);
  MatrixSquare(even, odd);  // two zero bits
  MatrixSquare(odd, even);  // four zero bits
  // Apply len_b zero bytes to crc_a, one bit of len_b at a time.
  for (;;) {
    MatrixSquare(even, odd);
    if (len_b & 1) crc_a = MatrixTimes(even, crc_a);
    len_b >>= 1;
    if (len_b == 0) break;
    MatrixSquare(odd, even);
    if (len_b & 1) crc_a = MatrixTimes(odd, crc_a);
    len_b >>= 1;
    if (len_b == 0) break;
  }
  return crc_a ^ crc_b;
}

}  // namespace kvrelay
