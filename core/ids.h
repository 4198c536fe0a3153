// Ids of sessions, messages and agents, as relay.proto defines them: 1 to
// 128 bytes of [A-Za-z0-9._:-]. The one home of that rule for the relay,
// its configuration, the tokens file and the C++ client.
//
// Thread-safety: pure functions.
#ifndef KVRELAY_CORE_IDS_H_
#define KVRELAY_CORE_IDS_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvrelay {

// The pattern, for messages.
inline constexpr char kIdPattern[] = "[A-Za-z0-9._:-]{1,128}";

// Whether `v` is an id.
bool IsId(absl::string_view v);

// OK for an id; otherwise InvalidArgument naming `field`: "FIELD: empty,
// expected [A-Za-z0-9._:-]{1,128}", "FIELD: N bytes, expected ..." past 128
// bytes, "FIELD: 'V', expected ..." (V C-escaped) for a wrong character.
absl::Status CheckId(absl::string_view field, absl::string_view v);

}  // namespace kvrelay

#endif  // KVRELAY_CORE_IDS_H_
