// The writer of a delivery (Fetch, Compress).
#ifndef KVRELAY_SERVER_INTERNAL_OUTGOING_MESSAGE_H_
#define KVRELAY_SERVER_INTERNAL_OUTGOING_MESSAGE_H_

#include <memory>

#include "core/crc32c.h"
#include "core/message.h"
#include "grpcpp/support/byte_buffer.h"
#include "proto/raw_chunk.h"
#include "proto/wire.h"

namespace kvrelay {

// Serializes a message as Fetch and Compress deliver it: per layer K, V,
// POS (dense) or K_CODES, K_SCALE, K_ZERO, V_CODES, V_SCALE, V_ZERO, POS
// (quantized); tensors of 0 bytes send no chunk; chunks of at most 1 MiB.
class OutgoingMessage {
 public:
  OutgoingMessage(std::shared_ptr<const void> hold, const Message* m)
      : hold_(std::move(hold)), chunks_(MessageDeliveryOrder(*m)) {}

  // Encodes the delivery's next response of type Resp (FetchResponse or
  // CompressResponse) into `out`: each chunk, its data sent from the message
  // itself (the slices hold the message), then the trailer; false after the
  // trailer.
  template <typename Resp>
  bool FillNext(grpc::ByteBuffer* out) {
    ChunkCursor::Piece c;
    if (chunks_.Next(&c)) {
      const uint32_t crc = Crc32c(c.data.data(), c.data.size());
      *out = EncodeChunkNoCopy(Resp::kChunkFieldNumber, c.layer, c.part, c.offset, c.data, crc, hold_);
      trailer_.Add(crc, c.data.size());
      return true;
    }
    if (trailer_sent_) return false;
    trailer_sent_ = true;
    Resp resp;
    *resp.mutable_trailer() = trailer_.Build();
    *out = EncodeProto(resp);
    return true;
  }

 private:
  std::shared_ptr<const void> hold_;  // keeps the message the views point into
  ChunkCursor chunks_;                 // delivery order
  TrailerBuilder trailer_;
  bool trailer_sent_ = false;
};

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_INTERNAL_OUTGOING_MESSAGE_H_
