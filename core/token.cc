#include "core/token.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/ids.h"
#include "openssl/sha.h"

namespace kvrelay {
namespace {

// Where a tokens-file line's digest starts (TokensFileLine, ParseTokensFile).
constexpr char kSha256Prefix[] = "sha256:";

}  // namespace

std::string Sha256Hex(absl::string_view data) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(data.data()), data.size(), digest);
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(digest), sizeof(digest)));
}

absl::Status RandomBytes(void* out, size_t n) {
  char* p = static_cast<char*>(out);
  size_t got = 0;
  while (got < n) {
    const ssize_t r = getrandom(p + got, n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return absl::InternalError(absl::StrCat("getrandom: ", std::strerror(r < 0 ? errno : EIO)));
    got += static_cast<size_t>(r);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> NewToken() {
  char raw[32];
  if (absl::Status s = RandomBytes(raw, sizeof(raw)); !s.ok()) return s;
  return absl::WebSafeBase64Escape(absl::string_view(raw, sizeof(raw)));
}

absl::StatusOr<std::string> TokensFileLine(absl::string_view agent, absl::string_view token) {
  if (absl::Status s = CheckId("agent", agent); !s.ok()) return s;
  return absl::StrCat(agent, " ", kSha256Prefix, Sha256Hex(token));
}

absl::StatusOr<std::vector<TokenEntry>> ParseTokensFile(const std::string& content, const std::string& source) {
  std::vector<TokenEntry> out;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(content, '\n')) {
    ++line_no;
    line = line.substr(0, line.find('#'));
    line = absl::StripAsciiWhitespace(line);
    if (line.empty()) continue;
    std::vector<absl::string_view> f = absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    const auto bad = [&](absl::string_view what) {
      return absl::InvalidArgumentError(absl::StrCat(source, ": line ", line_no, ": ", what,
                                                     "; expected 'AGENT sha256:HEX' (64 hex digits: the SHA-256 of "
                                                     "the token, e.g. from `kvrelayctl token new AGENT`)"));
    };
    if (f.size() != 2) return bad(absl::StrCat(f.size(), " fields"));
    if (!IsId(f[0])) return bad(absl::StrCat("the agent is not ", kIdPattern));
    if (!absl::StartsWith(f[1], kSha256Prefix)) return bad("the digest does not start with 'sha256:'");
    const absl::string_view hex = f[1].substr(strlen(kSha256Prefix));
    if (hex.size() != 64 || !std::all_of(hex.begin(), hex.end(), [](char c) { return absl::ascii_isxdigit(c); })) {
      return bad(absl::StrCat("the digest has ", hex.size(), " characters, not 64 hex digits"));
    }
    TokenEntry e;
    e.agent = std::string(f[0]);
    const std::string bytes = absl::HexStringToBytes(hex);
    std::copy(bytes.begin(), bytes.end(), e.digest.begin());
    for (const TokenEntry& prior : out) {
      if (prior.digest == e.digest) {
        return bad(absl::StrCat("the digest is also agent '", prior.agent, "''s: one token, one agent"));
      }
    }
    out.push_back(std::move(e));
  }
  return out;
}

}  // namespace kvrelay
