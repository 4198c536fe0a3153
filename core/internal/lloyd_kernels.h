// Row kernels of the rotated Lloyd-Max quantizer behind core/lloyd.h
// (docs/FORMAT.md, step 7b; internal to kvrelay_core).
//
// Codes are packed as core/message.h's QuantizedTensor says: element i of a
// row in bits [i*bits, (i+1)*bits), least significant first.
#ifndef KVRELAY_CORE_INTERNAL_LLOYD_KERNELS_H_
#define KVRELAY_CORE_INTERNAL_LLOYD_KERNELS_H_

#include <array>
#include <cstdint>
#include <vector>

#include "core/dtype.h"

namespace kvrelay {
namespace internal {

// Which code path runs. Both paths perform the same float operations on
// every value (the same butterflies of the Walsh-Hadamard transform in the
// same stage order, the same products, the float64 sum of squares in the
// same order), and both give a value the number of thresholds <= it as its
// code, so codes, norms and decoded values are bit-identical; the choice
// exists so tests can check that. kBest: AVX2 in builds with it (the
// default -march=x86-64-v3), scalar otherwise.
enum class LloydIsa { kBest, kScalar };

// The full codebook of one width.
struct LloydCodebook {
  int bits = 0;
  int size = 0;                        // 2^bits
  std::array<float, 16> level{};       // ascending
  std::array<float, 15> threshold{};   // between levels: float64 midpoints rounded to float32
  std::array<float, 16> table{};       // level[i % size]: a lookup by the low bits of a code
  // For the vector path of 4 bits: |u| falls in cell b = min(floor(3|u|), 7);
  // every cell holds at most one positive threshold, bin_threshold[b] (+inf
  // where none), and bin_code[b] is size/2 plus the number of positive
  // thresholds in the cells below b.
  std::array<float, 8> bin_threshold{};
  std::array<int32_t, 8> bin_code{};
};

// REQUIRES: 1 <= bits <= 4.
const LloydCodebook& GetLloydCodebook(int bits);

// The fp16 nearest to x >= 0 (ties to even); 0x7c00 (inf) past 65504 and
// its rounding range.
uint16_t F16NearestNonNegative(double x);

// The sign flips of a rotation of `dim` channels as float bit masks:
// 0x80000000 where sigma_i = -1 (LloydSigns), 0 elsewhere.
std::vector<uint32_t> LloydSignMasks(uint64_t seed, int dim);

enum class LloydRowOutcome { kOk, kNonFinite, kNormPastFp16 };

// The kernels behind LloydRowCoder.
using LloydTransformFn = double (*)(const void* x, DType dtype, int dim, const uint32_t* signs, float* work);
using LloydClassifyFn = void (*)(const LloydCodebook& cb, const float* work, int dim, float inv, uint8_t* codes);
using LloydDecodeFn = void (*)(const LloydCodebook& cb, const uint8_t* codes, int dim, const uint32_t* signs,
                               float scale, float* work, DType dtype, void* out);

// The row-form kernels (FORMAT.md step 7b) of one rotation, width and K/V
// dtype, chosen once. Rows x and out are `dim` elements of that dtype;
// `work` is dim floats of the caller's. Thread-safe (const).
class LloydRowCoder {
 public:
  // REQUIRES: dim a power of two, dim*bits % 8 == 0, 1 <= bits <= 4.
  LloydRowCoder(int dim, int bits, uint64_t seed, DType dtype, LloydIsa isa = LloydIsa::kBest);

  // Encoding one row x[0, dim) goes in three steps, so that a caller can
  // start a row's scalar norm arithmetic before the next row's transform
  // and finish the row after it (LloydQuantizeRows):
  //
  // Transform: sign flips and the unnormalized transform H of x (as
  // float32) into work (in an internal order: only Classify reads it);
  // returns the float64 sum of squares of x.
  double Transform(const void* x, float* work) const { return transform_(x, dtype_, dim_, signs_.data(), work); }

  // Norm: *norm = sqrt(sum_squares). kNonFinite when sum_squares is not
  // finite (a NaN or Inf in x), kNormPastFp16 when the norm rounds past
  // fp16. Otherwise kOk with *nu = the norm's fp16 and *inv = float32(1/nu)
  // (0 when nu = 0).
  static LloydRowOutcome Norm(double sum_squares, double* norm, uint16_t* nu, float* inv);

  // Classify: codes[0, dim*bits/8) = the packed codes (LloydClassifyPack)
  // of u = H(sigma x) * inv, from Transform's work.
  void Classify(const float* work, float inv, uint8_t* codes) const { classify_(*cb_, work, dim_, inv, codes); }

  // out = sigma * (H(c[code]) * scale) in float32 (the caller passes scale
  // = float32(nu) / dim), stored as FromFloatSaturating stores it.
  void Decode(const uint8_t* codes, float scale, float* work, void* out) const {
    decode_(*cb_, codes, dim_, signs_.data(), scale, work, dtype_, out);
  }

 private:
  int dim_;
  DType dtype_;
  const LloydCodebook* cb_;
  std::vector<uint32_t> signs_;  // LloydSignMasks
  LloydTransformFn transform_;
  LloydClassifyFn classify_;
  LloydDecodeFn decode_;
};

// The packed codes of u[0, n): with half = 2^(bits-1) and cnt = the number
// of positive thresholds <= |u|, half + cnt for u >= 0 and half - 1 - cnt
// otherwise (NaN included). That is the number of thresholds <= u, except
// for u exactly on a negative threshold, which takes the code below
// (FORMAT.md lets a value within rounding of a threshold take either).
// REQUIRES: n*bits % 8 == 0, 1 <= bits <= 4.
void LloydClassifyPack(const float* u, int n, int bits, uint8_t* codes, LloydIsa isa = LloydIsa::kBest);

// Channel form decoding: out[c] = fma(c[code_c], s[c], z[c]) for c in
// [0, dim). REQUIRES: dim*bits % 8 == 0, 1 <= bits <= 4.
void LloydDecodeChannelRow(const uint8_t* codes, int dim, int bits, const float* s, const float* z, float* out,
                           LloydIsa isa = LloydIsa::kBest);

}  // namespace internal
}  // namespace kvrelay

#endif  // KVRELAY_CORE_INTERNAL_LLOYD_KERNELS_H_
