// ReadMessage on arbitrary bytes. A message it accepts writes back
// (WriteMessage) and reads again, and writing that message gives the same
// bytes.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/format/turn_file.h"
#include "fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvrelay;
  absl::StatusOr<Message> msg = ReadMessage(absl::MakeConstSpan(data, size));
  if (!msg.ok()) {
    FUZZ_CHECK(msg.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  std::string out;
  FUZZ_CHECK(WriteMessage(*msg, &out).ok());
  absl::StatusOr<Message> again = ReadMessage(AsBytes(out));
  FUZZ_CHECK(again.ok());
  std::string out2;
  FUZZ_CHECK(WriteMessage(*again, &out2).ok());
  FUZZ_CHECK(out == out2);
  return 0;
}
