// Conversions between the core data model and relay.proto that both the
// relay and its clients need. Pure functions, thread-safe.
#ifndef KVRELAY_PROTO_WIRE_H_
#define KVRELAY_PROTO_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "absl/types/span.h"
#include "core/dtype.h"
#include "core/message.h"
#include "kvrelay/v1/relay.pb.h"

namespace kvrelay {

// Most tensor bytes one Chunk carries (relay.proto).
inline constexpr size_t kMaxChunkBytes = size_t{1} << 20;

// One tensor of a stream: (layer, part) and a view of its bytes.
struct TensorRef {
  uint32_t layer = 0;
  v1::Part part = v1::PART_UNSPECIFIED;
  absl::Span<const uint8_t> data;
};

// Every tensor of `msg` in delivery order (relay.proto): per layer K, V, POS
// when dense; K_CODES, K_SCALE, K_ZERO, V_CODES, V_SCALE, V_ZERO, POS when
// quantized. Tensors of 0 bytes are included (they send no chunk). Views
// into `msg`, which must outlive the result.
std::vector<TensorRef> MessageDeliveryOrder(const Message& msg);

// Walks tensors in order in pieces of at most `max_chunk` bytes: the chunks
// of a stream. Tensors of 0 bytes give none. The pieces are views into the
// tensors, which must outlive the cursor. Not thread-safe.
// REQUIRES: max_chunk >= 1.
class ChunkCursor {
 public:
  struct Piece {
    uint32_t layer = 0;
    v1::Part part = v1::PART_UNSPECIFIED;
    uint64_t offset = 0;              // of data within its tensor
    absl::Span<const uint8_t> data;   // 1 to max_chunk bytes
  };

  explicit ChunkCursor(std::vector<TensorRef> tensors, size_t max_chunk = kMaxChunkBytes)
      : tensors_(std::move(tensors)), max_chunk_(max_chunk) {}

  // Sets *piece to the next piece; false once every piece was given.
  bool Next(Piece* piece);

 private:
  std::vector<TensorRef> tensors_;
  size_t max_chunk_;
  size_t cursor_ = 0;  // tensor
  size_t offset_ = 0;  // within it
};

// Accumulates the trailer of a stream: chunk count, bytes, CRC32C over all
// chunk data in stream order. Not thread-safe.
class TrailerBuilder {
 public:
  // REQUIRES: chunk.crc32c() is the CRC32C of chunk.data() (it is combined,
  // not recomputed).
  void Add(const v1::Chunk& chunk);
  // A chunk of `size` bytes whose data has CRC32C `crc32c`.
  void Add(uint32_t crc32c, uint64_t size);
  v1::Trailer Build() const;

 private:
  uint64_t chunks_ = 0;
  uint64_t bytes_ = 0;
  uint32_t crc_ = 0;
};

// The file-format suffix of `part` ("prompt.k", "k.codes", ...; docs/FORMAT.md):
// tensor (layer l, part) is named "layer.{l}.{suffix}". "unknown" otherwise.
const char* FilePartName(v1::Part part);

v1::DType ToProtoDType(DType dtype);

// std::nullopt for DTYPE_UNSPECIFIED and unknown values; callers name the
// field in their error.
std::optional<DType> DTypeFromProto(v1::DType dtype);

// The message-shape fields of a delivery header: layers, kv_heads, head_dim,
// dtype, the four part sizes, next_pos and the quantization (bits, group,
// rotate).
// Leaves ids, routing and accounting alone.
void FillMessageHeader(const Message& msg, v1::MessageHeader* h);

}  // namespace kvrelay

#endif  // KVRELAY_PROTO_WIRE_H_
