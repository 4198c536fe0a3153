#include "core/internal/lloyd_kernels.h"

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/internal/dtype_avx.h"
#include "gtest/gtest.h"

namespace kvrelay {
namespace internal {
namespace {

// The code of u as LloydClassifyPack defines it, in float64 from the
// codebook's float32 thresholds.
int ExpectedCode(const LloydCodebook& cb, float u) {
  const int half = cb.size / 2;
  const double a = std::fabs(static_cast<double>(u));
  int cnt = 0;
  for (int j = half; j + 1 < cb.size; ++j) cnt += a >= static_cast<double>(cb.threshold[j]) ? 1 : 0;
  return u >= 0.0f ? half + cnt : half - 1 - cnt;
}

int CodeAt(const std::vector<uint8_t>& packed, int i, int bits) {
  int c = 0;
  for (int b = 0; b < bits; ++b) {
    const int bit = i * bits + b;
    c |= ((packed[bit / 8] >> (bit % 8)) & 1) << b;
  }
  return c;
}

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

// Values on and next to every threshold, every cell edge b/3 of the 4-bit
// lookup, signed zeros, huge values, infinities and NaN, then Gaussians.
std::vector<float> HardValues(const LloydCodebook& cb, std::mt19937* rng) {
  std::vector<float> v = {0.0f, -0.0f, 1e-30f, -1e-30f, 1e30f, -1e30f, std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()};
  auto around = [&v](float x) {
    for (float s : {1.0f, -1.0f}) {
      v.push_back(s * x);
      v.push_back(s * std::nextafter(x, 0.0f));
      v.push_back(s * std::nextafter(x, 10.0f));
    }
  };
  for (int j = 0; j + 1 < cb.size; ++j) around(std::fabs(cb.threshold[j]));
  for (int b = 1; b <= 9; ++b) around(static_cast<float>(b / 3.0));
  std::normal_distribution<float> n(0.0f, 1.2f);
  while (v.size() % 32 != 8) v.push_back(n(*rng));  // leaves a tail past whole blocks of 32
  for (int i = 0; i < 256; ++i) v.push_back(n(*rng));
  return v;
}

TEST(LloydKernelsTest, ClassifyGivesTheExactCountOnBothPaths) {
  std::mt19937 rng(7);
  for (int bits = 1; bits <= 4; ++bits) {
    const LloydCodebook& cb = GetLloydCodebook(bits);
    const std::vector<float> u = HardValues(cb, &rng);
    const int n = static_cast<int>(u.size());
    ASSERT_EQ(n * bits % 8, 0);
    std::vector<uint8_t> best(n * bits / 8, 0xAA), scalar(best);
    LloydClassifyPack(u.data(), n, bits, best.data(), LloydIsa::kBest);
    LloydClassifyPack(u.data(), n, bits, scalar.data(), LloydIsa::kScalar);
    EXPECT_EQ(best, scalar) << "bits " << bits;
    for (int i = 0; i < n; ++i) {
      ASSERT_EQ(CodeAt(scalar, i, bits), ExpectedCode(cb, u[i])) << "bits " << bits << " u " << u[i];
    }
  }
}

// Every positive threshold lies inside a cell [b/3, (b+1)/3), at least 0.05
// from its edges for 4 bits (the width that uses the cells), so
// float32(3 |u|) finds the right cell or a neighbour that gives the same
// count.
TEST(LloydKernelsTest, CellsHoldAtMostOneThresholdAwayFromTheirEdges) {
  for (int bits = 1; bits <= 4; ++bits) {
    const LloydCodebook& cb = GetLloydCodebook(bits);
    int seen = 0;
    for (int j = cb.size / 2; j + 1 < cb.size; ++j) {
      const double t3 = 3.0 * cb.threshold[j];
      const double edge = std::round(t3) / 3.0;
      EXPECT_GT(std::fabs(cb.threshold[j] - edge), bits == 4 ? 0.05 : 0.01)
          << "bits " << bits << " threshold " << cb.threshold[j];
      const int cell = std::min(static_cast<int>(std::floor(t3)), 7);
      EXPECT_EQ(cb.bin_threshold[cell], cb.threshold[j]);
      ++seen;
    }
    int with = 0;
    for (int b = 0; b < 8; ++b) with += std::isinf(cb.bin_threshold[b]) ? 0 : 1;
    EXPECT_EQ(with, seen) << "bits " << bits;
  }
}

// Rows of every length, width and dtype: the AVX2 path's transform, norm,
// codes and decoded rows are the scalar path's, bit for bit.
TEST(LloydKernelsTest, RowCoderPathsAreBitIdentical) {
  std::mt19937 rng(11);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_real_distribution<float> scale(-20.0f, 12.0f);
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    const size_t esize = DTypeSize(dtype);
    for (int dim : {8, 16, 32, 64, 128, 256, 512}) {
      for (int bits = 1; bits <= 4; ++bits) {
        if (dim * bits % 8 != 0) continue;
        const uint64_t seed = 1000 + dim + bits;
        const LloydRowCoder best(dim, bits, seed, dtype, LloydIsa::kBest);
        const LloydRowCoder scalar(dim, bits, seed, dtype, LloydIsa::kScalar);
        const int row_bytes = dim * bits / 8;
        for (int r = 0; r < 40; ++r) {
          std::vector<float> xf(dim);
          const float s = std::exp2(scale(rng));
          for (float& e : xf) e = n(rng) * s;
          if (r == 0) std::fill(xf.begin(), xf.end(), 0.0f);
          if (r == 1) std::fill(xf.begin(), xf.end(), -0.0f);
          if (r == 2) xf[dim / 2] = 3e4f;  // one outlier
          std::vector<uint8_t> x(dim * esize);
          FromFloat(dtype, xf.data(), x.data(), dim);
          std::vector<float> wb(dim), ws(dim);
          const double ssb = best.Transform(x.data(), wb.data());
          const double sss = scalar.Transform(x.data(), ws.data());
          ASSERT_EQ(ssb, sss) << dim << "/" << bits << " row " << r;
          double norm = 0;
          uint16_t nu = 0;
          float inv = 0;
          if (LloydRowCoder::Norm(ssb, &norm, &nu, &inv) != LloydRowOutcome::kOk) continue;
          std::vector<uint8_t> cb(row_bytes, 0x55), cs(row_bytes, 0x55);
          best.Classify(wb.data(), inv, cb.data());
          scalar.Classify(ws.data(), inv, cs.data());
          ASSERT_EQ(cb, cs) << dim << "/" << bits << " row " << r;
          std::vector<uint8_t> db(dim * esize, 0x11), ds(dim * esize, 0x22);
          const float step = F16ToFloat(nu) / static_cast<float>(dim);
          best.Decode(cb.data(), step, wb.data(), db.data());
          scalar.Decode(cs.data(), step, ws.data(), ds.data());
          ASSERT_EQ(db, ds) << dim << "/" << bits << " row " << r;
        }
      }
    }
  }
}

#if defined(__AVX2__) && defined(__F16C__)
// The vector load and the saturating store are ToFloat and
// FromFloatSaturating, on every kind of float32: random bit patterns
// (NaNs, infinities, subnormals), the limits and their neighbours, and
// halfway cases of BF16.
TEST(LloydKernelsTest, VectorConversionsAreThoseOfDtype) {
  std::mt19937 rng(9);
  std::vector<float> v;
  for (float f : {65504.0f, 65519.0f, 65520.0f, 0x1.fep127f, 0x1.ffp127f, std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::infinity(), 1.0f + 0x1p-8f, 1.0f + 0x1p-7f + 0x1p-8f, 0.0f}) {
    v.push_back(f);
    v.push_back(-f);
  }
  while (v.size() < 4096) {
    const uint32_t b = rng();
    float f;
    std::memcpy(&f, &b, sizeof f);
    v.push_back(f);
  }
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    const size_t esize = DTypeSize(dtype);
    std::vector<float> clamped(v);
    std::vector<uint8_t> want(v.size() * esize), got(v.size() * esize);
    FromFloatSaturating(dtype, clamped.data(), want.data(), v.size());
    for (size_t i = 0; i < v.size(); i += 8) {
      const __m256 x = _mm256_loadu_ps(v.data() + i);
      switch (dtype) {
        case DType::kF32: StoreSaturating8<DType::kF32>(x, got.data(), static_cast<int>(i)); break;
        case DType::kF16: StoreSaturating8<DType::kF16>(x, got.data(), static_cast<int>(i)); break;
        case DType::kBF16: StoreSaturating8<DType::kBF16>(x, got.data(), static_cast<int>(i)); break;
      }
    }
    ASSERT_EQ(got, want) << DTypeName(dtype);
    std::vector<float> back(v.size());
    ToFloat(dtype, want.data(), back.data(), v.size());
    for (size_t i = 0; i < v.size(); i += 8) {
      __m256 x;
      switch (dtype) {
        case DType::kF32: x = LoadAsFloat8<DType::kF32>(want.data(), static_cast<int>(i)); break;
        case DType::kF16: x = LoadAsFloat8<DType::kF16>(want.data(), static_cast<int>(i)); break;
        default: x = LoadAsFloat8<DType::kBF16>(want.data(), static_cast<int>(i)); break;
      }
      alignas(32) float l[8];
      _mm256_store_ps(l, x);
      for (int k = 0; k < 8; ++k) ASSERT_EQ(Bits(l[k]), Bits(back[i + k])) << DTypeName(dtype) << " " << i + k;
    }
  }
}
#endif

TEST(LloydKernelsTest, ChannelDecodePathsAreBitIdentical) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> byte(0, 255);
  std::normal_distribution<float> n(0.0f, 3.0f);
  for (int dim : {8, 24, 64, 128, 200}) {
    for (int bits = 1; bits <= 4; ++bits) {
      if (dim * bits % 8 != 0) continue;
      std::vector<uint8_t> codes(dim * bits / 8);
      for (uint8_t& c : codes) c = static_cast<uint8_t>(byte(rng));
      std::vector<float> s(dim), z(dim), best(dim), scalar(dim);
      for (int c = 0; c < dim; ++c) {
        s[c] = std::fabs(n(rng));
        z[c] = n(rng);
      }
      LloydDecodeChannelRow(codes.data(), dim, bits, s.data(), z.data(), best.data(), LloydIsa::kBest);
      LloydDecodeChannelRow(codes.data(), dim, bits, s.data(), z.data(), scalar.data(), LloydIsa::kScalar);
      const LloydCodebook& cb = GetLloydCodebook(bits);
      for (int c = 0; c < dim; ++c) {
        ASSERT_EQ(Bits(best[c]), Bits(scalar[c])) << dim << "/" << bits << " channel " << c;
        ASSERT_EQ(Bits(scalar[c]), Bits(std::fma(cb.level[CodeAt(codes, c, bits)], s[c], z[c])));
      }
    }
  }
}

// The nearest fp16 by exhaustive comparison in float64 (ties to even).
uint16_t NearestF16Slow(double x) {
  uint16_t best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  // Binary search for the neighbourhood, then compare three candidates.
  int lo = 0, hi = 0x7bff;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (static_cast<double>(F16ToFloat(static_cast<uint16_t>(mid))) <= x) lo = mid; else hi = mid - 1;
  }
  for (int c = lo - 1; c <= lo + 1; ++c) {
    if (c < 0 || c > 0x7bff) continue;
    const double err = std::fabs(static_cast<double>(F16ToFloat(static_cast<uint16_t>(c))) - x);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best = static_cast<uint16_t>(c);
      best_err = err;
    }
  }
  // Past 65504 by half an ulp (65520) or more: inf.
  if (x >= 65520.0) return 0x7c00;
  return best;
}

TEST(LloydKernelsTest, F16NearestIsExactAtAndAroundHalfwayPoints) {
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<double> e(-26.0, 16.5);
  std::vector<double> xs = {0.0, 65504.0, 65519.99, std::nextafter(65520.0, 0.0), 65520.0, 70000.0, 5.9604644775390625e-8, 2.98e-8};
  for (int h = 1; h < 0x7bff; h += 7) {
    const double a = F16ToFloat(static_cast<uint16_t>(h)), b = F16ToFloat(static_cast<uint16_t>(h + 1));
    const double mid = (a + b) / 2;
    xs.push_back(mid);
    xs.push_back(std::nextafter(mid, 0.0));
    xs.push_back(std::nextafter(mid, 1e9));
    xs.push_back(mid + (b - a) * 1e-9);  // rounds to mid in float32, but lies above it
    xs.push_back(mid - (b - a) * 1e-9);
  }
  for (int i = 0; i < 20000; ++i) xs.push_back(std::exp2(e(rng)));
  for (double x : xs) ASSERT_EQ(F16NearestNonNegative(x), NearestF16Slow(x)) << x;
}

}  // namespace
}  // namespace internal
}  // namespace kvrelay
