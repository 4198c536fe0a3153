// Chunk messages without protobuf copies.
//
// A generated protobuf message holds a Chunk's data in a std::string: the
// receiver copies the bytes out of gRPC's slices into it, and the sender
// copies them in and then again into gRPC's slices. For the tensor streams
// (Publish, Fetch, Compress) those copies were most of the relay's own
// work per byte. These helpers keep the wire format of relay.proto exactly
// and move the bytes once:
//
//  - RawMessage holds a received message as gRPC's slices and reads a
//    chunk out of them as views (ChunkView); ChunkView::CopyTo then copies
//    the data to its destination and computes its CRC32C in the same pass.
//    Anything that is not a plain chunk message (a header, a trailer, or a
//    chunk encoded unusually) is parsed as the generated message instead.
//  - EncodeChunkNoCopy sends a tensor's bytes as a slice that refers to the
//    tensor (kept alive by a shared_ptr until gRPC lets go of it);
//    EncodeChunkCopy copies them into the message once, computing the CRC32C
//    on the way.
//
// Thread-safety: the free functions are pure; a RawMessage or ChunkView is
// not thread-safe.
#ifndef KVRELAY_PROTO_RAW_CHUNK_H_
#define KVRELAY_PROTO_RAW_CHUNK_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/types/span.h"
#include "google/protobuf/message_lite.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "kvrelay/v1/relay.pb.h"

namespace kvrelay {

// A Chunk (relay.proto) whose data is a view, in one or more pieces.
struct ChunkView {
  uint32_t layer = 0;
  v1::Part part = v1::PART_UNSPECIFIED;  // any int32 value: proto3 enums are open
  uint64_t offset = 0;
  uint32_t crc32c = 0;
  std::vector<absl::Span<const uint8_t>> pieces;  // the data, in order
  uint64_t size = 0;                              // sum of the pieces

  // A view of `c`, which must outlive it.
  static ChunkView Of(const v1::Chunk& c);

  // Copies the data to `dst` (REQUIRES: room for `size` bytes) and returns
  // its CRC32C, computed over the copy while it is in cache.
  uint32_t CopyTo(uint8_t* dst) const;
};

// A received message, held as the slices gRPC delivered it in (no copy).
class RawMessage {
 public:
  // Takes references to the slices of `buf`. False when gRPC cannot read
  // the buffer.
  bool Reset(const grpc::ByteBuffer& buf);

  // True when the message is exactly one field number `field` holding a
  // well-formed Chunk: fills `*chunk` with views into the held slices, valid
  // until the next Reset. False for anything else (another field, several
  // fields, a Chunk field of an unexpected wire type): parse it with ParseAs.
  bool AsChunk(int field, ChunkView* chunk) const;

  // Parses the whole message into `msg` (copies). False when malformed.
  bool ParseAs(google::protobuf::MessageLite* msg) const;

  uint64_t size() const { return size_; }

 private:
  std::vector<grpc::Slice> slices_;
  uint64_t size_ = 0;
};

// `msg` serialized into a ByteBuffer.
grpc::ByteBuffer EncodeProto(const google::protobuf::MessageLite& msg);

// A message { Chunk chunk = `field`; } (a PublishRequest, FetchResponse,
// CompressRequest or CompressResponse, whichever `field` belongs to) whose
// data is `data` itself: no copy. The message holds `hold` until gRPC has
// sent it or dropped it; `data` must stay valid while `hold` lives.
// `crc32c` is the CRC32C of `data`.
grpc::ByteBuffer EncodeChunkNoCopy(int field, uint32_t layer, v1::Part part, uint64_t offset,
                                   absl::Span<const uint8_t> data, uint32_t crc32c,
                                   std::shared_ptr<const void> hold);

// The same message with `data` copied into it; the CRC32C is computed during
// the copy and stored in `*crc32c`.
grpc::ByteBuffer EncodeChunkCopy(int field, uint32_t layer, v1::Part part, uint64_t offset,
                                 absl::Span<const uint8_t> data, uint32_t* crc32c);

}  // namespace kvrelay

#endif  // KVRELAY_PROTO_RAW_CHUNK_H_
