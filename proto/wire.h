// Conversions between the core data model and relay.proto that both the
// relay and its clients need. Pure functions, thread-safe.
#ifndef KVRELAY_PROTO_WIRE_H_
#define KVRELAY_PROTO_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/dtype.h"
#include "core/message.h"
#include "core/quant.h"
#include "core/turn.h"
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

// Walks tensors in order in pieces of at most `max_chunk` bytes: the chunks
// of a stream (the orders are proto/stream_codec.h's). Tensors of 0 bytes
// give none. The pieces are views into the tensors, which must outlive the
// cursor. Not thread-safe.
// REQUIRES: max_chunk >= 1.
class ChunkCursor {
 public:
  struct Piece {
    uint32_t layer = 0;
    v1::Part part = v1::PART_UNSPECIFIED;
    uint64_t offset = 0;              // of data within its tensor
    absl::Span<const uint8_t> data;   // 1 to max_chunk bytes
    size_t tensor = 0;                // index of its tensor, in append order
  };

  explicit ChunkCursor(std::vector<TensorRef> tensors, size_t max_chunk = kMaxChunkBytes)
      : tensors_(std::move(tensors)), max_chunk_(max_chunk) {}

  // Queues more tensors after the others.
  void Append(std::vector<TensorRef> tensors);

  // Sets *piece to the next piece; false once every queued piece was given.
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

// InvalidArgument for DTYPE_UNSPECIFIED or an unknown value.
absl::StatusOr<DType> FromProtoDType(v1::DType dtype);

// The geometry of `turn` for a PublishHeader/CompressHeader.
// InvalidArgument when the turn has no layers or layer 0 is inconsistent,
// or it carries history.acc (not uploaded; named). history.score sets
// history_score_tokens to its columns: the history's tokens, or with a
// parent the parent's (layers[0].tokens() of the message fetched).
absl::StatusOr<v1::TurnGeometry> TurnGeometryOf(const Turn& turn);

// A layout as a request header's geometry. The inverse of CheckGeometry
// (proto/stream_codec.h): a geometry that passes it comes back field for
// field, its unset optional fields unset.
v1::TurnGeometry ToProto(const TurnLayout& layout);

// The MessageHeader fields that describe `msg` (FillMessageHeader, and
// accounting.{policy, full_bytes, sent_bytes, ratio}).
// REQUIRES: msg has at least one layer.
v1::MessageHeader MessageHeaderOf(const Message& msg);

// An Accounting on the wire and back (attention_error set exactly when it
// is).
v1::Accounting ToProto(const Accounting& a);
Accounting AccountingFromProto(const v1::Accounting& a);

// The message-shape fields of a delivery header: layers, kv_heads, head_dim,
// dtype, the four part sizes, next_pos, anchor_pos and the quantization
// (SetQuantHeader).
// Leaves ids, routing and accounting alone.
void FillMessageHeader(const Message& msg, v1::MessageHeader* h);

// The quantization fields of a message header: quant_bits, quant_group,
// quant_rotate, quant_scheme, quant_keys_channel, quant_seed from `quant`
// (none: dense K/V, the fields stay 0), then n_demoted and demote_bits
// when n_demoted > 0, with quant_seed = demote_seed (a message has one
// lloyd seed). lloyd rows carry quant_group 0: only keys per channel
// group tokens.
void SetQuantHeader(const std::optional<QuantOptions>& quant, int n_demoted, int demote_bits, uint64_t demote_seed,
                    v1::MessageHeader* h);

}  // namespace kvrelay

#endif  // KVRELAY_PROTO_WIRE_H_
