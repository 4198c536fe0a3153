// Reassembles an uploaded turn (Publish, Compress) from its chunk stream.
//
// The upload order is fixed by relay.proto: for layer 0, 1, ...: PROMPT_K,
// PROMPT_V, GEN_K, GEN_V, PROMPT_SCORE, then HISTORY_K, HISTORY_V,
// HISTORY_POS when the upload carries history. A tensor of 0 bytes sends no
// chunk. Chunks of a tensor carry contiguous offsets from 0 and 1 .. 1 MiB
// of data each. TurnAssembler checks every chunk against that order (and
// its CRC32C), copies it into the layer's tensors, and reports each layer as
// soon as its last byte is in, so it can be compressed while the rest
// arrives.
//
// Not thread-safe: one stream drives one assembler.
#ifndef KVRELAY_SERVER_ASSEMBLER_H_
#define KVRELAY_SERVER_ASSEMBLER_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/turn.h"
#include "kvrelay/v1/relay.pb.h"
#include "proto/raw_chunk.h"
#include "proto/wire.h"

namespace kvrelay {

// Bookkeeping an upload holds per layer beyond its tensor bytes (layer
// objects, queued work, the compressed layer's headers); counted in the
// in-flight reservation.
constexpr uint64_t kLayerOverheadBytes = 1024;

// An upload's shape as the header declares it, checked.
struct UploadShape {
  int layers = 0;
  TurnGeometry geo;        // n_history: history tokens uploaded (0 with a parent)
  bool first_agent = true;
  std::optional<int64_t> prompt_pos0;

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
// InvalidArgument naming the field and the range
// ("header.geometry.kv_heads: 0, expected 1..1024"). `field` prefixes field names.
absl::StatusOr<UploadShape> CheckGeometry(const v1::TurnGeometry& g, const std::string& field);

// The proto name of a part ("PART_PROMPT_K").
std::string PartName(v1::Part part);

class TurnAssembler {
 public:
  explicit TurnAssembler(const UploadShape& shape);

  // Accepts the next chunk. InvalidArgument when it is not the expected
  // (layer, part, offset), is empty, longer than 1 MiB, runs past its
  // tensor or completes a K/V element that is NaN or Inf (named like
  // core's "layer.2.gen.v: non-finite value ..."); DataLoss when its CRC32C
  // does not match. Nothing is accepted on error: a chunk failing its CRC32C
  // is copied (the check runs during the copy) into the bytes the next
  // accepted chunk overwrites, and no layer holding it is reported complete.
  absl::Status Accept(const ChunkView& chunk);
  absl::Status Accept(const v1::Chunk& chunk);

  // Layers that became complete since the last call, ascending. Moves them
  // out: each layer is returned exactly once.
  std::vector<std::pair<int, TurnLayer>> TakeCompleted();

  // Checks the commit trailer: every tensor complete, and the counts and
  // CRC32C match what arrived. InvalidArgument / DataLoss otherwise.
  absl::Status CheckCommit(const v1::Trailer& trailer) const;

  bool complete() const { return cursor_ == tensors_.size(); }
  uint64_t bytes_received() const { return bytes_; }

 private:
  struct Tensor {
    int layer;
    v1::Part part;
    uint64_t size;
  };
  uint8_t* Dest(const Tensor& t);
  // NaN/Inf in the K/V elements the chunk of `n` bytes just copied to
  // `base` + offset_ completes, while they are in cache: the layer is then
  // not scanned again before compression.
  absl::Status CheckFinite(const Tensor& t, const uint8_t* base, uint64_t n) const;
  void AdvanceCompleted();

  UploadShape shape_;
  std::vector<Tensor> tensors_;  // non-empty tensors in upload order
  size_t cursor_ = 0;            // index into tensors_
  uint64_t offset_ = 0;          // within tensors_[cursor_]
  std::vector<TurnLayer> layers_;
  int next_complete_ = 0;        // first layer not yet reported complete
  std::vector<int> ready_;       // completed, not yet taken
  uint64_t chunks_ = 0, bytes_ = 0;
  uint32_t crc_ = 0;
};

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_ASSEMBLER_H_
