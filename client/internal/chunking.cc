#include "client/internal/chunking.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/crc32c.h"
#include "core/status_macros.h"

namespace kvrelay {
namespace client_internal {
namespace {

template <typename T>
absl::Span<const uint8_t> BytesOf(const std::vector<T>& v) {
  return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(v.data()),
                                   v.size() * sizeof(T));
}

std::string ChunkName(uint32_t layer, v1::Part part) {
  return absl::StrCat("chunk layer ", layer, " part ", FilePartName(part));
}

// A message larger than this is not a plausible delivery (64 GiB).
constexpr uint64_t kMaxMessageBytes = uint64_t{1} << 36;

}  // namespace

absl::StatusOr<DType> FromProtoDType(v1::DType dtype) {
  if (std::optional<DType> d = DTypeFromProto(dtype)) return *d;
  return absl::InvalidArgumentError(absl::StrCat("dtype: ", static_cast<int>(dtype), ", expected F32, F16 or BF16"));
}

absl::StatusOr<v1::TurnGeometry> TurnGeometryOf(const Turn& turn) {
  KVRELAY_ASSIGN_OR_RETURN(const TurnGeometry geo, GeometryOf(turn));
  v1::TurnGeometry g;
  g.set_layers(static_cast<uint32_t>(turn.layers.size()));
  g.set_kv_heads(geo.kv_heads);
  g.set_score_heads(geo.score_heads);
  g.set_head_dim(geo.head_dim);
  g.set_dtype(ToProtoDType(geo.dtype));
  g.set_n_prompt(geo.n_prompt);
  g.set_n_gen(geo.n_gen);
  g.set_n_history(geo.n_history);
  g.set_first_agent(turn.first_agent);
  if (turn.prompt_pos0) g.set_prompt_pos0(*turn.prompt_pos0);
  return g;
}

std::vector<TensorRef> TurnUploadOrder(const Turn& turn) {
  std::vector<TensorRef> out;
  const bool history = !turn.layers.empty() && turn.layers[0].history_k.tokens() > 0;
  out.reserve(turn.layers.size() * (history ? 8 : 5));
  for (size_t i = 0; i < turn.layers.size(); ++i) {
    const TurnLayer& l = turn.layers[i];
    const uint32_t li = static_cast<uint32_t>(i);
    out.push_back({li, v1::PART_PROMPT_K, l.prompt_k.bytes()});
    out.push_back({li, v1::PART_PROMPT_V, l.prompt_v.bytes()});
    out.push_back({li, v1::PART_GEN_K, l.gen_k.bytes()});
    out.push_back({li, v1::PART_GEN_V, l.gen_v.bytes()});
    out.push_back({li, v1::PART_PROMPT_SCORE, BytesOf(l.scores.data)});
    if (history) {
      out.push_back({li, v1::PART_HISTORY_K, l.history_k.bytes()});
      out.push_back({li, v1::PART_HISTORY_V, l.history_v.bytes()});
      out.push_back({li, v1::PART_HISTORY_POS, BytesOf(l.history_pos.data)});
    }
  }
  return out;
}

v1::MessageHeader MessageHeaderOf(const Message& msg) {
  v1::MessageHeader h;
  FillMessageHeader(msg, &h);
  v1::Accounting* a = h.mutable_accounting();
  a->set_policy(msg.policy);
  a->set_full_bytes(msg.full_bytes);
  a->set_sent_bytes(msg.sent_bytes);
  a->set_ratio(msg.Ratio());
  return h;
}

uint64_t TotalBytes(absl::Span<const TensorRef> tensors) {
  uint64_t n = 0;
  for (const TensorRef& t : tensors) n += t.data.size();
  return n;
}

absl::Status ForEachChunk(const TensorRef& tensor, size_t max_chunk, v1::Chunk* chunk,
                          const std::function<absl::Status(const v1::Chunk&)>& sink) {
  ChunkCursor chunks({tensor}, max_chunk);
  ChunkCursor::Piece c;
  while (chunks.Next(&c)) {
    chunk->set_layer(c.layer);
    chunk->set_part(c.part);
    chunk->set_offset(c.offset);
    chunk->set_data(c.data.data(), c.data.size());
    chunk->set_crc32c(Crc32c(c.data.data(), c.data.size()));
    KVRELAY_RETURN_IF_ERROR(sink(*chunk));
  }
  return absl::OkStatus();
}

absl::Status MessageAssembler::Start(const v1::MessageHeader& h) {
  if (started_) return absl::InvalidArgumentError("header: given twice, expected one");
  auto bad = [](absl::string_view field, uint64_t v, absl::string_view expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.", field, ": ", v, ", expected ", expected));
  };
  if (h.layers() < 1) return bad("layers", h.layers(), ">= 1");
  if (h.kv_heads() < 1) return bad("kv_heads", h.kv_heads(), ">= 1");
  if (h.head_dim() < 1) return bad("head_dim", h.head_dim(), ">= 1");
  absl::StatusOr<DType> dtype = FromProtoDType(h.dtype());
  if (!dtype.ok()) return absl::InvalidArgumentError(absl::StrCat("header.", dtype.status().message()));
  const uint64_t n64 = uint64_t{h.n_history()} + h.n_anchor() + h.n_kept() + h.n_gen();
  if (n64 >= (uint64_t{1} << 31)) return bad("n_history+n_anchor+n_kept+n_gen", n64, "< 2^31");
  if (h.next_pos() < 0 || h.next_pos() > (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.next_pos: ", h.next_pos(), ", expected 0..2^31"));
  }
  const uint32_t bits = h.quant_bits();
  const bool quant = bits != 0;
  if (quant) {
    if (bits != 2 && bits != 4 && bits != 8) return bad("quant_bits", bits, "0, 2, 4 or 8");
    if (h.quant_group() < 1) return bad("quant_group", h.quant_group(), ">= 1 when quantized");
    if ((uint64_t{h.head_dim()} * bits) % 8 != 0)
      return bad("head_dim", h.head_dim(), "head_dim*quant_bits a multiple of 8");
  }
  const uint64_t L = h.layers(), H = h.kv_heads(), d = h.head_dim(), n = n64;
  const uint64_t groups = quant ? (n + h.quant_group() - 1) / h.quant_group() : 0;
  const uint64_t per_layer =
      quant ? 2 * (H * n * d * bits / 8) + 2 * 2 * H * groups * d + 2 * 2 * H * n + 4 * H * n
            : 2 * H * n * d * DTypeSize(*dtype) + 4 * H * n;
  if (L * per_layer > kMaxMessageBytes) {
    return bad("layers", L, absl::StrCat("a message below 2^36 bytes (", per_layer, " per layer)"));
  }

  msg_ = Message();
  msg_.policy = h.accounting().policy();
  msg_.dtype = *dtype;
  msg_.kv_heads = static_cast<int>(H);
  msg_.head_dim = static_cast<int>(d);
  msg_.n_history = static_cast<int>(h.n_history());
  msg_.n_anchor = static_cast<int>(h.n_anchor());
  msg_.n_kept = static_cast<int>(h.n_kept());
  msg_.n_gen = static_cast<int>(h.n_gen());
  msg_.full_bytes = h.accounting().full_bytes();
  msg_.sent_bytes = h.accounting().sent_bytes();
  msg_.next_pos = h.next_pos();
  msg_.layers.resize(L);
  slots_.clear();
  const int Hi = msg_.kv_heads, ni = static_cast<int>(n), di = msg_.head_dim;
  for (uint32_t l = 0; l < L; ++l) {
    MessageLayer& layer = msg_.layers[l];
    layer.pos = PosTensor(Hi, ni);
    if (!quant) {
      layer.k = KvTensor::Uninitialized(*dtype, Hi, ni, di);
      layer.v = KvTensor::Uninitialized(*dtype, Hi, ni, di);
    } else {
      layer.k = KvTensor(*dtype, Hi, 0, di);
      layer.v = KvTensor(*dtype, Hi, 0, di);
      QuantizedKv& q = layer.quant.emplace();
      q.bits = static_cast<int>(bits);
      q.group = static_cast<int>(h.quant_group());
      q.rotate = h.quant_rotate();
      q.dtype = *dtype;
      for (QuantizedTensor* t : {&q.k, &q.v}) {
        t->bits = q.bits;
        t->heads = Hi;
        t->tokens = ni;
        t->dim = di;
        t->codes.resize(H * n * d * bits / 8);
        const size_t stats = t == &q.k ? H * groups * d : H * n;
        t->scale.resize(stats);
        t->zero.resize(stats);
      }
    }
  }
  // The slots are the message's own buffers, in the delivery order.
  for (const TensorRef& t : MessageDeliveryOrder(msg_)) {
    slots_.push_back({t.layer, t.part, const_cast<uint8_t*>(t.data.data()), t.data.size()});
  }
  bytes_expected_ = 0;
  for (const Slot& s : slots_) bytes_expected_ += s.size;
  next_ = filled_ = 0;
  chunks_ = bytes_received_ = 0;
  crc_ = 0;
  started_ = true;
  SkipComplete();
  return absl::OkStatus();
}

void MessageAssembler::SkipComplete() {
  while (next_ < slots_.size() && filled_ == slots_[next_].size) {
    ++next_;
    filled_ = 0;
  }
}

absl::Status MessageAssembler::Add(const v1::Chunk& c) { return Add(ChunkView::Of(c)); }

absl::Status MessageAssembler::Add(const ChunkView& c) {
  if (!started_) return absl::InvalidArgumentError("chunk: before the header, expected a header first");
  const std::string name = ChunkName(c.layer, c.part);
  if (next_ >= slots_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": after every tensor of the message is complete, expected the trailer"));
  }
  const Slot& s = slots_[next_];
  if (c.layer != s.layer || c.part != s.part) {
    return absl::InvalidArgumentError(absl::StrCat(name, " (offset ", c.offset, "): out of order, expected ",
                                                   ChunkName(s.layer, s.part), " offset ", filled_));
  }
  if (c.offset != filled_) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": offset ", c.offset, ", expected ", filled_));
  }
  const uint64_t len = c.size;
  if (len < 1 || len > kMaxChunkBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": ", len, " data bytes, expected 1..", kMaxChunkBytes));
  }
  if (len > s.size - filled_) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", len, " bytes at offset ", filled_,
                                                   ", expected at most ", s.size - filled_,
                                                   " (tensor of ", s.size, " bytes)"));
  }
  const uint32_t crc = c.CopyTo(s.data + filled_);
  if (crc != c.crc32c) {
    return absl::DataLossError(absl::StrCat(name, " offset ", c.offset, ": crc32c ", c.crc32c,
                                            ", expected ", crc, " (computed over the data)"));
  }
  filled_ += len;
  ++chunks_;
  bytes_received_ += len;
  crc_ = Crc32cCombine(crc_, crc, len);  // the chunk was checked: no second pass
  SkipComplete();
  return absl::OkStatus();
}

absl::StatusOr<Message> MessageAssembler::Finish(const v1::Trailer& t) {
  if (!started_) return absl::InvalidArgumentError("trailer: before the header, expected a header first");
  if (next_ < slots_.size()) {
    const Slot& s = slots_[next_];
    return absl::InvalidArgumentError(
        absl::StrCat("trailer: stream ended with ", ChunkName(s.layer, s.part), " at ", filled_,
                     " of ", s.size, " bytes (", bytes_received_, " of ", bytes_expected_,
                     " message bytes received)"));
  }
  if (t.chunks() != chunks_) {
    return absl::DataLossError(
        absl::StrCat("trailer.chunks: ", t.chunks(), ", expected ", chunks_, " (chunks received)"));
  }
  if (t.bytes() != bytes_received_) {
    return absl::DataLossError(absl::StrCat("trailer.bytes: ", t.bytes(), ", expected ",
                                            bytes_received_, " (bytes received)"));
  }
  if (t.crc32c() != crc_) {
    return absl::DataLossError(absl::StrCat("trailer.crc32c: ", t.crc32c(), ", expected ", crc_,
                                            " (computed over the chunks received)"));
  }
  uint64_t sent = 0;
  for (const MessageLayer& l : msg_.layers) sent += l.SentBytes();
  if (sent != msg_.sent_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("header.accounting.sent_bytes: ",
                                                   msg_.sent_bytes, ", expected ", sent,
                                                   " (bytes of the delivered tensors)"));
  }
  msg_.next_pos = NextPosition(msg_);  // 0 (a relay before the field): from the ids
  started_ = false;
  return std::move(msg_);
}

}  // namespace client_internal
}  // namespace kvrelay
