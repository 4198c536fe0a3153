// Checks of request fields shared by the relay's calls. Each fails with
// INVALID_ARGUMENT naming the field, what was expected and what was found.
#ifndef KVRELAY_SERVER_REQUEST_CHECKS_H_
#define KVRELAY_SERVER_REQUEST_CHECKS_H_

#include <string>

#include "absl/status/status.h"
#include "core/pipeline.h"
#include "core/turn.h"

namespace kvrelay {

// At most this many recipients per publish (INVALID_ARGUMENT beyond).
inline constexpr int kMaxRecipients = 64;

// Checks an id against [A-Za-z0-9._:-]{1,128}. InvalidArgument naming `field`.
absl::Status CheckId(const std::string& field, const std::string& value);

// The spec bound (kMaxSpecBytes), checked before parsing so that the error
// names the header field. Specs are tens of bytes; the bound keeps error
// messages (which quote the spec) and log lines small, and under the 8 KiB of
// trailing metadata gRPC clients accept by default.
// `field` names the policy in the error.
absl::Status CheckPolicyLength(const std::string& policy, const std::string& field = "header.policy");

// The policy against the geometry: its quantization options against
// head_dim, and `window` only with queries. The error is prefixed by `field`.
absl::Status CheckPolicyFor(const Pipeline& p, const TurnGeometry& geo, const std::string& field);

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_REQUEST_CHECKS_H_
