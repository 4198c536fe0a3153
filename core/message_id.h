// Message ids made for a publish that names none: by the relay, and by the
// C++ client (RelayClient::Publish without PublishOptions::message_id).
//
// An id is "m-" and 32 lowercase hex digits: 128 bits from the kernel's
// CSPRNG, and nothing else (no counter, salt or clock), so the ids an agent
// has seen tell nothing about the next one, and no agent can take another's
// id in advance. The form passes the relay's id check
// ([A-Za-z0-9._:-]{1,128}).
#ifndef KVRELAY_CORE_MESSAGE_ID_H_
#define KVRELAY_CORE_MESSAGE_ID_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvrelay {

// Random bytes in an id, and the id's length ("m-" + hex).
inline constexpr size_t kMessageIdRandomBytes = 16;
inline constexpr size_t kMessageIdLength = 2 + 2 * kMessageIdRandomBytes;

// Fills `out[0, n)` with random bytes, or fails (nothing else may be used).
using RandomFill = absl::FunctionRef<absl::Status(void* out, size_t n)>;

// A fresh id from RandomBytes (getrandom(2)). Thread-safe. INTERNAL naming
// header.message_id when the CSPRNG fails: no weaker id is made instead.
[[nodiscard]] absl::StatusOr<std::string> NewMessageId();
// The same from `fill` (tests inject a failing or a fixed source).
[[nodiscard]] absl::StatusOr<std::string> NewMessageId(RandomFill fill);

}  // namespace kvrelay

#endif  // KVRELAY_CORE_MESSAGE_ID_H_
