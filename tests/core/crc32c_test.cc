#include "core/crc32c.h"

#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvrelay {
namespace {

// Bitwise reference, independent of the table and the SSE4.2 instruction.
uint32_t Reference(const std::vector<uint8_t>& d) {
  uint32_t c = 0xffffffffu;
  for (uint8_t b : d) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82f63b78u : c >> 1;
  }
  return ~c;
}

TEST(Crc32cTest, KnownVectors) {
  const std::string s = "123456789";
  EXPECT_EQ(Crc32c(s.data(), s.size()), 0xe3069283u);  // the standard check value
  EXPECT_EQ(Crc32c(nullptr, 0), 0u);
  const std::vector<uint8_t> zeros(32, 0);
  EXPECT_EQ(Crc32c(zeros.data(), zeros.size()), 0x8a9136aau);  // RFC 3720 B.4
}

TEST(Crc32cTest, MatchesReferenceAndExtends) {
  std::mt19937 rng(1);
  for (int i = 0; i < 200; ++i) {
    std::vector<uint8_t> d(rng() % 300);
    for (auto& b : d) b = static_cast<uint8_t>(rng());
    ASSERT_EQ(Crc32c(d.data(), d.size()), Reference(d));
    const size_t cut = d.empty() ? 0 : rng() % d.size();
    const uint32_t a = Crc32c(d.data(), cut);
    ASSERT_EQ(Crc32cExtend(a, d.data() + cut, d.size() - cut), Reference(d));
  }
}

TEST(Crc32cTest, CombineEqualsTheCrcOfTheConcatenation) {
  std::mt19937 rng(2);
  for (int i = 0; i < 300; ++i) {
    std::vector<uint8_t> a(rng() % 200), b(i % 50 == 0 ? 0 : rng() % 5000);
    for (auto& x : a) x = static_cast<uint8_t>(rng());
    for (auto& x : b) x = static_cast<uint8_t>(rng());
    std::vector<uint8_t> ab(a);
    ab.insert(ab.end(), b.begin(), b.end());
    ASSERT_EQ(Crc32cCombine(Crc32c(a.data(), a.size()), Crc32c(b.data(), b.size()), b.size()),
              Reference(ab))
        << a.size() << " + " << b.size();
  }
}

}  // namespace
}  // namespace kvrelay
