// ParseServerConfig with --config pointing at a file holding the input (no
// flags, no environment). Any input gives a configuration or
// InvalidArgument, never a crash.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "fuzz/fuzz_check.h"
#include "server/config/config.h"

namespace {

const std::string& ConfigPath() {
  static const std::string* path = [] {
    const char* dir = std::getenv("TMPDIR");
    auto* p = new std::string(std::string(dir != nullptr && *dir != '\0' ? dir : "/tmp") +
                              "/kvrelay_fuzz_config." + std::to_string(getpid()) + ".json");
    std::atexit([] { unlink(ConfigPath().c_str()); });
    return p;
  }();
  return *path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvrelay;
  const std::string& path = ConfigPath();
  // A new file each time: ext4 flushes a file truncated and rewritten on close.
  unlink(path.c_str());
  FILE* f = std::fopen(path.c_str(), "wb");
  FUZZ_CHECK(f != nullptr);
  FUZZ_CHECK(std::fwrite(data, 1, size, f) == size);
  FUZZ_CHECK(std::fclose(f) == 0);
  const char* argv[] = {"kvrelay-server", "--config", path.c_str()};
  absl::StatusOr<ServerConfig> c = ParseServerConfig(3, argv, [](const char*) -> const char* { return nullptr; });
  if (!c.ok()) FUZZ_CHECK(c.status().code() == absl::StatusCode::kInvalidArgument);
  return 0;
}
