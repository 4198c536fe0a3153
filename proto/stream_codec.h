// The tensor streams of relay.proto, read and written in one place.
//
// A stream is a header, the chunks of every tensor in the stream's order,
// then a trailer. There are two orders, stated here once each:
//
//   upload (Publish, Compress), per layer: PROMPT_K, PROMPT_V, GEN_K, GEN_V,
//     PROMPT_SCORE, then HISTORY_K, HISTORY_V, HISTORY_POS when the upload
//     carries history;
//   delivery (Fetch, Compress, Forward), per layer: K, V, POS when dense;
//     K_CODES, K_SCALE, K_ZERO, V_CODES, V_SCALE, V_ZERO, POS when quantized
//     (lloyd sends no zeros but K_ZERO with keys per channel: they have 0
//     bytes); then, with demoted tokens (relay to relay only),
//     DEMOTED_K_CODES, DEMOTED_K_NORM, DEMOTED_V_CODES, DEMOTED_V_NORM;
//     then ACC relay to relay.
//
// A tensor of 0 bytes sends no chunk. The chunks of a tensor carry
// contiguous offsets from 0, 1 .. kMaxChunkBytes of data each and the
// CRC32C of that data. The trailer counts the chunks and bytes, and holds
// the CRC32C of all chunk data in stream order.
//
// Both readers run one state machine (ChunkSequence). They report what is
// wrong as a StreamError: a kind, and a message naming the chunk or field,
// what was expected and what was found. The reading side turns it into a
// status in one function: UploadStatus (a bad upload is the caller's
// INVALID_ARGUMENT; a CRC32C mismatch is DATA_LOSS, as relay.proto says) or
// DeliveryStatus (a bad delivery is the receiver's DATA_LOSS).
//
// Copies: a reader copies each chunk once out of gRPC's slices (ChunkView),
// computing its CRC32C during the copy; the writer sends tensors from their
// own memory (EncodeChunkNoCopy) or copies them once, computing the CRC32C
// on the way (EncodeChunkCopy).
//
// Byte order: tensors travel little-endian, which is the host order kvrelay
// supports.
//
// Thread-safety: the free functions are pure. Readers and writers are not
// thread-safe: one stream drives one.
#ifndef KVRELAY_PROTO_STREAM_CODEC_H_
#define KVRELAY_PROTO_STREAM_CODEC_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/message.h"
#include "core/turn.h"
#include "grpcpp/support/byte_buffer.h"
#include "kvrelay/v1/relay.pb.h"
#include "proto/raw_chunk.h"
#include "proto/wire.h"

namespace kvrelay {

// ------------------------------------------------------------------ errors

enum class StreamErrorKind {
  kOk = 0,
  kHeader,        // the header describes no valid stream (a field out of range)
  kSequence,      // a message out of place: a chunk before the header, a
                  // second header, anything after the trailer
  kOrder,         // not the next expected (layer, part, offset): out of
                  // order, duplicated, or a chunk missing before it
  kChunkSize,     // chunk data empty, above kMaxChunkBytes, or past its tensor
  kExtraChunk,    // a chunk after every tensor is complete
  kChunkCrc,      // a chunk's data does not match its crc32c
  kValue,         // data the stream may not hold: a NaN/Inf K/V element in
                  // an upload, sent bytes that disagree with a delivery
  kIncomplete,    // the trailer came before every tensor was complete
  kTrailerCount,  // the trailer's chunks or bytes differ from what arrived
  kTrailerCrc,    // the trailer's crc32c differs from the data that arrived
};

// "ORDER", "CHUNK_CRC", ...
const char* StreamErrorKindName(StreamErrorKind kind);

// What a reader found wrong; ok() when nothing.
class [[nodiscard]] StreamError {
 public:
  StreamError() = default;
  StreamError(StreamErrorKind kind, std::string message) : kind_(kind), message_(std::move(message)) {}

  bool ok() const { return kind_ == StreamErrorKind::kOk; }
  StreamErrorKind kind() const { return kind_; }
  const std::string& message() const { return message_; }

 private:
  StreamErrorKind kind_ = StreamErrorKind::kOk;
  std::string message_;
};

// A bad upload, as the relay answers its caller: DATA_LOSS for kChunkCrc
// and kTrailerCrc, INVALID_ARGUMENT for every other kind.
absl::Status UploadStatus(const StreamError& e);

// A bad delivery, as its receiver reports it: DATA_LOSS for every kind.
absl::Status DeliveryStatus(const StreamError& e);

// ------------------------------------------------------------------ orders

// The parts of one uploaded layer, in upload order (without history: all
// but the last three, HISTORY_K, HISTORY_V, HISTORY_POS).
absl::Span<const v1::Part> UploadParts(bool history, bool queries = false);

// The parts of one delivered layer, in delivery order.
absl::Span<const v1::Part> DeliveryParts(bool quantized);

// The tensors of `layer` (index `index`) in upload order, 0-byte tensors
// included. Views into `layer`, which must outlive the result.
std::vector<TensorRef> LayerUploadOrder(const TurnLayer& layer, uint32_t index, bool history);

// Every tensor of `turn` in upload order; history parts when layer 0 has
// history tokens. Views into `turn`, which must outlive the result.
std::vector<TensorRef> TurnUploadOrder(const Turn& turn);

// The tensors of `layer` (index `index`) in delivery order, 0-byte tensors
// included, and with `with_acc` (relay to relay) its acc after them. Views
// into `layer`, which must outlive the result.
std::vector<TensorRef> LayerDeliveryOrder(const MessageLayer& layer, uint32_t index, bool with_acc = false);

// Every tensor of `msg` in delivery order: LayerDeliveryOrder of each layer.
std::vector<TensorRef> MessageDeliveryOrder(const Message& msg, bool with_acc = false);

// Tensor bytes of `tensors` in total.
uint64_t TotalBytes(absl::Span<const TensorRef> tensors);

// ---------------------------------------------------------- upload header

// Bookkeeping an upload holds per layer beyond its tensor bytes (layer
// objects, queued work, the compressed layer's headers); counted in the
// in-flight reservation.
constexpr uint64_t kLayerOverheadBytes = 1024;

// An upload's shape as the header declares it, checked, with the bytes it
// carries.
struct UploadShape : TurnLayout {
  // Tensor bytes the upload carries (every chunk's data, summed).
  uint64_t UploadBytes() const;
  // Bytes of one uploaded layer.
  uint64_t LayerUploadBytes() const;
  // What the upload reserves in flight: UploadBytes() plus
  // kLayerOverheadBytes per layer.
  uint64_t ReserveBytes() const;
};

// Checks a header's geometry against the core's bounds (core/turn.h:
// kMaxLayers, kMaxKvHeads, kMaxScoreHeads, kMaxHeadDim, kMaxTokensPerPart).
// UploadStatus of a kHeader error naming the field and the range
// ("header.geometry.kv_heads: 0, expected 1..1024") otherwise. `field`
// prefixes field names. `with_parent`: the upload composes on a parent
// (history_score_tokens may then be set without n_history; the caller
// checks it against the parent).
absl::StatusOr<UploadShape> CheckGeometry(const v1::TurnGeometry& g, const std::string& field,
                                          bool with_parent = false);

// The proto name of a part ("PART_PROMPT_K").
std::string PartName(v1::Part part);

// ----------------------------------------------------------------- readers

// The state machine of both readers: the stream's tensors ("slots") in
// order, each filled by chunks with contiguous offsets, then the trailer
// checked against what arrived.
class ChunkSequence {
 public:
  struct Slot {
    uint32_t layer = 0;
    v1::Part part = v1::PART_UNSPECIFIED;
    uint64_t size = 0;
  };

  // `slots` in stream order (0-byte slots are skipped). `stream` names the
  // order in messages ("upload", "delivery"), `whole` what the stream
  // carries ("turn", "message"), and `trailer` the trailer field ("commit",
  // "trailer").
  ChunkSequence(std::vector<Slot> slots, const char* stream, const char* whole, const char* trailer);

  // Accepts `c` as the next chunk. Checks its place and size, copies its
  // data to dest(slot) + offset() (dest may allocate the slot's buffer when
  // offset() is 0), checks the CRC32C computed during the copy, then runs
  // verify(slot, base, n) over the copied bytes (base = dest's result, the
  // chunk at base + offset(), n bytes). Nothing is accepted on error: a
  // chunk that fails after its copy leaves bytes that the next accepted
  // chunk overwrites.
  //
  // `in_place`: the chunk's data already lies at dest(slot) + offset() (one
  // piece, written there by this process) and c.crc32c is the CRC32C this
  // process computed over those bytes: nothing is copied and the CRC is
  // not computed again; a chunk elsewhere is a kOrder error.
  StreamError Accept(const ChunkView& c, absl::FunctionRef<uint8_t*(const Slot&)> dest,
                     absl::FunctionRef<StreamError(const Slot&, const uint8_t*, uint64_t)> verify,
                     bool in_place = false);

  // kIncomplete unless every slot is full, then kTrailerCount /
  // kTrailerCrc unless `t` matches the chunks accepted.
  StreamError CheckTrailer(const v1::Trailer& t) const;

  bool complete() const { return next_ == slots_.size(); }
  // REQUIRES: !complete().
  const Slot& current() const { return slots_[next_]; }
  // The index of current() among the non-empty slots, in order.
  size_t index() const { return next_; }
  uint64_t offset() const { return offset_; }  // within current()
  uint64_t bytes_received() const { return bytes_; }
  uint64_t bytes_expected() const { return expected_; }
  // The non-empty slots, in stream order.
  const std::vector<Slot>& slots() const { return slots_; }

 private:
  std::vector<Slot> slots_;  // non-empty, in stream order
  const char* stream_;
  const char* whole_;
  const char* trailer_;
  size_t next_ = 0;
  uint64_t offset_ = 0;
  uint64_t chunks_ = 0, bytes_ = 0, expected_ = 0;
  uint32_t crc_ = 0;
};

// Reassembles an uploaded turn (Publish, Compress) from its chunks, and
// reports each layer as soon as its last byte is in, so it can be
// compressed while the rest arrives.
class UploadReader {
 public:
  explicit UploadReader(const UploadShape& shape);

  // Accepts the next chunk. kOrder / kChunkSize / kExtraChunk when it is
  // not the expected (layer, part, offset), is empty, longer than 1 MiB or
  // runs past its tensor; kChunkCrc when its CRC32C does not match; kValue
  // when it completes a K/V element that is NaN or Inf (named like core's
  // "layer.2.gen.v: non-finite value ..."). Nothing is accepted on error,
  // and no layer holding a rejected chunk is reported complete.
  StreamError Accept(const ChunkView& chunk);
  StreamError Accept(const v1::Chunk& chunk);

  // Layers that became complete since the last call, ascending. Moves them
  // out: each layer is returned exactly once.
  std::vector<std::pair<int, TurnLayer>> TakeCompleted();

  // Checks the commit trailer: every tensor complete, and the counts and
  // CRC32C match what arrived.
  StreamError CheckCommit(const v1::Trailer& trailer) const;

  bool complete() const { return seq_.complete(); }
  uint64_t bytes_received() const { return seq_.bytes_received(); }

 private:
  uint8_t* Dest(const ChunkSequence::Slot& s);
  // NaN/Inf in the K/V elements the `n` bytes just copied to base +
  // offset complete, checked while they are in cache.
  StreamError CheckFinite(const ChunkSequence::Slot& s, const uint8_t* base, uint64_t n) const;
  void AdvanceCompleted();

  UploadShape shape_;
  ChunkSequence seq_;
  std::vector<TurnLayer> layers_;
  int next_complete_ = 0;   // first layer not yet reported complete
  std::vector<int> ready_;  // completed, not yet taken
};

// Rebuilds a Message from a delivery stream (Fetch, Compress, and a relay
// reading a forwarded message): a v1::MessageHeader, chunks in delivery
// order, a v1::Trailer.
//
//   DeliveryReader r;
//   StreamError e = r.Start(header);
//   for each chunk: if (e.ok()) e = r.Add(chunk);
//   Message m;
//   if (e.ok()) e = r.Finish(trailer, &m);
//   return DeliveryStatus(e);
//
// Errors: kHeader for a header that describes no valid message (layers,
// kv_heads or head_dim above core/turn.h's kMaxLayers, kMaxKvHeads,
// kMaxHeadDim, or 2^36 bytes or more, included; acc_tokens that is neither
// 0 nor at least the message's tokens; anchor_pos not ascending); kSequence
// for a chunk or trailer before Start, a second Start, or anything after
// Finish; the chunk and trailer kinds of ChunkSequence; kValue when the
// header's accounting.sent_bytes is not the bytes of the delivered tensors.
// Bytes one layer of the message `h` describes sends (its tensors in
// delivery order): what the header's accounting.sent_bytes is per layer.
// Meaningful only for a header DeliveryReader::Start accepts.
uint64_t MessageLayerBytes(const v1::MessageHeader& h);

class DeliveryReader {
 public:
  DeliveryReader() = default;
  DeliveryReader(const DeliveryReader&) = delete;
  DeliveryReader& operator=(const DeliveryReader&) = delete;

  // Validates `header` as Start does, allocating nothing; on OK `*bytes` is
  // the tensor bytes the message will hold (what to reserve before Start).
  static StreamError CheckHeader(const v1::MessageHeader& header, uint64_t* bytes);
  // Validates `header` and allocates every tensor of the message.
  StreamError Start(const v1::MessageHeader& header);
  // Copies the chunk's data into its tensor, checking its CRC32C during the
  // copy, and then that the values it completes are finite (dense K/V,
  // scales, zeros and norms: kValue naming the tensor and the index, since
  // a relay that computed them never sends NaN or Inf).
  StreamError Add(const ChunkView& chunk);
  StreamError Add(const v1::Chunk& chunk);
  // The buffer of slot `index` (slots() order), for a caller that writes a
  // slot's bytes there itself and then passes them to AddInPlace. REQUIRES:
  // started(), index < slots().size().
  uint8_t* SlotData(size_t index) { return slot_data_[index]; }
  // As Add, for a chunk whose data this process wrote at its place in
  // SlotData(), with the CRC32C it computed over those bytes: checked and
  // counted like Add's, without the copy and the CRC pass.
  StreamError AddInPlace(const ChunkView& chunk);
  // Checks the trailer and moves the message to `*out`.
  StreamError Finish(const v1::Trailer& trailer, Message* out);

  bool started() const { return seq_.has_value(); }
  bool done() const { return done_; }
  uint64_t bytes_received() const { return seq_ ? seq_->bytes_received() : 0; }
  uint64_t bytes_expected() const { return seq_ ? seq_->bytes_expected() : 0; }
  // The tensors the message holds (non-empty, delivery order); empty before
  // Start.
  absl::Span<const ChunkSequence::Slot> slots() const {
    return seq_ ? absl::Span<const ChunkSequence::Slot>(seq_->slots()) : absl::Span<const ChunkSequence::Slot>();
  }

 private:
  StreamError AddChunk(const ChunkView& chunk, bool in_place);
  StreamError CheckFinite(const ChunkSequence::Slot& s, const uint8_t* base, uint64_t n) const;

  Message msg_;
  std::optional<ChunkSequence> seq_;
  std::vector<uint8_t*> slot_data_;  // the message's buffers, per slot of seq_
  bool done_ = false;
};

// ------------------------------------------------------------------ writer

// Writes the chunks of a stream (an upload or a delivery) and its trailer,
// as messages { Chunk chunk = Msg::kChunkFieldNumber; } and the Msg's
// Trailer field (`trailer`, or `commit` for the upload requests): any Msg
// with a Chunk/Trailer oneof. Tensors may be appended while the stream is
// written (a layer as soon as it exists); chunks go out in append order.
class ChunkStreamWriter {
 public:
  // REQUIRES: max_chunk in 1 .. kMaxChunkBytes.
  explicit ChunkStreamWriter(size_t max_chunk = kMaxChunkBytes) : chunks_({}, max_chunk) {}

  // Queues `tensors` (LayerDeliveryOrder, TurnUploadOrder, ...) after those
  // queued before. With `hold`, chunks refer to the tensors' bytes, which
  // must stay valid and unchanged while `hold` lives: each chunk's message
  // holds it (gRPC may keep it past the write), and so does the writer until
  // it encodes a chunk of a later append. Without, each chunk's data is copied once into its message,
  // its CRC32C computed during the copy; the bytes must stay valid until
  // that chunk is encoded.
  void Append(std::vector<TensorRef> tensors, std::shared_ptr<const void> hold);

  // Encodes the next queued chunk into `*out`; false when none is queued.
  // `*bytes` (when given) receives its data size.
  template <typename Msg>
  bool NextChunk(grpc::ByteBuffer* out, uint64_t* bytes = nullptr) {
    return NextChunk(Msg::kChunkFieldNumber, out, bytes);
  }

  // The trailer of every chunk encoded so far, as a Msg.
  template <typename Msg>
  grpc::ByteBuffer EncodeTrailer() {
    Msg m;
    *MutableTrailer(&m, 0) = trailer_.Build();
    trailer_sent_ = true;
    return EncodeProto(m);
  }

  // For a stream whose tensors are all appended: each chunk, then the
  // trailer; false after the trailer.
  template <typename Msg>
  bool FillNext(grpc::ByteBuffer* out) {
    if (NextChunk<Msg>(out)) return true;
    if (trailer_sent_) return false;
    *out = EncodeTrailer<Msg>();
    return true;
  }

  v1::Trailer trailer() const { return trailer_.Build(); }
  bool trailer_sent() const { return trailer_sent_; }

 private:
  bool NextChunk(int field, grpc::ByteBuffer* out, uint64_t* bytes);

  template <typename M>
  static auto MutableTrailer(M* m, int) -> decltype(m->mutable_trailer()) {
    return m->mutable_trailer();
  }
  template <typename M>
  static auto MutableTrailer(M* m, long) -> decltype(m->mutable_commit()) {
    return m->mutable_commit();
  }

  ChunkCursor chunks_;
  // The hold of each append: (index of its first tensor, hold).
  std::vector<std::pair<size_t, std::shared_ptr<const void>>> holds_;
  size_t appended_ = 0;  // tensors appended so far
  size_t hold_ = 0;      // index into holds_ of the chunk being encoded
  TrailerBuilder trailer_;
  bool trailer_sent_ = false;
};

// Splits `tensor` into chunks of at most `max_chunk` bytes (each with its
// CRC32C) as generated messages: fills `*chunk` with each in turn and calls
// `sink`, stopping at the first error the sink returns. A tensor of 0 bytes
// produces no chunk. REQUIRES: max_chunk >= 1.
absl::Status ForEachChunk(const TensorRef& tensor, size_t max_chunk, v1::Chunk* chunk,
                          const std::function<absl::Status(const v1::Chunk&)>& sink);

}  // namespace kvrelay

#endif  // KVRELAY_PROTO_STREAM_CODEC_H_
