#include "core/lloyd.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "core/dtype.h"
#include "core/quant.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvrelay {

namespace {

// Lloyd-Max levels of N(0, 1), non-negative half (docs/FORMAT.md, step 7b).
constexpr float kLevels1[] = {0.7978846f};
constexpr float kLevels2[] = {0.4527800f, 1.5104176f};
constexpr float kLevels3[] = {0.2450942f, 0.7560053f, 1.3439093f, 2.1519456f};
constexpr float kLevels4[] = {0.1283950f, 0.3880483f, 0.6567591f, 0.9423404f,
                              1.2562312f, 1.6180464f, 2.0690172f, 2.7325895f};

// The full codebook of one width: 2^bits levels ascending, and the
// 2^bits - 1 thresholds between them (midpoints in float64, rounded to
// float32).
struct Codebook {
  int bits = 0;
  int size = 0;
  std::array<float, 16> level{};
  std::array<float, 15> threshold{};
};

Codebook MakeCodebook(int bits) {
  Codebook cb;
  cb.bits = bits;
  cb.size = 1 << bits;
  absl::Span<const float> half = LloydLevels(bits);
  const int m = static_cast<int>(half.size());
  for (int i = 0; i < m; ++i) {
    cb.level[m - 1 - i] = -half[i];
    cb.level[m + i] = half[i];
  }
  for (int j = 0; j + 1 < cb.size; ++j) {
    cb.threshold[j] =
        static_cast<float>((static_cast<double>(cb.level[j]) + static_cast<double>(cb.level[j + 1])) / 2);
  }
  return cb;
}

const Codebook& GetCodebook(int bits) {
  static const std::array<Codebook, 5> books = {Codebook{}, MakeCodebook(1), MakeCodebook(2), MakeCodebook(3),
                                                MakeCodebook(4)};
  return books[bits];
}

size_t RowBytes(int dim, int bits) { return static_cast<size_t>(dim) * bits / 8; }
int NumGroups(int tokens, int group) { return tokens == 0 ? 0 : (tokens - 1) / group + 1; }

// The code of u: with half = 2^(bits-1) and a = |u|, cnt = the number of
// the positive thresholds t_{half}, ..., t_{2half-2} that a reaches (a >=
// t); code = half + cnt for u >= 0, half - 1 - cnt otherwise. This is the
// number of thresholds <= u except for u exactly on a negative threshold
// (FORMAT.md leaves values within rounding of a threshold either code).
// The vector and scalar paths decide alike.
void Classify(const Codebook& cb, const float* u, uint8_t* codes, int n) {
  const int half = cb.size / 2;
  const float* tp = cb.threshold.data() + half;  // the half - 1 positive thresholds
  int i = 0;
#if defined(__AVX2__)
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i vhalf = _mm256_set1_epi32(half), vhalf1 = _mm256_set1_epi32(half - 1);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(u + i);
    const __m256 a = _mm256_and_ps(x, abs_mask);
    __m256i cnt = _mm256_setzero_si256();
    for (int j = 0; j + 1 < half; ++j) {
      cnt = _mm256_sub_epi32(cnt, _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(tp[j]), _CMP_GE_OQ)));
    }
    const __m256 pos = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ);
    const __m256i c = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(_mm256_sub_epi32(vhalf1, cnt)),
                                                           _mm256_castsi256_ps(_mm256_add_epi32(vhalf, cnt)), pos));
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i), _mm_packus_epi16(w, w));
  }
#endif
  for (; i < n; ++i) {
    const float a = std::fabs(u[i]);
    int cnt = 0;
    for (int j = 0; j + 1 < half; ++j) cnt += a >= tp[j] ? 1 : 0;
    codes[i] = static_cast<uint8_t>(u[i] >= 0.0f ? half + cnt : half - 1 - cnt);
  }
}

// out[i] = level[codes[i]] * step.
void Levels(const Codebook& cb, const uint8_t* codes, float step, float* out, int n) {
  int i = 0;
#if defined(__AVX2__)
  const __m256 lo = _mm256_loadu_ps(cb.level.data()), hi = _mm256_loadu_ps(cb.level.data() + 8);
  const __m256 vs = _mm256_set1_ps(step);
  const __m256i seven = _mm256_set1_epi32(7);
  for (; i + 8 <= n; i += 8) {
    const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
    const __m256 l = _mm256_permutevar8x32_ps(lo, idx), h = _mm256_permutevar8x32_ps(hi, idx);
    const __m256 v = _mm256_blendv_ps(l, h, _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, seven)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(v, vs));
  }
#endif
  for (; i < n; ++i) out[i] = cb.level[codes[i]] * step;
}

// Sum of squares in float64 (any order: the result is rounded to fp16).
double SumSquares(const float* x, int n) {
  int i = 0;
  double total = 0;
#if defined(__AVX2__)
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  for (; i + 8 <= n; i += 8) {
    const __m256d lo = _mm256_cvtps_pd(_mm_loadu_ps(x + i)), hi = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4));
    a0 = _mm256_add_pd(a0, _mm256_mul_pd(lo, lo));
    a1 = _mm256_add_pd(a1, _mm256_mul_pd(hi, hi));
  }
  alignas(32) double t[4];
  _mm256_store_pd(t, _mm256_add_pd(a0, a1));
  total = (t[0] + t[1]) + (t[2] + t[3]);
#endif
  for (; i < n; ++i) total += static_cast<double>(x[i]) * x[i];
  return total;
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

void Unpack(const uint8_t* in, int n, int bits, uint8_t* codes) {
  if (bits == 4) {
    for (int i = 0; i < n / 2; ++i) {
      codes[2 * i] = in[i] & 0xF;
      codes[2 * i + 1] = in[i] >> 4;
    }
    return;
  }
  if (bits == 2) {
    for (int i = 0; i < n / 4; ++i) {
      for (int k = 0; k < 4; ++k) codes[4 * i + k] = (in[i] >> (2 * k)) & 3;
    }
    return;
  }
  const uint32_t mask = (1u << bits) - 1;
  for (int i = 0; i < n / 8; ++i) {
    uint32_t w = 0;
    for (int b = 0; b < bits; ++b) w |= static_cast<uint32_t>(in[i * bits + b]) << (8 * b);
    for (int k = 0; k < 8; ++k) codes[8 * i + k] = static_cast<uint8_t>((w >> (k * bits)) & mask);
  }
}

// fp16 nearest (ties to even) to a non-negative float64; 0x7c00 (inf) past
// the fp16 range.
uint16_t F16Nearest(double x) {
  uint16_t h = FloatToF16(static_cast<float>(x));
  if ((h & 0x7fff) >= 0x7c00) {
    // Rounding to float32 first cannot cross 65520 (the fp16 overflow
    // threshold) wrongly: 65520 is exact in float32.
    return 0x7c00;
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

// Classify + Pack of one row: eight codes at a time, packed into `bits`
// bytes by shifting each lane to its place (codes never overlap, so the sum
// of the lanes is their OR).
template <int kBits>
void ClassifyPackBits(const Codebook& cb, const float* u, uint8_t* out, int n, uint8_t* scratch) {
  int i = 0;
#if defined(__AVX2__)
  constexpr int bits = kBits;
  constexpr int half = 1 << (kBits - 1);
  const float* tp = cb.threshold.data() + half;
  __m256 tv[half > 1 ? half - 1 : 1];
  for (int j = 0; j + 1 < half; ++j) tv[j] = _mm256_set1_ps(tp[j]);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i vhalf = _mm256_set1_epi32(half), vhalf1 = _mm256_set1_epi32(half - 1);
  const __m256i shifts = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(bits));
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(u + i);
    const __m256 a = _mm256_and_ps(x, abs_mask);
    __m256i cnt = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j + 1 < half; ++j) {
      cnt = _mm256_sub_epi32(cnt, _mm256_castps_si256(_mm256_cmp_ps(a, tv[j], _CMP_GE_OQ)));
    }
    const __m256 pos = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ);
    const __m256i c = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(_mm256_sub_epi32(vhalf1, cnt)),
                                                           _mm256_castsi256_ps(_mm256_add_epi32(vhalf, cnt)), pos));
    __m256i v = _mm256_sllv_epi32(c, shifts);
    v = _mm256_add_epi32(v, _mm256_permute2x128_si256(v, v, 1));
    v = _mm256_add_epi32(v, _mm256_shuffle_epi32(v, 0x4E));
    v = _mm256_add_epi32(v, _mm256_shuffle_epi32(v, 0xB1));
    const uint32_t word = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm256_castsi256_si128(v)));
    std::memcpy(out + static_cast<size_t>(i) * bits / 8, &word, bits);  // little-endian
  }
#endif
  if (i < n) {
    Classify(cb, u + i, scratch, n - i);
    Pack(scratch, n - i, cb.bits, out + static_cast<size_t>(i) * cb.bits / 8);
  }
}

// Unpack + Levels of one row.
template <int kBits>
void UnpackLevelsBits(const Codebook& cb, const uint8_t* in, float step, float* out, int n, uint8_t* scratch) {
  int i = 0;
#if defined(__AVX2__)
  constexpr int bits = kBits;
  const __m256 lo = _mm256_loadu_ps(cb.level.data()), hi = _mm256_loadu_ps(cb.level.data() + 8);
  const __m256 vs = _mm256_set1_ps(step);
  const __m256i seven = _mm256_set1_epi32(7), mask = _mm256_set1_epi32((1 << bits) - 1);
  const __m256i shifts = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(bits));
  for (; i + 8 <= n; i += 8) {
    uint32_t word = 0;
    std::memcpy(&word, in + static_cast<size_t>(i) * bits / 8, bits);
    const __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), shifts), mask);
    const __m256 l = _mm256_permutevar8x32_ps(lo, idx), h = _mm256_permutevar8x32_ps(hi, idx);
    const __m256 v = _mm256_blendv_ps(l, h, _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, seven)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(v, vs));
  }
#endif
  if (i < n) {
    Unpack(in + static_cast<size_t>(i) * cb.bits / 8, n - i, cb.bits, scratch);
    Levels(cb, scratch, step, out + i, n - i);
  }
}

void ClassifyPack(const Codebook& cb, const float* u, uint8_t* out, int n, uint8_t* scratch) {
  switch (cb.bits) {
    case 1: return ClassifyPackBits<1>(cb, u, out, n, scratch);
    case 2: return ClassifyPackBits<2>(cb, u, out, n, scratch);
    case 3: return ClassifyPackBits<3>(cb, u, out, n, scratch);
    default: return ClassifyPackBits<4>(cb, u, out, n, scratch);
  }
}

void UnpackLevels(const Codebook& cb, const uint8_t* in, float step, float* out, int n, uint8_t* scratch) {
  switch (cb.bits) {
    case 1: return UnpackLevelsBits<1>(cb, in, step, out, n, scratch);
    case 2: return UnpackLevelsBits<2>(cb, in, step, out, n, scratch);
    case 3: return UnpackLevelsBits<3>(cb, in, step, out, n, scratch);
    default: return UnpackLevelsBits<4>(cb, in, step, out, n, scratch);
  }
}

absl::Status NonFinite(const char* tensor, int h, int t) {
  return absl::InvalidArgumentError(
      absl::StrFormat("lloyd: %s head %d token %d: non-finite value", tensor, h, t));
}

}  // namespace

absl::Span<const float> LloydLevels(int bits) {
  switch (bits) {
    case 1: return kLevels1;
    case 2: return kLevels2;
    case 3: return kLevels3;
    default: return kLevels4;
  }
}

void LloydSigns(uint64_t seed, int dim, float* signs) {
  uint64_t state = seed, z = 0;
  for (int i = 0; i < dim; ++i) {
    if (i % 64 == 0) {
      state += 0x9e3779b97f4a7c15ull;
      z = state;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      z ^= z >> 31;
    }
    signs[i] = ((z >> (i % 64)) & 1) ? -1.0f : 1.0f;
  }
}

absl::Status LloydQuantizeRows(const KvTensor& x, int bits, uint64_t seed, const char* tensor,
                               QuantizedTensor* q) {
  const int heads = x.heads(), tokens = x.tokens(), dim = x.dim();
  const Codebook& cb = GetCodebook(bits);
  const size_t row_bytes = RowBytes(dim, bits);
  q->bits = bits;
  q->heads = heads;
  q->tokens = tokens;
  q->dim = dim;
  q->codes.assign(static_cast<size_t>(heads) * tokens * row_bytes, 0);
  q->scale.assign(static_cast<size_t>(heads) * tokens, 0);
  q->zero.clear();
  std::vector<float> signs(dim), row(dim);
  std::vector<uint8_t> codes(dim);
  LloydSigns(seed, dim, signs.data());
  for (int h = 0; h < heads; ++h) {
    for (int t = 0; t < tokens; ++t) {
      ToFloat(x.dtype(), x.row(h, t), row.data(), dim);
      const double ss = SumSquares(row.data(), dim);
      if (!std::isfinite(ss)) {
        // A finite float32 squared can overflow float64 only past 1e154,
        // which no float32 reaches; so this is NaN or Inf in the row.
        return NonFinite(tensor, h, t);
      }
      const uint16_t nu = F16Nearest(std::sqrt(ss));
      if (nu == 0x7c00) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "lloyd: %s head %d token %d: row norm %g does not fit in fp16 (at most 65504)", tensor, h, t,
            std::sqrt(ss)));
      }
      const size_t stat = static_cast<size_t>(h) * tokens + t;
      q->scale[stat] = nu;
      // u = (H / sqrt(d)) (sigma x) * sqrt(d) / nu = H (sigma x) / nu.
      const float nuf = F16ToFloat(nu);
      const float f = nuf == 0.0f ? 0.0f : static_cast<float>(1.0 / nuf);
      for (int i = 0; i < dim; ++i) row[i] *= signs[i];
      HadamardTransformScaled(row.data(), dim, f);
      ClassifyPack(cb, row.data(), q->codes.data() + stat * row_bytes, dim, codes.data());
    }
  }
  return absl::OkStatus();
}

absl::Status LloydQuantizeChannels(const KvTensor& x, int bits, int group, const char* tensor,
                                   QuantizedTensor* q) {
  const int heads = x.heads(), tokens = x.tokens(), dim = x.dim();
  const Codebook& cb = GetCodebook(bits);
  const size_t row_bytes = RowBytes(dim, bits);
  const int groups = NumGroups(tokens, group);
  q->bits = bits;
  q->heads = heads;
  q->tokens = tokens;
  q->dim = dim;
  q->codes.assign(static_cast<size_t>(heads) * tokens * row_bytes, 0);
  q->scale.assign(static_cast<size_t>(heads) * groups * dim, 0);
  q->zero.assign(q->scale.size(), 0);
  std::vector<float> block, mu(dim), inv(dim), row(dim);
  std::vector<double> sum(dim), sq(dim);
  std::vector<uint8_t> codes(dim);
  for (int h = 0; h < heads; ++h) {
    for (int g = 0; g < groups; ++g) {
      const int t0 = g * group, n = std::min(group, tokens - t0);
      block.resize(static_cast<size_t>(n) * dim);
      ToFloat(x.dtype(), x.row(h, t0), block.data(), block.size());
      std::fill(sum.begin(), sum.end(), 0.0);
      for (int r = 0; r < n; ++r) {
        for (int c = 0; c < dim; ++c) sum[c] += block[static_cast<size_t>(r) * dim + c];
      }
      const size_t stat0 = (static_cast<size_t>(h) * groups + g) * dim;
      for (int c = 0; c < dim; ++c) {
        if (!std::isfinite(sum[c])) return NonFinite(tensor, h, t0);
        const double mean = sum[c] / n;
        const uint16_t m16 = F16Nearest(std::fabs(mean)) | (mean < 0 ? 0x8000 : 0);
        if ((m16 & 0x7fff) == 0x7c00) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "lloyd: %s head %d channel %d tokens [%d, %d): mean %g does not fit in fp16", tensor, h, c, t0,
              t0 + n, mean));
        }
        q->zero[stat0 + c] = m16;
        mu[c] = F16ToFloat(m16);
        sq[c] = 0;
      }
      for (int r = 0; r < n; ++r) {
        for (int c = 0; c < dim; ++c) {
          const double e = static_cast<double>(block[static_cast<size_t>(r) * dim + c]) - mu[c];
          sq[c] += e * e;
        }
      }
      for (int c = 0; c < dim; ++c) {
        uint16_t s16 = F16Nearest(std::sqrt(sq[c] / n));
        if (s16 == 0x7c00) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "lloyd: %s head %d channel %d tokens [%d, %d): rms %g does not fit in fp16", tensor, h, c, t0, t0 + n,
              std::sqrt(sq[c] / n)));
        }
        if (s16 == 0) s16 = 0x0001;  // the smallest fp16 subnormal
        q->scale[stat0 + c] = s16;
        inv[c] = 1.0f / F16ToFloat(s16);
      }
      for (int r = 0; r < n; ++r) {
        const float* xr = block.data() + static_cast<size_t>(r) * dim;
        for (int c = 0; c < dim; ++c) row[c] = (xr[c] - mu[c]) * inv[c];
        ClassifyPack(cb, row.data(), q->codes.data() + (static_cast<size_t>(h) * tokens + t0 + r) * row_bytes, dim,
                     codes.data());
      }
    }
  }
  return absl::OkStatus();
}

void LloydDecodeRows(const QuantizedTensor& q, uint64_t seed, KvTensor* out) {
  const int heads = q.heads, tokens = q.tokens, dim = q.dim;
  const Codebook& cb = GetCodebook(q.bits);
  const size_t row_bytes = RowBytes(dim, q.bits);
  std::vector<float> signs(dim), row(dim);
  std::vector<uint8_t> codes(dim);
  LloydSigns(seed, dim, signs.data());
  for (int h = 0; h < heads; ++h) {
    for (int t = 0; t < tokens; ++t) {
      const size_t stat = static_cast<size_t>(h) * tokens + t;
      // x = sigma (H / sqrt(d)) (c * nu / sqrt(d)) = sigma H(c) * nu / d.
      UnpackLevels(cb, q.codes.data() + stat * row_bytes, 1.0f, row.data(), dim, codes.data());
      HadamardTransformScaled(row.data(), dim, static_cast<float>(F16ToFloat(q.scale[stat]) / dim));
      for (int i = 0; i < dim; ++i) row[i] *= signs[i];
      FromFloatSaturating(out->dtype(), row.data(), out->row(h, t), dim);
    }
  }
}

void LloydDecodeChannels(const QuantizedTensor& q, int group, KvTensor* out) {
  const int heads = q.heads, tokens = q.tokens, dim = q.dim;
  const Codebook& cb = GetCodebook(q.bits);
  const size_t row_bytes = RowBytes(dim, q.bits);
  const int groups = NumGroups(tokens, group);
  std::vector<float> s(dim), z(dim), row(dim);
  std::vector<uint8_t> codes(dim);
  for (int h = 0; h < heads; ++h) {
    for (int g = 0; g < groups; ++g) {
      const size_t stat0 = (static_cast<size_t>(h) * groups + g) * dim;
      ToFloat(DType::kF16, &q.scale[stat0], s.data(), dim);
      ToFloat(DType::kF16, &q.zero[stat0], z.data(), dim);
      const int t1 = std::min(tokens, (g + 1) * group);
      for (int t = g * group; t < t1; ++t) {
        Unpack(q.codes.data() + (static_cast<size_t>(h) * tokens + t) * row_bytes, dim, q.bits, codes.data());
        for (int c = 0; c < dim; ++c) row[c] = std::fma(cb.level[codes[c]], s[c], z[c]);
        FromFloatSaturating(out->dtype(), row.data(), out->row(h, t), dim);
      }
    }
  }
}

absl::Status CheckLloydTensor(const QuantizedTensor& q, const char* name, int bits, bool channel, int group) {
  if (q.bits != bits) {
    return absl::InvalidArgumentError(absl::StrFormat("lloyd: %s.bits is %d, expected %d", name, q.bits, bits));
  }
  if (q.heads < 0 || q.tokens < 0 || q.dim < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("lloyd: %s shape [%d, %d, %d] is invalid", name, q.heads, q.tokens, q.dim));
  }
  const size_t codes = static_cast<size_t>(q.heads) * q.tokens * RowBytes(q.dim, bits);
  const size_t stats = channel ? static_cast<size_t>(q.heads) * NumGroups(q.tokens, group) * q.dim
                               : static_cast<size_t>(q.heads) * q.tokens;
  const size_t zeros = channel ? stats : 0;
  if (q.codes.size() != codes || q.scale.size() != stats || q.zero.size() != zeros) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "lloyd: %s of shape [%d, %d, %d] has %d code bytes, %d scales, %d zeros; expected %d, %d, %d", name, q.heads,
        q.tokens, q.dim, q.codes.size(), q.scale.size(), q.zero.size(), codes, stats, zeros));
  }
  return absl::OkStatus();
}

}  // namespace kvrelay
