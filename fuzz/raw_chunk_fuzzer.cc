// RawMessage (proto/raw_chunk.h) on arbitrary messages, against the
// generated parser. Input: one byte choosing the slice size (0: one slice),
// then the serialized message. Whenever AsChunk accepts the message as a
// chunk, the generated parser reads the same message as that chunk with the
// same fields and data, and CopyTo returns the data's CRC32C.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/crc32c.h"
#include "fuzz/fuzz_check.h"
#include "fuzz/fuzz_frames.h"
#include "google/protobuf/stubs/logging.h"
#include "proto/raw_chunk.h"

// Invalid UTF-8 in a string field is logged by protobuf on every parse.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvrelay;
  if (size < 1) return 0;
  const std::string bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  RawMessage raw;
  FUZZ_CHECK(raw.Reset(fuzz::Sliced(bytes, data[0])));
  FUZZ_CHECK(raw.size() == bytes.size());
  v1::PublishRequest parsed;
  const bool parses = raw.ParseAs(&parsed);
  FUZZ_CHECK(parses == parsed.ParseFromString(bytes));
  ChunkView view;
  if (!raw.AsChunk(v1::PublishRequest::kChunkFieldNumber, &view)) return 0;
  FUZZ_CHECK(parses && parsed.kind_case() == v1::PublishRequest::kChunk);
  const v1::Chunk& c = parsed.chunk();
  FUZZ_CHECK(view.layer == c.layer());
  FUZZ_CHECK(static_cast<int>(view.part) == static_cast<int>(c.part()));
  FUZZ_CHECK(view.offset == c.offset());
  FUZZ_CHECK(view.crc32c == c.crc32c());
  FUZZ_CHECK(view.size == c.data().size());
  std::string joined;
  uint64_t sum = 0;
  for (absl::Span<const uint8_t> p : view.pieces) {
    joined.append(reinterpret_cast<const char*>(p.data()), p.size());
    sum += p.size();
  }
  FUZZ_CHECK(sum == view.size);
  FUZZ_CHECK(joined == c.data());
  std::string copy(view.size, '\0');
  FUZZ_CHECK(view.CopyTo(reinterpret_cast<uint8_t*>(copy.data())) == Crc32c(c.data().data(), c.data().size()));
  FUZZ_CHECK(copy == c.data());
  return 0;
}
