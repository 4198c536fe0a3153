// Relay-assigned message ids: their form, their randomness, and that one id
// tells nothing about the next.
#include "core/message_id.h"

#include <array>
#include <cstdint>
#include <string>
#include <unordered_set>
#include <vector>

#include "absl/strings/escaping.h"
#include "gtest/gtest.h"
#include "server/rpc/request_checks.h"

namespace kvrelay {
namespace {

bool IsLowerHex(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); }

// The 16 random bytes of an id of the documented form; fails the test
// otherwise.
std::string RandomPart(const std::string& id) {
  EXPECT_EQ(id.size(), kMessageIdLength) << id;
  EXPECT_EQ(id.substr(0, 2), "m-") << id;
  for (size_t i = 2; i < id.size(); ++i) EXPECT_TRUE(IsLowerHex(id[i])) << id;
  EXPECT_TRUE(CheckId("message_id", id).ok()) << id;
  return id.size() == kMessageIdLength ? absl::HexStringToBytes(id.substr(2)) : std::string();
}

// Every id is "m-" and 32 lowercase hex digits, distinct, and each of its 128
// bits varies: across 4096 ids, each bit is set in 35%..65% of them (a fixed
// salt bit or a counter's high bits would be set in 0% or 100%; for a random
// bit, leaving that band is a 19-sigma event).
TEST(MessageIdTest, IdsAreDistinctAndAll128BitsVary) {
  constexpr int kIds = 4096;
  std::unordered_set<std::string> seen;
  std::array<int, 128> ones{};
  for (int i = 0; i < kIds; ++i) {
    absl::StatusOr<std::string> id = NewMessageId();
    ASSERT_TRUE(id.ok()) << id.status();
    const std::string raw = RandomPart(*id);
    ASSERT_EQ(raw.size(), kMessageIdRandomBytes) << *id;
    EXPECT_TRUE(seen.insert(*id).second) << "repeated: " << *id;
    for (int b = 0; b < 128; ++b) ones[b] += (static_cast<uint8_t>(raw[b / 8]) >> (b % 8)) & 1;
  }
  for (int b = 0; b < 128; ++b) {
    EXPECT_GE(ones[b], kIds * 35 / 100) << "bit " << b;
    EXPECT_LE(ones[b], kIds * 65 / 100) << "bit " << b;
  }
}

// Consecutive ids share no structure an agent could extend: no common prefix
// of 8 or more hex digits (a salt), and the low 64 bits are not a small step
// apart (a counter). For random ids each happens with probability 2^-32 or
// less per pair.
TEST(MessageIdTest, ConsecutiveIdsShareNoCounterOrSalt) {
  absl::StatusOr<std::string> prev = NewMessageId();
  ASSERT_TRUE(prev.ok()) << prev.status();
  for (int i = 0; i < 1000; ++i) {
    absl::StatusOr<std::string> next = NewMessageId();
    ASSERT_TRUE(next.ok()) << next.status();
    ASSERT_EQ(next->size(), kMessageIdLength) << *next;
    size_t common = 2;
    while (common < next->size() && (*prev)[common] == (*next)[common]) ++common;
    EXPECT_LT(common - 2, 8u) << *prev << " then " << *next;
    const uint64_t a = std::stoull(prev->substr(prev->size() - 16), nullptr, 16);
    const uint64_t b = std::stoull(next->substr(next->size() - 16), nullptr, 16);
    EXPECT_GT(b - a, 1000000u) << *prev << " then " << *next;
    prev = std::move(next);
  }
}

TEST(MessageIdTest, TheBytesOfTheSourceMakeTheId) {
  absl::StatusOr<std::string> id = NewMessageId([](void* out, size_t n) {
    auto* p = static_cast<uint8_t*>(out);
    for (size_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(0xf0 + i);
    return absl::OkStatus();
  });
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(*id, "m-f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff");
}

// A CSPRNG that fails fails the id: INTERNAL, never a weaker id.
TEST(MessageIdTest, AFailingSourceIsInternal) {
  absl::StatusOr<std::string> id =
      NewMessageId([](void*, size_t) { return absl::InternalError("getrandom: Function not implemented"); });
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(id.status().message(),
            "header.message_id: empty, and no random id could be made for it (getrandom: Function not implemented); "
            "retry, or set a message id of your own");
}

}  // namespace
}  // namespace kvrelay
