// TypeScript declarations of crc32c.js: CRC32C (Castagnoli), as relay.proto
// uses it for chunks and trailers.

/** CRC32C of `data`, continuing from `crc` (the CRC32C of the bytes before it; default 0). Unsigned 32-bit. */
export declare function crc32c(data: Uint8Array, crc?: number): number;
/** CRC32C of A||B from crc(A), crc(B) and len(B) (a non-negative safe integer; RangeError otherwise). */
export declare function crc32cCombine(crcA: number, crcB: number, lenB: number): number;
