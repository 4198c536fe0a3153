'use strict';
// CRC32C (Castagnoli), as relay.proto uses it: every Chunk carries the CRC32C
// of its data, and a Trailer the CRC32C of all chunk data of the stream,
// concatenated in stream order.
//
//   crc32c(data[, crc])            extends `crc` (CRC of the preceding bytes) by `data`
//   crc32cCombine(crcA, crcB, lenB) CRC32C of A||B from crc(A), crc(B) and len(B)
//
// Pure JavaScript (slicing-by-8, a few hundred MB/s), so the trailer is
// combined from the per-chunk CRCs instead of reading every byte twice.

const POLY = 0x82f63b78; // reflected Castagnoli polynomial

// TABLE[k * 256 + b]: the register after byte b followed by k zero bytes.
const TABLE = (() => {
  const t = new Uint32Array(8 * 256);
  for (let b = 0; b < 256; b++) {
    let c = b;
    for (let i = 0; i < 8; i++) c = c & 1 ? (c >>> 1) ^ POLY : c >>> 1;
    t[b] = c;
  }
  for (let k = 1; k < 8; k++) {
    for (let b = 0; b < 256; b++) {
      const prev = t[(k - 1) * 256 + b];
      t[k * 256 + b] = (prev >>> 8) ^ t[prev & 0xff];
    }
  }
  return t;
})();

/**
 * CRC32C of `data` (a Uint8Array or Buffer), continuing from `crc`.
 * @param {Uint8Array} data
 * @param {number} [crc=0] CRC32C of the bytes before `data`
 * @returns {number} unsigned 32-bit CRC
 */
function crc32c(data, crc = 0) {
  const t = TABLE;
  let c = ~crc;
  let i = 0;
  const end8 = data.length - (data.length % 8);
  for (; i < end8; i += 8) {
    const lo = c ^ (data[i] | (data[i + 1] << 8) | (data[i + 2] << 16) | (data[i + 3] << 24));
    c = t[7 * 256 + (lo & 0xff)] ^ t[6 * 256 + ((lo >>> 8) & 0xff)] ^
        t[5 * 256 + ((lo >>> 16) & 0xff)] ^ t[4 * 256 + (lo >>> 24)] ^
        t[3 * 256 + data[i + 4]] ^ t[2 * 256 + data[i + 5]] ^
        t[1 * 256 + data[i + 6]] ^ t[data[i + 7]];
  }
  for (; i < data.length; i++) c = t[(c ^ data[i]) & 0xff] ^ (c >>> 8);
  return ~c >>> 0;
}

// a(x) * b(x) mod P(x), in the reflected bit order of the CRC (zlib's
// multmodp). REQUIRES: a != 0.
function multModP(a, b) {
  let m = 0x80000000;
  let p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) === 0) break;
    }
    m >>>= 1;
    b = b & 1 ? (b >>> 1) ^ POLY : b >>> 1;
  }
  return p >>> 0;
}

// X2N[k] = x^(2^k) mod P(x), for every k a byte length up to 2^53 needs
// (k = 3 .. 56). The powers do not repeat with period 32: x^(2^32) is not x
// modulo the Castagnoli polynomial, so no index may be reduced mod 32.
const X2N = (() => {
  const t = new Uint32Array(64);
  let p = 0x40000000; // x^1
  for (let k = 0; k < t.length; k++) {
    t[k] = p;
    p = multModP(p, p);
  }
  return t;
})();

/**
 * CRC32C of A||B given crc(A), crc(B) and the length of B in bytes.
 * @param {number} crcA
 * @param {number} crcB
 * @param {number} lenB non-negative safe integer (RangeError otherwise)
 * @returns {number}
 */
function crc32cCombine(crcA, crcB, lenB) {
  if (!Number.isSafeInteger(lenB) || lenB < 0) {
    throw new RangeError(`crc32cCombine: lenB ${lenB}, expected a non-negative safe integer`);
  }
  // Multiply crcA by x^(8 * lenB): one factor x^(2^k) per set bit of lenB, k from 3.
  let p = 0x80000000; // x^0
  let k = 3;
  for (let n = lenB; n > 0; n = Math.floor(n / 2), k++) {
    if (n % 2) p = multModP(X2N[k], p);
  }
  return (multModP(p, crcA >>> 0) ^ crcB) >>> 0;
}

module.exports = { crc32c, crc32cCombine };
