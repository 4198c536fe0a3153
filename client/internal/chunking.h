// Chunking of turns into upload streams, and reassembly of delivered
// messages from download streams, exactly as proto/kvrelay/v1/relay.proto
// lays them out. Used by RelayClient; nobody outside client/ includes it.
//
// Byte order: tensors travel little-endian; the in-memory tensors of core/
// are host order, which kvrelay only supports on little-endian hosts.
//
// Thread-safety: the free functions are pure. TrailerBuilder and
// MessageAssembler are not thread-safe.
#ifndef KVRELAY_CLIENT_INTERNAL_CHUNKING_H_
#define KVRELAY_CLIENT_INTERNAL_CHUNKING_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/message.h"
#include "core/turn.h"
#include "kvrelay/v1/relay.pb.h"
#include "proto/raw_chunk.h"
#include "proto/wire.h"

namespace kvrelay {
namespace client_internal {

// The stream vocabulary shared with the relay (proto/wire.h).
using ::kvrelay::FilePartName;  // "prompt.k", "k.codes", ...
using ::kvrelay::kMaxChunkBytes;
using ::kvrelay::MessageDeliveryOrder;
using ::kvrelay::TensorRef;
using ::kvrelay::ToProtoDType;
using ::kvrelay::TrailerBuilder;

// InvalidArgument for DTYPE_UNSPECIFIED or an unknown value.
absl::StatusOr<DType> FromProtoDType(v1::DType dtype);

// The geometry of `turn` for a PublishHeader/CompressHeader.
// InvalidArgument when the turn has no layers or layer 0 is inconsistent.
absl::StatusOr<v1::TurnGeometry> TurnGeometryOf(const Turn& turn);

// Every tensor of `turn` in upload order: per layer PROMPT_K, PROMPT_V,
// GEN_K, GEN_V, PROMPT_SCORE, then HISTORY_K, HISTORY_V, HISTORY_POS when the
// turn has history. Views into `turn`, which must outlive the result.
std::vector<TensorRef> TurnUploadOrder(const Turn& turn);

// The MessageHeader fields that describe `msg` (geometry, token counts,
// quantization, accounting.{policy, full_bytes, sent_bytes, ratio}).
// REQUIRES: msg has at least one layer.
v1::MessageHeader MessageHeaderOf(const Message& msg);

// Tensor bytes of `tensors` in total.
uint64_t TotalBytes(absl::Span<const TensorRef> tensors);

// Splits `tensor` into chunks of at most `max_chunk` bytes (each with its
// CRC32C): fills `*chunk` with each in turn and calls `sink`, stopping at
// the first error the sink returns. `chunk` is typically the chunk field of
// the request the sink writes, so the data is copied once. A tensor of 0
// bytes produces no chunk. REQUIRES: max_chunk >= 1.
absl::Status ForEachChunk(const TensorRef& tensor, size_t max_chunk, v1::Chunk* chunk,
                          const std::function<absl::Status(const v1::Chunk&)>& sink);

// Rebuilds a Message from a delivery stream (Fetch, Compress): a header,
// chunks in the order of relay.proto, a trailer.
//
//   MessageAssembler a;
//   KVRELAY_RETURN_IF_ERROR(a.Start(header));
//   for each chunk: KVRELAY_RETURN_IF_ERROR(a.Add(chunk));
//   KVRELAY_ASSIGN_OR_RETURN(Message m, a.Finish(trailer));
//
// Errors: DATA_LOSS for a chunk CRC32C mismatch, or a trailer whose counts
// or CRC32C disagree with the chunks received; INVALID_ARGUMENT for a header
// that describes no valid message, a chunk out of order, duplicated, of the
// wrong size or beyond its tensor, or a stream that ends before every
// tensor is complete. Messages name the field, what was expected and what
// was found, e.g. "chunk layer 3 part k: offset 0, expected 1048576".
class MessageAssembler {
 public:
  MessageAssembler() = default;
  MessageAssembler(const MessageAssembler&) = delete;
  MessageAssembler& operator=(const MessageAssembler&) = delete;

  // Validates `header` and allocates every tensor of the message.
  absl::Status Start(const v1::MessageHeader& header);
  // Copies the chunk's data into its tensor, checking its CRC32C during the
  // copy: a chunk that fails it leaves bytes that the next chunk overwrites.
  absl::Status Add(const ChunkView& chunk);
  absl::Status Add(const v1::Chunk& chunk);
  // REQUIRES: Start() succeeded. The message is moved out.
  absl::StatusOr<Message> Finish(const v1::Trailer& trailer);

  uint64_t bytes_received() const { return bytes_received_; }
  uint64_t bytes_expected() const { return bytes_expected_; }

 private:
  struct Slot {
    uint32_t layer;
    v1::Part part;
    uint8_t* data;
    size_t size;
  };
  // Skips complete tensors (including empty ones) starting at next_.
  void SkipComplete();

  bool started_ = false;
  Message msg_;
  std::vector<Slot> slots_;
  size_t next_ = 0;       // slot being filled
  size_t filled_ = 0;     // bytes of slots_[next_] received
  uint64_t chunks_ = 0;
  uint64_t bytes_received_ = 0;
  uint64_t bytes_expected_ = 0;
  uint32_t crc_ = 0;
};

}  // namespace client_internal
}  // namespace kvrelay

#endif  // KVRELAY_CLIENT_INTERNAL_CHUNKING_H_
