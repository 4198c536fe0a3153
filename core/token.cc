#include "core/token.h"

#include <sys/random.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "openssl/sha.h"

namespace kvrelay {

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
  bool ok = !agent.empty() && agent.size() <= 128;
  for (char c : agent) {
    ok = ok && ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
                c == '_' || c == ':' || c == '-');
  }
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("agent: \"", absl::CHexEscape(agent), "\", expected [A-Za-z0-9._:-]{1,128}"));
  }
  return absl::StrCat(agent, " sha256:", Sha256Hex(token));
}

}  // namespace kvrelay
