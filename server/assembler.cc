#include "server/assembler.h"

#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "core/crc32c.h"
#include "core/status_macros.h"

namespace kvrelay {
namespace {

absl::Status Field(const std::string& field, absl::string_view name, uint64_t value,
                   absl::string_view expected) {
  return absl::InvalidArgumentError(absl::StrCat(field, ".", name, ": ", value, ", expected ", expected));
}

}  // namespace

std::string PartName(v1::Part part) { return v1::Part_Name(part); }

uint64_t UploadShape::LayerUploadBytes() const {
  const uint64_t kv = static_cast<uint64_t>(geo.kv_heads) * geo.head_dim * DTypeSize(geo.dtype);
  return 2 * kv * (static_cast<uint64_t>(geo.n_prompt) + geo.n_gen + geo.n_history) +
         4ull * geo.score_heads * geo.n_prompt + 4ull * geo.kv_heads * geo.n_history;
}

uint64_t UploadShape::UploadBytes() const { return LayerUploadBytes() * layers; }

uint64_t UploadShape::ReserveBytes() const {
  return UploadBytes() + kLayerOverheadBytes * static_cast<uint64_t>(layers);
}

absl::StatusOr<UploadShape> CheckGeometry(const v1::TurnGeometry& g, const std::string& field) {
  UploadShape s;
  // The core's bounds (core/turn.h), checked before anything is reserved.
  auto range = [](int hi) { return absl::StrCat("1..", hi); };
  if (g.layers() < 1 || g.layers() > static_cast<uint32_t>(kMaxLayers)) {
    return Field(field, "layers", g.layers(), range(kMaxLayers));
  }
  if (g.kv_heads() < 1 || g.kv_heads() > static_cast<uint32_t>(kMaxKvHeads)) {
    return Field(field, "kv_heads", g.kv_heads(), range(kMaxKvHeads));
  }
  if (g.score_heads() < g.kv_heads() || g.score_heads() % g.kv_heads() != 0 ||
      g.score_heads() > static_cast<uint32_t>(kMaxScoreHeads)) {
    return Field(field, "score_heads", g.score_heads(),
                 absl::StrCat("a positive multiple of kv_heads (", g.kv_heads(), "), at most ", kMaxScoreHeads));
  }
  if (g.head_dim() < 1 || g.head_dim() > static_cast<uint32_t>(kMaxHeadDim)) {
    return Field(field, "head_dim", g.head_dim(), range(kMaxHeadDim));
  }
  if (std::optional<DType> dt = DTypeFromProto(g.dtype())) {
    s.geo.dtype = *dt;
  } else {
    // An unknown value has no name: print the number alone.
    const std::string& name = v1::DType_Name(g.dtype());
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".dtype: ",
                     name.empty() ? absl::StrCat(static_cast<int>(g.dtype()))
                                  : absl::StrCat(name, " (", static_cast<int>(g.dtype()), ")"),
                     ", expected DTYPE_F32, DTYPE_F16 or DTYPE_BF16"));
  }
  for (auto [name, v] : {std::pair<const char*, uint32_t>{"n_prompt", g.n_prompt()},
                         {"n_gen", g.n_gen()},
                         {"n_history", g.n_history()}}) {
    if (v > static_cast<uint32_t>(kMaxTokensPerPart)) {
      return Field(field, name, v, absl::StrCat("0..", kMaxTokensPerPart));
    }
  }
  s.layers = static_cast<int>(g.layers());
  s.geo.kv_heads = static_cast<int>(g.kv_heads());
  s.geo.score_heads = static_cast<int>(g.score_heads());
  s.geo.head_dim = static_cast<int>(g.head_dim());
  s.geo.n_prompt = static_cast<int>(g.n_prompt());
  s.geo.n_gen = static_cast<int>(g.n_gen());
  s.geo.n_history = static_cast<int>(g.n_history());
  s.first_agent = g.first_agent();
  if (g.has_prompt_pos0()) {
    const int64_t p = g.prompt_pos0();
    constexpr int64_t kMaxPos = std::numeric_limits<int32_t>::max();
    // p is bounded before the sum, which could otherwise overflow. The last
    // position id, prompt_pos0 + n_prompt + n_gen - 1, may be 2^31-1 (as the
    // core allows, and as a child continuing after its parent gets).
    if (p < 0 || p > kMaxPos || p + g.n_prompt() + g.n_gen() > kMaxPos + 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".prompt_pos0: ", p, ", expected >= 0 with prompt_pos0 + n_prompt + n_gen <= 2^31 (position ids "
          "are int32)"));
    }
    s.prompt_pos0 = p;
  }
  // The core's own check, as a backstop (it must agree with the above).
  if (absl::Status st = ValidateGeometry(s.geo); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", st.message()));
  }
  // Per-tensor element counts must fit the int-indexed tensors of core/.
  const uint64_t tokens = std::max({g.n_prompt(), g.n_gen(), g.n_history()});
  if (static_cast<uint64_t>(g.kv_heads()) * tokens * g.head_dim() > (1ull << 40) ||
      s.UploadBytes() > (1ull << 44)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", s.UploadBytes(),
                                                   " bytes of tensors, expected at most 16 TiB"));
  }
  return s;
}

TurnAssembler::TurnAssembler(const UploadShape& shape) : shape_(shape), layers_(shape.layers) {
  const TurnGeometry& g = shape.geo;
  const uint64_t row = static_cast<uint64_t>(g.head_dim) * DTypeSize(g.dtype);
  const uint64_t prompt = row * g.kv_heads * g.n_prompt, gen = row * g.kv_heads * g.n_gen,
                 hist = row * g.kv_heads * g.n_history;
  const uint64_t score = 4ull * g.score_heads * g.n_prompt, pos = 4ull * g.kv_heads * g.n_history;
  for (int l = 0; l < shape.layers; ++l) {
    const std::pair<v1::Part, uint64_t> parts[] = {
        {v1::PART_PROMPT_K, prompt}, {v1::PART_PROMPT_V, prompt}, {v1::PART_GEN_K, gen},
        {v1::PART_GEN_V, gen},       {v1::PART_PROMPT_SCORE, score}, {v1::PART_HISTORY_K, hist},
        {v1::PART_HISTORY_V, hist},  {v1::PART_HISTORY_POS, pos}};
    for (const auto& [part, size] : parts) {
      if (size > 0) tensors_.push_back({l, part, size});
    }
  }
  AdvanceCompleted();
}

absl::Status TurnAssembler::CheckFinite(const Tensor& t, const uint8_t* base, uint64_t n) const {
  const TurnGeometry& g = shape_.geo;
  int tokens;
  switch (t.part) {
    case v1::PART_PROMPT_K:
    case v1::PART_PROMPT_V: tokens = g.n_prompt; break;
    case v1::PART_GEN_K:
    case v1::PART_GEN_V: tokens = g.n_gen; break;
    case v1::PART_HISTORY_K:
    case v1::PART_HISTORY_V: tokens = g.n_history; break;
    default: return absl::OkStatus();  // scores and positions: checked per layer
  }
  // The elements this chunk completes (one may straddle the previous chunk).
  const uint64_t es = DTypeSize(g.dtype);
  const uint64_t first = offset_ / es, end = (offset_ + n) / es;
  return CheckKvFinite(g.dtype, base, first, end - first, t.layer, FilePartName(t.part), tokens, g.head_dim);
}

uint8_t* TurnAssembler::Dest(const Tensor& t) {
  TurnLayer& L = layers_[t.layer];
  const TurnGeometry& g = shape_.geo;
  // Tensors are allocated when their first chunk arrives, so an upload holds
  // only the layers that are not yet compressed.
  switch (t.part) {
    case v1::PART_PROMPT_K:
      if (offset_ == 0) L.prompt_k = KvTensor::Uninitialized(g.dtype, g.kv_heads, g.n_prompt, g.head_dim);
      return L.prompt_k.mutable_bytes().data();
    case v1::PART_PROMPT_V:
      if (offset_ == 0) L.prompt_v = KvTensor::Uninitialized(g.dtype, g.kv_heads, g.n_prompt, g.head_dim);
      return L.prompt_v.mutable_bytes().data();
    case v1::PART_GEN_K:
      if (offset_ == 0) L.gen_k = KvTensor::Uninitialized(g.dtype, g.kv_heads, g.n_gen, g.head_dim);
      return L.gen_k.mutable_bytes().data();
    case v1::PART_GEN_V:
      if (offset_ == 0) L.gen_v = KvTensor::Uninitialized(g.dtype, g.kv_heads, g.n_gen, g.head_dim);
      return L.gen_v.mutable_bytes().data();
    case v1::PART_PROMPT_SCORE:
      if (offset_ == 0) L.scores = ScoreMatrix(g.score_heads, g.n_prompt);
      return reinterpret_cast<uint8_t*>(L.scores.data.data());
    case v1::PART_HISTORY_K:
      if (offset_ == 0) L.history_k = KvTensor::Uninitialized(g.dtype, g.kv_heads, g.n_history, g.head_dim);
      return L.history_k.mutable_bytes().data();
    case v1::PART_HISTORY_V:
      if (offset_ == 0) L.history_v = KvTensor::Uninitialized(g.dtype, g.kv_heads, g.n_history, g.head_dim);
      return L.history_v.mutable_bytes().data();
    case v1::PART_HISTORY_POS:
      if (offset_ == 0) L.history_pos = PosTensor(g.kv_heads, g.n_history);
      return reinterpret_cast<uint8_t*>(L.history_pos.data.data());
    default:
      return nullptr;
  }
}

absl::Status TurnAssembler::Accept(const v1::Chunk& c) { return Accept(ChunkView::Of(c)); }

absl::Status TurnAssembler::Accept(const ChunkView& c) {
  if (cursor_ == tensors_.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk: layer ", c.layer, " ", PartName(c.part), " offset ", c.offset,
        ", expected the commit: every tensor of the turn is already complete"));
  }
  const Tensor& t = tensors_[cursor_];
  if (c.layer != static_cast<uint32_t>(t.layer) || c.part != t.part || c.offset != offset_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk: layer ", c.layer, " ", PartName(c.part), " offset ", c.offset, ", expected layer ",
        t.layer, " ", PartName(t.part), " offset ", offset_,
        " (tensors in upload order, contiguous offsets, no duplicates)"));
  }
  const uint64_t n = c.size;
  if (n == 0 || n > kMaxChunkBytes) {
    return absl::InvalidArgumentError(absl::StrCat("chunk.data: ", n, " bytes at layer ", t.layer, " ",
                                                   PartName(t.part), " offset ", offset_,
                                                   ", expected 1..", kMaxChunkBytes));
  }
  if (offset_ + n > t.size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk.data: ", n, " bytes at layer ", t.layer, " ", PartName(t.part), " offset ", offset_,
        " runs past the tensor's ", t.size, " bytes (from the header's geometry)"));
  }
  // Copied before it is checked (one pass over the data); a chunk that
  // fails leaves its bytes where the next chunk will overwrite them.
  uint8_t* const base = Dest(t);
  const uint32_t crc = c.CopyTo(base + offset_);
  if (crc != c.crc32c) {
    return absl::DataLossError(absl::StrCat("chunk.crc32c: ", c.crc32c, " at layer ", t.layer, " ",
                                            PartName(t.part), " offset ", offset_, ", expected ", crc,
                                            " (CRC32C of the chunk's data)"));
  }
  KVRELAY_RETURN_IF_ERROR(CheckFinite(t, base, n));
  crc_ = Crc32cCombine(crc_, crc, n);  // the chunk was checked: no second pass
  ++chunks_;
  bytes_ += n;
  offset_ += n;
  if (offset_ == t.size) {
    ++cursor_;
    offset_ = 0;
    AdvanceCompleted();
  }
  return absl::OkStatus();
}

void TurnAssembler::AdvanceCompleted() {
  const int limit = cursor_ < tensors_.size() ? tensors_[cursor_].layer : shape_.layers;
  for (; next_complete_ < limit; ++next_complete_) {
    // Tensors of 0 bytes sent no chunk: give them their (empty) shape.
    TurnLayer& L = layers_[next_complete_];
    const TurnGeometry& g = shape_.geo;
    if (g.n_prompt == 0) {
      L.prompt_k = KvTensor(g.dtype, g.kv_heads, 0, g.head_dim);
      L.prompt_v = KvTensor(g.dtype, g.kv_heads, 0, g.head_dim);
      L.scores = ScoreMatrix(g.score_heads, 0);
    }
    if (g.n_gen == 0) {
      L.gen_k = KvTensor(g.dtype, g.kv_heads, 0, g.head_dim);
      L.gen_v = KvTensor(g.dtype, g.kv_heads, 0, g.head_dim);
    }
    if (g.n_history == 0) {
      L.history_k = KvTensor(g.dtype, g.kv_heads, 0, g.head_dim);
      L.history_v = KvTensor(g.dtype, g.kv_heads, 0, g.head_dim);
      L.history_pos = PosTensor(g.kv_heads, 0);
    }
    ready_.push_back(next_complete_);
  }
}

std::vector<std::pair<int, TurnLayer>> TurnAssembler::TakeCompleted() {
  std::vector<std::pair<int, TurnLayer>> out;
  out.reserve(ready_.size());
  for (int l : ready_) out.emplace_back(l, std::move(layers_[l]));
  ready_.clear();
  return out;
}

absl::Status TurnAssembler::CheckCommit(const v1::Trailer& t) const {
  if (cursor_ != tensors_.size()) {
    const Tensor& next = tensors_[cursor_];
    return absl::InvalidArgumentError(absl::StrCat(
        "commit: ", bytes_, " of ", shape_.UploadBytes(), " tensor bytes received, expected layer ",
        next.layer, " ", PartName(next.part), " offset ", offset_, " before the commit"));
  }
  if (t.chunks() != chunks_) {
    return absl::InvalidArgumentError(absl::StrCat("commit.chunks: ", t.chunks(), ", expected ", chunks_,
                                                   " (chunks received)"));
  }
  if (t.bytes() != bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("commit.bytes: ", t.bytes(), ", expected ", bytes_,
                                                   " (tensor bytes received)"));
  }
  if (t.crc32c() != crc_) {
    return absl::DataLossError(absl::StrCat("commit.crc32c: ", t.crc32c(), ", expected ", crc_,
                                            " (CRC32C of all chunk data in stream order)"));
  }
  return absl::OkStatus();
}

}  // namespace kvrelay
