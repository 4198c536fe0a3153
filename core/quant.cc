#include "core/quant.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/dtype.h"
#include "core/history.h"
#include "core/internal/hadamard_avx.h"
#include "core/lloyd.h"
#include "core/status_macros.h"

#if defined(__AVX2__) || defined(__AVX__) || defined(__F16C__)
#include <immintrin.h>
#endif

// Layout of the work: rows are processed in blocks of up to kBlockRows
// (keys: one token group; values: consecutive tokens). A block is converted
// to f32 once, rotated, reduced to min/max, turned into fp16 statistics
// with one vectorized pass, then encoded. Every vector path (AVX2, F16C)
// performs the same IEEE operations as its scalar fallback, so builds with
// and without -march=x86-64-v3 produce identical bytes.

namespace kvrelay {

namespace {

constexpr uint16_t kF16MinSubnormal = 0x0001;
constexpr int kValueBlockRows = 32;  // value rows whose statistics are made together

bool IsPowerOfTwo(int64_t n) { return n > 0 && (n & (n - 1)) == 0; }

// ---------------------------------------------------------------------------
// Row conversions: the shared (F16C-accelerated) ones from core/dtype.h.

void LoadRow(DType dtype, const uint8_t* src, float* dst, size_t n) { ToFloat(dtype, src, dst, n); }

void LoadF16(const uint16_t* src, float* dst, size_t n) { ToFloat(DType::kF16, src, dst, n); }

// Decoded values lie within scale/2 of values the dtype holds, so they are
// saturated to its finite range (which only brings them closer).
void StoreRow(DType dtype, float* src, uint8_t* dst, int n) {
  FromFloatSaturating(dtype, src, dst, static_cast<size_t>(n));
}

// ---------------------------------------------------------------------------
// Min/max reductions. Both also report NaN (which min/max would skip);
// infinities show up in the statistics.

// Per-channel min/max over `rows` rows of `dim` floats. Returns false on NaN.
bool ColumnMinMax(const float* x, int rows, int dim, float* lo, float* hi) {
  std::memcpy(lo, x, dim * sizeof(float));
  std::memcpy(hi, x, dim * sizeof(float));
  bool nan = false;
  int c0 = 0;
#if defined(__AVX__)
  __m256 bad = _mm256_setzero_ps();
  for (; c0 + 8 <= dim; c0 += 8) {
    __m256 l = _mm256_loadu_ps(x + c0), h = l;
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(l, l, _CMP_UNORD_Q));
    for (int r = 1; r < rows; ++r) {
      const __m256 v = _mm256_loadu_ps(x + static_cast<size_t>(r) * dim + c0);
      l = _mm256_min_ps(v, l);
      h = _mm256_max_ps(v, h);
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    _mm256_storeu_ps(lo + c0, l);
    _mm256_storeu_ps(hi + c0, h);
  }
  nan = _mm256_movemask_ps(bad) != 0;
#endif
  for (int r = 0; r < rows; ++r) {
    const float* row = x + static_cast<size_t>(r) * dim;
    for (int c = c0; c < dim; ++c) {
      const float v = row[c];
      nan |= v != v;
      lo[c] = v < lo[c] ? v : lo[c];
      hi[c] = v > hi[c] ? v : hi[c];
    }
  }
  return !nan;
}

// Min/max of one row of n >= 1 floats. Returns false on NaN.
bool RowMinMax(const float* x, int n, float* lo, float* hi) {
  int i = 0;
  float l = x[0], h = x[0];
  bool nan = false;
#if defined(__AVX__)
  if (n >= 8) {
    __m256 vl = _mm256_loadu_ps(x), vh = vl;
    __m256 bad = _mm256_cmp_ps(vl, vl, _CMP_UNORD_Q);
    for (i = 8; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      vl = _mm256_min_ps(v, vl);
      vh = _mm256_max_ps(v, vh);
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    alignas(32) float bl[8], bh[8];
    _mm256_store_ps(bl, vl);
    _mm256_store_ps(bh, vh);
    for (int j = 0; j < 8; ++j) {
      l = std::min(l, bl[j]);
      h = std::max(h, bh[j]);
    }
    nan = _mm256_movemask_ps(bad) != 0;
  }
#endif
  for (; i < n; ++i) {
    nan |= x[i] != x[i];
    l = std::min(l, x[i]);
    h = std::max(h, x[i]);
  }
  *lo = l;
  *hi = h;
  return !nan;
}

// ---------------------------------------------------------------------------
// fp16 statistics with directed rounding (quant.h): z is the largest fp16
// <= lo; s is the smallest fp16 >= 2^-24 with s * max_code >= hi - z, the
// product and the difference evaluated in float64.

// The next fp16 toward -inf / +inf. REQUIRES: h is not NaN.
uint16_t F16NextDown(uint16_t h) {
  if (h == 0x0000) return 0x8001;
  if (h & 0x8000) return h == 0xfc00 ? h : static_cast<uint16_t>(h + 1);
  return static_cast<uint16_t>(h - 1);
}
uint16_t F16NextUp(uint16_t h) {
  if (h == 0x8000) return 0x0001;
  if (h & 0x8000) return static_cast<uint16_t>(h - 1);
  return h == 0x7c00 ? h : static_cast<uint16_t>(h + 1);
}

bool F16IsInf(uint16_t h) { return (h & 0x7fffu) == 0x7c00u; }

// Where a statistic block lies, for error messages.
struct BlockRef {
  const char* tensor;  // "k" or "v"
  int head;
  int token0, token1;  // [token0, token1)
  int channel;         // -1: all channels of one token
};

std::string Describe(const BlockRef& b) {
  if (b.channel >= 0) {
    return absl::StrFormat("%s head %d channel %d tokens [%d, %d)", b.tensor, b.head,
                           b.channel, b.token0, b.token1);
  }
  return absl::StrFormat("%s head %d token %d", b.tensor, b.head, b.token0);
}

// Inputs are checked finite; a rotation can still overflow near FLT_MAX.
constexpr char kRotationOverflow[] = "rotating values near the float32 limit overflows";

absl::Status NanError(const char* tensor, int head, int token0, int token1) {
  return absl::InvalidArgumentError(
      absl::StrFormat("quant: %s head %d tokens [%d, %d): NaN value (after rotation, if any: %s)", tensor, head,
                      token0, token1, kRotationOverflow));
}

// Scalar reference for one statistic; also builds the error for a block
// that has no representable statistic.
absl::Status MakeStat(float lo, float hi, int max_code, const BlockRef& where,
                      uint16_t* zero_bits, uint16_t* scale_bits) {
  if (!std::isfinite(lo) || !std::isfinite(hi)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "quant: %s: non-finite value %g (after rotation, if any: %s)", Describe(where),
        std::isfinite(lo) ? hi : lo, kRotationOverflow));
  }
  uint16_t z = FloatToF16(lo);
  while (F16ToFloat(z) > lo) z = F16NextDown(z);
  if (F16IsInf(z)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "quant: %s: minimum %g gives a zero point outside the fp16 range", Describe(where), lo));
  }
  const double diff = static_cast<double>(hi) - static_cast<double>(F16ToFloat(z));
  uint16_t s = FloatToF16(static_cast<float>(diff / max_code));
  if (s == 0x0000 || s == 0x8000) s = kF16MinSubnormal;
  while (!F16IsInf(s) && static_cast<double>(F16ToFloat(s)) * max_code < diff) s = F16NextUp(s);
  while (s > kF16MinSubnormal && !F16IsInf(s) &&
         static_cast<double>(F16ToFloat(static_cast<uint16_t>(s - 1))) * max_code >= diff) {
    --s;
  }
  if (F16IsInf(s)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "quant: %s: scale %g (range [%g, %g]) does not fit in fp16", Describe(where),
        diff / max_code, lo, hi));
  }
  *zero_bits = z;
  *scale_bits = s;
  return absl::OkStatus();
}

// Statistics of n blocks: fp16 bits to zb/sb, and as floats z and 1/s for
// the encoder. Returns the index of the first block without a
// representable statistic, or -1.
int MakeStats(const float* lo, const float* hi, int n, int max_code, uint16_t* zb,
              uint16_t* sb, float* z, float* inv) {
  int i = 0;
#if defined(__F16C__) && defined(__AVX__)
  const __m256 inv_max = _mm256_set1_ps(1.0f / static_cast<float>(max_code));
  const __m256d maxd = _mm256_set1_pd(max_code);
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 f16_max = _mm256_set1_ps(65504.0f);
  const __m256 min_sub = _mm256_set1_ps(0x1p-24f);
  for (; i + 8 <= n; i += 8) {
    const __m256 l = _mm256_loadu_ps(lo + i);
    const __m256 h = _mm256_loadu_ps(hi + i);
    const __m128i z16 = _mm256_cvtps_ph(l, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m256 zf = _mm256_cvtph_ps(z16);
    // A guess for s, then an exact check in float64 of both conditions.
    const __m256 guess = _mm256_mul_ps(_mm256_sub_ps(h, zf), inv_max);
    const __m128i s16 = _mm_max_epu16(
        _mm256_cvtps_ph(guess, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC),
        _mm_set1_epi16(static_cast<short>(kF16MinSubnormal)));
    const __m256 sf = _mm256_cvtph_ps(s16);
    const __m256 prevf = _mm256_cvtph_ps(_mm_sub_epi16(s16, _mm_set1_epi16(1)));
    // Finite: zf >= -65504 (false for -inf and NaN), sf <= 65504.
    __m256 ok = _mm256_and_ps(_mm256_cmp_ps(zf, _mm256_sub_ps(_mm256_setzero_ps(), f16_max),
                                            _CMP_GE_OQ),
                              _mm256_cmp_ps(sf, f16_max, _CMP_LE_OQ));
    ok = _mm256_and_ps(ok, _mm256_cmp_ps(h, f16_max, _CMP_ORD_Q));  // hi not NaN
    int okbits = _mm256_movemask_ps(ok);
    const __m256 at_min = _mm256_cmp_ps(sf, min_sub, _CMP_EQ_OQ);
    for (int half = 0; half < 2; ++half) {
      const __m128 hq = half ? _mm256_extractf128_ps(h, 1) : _mm256_castps256_ps128(h);
      const __m128 zq = half ? _mm256_extractf128_ps(zf, 1) : _mm256_castps256_ps128(zf);
      const __m128 sq = half ? _mm256_extractf128_ps(sf, 1) : _mm256_castps256_ps128(sf);
      const __m128 pq = half ? _mm256_extractf128_ps(prevf, 1) : _mm256_castps256_ps128(prevf);
      const __m256d diff = _mm256_sub_pd(_mm256_cvtps_pd(hq), _mm256_cvtps_pd(zq));
      const __m256d enough = _mm256_cmp_pd(_mm256_mul_pd(_mm256_cvtps_pd(sq), maxd), diff,
                                           _CMP_GE_OQ);
      const __m256d tight = _mm256_cmp_pd(_mm256_mul_pd(_mm256_cvtps_pd(pq), maxd), diff,
                                          _CMP_LT_OQ);
      const int e = _mm256_movemask_pd(enough);
      const int t = _mm256_movemask_pd(tight);
      okbits &= ~(((~e) & 0xF) << (4 * half));
      const int atmin = (_mm256_movemask_ps(at_min) >> (4 * half)) & 0xF;
      okbits &= ~(((~(t | atmin)) & 0xF) << (4 * half));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(zb + i), z16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(sb + i), s16);
    _mm256_storeu_ps(z + i, zf);
    _mm256_storeu_ps(inv + i, _mm256_div_ps(one, sf));
    if (okbits != 0xFF) {
      for (int j = 0; j < 8; ++j) {
        if (okbits & (1 << j)) continue;
        if (!MakeStat(lo[i + j], hi[i + j], max_code, BlockRef{"", 0, 0, 0, 0}, &zb[i + j],
                      &sb[i + j])
                 .ok()) {
          return i + j;
        }
        z[i + j] = F16ToFloat(zb[i + j]);
        inv[i + j] = 1.0f / F16ToFloat(sb[i + j]);
      }
    }
  }
#endif
  for (; i < n; ++i) {
    if (!MakeStat(lo[i], hi[i], max_code, BlockRef{"", 0, 0, 0, 0}, &zb[i], &sb[i]).ok()) {
      return i;
    }
    z[i] = F16ToFloat(zb[i]);
    inv[i] = 1.0f / F16ToFloat(sb[i]);
  }
  return -1;
}

// ---------------------------------------------------------------------------
// Walsh-Hadamard butterflies.

#if defined(__AVX__)
// The whole transform of n = 8 * kVecs floats, unrolled, in registers.
template <int kVecs>
void HadamardFixed(float* x, float norm) {
  __m256 v[kVecs];
#pragma GCC unroll 16
  for (int q = 0; q < kVecs; ++q) v[q] = _mm256_loadu_ps(x + 8 * q);
  internal::HadamardInRegisters<kVecs>(v);
  const __m256 s = _mm256_set1_ps(norm);
#pragma GCC unroll 16
  for (int q = 0; q < kVecs; ++q) _mm256_storeu_ps(x + 8 * q, _mm256_mul_ps(v[q], s));
}
#endif

float HadamardNorm(int n) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(n))); }

// ---------------------------------------------------------------------------
// Row kernels. kPerChannel: z/inv (or s/z) are arrays of dim entries;
// otherwise element 0 applies to the whole row. The product code * scale is
// exact (at most 8 + 11 significant bits), so an FMA rounds like mul + add.

template <int kBits, bool kPerChannel>
void EncodeRow(const float* x, const float* z, const float* inv, uint8_t* out, int d) {
  constexpr int kPer = 8 / kBits;
  constexpr float kMax = static_cast<float>((1 << kBits) - 1);
  int i = 0;
#if defined(__AVX2__)
  const __m256 zero = _mm256_setzero_ps();
  const __m256 maxc = _mm256_set1_ps(kMax);
  const __m256 half = _mm256_set1_ps(0.5f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256 zb = _mm256_set1_ps(z[0]);
  const __m256 ib = _mm256_set1_ps(inv[0]);
  for (; i + 32 <= d; i += 32) {
    __m256i c[4];
    for (int q = 0; q < 4; ++q) {
      const int o = i + 8 * q;
      const __m256 zv = kPerChannel ? _mm256_loadu_ps(z + o) : zb;
      const __m256 iv = kPerChannel ? _mm256_loadu_ps(inv + o) : ib;
      __m256 t = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + o), zv), iv);
      t = _mm256_min_ps(_mm256_max_ps(t, zero), maxc);
      c[q] = _mm256_cvttps_epi32(_mm256_add_ps(t, half));
    }
    // 32 int32 codes -> 32 bytes in element order.
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packus_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3])),
        order);
    uint8_t* o = out + i * kBits / 8;
    if constexpr (kBits == 8) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), bytes);
    } else if constexpr (kBits == 4) {
      // Byte pairs (c0, c1) -> c0 + 16*c1 in 16-bit lanes, then to bytes.
      const __m256i w = _mm256_maddubs_epi16(bytes, _mm256_set1_epi16(0x1001));
      const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi16(w, w), 0xD8);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm256_castsi256_si128(p));
    } else {
      // (c0 + 4*c1) + 16*(c2 + 4*c3) in 32-bit lanes, then to bytes.
      const __m256i w = _mm256_madd_epi16(_mm256_maddubs_epi16(bytes, _mm256_set1_epi16(0x0401)),
                                          _mm256_set1_epi32(0x00100001));
      const __m256i p16 = _mm256_packus_epi32(w, w);
      const __m256i p8 = _mm256_packus_epi16(p16, p16);
      const __m256i p =
          _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(o), _mm256_castsi256_si128(p));
    }
  }
#endif
  for (int j = i / kPer; j < d / kPer; ++j) {
    uint32_t b = 0;
    for (int k = 0; k < kPer; ++k) {
      const int e = j * kPer + k;
      float t = (x[e] - z[kPerChannel ? e : 0]) * inv[kPerChannel ? e : 0];
      t = t < 0.0f ? 0.0f : t;
      t = t > kMax ? kMax : t;
      const uint32_t c = static_cast<uint32_t>(static_cast<int32_t>(t + 0.5f));
      b |= c << (k * kBits);
    }
    out[j] = static_cast<uint8_t>(b);
  }
}

template <int kBits, bool kPerChannel>
void DecodeRow(const uint8_t* codes, const float* s, const float* z, float* out, int d) {
  constexpr int kPer = 8 / kBits;
  constexpr uint32_t kMask = (1u << kBits) - 1;
  int i = 0;
#if defined(__AVX2__)
  // Eight elements at a time: kBits bytes, broadcast and shifted per lane.
  const __m256i mask = _mm256_set1_epi32(static_cast<int>(kMask));
  const __m256i shifts = _mm256_setr_epi32(0, kBits, 2 * kBits, 3 * kBits, 4 * kBits,
                                           5 * kBits, 6 * kBits, 7 * kBits);
  const __m256 sb = _mm256_set1_ps(s[0]);
  const __m256 zb = _mm256_set1_ps(z[0]);
  for (; i + 8 <= d; i += 8) {
    const uint8_t* src = codes + i * kBits / 8;
    __m256i c;
    if constexpr (kBits == 8) {
      c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
    } else {
      uint32_t word = 0;
      std::memcpy(&word, src, kBits);  // 2 or 4 bytes
      c = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), shifts),
                           mask);
    }
    const __m256 cf = _mm256_cvtepi32_ps(c);
    const __m256 sv = kPerChannel ? _mm256_loadu_ps(s + i) : sb;
    const __m256 zv = kPerChannel ? _mm256_loadu_ps(z + i) : zb;
#if defined(__FMA__)
    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(cf, sv, zv));
#else
    _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_mul_ps(cf, sv), zv));
#endif
  }
#endif
  for (int j = i / kPer; j < d / kPer; ++j) {
    const uint32_t b = codes[j];
    for (int k = 0; k < kPer; ++k) {
      const int e = j * kPer + k;
      const float c = static_cast<float>(static_cast<int32_t>((b >> (k * kBits)) & kMask));
      out[e] = c * s[kPerChannel ? e : 0] + z[kPerChannel ? e : 0];
    }
  }
}

using EncodeFn = void (*)(const float*, const float*, const float*, uint8_t*, int);
using DecodeFn = void (*)(const uint8_t*, const float*, const float*, float*, int);

template <bool kPerChannel>
EncodeFn PickEncode(int bits) {
  return bits == 8   ? EncodeRow<8, kPerChannel>
         : bits == 4 ? EncodeRow<4, kPerChannel>
                     : EncodeRow<2, kPerChannel>;
}
template <bool kPerChannel>
DecodeFn PickDecode(int bits) {
  return bits == 8   ? DecodeRow<8, kPerChannel>
         : bits == 4 ? DecodeRow<4, kPerChannel>
                     : DecodeRow<2, kPerChannel>;
}

size_t RowCodeBytes(int dim, int bits) { return static_cast<size_t>(dim) * bits / 8; }
int NumGroups(int tokens, int group) { return tokens == 0 ? 0 : (tokens - 1) / group + 1; }

void InitQuantized(QuantizedTensor* q, int bits, int heads, int tokens, int dim, size_t stats) {
  q->bits = bits;
  q->heads = heads;
  q->tokens = tokens;
  q->dim = dim;
  q->codes.assign(static_cast<size_t>(heads) * tokens * RowCodeBytes(dim, bits), 0);
  q->scale.assign(stats, 0);
  q->zero.assign(stats, 0);
}

// Loads rows [t0, t0+n) of head h as f32 into buf and rotates them.
void LoadBlock(const KvTensor& x, int h, int t0, int n, bool rotate, float* buf) {
  const int dim = x.dim();
  LoadRow(x.dtype(), x.row(h, t0), buf, static_cast<size_t>(n) * dim);
  if (rotate) {
    for (int r = 0; r < n; ++r) HadamardTransform(buf + static_cast<size_t>(r) * dim, dim);
  }
}

// Keys: per (head, channel) statistics over groups of `group` tokens.
absl::Status QuantizeKeys(const KvTensor& k, const QuantOptions& opts, QuantizedTensor* q) {
  const int heads = k.heads(), tokens = k.tokens(), dim = k.dim();
  const int groups = NumGroups(tokens, opts.group);
  InitQuantized(q, opts.bits, heads, tokens, dim, static_cast<size_t>(heads) * groups * dim);
  if (q->codes.empty()) return absl::OkStatus();

  const int max_code = (1 << opts.bits) - 1;
  const size_t row_bytes = RowCodeBytes(dim, opts.bits);
  const EncodeFn encode = PickEncode<true>(opts.bits);
  const int buf_rows = std::min(opts.group, tokens);
  std::vector<float> buf(static_cast<size_t>(buf_rows) * dim);
  std::vector<float> lo(dim), hi(dim), z(dim), inv(dim);

  for (int h = 0; h < heads; ++h) {
    for (int g = 0; g < groups; ++g) {
      const int t0 = g * opts.group;
      const int n = std::min(opts.group, tokens - t0);
      LoadBlock(k, h, t0, n, opts.rotate, buf.data());
      if (!ColumnMinMax(buf.data(), n, dim, lo.data(), hi.data())) {
        return NanError("k", h, t0, t0 + n);
      }
      const size_t stat0 = (static_cast<size_t>(h) * groups + g) * dim;
      const int bad = MakeStats(lo.data(), hi.data(), dim, max_code, &q->zero[stat0],
                                &q->scale[stat0], z.data(), inv.data());
      if (bad >= 0) {
        uint16_t zb, sb;
        return MakeStat(lo[bad], hi[bad], max_code, BlockRef{"k", h, t0, t0 + n, bad}, &zb, &sb);
      }
      uint8_t* out = q->codes.data() + (static_cast<size_t>(h) * tokens + t0) * row_bytes;
      for (int r = 0; r < n; ++r) {
        encode(buf.data() + static_cast<size_t>(r) * dim, z.data(), inv.data(),
               out + r * row_bytes, dim);
      }
    }
  }
  return absl::OkStatus();
}

// Values: per (head, token) statistics over all channels.
absl::Status QuantizeValues(const KvTensor& v, const QuantOptions& opts, QuantizedTensor* q) {
  const int heads = v.heads(), tokens = v.tokens(), dim = v.dim();
  InitQuantized(q, opts.bits, heads, tokens, dim, static_cast<size_t>(heads) * tokens);
  if (q->codes.empty()) return absl::OkStatus();

  const int max_code = (1 << opts.bits) - 1;
  const size_t row_bytes = RowCodeBytes(dim, opts.bits);
  const EncodeFn encode = PickEncode<false>(opts.bits);
  const int buf_rows = std::min(kValueBlockRows, tokens);
  std::vector<float> buf(static_cast<size_t>(buf_rows) * dim);
  float lo[kValueBlockRows], hi[kValueBlockRows], z[kValueBlockRows], inv[kValueBlockRows];

  for (int h = 0; h < heads; ++h) {
    for (int t0 = 0; t0 < tokens; t0 += kValueBlockRows) {
      const int n = std::min(kValueBlockRows, tokens - t0);
      LoadBlock(v, h, t0, n, opts.rotate, buf.data());
      for (int r = 0; r < n; ++r) {
        if (!RowMinMax(buf.data() + static_cast<size_t>(r) * dim, dim, &lo[r], &hi[r])) {
          return NanError("v", h, t0 + r, t0 + r + 1);
        }
      }
      const size_t stat0 = static_cast<size_t>(h) * tokens + t0;
      const int bad = MakeStats(lo, hi, n, max_code, &q->zero[stat0], &q->scale[stat0], z, inv);
      if (bad >= 0) {
        uint16_t zb, sb;
        return MakeStat(lo[bad], hi[bad], max_code, BlockRef{"v", h, t0 + bad, t0 + bad + 1, -1},
                        &zb, &sb);
      }
      uint8_t* out = q->codes.data() + stat0 * row_bytes;
      for (int r = 0; r < n; ++r) {
        encode(buf.data() + static_cast<size_t>(r) * dim, &z[r], &inv[r], out + r * row_bytes,
               dim);
      }
    }
  }
  return absl::OkStatus();
}

// Checks that `q` is a consistent packed tensor of the given kind.
absl::Status CheckQuantized(const QuantizedTensor& q, const char* name, bool keys, int bits,
                            int group) {
  if (q.bits != bits) {
    return absl::InvalidArgumentError(
        absl::StrFormat("quant: %s.bits is %d, expected %d", name, q.bits, bits));
  }
  if (q.heads < 0 || q.tokens < 0 || q.dim < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "quant: %s shape [%d, %d, %d] is invalid", name, q.heads, q.tokens, q.dim));
  }
  const size_t codes = static_cast<size_t>(q.heads) * q.tokens * RowCodeBytes(q.dim, bits);
  const size_t stats = keys ? static_cast<size_t>(q.heads) * NumGroups(q.tokens, group) * q.dim
                            : static_cast<size_t>(q.heads) * q.tokens;
  if (q.codes.size() != codes || q.scale.size() != stats || q.zero.size() != stats) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "quant: %s of shape [%d, %d, %d] has %d code bytes, %d scales, %d zeros; expected %d, "
        "%d, %d",
        name, q.heads, q.tokens, q.dim, q.codes.size(), q.scale.size(), q.zero.size(), codes,
        stats, stats));
  }
  return absl::OkStatus();
}

void DequantizeKeys(const QuantizedTensor& q, int group, bool rotate, KvTensor* out) {
  const int heads = q.heads, tokens = q.tokens, dim = q.dim;
  if (static_cast<size_t>(heads) * tokens == 0) return;
  const int groups = NumGroups(tokens, group);
  const size_t row_bytes = RowCodeBytes(dim, q.bits);
  const DecodeFn decode = PickDecode<true>(q.bits);
  std::vector<float> s(dim), z(dim), row(dim);
  for (int h = 0; h < heads; ++h) {
    for (int g = 0; g < groups; ++g) {
      const size_t stat0 = (static_cast<size_t>(h) * groups + g) * dim;
      LoadF16(&q.scale[stat0], s.data(), dim);
      LoadF16(&q.zero[stat0], z.data(), dim);
      const int t0 = g * group;
      const int t1 = std::min(tokens, t0 + group);
      for (int t = t0; t < t1; ++t) {
        const uint8_t* codes = q.codes.data() + (static_cast<size_t>(h) * tokens + t) * row_bytes;
        decode(codes, s.data(), z.data(), row.data(), dim);
        if (rotate) HadamardTransform(row.data(), dim);
        StoreRow(out->dtype(), row.data(), out->row(h, t), dim);
      }
    }
  }
}

void DequantizeValues(const QuantizedTensor& q, bool rotate, KvTensor* out) {
  const int heads = q.heads, tokens = q.tokens, dim = q.dim;
  if (static_cast<size_t>(heads) * tokens == 0) return;
  const size_t row_bytes = RowCodeBytes(dim, q.bits);
  const DecodeFn decode = PickDecode<false>(q.bits);
  std::vector<float> s(tokens), z(tokens), row(dim);
  for (int h = 0; h < heads; ++h) {
    const size_t stat0 = static_cast<size_t>(h) * tokens;
    LoadF16(&q.scale[stat0], s.data(), tokens);
    LoadF16(&q.zero[stat0], z.data(), tokens);
    for (int t = 0; t < tokens; ++t) {
      decode(q.codes.data() + (stat0 + t) * row_bytes, &s[t], &z[t], row.data(), dim);
      if (rotate) HadamardTransform(row.data(), dim);
      StoreRow(out->dtype(), row.data(), out->row(h, t), dim);
    }
  }
}

}  // namespace

void HadamardTransform(float* x, int n) { HadamardTransformScaled(x, n, HadamardNorm(n)); }

void HadamardTransformScaled(float* x, int n, float norm) {
#if defined(__AVX__)
  switch (n) {
    case 8: return HadamardFixed<1>(x, norm);
    case 16: return HadamardFixed<2>(x, norm);
    case 32: return HadamardFixed<4>(x, norm);
    case 64: return HadamardFixed<8>(x, norm);
    case 128: return HadamardFixed<16>(x, norm);
    default: break;
  }
#endif
  int h = 1;
#if defined(__AVX__)
  if (n >= 8) {
    for (int i = 0; i < n; i += 8) _mm256_storeu_ps(x + i, internal::HadamardInVector(_mm256_loadu_ps(x + i)));
    for (h = 8; h < n; h *= 2) {
      for (int i = 0; i < n; i += 2 * h) {
        for (int j = i; j < i + h; j += 8) {
          const __m256 a = _mm256_loadu_ps(x + j);
          const __m256 b = _mm256_loadu_ps(x + j + h);
          _mm256_storeu_ps(x + j, _mm256_add_ps(a, b));
          _mm256_storeu_ps(x + j + h, _mm256_sub_ps(a, b));
        }
      }
    }
  }
#endif
  for (; h < n; h *= 2) {
    for (int i = 0; i < n; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
  for (int i = 0; i < n; ++i) x[i] *= norm;
}

namespace {

// What the quantization rules call each option in their messages.
struct QuantFieldNames {
  absl::string_view prefix, bits, group, rotate, head_dim;
};

// The one set of quantization rules, on values wide enough for any source.
absl::Status CheckQuant(QuantScheme scheme, int64_t bits, int64_t group, bool rotate, bool keys_channel,
                        int64_t head_dim, const QuantFieldNames& f) {
  auto bad = [&f](absl::string_view name, int64_t v, absl::string_view expected) {
    return absl::InvalidArgumentError(absl::StrCat(f.prefix, name, ": ", v, ", expected ", expected));
  };
  const bool lloyd = scheme == QuantScheme::kLloyd;
  if (lloyd) {
    if (bits < 1 || bits > 4) return bad(f.bits, bits, "1..4 (lloyd)");
  } else if (bits != 2 && bits != 4 && bits != 8) {
    return bad(f.bits, bits, "2, 4 or 8");
  }
  if ((!lloyd || keys_channel) && (group < 1 || group > kMaxQuantGroup)) {
    return bad(f.group, group, absl::StrCat("1..", kMaxQuantGroup));
  }
  if (head_dim < 1) return bad(f.head_dim, head_dim, ">= 1");
  if (lloyd && rotate) {
    return absl::InvalidArgumentError(
        absl::StrCat(f.prefix, f.rotate, " applies to int quantization only (lloyd always rotates rows)"));
  }
  if (rotate && bits == 8) {
    return absl::InvalidArgumentError(
        absl::StrCat(f.prefix, f.rotate, "=hadamard needs 4 or 2 bits, got ", f.bits, "=8"));
  }
  if ((rotate || lloyd) && !IsPowerOfTwo(head_dim)) {
    return absl::InvalidArgumentError(absl::StrCat(f.prefix, lloyd ? "lloyd" : absl::StrCat(f.rotate, "=hadamard"),
                                                   " needs a power-of-two head_dim, got ", f.head_dim, "=",
                                                   head_dim));
  }
  if (head_dim * bits % 8 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(f.prefix, f.head_dim, "*", f.bits, " must be a multiple of 8, got ",
                                                   f.head_dim, "=", head_dim, " ", f.bits, "=", bits));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateQuantOptions(const QuantOptions& opts, int head_dim) {
  const QuantFieldNames names = {"quant: ", "bits", "group", "rotate", "head_dim"};
  KVRELAY_RETURN_IF_ERROR(
      CheckQuant(opts.scheme, opts.bits, opts.group, opts.rotate, opts.keys_channel, head_dim, names));
  if (opts.v_bits == 0) return absl::OkStatus();
  if (opts.scheme != QuantScheme::kLloyd) {
    return absl::InvalidArgumentError(absl::StrCat("quant: v_bits: ", opts.v_bits, ", expected 0 (int quantizes "
                                                   "keys and values alike)"));
  }
  return CheckQuant(opts.scheme, opts.v_bits, opts.group, opts.rotate, opts.keys_channel, head_dim,
                    {"quant: ", "v_bits", "group", "rotate", "head_dim"});
}

absl::StatusOr<QuantOptions> QuantOptionsFromHeader(uint32_t bits, uint32_t group, bool rotate, uint32_t head_dim,
                                                    absl::string_view field) {
  return QuantOptionsFromHeader(QuantScheme::kInt, bits, group, rotate, false, 0, head_dim, field);
}

absl::StatusOr<QuantOptions> QuantOptionsFromHeader(QuantScheme scheme, uint32_t bits, uint32_t group, bool rotate,
                                                    bool keys_channel, uint64_t seed, uint32_t head_dim,
                                                    absl::string_view field) {
  const std::string quant_bits = absl::StrCat(field, "quant_bits"), quant_group = absl::StrCat(field, "quant_group"),
                    quant_rotate = absl::StrCat(field, "quant_rotate"), dim = absl::StrCat(field, "head_dim");
  KVRELAY_RETURN_IF_ERROR(CheckQuant(scheme, bits, group, rotate, keys_channel, head_dim,
                                     {"", quant_bits, quant_group, quant_rotate, dim}));
  QuantOptions o;
  o.scheme = scheme;
  o.bits = static_cast<int>(bits);
  o.group = static_cast<int>(group);
  o.rotate = rotate;
  o.keys_channel = keys_channel;
  o.seed = seed;
  return o;
}

QuantOptions OptionsOf(const QuantizedKv& q) {
  QuantOptions o;
  o.scheme = q.scheme;
  o.bits = q.bits;
  o.group = q.group;
  o.rotate = q.rotate;
  o.keys_channel = q.keys_channel;
  o.seed = q.seed;
  o.v_bits = q.v_bits;
  return o;
}

absl::StatusOr<QuantizedKv> QuantizeKv(const KvTensor& k, const KvTensor& v,
                                       const QuantOptions& opts) {
  if (!k.SameShape(v)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "quant: k shape [%d, %d, %d] differs from v shape [%d, %d, %d]", k.heads(), k.tokens(),
        k.dim(), v.heads(), v.tokens(), v.dim()));
  }
  KVRELAY_RETURN_IF_ERROR(ValidateQuantOptions(opts, k.dim()));
  QuantizedKv q;
  q.scheme = opts.scheme;
  q.bits = opts.bits;
  q.group = opts.group;
  q.rotate = opts.rotate;
  q.dtype = k.dtype();
  if (opts.scheme == QuantScheme::kLloyd) {
    q.keys_channel = opts.keys_channel;
    q.seed = opts.seed;
    q.v_bits = opts.v_bits == opts.bits ? 0 : opts.v_bits;
    if (!opts.keys_channel) q.group = 0;
    KVRELAY_RETURN_IF_ERROR(opts.keys_channel ? LloydQuantizeChannels(k, opts.bits, opts.group, "k", &q.k)
                                              : LloydQuantizeRows(k, opts.bits, opts.seed, "k", &q.k));
    KVRELAY_RETURN_IF_ERROR(LloydQuantizeRows(v, q.VBits(), opts.seed, "v", &q.v));
    return q;
  }
  KVRELAY_RETURN_IF_ERROR(QuantizeKeys(k, opts, &q.k));
  KVRELAY_RETURN_IF_ERROR(QuantizeValues(v, opts, &q.v));
  return q;
}

absl::Status CheckQuantizedShape(const QuantizedKv& q, int heads, int tokens, int dim) {
  KVRELAY_RETURN_IF_ERROR(ValidateQuantOptions(OptionsOf(q), dim));
  for (const QuantizedTensor* t : {&q.k, &q.v}) {
    if (t->heads != heads || t->tokens != tokens || t->dim != dim) {
      return absl::InvalidArgumentError(absl::StrFormat("quant: %s is [%d, %d, %d], expected [%d, %d, %d]",
                                                        t == &q.k ? "k" : "v", t->heads, t->tokens, t->dim, heads,
                                                        tokens, dim));
    }
  }
  if (q.scheme == QuantScheme::kLloyd) {
    KVRELAY_RETURN_IF_ERROR(CheckLloydTensor(q.k, "k", q.bits, q.keys_channel, q.group));
    return CheckLloydTensor(q.v, "v", q.VBits(), /*channel=*/false, 0);
  }
  KVRELAY_RETURN_IF_ERROR(CheckQuantized(q.k, "k", /*keys=*/true, q.bits, q.group));
  return CheckQuantized(q.v, "v", /*keys=*/false, q.bits, q.group);
}

absl::Status DequantizeKv(const QuantizedKv& q, DType dtype, KvTensor* k, KvTensor* v) {
  if (dtype != DType::kF32 && dtype != DType::kF16 && dtype != DType::kBF16) {
    return absl::InvalidArgumentError("quant: unknown output dtype");
  }
  KVRELAY_RETURN_IF_ERROR(ValidateQuantOptions(OptionsOf(q), q.k.dim));
  const bool lloyd = q.scheme == QuantScheme::kLloyd;
  if (lloyd) {
    KVRELAY_RETURN_IF_ERROR(CheckLloydTensor(q.k, "k", q.bits, q.keys_channel, q.group));
    KVRELAY_RETURN_IF_ERROR(CheckLloydTensor(q.v, "v", q.VBits(), /*channel=*/false, 0));
  } else {
    KVRELAY_RETURN_IF_ERROR(CheckQuantized(q.k, "k", /*keys=*/true, q.bits, q.group));
    KVRELAY_RETURN_IF_ERROR(CheckQuantized(q.v, "v", /*keys=*/false, q.bits, q.group));
  }
  if (q.k.heads != q.v.heads || q.k.tokens != q.v.tokens || q.k.dim != q.v.dim) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "quant: k shape [%d, %d, %d] differs from v shape [%d, %d, %d]", q.k.heads, q.k.tokens,
        q.k.dim, q.v.heads, q.v.tokens, q.v.dim));
  }
  // Every row is overwritten, so outputs that already have the right dtype
  // and shape are reused instead of reallocated.
  auto fits = [&](const KvTensor& t) {
    return t.dtype() == dtype && t.heads() == q.k.heads && t.tokens() == q.k.tokens &&
           t.dim() == q.k.dim;
  };
  if (!fits(*k)) *k = KvTensor(dtype, q.k.heads, q.k.tokens, q.k.dim);
  if (!fits(*v)) *v = KvTensor(dtype, q.v.heads, q.v.tokens, q.v.dim);
  if (lloyd) {
    if (q.keys_channel) {
      LloydDecodeChannels(q.k, q.group, k);
    } else {
      LloydDecodeRows(q.k, q.seed, k);
    }
    LloydDecodeRows(q.v, q.seed, v);
    return absl::OkStatus();
  }
  DequantizeKeys(q.k, q.group, q.rotate, k);
  DequantizeValues(q.v, q.rotate, v);
  return absl::OkStatus();
}

bool AgentsReceiveDecoded(const Message& msg) {
  for (const MessageLayer& l : msg.layers) {
    if (l.demoted || (l.quant && l.quant->scheme == QuantScheme::kLloyd)) return true;
  }
  return false;
}

namespace {

// The dense form of `msg` (DecodeLayer per layer, K/V in `dtype`), with or
// without acc: the one rule for DequantizeMessage and DecodedMessage.
absl::StatusOr<Message> Decode(const Message& msg, DType dtype, bool keep_acc) {
  Message out;
  out.policy = msg.policy;
  out.dtype = msg.dtype;
  out.kv_heads = msg.kv_heads;
  out.head_dim = msg.head_dim;
  out.n_history = msg.n_history;
  out.n_anchor = msg.n_anchor;
  out.n_kept = msg.n_kept + msg.n_demoted;
  out.n_gen = msg.n_gen;
  out.full_bytes = msg.full_bytes;
  out.next_pos = msg.next_pos;
  out.attention_error = msg.attention_error;
  out.anchor_pos = msg.anchor_pos;
  out.layers.resize(msg.layers.size());
  for (size_t l = 0; l < msg.layers.size(); ++l) {
    const MessageLayer& layer = msg.layers[l];
    if (layer.quant || layer.demoted) {
      KVRELAY_RETURN_IF_ERROR(DecodeLayer(layer, static_cast<int>(l), msg, dtype, &out.layers[l]));
    } else {
      out.layers[l] = layer;  // dense already: left as it is
    }
    if (!keep_acc) out.layers[l].acc.clear();
    out.sent_bytes += out.layers[l].SentBytes();
  }
  return out;
}

}  // namespace

absl::Status DequantizeMessage(Message* msg, DType dtype) {
  KVRELAY_ASSIGN_OR_RETURN(Message dense, Decode(*msg, dtype, /*keep_acc=*/true));
  dense.dtype = msg->dtype;  // the turn's dtype, whatever the decoded one
  *msg = std::move(dense);
  return absl::OkStatus();
}

absl::StatusOr<Message> DecodedMessage(const Message& msg) { return Decode(msg, msg.dtype, /*keep_acc=*/false); }

}  // namespace kvrelay
