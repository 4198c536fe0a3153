// A generic reader and writer for safetensors files.
//
// Layout (https://github.com/huggingface/safetensors): an 8-byte
// little-endian header length N, N bytes of JSON header, then the tensor
// data. The header is an object mapping each tensor name to
// {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, with
// offsets relative to the first byte after the header, plus an optional
// "__metadata__" object whose values are strings. Data is little-endian and
// row-major.
//
// The reader checks everything the header claims against the buffer and
// rejects malformed files with InvalidArgument naming the tensor (or field),
// what was expected and what was found. It copies no tensor data: the
// tensors it returns are spans into the buffer it parsed.
//
// The writer is deterministic: "__metadata__" first (omitted when empty,
// keys sorted), then the tensors in the order given, data laid out
// contiguously in that order, header padded with spaces so the data starts
// at a multiple of 8 bytes.
//
// Thread-safety: a SafetensorsReader is immutable after Parse*(); concurrent
// const access is safe. Free functions are thread-safe.
#ifndef KVRELAY_CORE_FORMAT_SAFETENSORS_H_
#define KVRELAY_CORE_FORMAT_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvrelay {

// Element types of the safetensors format. The kvrelay turn and message
// layers use only F32, F16, BF16, I32 and U8; the others are accepted here so
// that foreign files parse and the higher layers can name what they found.
enum class StDType : uint8_t {
  kBool,
  kU8,
  kI8,
  kU16,
  kI16,
  kF16,
  kBF16,
  kU32,
  kI32,
  kF32,
  kU64,
  kI64,
  kF64,
  kF8E4M3,
  kF8E5M2,
};

// The safetensors name: "BOOL", "U8", ..., "F8_E4M3", "F8_E5M2".
absl::string_view StDTypeName(StDType dtype);
// Inverse of StDTypeName (exact, case-sensitive); nullopt for anything else.
std::optional<StDType> ParseStDType(absl::string_view name);
// Bytes per element (1, 2, 4 or 8).
size_t StDTypeSize(StDType dtype);

// "[2,3,4]".
std::string ShapeString(absl::Span<const int64_t> shape);

// One tensor: a view of bytes that somebody else owns.
struct StTensor {
  std::string name;
  StDType dtype = StDType::kF32;
  std::vector<int64_t> shape;
  absl::Span<const uint8_t> data;  // exactly NumElements() * StDTypeSize(dtype) bytes

  // Product of `shape` (1 for a scalar). REQUIRES: no overflow (the reader
  // guarantees it for what it returns).
  int64_t NumElements() const;
};

using StMetadata = std::map<std::string, std::string>;

// Header lengths above this are rejected as absurd.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = uint64_t{16} << 20;  // 16 MiB

class SafetensorsReader {
 public:
  // Parses `bytes` without copying them. The caller keeps `bytes` alive and
  // unchanged for as long as the reader, or any span it handed out, is used.
  static absl::StatusOr<SafetensorsReader> ParseView(absl::Span<const uint8_t> bytes);
  // Parses `buffer`, taking ownership of it; spans stay valid for the life
  // of the reader and of its copies.
  static absl::StatusOr<SafetensorsReader> ParseOwned(std::string buffer);
  // Reads the whole file at `path` and parses it (ParseOwned). NotFound or
  // Internal for I/O errors, InvalidArgument (prefixed with the path) for a
  // malformed file.
  static absl::StatusOr<SafetensorsReader> ReadFile(const std::string& path);

  // "__metadata__", empty when absent.
  const StMetadata& metadata() const { return metadata_; }
  // Value of a metadata key, nullopt when absent.
  std::optional<absl::string_view> GetMetadata(absl::string_view key) const;
  // Every tensor, in ascending data offset (file order; ties by name).
  const std::vector<StTensor>& tensors() const { return tensors_; }
  // The tensor named `name`, or nullptr.
  const StTensor* Find(absl::string_view name) const;
  // Bytes of the JSON header (without the 8-byte length).
  uint64_t header_bytes() const { return header_bytes_; }

 private:
  SafetensorsReader() = default;
  absl::Status Parse(absl::Span<const uint8_t> bytes);

  std::shared_ptr<const std::string> owned_;  // set by ParseOwned / ReadFile
  StMetadata metadata_;
  std::vector<StTensor> tensors_;
  std::map<std::string, size_t, std::less<>> index_;  // name -> position in tensors_
  uint64_t header_bytes_ = 0;
};

// Serializes `tensors` and `metadata` into one safetensors buffer.
// InvalidArgument (naming the tensor) for an empty, duplicate or
// "__metadata__" name, a negative dimension, or a data span whose size is not
// NumElements() * StDTypeSize(dtype).
absl::StatusOr<std::string> SerializeSafetensors(absl::Span<const StTensor> tensors,
                                                 const StMetadata& metadata);

// The bytes SerializeSafetensors writes before the tensor data (the length
// field and the padded JSON header); followed by each tensor's `data` in
// order, they are its whole output. Same errors.
absl::StatusOr<std::string> SafetensorsHeader(absl::Span<const StTensor> tensors, const StMetadata& metadata);

// Same bytes as SerializeSafetensors, streamed to the file at `path`
// without assembling the buffer in memory. A new file, or a regular file of
// this user's with one link, is written under a temporary name beside it
// (with the old file's mode from the start) and renamed over `path` once
// complete: after a failed write the old file is intact and nothing is left
// behind (unless the process is killed meanwhile; no fsync). Other paths
// (a device, FIFO or symbolic link, a file with other links or another
// owner, or where the directory takes no new file) are written in place. A
// file this user may not write is refused as open() would. Internal for I/O
// errors.
absl::Status WriteSafetensorsFile(const std::string& path, absl::Span<const StTensor> tensors,
                                  const StMetadata& metadata);

// Reads the whole file at `path`. NotFound when it does not exist, Internal
// for other I/O errors.
absl::StatusOr<std::string> ReadFileToString(const std::string& path);

// Bytes as an unsigned span (helper for std::string buffers).
inline absl::Span<const uint8_t> AsBytes(absl::string_view s) {
  return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

}  // namespace kvrelay

#endif  // KVRELAY_CORE_FORMAT_SAFETENSORS_H_
