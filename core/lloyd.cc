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

// codes[i] = number of thresholds <= u[i]. Loops over thresholds outside so
// the inner loop vectorizes.
void Classify(const Codebook& cb, const float* u, uint8_t* codes, int n) {
  std::fill(codes, codes + n, 0);
  for (int j = 0; j + 1 < cb.size; ++j) {
    const float t = cb.threshold[j];
    for (int i = 0; i < n; ++i) codes[i] += u[i] >= t ? 1 : 0;
  }
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
  const double sqrt_d = std::sqrt(static_cast<double>(dim));
  for (int h = 0; h < heads; ++h) {
    for (int t = 0; t < tokens; ++t) {
      ToFloat(x.dtype(), x.row(h, t), row.data(), dim);
      double ss = 0;
      for (int i = 0; i < dim; ++i) ss += static_cast<double>(row[i]) * row[i];
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
      const float nuf = F16ToFloat(nu);
      const float f = nuf == 0.0f ? 0.0f : static_cast<float>(sqrt_d / nuf);
      for (int i = 0; i < dim; ++i) row[i] *= signs[i];
      HadamardTransform(row.data(), dim);
      for (int i = 0; i < dim; ++i) row[i] *= f;
      Classify(cb, row.data(), codes.data(), dim);
      Pack(codes.data(), dim, bits, q->codes.data() + stat * row_bytes);
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
        Classify(cb, row.data(), codes.data(), dim);
        Pack(codes.data(), dim, bits, q->codes.data() + (static_cast<size_t>(h) * tokens + t0 + r) * row_bytes);
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
  const double sqrt_d = std::sqrt(static_cast<double>(dim));
  for (int h = 0; h < heads; ++h) {
    for (int t = 0; t < tokens; ++t) {
      const size_t stat = static_cast<size_t>(h) * tokens + t;
      Unpack(q.codes.data() + stat * row_bytes, dim, q.bits, codes.data());
      const float step = static_cast<float>(F16ToFloat(q.scale[stat]) / sqrt_d);
      for (int i = 0; i < dim; ++i) row[i] = cb.level[codes[i]] * step;
      HadamardTransform(row.data(), dim);
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
