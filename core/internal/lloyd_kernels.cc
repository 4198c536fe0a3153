#include "core/internal/lloyd_kernels.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "core/dtype.h"
#include "core/lloyd.h"
#include "core/quant.h"

// The vector path needs x86-64-v3 (AVX2, FMA, F16C), which the default
// build assumes (KVRELAY_ARCH); other builds run the scalar path.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVRELAY_LLOYD_AVX2 1
#else
#define KVRELAY_LLOYD_AVX2 0
#endif

#if KVRELAY_LLOYD_AVX2 || defined(__F16C__)
#include <immintrin.h>
#endif
#if KVRELAY_LLOYD_AVX2
#include "core/internal/dtype_avx.h"
#include "core/internal/hadamard_avx.h"
#endif

namespace kvrelay {
namespace internal {

namespace {

LloydCodebook MakeCodebook(int bits) {
  LloydCodebook cb;
  cb.bits = bits;
  cb.size = 1 << bits;
  const float* half_levels = LloydLevels(bits).data();
  const int m = cb.size / 2;
  for (int i = 0; i < m; ++i) {
    cb.level[m - 1 - i] = -half_levels[i];
    cb.level[m + i] = half_levels[i];
  }
  for (int j = 0; j + 1 < cb.size; ++j) {
    cb.threshold[j] =
        static_cast<float>((static_cast<double>(cb.level[j]) + static_cast<double>(cb.level[j + 1])) / 2);
  }
  for (int i = 0; i < 16; ++i) cb.table[i] = cb.level[i % cb.size];
  // The cells [b/3, (b+1)/3) of |u| (the last one open above). The 4-bit
  // codebook keeps every positive threshold at least 0.05 from a cell edge,
  // so a cell found from float32(3 |u|), off by one only within rounding
  // of an edge, still gives the exact count (lloyd_kernels_test checks it).
  cb.bin_threshold.fill(std::numeric_limits<float>::infinity());
  for (int b = 0; b < 8; ++b) {
    int below = 0;
    for (int j = m; j + 1 < cb.size; ++j) {
      const int cell = std::min(static_cast<int>(std::floor(3.0 * cb.threshold[j])), 7);
      if (cell < b) ++below;
      if (cell == b) cb.bin_threshold[b] = cb.threshold[j];
    }
    cb.bin_code[b] = m + below;
  }
  return cb;
}

// The float64 sum of squares of x[0, n) as the AVX2 path adds it: sixteen
// running sums (element i into sum i % 16), then per l < 4 (A_l + A_{4+l})
// + (A_{8+l} + A_{12+l}), those four as (s0 + s1) + (s2 + s3), then the
// last n % 16 elements in order. Products of floats are exact in float64,
// so fused multiply-adds change nothing.
double SumSquaresScalar(const float* x, int n) {
  double acc[16] = {};
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int l = 0; l < 16; ++l) acc[l] += static_cast<double>(x[i + l]) * x[i + l];
  }
  double s[4];
  for (int l = 0; l < 4; ++l) s[l] = (acc[l] + acc[4 + l]) + (acc[8 + l] + acc[12 + l]);
  double total = (s[0] + s[1]) + (s[2] + s[3]);
  for (; i < n; ++i) total += static_cast<double>(x[i]) * x[i];
  return total;
}

// fp16 to float32 (exact).
inline float HalfToFloat(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return F16ToFloat(h);
#endif
}

LloydRowOutcome RowNorm(double ss, double* norm, uint16_t* nu, float* inv) {
  *norm = std::sqrt(ss);
  // A finite float32 squared can overflow float64 only past 1e154, which
  // no float32 reaches; so a non-finite sum means NaN or Inf in the row.
  if (!std::isfinite(ss)) return LloydRowOutcome::kNonFinite;
  *nu = F16NearestNonNegative(*norm);
  if (*nu == 0x7c00) return LloydRowOutcome::kNormPastFp16;
  const float nuf = HalfToFloat(*nu);
  *inv = nuf == 0.0f ? 0.0f : static_cast<float>(1.0 / nuf);
  return LloydRowOutcome::kOk;
}

// ---------------------------------------------------------------------------
// Scalar path.

// The unnormalized transform, stages h = 1, 2, 4, ... (hadamard_avx.h).
void HadamardScalar(float* x, int n) {
  for (int h = 1; h < n; h *= 2) {
    for (int i = 0; i < n; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
}

float FlipSign(float v, uint32_t mask) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  b ^= mask;
  std::memcpy(&v, &b, sizeof v);
  return v;
}

uint8_t ClassifyScalar(const LloydCodebook& cb, float u) {
  const int half = cb.size / 2;
  const float a = std::fabs(u);
  int cnt = 0;
  for (int j = half; j + 1 < cb.size; ++j) cnt += a >= cb.threshold[j] ? 1 : 0;
  return static_cast<uint8_t>(u >= 0.0f ? half + cnt : half - 1 - cnt);
}

// Packs n codes of `bits` bits, element i at bits [i*bits, (i+1)*bits).
void Pack(const uint8_t* codes, int n, int bits, uint8_t* out) {
  if (bits == 4) {
    for (int i = 0; i < n / 2; ++i) out[i] = static_cast<uint8_t>(codes[2 * i] | (codes[2 * i + 1] << 4));
    return;
  }
  if (bits == 2) {
    for (int i = 0; i < n / 4; ++i) {
      const uint8_t* c = codes + 4 * i;
      out[i] = static_cast<uint8_t>(c[0] | (c[1] << 2) | (c[2] << 4) | (c[3] << 6));
    }
    return;
  }
  // 1 or 3 bits: eight codes fill `bits` bytes exactly.
  for (int i = 0; i < n / 8; ++i) {
    uint32_t w = 0;
    for (int k = 0; k < 8; ++k) w |= static_cast<uint32_t>(codes[8 * i + k]) << (k * bits);
    for (int b = 0; b < bits; ++b) out[i * bits + b] = static_cast<uint8_t>(w >> (8 * b));
  }
}

// Code i of a packed row.
int CodeAt(const uint8_t* in, int i, int bits) {
  const int bit = i * bits;
  uint32_t w = in[bit / 8];
  if (bit % 8 + bits > 8) w |= static_cast<uint32_t>(in[bit / 8 + 1]) << 8;
  return static_cast<int>((w >> (bit % 8)) & ((1u << bits) - 1));
}

void ClassifyPackScalar(const LloydCodebook& cb, const float* u, int n, uint8_t* out) {
  uint8_t codes[8];
  // Eight codes fill `bits` bytes; n*bits % 8 == 0 leaves at most one
  // shorter group, of a whole number of bytes.
  for (int i = 0; i < n; i += 8) {
    const int m = n - i < 8 ? n - i : 8;
    for (int k = 0; k < m; ++k) codes[k] = ClassifyScalar(cb, u[i + k]);
    Pack(codes, m, cb.bits, out + static_cast<size_t>(i) * cb.bits / 8);
  }
}

float* Scratch(int n) {
  thread_local std::vector<float> buf;
  if (buf.size() < static_cast<size_t>(n)) buf.resize(n);
  return buf.data();
}

double TransformScalar(const void* src, DType dtype, int dim, const uint32_t* signs, float* work) {
  float* x = Scratch(dim);
  ToFloat(dtype, src, x, dim);
  for (int i = 0; i < dim; ++i) work[i] = FlipSign(x[i], signs[i]);
  HadamardScalar(work, dim);
  return SumSquaresScalar(x, dim);
}

void ClassifyRowScalar(const LloydCodebook& cb, const float* work, int dim, float inv, uint8_t* codes) {
  float* u = Scratch(dim);
  for (int i = 0; i < dim; ++i) u[i] = work[i] * inv;
  ClassifyPackScalar(cb, u, dim, codes);
}

void DecodeRowScalar(const LloydCodebook& cb, const uint8_t* codes, int dim, const uint32_t* signs, float scale,
                     float* work, DType dtype, void* out) {
  for (int i = 0; i < dim; ++i) work[i] = cb.level[CodeAt(codes, i, cb.bits)];
  HadamardScalar(work, dim);
  for (int i = 0; i < dim; ++i) work[i] = FlipSign(work[i] * scale, signs[i]);
  FromFloatSaturating(dtype, work, out, dim);
}

void DecodeChannelRowScalar(const LloydCodebook& cb, const uint8_t* codes, int dim, const float* s, const float* z,
                            float* out) {
  for (int c = 0; c < dim; ++c) out[c] = std::fma(cb.level[CodeAt(codes, c, cb.bits)], s[c], z[c]);
}

// ---------------------------------------------------------------------------
// AVX2 path.

#if KVRELAY_LLOYD_AVX2

// The eight codes of u (as int32 lanes): the 4-bit codebook looks up the one
// threshold of |u|'s cell (LloydCodebook::bin_threshold), narrower ones
// compare with each positive threshold. Either way the count is that of
// ClassifyScalar; NaN gets cell 0 (its conversion is INT32_MIN) and no
// threshold, and is "not >= 0" like a negative.
template <int kBits>
struct Classifier {
  static constexpr int kHalf = 1 << (kBits - 1);
  __m256 abs_mask, zero, three, seven, bin_threshold;
  __m256i half, flip, bin_code;
  __m256 thresholds[kHalf > 1 ? kHalf - 1 : 1];

  explicit Classifier(const LloydCodebook& cb) {
    abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    zero = _mm256_setzero_ps();
    three = _mm256_set1_ps(3.0f);
    seven = _mm256_set1_ps(7.0f);
    bin_threshold = _mm256_loadu_ps(cb.bin_threshold.data());
    bin_code = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb.bin_code.data()));
    half = _mm256_set1_epi32(kHalf);
    flip = _mm256_set1_epi32(2 * kHalf - 1);
    for (int j = 0; j + 1 < kHalf; ++j) thresholds[j] = _mm256_set1_ps(cb.threshold[kHalf + j]);
  }

  __m256i operator()(__m256 u) const {
    const __m256 a = _mm256_and_ps(u, abs_mask);
    __m256i y;  // half + cnt
    if constexpr (kBits == 4) {
      const __m256i cell = _mm256_cvttps_epi32(_mm256_min_ps(seven, _mm256_mul_ps(a, three)));
      const __m256 ge = _mm256_cmp_ps(a, _mm256_permutevar8x32_ps(bin_threshold, cell), _CMP_GE_OQ);
      y = _mm256_sub_epi32(_mm256_permutevar8x32_epi32(bin_code, cell), _mm256_castps_si256(ge));
    } else {
      y = half;
      for (int j = 0; j + 1 < kHalf; ++j) {
        y = _mm256_sub_epi32(y, _mm256_castps_si256(_mm256_cmp_ps(a, thresholds[j], _CMP_GE_OQ)));
      }
    }
    // half - 1 - cnt = (2 half - 1) - y = y ^ (2 half - 1).
    const __m256 neg = _mm256_cmp_ps(u, zero, _CMP_NGE_UQ);
    return _mm256_xor_si256(y, _mm256_and_si256(_mm256_castps_si256(neg), flip));
  }
};

// Packs the 32 codes c[0..3] (int32 lanes, element order) into 4 * kBits
// bytes at out.
template <int kBits>
inline void Pack32(const __m256i* c, uint8_t* out) {
  // 32 bytes in element order.
  const __m256i bytes =
      _mm256_permutevar8x32_epi32(_mm256_packus_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3])),
                                  _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if constexpr (kBits == 4) {
    // Byte pairs (c0, c1) -> c0 + 16 c1 in 16-bit lanes, then to bytes.
    const __m256i w = _mm256_maddubs_epi16(bytes, _mm256_set1_epi16(0x1001));
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi16(w, w), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(p));
  } else if constexpr (kBits == 3) {
    // (c0 + 8 c1) + 64 (c2 + 8 c3) in 32-bit lanes, two of them to 24 bits
    // per 64-bit lane, then the three low bytes of each.
    const __m256i w = _mm256_madd_epi16(_mm256_maddubs_epi16(bytes, _mm256_set1_epi16(0x0801)),
                                        _mm256_set1_epi32(0x00400001));
    const __m256i t = _mm256_or_si256(_mm256_and_si256(w, _mm256_set1_epi64x(0xfff)), _mm256_srli_epi64(w, 20));
    const __m256i s = _mm256_shuffle_epi8(
        t, _mm256_setr_epi8(0, 1, 2, 8, 9, 10, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,  //
                            -1, -1, -1, -1, -1, -1, 0, 1, 2, 8, 9, 10, -1, -1, -1, -1));
    const __m128i r = _mm_or_si128(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), r);
    const uint32_t tail = static_cast<uint32_t>(_mm_extract_epi32(r, 2));
    std::memcpy(out + 8, &tail, 4);
  } else if constexpr (kBits == 2) {
    // (c0 + 4 c1) + 16 (c2 + 4 c3) in 32-bit lanes, then to bytes.
    const __m256i w = _mm256_madd_epi16(_mm256_maddubs_epi16(bytes, _mm256_set1_epi16(0x0401)),
                                        _mm256_set1_epi32(0x00100001));
    const __m256i p16 = _mm256_packus_epi32(w, w);
    const __m256i p8 = _mm256_packus_epi16(p16, p16);
    const __m256i p = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(p));
  } else {
    const uint32_t m = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_slli_epi16(bytes, 7)));
    std::memcpy(out, &m, 4);
  }
}

template <int kBits>
void ClassifyPackAvx2(const LloydCodebook& cb, const float* u, int n, uint8_t* out) {
  const Classifier<kBits> classify(cb);
  int i = 0;
  for (; i + 32 <= n; i += 32) {
    __m256i c[4];
    for (int r = 0; r < 4; ++r) c[r] = classify(_mm256_loadu_ps(u + i + 8 * r));
    Pack32<kBits>(c, out + static_cast<size_t>(i) * kBits / 8);
  }
  if (i < n) ClassifyPackScalar(cb, u + i, n - i, out + static_cast<size_t>(i) * kBits / 8);
}

// The levels of codes 8g .. 8g+7 of a packed row of at least 4 bytes, read
// as one 32-bit word that ends at the group's last byte or starts at the
// row (so it never leaves the row). Narrower codebooks repeat their levels
// in `lo` (the permutation reads the low three bits of each lane); 4 bits
// pick from lo or hi by the code's top bit.
template <int kBits>
inline __m256 LookupLevels(const uint8_t* row, int g, __m256 lo, __m256 hi) {
  const int o = kBits * g;
  const int at = o + kBits - 4 > 0 ? o + kBits - 4 : 0;
  int32_t w;
  std::memcpy(&w, row + at, 4);
  const __m256i word = _mm256_set1_epi32(w);
  const __m256i lanes = _mm256_setr_epi32(0, kBits, 2 * kBits, 3 * kBits, 4 * kBits, 5 * kBits, 6 * kBits, 7 * kBits);
  const __m256i idx = _mm256_srlv_epi32(word, _mm256_add_epi32(lanes, _mm256_set1_epi32(8 * (o - at))));
  if constexpr (kBits == 4) {
    // o == at: the top bit of code l is bit 4l + 3; move it to bit 31.
    const __m256i sel = _mm256_sllv_epi32(word, _mm256_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0));
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx), _mm256_permutevar8x32_ps(hi, idx),
                            _mm256_castsi256_ps(sel));
  } else {
    (void)hi;
    return _mm256_permutevar8x32_ps(lo, idx);
  }
}

// Lookup tables of LookupLevels.
inline void LevelTables(const LloydCodebook& cb, __m256* lo, __m256* hi) {
  *lo = _mm256_loadu_ps(cb.table.data());
  *hi = _mm256_loadu_ps(cb.table.data() + 8);
}

inline __m256 SignMasks(const uint32_t* signs) {
  return _mm256_castsi256_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(signs)));
}

// Rows of dim = 8 * kVecs (kVecs = 8, 16, 32) in blocks of eight vectors:
// each block is loaded (and its squares summed), sign-flipped and
// transformed up to h = 32 in registers and stored; the stages between
// blocks but the last follow in memory. ClassifyFused does the last stage
// (for one block, none) with the scale, the classification and the packing.
template <int kVecs, DType kDtype>
double TransformFused(const void* x, DType /*dtype*/, int /*dim*/, const uint32_t* signs, float* work) {
  static_assert(kVecs % 8 == 0, "blocks of eight vectors");
  constexpr int kBlocks = kVecs / 8;
  // Sums of squares: element i into lane i % 4 of acc[(i / 4) % 4].
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  for (int blk = 0; blk < kBlocks; ++blk) {
    __m256 v[8];
#pragma GCC unroll 8
    for (int q = 0; q < 8; ++q) {
      const __m256 xv = LoadAsFloat8<kDtype>(x, 64 * blk + 8 * q);
      const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(xv));
      const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(xv, 1));
      acc[(2 * q) % 4] = _mm256_fmadd_pd(lo, lo, acc[(2 * q) % 4]);
      acc[(2 * q + 1) % 4] = _mm256_fmadd_pd(hi, hi, acc[(2 * q + 1) % 4]);
      v[q] = _mm256_xor_ps(xv, SignMasks(signs + 64 * blk + 8 * q));
    }
    HadamardInRegisters<8>(v);
#pragma GCC unroll 8
    for (int q = 0; q < 8; ++q) _mm256_storeu_ps(work + 64 * blk + 8 * q, v[q]);
  }
  HadamardStagesFrom64(work, 8 * kVecs, 4 * kVecs);
  alignas(32) double t[4];
  _mm256_store_pd(t, _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3])));
  return (t[0] + t[1]) + (t[2] + t[3]);
}

template <int kBits, int kVecs>
void ClassifyFused(const LloydCodebook& cb, const float* work, int /*dim*/, float inv, uint8_t* codes) {
  const __m256 f = _mm256_set1_ps(inv);
  const Classifier<kBits> classify(cb);
  if constexpr (kVecs == 8) {
    for (int j = 0; j < 64; j += 32) {
      __m256i c[4];
      for (int r = 0; r < 4; ++r) c[r] = classify(_mm256_mul_ps(_mm256_loadu_ps(work + j + 8 * r), f));
      Pack32<kBits>(c, codes + j * kBits / 8);
    }
  } else {
    constexpr int kHalf = 4 * kVecs;  // the last stage's h, in floats
    for (int j = 0; j < kHalf; j += 32) {
      __m256 lo[4], hi[4];
      __m256i c[4];
      for (int r = 0; r < 4; ++r) {
        const __m256 a = _mm256_loadu_ps(work + j + 8 * r), b = _mm256_loadu_ps(work + j + kHalf + 8 * r);
        lo[r] = _mm256_add_ps(a, b);
        hi[r] = _mm256_sub_ps(a, b);
      }
      for (int r = 0; r < 4; ++r) c[r] = classify(_mm256_mul_ps(lo[r], f));
      Pack32<kBits>(c, codes + j * kBits / 8);
      for (int r = 0; r < 4; ++r) c[r] = classify(_mm256_mul_ps(hi[r], f));
      Pack32<kBits>(c, codes + (j + kHalf) * kBits / 8);
    }
  }
}

// The same blocks for decoding: look up and transform each block in
// registers, the stages between blocks in `work`, the last one fused with
// the scale, the signs and the store as the dtype.
template <int kBits, int kVecs, DType kDtype>
void DecodeRowFused(const LloydCodebook& cb, const uint8_t* codes, int /*dim*/, const uint32_t* signs, float scale,
                    float* work, DType /*dtype*/, void* out) {
  static_assert(kVecs % 8 == 0, "blocks of eight vectors");
  constexpr int kBlocks = kVecs / 8;
  __m256 lo, hi;
  LevelTables(cb, &lo, &hi);
  const __m256 s = _mm256_set1_ps(scale);
  for (int blk = 0; blk < kBlocks; ++blk) {
    __m256 v[8];
#pragma GCC unroll 8
    for (int q = 0; q < 8; ++q) v[q] = LookupLevels<kBits>(codes, 8 * blk + q, lo, hi);
    HadamardInRegisters<8>(v);
#pragma GCC unroll 8
    for (int q = 0; q < 8; ++q) {
      if constexpr (kBlocks == 1) {
        StoreSaturating8<kDtype>(_mm256_xor_ps(_mm256_mul_ps(v[q], s), SignMasks(signs + 8 * q)), out, 8 * q);
      } else {
        _mm256_storeu_ps(work + 64 * blk + 8 * q, v[q]);
      }
    }
  }
  if constexpr (kBlocks > 1) {
    HadamardStagesFrom64(work, 8 * kVecs, 4 * kVecs);
    constexpr int kHalf = 4 * kVecs;
#pragma GCC unroll 4
    for (int j = 0; j < kHalf; j += 8) {
      const __m256 a = _mm256_loadu_ps(work + j), b = _mm256_loadu_ps(work + j + kHalf);
      StoreSaturating8<kDtype>(_mm256_xor_ps(_mm256_mul_ps(_mm256_add_ps(a, b), s), SignMasks(signs + j)), out, j);
      StoreSaturating8<kDtype>(_mm256_xor_ps(_mm256_mul_ps(_mm256_sub_ps(a, b), s), SignMasks(signs + j + kHalf)),
                               out, j + kHalf);
    }
  }
}

// Rows of other lengths: through memory, with HadamardTransformScaled (the
// same butterflies; its scale 1 is exact).
double TransformAvx2(const void* src, DType dtype, int dim, const uint32_t* signs, float* work) {
  float* x = Scratch(dim);
  ToFloat(dtype, src, x, dim);
  for (int i = 0; i < dim; ++i) work[i] = FlipSign(x[i], signs[i]);
  HadamardTransformScaled(work, dim, 1.0f);
  return SumSquaresScalar(x, dim);
}

void ClassifyRowAvx2(const LloydCodebook& cb, const float* work, int dim, float inv, uint8_t* codes) {
  float* u = Scratch(dim);
  for (int i = 0; i < dim; ++i) u[i] = work[i] * inv;
  LloydClassifyPack(u, dim, cb.bits, codes, LloydIsa::kBest);
}

void DecodeRowAvx2(const LloydCodebook& cb, const uint8_t* codes, int dim, const uint32_t* signs, float scale,
                   float* work, DType dtype, void* out) {
  for (int i = 0; i < dim; ++i) work[i] = cb.level[CodeAt(codes, i, cb.bits)];
  HadamardTransformScaled(work, dim, scale);
  for (int i = 0; i < dim; ++i) work[i] = FlipSign(work[i], signs[i]);
  FromFloatSaturating(dtype, work, out, dim);
}

// The fused kernels of one row length and dtype.
template <int kVecs, DType kDtype>
void PickFused(int bits, LloydTransformFn* transform, LloydClassifyFn* classify, LloydDecodeFn* decode) {
  *transform = TransformFused<kVecs, kDtype>;
  switch (bits) {
    case 1:
      *classify = ClassifyFused<1, kVecs>;
      *decode = DecodeRowFused<1, kVecs, kDtype>;
      return;
    case 2:
      *classify = ClassifyFused<2, kVecs>;
      *decode = DecodeRowFused<2, kVecs, kDtype>;
      return;
    case 3:
      *classify = ClassifyFused<3, kVecs>;
      *decode = DecodeRowFused<3, kVecs, kDtype>;
      return;
    default:
      *classify = ClassifyFused<4, kVecs>;
      *decode = DecodeRowFused<4, kVecs, kDtype>;
      return;
  }
}

template <int kVecs>
void PickFused(DType dtype, int bits, LloydTransformFn* transform, LloydClassifyFn* classify,
               LloydDecodeFn* decode) {
  switch (dtype) {
    case DType::kF32: return PickFused<kVecs, DType::kF32>(bits, transform, classify, decode);
    case DType::kF16: return PickFused<kVecs, DType::kF16>(bits, transform, classify, decode);
    case DType::kBF16: return PickFused<kVecs, DType::kBF16>(bits, transform, classify, decode);
  }
}

template <int kBits>
void DecodeChannelRowAvx2(const LloydCodebook& cb, const uint8_t* codes, int dim, const float* s, const float* z,
                          float* out) {
  int c = 0;
  if (dim * kBits >= 32) {  // LookupLevels reads 4 bytes
    __m256 lo, hi;
    LevelTables(cb, &lo, &hi);
    for (; c + 8 <= dim; c += 8) {
      const __m256 l = LookupLevels<kBits>(codes, c / 8, lo, hi);
      _mm256_storeu_ps(out + c, _mm256_fmadd_ps(l, _mm256_loadu_ps(s + c), _mm256_loadu_ps(z + c)));
    }
  }
  for (; c < dim; ++c) out[c] = std::fma(cb.level[CodeAt(codes, c, kBits)], s[c], z[c]);
}

#endif  // KVRELAY_LLOYD_AVX2

}  // namespace

const LloydCodebook& GetLloydCodebook(int bits) {
  static const std::array<LloydCodebook, 5> books = {LloydCodebook{}, MakeCodebook(1), MakeCodebook(2),
                                                     MakeCodebook(3), MakeCodebook(4)};
  return books[bits];
}

uint16_t F16NearestNonNegative(double x) {
  const float f = static_cast<float>(x);
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  // From 2^-14 up, fp16 keeps the top 11 of float32's 24 significant bits;
  // unless f lies exactly halfway between two fp16 values, x and f round to
  // the same one (the halfway points are float32 values, so rounding x to
  // float32 cannot carry it across one).
  if (b >= 0x38800000u && (b & 0x1fffu) != 0x1000u) {
#if defined(__F16C__)
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    return FloatToF16(f);
#endif
  }
  uint16_t h = FloatToF16(f);
  if ((h & 0x7fff) >= 0x7c00) {
    // f >= 65520 (the fp16 overflow threshold, exact in float32); x itself
    // may lie just below it, and then rounds to 65504.
    return x >= 65520.0 ? 0x7c00 : 0x7bff;
  }
  // Double rounding through float32 can land one fp16 off; pick the
  // nearest of h and its neighbours.
  uint16_t best = h;
  double best_err = std::fabs(static_cast<double>(F16ToFloat(h)) - x);
  for (int delta : {-1, 1}) {
    const int c = static_cast<int>(h) + delta;
    if (c < 0 || c >= 0x7c00) continue;
    const double err = std::fabs(static_cast<double>(F16ToFloat(static_cast<uint16_t>(c))) - x);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best = static_cast<uint16_t>(c);
      best_err = err;
    }
  }
  return best;
}

std::vector<uint32_t> LloydSignMasks(uint64_t seed, int dim) {
  std::vector<float> signs(dim);
  LloydSigns(seed, dim, signs.data());
  std::vector<uint32_t> masks(dim);
  for (int i = 0; i < dim; ++i) masks[i] = signs[i] < 0 ? 0x80000000u : 0u;
  return masks;
}

LloydRowCoder::LloydRowCoder(int dim, int bits, uint64_t seed, DType dtype, LloydIsa isa)
    : dim_(dim),
      dtype_(dtype),
      cb_(&GetLloydCodebook(bits)),
      signs_(LloydSignMasks(seed, dim)),
      transform_(TransformScalar),
      classify_(ClassifyRowScalar),
      decode_(DecodeRowScalar) {
#if KVRELAY_LLOYD_AVX2
  if (isa == LloydIsa::kBest) {
    transform_ = TransformAvx2;
    classify_ = ClassifyRowAvx2;
    decode_ = DecodeRowAvx2;
    switch (dim) {
      case 64:
        PickFused<8>(dtype, bits, &transform_, &classify_, &decode_);
        break;
      case 128:
        PickFused<16>(dtype, bits, &transform_, &classify_, &decode_);
        break;
      case 256:
        PickFused<32>(dtype, bits, &transform_, &classify_, &decode_);
        break;
      default: break;
    }
  }
#else
  (void)isa;  // scalar-only builds
#endif
}

LloydRowOutcome LloydRowCoder::Norm(double sum_squares, double* norm, uint16_t* nu, float* inv) {
  return RowNorm(sum_squares, norm, nu, inv);
}

void LloydClassifyPack(const float* u, int n, int bits, uint8_t* codes, LloydIsa isa) {
  const LloydCodebook& cb = GetLloydCodebook(bits);
  (void)isa;  // scalar-only builds
#if KVRELAY_LLOYD_AVX2
  if (isa == LloydIsa::kBest) {
    switch (bits) {
      case 1: return ClassifyPackAvx2<1>(cb, u, n, codes);
      case 2: return ClassifyPackAvx2<2>(cb, u, n, codes);
      case 3: return ClassifyPackAvx2<3>(cb, u, n, codes);
      default: return ClassifyPackAvx2<4>(cb, u, n, codes);
    }
  }
#endif
  ClassifyPackScalar(cb, u, n, codes);
}

void LloydDecodeChannelRow(const uint8_t* codes, int dim, int bits, const float* s, const float* z, float* out,
                           LloydIsa isa) {
  const LloydCodebook& cb = GetLloydCodebook(bits);
  (void)isa;  // scalar-only builds
#if KVRELAY_LLOYD_AVX2
  if (isa == LloydIsa::kBest) {
    switch (bits) {
      case 1: return DecodeChannelRowAvx2<1>(cb, codes, dim, s, z, out);
      case 2: return DecodeChannelRowAvx2<2>(cb, codes, dim, s, z, out);
      case 3: return DecodeChannelRowAvx2<3>(cb, codes, dim, s, z, out);
      default: return DecodeChannelRowAvx2<4>(cb, codes, dim, s, z, out);
    }
  }
#endif
  DecodeChannelRowScalar(cb, codes, dim, s, z, out);
}

}  // namespace internal
}  // namespace kvrelay
