#include "proto/stream_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "core/crc32c.h"
#include "core/status_macros.h"
#include "core/quant.h"

namespace kvrelay {
namespace {

template <typename T>
absl::Span<const uint8_t> BytesOf(const std::vector<T>& v) {
  return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(T));
}

constexpr v1::Part kUploadParts[] = {v1::PART_PROMPT_K,     v1::PART_PROMPT_V,        v1::PART_GEN_K,
                                     v1::PART_GEN_V,        v1::PART_PROMPT_SCORE,    v1::PART_HISTORY_SCORE,
                                     v1::PART_HISTORY_K,    v1::PART_HISTORY_V,       v1::PART_HISTORY_POS};
constexpr v1::Part kQueryUploadParts[] = {v1::PART_PROMPT_K,  v1::PART_PROMPT_V,  v1::PART_GEN_K,
                                          v1::PART_GEN_V,     v1::PART_GEN_Q,     v1::PART_HISTORY_K,
                                          v1::PART_HISTORY_V, v1::PART_HISTORY_POS};
constexpr v1::Part kDenseParts[] = {v1::PART_K, v1::PART_V, v1::PART_POS};
constexpr v1::Part kDemotedParts[] = {v1::PART_DEMOTED_K_CODES, v1::PART_DEMOTED_K_NORM, v1::PART_DEMOTED_V_CODES,
                                      v1::PART_DEMOTED_V_NORM};
constexpr v1::Part kQuantParts[] = {v1::PART_K_CODES, v1::PART_K_SCALE, v1::PART_K_ZERO, v1::PART_V_CODES,
                                    v1::PART_V_SCALE, v1::PART_V_ZERO,  v1::PART_POS};

absl::Span<const uint8_t> TurnPartBytes(const TurnLayer& l, v1::Part part) {
  switch (part) {
    case v1::PART_PROMPT_K: return l.prompt_k.bytes();
    case v1::PART_PROMPT_V: return l.prompt_v.bytes();
    case v1::PART_GEN_K: return l.gen_k.bytes();
    case v1::PART_GEN_V: return l.gen_v.bytes();
    case v1::PART_PROMPT_SCORE: return BytesOf(l.scores.data);
    case v1::PART_GEN_Q: return l.gen_q.bytes();
    case v1::PART_HISTORY_SCORE: return BytesOf(l.history_score.data);
    case v1::PART_HISTORY_K: return l.history_k.bytes();
    case v1::PART_HISTORY_V: return l.history_v.bytes();
    case v1::PART_HISTORY_POS: return BytesOf(l.history_pos.data);
    default: return {};
  }
}

absl::Span<const uint8_t> MessagePartBytes(const MessageLayer& l, v1::Part part) {
  const QuantizedKv* q = l.quant ? &*l.quant : nullptr;
  switch (part) {
    case v1::PART_K: return l.k.bytes();
    case v1::PART_V: return l.v.bytes();
    case v1::PART_POS: return BytesOf(l.pos.data);
    case v1::PART_K_CODES: return BytesOf(q->k.codes);
    case v1::PART_K_SCALE: return BytesOf(q->k.scale);
    case v1::PART_K_ZERO: return BytesOf(q->k.zero);
    case v1::PART_V_CODES: return BytesOf(q->v.codes);
    case v1::PART_V_SCALE: return BytesOf(q->v.scale);
    case v1::PART_V_ZERO: return BytesOf(q->v.zero);
    case v1::PART_ACC: return BytesOf(l.acc);
    case v1::PART_DEMOTED_K_CODES: return l.demoted ? BytesOf(l.demoted->k.codes) : absl::Span<const uint8_t>();
    case v1::PART_DEMOTED_K_NORM: return l.demoted ? BytesOf(l.demoted->k.scale) : absl::Span<const uint8_t>();
    case v1::PART_DEMOTED_V_CODES: return l.demoted ? BytesOf(l.demoted->v.codes) : absl::Span<const uint8_t>();
    case v1::PART_DEMOTED_V_NORM: return l.demoted ? BytesOf(l.demoted->v.scale) : absl::Span<const uint8_t>();
    default: return {};
  }
}

// An uploaded tensor's bytes, from the header's geometry.
uint64_t UploadPartBytes(const UploadShape& s, v1::Part part) {
  const TurnGeometry& g = s.geo;
  const uint64_t row = static_cast<uint64_t>(g.head_dim) * DTypeSize(g.dtype) * g.kv_heads;
  switch (part) {
    case v1::PART_PROMPT_K:
    case v1::PART_PROMPT_V: return row * g.n_prompt;
    case v1::PART_GEN_K:
    case v1::PART_GEN_V: return row * g.n_gen;
    case v1::PART_PROMPT_SCORE: return 4ull * g.score_heads * g.n_prompt;
    case v1::PART_GEN_Q: return uint64_t{DTypeSize(g.q_dtype)} * g.score_heads * g.n_gen * g.head_dim;
    case v1::PART_HISTORY_SCORE: return 4ull * g.score_heads * s.history_score_tokens;
    case v1::PART_HISTORY_K:
    case v1::PART_HISTORY_V: return row * g.n_history;
    case v1::PART_HISTORY_POS: return 4ull * g.kv_heads * g.n_history;
    default: return 0;
  }
}

std::string Place(uint32_t layer, v1::Part part, uint64_t offset) {
  return absl::StrCat("layer ", layer, " ", PartName(part), " offset ", offset);
}

// NaN or Inf among the `dtype` elements of slot `s` (a [heads, tokens,
// dim] tensor at `base`) that the `n` bytes just copied at byte `offset`
// complete (one element may straddle the previous chunk): kValue naming the
// tensor and the index.
StreamError CheckChunkFinite(const ChunkSequence::Slot& s, DType dtype, const uint8_t* base, uint64_t offset,
                             uint64_t n, int tokens, int dim) {
  const uint64_t es = DTypeSize(dtype);
  const uint64_t first = offset / es, end = (offset + n) / es;
  absl::Status st = CheckKvFinite(dtype, base, first, end - first, static_cast<int>(s.layer), FilePartName(s.part),
                                  tokens, dim);
  if (st.ok()) return StreamError();
  return StreamError(StreamErrorKind::kValue, std::string(st.message()));
}

StreamError HeaderError(std::string message) { return StreamError(StreamErrorKind::kHeader, std::move(message)); }

StreamError FieldError(const std::string& field, absl::string_view name, uint64_t value, absl::string_view expected) {
  return HeaderError(absl::StrCat(field, ".", name, ": ", value, ", expected ", expected));
}

// A message larger than this is not a plausible delivery (64 GiB).
constexpr uint64_t kMaxMessageBytes = uint64_t{1} << 36;

}  // namespace

const char* StreamErrorKindName(StreamErrorKind kind) {
  switch (kind) {
    case StreamErrorKind::kOk: return "OK";
    case StreamErrorKind::kHeader: return "HEADER";
    case StreamErrorKind::kSequence: return "SEQUENCE";
    case StreamErrorKind::kOrder: return "ORDER";
    case StreamErrorKind::kChunkSize: return "CHUNK_SIZE";
    case StreamErrorKind::kExtraChunk: return "EXTRA_CHUNK";
    case StreamErrorKind::kChunkCrc: return "CHUNK_CRC";
    case StreamErrorKind::kValue: return "VALUE";
    case StreamErrorKind::kIncomplete: return "INCOMPLETE";
    case StreamErrorKind::kTrailerCount: return "TRAILER_COUNT";
    case StreamErrorKind::kTrailerCrc: return "TRAILER_CRC";
  }
  return "UNKNOWN";
}

absl::Status UploadStatus(const StreamError& e) {
  switch (e.kind()) {
    case StreamErrorKind::kOk: return absl::OkStatus();
    case StreamErrorKind::kChunkCrc:
    case StreamErrorKind::kTrailerCrc: return absl::DataLossError(e.message());
    default: return absl::InvalidArgumentError(e.message());
  }
}

absl::Status DeliveryStatus(const StreamError& e) {
  if (e.ok()) return absl::OkStatus();
  return absl::DataLossError(e.message());
}

absl::Span<const v1::Part> UploadParts(bool history, bool queries) {
  absl::Span<const v1::Part> all = queries ? absl::MakeConstSpan(kQueryUploadParts) : absl::MakeConstSpan(kUploadParts);
  return history ? all : all.first(all.size() - 3);
}

absl::Span<const v1::Part> DeliveryParts(bool quantized) {
  if (quantized) return absl::MakeConstSpan(kQuantParts);
  return absl::MakeConstSpan(kDenseParts);
}

std::vector<TensorRef> LayerUploadOrder(const TurnLayer& layer, uint32_t index, bool history) {
  std::vector<TensorRef> out;
  for (v1::Part p : UploadParts(history, layer.has_queries())) out.push_back({index, p, TurnPartBytes(layer, p)});
  return out;
}

std::vector<TensorRef> TurnUploadOrder(const Turn& turn) {
  std::vector<TensorRef> out;
  const bool history = !turn.layers.empty() && turn.layers[0].history_k.tokens() > 0;
  const bool queries = !turn.layers.empty() && turn.layers[0].has_queries();
  out.reserve(turn.layers.size() * UploadParts(history, queries).size());
  for (size_t i = 0; i < turn.layers.size(); ++i) {
    for (v1::Part p : UploadParts(history, queries)) {
      out.push_back({static_cast<uint32_t>(i), p, TurnPartBytes(turn.layers[i], p)});
    }
  }
  return out;
}

std::vector<TensorRef> LayerDeliveryOrder(const MessageLayer& layer, uint32_t index, bool with_acc) {
  std::vector<TensorRef> out;
  for (v1::Part p : DeliveryParts(layer.quant.has_value())) out.push_back({index, p, MessagePartBytes(layer, p)});
  if (layer.demoted) {
    for (v1::Part p : kDemotedParts) out.push_back({index, p, MessagePartBytes(layer, p)});
  }
  if (with_acc) out.push_back({index, v1::PART_ACC, MessagePartBytes(layer, v1::PART_ACC)});
  return out;
}

std::vector<TensorRef> MessageDeliveryOrder(const Message& msg, bool with_acc) {
  std::vector<TensorRef> out;
  for (size_t i = 0; i < msg.layers.size(); ++i) {
    std::vector<TensorRef> l = LayerDeliveryOrder(msg.layers[i], static_cast<uint32_t>(i), with_acc);
    out.insert(out.end(), l.begin(), l.end());
  }
  return out;
}

uint64_t TotalBytes(absl::Span<const TensorRef> tensors) {
  uint64_t n = 0;
  for (const TensorRef& t : tensors) n += t.data.size();
  return n;
}

// ---------------------------------------------------------- upload header

std::string PartName(v1::Part part) { return v1::Part_Name(part); }

uint64_t UploadShape::LayerUploadBytes() const {
  uint64_t n = 0;
  for (v1::Part p : UploadParts(true, geo.queries)) n += UploadPartBytes(*this, p);
  return n;
}

uint64_t UploadShape::UploadBytes() const { return LayerUploadBytes() * layers; }

uint64_t UploadShape::ReserveBytes() const {
  return UploadBytes() + kLayerOverheadBytes * static_cast<uint64_t>(layers);
}

namespace {

// What HeaderGeometryError words an error with: the header's geometry and
// the field prefix ("header.geometry").
struct HeaderGeometry {
  const v1::TurnGeometry* g;
  const std::string* field;
};

// ValidateGeometry's words for a header: its field names, and the header's
// own values (a core count saturates at INT_MAX; the header's may not).
std::string HeaderGeometryError(const TurnGeometry& geo, GeometryField f, const std::string& found,
                                const std::string& expected, const void* arg) {
  const HeaderGeometry& h = *static_cast<const HeaderGeometry*>(arg);
  const v1::TurnGeometry& g = *h.g;
  auto text = [&](const char* name, uint32_t value) {
    return absl::StrCat(*h.field, ".", name, ": ", value, ", expected ", expected);
  };
  switch (f) {
    case GeometryField::kKvHeads: return text("kv_heads", g.kv_heads());
    case GeometryField::kHeadDim: return text("head_dim", g.head_dim());
    case GeometryField::kNPrompt: return text("n_prompt", g.n_prompt());
    case GeometryField::kNGen: return text("n_gen", g.n_gen());
    case GeometryField::kNHistory: return text("n_history", g.n_history());
    case GeometryField::kScoreHeads: return text("score_heads", g.score_heads());
    case GeometryField::kQueryDType: break;
  }
  return absl::StrCat(*h.field, ".query_dtype: ", v1::DType_Name(g.query_dtype()),
                      ", expected DTYPE_UNSPECIFIED (the layers send PROMPT_SCORE) or ",
                      geo.dtype == DType::kF32 ? "DTYPE_F32" : absl::StrCat("DTYPE_F32 or ", v1::DType_Name(g.dtype())),
                      " (the layers send GEN_Q; the K/V dtype or F32)");
}

// A proto enum's value for an error: its name and number, or the number
// alone when it has no name.
std::string EnumText(v1::DType d) {
  const std::string& name = v1::DType_Name(d);
  return name.empty() ? absl::StrCat(static_cast<int>(d)) : absl::StrCat(name, " (", static_cast<int>(d), ")");
}

// The header's geometry in the core's terms; counts past INT_MAX saturate
// there (ValidateGeometry refuses them).
absl::StatusOr<UploadShape> ShapeFromHeader(const v1::TurnGeometry& g, const std::string& field) {
  auto to_int = [](uint32_t v) { return static_cast<int>(std::min<uint32_t>(v, std::numeric_limits<int>::max())); };
  UploadShape s;
  if (std::optional<DType> dt = DTypeFromProto(g.dtype())) {
    s.geo.dtype = *dt;
  } else {
    return UploadStatus(HeaderError(
        absl::StrCat(field, ".dtype: ", EnumText(g.dtype()), ", expected DTYPE_F32, DTYPE_F16 or DTYPE_BF16")));
  }
  if (g.query_dtype() != v1::DTYPE_UNSPECIFIED) {
    std::optional<DType> q = DTypeFromProto(g.query_dtype());
    if (!q) {
      return UploadStatus(HeaderError(absl::StrCat(field, ".query_dtype: ", EnumText(g.query_dtype()),
                                                   ", expected DTYPE_UNSPECIFIED, DTYPE_F32, DTYPE_F16 or "
                                                   "DTYPE_BF16")));
    }
    s.geo.queries = true;
    s.geo.q_dtype = *q;
  }
  s.layers = to_int(g.layers());
  s.geo.kv_heads = to_int(g.kv_heads());
  s.geo.score_heads = to_int(g.score_heads());
  s.geo.head_dim = to_int(g.head_dim());
  s.geo.n_prompt = to_int(g.n_prompt());
  s.geo.n_gen = to_int(g.n_gen());
  s.geo.n_history = to_int(g.n_history());
  s.first_agent = g.first_agent();
  s.geo.history_anchors.assign(g.history_anchors().begin(), g.history_anchors().end());
  return s;
}

// The header's own fields beyond the core's geometry: prompt_pos0 and
// history_score_tokens.
absl::Status CheckUploadFields(const v1::TurnGeometry& g, const std::string& field, bool with_parent,
                               UploadShape* s) {
  auto bad = [](const StreamError& e) { return UploadStatus(e); };
  if (g.has_prompt_pos0()) {
    const int64_t p = g.prompt_pos0();
    constexpr int64_t kMaxPos = std::numeric_limits<int32_t>::max();
    // p is bounded before the sum, which could otherwise overflow. The last
    // position id, prompt_pos0 + n_prompt + n_gen - 1, may be 2^31-1 (as the
    // core allows, and as a child continuing after its parent gets).
    if (p < 0 || p > kMaxPos || p + g.n_prompt() + g.n_gen() > kMaxPos + 1) {
      return bad(HeaderError(absl::StrCat(
          field, ".prompt_pos0: ", p, ", expected >= 0 with prompt_pos0 + n_prompt + n_gen <= 2^31 (position ids "
          "are int32)")));
    }
    s->prompt_pos0 = p;
  }
  if (const uint32_t n = g.history_score_tokens(); n > 0) {
    if (s->geo.queries) {
      return bad(HeaderError(absl::StrCat(field, ".history_score_tokens: ", n,
                                          ", expected 0 with query_dtype (the relay computes the mass on the "
                                          "history from GEN_Q)")));
    }
    if (s->geo.n_history > 0 && static_cast<int>(n) != s->geo.n_history) {
      return bad(FieldError(field, "history_score_tokens", n,
                            absl::StrCat("0 or n_history (", s->geo.n_history, ")")));
    }
    if (s->geo.n_history == 0 && !with_parent) {
      return bad(FieldError(field, "history_score_tokens", n,
                            "0 (no history: n_history is 0 and there is no parent)"));
    }
    if (n > static_cast<uint32_t>(kMaxTokensPerPart)) {
      return bad(FieldError(field, "history_score_tokens", n, absl::StrCat("0..", kMaxTokensPerPart)));
    }
    s->history_score_tokens = static_cast<int>(n);
    s->geo.history_score = true;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<UploadShape> CheckGeometry(const v1::TurnGeometry& g, const std::string& field, bool with_parent) {
  if (g.layers() < 1 || g.layers() > static_cast<uint32_t>(kMaxLayers)) {
    return UploadStatus(FieldError(field, "layers", g.layers(), absl::StrCat("1..", kMaxLayers)));
  }
  KVRELAY_ASSIGN_OR_RETURN(UploadShape s, ShapeFromHeader(g, field));
  if (absl::Status st = CheckAnchorList(s.geo.history_anchors, s.geo.n_history); !st.ok()) {
    return UploadStatus(HeaderError(absl::StrCat(field, ".", st.message())));
  }
  const HeaderGeometry words{&g, &field};
  if (absl::Status st = ValidateGeometry(s.geo, HeaderGeometryError, &words); !st.ok()) {
    return UploadStatus(HeaderError(std::string(st.message())));
  }
  if (g.has_softmax_scale()) {
    if (absl::Status st = CheckSoftmaxScale(g.softmax_scale(), absl::StrCat(field, ".softmax_scale")); !st.ok()) {
      return UploadStatus(HeaderError(std::string(st.message())));
    }
    s.softmax_scale = g.softmax_scale();
  }
  KVRELAY_RETURN_IF_ERROR(CheckUploadFields(g, field, with_parent, &s));
  // Per-tensor element counts must fit the int-indexed tensors of core/.
  const uint64_t tokens = std::max({g.n_prompt(), g.n_gen(), g.n_history()});
  if (static_cast<uint64_t>(g.kv_heads()) * tokens * g.head_dim() > (1ull << 40) ||
      s.UploadBytes() > (1ull << 44)) {
    return UploadStatus(HeaderError(
        absl::StrCat(field, ": ", s.UploadBytes(), " bytes of tensors, expected at most 16 TiB")));
  }
  return s;
}

// ---------------------------------------------------------- ChunkSequence

ChunkSequence::ChunkSequence(std::vector<Slot> slots, const char* stream, const char* whole, const char* trailer)
    : stream_(stream), whole_(whole), trailer_(trailer) {
  for (const Slot& s : slots) {
    if (s.size == 0) continue;
    slots_.push_back(s);
    expected_ += s.size;
  }
}

StreamError ChunkSequence::Accept(const ChunkView& c, absl::FunctionRef<uint8_t*(const Slot&)> dest,
                                  absl::FunctionRef<StreamError(const Slot&, const uint8_t*, uint64_t)> verify,
                                  bool in_place) {
  if (complete()) {
    return StreamError(StreamErrorKind::kExtraChunk,
                       absl::StrCat("chunk: ", Place(c.layer, c.part, c.offset), ", expected the ", trailer_,
                                    ": every tensor of the ", whole_, " is already complete"));
  }
  const Slot& s = slots_[next_];
  if (c.layer != s.layer || c.part != s.part || c.offset != offset_) {
    return StreamError(StreamErrorKind::kOrder,
                       absl::StrCat("chunk: ", Place(c.layer, c.part, c.offset), ", expected ",
                                    Place(s.layer, s.part, offset_), " (tensors in ", stream_,
                                    " order, contiguous offsets, no duplicates)"));
  }
  const uint64_t n = c.size;
  if (n == 0 || n > kMaxChunkBytes) {
    return StreamError(StreamErrorKind::kChunkSize,
                       absl::StrCat("chunk.data: ", n, " bytes at ", Place(s.layer, s.part, offset_),
                                    ", expected 1..", kMaxChunkBytes));
  }
  if (n > s.size - offset_) {
    return StreamError(StreamErrorKind::kChunkSize,
                       absl::StrCat("chunk.data: ", n, " bytes at ", Place(s.layer, s.part, offset_),
                                    " runs past the tensor's ", s.size, " bytes (from the header)"));
  }
  // Copied before it is checked (one pass over the data).
  uint8_t* const base = dest(s);
  if (in_place && (c.pieces.size() != 1 || c.pieces[0].data() != base + offset_)) {
    return StreamError(StreamErrorKind::kOrder,
                       absl::StrCat("chunk: ", Place(s.layer, s.part, offset_), " given in place, but not at its place"));
  }
  const uint32_t crc = in_place ? c.crc32c : c.CopyTo(base + offset_);
  if (crc != c.crc32c) {
    return StreamError(StreamErrorKind::kChunkCrc,
                       absl::StrCat("chunk.crc32c: ", c.crc32c, " at ", Place(s.layer, s.part, offset_),
                                    ", expected ", crc, " (CRC32C of the chunk's data)"));
  }
  if (StreamError e = verify(s, base, n); !e.ok()) return e;
  crc_ = Crc32cCombine(crc_, crc, n);  // the chunk was checked: no second pass
  ++chunks_;
  bytes_ += n;
  offset_ += n;
  if (offset_ == s.size) {
    ++next_;
    offset_ = 0;
  }
  return StreamError();
}

StreamError ChunkSequence::CheckTrailer(const v1::Trailer& t) const {
  if (!complete()) {
    const Slot& s = slots_[next_];
    return StreamError(StreamErrorKind::kIncomplete,
                       absl::StrCat(trailer_, ": ", bytes_, " of ", expected_, " tensor bytes received, expected ",
                                    Place(s.layer, s.part, offset_), " (of ", s.size, " bytes) before the ",
                                    trailer_));
  }
  if (t.chunks() != chunks_) {
    return StreamError(StreamErrorKind::kTrailerCount, absl::StrCat(trailer_, ".chunks: ", t.chunks(), ", expected ",
                                                                    chunks_, " (chunks received)"));
  }
  if (t.bytes() != bytes_) {
    return StreamError(StreamErrorKind::kTrailerCount, absl::StrCat(trailer_, ".bytes: ", t.bytes(), ", expected ",
                                                                    bytes_, " (tensor bytes received)"));
  }
  if (t.crc32c() != crc_) {
    return StreamError(StreamErrorKind::kTrailerCrc,
                       absl::StrCat(trailer_, ".crc32c: ", t.crc32c(), ", expected ", crc_,
                                    " (CRC32C of all chunk data in stream order)"));
  }
  return StreamError();
}

// ----------------------------------------------------------- UploadReader

namespace {

std::vector<ChunkSequence::Slot> UploadSlots(const UploadShape& shape) {
  std::vector<ChunkSequence::Slot> out;
  for (int l = 0; l < shape.layers; ++l) {
    for (v1::Part p : UploadParts(true, shape.geo.queries)) {
      out.push_back({static_cast<uint32_t>(l), p, UploadPartBytes(shape, p)});
    }
  }
  return out;
}

}  // namespace

UploadReader::UploadReader(const UploadShape& shape)
    : shape_(shape), seq_(UploadSlots(shape), "upload", "turn", "commit"), layers_(shape.layers) {
  AdvanceCompleted();
}

StreamError UploadReader::CheckFinite(const ChunkSequence::Slot& s, const uint8_t* base, uint64_t n) const {
  const TurnGeometry& g = shape_.geo;
  int tokens;
  DType dtype = g.dtype;
  switch (s.part) {
    case v1::PART_PROMPT_K:
    case v1::PART_PROMPT_V: tokens = g.n_prompt; break;
    case v1::PART_GEN_K:
    case v1::PART_GEN_V: tokens = g.n_gen; break;
    case v1::PART_GEN_Q:
      tokens = g.n_gen;
      dtype = g.q_dtype;
      break;
    case v1::PART_HISTORY_K:
    case v1::PART_HISTORY_V: tokens = g.n_history; break;
    default: return StreamError();  // scores and positions: checked per layer
  }
  return CheckChunkFinite(s, dtype, base, seq_.offset(), n, tokens, g.head_dim);
}

uint8_t* UploadReader::Dest(const ChunkSequence::Slot& s) {
  TurnLayer& L = layers_[s.layer];
  const TurnGeometry& g = shape_.geo;
  const bool first = seq_.offset() == 0;
  // Tensors are allocated when their first chunk arrives, so an upload holds
  // only the layers that are not yet compressed.
  switch (s.part) {
    case v1::PART_PROMPT_K:
      if (first) L.prompt_k = KvTensor::Uninitialized(g.dtype, g.kv_heads, g.n_prompt, g.head_dim);
      return L.prompt_k.mutable_bytes().data();
    case v1::PART_PROMPT_V:
      if (first) L.prompt_v = KvTensor::Uninitialized(g.dtype, g.kv_heads, g.n_prompt, g.head_dim);
      return L.prompt_v.mutable_bytes().data();
    case v1::PART_GEN_K:
      if (first) L.gen_k = KvTensor::Uninitialized(g.dtype, g.kv_heads, g.n_gen, g.head_dim);
      return L.gen_k.mutable_bytes().data();
    case v1::PART_GEN_V:
      if (first) L.gen_v = KvTensor::Uninitialized(g.dtype, g.kv_heads, g.n_gen, g.head_dim);
      return L.gen_v.mutable_bytes().data();
    case v1::PART_PROMPT_SCORE:
      if (first) L.scores = ScoreMatrix(g.score_heads, g.n_prompt);
      return reinterpret_cast<uint8_t*>(L.scores.data.data());
    case v1::PART_GEN_Q:
      if (first) L.gen_q = KvTensor::Uninitialized(g.q_dtype, g.score_heads, g.n_gen, g.head_dim);
      return L.gen_q.mutable_bytes().data();
    case v1::PART_HISTORY_SCORE:
      if (first) L.history_score = ScoreMatrix(g.score_heads, shape_.history_score_tokens);
      return reinterpret_cast<uint8_t*>(L.history_score.data.data());
    case v1::PART_HISTORY_K:
      if (first) L.history_k = KvTensor::Uninitialized(g.dtype, g.kv_heads, g.n_history, g.head_dim);
      return L.history_k.mutable_bytes().data();
    case v1::PART_HISTORY_V:
      if (first) L.history_v = KvTensor::Uninitialized(g.dtype, g.kv_heads, g.n_history, g.head_dim);
      return L.history_v.mutable_bytes().data();
    case v1::PART_HISTORY_POS:
      if (first) L.history_pos = PosTensor(g.kv_heads, g.n_history);
      return reinterpret_cast<uint8_t*>(L.history_pos.data.data());
    default:
      return nullptr;  // not an upload part: ChunkSequence never asks
  }
}

StreamError UploadReader::Accept(const v1::Chunk& c) { return Accept(ChunkView::Of(c)); }

StreamError UploadReader::Accept(const ChunkView& c) {
  StreamError e = seq_.Accept(
      c, [this](const ChunkSequence::Slot& s) { return Dest(s); },
      [this](const ChunkSequence::Slot& s, const uint8_t* base, uint64_t n) { return CheckFinite(s, base, n); });
  if (e.ok()) AdvanceCompleted();
  return e;
}

void UploadReader::AdvanceCompleted() {
  const int limit = seq_.complete() ? shape_.layers : static_cast<int>(seq_.current().layer);
  for (; next_complete_ < limit; ++next_complete_) {
    // Tensors of 0 bytes sent no chunk: give them their (empty) shape.
    TurnLayer& L = layers_[next_complete_];
    const TurnGeometry& g = shape_.geo;
    if (g.n_prompt == 0) {
      L.prompt_k = KvTensor(g.dtype, g.kv_heads, 0, g.head_dim);
      L.prompt_v = KvTensor(g.dtype, g.kv_heads, 0, g.head_dim);
      if (!g.queries) L.scores = ScoreMatrix(g.score_heads, 0);
    }
    if (g.n_gen == 0) {
      L.gen_k = KvTensor(g.dtype, g.kv_heads, 0, g.head_dim);
      L.gen_v = KvTensor(g.dtype, g.kv_heads, 0, g.head_dim);
      if (g.queries) L.gen_q = KvTensor(g.q_dtype, g.score_heads, 0, g.head_dim);
    }
    if (g.n_history == 0) {
      L.history_k = KvTensor(g.dtype, g.kv_heads, 0, g.head_dim);
      L.history_v = KvTensor(g.dtype, g.kv_heads, 0, g.head_dim);
      L.history_pos = PosTensor(g.kv_heads, 0);
    }
    ready_.push_back(next_complete_);
  }
}

std::vector<std::pair<int, TurnLayer>> UploadReader::TakeCompleted() {
  std::vector<std::pair<int, TurnLayer>> out;
  out.reserve(ready_.size());
  for (int l : ready_) out.emplace_back(l, std::move(layers_[l]));
  ready_.clear();
  return out;
}

StreamError UploadReader::CheckCommit(const v1::Trailer& t) const { return seq_.CheckTrailer(t); }

// --------------------------------------------------------- DeliveryReader

uint64_t MessageLayerBytes(const v1::MessageHeader& h) {
  const uint64_t H = h.kv_heads(), d = h.head_dim();
  const uint64_t n = uint64_t{h.n_history()} + h.n_anchor() + h.n_kept() + h.n_gen();
  const uint64_t nd = h.n_demoted();
  const QuantScheme scheme = h.quant_scheme() == v1::QUANT_SCHEME_LLOYD ? QuantScheme::kLloyd : QuantScheme::kInt;
  auto tensor = [&](bool is_key) -> uint64_t {
    if (h.quant_bits() == 0) {
      absl::StatusOr<DType> dtype = FromProtoDType(h.dtype());
      return H * n * d * (dtype.ok() ? DTypeSize(*dtype) : 0);
    }
    return QuantizedSizesOf(scheme, static_cast<int>(h.quant_bits()), static_cast<int>(h.quant_group()),
                            h.quant_keys_channel(), is_key, H, n, d)
        .Bytes();
  };
  // Demoted tokens: lloyd rows.
  const uint64_t demoted =
      nd == 0 ? 0
              : 2 * QuantizedSizesOf(QuantScheme::kLloyd, static_cast<int>(h.demote_bits()), 0, false, false, H, nd, d)
                        .Bytes();
  return tensor(/*is_key=*/true) + tensor(/*is_key=*/false) + demoted + 4 * H * (n + nd);
}

namespace {

// A delivery header's quantization fields: the rules a publish's policy
// passes (ValidateQuantOptions, ranges included), for the message's codes
// and its demoted rows, and none of the fields set without quantization.
StreamError CheckHeaderQuant(const v1::MessageHeader& h) {
  auto bad = [](absl::string_view field, uint64_t v, absl::string_view expected) {
    return HeaderError(absl::StrCat("header.", field, ": ", v, ", expected ", expected));
  };
  const uint32_t bits = h.quant_bits();
  const bool quant = bits != 0;
  if (h.quant_scheme() != v1::QUANT_SCHEME_INT && h.quant_scheme() != v1::QUANT_SCHEME_LLOYD) {
    return bad("quant_scheme", static_cast<uint32_t>(h.quant_scheme()), "QUANT_SCHEME_INT or QUANT_SCHEME_LLOYD");
  }
  const bool lloyd = h.quant_scheme() == v1::QUANT_SCHEME_LLOYD;
  if (quant) {
    absl::StatusOr<QuantOptions> q = QuantOptionsFromHeader(
        lloyd ? QuantScheme::kLloyd : QuantScheme::kInt, bits, h.quant_group(), h.quant_rotate(),
        h.quant_keys_channel(), h.quant_seed(), h.head_dim(), "header.");
    if (!q.ok()) return HeaderError(std::string(q.status().message()));
    if (lloyd && !h.quant_keys_channel() && h.quant_group() != 0) {
      return bad("quant_group", h.quant_group(), "0 for lloyd rows (quant_keys_channel false)");
    }
    if (!lloyd && h.quant_keys_channel()) {
      return HeaderError("header.quant_keys_channel: true, expected false with QUANT_SCHEME_INT");
    }
  } else if (h.quant_group() != 0 || h.quant_rotate() || lloyd || h.quant_keys_channel()) {
    return HeaderError(absl::StrCat("header.quant_group: ", h.quant_group(), ", quant_rotate: ", h.quant_rotate(),
                                    ", quant_scheme: ", static_cast<int>(h.quant_scheme()), ", quant_keys_channel: ",
                                    h.quant_keys_channel(),
                                    ", expected 0, false, QUANT_SCHEME_INT and false without quantization (quant_bits 0)"));
  }
  if ((h.n_demoted() == 0) != (h.demote_bits() == 0)) {
    return HeaderError(absl::StrCat("header.n_demoted: ", h.n_demoted(), ", demote_bits: ", h.demote_bits(),
                                    ", expected both 0 or both set"));
  }
  if (h.n_demoted() != 0) {
    absl::StatusOr<QuantOptions> q = QuantOptionsFromHeader(QuantScheme::kLloyd, h.demote_bits(), 0, false, false,
                                                            h.quant_seed(), h.head_dim(), "header.demote: ");
    if (!q.ok()) return HeaderError(std::string(q.status().message()));
  }
  if (!quant && h.n_demoted() == 0 && h.quant_seed() != 0) {
    return bad("quant_seed", h.quant_seed(), "0 without lloyd codes");
  }
  return StreamError();
}

}  // namespace

StreamError DeliveryReader::CheckHeader(const v1::MessageHeader& h, uint64_t* bytes) {
  auto bad = [](absl::string_view field, uint64_t v, absl::string_view expected) {
    return HeaderError(absl::StrCat("header.", field, ": ", v, ", expected ", expected));
  };
  if (h.layers() < 1) return bad("layers", h.layers(), ">= 1");
  if (h.kv_heads() < 1) return bad("kv_heads", h.kv_heads(), ">= 1");
  if (h.head_dim() < 1) return bad("head_dim", h.head_dim(), ">= 1");
  // The core's bounds (core/turn.h): they keep the sizes below from
  // overflowing, and a header of empty layers from allocating billions.
  if (h.layers() > static_cast<uint32_t>(kMaxLayers)) return bad("layers", h.layers(), absl::StrCat("<= ", kMaxLayers));
  if (h.kv_heads() > static_cast<uint32_t>(kMaxKvHeads)) {
    return bad("kv_heads", h.kv_heads(), absl::StrCat("<= ", kMaxKvHeads));
  }
  if (h.head_dim() > static_cast<uint32_t>(kMaxHeadDim)) {
    return bad("head_dim", h.head_dim(), absl::StrCat("<= ", kMaxHeadDim));
  }
  absl::StatusOr<DType> dtype = FromProtoDType(h.dtype());
  if (!dtype.ok()) return HeaderError(absl::StrCat("header.", dtype.status().message()));
  const uint64_t n64 = uint64_t{h.n_history()} + h.n_anchor() + h.n_kept() + h.n_gen();
  if (n64 + h.n_demoted() >= (uint64_t{1} << 31)) {
    return bad("n_history+n_anchor+n_kept+n_gen+n_demoted", n64 + h.n_demoted(), "< 2^31");
  }
  if (h.next_pos() < 0 || h.next_pos() > (int64_t{1} << 31)) {
    return HeaderError(absl::StrCat("header.next_pos: ", h.next_pos(), ", expected 0..2^31"));
  }
  if (StreamError e = CheckHeaderQuant(h); !e.ok()) return e;
  if (h.acc_tokens() >= (uint64_t{1} << 31)) return bad("acc_tokens", h.acc_tokens(), "< 2^31");
  if (h.acc_tokens() != 0 && h.acc_tokens() < n64 + h.n_demoted()) {
    return bad("acc_tokens", h.acc_tokens(),
               absl::StrCat("0 or at least the message's ", n64 + h.n_demoted(), " tokens"));
  }
  if (static_cast<uint64_t>(h.anchor_pos_size()) > n64) {
    return bad("anchor_pos", h.anchor_pos_size(), absl::StrCat("at most the message's ", n64, " tokens"));
  }
  if (const int i = FirstUnorderedId(h.anchor_pos()); i >= 0) {
    return HeaderError(absl::StrCat("header.anchor_pos[", i, "]: ", h.anchor_pos(i),
                                    ", expected ascending distinct position ids >= 0"));
  }
  const uint64_t L = h.layers();
  const uint64_t per_layer = MessageLayerBytes(h) + 4 * uint64_t{h.kv_heads()} * h.acc_tokens();
  if (per_layer > kMaxMessageBytes / L) {
    return bad("layers", L, absl::StrCat("a message below 2^36 bytes (", per_layer, " per layer)"));
  }

  *bytes = per_layer * L;
  return StreamError();
}

namespace {

// Sizes q's K and V as [heads, tokens, dim] of q's scheme and options
// (QuantizedSizesOf), filled with zeros.
void AllocateQuantized(int heads, int tokens, int dim, QuantizedKv* q) {
  for (QuantizedTensor* t : {&q->k, &q->v}) {
    const QuantizedSizes s =
        QuantizedSizesOf(q->scheme, q->bits, q->group, q->keys_channel, t == &q->k, heads, tokens, dim);
    t->bits = q->bits;
    t->heads = heads;
    t->tokens = tokens;
    t->dim = dim;
    t->codes.resize(s.codes);
    t->scale.resize(s.scales);
    t->zero.resize(s.zeros);
  }
}

}  // namespace

StreamError DeliveryReader::Start(const v1::MessageHeader& h) {
  if (done_ || seq_) return StreamError(StreamErrorKind::kSequence, "header: given twice, expected one");
  uint64_t bytes;
  if (StreamError e = CheckHeader(h, &bytes); !e.ok()) return e;
  const absl::StatusOr<DType> dtype = FromProtoDType(h.dtype());  // OK: checked
  const uint32_t bits = h.quant_bits();
  const bool quant = bits != 0;
  const uint64_t L = h.layers(), H = h.kv_heads(), d = h.head_dim();
  const uint64_t n = uint64_t{h.n_history()} + h.n_anchor() + h.n_kept() + h.n_gen();
  const bool lloyd = h.quant_scheme() == v1::QUANT_SCHEME_LLOYD;
  const uint64_t nd = h.n_demoted();

  msg_ = Message();
  msg_.policy = h.accounting().policy();
  msg_.dtype = *dtype;
  msg_.kv_heads = static_cast<int>(H);
  msg_.head_dim = static_cast<int>(d);
  msg_.n_history = static_cast<int>(h.n_history());
  msg_.n_anchor = static_cast<int>(h.n_anchor());
  msg_.n_kept = static_cast<int>(h.n_kept());
  msg_.n_gen = static_cast<int>(h.n_gen());
  msg_.n_demoted = static_cast<int>(nd);
  msg_.demote_bits = static_cast<int>(h.demote_bits());
  msg_.full_bytes = h.accounting().full_bytes();
  msg_.sent_bytes = h.accounting().sent_bytes();
  msg_.next_pos = h.next_pos();
  msg_.anchor_pos.assign(h.anchor_pos().begin(), h.anchor_pos().end());
  msg_.layers.resize(L);
  const int Hi = msg_.kv_heads, ni = static_cast<int>(n), di = msg_.head_dim;
  for (uint32_t l = 0; l < L; ++l) {
    MessageLayer& layer = msg_.layers[l];
    layer.pos = PosTensor(Hi, static_cast<int>(n + nd));
    layer.acc.resize(H * h.acc_tokens());
    if (nd > 0) {
      QuantizedKv& q = layer.demoted.emplace();
      q.scheme = QuantScheme::kLloyd;
      q.bits = static_cast<int>(h.demote_bits());
      q.seed = h.quant_seed();
      q.dtype = *dtype;
      AllocateQuantized(Hi, static_cast<int>(nd), di, &q);
    }
    if (!quant) {
      layer.k = KvTensor::Uninitialized(*dtype, Hi, ni, di);
      layer.v = KvTensor::Uninitialized(*dtype, Hi, ni, di);
    } else {
      layer.k = KvTensor(*dtype, Hi, 0, di);
      layer.v = KvTensor(*dtype, Hi, 0, di);
      QuantizedKv& q = layer.quant.emplace();
      q.scheme = lloyd ? QuantScheme::kLloyd : QuantScheme::kInt;
      q.bits = static_cast<int>(bits);
      q.group = static_cast<int>(h.quant_group());
      q.rotate = h.quant_rotate();
      q.keys_channel = h.quant_keys_channel();
      q.seed = lloyd ? h.quant_seed() : 0;
      q.dtype = *dtype;
      AllocateQuantized(Hi, ni, di, &q);
    }
  }
  // The slots are the message's own buffers, in delivery order.
  std::vector<ChunkSequence::Slot> slots;
  slot_data_.clear();
  for (const TensorRef& t : MessageDeliveryOrder(msg_, /*with_acc=*/h.acc_tokens() > 0)) {
    if (t.data.empty()) continue;
    slots.push_back({t.layer, t.part, t.data.size()});
    slot_data_.push_back(const_cast<uint8_t*>(t.data.data()));
  }
  seq_.emplace(std::move(slots), "delivery", "message", "trailer");
  return StreamError();
}

StreamError DeliveryReader::Add(const v1::Chunk& c) { return Add(ChunkView::Of(c)); }

StreamError DeliveryReader::Add(const ChunkView& c) { return AddChunk(c, /*in_place=*/false); }

StreamError DeliveryReader::AddInPlace(const ChunkView& c) { return AddChunk(c, /*in_place=*/true); }

StreamError DeliveryReader::AddChunk(const ChunkView& c, bool in_place) {
  if (done_) return StreamError(StreamErrorKind::kSequence, "chunk: after the trailer, expected the end");
  if (!seq_) return StreamError(StreamErrorKind::kSequence, "chunk: before the header, expected a header first");
  return seq_->Accept(
      c, [this](const ChunkSequence::Slot&) { return slot_data_[seq_->index()]; },
      [this](const ChunkSequence::Slot& s, const uint8_t* base, uint64_t n) { return CheckFinite(s, base, n); },
      in_place);
}

StreamError DeliveryReader::CheckFinite(const ChunkSequence::Slot& s, const uint8_t* base, uint64_t n) const {
  const MessageLayer& layer = msg_.layers[s.layer];
  const int H = msg_.kv_heads;
  DType dtype = DType::kF16;  // every statistic is fp16
  int tokens = 0, dim = 1;
  switch (s.part) {
    case v1::PART_K:
    case v1::PART_V:
      dtype = msg_.dtype;
      tokens = layer.k.tokens();
      dim = msg_.head_dim;
      break;
    case v1::PART_K_SCALE:
    case v1::PART_K_ZERO: {
      // Per token (int values, lloyd rows) or per token group and channel.
      const QuantizedKv& q = *layer.quant;
      const bool per_channel = q.scheme != QuantScheme::kLloyd || q.keys_channel;
      dim = per_channel ? msg_.head_dim : 1;
      tokens = static_cast<int>(q.k.scale.size() / H / dim);
      break;
    }
    case v1::PART_V_SCALE:
    case v1::PART_V_ZERO: tokens = layer.quant->v.tokens; break;
    case v1::PART_DEMOTED_K_NORM:
    case v1::PART_DEMOTED_V_NORM: tokens = layer.demoted_tokens(); break;
    default: return StreamError();  // codes, positions; acc: checked by Finish
  }
  return CheckChunkFinite(s, dtype, base, seq_->offset(), n, tokens, dim);
}

StreamError DeliveryReader::Finish(const v1::Trailer& t, Message* out) {
  if (done_) return StreamError(StreamErrorKind::kSequence, "trailer: given twice, expected one");
  if (!seq_) return StreamError(StreamErrorKind::kSequence, "trailer: before the header, expected a header first");
  if (StreamError e = seq_->CheckTrailer(t); !e.ok()) return e;
  uint64_t sent = 0;
  for (const MessageLayer& l : msg_.layers) sent += l.SentBytes();
  if (sent != msg_.sent_bytes) {
    return StreamError(StreamErrorKind::kValue,
                       absl::StrCat("header.accounting.sent_bytes: ", msg_.sent_bytes, ", expected ", sent,
                                    " (bytes of the delivered tensors)"));
  }
  // acc (relay to relay) feeds later selections: a value no relay computes
  // is refused rather than stored.
  for (size_t l = 0; l < msg_.layers.size(); ++l) {
    const std::vector<float>& acc = msg_.layers[l].acc;
    if (AllFiniteNonNegative(acc.data(), acc.size())) continue;
    for (size_t i = 0; i < acc.size(); ++i) {
      if (!(std::isfinite(acc[i]) && acc[i] >= 0)) {
        const size_t n = acc.size() / msg_.kv_heads;
        return StreamError(StreamErrorKind::kValue,
                           absl::StrCat("layer.", l, ".acc: ", acc[i], " at [", i / n, ",", i % n,
                                        "], expected a finite accumulated importance >= 0"));
      }
    }
  }
  msg_.next_pos = NextPosition(msg_);  // 0 (a relay before the field): from the ids
  done_ = true;
  *out = std::move(msg_);
  return StreamError();
}

// ------------------------------------------------------- ChunkStreamWriter

void ChunkStreamWriter::Append(std::vector<TensorRef> tensors, std::shared_ptr<const void> hold) {
  holds_.emplace_back(appended_, std::move(hold));
  appended_ += tensors.size();
  chunks_.Append(std::move(tensors));
}

bool ChunkStreamWriter::NextChunk(int field, grpc::ByteBuffer* out, uint64_t* bytes) {
  ChunkCursor::Piece c;
  if (!chunks_.Next(&c)) return false;
  while (hold_ + 1 < holds_.size() && holds_[hold_ + 1].first <= c.tensor) holds_[hold_++].second.reset();
  const std::shared_ptr<const void>& hold = holds_[hold_].second;
  uint32_t crc = 0;
  if (hold) {
    crc = Crc32c(c.data.data(), c.data.size());
    *out = EncodeChunkNoCopy(field, c.layer, c.part, c.offset, c.data, crc, hold);
  } else {
    *out = EncodeChunkCopy(field, c.layer, c.part, c.offset, c.data, &crc);
  }
  trailer_.Add(crc, c.data.size());
  if (bytes) *bytes = c.data.size();
  return true;
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
    absl::Status s = sink(*chunk);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace kvrelay
