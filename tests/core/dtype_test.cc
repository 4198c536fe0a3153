#include "core/dtype.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvrelay {
namespace {

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Nearest value of a sorted table of non-negative finite values, ties to the
// even index (even mantissa), overflow to inf past `max + half ulp`.
uint16_t Nearest(const std::vector<double>& table, double a, double overflow) {
  if (a >= overflow) return static_cast<uint16_t>(table.size());  // index of inf
  auto it = std::lower_bound(table.begin(), table.end(), a);
  size_t hi = it - table.begin();
  if (hi == 0) return 0;
  if (hi == table.size()) return static_cast<uint16_t>(table.size() - 1);
  const size_t lo = hi - 1;
  const double dl = a - table[lo], dh = table[hi] - a;
  if (dl < dh) return lo;
  if (dh < dl) return hi;
  return (lo % 2 == 0) ? lo : hi;
}

TEST(DTypeTest, NamesRoundTrip) {
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16}) {
    auto parsed = ParseDType(DTypeName(d));
    ASSERT_TRUE(parsed.has_value());
    EXPECT_EQ(*parsed, d);
  }
  EXPECT_FALSE(ParseDType("F64").has_value());
  EXPECT_FALSE(ParseDType("bf16").has_value());
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
}

TEST(DTypeTest, Bf16AllPatternsRoundTrip) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = Bf16ToFloat(static_cast<uint16_t>(h));
    const uint16_t back = FloatToBf16(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(Bf16ToFloat(back)));
    } else {
      EXPECT_EQ(back, h) << "pattern " << h;
    }
  }
}

TEST(DTypeTest, F16AllPatternsRoundTrip) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = F16ToFloat(static_cast<uint16_t>(h));
    const uint16_t back = FloatToF16(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(F16ToFloat(back)));
    } else {
      EXPECT_EQ(back, h) << "pattern " << h;
    }
  }
}

TEST(DTypeTest, F16RoundsToNearestEvenAgainstTable) {
  std::vector<double> table;  // all non-negative finite f16 values, ascending
  for (uint32_t h = 0; h < 0x7c00; ++h) table.push_back(F16ToFloat(static_cast<uint16_t>(h)));
  const double overflow = 65520.0;  // 65504 + half ulp (ties go to inf: even)
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> exp_dist(90, 145), mant(0, (1u << 23) - 1);
  for (int i = 0; i < 400000; ++i) {
    uint32_t bits = (exp_dist(rng) << 23) | mant(rng);
    if (i % 4 == 0) bits &= ~0x1fffu, bits |= 0x1000u;  // exact ties at normal precision
    const float f = FromBits(bits);
    const uint16_t expect = Nearest(table, f, overflow);
    ASSERT_EQ(FloatToF16(f), expect) << "f=" << f;
    ASSERT_EQ(FloatToF16(-f), expect | 0x8000u) << "f=" << -f;
  }
}

TEST(DTypeTest, Bf16RoundsToNearestEven) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<uint32_t> any(0, 0x7f7fffffu);
  for (int i = 0; i < 400000; ++i) {
    uint32_t bits = any(rng);
    if (i % 4 == 0) bits = (bits & ~0xffffu) | 0x8000u;  // exact tie
    const float f = FromBits(bits);
    const uint32_t lo = bits & 0xffff0000u, hi = lo + 0x10000u;
    const double dl = static_cast<double>(f) - FromBits(lo);
    const double hv = hi == 0x7f800000u ? 0x1p128 : static_cast<double>(FromBits(hi));
    const double dh = hv - f;
    uint16_t expect = static_cast<uint16_t>((dl < dh || (dl == dh && ((lo >> 16) & 1u) == 0)) ? lo >> 16 : hi >> 16);
    ASSERT_EQ(FloatToBf16(f), expect) << "bits=" << bits;
  }
}

TEST(DTypeTest, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(FloatToF16(inf), 0x7c00);
  EXPECT_EQ(FloatToF16(-inf), 0xfc00);
  EXPECT_EQ(FloatToF16(70000.f), 0x7c00);
  EXPECT_EQ(FloatToF16(65504.f), 0x7bff);
  EXPECT_EQ(FloatToF16(65519.f), 0x7bff);
  EXPECT_EQ(FloatToF16(65520.f), 0x7c00);
  EXPECT_EQ(FloatToF16(5.9604644775390625e-8f), 0x0001);   // smallest subnormal
  EXPECT_EQ(FloatToF16(2.98023223876953125e-8f), 0x0000);  // half of it: tie to even 0
  EXPECT_EQ(FloatToBf16(inf), 0x7f80);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::nanf("")))));
  EXPECT_TRUE(std::isnan(F16ToFloat(FloatToF16(std::nanf("")))));
  EXPECT_EQ(FloatToBf16(-0.0f), 0x8000);
}

TEST(DTypeTest, BulkConversionMatchesScalar) {
  std::mt19937 rng(3);
  std::normal_distribution<float> n(0.f, 100.f);
  std::vector<float> src(1000);
  for (float& x : src) x = n(rng);
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16}) {
    std::vector<uint8_t> buf(src.size() * DTypeSize(d));
    FromFloat(d, src.data(), buf.data(), src.size());
    std::vector<float> back(src.size());
    ToFloat(d, buf.data(), back.data(), src.size());
    for (size_t i = 0; i < src.size(); ++i) {
      float expect = src[i];
      if (d == DType::kF16) expect = F16ToFloat(FloatToF16(src[i]));
      if (d == DType::kBF16) expect = Bf16ToFloat(FloatToBf16(src[i]));
      ASSERT_EQ(back[i], expect);
    }
  }
}

// The bulk F16 paths may use F16C instructions; they must agree with the
// scalar conversions bit for bit, subnormals, overflow and ties included.
TEST(DTypeTest, BulkF16MatchesScalarOverAllRanges) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<uint32_t> exp_dist(80, 160), mant(0, (1u << 23) - 1);
  std::vector<float> src;
  for (uint32_t h = 0; h < 65536; ++h) src.push_back(F16ToFloat(static_cast<uint16_t>(h)));
  for (int i = 0; i < 200000; ++i) {
    uint32_t bits = (exp_dist(rng) << 23) | mant(rng) | (i % 2 ? 0x80000000u : 0u);
    if (i % 3 == 0) bits = (bits & ~0x1fffu) | 0x1000u;  // ties
    src.push_back(FromBits(bits));
  }
  std::vector<uint16_t> bulk(src.size());
  FromFloat(DType::kF16, src.data(), bulk.data(), src.size());
  for (size_t i = 0; i < src.size(); ++i) {
    if (std::isnan(src[i])) {
      ASSERT_TRUE(std::isnan(F16ToFloat(bulk[i])));
      continue;
    }
    ASSERT_EQ(bulk[i], FloatToF16(src[i])) << "value " << src[i];
  }
  std::vector<float> back(bulk.size());
  ToFloat(DType::kF16, bulk.data(), back.data(), bulk.size());
  for (size_t i = 0; i < bulk.size(); ++i) {
    const float expect = F16ToFloat(bulk[i]);
    if (std::isnan(expect)) ASSERT_TRUE(std::isnan(back[i]));
    else ASSERT_EQ(back[i], expect);
  }
}

}  // namespace
}  // namespace kvrelay
