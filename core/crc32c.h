// CRC32C (Castagnoli), as used by kvrelay's chunk and trailer checksums.
// Thread-safe (pure).
#ifndef KVRELAY_CORE_CRC32C_H_
#define KVRELAY_CORE_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace kvrelay {

// Extends `crc` (the CRC32C of some data; 0 for none) with `n` more bytes.
// Crc32c(Crc32c(0, a), b) == Crc32c(0, a + b).
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n);

inline uint32_t Crc32c(const void* data, size_t n) { return Crc32cExtend(0, data, n); }

// The CRC32C of A followed by B, from crc_a = Crc32c(A), crc_b = Crc32c(B)
// and len_b = |B|, without touching the data: O(log len_b).
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

}  // namespace kvrelay

#endif  // KVRELAY_CORE_CRC32C_H_
