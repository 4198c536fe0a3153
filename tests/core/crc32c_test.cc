#include "core/crc32c.h"

#include <random>
#include <string>
#include <vector>

#include "core/internal/crc32c_fold.h"
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

// Long buffers take the interleaved three-stream paths (triples of 8 KiB
// blocks, then of 1 KiB blocks, then 8 bytes at a time); every length around
// their boundaries and any starting state must agree with the bitwise
// reference.
TEST(Crc32cTest, LongBuffersMatchTheReference) {
  std::mt19937 rng(3);
  std::vector<uint8_t> d(3 * 3 * 8192 + 3 * 3 * 1024 + 100);
  for (auto& b : d) b = static_cast<uint8_t>(rng());
  for (size_t n : {size_t{3 * 1024 - 1}, size_t{3 * 1024}, size_t{3 * 1024 + 9}, size_t{6 * 1024 + 5},
                   size_t{3 * 8192 - 1}, size_t{3 * 8192}, size_t{3 * 8192 + 7}, size_t{3 * 8192 + 3 * 1024 + 3},
                   size_t{6 * 8192 + 13}, size_t{6 * 8192 + 6 * 1024 + 17}, d.size()}) {
    const std::vector<uint8_t> head(d.begin(), d.begin() + n);
    ASSERT_EQ(Crc32c(head.data(), head.size()), Reference(head)) << n;
    const size_t cut = 1 + rng() % 100;  // a non-zero starting state, an unaligned start
    ASSERT_EQ(Crc32cExtend(Crc32c(head.data(), cut), head.data() + cut, n - cut), Reference(head)) << n;
  }
}

// On CPUs with VPCLMULQDQ, inputs of 256 bytes and more are folded 256 and
// then 64 bytes at a time (the rest goes byte-wise); the portable path is
// the three-stream loop. Both must agree with the bitwise reference at
// every length around those steps, from any state and alignment.
TEST(Crc32cTest, FoldingAndPortablePathsMatchTheReference) {
  std::mt19937 rng(4);
  std::vector<uint8_t> d(70000);
  for (auto& b : d) b = static_cast<uint8_t>(rng());
  std::vector<size_t> lengths;
  for (size_t base : {size_t{256}, size_t{320}, size_t{512}, size_t{2048}, size_t{3 * 1024}, size_t{65536}}) {
    for (size_t n = base - 9; n <= base + 9; ++n) lengths.push_back(n);
  }
  for (int i = 0; i < 200; ++i) lengths.push_back(rng() % 4000);
  for (size_t n : lengths) {
    const size_t start = rng() % 64;  // unaligned starts
    const std::vector<uint8_t> v(d.begin() + start, d.begin() + start + n);
    const uint32_t want = Reference(v);
    ASSERT_EQ(Crc32c(v.data(), n), want) << n;
    ASSERT_EQ(internal::Crc32cExtendPortable(0, v.data(), n), want) << n;
    const size_t cut = n == 0 ? 0 : rng() % n;  // a non-zero state entering the fold
    ASSERT_EQ(Crc32cExtend(Crc32c(v.data(), cut), v.data() + cut, n - cut), want) << n << " cut " << cut;
  }
}

TEST(Crc32cTest, CombineHandlesLargeLengths) {
  // Shifting over L1 then L2 bytes equals shifting over L1 + L2, also past
  // 32-bit lengths, and a shift is not the identity.
  const uint32_t a = 0x12345678u;
  const uint64_t l1 = (uint64_t{1} << 33) + 5, l2 = (uint64_t{1} << 40) + 12345;
  EXPECT_EQ(Crc32cCombine(Crc32cCombine(a, 0, l1), 0, l2), Crc32cCombine(a, 0, l1 + l2));
  EXPECT_NE(Crc32cCombine(a, 0, l1), a);
  const std::vector<uint8_t> z(1000, 0);
  const uint32_t zc = Crc32c(z.data(), z.size());
  EXPECT_EQ(Crc32cCombine(Crc32cCombine(a, zc, 1000), zc, 1000),
            Crc32cCombine(a, Crc32cCombine(zc, zc, 1000), 2000));
}

}  // namespace
}  // namespace kvrelay
