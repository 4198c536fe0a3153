// ParseTokensFile on arbitrary content: entries (none with an empty agent)
// or InvalidArgument.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz/fuzz_check.h"
#include "server/auth/auth.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvrelay;
  const std::string content(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<std::vector<TokenEntry>> tokens = ParseTokensFile(content, "--tokens-file");
  if (!tokens.ok()) {
    FUZZ_CHECK(tokens.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  for (const TokenEntry& e : *tokens) FUZZ_CHECK(!e.agent.empty());
  return 0;
}
