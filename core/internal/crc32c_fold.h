// CRC32C by carry-less multiplication (internal to kvrelay_core).
//
// The data is read as 128-bit blocks, each a polynomial over GF(2) in the
// CRC's reflected bit order. Four 512-bit accumulators (16 blocks) fold
// forward by 2048 bits per step: a block A becomes A_hi * x^(2048+63) +
// A_lo * x^(2048-1) mod P, which is congruent to A * x^2048 and so leaves
// the CRC unchanged. The accumulators are then folded into one block, and
// the CRC32 instruction reduces that block to the 32-bit state.
#ifndef KVRELAY_CORE_INTERNAL_CRC32C_FOLD_H_
#define KVRELAY_CORE_INTERNAL_CRC32C_FOLD_H_

#include <cstddef>
#include <cstdint>

namespace kvrelay {
namespace internal {

// For a fold over f bits: {x^(f+63) mod P, x^(f-1) mod P}, each the 32-bit
// reflected residue shifted left by 32 (its place in a 64-bit lane).
struct Crc32cFoldKey {
  uint64_t hi_lane_key;  // multiplies the block's first (higher-degree) 64 bits
  uint64_t lo_lane_key;  // multiplies its last 64 bits
};

struct Crc32cFoldKeys {
  Crc32cFoldKey by2048, by512, by384, by256, by128;
};

// The smallest input Crc32cFoldAvx512 takes.
inline constexpr size_t kCrc32cFoldMinBytes = 256;

// Consumes the whole 64-byte blocks of [*p, *p + *n) into `state` (the raw
// CRC register, not inverted) and returns the new state; advances *p and
// *n past them (*n < 64 afterwards). Defined in crc32c_avx512.cc.
// REQUIRES: Avx512ClmulEnabled(), *n >= kCrc32cFoldMinBytes.
uint32_t Crc32cFoldAvx512(uint32_t state, const uint8_t** p, size_t* n, const Crc32cFoldKeys& keys);

// Crc32cExtend without the AVX-512 path (what CPUs without VPCLMULQDQ run),
// so tests can compare the two on one machine.
uint32_t Crc32cExtendPortable(uint32_t crc, const void* data, size_t n);

}  // namespace internal
}  // namespace kvrelay

#endif  // KVRELAY_CORE_INTERNAL_CRC32C_FOLD_H_
