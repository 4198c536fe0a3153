#include "core/token.h"

#include <set>
#include <string>

#include "absl/strings/escaping.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvrelay {
namespace {

TEST(Sha256Hex, KnownVectors) {
  EXPECT_EQ(Sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Sha256Hex(std::string("a\0b", 3)), Sha256Hex(std::string("a\0b", 3)));
  EXPECT_NE(Sha256Hex(std::string("a\0b", 3)), Sha256Hex("a"));
}

TEST(NewToken, UrlSafeBase64OfThirtyTwoFreshBytes) {
  std::set<std::string> seen;
  for (int i = 0; i < 100; ++i) {
    absl::StatusOr<std::string> t = NewToken();
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_EQ(t->size(), 43u);
    EXPECT_THAT(*t, ::testing::MatchesRegex("[A-Za-z0-9_-]+"));
    std::string raw;
    ASSERT_TRUE(absl::WebSafeBase64Unescape(*t, &raw));
    EXPECT_EQ(raw.size(), 32u);
    seen.insert(*t);
  }
  EXPECT_EQ(seen.size(), 100u);
}

TEST(TokensFileLine, AgentAndHashOfTheToken) {
  EXPECT_EQ(*TokensFileLine("planner", "abc"),
            "planner sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_TRUE(TokensFileLine(std::string(128, 'a'), "t").ok());
  EXPECT_TRUE(TokensFileLine("A-z.0_9:x", "t").ok());
  for (const std::string& bad : {std::string(), std::string(129, 'a'), std::string("a b"), std::string("a/b"),
                                 std::string("a\nb")}) {
    absl::StatusOr<std::string> line = TokensFileLine(bad, "t");
    EXPECT_EQ(line.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(line.status().message()), ::testing::HasSubstr("expected [A-Za-z0-9._:-]{1,128}"));
    EXPECT_THAT(std::string(line.status().message()), ::testing::StartsWith("agent: "));
  }
}

}  // namespace
}  // namespace kvrelay
