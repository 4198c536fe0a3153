// The identity of a peer relay as --peer-identity names it: a pattern
// matched against the SANs of the relay's certificate (auth/auth.h).
#ifndef KVRELAY_SERVER_CONFIG_IDENTITY_PATTERN_H_
#define KVRELAY_SERVER_CONFIG_IDENTITY_PATTERN_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvrelay {

// A --peer-identity pattern: a SAN (DNS name, IP address or URI, e.g. a
// SPIFFE id) matched exactly (DNS names ASCII case-insensitively), or
// "*.SUFFIX", which matches one more leading DNS label. InvalidArgument
// otherwise. A pattern with "://" matches URI SANs only, any other DNS and
// IP SANs only (an email SAN never matches).
absl::Status CheckIdentityPattern(absl::string_view pattern);
// Whether the SAN `san` matches `pattern`. REQUIRES: CheckIdentityPattern(pattern) is OK.
bool IdentityMatches(absl::string_view pattern, absl::string_view san);

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_CONFIG_IDENTITY_PATTERN_H_
