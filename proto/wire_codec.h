// The wire codec: one layer of a delivery stream, entropy-coded losslessly
// into one self-describing blob (relay to relay, ForwardHeader.wire_codec =
// WIRE_CODEC_RANS; docs/FORMAT.md, "Wire codec").
//
// A layer's non-empty tensors, in delivery order, each become one stream of
// the blob. How a stream is transformed before coding follows from its
// part's kind (WireStreamKind, the one place that maps parts to kinds):
//
//   kPositions  int32 position ids: per-row deltas (a row = the tensor's
//               elements / kv_heads), zigzag, then 4 byte planes. Lossless
//               for any input; small when rows ascend.
//   kHalf       fp16 tensors: 2 byte planes (low, high).
//   kFloat32    fp32 and dense K/V (fp16 or fp32 rows): 4 byte planes.
//   kBytes      quantized codes: the bytes as they are.
//   kRaw        anything else (a part this codec does not know): stored.
//
// Each plane is coded with rANS order 0 (htscodecs' rans_compress_to_4x16,
// the Debian library libhtscodecs-dev, 32-way interleaved: RANS_ORDER_X32,
// whose SIMD decoder it picks at run time), which writes its own frequency
// table in-band: one table per plane of each stream of each layer. A stream
// whose coding does not shrink it is stored raw.
//
// Blob layout, little-endian:
//
//   "KVW1"            4 bytes
//   blob_bytes        u64, the whole blob, this header included
//   streams           u32
//   streams x record  part u32, method u8, param u32, raw_bytes u64,
//                     coded_bytes u64, crc32c u32 of the raw bytes
//                     (29 bytes)
//   payloads          coded_bytes each, in record order
//
// Methods: kStored (param 0; the payload is the raw bytes); kRansPlanes
// (param = planes 1, 2 or 4, raw_bytes a multiple of it); kRansPosDelta
// (param = row length in elements >= 1, raw_bytes a multiple of 4). A rANS
// payload is, per plane, coded length u32 then that many bytes of one
// rans_compress_to_4x16 order-0 block, whose order byte is 0x00, 0x04
// (X32), 0x20 or 0x24 (stored by rANS itself); nothing else is accepted, so
// the library's RLE, bit-packing and striping paths (which allocate by
// sizes the input declares) are never reached.
//
// Decoding trusts nothing: the caller states the parts and sizes the layer
// must hold (from the message header), and every record, length, plane and
// rANS block is checked against them before anything is written. Output
// buffers are the expected sizes, allocated before decoding; a blob that
// disagrees is an error, never a crash, an over-read or a larger
// allocation; decoded bytes whose CRC32C differs from their record's are
// DATA_LOSS (a payload flip is found even where the coder absorbs it).
// htscodecs' decoder is given the exact output size and writes at most
// that.
//
// Thread-safe: the functions are pure.
#ifndef KVRELAY_PROTO_WIRE_CODEC_H_
#define KVRELAY_PROTO_WIRE_CODEC_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/tensor.h"
#include "kvrelay/v1/relay.pb.h"
#include "proto/wire.h"

namespace kvrelay {

enum class WireStreamKind { kRaw, kPositions, kHalf, kFloat32, kBytes };

// How a part's bytes are transformed before coding. Parts it does not
// name are kRaw. `dense_elem_bytes` is the element size of dense K/V (2 for
// fp16/bf16, 4 for fp32).
WireStreamKind WireStreamKindOf(v1::Part part, int dense_elem_bytes = 2);

enum class WireMethod : uint8_t { kStored = 0, kRansPlanes = 1, kRansPosDelta = 2 };

// Fixed sizes of the blob layout above.
inline constexpr size_t kWireBlobHeaderBytes = 16;
inline constexpr size_t kWireRecordBytes = 29;

// The parts and sizes a decoded layer must hold, in delivery order, empty
// tensors left out.
struct WireTensor {
  v1::Part part = v1::PART_UNSPECIFIED;
  uint64_t size = 0;
};

struct WireEncodeOptions {
  int kv_heads = 1;          // rows of a positions tensor
  int dense_elem_bytes = 2;  // element size of dense K/V
};

// The options every coder of a message's layers uses (a forward, a spool
// message file): positions in `kv_heads` rows, dense K/V elements of 4
// bytes for DTYPE_F32 and of 2 otherwise (a quantized message has no dense
// K/V, so its dtype does not matter).
WireEncodeOptions WireEncodeOptionsOf(int kv_heads, v1::DType dtype);

// A coded layer. Its storage is allocated once, uninitialized, at the most
// the layer can take, and the streams are coded straight into it, so its
// capacity exceeds its size by what coding saved.
using WireBlob = std::vector<uint8_t, internal::DefaultInitAllocator<uint8_t>>;

// Encodes the non-empty tensors of `tensors` (one layer, delivery order)
// into a blob. Never larger than kWireBlobHeaderBytes + kWireRecordBytes
// per stream + the tensors' bytes.
WireBlob EncodeWireLayer(absl::Span<const TensorRef> tensors, const WireEncodeOptions& opts = {});

// The largest blob EncodeWireLayer writes for a layer holding `expected`.
uint64_t MaxWireLayerBytes(absl::Span<const WireTensor> expected);

// The blob_bytes a blob's first kWireBlobHeaderBytes bytes declare, checked
// against the magic and against `max_bytes`. INVALID_ARGUMENT otherwise
// (also for a prefix shorter than the header).
absl::StatusOr<uint64_t> WireLayerBlobBytes(absl::Span<const uint8_t> prefix, uint64_t max_bytes);

// What DecodeWireLayer checks before it allocates or decodes anything: the
// blob's header, records and payload lengths against `expected`. OK does
// not mean that the blob decodes (its rANS blocks and CRC32Cs are not read).
absl::Status CheckWireLayer(absl::Span<const uint8_t> blob, absl::Span<const WireTensor> expected);

// Decodes `blob` into one buffer per entry of `expected` (its size). An
// error naming the field when the blob does not hold exactly `expected`:
// INVALID_ARGUMENT for a malformed or inconsistent blob, DATA_LOSS for a
// rANS block that does not decode or decoded bytes that do not match their
// record's CRC32C.
absl::StatusOr<std::vector<std::vector<uint8_t>>> DecodeWireLayer(absl::Span<const uint8_t> blob,
                                                                 absl::Span<const WireTensor> expected);

// As DecodeWireLayer, into the caller's buffers: out[i] holds
// expected[i].size bytes. On error out[i]'s contents are unspecified. When
// `piece_crcs` is not null it receives, per tensor, the CRC32C of each
// `piece_bytes` piece of the decoded bytes (the last one shorter), from the
// same pass that checks the record's CRC32C. REQUIRES: out.size() ==
// expected.size(); piece_bytes > 0 when piece_crcs is given.
absl::Status DecodeWireLayerInto(absl::Span<const uint8_t> blob, absl::Span<const WireTensor> expected,
                                 absl::Span<uint8_t* const> out, uint64_t piece_bytes = 0,
                                 std::vector<std::vector<uint32_t>>* piece_crcs = nullptr);

}  // namespace kvrelay

#endif  // KVRELAY_PROTO_WIRE_CODEC_H_
