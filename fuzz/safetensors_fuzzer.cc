// SafetensorsReader::ParseView on arbitrary bytes. For a file it accepts:
// every tensor lies inside the buffer with the size its dtype and shape
// claim, Find() returns it, and SerializeSafetensors of what was read (when
// it accepts it) parses back to the same tensors and metadata.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/format/safetensors.h"
#include "fuzz/fuzz_check.h"

namespace kvrelay {
namespace {

bool SameTensors(const SafetensorsReader& a, const SafetensorsReader& b) {
  if (a.metadata() != b.metadata() || a.tensors().size() != b.tensors().size()) return false;
  for (const StTensor& t : a.tensors()) {
    const StTensor* u = b.Find(t.name);
    if (u == nullptr || u->dtype != t.dtype || u->shape != t.shape || u->data.size() != t.data.size()) {
      return false;
    }
    if (!t.data.empty() && std::memcmp(u->data.data(), t.data.data(), t.data.size()) != 0) return false;
  }
  return true;
}

}  // namespace
}  // namespace kvrelay

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvrelay;
  absl::StatusOr<SafetensorsReader> r = SafetensorsReader::ParseView(absl::MakeConstSpan(data, size));
  if (!r.ok()) {
    FUZZ_CHECK(r.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  for (const StTensor& t : r->tensors()) {
    FUZZ_CHECK(t.data.size() == static_cast<uint64_t>(t.NumElements()) * StDTypeSize(t.dtype));
    FUZZ_CHECK(t.data.empty() || (t.data.data() >= data && t.data.data() + t.data.size() <= data + size));
    FUZZ_CHECK(r->Find(t.name) == &t);
  }
  absl::StatusOr<std::string> bytes = SerializeSafetensors(r->tensors(), r->metadata());
  if (!bytes.ok()) return 0;
  absl::StatusOr<SafetensorsReader> again = SafetensorsReader::ParseView(AsBytes(*bytes));
  FUZZ_CHECK(again.ok());
  FUZZ_CHECK(SameTensors(*r, *again));
  return 0;
}
