// The flag table: every flag reaches the relay's configuration from each of
// its three sources, and the docs' table is the one the code makes.
#include "server/config/flags.h"

#include <cctype>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gtest/gtest.h"

namespace kvrelay {
namespace {

absl::StatusOr<ServerConfig> ParseWith(std::vector<std::string> args, const std::string& var = "",
                                       const std::string& value = "") {
  args.insert(args.begin(), "kvrelay-server");
  std::vector<const char*> argv;
  for (const std::string& a : args) argv.push_back(a.c_str());
  return ParseServerConfig(static_cast<int>(argv.size()), argv.data(), [&](const char* name) -> const char* {
    return name == var ? value.c_str() : nullptr;
  });
}

// A value no flag takes: each source's error must name that source.
constexpr char kBad[] = "\x01not-a-value";

TEST(FlagsTest, NamesVariablesAndHelpFollowOneRule) {
  std::set<std::string> names;
  const std::string usage = ServerUsage();
  for (const FlagSpec& f : ServerFlags()) {
    EXPECT_TRUE(names.insert(f.name).second) << f.name << " given twice";
    EXPECT_EQ(f.env, "KVRELAY_" + absl::AsciiStrToUpper(absl::StrReplaceAll(f.name, {{"-", "_"}}))) << f.name;
    EXPECT_FALSE(f.help.empty()) << f.name;
    EXPECT_EQ(f.metavar.empty(), f.kind == FlagKind::kSwitch) << f.name;
    EXPECT_EQ(f.env_separator != 0, f.kind == FlagKind::kList || f.kind == FlagKind::kMap) << f.name;
    EXPECT_EQ(f.parse == nullptr, f.kind == FlagKind::kConfig) << f.name;
    EXPECT_EQ(f.list != nullptr, f.kind == FlagKind::kList) << f.name;
    if (f.kind == FlagKind::kMap) EXPECT_NE(f.metavar.find('='), std::string::npos) << f.name;
    EXPECT_NE(usage.find(absl::StrCat("  --", f.name, " ")), std::string::npos) << f.name;
    EXPECT_NE(usage.find(f.env), std::string::npos) << f.name;
    EXPECT_EQ(FindServerFlag(f.name), &f);
  }
  EXPECT_EQ(FindServerFlag("frobnicate"), nullptr);
}

// Each flag is read from the command line, from its variable and from the
// config file, and a bad value is refused naming where it came from.
TEST(FlagsTest, EverySourceReachesEveryFlag) {
  const std::string path = ::testing::TempDir() + "/kvrelay_flags_test.json";
  for (const FlagSpec& f : ServerFlags()) {
    if (f.kind == FlagKind::kConfig) continue;
    SCOPED_TRACE(f.name);
    const std::string value = f.kind == FlagKind::kSwitch ? "maybe" : kBad;
    auto flag = ParseWith({absl::StrCat("--", f.name, "=", value)});
    auto env = ParseWith({}, f.env, value);
    const std::string json_value = f.kind == FlagKind::kSwitch ? "\"maybe\""
                                   : f.kind == FlagKind::kMap  ? "[\"\\u0001not-a-value\"]"
                                                               : "\"\\u0001not-a-value\"";
    std::ofstream(path) << "{\"" << absl::StrReplaceAll(f.name, {{"-", "_"}}) << "\": " << json_value << "}";
    auto file = ParseWith({"--config", path});
    // A file name is any non-empty string: the three sources then agree,
    // whether or not the rules between flags (CheckServerConfig) allow it.
    const std::string value_error = absl::StrCat("--", f.name, "=");
    if (flag.ok() || !absl::StartsWith(flag.status().message(), value_error)) {
      EXPECT_EQ(env.status(), flag.status());
      EXPECT_EQ(file.status(), flag.status());
      continue;
    }
    EXPECT_EQ(flag.status().code(), absl::StatusCode::kInvalidArgument);
    ASSERT_FALSE(env.ok());
    EXPECT_TRUE(absl::StartsWith(env.status().message(), absl::StrCat(f.env, ": ", value_error))) << env.status();
    ASSERT_FALSE(file.ok());
    EXPECT_TRUE(absl::StartsWith(file.status().message(), absl::StrCat("--config=", path, ": ", value_error)))
        << file.status();
  }
  std::remove(path.c_str());
}

// docs/OPERATING.md holds the table ServerFlagsMarkdown makes; after a
// change to a flag, `kvrelay-server --help=markdown` gives the new one.
TEST(FlagsTest, TheDocsTableIsTheFlagTable) {
  std::ifstream in(std::string(KVRELAY_SOURCE_DIR) + "/docs/OPERATING.md");
  ASSERT_TRUE(in) << "docs/OPERATING.md";
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string doc = ss.str();
  const size_t begin = doc.find("<!-- flags:begin");
  const size_t end = doc.find("<!-- flags:end -->");
  ASSERT_NE(begin, std::string::npos);
  ASSERT_NE(end, std::string::npos);
  const size_t first = doc.find('\n', begin) + 1;
  EXPECT_EQ(doc.substr(first, end - first), ServerFlagsMarkdown())
      << "regenerate the table between the markers with `kvrelay-server --help=markdown`";
  EXPECT_EQ(ParseWith({"--help=markdown"}).status().message(), ServerFlagsMarkdown());
}

}  // namespace
}  // namespace kvrelay
