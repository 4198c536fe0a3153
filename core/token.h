// Bearer tokens of the relay's agents: what a client sends
// (`authorization: Bearer TOKEN`) and what a tokens file holds for it
// (`AGENT sha256:HEX`, HEX the SHA-256 of the token, never the token
// itself). Pure functions (OpenSSL's libcrypto), thread-safe.
#ifndef KVRELAY_CORE_TOKEN_H_
#define KVRELAY_CORE_TOKEN_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvrelay {

// Lowercase hex SHA-256 of `data` (64 characters).
std::string Sha256Hex(absl::string_view data);

// Fills `out[0, n)` from the kernel's CSPRNG (getrandom(2)), retrying on
// EINTR and short reads. INTERNAL naming the errno when the kernel gives no
// randomness; `out` is then not to be used. Thread-safe.
absl::Status RandomBytes(void* out, size_t n);

// A fresh token: 32 bytes from RandomBytes, URL-safe base64 without
// padding (43 characters of [A-Za-z0-9_-]). INTERNAL when the kernel gives
// no randomness.
absl::StatusOr<std::string> NewToken();

// The tokens-file line for `token` of `agent`: "AGENT sha256:HEX" (no
// newline). INVALID_ARGUMENT naming "agent" unless it is a relay agent id
// ([A-Za-z0-9._:-]{1,128}).
absl::StatusOr<std::string> TokensFileLine(absl::string_view agent, absl::string_view token);

// One line of a tokens file.
struct TokenEntry {
  std::string agent;
  std::array<uint8_t, 32> digest;  // SHA-256 of the token
};
// Parses a tokens file: one "AGENT sha256:HEX" per line (64 hex digits),
// blank lines, and '#' to the end of a line as a comment. InvalidArgument
// naming `source`, the line number and what was expected; a token itself
// never appears in the file, so none can leak through an error.
absl::StatusOr<std::vector<TokenEntry>> ParseTokensFile(const std::string& content, const std::string& source);

}  // namespace kvrelay

#endif  // KVRELAY_CORE_TOKEN_H_
