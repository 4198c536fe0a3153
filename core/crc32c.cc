#include "core/crc32c.h"

#include <array>
#include <cstring>

#include "core/internal/cpu.h"
#include "core/internal/crc32c_fold.h"

#if defined(__SSE4_2__)
#include <nmmintrin.h>
#endif

namespace kvrelay {
namespace {

constexpr uint32_t kPoly = 0x82f63b78u;  // reflected Castagnoli polynomial

// a * b mod P over GF(2), in the reflected bit order (bit 31 is x^0).
uint32_t MultModP(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

// kX2n[k] = x^(2^k) mod P.
struct X2nTable {
  std::array<uint32_t, 64> v;
  X2nTable() {
    uint32_t p = 1u << 30;  // x^1
    for (auto& e : v) {
      e = p;
      p = MultModP(p, p);
    }
  }
};

// x^(8 n) mod P: the operator that appends n zero bytes to a CRC state.
uint32_t X8nModP(uint64_t n) {
  static const X2nTable table;
  uint32_t p = 1u << 31;  // x^0
  for (int k = 3; n; n >>= 1, ++k) {
    if (n & 1) p = MultModP(table.v[k & 63], p);
  }
  return p;
}

#if defined(__SSE4_2__)
// Three independent CRC streams over consecutive blocks of Block bytes hide
// the crc32 instruction's latency; the streams are joined by shifting a state
// over Block zero bytes, which is linear, so four byte tables do it. Two block
// sizes: large ones join rarely, small ones keep 3 KiB..24 KiB buffers (gRPC
// slices, cache-sized copy blocks) off the one-stream loop.
template <size_t Block>
struct ShiftTables {
  uint32_t t[4][256];
  ShiftTables() {
    const uint32_t op = X8nModP(Block);
    for (int k = 0; k < 4; ++k) {
      for (uint32_t b = 0; b < 256; ++b) t[k][b] = MultModP(op, b << (8 * k));
    }
  }
  uint32_t Shift(uint32_t c) const {
    return t[0][c & 0xff] ^ t[1][(c >> 8) & 0xff] ^ t[2][(c >> 16) & 0xff] ^ t[3][c >> 24];
  }
};

inline uint64_t Load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// Consumes whole triples of Block-byte blocks from (*p, *n) into *c64.
template <size_t Block>
void ThreeStreams(uint64_t* c64, const uint8_t** p, size_t* n) {
  if (*n < 3 * Block) return;
  static const ShiftTables<Block> shift;
  uint64_t c0 = *c64;
  const uint8_t* q = *p;
  size_t left = *n;
  for (; left >= 3 * Block; left -= 3 * Block, q += 3 * Block) {
    uint64_t c1 = 0, c2 = 0;
    for (size_t i = 0; i < Block; i += 8) {
      c0 = _mm_crc32_u64(c0, Load64(q + i));
      c1 = _mm_crc32_u64(c1, Load64(q + Block + i));
      c2 = _mm_crc32_u64(c2, Load64(q + 2 * Block + i));
    }
    const uint32_t joined = shift.Shift(static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1);
    c0 = shift.Shift(joined) ^ static_cast<uint32_t>(c2);
  }
  *c64 = c0;
  *p = q;
  *n = left;
}
#else
std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    t[i] = c;
  }
  return t;
}
#endif

// The raw state extended with [p, p + n), without the folding path.
uint32_t ExtendState(uint32_t c, const uint8_t* p, size_t n) {
#if defined(__SSE4_2__)
  uint64_t c64 = c;
  ThreeStreams<8192>(&c64, &p, &n);
  ThreeStreams<1024>(&c64, &p, &n);
  for (; n >= 8; n -= 8, p += 8) c64 = _mm_crc32_u64(c64, Load64(p));
  c = static_cast<uint32_t>(c64);
  for (; n > 0; --n, ++p) c = _mm_crc32_u8(c, *p);
#else
  static const std::array<uint32_t, 256> table = MakeTable();
  for (; n > 0; --n, ++p) c = table[(c ^ *p) & 0xffu] ^ (c >> 8);
#endif
  return c;
}

#if defined(KVRELAY_AVX512_KERNELS) && defined(__SSE4_2__)
// x^k mod P, for k >= 1.
uint32_t XPowModP(uint64_t k) { return (k & 7) == 0 ? X8nModP(k >> 3) : MultModP(XPowModP(k - 1), 1u << 30); }

internal::Crc32cFoldKey FoldKey(uint64_t bits) {
  return {uint64_t{XPowModP(bits + 63)} << 32, uint64_t{XPowModP(bits - 1)} << 32};
}
#endif

}  // namespace

namespace internal {

uint32_t Crc32cExtendPortable(uint32_t crc, const void* data, size_t n) {
  return ~ExtendState(~crc, static_cast<const uint8_t*>(data), n);
}

}  // namespace internal

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
#if defined(KVRELAY_AVX512_KERNELS) && defined(__SSE4_2__)
  if (n >= internal::kCrc32cFoldMinBytes && internal::Avx512ClmulEnabled()) {
    static const internal::Crc32cFoldKeys keys{FoldKey(2048), FoldKey(512), FoldKey(384), FoldKey(256), FoldKey(128)};
    c = internal::Crc32cFoldAvx512(c, &p, &n, keys);
  }
#endif
  return ~ExtendState(c, p, n);
}

uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  if (len_b == 0) return crc_a;
  return MultModP(X8nModP(len_b), crc_a) ^ crc_b;
}

}  // namespace kvrelay
