// Pipeline::Create on arbitrary spec strings. A spec it accepts has a
// canonical spec() that is accepted too and is its own canonical form.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/pipeline.h"
#include "fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvrelay;
  const std::string spec(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<std::unique_ptr<Pipeline>> p = Pipeline::Create(spec);
  if (!p.ok()) {
    FUZZ_CHECK(p.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  absl::StatusOr<std::unique_ptr<Pipeline>> canonical = Pipeline::Create((*p)->spec());
  FUZZ_CHECK(canonical.ok());
  FUZZ_CHECK((*canonical)->spec() == (*p)->spec());
  return 0;
}
