// The shared stream codec (proto/stream_codec.h): UploadReader and
// DeliveryReader fed the requests of one stream, as the relay and the
// clients drive them.
//
// Input: a flags byte, a slice-size byte (0: each message in one slice),
// then frames (fuzz_frames.h), each a serialized message: a PublishRequest
// (flags bit 0 clear: an upload) or a FetchResponse (bit 0 set: a
// delivery). The first frame must be the header. With flags bit 1 set the
// harness rewrites each chunk's crc32c and each trailer's counts and
// crc32c to match the chunks sent, so that the mutations reach past the
// checksums.
//
// Properties: the readers never accept a stream that breaks the contract
// (an upload layer is reported once, in order, and only whole; a finished
// stream has every layer); every error maps to a non-OK status; a delivery
// header describing 2^36 bytes or more is refused. Streams whose header
// asks for more than 16 MiB of tensors (legal, but too big to fuzz quickly)
// are skipped.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/crc32c.h"
#include "fuzz/fuzz_check.h"
#include "fuzz/fuzz_frames.h"
#include "google/protobuf/stubs/logging.h"
#include "proto/raw_chunk.h"
#include "proto/stream_codec.h"

namespace kvrelay {
namespace {

constexpr uint64_t kMaxFuzzBytes = uint64_t{16} << 20;

// Running totals of the chunks sent, for rewriting trailers.
struct Sent {
  uint64_t chunks = 0, bytes = 0;
  uint32_t crc = 0;
};

// The trailer of `m` when it is one, else null.
v1::Trailer* TrailerOf(v1::PublishRequest* m) { return m->has_commit() ? m->mutable_commit() : nullptr; }
v1::Trailer* TrailerOf(v1::FetchResponse* m) { return m->has_trailer() ? m->mutable_trailer() : nullptr; }

// Rewrites the crc32c of a chunk, or the counts and crc32c of a trailer, of
// the serialized Msg `bytes` to match what was sent; other messages as given.
template <typename Msg>
std::string FixChecksums(const std::string& bytes, Sent* sent) {
  Msg m;
  if (!m.ParseFromString(bytes)) return bytes;
  if (m.has_chunk()) {
    v1::Chunk* c = m.mutable_chunk();
    c->set_crc32c(Crc32c(c->data().data(), c->data().size()));
    ++sent->chunks;
    sent->bytes += c->data().size();
    sent->crc = Crc32cExtend(sent->crc, c->data().data(), c->data().size());
  } else if (v1::Trailer* t = TrailerOf(&m)) {
    t->set_chunks(sent->chunks);
    t->set_bytes(sent->bytes);
    t->set_crc32c(sent->crc);
  } else {
    return bytes;
  }
  return m.SerializeAsString();
}

// Bytes of the tensors `h` describes, without overflow (0 for a dtype
// DeliveryReader refuses anyway), the acc of relay-to-relay streams
// (acc_tokens per head) included.
unsigned __int128 ExactMessageBytes(const v1::MessageHeader& h) {
  using u128 = unsigned __int128;
  const u128 L = h.layers(), H = h.kv_heads(), d = h.head_dim(), bits = h.quant_bits();
  const u128 n = u128{h.n_history()} + h.n_anchor() + h.n_kept() + h.n_gen();
  const u128 acc = 4 * H * h.acc_tokens();
  if (bits != 0) {
    const u128 groups = h.quant_group() ? (n + h.quant_group() - 1) / h.quant_group() : 0;
    return L * (2 * (H * n * d * bits / 8) + 4 * H * groups * d + 4 * H * n + 4 * H * n + acc);
  }
  absl::StatusOr<DType> dtype = FromProtoDType(h.dtype());
  return L * (2 * H * n * d * (dtype.ok() ? DTypeSize(*dtype) : 0) + 4 * H * n + acc);
}

void FuzzUpload(const std::vector<std::string>& frames, size_t cut, bool fix) {
  v1::PublishRequest first;
  if (!first.ParseFromString(frames[0]) || !first.has_header()) return;
  absl::StatusOr<UploadShape> shape = CheckGeometry(first.header().geometry(), "header.geometry",
                                                    /*with_parent=*/!first.header().parent_id().empty());
  if (!shape.ok()) {
    FUZZ_CHECK(shape.status().code() == absl::StatusCode::kInvalidArgument);
    return;
  }
  if (shape->UploadBytes() > kMaxFuzzBytes) return;
  UploadReader reader(*shape);
  Sent sent;
  int next_layer = 0;
  // Layers of 0 bytes are complete before any chunk (the relay takes them
  // right after Start); every later Accept may complete more.
  auto take = [&] {
    for (auto& [index, layer] : reader.TakeCompleted()) {
      FUZZ_CHECK(index == next_layer);
      FUZZ_CHECK(layer.prompt_k.tokens() == shape->geo.n_prompt);
      ++next_layer;
    }
  };
  take();
  for (size_t i = 1; i < frames.size(); ++i) {
    const std::string bytes = fix ? FixChecksums<v1::PublishRequest>(frames[i], &sent) : frames[i];
    RawMessage raw;
    FUZZ_CHECK(raw.Reset(fuzz::Sliced(bytes, cut)));
    ChunkView view;
    StreamError e;
    if (raw.AsChunk(v1::PublishRequest::kChunkFieldNumber, &view)) {
      e = reader.Accept(view);
      take();
    } else {
      v1::PublishRequest req;
      if (!raw.ParseAs(&req) || !req.has_commit()) return;  // the relay refuses these itself
      e = reader.CheckCommit(req.commit());
      if (e.ok()) {
        FUZZ_CHECK(reader.complete());
        FUZZ_CHECK(next_layer == shape->layers);
        return;
      }
    }
    if (!e.ok()) {
      FUZZ_CHECK(!UploadStatus(e).ok());
      return;
    }
  }
}

void FuzzDelivery(const std::vector<std::string>& frames, size_t cut, bool fix) {
  v1::FetchResponse first;
  if (!first.ParseFromString(frames[0]) || !first.has_header()) return;
  const v1::MessageHeader& h = first.header();
  const unsigned __int128 exact = ExactMessageBytes(h);
  DeliveryReader reader;
  StreamError e;
  if (exact > kMaxFuzzBytes) {
    if (exact < (unsigned __int128){1} << 36) return;
    e = reader.Start(h);
    FUZZ_CHECK(!e.ok());
    return;
  }
  e = reader.Start(h);
  if (!e.ok()) {
    FUZZ_CHECK(!DeliveryStatus(e).ok());
    return;
  }
  FUZZ_CHECK(reader.bytes_expected() == static_cast<uint64_t>(exact));
  Sent sent;
  for (size_t i = 1; i < frames.size(); ++i) {
    const std::string bytes = fix ? FixChecksums<v1::FetchResponse>(frames[i], &sent) : frames[i];
    RawMessage raw;
    FUZZ_CHECK(raw.Reset(fuzz::Sliced(bytes, cut)));
    ChunkView view;
    if (raw.AsChunk(v1::FetchResponse::kChunkFieldNumber, &view)) {
      e = reader.Add(view);
    } else {
      v1::FetchResponse resp;
      if (!raw.ParseAs(&resp)) return;
      if (resp.has_trailer()) {
        Message m;
        e = reader.Finish(resp.trailer(), &m);
        if (e.ok()) {
          FUZZ_CHECK(reader.done());
          FUZZ_CHECK(m.layers.size() == h.layers());
          FUZZ_CHECK(reader.bytes_received() == reader.bytes_expected());
          return;
        }
      } else if (resp.has_header()) {
        e = reader.Start(resp.header());
        FUZZ_CHECK(e.kind() == StreamErrorKind::kSequence);
      } else {
        return;
      }
    }
    if (!e.ok()) {
      FUZZ_CHECK(!DeliveryStatus(e).ok());
      return;
    }
  }
}

}  // namespace
}  // namespace kvrelay

// Invalid UTF-8 in a string field is logged by protobuf on every parse.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const std::vector<std::string> frames = kvrelay::fuzz::Frames(data + 2, size - 2);
  if (frames.empty()) return 0;
  const bool delivery = data[0] & 1, fix = data[0] & 2;
  if (delivery) {
    kvrelay::FuzzDelivery(frames, data[1], fix);
  } else {
    kvrelay::FuzzUpload(frames, data[1], fix);
  }
  return 0;
}
