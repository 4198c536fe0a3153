// kvrelayctl's flag parser (client/kvrelayctl/flags.h): both value forms,
// bool and repeated flags, values that start with '-', help, the typed
// getters with the table's defaults, and every error message exactly.
#include "client/kvrelayctl/flags.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvrelay::ctl {
namespace {

using ::testing::ElementsAre;

VerbSpec TestSpec() {
  return {"",
          {
              RequiredFlag("out", "FILE", "where it goes"),
              ValueFlag("seed", "X", "random seed", "1"),
              ValueFlag("wait", "SECONDS", "how long", "30"),
              BoolFlag("decode", "decodes"),
              RepeatedFlag("to", "AGENT", "a recipient"),
          }};
}

absl::StatusOr<Flags> Parse(std::vector<std::string> args) { return Flags::Parse("verb", TestSpec(), args); }

std::string Error(std::vector<std::string> args) {
  absl::StatusOr<Flags> flags = Parse(std::move(args));
  EXPECT_FALSE(flags.ok());
  EXPECT_EQ(flags.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(flags.status().message());
}

TEST(KvrelayctlFlags, SpaceAndEqualsForms) {
  absl::StatusOr<Flags> flags = Parse({"--out", "a.st", "--seed=7", "pos"});
  ASSERT_TRUE(flags.ok()) << flags.status();
  EXPECT_EQ(flags->Get("out"), "a.st");
  EXPECT_EQ(flags->Get("seed"), "7");
  EXPECT_THAT(flags->positional(), ElementsAre("pos"));
  EXPECT_FALSE(flags->help_requested());
}

TEST(KvrelayctlFlags, EqualsFormKeepsLaterEqualsAndEmptyValue) {
  absl::StatusOr<Flags> flags = Parse({"--out=a=b", "--seed="});
  ASSERT_TRUE(flags.ok()) << flags.status();
  EXPECT_EQ(flags->Get("out"), "a=b");
  EXPECT_EQ(flags->Get("seed"), "");
  EXPECT_EQ(flags->Required("seed").status().message(), "flag --seed: empty value");
}

TEST(KvrelayctlFlags, BoolFlag) {
  absl::StatusOr<Flags> flags = Parse({"--decode"});
  ASSERT_TRUE(flags.ok()) << flags.status();
  EXPECT_TRUE(flags->Has("decode"));
  EXPECT_FALSE(flags->Has("out"));
  EXPECT_EQ(Error({"--decode=true"}), "flag --decode takes no value");
  EXPECT_EQ(Error({"--decode", "--decode"}), "flag --decode given twice");
}

TEST(KvrelayctlFlags, RepeatedFlagKeepsOrder) {
  absl::StatusOr<Flags> flags = Parse({"--to", "a", "--to=b", "--to", "a"});
  ASSERT_TRUE(flags.ok()) << flags.status();
  EXPECT_THAT(flags->GetAll("to"), ElementsAre("a", "b", "a"));
  EXPECT_TRUE(flags->GetAll("out").empty());
}

TEST(KvrelayctlFlags, ValuedFlagGivenTwice) {
  EXPECT_EQ(Error({"--out", "a", "--out=b"}), "flag --out given twice");
}

TEST(KvrelayctlFlags, ValueStartingWithDashIsTheValue) {
  absl::StatusOr<Flags> flags = Parse({"--seed", "-5", "--out", "--decode"});
  ASSERT_TRUE(flags.ok()) << flags.status();
  EXPECT_EQ(flags->Get("seed"), "-5");
  EXPECT_EQ(flags->Get("out"), "--decode");
  EXPECT_FALSE(flags->Has("decode"));
  EXPECT_EQ(flags->Int("seed", 0, 10).status().message(), "flag --seed: \"-5\", expected an integer in [0, 10]");
}

TEST(KvrelayctlFlags, UnknownFlagNamesItAndListsTheVerbsFlags) {
  const std::string want = "; its flags: --out, --seed, --wait, --decode, --to";
  EXPECT_EQ(Error({"--bogus", "1"}), "unknown flag --bogus for verb" + want);
  EXPECT_EQ(Error({"--bogus=1"}), "unknown flag --bogus for verb" + want);
  EXPECT_EQ(Error({"-x"}), "unknown flag -x for verb" + want);
  EXPECT_EQ(Error({"-5"}), "unknown flag -5 for verb" + want);
  EXPECT_EQ(Error({"--"}), "unknown flag -- for verb" + want);
  absl::StatusOr<Flags> none = Flags::Parse("inspect", VerbSpec{"FILE", {}}, std::vector<std::string>{"--all"});
  EXPECT_EQ(none.status().message(), "unknown flag --all for inspect; it takes no flags");
}

TEST(KvrelayctlFlags, MissingValueNamesTheFlag) {
  EXPECT_EQ(Error({"--out"}), "flag --out needs a value (--out FILE)");
  EXPECT_EQ(Error({"--decode", "--to"}), "flag --to needs a value (--to AGENT)");
}

TEST(KvrelayctlFlags, LoneDashIsPositional) {
  absl::StatusOr<Flags> flags = Parse({"-", "x"});
  ASSERT_TRUE(flags.ok()) << flags.status();
  EXPECT_THAT(flags->positional(), ElementsAre("-", "x"));
}

TEST(KvrelayctlFlags, HelpStopsParsing) {
  for (const char* help : {"--help", "-h"}) {
    absl::StatusOr<Flags> flags = Parse({help, "--bogus"});
    ASSERT_TRUE(flags.ok()) << flags.status();
    EXPECT_TRUE(flags->help_requested());
  }
  EXPECT_EQ(Error({"--help=1"}).substr(0, 24), "unknown flag --help for ");
}

TEST(KvrelayctlFlags, RequiredAndDefaults) {
  absl::StatusOr<Flags> flags = Parse({});
  ASSERT_TRUE(flags.ok()) << flags.status();
  EXPECT_EQ(flags->Required("out").status().message(), "verb: missing required flag --out");
  EXPECT_EQ(flags->Get("seed"), std::nullopt);
  EXPECT_EQ(flags->Value("seed"), "1");
  EXPECT_EQ(flags->Value("out"), std::nullopt);
  EXPECT_EQ(*flags->Int("seed", 0, 10), 1);
  EXPECT_EQ(*flags->IntOr("out", 42, 0, 10), 42);  // a computed default is not range-checked
  EXPECT_EQ(flags->Seconds("wait", 0.001, 60)->count(), 30000);
  EXPECT_EQ(flags->Int("out", 0, 10).status().code(), absl::StatusCode::kInternal);
}

TEST(KvrelayctlFlags, TypedGetterErrorsNameFlagValueAndRange) {
  absl::StatusOr<Flags> flags = Parse({"--seed", "x", "--wait", "0.25"});
  ASSERT_TRUE(flags.ok()) << flags.status();
  EXPECT_EQ(flags->Int("seed", 0, 10).status().message(), "flag --seed: \"x\", expected an integer in [0, 10]");
  EXPECT_EQ(flags->Seconds("wait", 0.001, 86400)->count(), 250);
  EXPECT_EQ(flags->Seconds("wait", 1, 60).status().message(), "flag --wait: \"0.25\", expected seconds in [1, 60]");
}

TEST(KvrelayctlFlags, HelpTextComesFromTheTable) {
  EXPECT_EQ(HelpText("verb", "Does things.", TestSpec()),
            "usage: kvrelayctl verb [flags]\n"
            "Does things.\n"
            "\n"
            "flags:\n"
            "  --out FILE\n"
            "      where it goes (required)\n"
            "  --seed X\n"
            "      random seed (default: 1)\n"
            "  --wait SECONDS\n"
            "      how long (default: 30)\n"
            "  --decode\n"
            "      decodes\n"
            "  --to AGENT\n"
            "      a recipient (repeatable)\n");
  EXPECT_EQ(HelpText("inspect", "Describes a file.", VerbSpec{"FILE", {}}),
            "usage: kvrelayctl inspect FILE\nDescribes a file.\n\nno flags.\n");
}

TEST(KvrelayctlFlags, SynopsisComesFromTheTableAndWraps) {
  EXPECT_EQ(Synopsis("verb", TestSpec()),
            "  verb --out FILE [--seed X] [--wait SECONDS] [--decode] [--to AGENT ...]\n");
  VerbSpec required = TestSpec();
  required.synopsis = "POS";
  required.flags.back().required = true;
  // Wrapped before 40 columns, continuation lines under the first word.
  EXPECT_EQ(Synopsis("verb", required, 2, 40),
            "  verb POS --out FILE [--seed X]\n"
            "       [--wait SECONDS] [--decode]\n"
            "       --to AGENT [--to AGENT ...]\n");
  EXPECT_EQ(Synopsis("inspect", VerbSpec{"FILE", {}}), "  inspect FILE\n");
}

}  // namespace
}  // namespace kvrelay::ctl
