// Tests of core/quant.h: error bounds, byte accounting, bit layout, fp16
// directed rounding, the Walsh-Hadamard rotation and every bad input.
#include "core/quant.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/dtype.h"
#include "core/message.h"
#include "core/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvrelay {
namespace {

using ::testing::HasSubstr;

constexpr DType kDTypes[] = {DType::kF32, DType::kF16, DType::kBF16};

// ---------------------------------------------------------------------------
// Independent helpers (scalar, float64 where it matters).

std::vector<float> ReadAll(const KvTensor& t) {
  std::vector<float> out(t.elements());
  for (int h = 0; h < t.heads(); ++h) {
    for (int s = 0; s < t.tokens(); ++s) {
      t.ReadRow(h, s, out.data() + (static_cast<size_t>(h) * t.tokens() + s) * t.dim());
    }
  }
  return out;
}

KvTensor FromValues(DType dtype, int heads, int tokens, int dim, const std::vector<float>& x) {
  KvTensor t(dtype, heads, tokens, dim);
  for (int h = 0; h < heads; ++h) {
    for (int s = 0; s < tokens; ++s) {
      t.WriteRow(h, s, x.data() + (static_cast<size_t>(h) * tokens + s) * dim);
    }
  }
  return t;
}

// Random KV-like data: per-channel magnitudes with a few outlier channels
// and a per-tensor offset, so statistics differ between channels and rows.
KvTensor RandomKv(std::mt19937_64& rng, DType dtype, int heads, int tokens, int dim) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(0.05f, 3.0f);
  std::vector<float> chan_scale(dim), chan_shift(dim);
  for (int c = 0; c < dim; ++c) {
    chan_scale[c] = uni(rng) * (rng() % 16 == 0 ? 20.0f : 1.0f);
    chan_shift[c] = normal(rng);
  }
  std::vector<float> x(static_cast<size_t>(heads) * tokens * dim);
  for (size_t i = 0; i < x.size(); ++i) {
    const int c = static_cast<int>(i % dim);
    x[i] = chan_shift[c] + chan_scale[c] * normal(rng);
  }
  return FromValues(dtype, heads, tokens, dim, x);
}

// Element i of row (h, t), read bit by bit from the documented layout.
uint32_t UnpackRef(const QuantizedTensor& q, int h, int t, int i) {
  const size_t row_bytes = static_cast<size_t>(q.dim) * q.bits / 8;
  const uint8_t* row = q.codes.data() + (static_cast<size_t>(h) * q.tokens + t) * row_bytes;
  uint32_t c = 0;
  for (int b = 0; b < q.bits; ++b) {
    const int bit = i * q.bits + b;
    if ((row[bit / 8] >> (bit % 8)) & 1) c |= 1u << b;
  }
  return c;
}

// Packs one row of codes bit by bit, LSB first.
std::vector<uint8_t> PackRef(const std::vector<uint32_t>& codes, int bits) {
  std::vector<uint8_t> out(codes.size() * bits / 8, 0);
  for (size_t i = 0; i < codes.size(); ++i) {
    for (int b = 0; b < bits; ++b) {
      if ((codes[i] >> b) & 1) {
        const size_t bit = i * bits + b;
        out[bit / 8] |= static_cast<uint8_t>(1u << (bit % 8));
      }
    }
  }
  return out;
}

int Groups(int tokens, int group) { return (tokens + group - 1) / group; }

// Index of the statistic of element (h, t, c).
size_t StatIndex(const QuantizedKv& q, bool keys, int h, int t, int c) {
  const QuantizedTensor& x = keys ? q.k : q.v;
  if (keys) return (static_cast<size_t>(h) * Groups(x.tokens, q.group) + t / q.group) * x.dim + c;
  return static_cast<size_t>(h) * x.tokens + t;
}

// Sylvester Walsh-Hadamard matrix H_n / sqrt(n), float64, row-major.
std::vector<double> SylvesterHadamard(int n) {
  std::vector<double> m(1, 1.0);
  for (int size = 1; size < n; size *= 2) {
    std::vector<double> next(4 * size * size);
    for (int r = 0; r < size; ++r) {
      for (int c = 0; c < size; ++c) {
        const double v = m[r * size + c];
        next[r * 2 * size + c] = v;
        next[r * 2 * size + c + size] = v;
        next[(r + size) * 2 * size + c] = v;
        next[(r + size) * 2 * size + c + size] = -v;
      }
    }
    m.swap(next);
  }
  for (double& v : m) v /= std::sqrt(static_cast<double>(n));
  return m;
}

// The encoder's input domain: rows read as f32, rotated when `rotate`.
std::vector<float> EncoderDomain(const KvTensor& t, bool rotate) {
  std::vector<float> x = ReadAll(t);
  if (rotate) {
    for (size_t r = 0; r + t.dim() <= x.size() && t.dim() > 0; r += t.dim()) {
      HadamardTransform(x.data() + r, t.dim());
    }
  }
  return x;
}

// Checks one quantized tensor against the contract in quant.h, elementwise
// in the encoder's domain: z <= block min, s the smallest fp16 with
// s*(2^b-1) >= max - z (and >= the smallest subnormal), z the largest fp16
// <= min, codes in range, |code*s + z - x| <= s/2 up to f32 rounding.
void CheckTensorBounds(const QuantizedKv& q, bool keys, const KvTensor& orig,
                       const std::string& ctx) {
  const QuantizedTensor& qt = keys ? q.k : q.v;
  const std::vector<float> x = EncoderDomain(orig, q.rotate);
  const int heads = qt.heads, tokens = qt.tokens, dim = qt.dim;
  const double max_code = (1 << q.bits) - 1;
  const size_t stats = keys ? static_cast<size_t>(heads) * Groups(tokens, q.group) * dim
                            : static_cast<size_t>(heads) * tokens;
  std::vector<double> lo(stats, std::numeric_limits<double>::infinity());
  std::vector<double> hi(stats, -std::numeric_limits<double>::infinity());
  for (int h = 0; h < heads; ++h) {
    for (int t = 0; t < tokens; ++t) {
      for (int c = 0; c < dim; ++c) {
        const size_t si = StatIndex(q, keys, h, t, c);
        const double xv = x[(static_cast<size_t>(h) * tokens + t) * dim + c];
        lo[si] = std::min(lo[si], xv);
        hi[si] = std::max(hi[si], xv);
      }
    }
  }
  int failures = 0;
  for (size_t si = 0; si < stats && failures < 5; ++si) {
    const double z = F16ToFloat(qt.zero[si]);
    const double s = F16ToFloat(qt.scale[si]);
    ASSERT_TRUE(std::isfinite(z) && std::isfinite(s)) << ctx;
    EXPECT_GE(s, std::ldexp(1.0, -24)) << ctx << " stat " << si;
    EXPECT_LE(z, lo[si]) << ctx << " stat " << si;
    EXPECT_GE(s * max_code, hi[si] - z) << ctx << " stat " << si;
    // Tightness: the next fp16 above z is > min; the one below s is too small.
    const uint16_t zb = qt.zero[si];
    const uint16_t z_up = zb == 0x8000 ? 0x0001 : (zb & 0x8000) ? zb - 1 : zb + 1;
    EXPECT_GT(F16ToFloat(z_up), lo[si]) << ctx << " stat " << si;
    if (qt.scale[si] > 0x0001) {
      const double s_down = F16ToFloat(static_cast<uint16_t>(qt.scale[si] - 1));
      EXPECT_LT(s_down * max_code, hi[si] - z) << ctx << " stat " << si;
    }
    if (::testing::Test::HasFailure()) ++failures;
  }
  failures = 0;
  for (int h = 0; h < heads && failures < 5; ++h) {
    for (int t = 0; t < tokens && failures < 5; ++t) {
      for (int c = 0; c < dim; ++c) {
        const size_t si = StatIndex(q, keys, h, t, c);
        const double z = F16ToFloat(qt.zero[si]);
        const double s = F16ToFloat(qt.scale[si]);
        const uint32_t code = UnpackRef(qt, h, t, c);
        const double xv = x[(static_cast<size_t>(h) * tokens + t) * dim + c];
        const double err = std::fabs(code * s + z - xv);
        const double slack = 1e-6 * (std::fabs(xv) + std::fabs(z) + max_code * s) + 1e-7;
        if (code > max_code || err > s / 2 + slack) {
          ADD_FAILURE() << ctx << (keys ? " k" : " v") << " [" << h << "," << t << "," << c
                        << "] x=" << xv << " code=" << code << " s=" << s << " z=" << z
                        << " err=" << err;
          ++failures;
          break;
        }
      }
    }
  }
}

// With rotation: the L2 error of each decoded row in the original domain is
// at most sqrt(d) * (largest scale of the row) / 2, up to f32 rounding.
void CheckRotatedRowError(const QuantizedKv& q, bool keys, const KvTensor& orig,
                          const KvTensor& decoded_f32, const std::string& ctx) {
  const QuantizedTensor& qt = keys ? q.k : q.v;
  const std::vector<float> x = ReadAll(orig);
  const std::vector<float> y = ReadAll(decoded_f32);
  const int dim = qt.dim;
  for (int h = 0; h < qt.heads; ++h) {
    for (int t = 0; t < qt.tokens; ++t) {
      double err2 = 0, norm2 = 0, max_s = 0;
      for (int c = 0; c < dim; ++c) {
        const size_t i = (static_cast<size_t>(h) * qt.tokens + t) * dim + c;
        err2 += (double(x[i]) - y[i]) * (double(x[i]) - y[i]);
        norm2 += double(x[i]) * x[i];
        max_s = std::max<double>(max_s, F16ToFloat(qt.scale[StatIndex(q, keys, h, t, c)]));
      }
      const double bound = std::sqrt(double(dim)) * max_s / 2;
      ASSERT_LE(std::sqrt(err2), bound + 1e-5 * std::sqrt(norm2) + 1e-6)
          << ctx << (keys ? " k" : " v") << " row [" << h << "," << t << "]";
    }
  }
}

// Reference decode in f32 following FORMAT.md: code * scale + zero, then the
// rotation (the library's transform, tested separately against float64).
std::vector<float> ReferenceDecode(const QuantizedKv& q, bool keys) {
  const QuantizedTensor& qt = keys ? q.k : q.v;
  std::vector<float> out(static_cast<size_t>(qt.heads) * qt.tokens * qt.dim);
  for (int h = 0; h < qt.heads; ++h) {
    for (int t = 0; t < qt.tokens; ++t) {
      float* row = out.data() + (static_cast<size_t>(h) * qt.tokens + t) * qt.dim;
      for (int c = 0; c < qt.dim; ++c) {
        const size_t si = StatIndex(q, keys, h, t, c);
        row[c] = static_cast<float>(UnpackRef(qt, h, t, c)) * F16ToFloat(qt.scale[si]) +
                 F16ToFloat(qt.zero[si]);
      }
      if (q.rotate) HadamardTransform(row, qt.dim);
    }
  }
  return out;
}

std::vector<uint16_t> RoundTo(DType dtype, const std::vector<float>& x) {
  std::vector<uint16_t> out(x.size());
  FromFloat(dtype, x.data(), out.data(), x.size());
  return out;
}

std::vector<uint16_t> Halfwords(const KvTensor& t) {
  std::vector<uint16_t> out(t.byte_size() / 2);
  if (!out.empty()) std::memcpy(out.data(), t.bytes().data(), t.byte_size());
  return out;
}

// ---------------------------------------------------------------------------
// Property test over random seeds and shapes.

struct Case {
  int bits;
  bool rotate;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << "bits=" << c.bits << (c.rotate ? " rotate=hadamard" : "");
}

class QuantPropertyTest : public ::testing::TestWithParam<Case> {};

TEST_P(QuantPropertyTest, RandomShapesMeetTheContract) {
  const Case cs = GetParam();
  for (int seed = 0; seed < 24; ++seed) {
    std::mt19937_64 rng(1000 * cs.bits + 7 * cs.rotate + seed);
    const int heads = 1 + static_cast<int>(rng() % 4);
    // Tokens: 0 sometimes, else 1..80 (mostly not a multiple of the group).
    const int tokens = seed % 8 == 3 ? 0 : 1 + static_cast<int>(rng() % 80);
    const int groups[] = {1, 3, 7, 16, 32, 1000};
    const int group = groups[rng() % 6];
    int dim;
    if (cs.rotate) {
      dim = 8 << (rng() % 5);  // 8..128
    } else {
      const int dims[] = {8, 12, 24, 40, 64, 96, 128};  // all multiples of 4
      dim = dims[rng() % 7];
    }
    const DType dtype = kDTypes[rng() % 3];
    const std::string ctx =
        absl::StrFormat("seed %d bits %d rotate %d shape [%d,%d,%d] group %d dtype %s", seed,
                        cs.bits, cs.rotate, heads, tokens, dim, group, DTypeName(dtype));
    SCOPED_TRACE(ctx);

    const KvTensor k = RandomKv(rng, dtype, heads, tokens, dim);
    const KvTensor v = RandomKv(rng, dtype, heads, tokens, dim);
    QuantOptions opts;
    opts.bits = cs.bits;
    opts.group = group;
    opts.rotate = cs.rotate;
    absl::StatusOr<QuantizedKv> q = QuantizeKv(k, v, opts);
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_EQ(q->bits, cs.bits);
    EXPECT_EQ(q->group, group);
    EXPECT_EQ(q->rotate, cs.rotate);
    EXPECT_EQ(q->dtype, dtype);

    // (b) Byte accounting, exactly.
    const size_t codes = static_cast<size_t>(heads) * tokens * dim * cs.bits / 8;
    const size_t kstats = static_cast<size_t>(heads) * Groups(tokens, group) * dim;
    const size_t vstats = static_cast<size_t>(heads) * tokens;
    for (const QuantizedTensor* t : {&q->k, &q->v}) {
      EXPECT_EQ(t->bits, cs.bits);
      EXPECT_EQ(t->heads, heads);
      EXPECT_EQ(t->tokens, tokens);
      EXPECT_EQ(t->dim, dim);
      EXPECT_EQ(t->codes.size(), codes);
    }
    EXPECT_EQ(q->k.scale.size(), kstats);
    EXPECT_EQ(q->k.zero.size(), kstats);
    EXPECT_EQ(q->v.scale.size(), vstats);
    EXPECT_EQ(q->v.zero.size(), vstats);
    EXPECT_EQ(q->k.ByteSize(), codes + 4 * kstats);
    EXPECT_EQ(q->v.ByteSize(), codes + 4 * vstats);
    if (::testing::Test::HasFailure()) return;

    // (a) Elementwise error in the rotated (encoder) domain.
    CheckTensorBounds(*q, /*keys=*/true, k, ctx);
    CheckTensorBounds(*q, /*keys=*/false, v, ctx);

    // (c) Decoding to every dtype: f32 equals the reference decode exactly,
    // f16/bf16 equal its round-to-nearest-even conversion.
    const std::vector<float> kref = ReferenceDecode(*q, true);
    const std::vector<float> vref = ReferenceDecode(*q, false);
    for (DType out : kDTypes) {
      KvTensor dk, dv;
      ASSERT_TRUE(DequantizeKv(*q, out, &dk, &dv).ok());
      ASSERT_EQ(dk.dtype(), out);
      ASSERT_EQ(dv.dtype(), out);
      ASSERT_TRUE(dk.SameShape(k) && dv.SameShape(v));
      if (out == DType::kF32) {
        EXPECT_EQ(ReadAll(dk), kref);
        EXPECT_EQ(ReadAll(dv), vref);
        if (cs.rotate) {
          CheckRotatedRowError(*q, true, k, dk, ctx);
          CheckRotatedRowError(*q, false, v, dv, ctx);
        }
      } else {
        EXPECT_EQ(Halfwords(dk), RoundTo(out, kref)) << DTypeName(out);
        EXPECT_EQ(Halfwords(dv), RoundTo(out, vref)) << DTypeName(out);
      }
      // Decoding again into the same (now scribbled) tensors reuses them and
      // overwrites every byte.
      const KvTensor dk0 = dk, dv0 = dv;
      std::fill(dk.mutable_bytes().begin(), dk.mutable_bytes().end(), 0xAB);
      std::fill(dv.mutable_bytes().begin(), dv.mutable_bytes().end(), 0xCD);
      ASSERT_TRUE(DequantizeKv(*q, out, &dk, &dv).ok());
      EXPECT_TRUE(dk == dk0 && dv == dv0) << DTypeName(out);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllBits, QuantPropertyTest,
                         ::testing::Values(Case{8, false}, Case{4, false}, Case{2, false},
                                           Case{4, true}, Case{2, true}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return absl::StrFormat("Bits%d%s", info.param.bits,
                                                  info.param.rotate ? "Hadamard" : "");
                         });

// ---------------------------------------------------------------------------
// (d) Walsh-Hadamard transform.

TEST(HadamardTest, MatchesSylvesterMatrixOrthonormalAndInvolutive) {
  std::mt19937_64 rng(42);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int n = 1; n <= 512; n *= 2) {
    SCOPED_TRACE(n);
    const std::vector<double> ref = SylvesterHadamard(n);
    // Columns of the library transform, one unit vector at a time.
    std::vector<double> m(static_cast<size_t>(n) * n);
    std::vector<float> e(n);
    for (int j = 0; j < n; ++j) {
      std::fill(e.begin(), e.end(), 0.0f);
      e[j] = 1.0f;
      HadamardTransform(e.data(), n);
      for (int i = 0; i < n; ++i) m[static_cast<size_t>(i) * n + j] = e[i];
    }
    for (size_t i = 0; i < m.size(); ++i) ASSERT_NEAR(m[i], ref[i], 1e-7) << i;
    // Orthonormal: M M^T = I; symmetric, so also its own inverse.
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) {
        double dot = 0;
        for (int c = 0; c < n; ++c) dot += m[static_cast<size_t>(i) * n + c] * m[static_cast<size_t>(j) * n + c];
        ASSERT_NEAR(dot, i == j ? 1.0 : 0.0, 1e-6) << i << "," << j;
      }
    }
    // Random vectors: matches the float64 product, keeps the norm, and
    // applying it twice gives the input back.
    for (int trial = 0; trial < 5; ++trial) {
      std::vector<float> x(n);
      for (float& xv : x) xv = normal(rng) * (trial + 1);
      std::vector<float> y = x;
      HadamardTransform(y.data(), n);
      double nx = 0, ny = 0;
      for (int i = 0; i < n; ++i) {
        double want = 0;
        for (int c = 0; c < n; ++c) want += ref[static_cast<size_t>(i) * n + c] * x[c];
        ASSERT_NEAR(y[i], want, 1e-5 * (trial + 1) * std::sqrt(double(n)));
        nx += double(x[i]) * x[i];
        ny += double(y[i]) * y[i];
      }
      EXPECT_NEAR(std::sqrt(ny), std::sqrt(nx), 1e-5 * std::sqrt(nx));
      HadamardTransform(y.data(), n);
      for (int i = 0; i < n; ++i) ASSERT_NEAR(y[i], x[i], 1e-5 * (trial + 1)) << i;
    }
  }
}

// ---------------------------------------------------------------------------
// (e) Bit layout on hand-written examples.

TEST(QuantLayoutTest, IndependentPackerAgreesOnHandWrittenBytes) {
  EXPECT_EQ(PackRef({0, 1, 2, 3}, 2), std::vector<uint8_t>({0xE4}));
  EXPECT_EQ(PackRef({0, 15, 1, 14}, 4), std::vector<uint8_t>({0xF0, 0xE1}));
  EXPECT_EQ(PackRef({0x12, 0xFE}, 8), std::vector<uint8_t>({0x12, 0xFE}));
}

TEST(QuantLayoutTest, ValueRowsPackLsbFirst) {
  // One row per case; min 0 and max 2^bits-1 give zero 0 and scale 1, so the
  // codes are the values themselves.
  struct Example {
    int bits;
    std::vector<float> row;
    std::vector<uint8_t> bytes;
  };
  const Example examples[] = {
      {2, {0, 1, 2, 3}, {0xE4}},
      {2, {3, 0, 1, 2, 2, 2, 0, 3}, {0x93, 0xCA}},
      {4, {0, 15, 1, 14, 2, 13, 3, 12}, {0xF0, 0xE1, 0xD2, 0xC3}},
      {8, {0, 255, 7, 128}, {0x00, 0xFF, 0x07, 0x80}},
  };
  for (const Example& ex : examples) {
    SCOPED_TRACE(ex.bits);
    const int dim = static_cast<int>(ex.row.size());
    const KvTensor k = FromValues(DType::kF32, 1, 1, dim, ex.row);
    QuantOptions opts;
    opts.bits = ex.bits;
    opts.group = 1;
    absl::StatusOr<QuantizedKv> q = QuantizeKv(k, k, opts);
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_EQ(q->v.zero, std::vector<uint16_t>({0x0000}));
    EXPECT_EQ(q->v.scale, std::vector<uint16_t>({0x3C00}));  // 1.0
    EXPECT_EQ(q->v.codes, ex.bytes);
    std::vector<uint32_t> codes(ex.row.begin(), ex.row.end());
    EXPECT_EQ(PackRef(codes, ex.bits), ex.bytes);
    // group=1 keys: every block is one element, so codes are 0 and the
    // zero point is the element itself.
    EXPECT_EQ(q->k.codes, std::vector<uint8_t>(ex.bytes.size(), 0));
    for (int c = 0; c < dim; ++c) EXPECT_EQ(F16ToFloat(q->k.zero[c]), ex.row[c]);
  }
}

TEST(QuantLayoutTest, KeyGroupsAndShortLastGroup) {
  // [1 head, 5 tokens, 4 dims], group 2 -> groups {0,1}, {2,3}, {4}.
  const std::vector<float> x = {
      0,   3,  0,   3,     // t0
      3,   0,  3,   0,     // t1
      -2,  4,  4,   -2,    // t2
      4,   -2, -2,  4,     // t3
      1.5, -7, 100, 0.25,  // t4 (alone in the last group)
  };
  const KvTensor k = FromValues(DType::kF32, 1, 5, 4, x);
  QuantOptions opts;
  opts.bits = 2;
  opts.group = 2;
  absl::StatusOr<QuantizedKv> q = QuantizeKv(k, k, opts);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->k.codes, std::vector<uint8_t>({0xCC, 0x33, 0x3C, 0xC3, 0x00}));
  std::vector<uint16_t> zero, scale;
  for (float z : {0.f, 0.f, 0.f, 0.f, -2.f, -2.f, -2.f, -2.f, 1.5f, -7.f, 100.f, 0.25f}) {
    zero.push_back(FloatToF16(z));
  }
  for (float s : {1.f, 1.f, 1.f, 1.f, 2.f, 2.f, 2.f, 2.f}) scale.push_back(FloatToF16(s));
  for (int c = 0; c < 4; ++c) scale.push_back(0x0001);  // constant block: smallest subnormal
  EXPECT_EQ(q->k.zero, zero);
  EXPECT_EQ(q->k.scale, scale);
  KvTensor dk, dv;
  ASSERT_TRUE(DequantizeKv(*q, DType::kF32, &dk, &dv).ok());
  EXPECT_EQ(ReadAll(dk), x);  // every value is exact here
}

// ---------------------------------------------------------------------------
// (f) Constant rows, the fp16 limit, and errors.

TEST(QuantRangeTest, ConstantRowsDecodeWithinHalfTheSmallestScale) {
  for (int bits : {8, 4, 2}) {
    for (float c : {3.0f, 0.1f, -1234.567f, 0.0f, 1e-9f, 65504.0f, -65504.0f}) {
      SCOPED_TRACE(absl::StrFormat("bits %d value %g", bits, c));
      const KvTensor k = FromValues(DType::kF32, 2, 5, 8, std::vector<float>(80, c));
      QuantOptions opts;
      opts.bits = bits;
      opts.group = 4;
      absl::StatusOr<QuantizedKv> q = QuantizeKv(k, k, opts);
      ASSERT_TRUE(q.ok()) << q.status();
      CheckTensorBounds(*q, true, k, "const");
      CheckTensorBounds(*q, false, k, "const");
      KvTensor dk, dv;
      ASSERT_TRUE(DequantizeKv(*q, DType::kF32, &dk, &dv).ok());
      // z is c rounded down to fp16, s tiny: decoding is within one fp16 ulp.
      const float ulp = std::max(std::fabs(c) * 0x1p-10f, 0x1p-24f);
      for (float y : ReadAll(dk)) EXPECT_NEAR(y, c, ulp);
      for (float y : ReadAll(dv)) EXPECT_NEAR(y, c, ulp);
      if (c == 3.0f || c == 0.0f || std::fabs(c) == 65504.0f) {
        EXPECT_EQ(ReadAll(dk), std::vector<float>(80, c));
        EXPECT_EQ(ReadAll(dv), std::vector<float>(80, c));
      }
    }
  }
}

TEST(QuantRangeTest, ValuesNearTheFp16LimitWork) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> uni(-65504.0f, 65504.0f);
  for (int bits : {8, 4, 2}) {
    std::vector<float> x(3 * 10 * 16);
    for (float& xv : x) xv = uni(rng);
    x[0] = 65504.0f;
    x[1] = -65504.0f;
    x[17] = 65519.0f;  // above the fp16 max but rounds down to it
    const KvTensor k = FromValues(DType::kF32, 3, 10, 16, x);
    QuantOptions opts;
    opts.bits = bits;
    opts.group = 4;
    absl::StatusOr<QuantizedKv> q = QuantizeKv(k, k, opts);
    ASSERT_TRUE(q.ok()) << bits << ": " << q.status();
    CheckTensorBounds(*q, true, k, "huge");
    CheckTensorBounds(*q, false, k, "huge");
  }
}

// A value at the F16 limit can decode to just past it (within scale/2);
// decoding back to F16 saturates instead of rounding to infinity.
TEST(QuantRangeTest, DecodingToF16NearItsLimitStaysFinite) {
  std::vector<float> x(1 * 3 * 8, 0.0f);
  x[0] = 65504.0f;
  x[1] = -65504.0f;
  x[8] = 65504.0f;
  x[17] = -65504.0f;
  const KvTensor k = FromValues(DType::kF16, 1, 3, 8, x);
  for (int bits : {8, 4, 2}) {
    SCOPED_TRACE(absl::StrFormat("bits %d", bits));
    QuantOptions opts;
    opts.bits = bits;
    opts.group = 3;
    absl::StatusOr<QuantizedKv> q = QuantizeKv(k, k, opts);
    ASSERT_TRUE(q.ok()) << q.status();
    for (DType out : {DType::kF16, DType::kBF16, DType::kF32}) {
      KvTensor dk, dv;
      ASSERT_TRUE(DequantizeKv(*q, out, &dk, &dv).ok());
      const std::vector<float> ks = ReadAll(dk), vs = ReadAll(dv);
      for (size_t i = 0; i < x.size(); ++i) {
        ASSERT_TRUE(std::isfinite(ks[i]) && std::isfinite(vs[i])) << "element " << i;
        if (out == DType::kF16) {
          ASSERT_LE(std::fabs(ks[i]), 65504.0f);
          ASSERT_LE(std::fabs(vs[i]), 65504.0f);
        }
      }
    }
    CheckTensorBounds(*q, true, k, "limit");
    CheckTensorBounds(*q, false, k, "limit");
  }
}

TEST(QuantRangeTest, StatisticOutsideFp16IsInvalidArgument) {
  // A minimum below -65504 has no fp16 zero point <= it.
  {
    std::vector<float> kx(2 * 4 * 8, 1.0f), vx(2 * 4 * 8, 1.0f);
    kx[(1 * 4 + 2) * 8 + 5] = -70000.0f;  // k head 1
    const KvTensor k = FromValues(DType::kF32, 2, 4, 8, kx);
    const KvTensor v = FromValues(DType::kF32, 2, 4, 8, vx);
    absl::StatusOr<QuantizedKv> q = QuantizeKv(k, v, QuantOptions{});
    ASSERT_EQ(q.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(q.status().message(), HasSubstr("k head 1"));
    EXPECT_THAT(q.status().message(), HasSubstr("-70000"));
  }
  // -65505 is just past the limit (rounds to nearest -65504 > -65505).
  {
    std::vector<float> vx(2 * 4 * 8, 1.0f);
    vx[(0 * 4 + 3) * 8 + 1] = -65505.0f;
    const KvTensor k = FromValues(DType::kF32, 2, 4, 8, std::vector<float>(64, 1.0f));
    const KvTensor v = FromValues(DType::kF32, 2, 4, 8, vx);
    absl::StatusOr<QuantizedKv> q = QuantizeKv(k, v, QuantOptions{});
    ASSERT_EQ(q.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(q.status().message(), HasSubstr("v head 0"));
    EXPECT_THAT(q.status().message(), HasSubstr("-65505"));
  }
  // A range too wide for an fp16 scale: 1e6 / 3 > 65504.
  {
    std::vector<float> vx(2 * 4 * 8, 0.0f);
    vx[(1 * 4 + 0) * 8 + 7] = 1e6f;
    const KvTensor v = FromValues(DType::kF32, 2, 4, 8, vx);
    const KvTensor k = FromValues(DType::kF32, 2, 4, 8, std::vector<float>(64, 0.0f));
    QuantOptions opts;
    opts.bits = 2;
    absl::StatusOr<QuantizedKv> q = QuantizeKv(k, v, opts);
    ASSERT_EQ(q.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(q.status().message(), HasSubstr("v head 1"));
    EXPECT_THAT(q.status().message(), HasSubstr("scale"));
    // With 8 bits the same range fits (1e6 / 255 < 65504).
    opts.bits = 8;
    EXPECT_TRUE(QuantizeKv(k, v, opts).ok());
  }
}

TEST(QuantRangeTest, NonFiniteInputIsInvalidArgument) {
  for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    for (bool in_keys : {true, false}) {
      for (bool rotate : {false, true}) {
        std::vector<float> x(2 * 3 * 8, 0.5f);
        x[(1 * 3 + 2) * 8 + 3] = bad;
        const KvTensor good = FromValues(DType::kF32, 2, 3, 8, std::vector<float>(48, 0.5f));
        const KvTensor broken = FromValues(DType::kF32, 2, 3, 8, x);
        QuantOptions opts;
        opts.rotate = rotate;
        absl::StatusOr<QuantizedKv> q =
            in_keys ? QuantizeKv(broken, good, opts) : QuantizeKv(good, broken, opts);
        ASSERT_EQ(q.status().code(), absl::StatusCode::kInvalidArgument) << bad;
        EXPECT_THAT(q.status().message(), HasSubstr(in_keys ? "k head 1" : "v head 1"));
      }
    }
  }
}

TEST(QuantOptionsTest, EachBadOptionIsNamed) {
  struct Bad {
    int bits, group;
    bool rotate;
    int dim;
    const char* name;
  };
  const Bad bad[] = {
      {3, 32, false, 16, "bits"},        {1, 32, false, 16, "bits"},
      {16, 32, false, 16, "bits"},       {4, 0, false, 16, "group"},
      {4, -5, false, 16, "group"},       {8, 32, true, 16, "rotate"},
      {4, 32, true, 24, "rotate"},       {4, 32, true, 24, "head_dim"},
      {2, 32, false, 6, "head_dim*bits"}, {4, 32, false, 3, "head_dim*bits"},
      {4, 32, false, 0, "head_dim"},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(absl::StrFormat("bits %d group %d rotate %d dim %d", b.bits, b.group, b.rotate,
                                 b.dim));
    QuantOptions opts;
    opts.bits = b.bits;
    opts.group = b.group;
    opts.rotate = b.rotate;
    absl::Status s = ValidateQuantOptions(opts, b.dim);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr(b.name));
    const KvTensor k(DType::kBF16, 2, 3, b.dim);
    absl::StatusOr<QuantizedKv> q = QuantizeKv(k, k, opts);
    EXPECT_EQ(q.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(q.status().message(), HasSubstr(b.name));
  }
  QuantOptions ok;
  for (int bits : {2, 4, 8}) {
    ok.bits = bits;
    ok.rotate = bits != 8;
    EXPECT_TRUE(ValidateQuantOptions(ok, 128).ok()) << bits;
  }
}

TEST(QuantOptionsTest, ShapeMismatchIsInvalidArgument) {
  const KvTensor k(DType::kBF16, 2, 3, 16);
  const KvTensor v(DType::kBF16, 2, 4, 16);
  absl::StatusOr<QuantizedKv> q = QuantizeKv(k, v, QuantOptions{});
  EXPECT_EQ(q.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(q.status().message(), HasSubstr("shape"));
}

TEST(QuantDecodeTest, InconsistentPackedTensorsAreInvalidArgument) {
  std::mt19937_64 rng(3);
  const KvTensor k = RandomKv(rng, DType::kBF16, 2, 9, 16);
  QuantOptions opts;
  opts.group = 4;
  absl::StatusOr<QuantizedKv> q = QuantizeKv(k, k, opts);
  ASSERT_TRUE(q.ok());
  auto expect_bad = [](const QuantizedKv& bad, const char* what) {
    KvTensor dk(DType::kF32, 1, 1, 1), dv(DType::kF32, 1, 1, 1);
    const KvTensor dk0 = dk, dv0 = dv;
    absl::Status s = DequantizeKv(bad, DType::kF32, &dk, &dv);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_EQ(dk, dk0) << what;  // outputs untouched
    EXPECT_EQ(dv, dv0) << what;
  };
  QuantizedKv bad = *q;
  bad.k.codes.pop_back();
  expect_bad(bad, "short k codes");
  bad = *q;
  bad.v.scale.push_back(0);
  expect_bad(bad, "long v scales");
  bad = *q;
  bad.group = 2;  // 5 key groups instead of 3: statistics no longer match
  expect_bad(bad, "group");
  bad = *q;
  bad.bits = 3;
  expect_bad(bad, "bits");
  bad = *q;
  bad.v.bits = 2;
  expect_bad(bad, "v bits");
  bad = *q;
  bad.v.tokens = 8;
  bad.v.codes.resize(2 * 8 * 8);
  bad.v.scale.resize(16);
  bad.v.zero.resize(16);
  expect_bad(bad, "k/v tokens differ");
}

TEST(QuantDecodeTest, ZeroTokensRoundTrip) {
  for (bool rotate : {false, true}) {
    const KvTensor k(DType::kF16, 3, 0, 64);
    QuantOptions opts;
    opts.rotate = rotate;
    absl::StatusOr<QuantizedKv> q = QuantizeKv(k, k, opts);
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_TRUE(q->k.codes.empty() && q->k.scale.empty() && q->k.zero.empty());
    EXPECT_TRUE(q->v.codes.empty() && q->v.scale.empty() && q->v.zero.empty());
    EXPECT_EQ(q->k.ByteSize() + q->v.ByteSize(), 0u);
    KvTensor dk, dv;
    ASSERT_TRUE(DequantizeKv(*q, DType::kBF16, &dk, &dv).ok());
    EXPECT_EQ(dk, KvTensor(DType::kBF16, 3, 0, 64));
    EXPECT_EQ(dv, KvTensor(DType::kBF16, 3, 0, 64));
  }
}

// ---------------------------------------------------------------------------
// Messages and byte accounting.

Message MakeMessage(std::mt19937_64& rng, const QuantOptions& opts, int layers, int heads,
                    int tokens, int dim) {
  Message msg;
  msg.dtype = DType::kBF16;
  msg.kv_heads = heads;
  msg.head_dim = dim;
  msg.n_kept = tokens;
  for (int l = 0; l < layers; ++l) {
    MessageLayer layer;
    layer.pos = PosTensor(heads, tokens);
    for (size_t i = 0; i < layer.pos.data.size(); ++i) layer.pos.data[i] = static_cast<int32_t>(i);
    KvTensor k = RandomKv(rng, DType::kBF16, heads, tokens, dim);
    KvTensor v = RandomKv(rng, DType::kBF16, heads, tokens, dim);
    if (l % 2 == 0) {  // even layers quantized, odd layers dense
      absl::StatusOr<QuantizedKv> q = QuantizeKv(k, v, opts);
      EXPECT_TRUE(q.ok()) << q.status();
      layer.quant = *std::move(q);
      layer.k = KvTensor(DType::kBF16, heads, 0, dim);
      layer.v = KvTensor(DType::kBF16, heads, 0, dim);
    } else {
      layer.k = std::move(k);
      layer.v = std::move(v);
    }
    msg.layers.push_back(std::move(layer));
  }
  for (const MessageLayer& layer : msg.layers) msg.sent_bytes += layer.SentBytes();
  msg.full_bytes = 12345;
  return msg;
}

TEST(QuantMessageTest, SentBytesFollowsFormatMd) {
  std::mt19937_64 rng(11);
  QuantOptions opts;
  opts.bits = 4;
  opts.group = 32;
  const int heads = 2, tokens = 45, dim = 64;
  Message msg = MakeMessage(rng, opts, 2, heads, tokens, dim);
  const uint64_t pos_bytes = 4ull * heads * tokens;
  const uint64_t codes = 1ull * heads * tokens * dim * 4 / 8;
  const uint64_t kstats = 2ull * heads * Groups(tokens, 32) * dim * 2;  // scale + zero, 2 bytes
  const uint64_t vstats = 2ull * heads * tokens * 2;
  EXPECT_EQ(msg.layers[0].SentBytes(), 2 * codes + kstats + vstats + pos_bytes);
  EXPECT_EQ(msg.layers[1].SentBytes(), 2ull * heads * tokens * dim * 2 + pos_bytes);
}

TEST(QuantMessageTest, DequantizeMessageDecodesAndRecountsBytes) {
  std::mt19937_64 rng(5);
  QuantOptions opts;
  opts.bits = 2;
  opts.group = 16;
  opts.rotate = true;
  for (DType out : kDTypes) {
    Message msg = MakeMessage(rng, opts, 3, 2, 37, 32);
    const Message before = msg;
    ASSERT_TRUE(DequantizeMessage(&msg, out).ok());
    uint64_t sent = 0;
    for (size_t l = 0; l < msg.layers.size(); ++l) {
      const MessageLayer& layer = msg.layers[l];
      EXPECT_FALSE(layer.quant.has_value());
      EXPECT_EQ(layer.pos, before.layers[l].pos);
      if (before.layers[l].quant.has_value()) {
        KvTensor dk, dv;
        ASSERT_TRUE(DequantizeKv(*before.layers[l].quant, out, &dk, &dv).ok());
        EXPECT_EQ(layer.k, dk);
        EXPECT_EQ(layer.v, dv);
      } else {
        EXPECT_EQ(layer.k, before.layers[l].k);
        EXPECT_EQ(layer.v, before.layers[l].v);
      }
      sent += layer.k.byte_size() + layer.v.byte_size() + 4 * layer.pos.data.size();
    }
    EXPECT_EQ(msg.sent_bytes, sent);
    EXPECT_GT(msg.sent_bytes, before.sent_bytes);  // dense is bigger than 2 bits
    EXPECT_EQ(msg.full_bytes, before.full_bytes);
    EXPECT_EQ(msg.dtype, before.dtype);
  }
}

TEST(QuantMessageTest, DequantizeMessageErrorLeavesMessageUnchanged) {
  std::mt19937_64 rng(9);
  Message msg = MakeMessage(rng, QuantOptions{}, 3, 2, 10, 16);
  msg.layers[2].quant->v.codes.pop_back();
  const uint64_t sent = msg.sent_bytes;
  absl::Status s = DequantizeMessage(&msg, DType::kBF16);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("layer.2"));
  EXPECT_TRUE(msg.layers[0].quant.has_value());  // layer 0 was not replaced
  EXPECT_EQ(msg.layers[0].k.tokens(), 0);
  EXPECT_EQ(msg.sent_bytes, sent);
}

}  // namespace
}  // namespace kvrelay
