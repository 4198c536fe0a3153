#include "server/config/identity_pattern.h"

#include <algorithm>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "proto/address.h"

namespace kvrelay {

absl::Status CheckIdentityPattern(absl::string_view p) {
  const bool printable = std::all_of(p.begin(), p.end(), [](char c) { return c > ' ' && c < 127; });
  absl::string_view rest = absl::StartsWith(p, "*.") ? p.substr(2) : p;
  if (p.empty() || p.size() > 1024 || !printable || rest.empty() || absl::StrContains(rest, '*') ||
      absl::StartsWith(rest, ".")) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", absl::CHexEscape(p),
                     "': expected a certificate SAN (a DNS name such as relay-0.kvrelay.agents.svc.cluster.local, "
                     "or a URI such as spiffe://cluster.local/ns/agents/sa/kvrelay) or '*.' and a DNS suffix"));
  }
  return absl::OkStatus();
}

bool IdentityMatches(absl::string_view pattern, absl::string_view san) {
  if (absl::StartsWith(pattern, "*.")) {
    absl::string_view suffix = pattern.substr(1);  // ".rest"
    if (san.size() <= suffix.size() || !absl::EndsWithIgnoreCase(san, suffix)) return false;
    absl::string_view label = san.substr(0, san.size() - suffix.size());
    return !absl::StrContains(label, '.') && !absl::StrContains(label, '/') && !absl::StrContains(label, ':');
  }
  if (absl::StrContains(pattern, "://")) return pattern == san;  // a URI: exact
  return SameHost(pattern, san);
}

}  // namespace kvrelay
