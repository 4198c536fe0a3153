// ReadTurn on arbitrary bytes. A turn it accepts writes back (WriteTurn)
// and reads again, and writing that turn gives the same bytes.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/format/turn_file.h"
#include "fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvrelay;
  absl::StatusOr<Turn> turn = ReadTurn(absl::MakeConstSpan(data, size));
  if (!turn.ok()) {
    FUZZ_CHECK(turn.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  std::string out;
  FUZZ_CHECK(WriteTurn(*turn, &out).ok());
  absl::StatusOr<Turn> again = ReadTurn(AsBytes(out));
  FUZZ_CHECK(again.ok());
  std::string out2;
  FUZZ_CHECK(WriteTurn(*again, &out2).ok());
  FUZZ_CHECK(out == out2);
  return 0;
}
