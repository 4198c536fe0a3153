// ParseRouteFile on arbitrary content: a route table or InvalidArgument.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz/fuzz_check.h"
#include "server/mesh/routing.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvrelay;
  const std::string content(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<std::map<std::string, std::string>> routes = ParseRouteFile(content, "--route-file");
  if (!routes.ok()) {
    FUZZ_CHECK(routes.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  for (const auto& [agent, target] : *routes) FUZZ_CHECK(!agent.empty() && !target.empty());
  return 0;
}
