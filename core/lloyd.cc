#include "core/lloyd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "core/dtype.h"
#include "core/internal/lloyd_kernels.h"

namespace kvrelay {

namespace {

// Lloyd-Max levels of N(0, 1), non-negative half (docs/FORMAT.md, step 7b).
constexpr float kLevels1[] = {0.7978846f};
constexpr float kLevels2[] = {0.4527800f, 1.5104176f};
constexpr float kLevels3[] = {0.2450942f, 0.7560053f, 1.3439093f, 2.1519456f};
constexpr float kLevels4[] = {0.1283950f, 0.3880483f, 0.6567591f, 0.9423404f,
                              1.2562312f, 1.6180464f, 2.0690172f, 2.7325895f};

size_t RowBytes(int dim, int bits) { return static_cast<size_t>(dim) * bits / 8; }
int NumGroups(int tokens, int group) { return tokens == 0 ? 0 : (tokens - 1) / group + 1; }

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
  const size_t row_bytes = RowBytes(dim, bits);
  q->bits = bits;
  q->heads = heads;
  q->tokens = tokens;
  q->dim = dim;
  q->codes.resize(static_cast<size_t>(heads) * tokens * row_bytes);
  q->scale.resize(static_cast<size_t>(heads) * tokens);
  q->zero.clear();
  const internal::LloydRowCoder coder(dim, bits, seed, x.dtype());
  const size_t rows = static_cast<size_t>(heads) * tokens;
  std::vector<float> work(2 * static_cast<size_t>(dim));
  auto transform = [&](size_t r) {
    return coder.Transform(x.row(static_cast<int>(r / tokens), static_cast<int>(r % tokens)),
                           work.data() + (r % 2) * dim);
  };
  // Row r's norm arithmetic (a long scalar chain) is issued before row r+1's
  // transform, so that the two overlap; row r is classified after both.
  double ss = rows > 0 ? transform(0) : 0;
  for (size_t r = 0; r < rows; ++r) {
    double norm = 0;
    float inv = 0;
    const internal::LloydRowOutcome outcome = internal::LloydRowCoder::Norm(ss, &norm, &q->scale[r], &inv);
    if (outcome != internal::LloydRowOutcome::kOk) {
      const int h = static_cast<int>(r / tokens), t = static_cast<int>(r % tokens);
      if (outcome == internal::LloydRowOutcome::kNonFinite) return NonFinite(tensor, h, t);
      return absl::InvalidArgumentError(absl::StrFormat(
          "lloyd: %s head %d token %d: row norm %g does not fit in fp16 (at most 65504)", tensor, h, t, norm));
    }
    if (r + 1 < rows) ss = transform(r + 1);
    coder.Classify(work.data() + (r % 2) * dim, inv, q->codes.data() + r * row_bytes);
  }
  return absl::OkStatus();
}

absl::Status LloydQuantizeChannels(const KvTensor& x, int bits, int group, const char* tensor,
                                   QuantizedTensor* q) {
  const int heads = x.heads(), tokens = x.tokens(), dim = x.dim();
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
        const uint16_t m16 = internal::F16NearestNonNegative(std::fabs(mean)) | (mean < 0 ? 0x8000 : 0);
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
        uint16_t s16 = internal::F16NearestNonNegative(std::sqrt(sq[c] / n));
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
        internal::LloydClassifyPack(row.data(), dim, bits,
                                    q->codes.data() + (static_cast<size_t>(h) * tokens + t0 + r) * row_bytes);
      }
    }
  }
  return absl::OkStatus();
}

void LloydDecodeRows(const QuantizedTensor& q, uint64_t seed, KvTensor* out) {
  const int heads = q.heads, tokens = q.tokens, dim = q.dim;
  if (static_cast<size_t>(heads) * tokens == 0) return;  // no rows, no norms
  const size_t row_bytes = RowBytes(dim, q.bits);
  const internal::LloydRowCoder coder(dim, q.bits, seed, out->dtype());
  std::vector<float> work(dim), nu(tokens);
  for (int h = 0; h < heads; ++h) {
    const size_t stat0 = static_cast<size_t>(h) * tokens;
    ToFloat(DType::kF16, q.scale.data() + stat0, nu.data(), tokens);
    for (int t = 0; t < tokens; ++t) {
      const size_t stat = stat0 + t;
      // x = sigma (H / sqrt(d)) (c * nu / sqrt(d)) = sigma H(c) * nu / d.
      coder.Decode(q.codes.data() + stat * row_bytes, nu[t] / static_cast<float>(dim), work.data(), out->row(h, t));
    }
  }
}

void LloydDecodeChannels(const QuantizedTensor& q, int group, KvTensor* out) {
  const int heads = q.heads, tokens = q.tokens, dim = q.dim;
  const size_t row_bytes = RowBytes(dim, q.bits);
  const int groups = NumGroups(tokens, group);
  std::vector<float> s(dim), z(dim), row(dim);
  for (int h = 0; h < heads; ++h) {
    for (int g = 0; g < groups; ++g) {
      const size_t stat0 = (static_cast<size_t>(h) * groups + g) * dim;
      ToFloat(DType::kF16, q.scale.data() + stat0, s.data(), dim);
      ToFloat(DType::kF16, q.zero.data() + stat0, z.data(), dim);
      const int t1 = std::min(tokens, (g + 1) * group);
      for (int t = g * group; t < t1; ++t) {
        internal::LloydDecodeChannelRow(q.codes.data() + (static_cast<size_t>(h) * tokens + t) * row_bytes, dim,
                                        q.bits, s.data(), z.data(), row.data());
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
