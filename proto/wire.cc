#include "proto/wire.h"

#include "absl/strings/str_cat.h"
#include "core/crc32c.h"
#include "core/status_macros.h"

namespace kvrelay {

void ChunkCursor::Append(std::vector<TensorRef> tensors) {
  tensors_.insert(tensors_.end(), tensors.begin(), tensors.end());
}

bool ChunkCursor::Next(Piece* piece) {
  while (cursor_ < tensors_.size() && offset_ >= tensors_[cursor_].data.size()) {
    ++cursor_;
    offset_ = 0;
  }
  if (cursor_ == tensors_.size()) return false;
  const TensorRef& t = tensors_[cursor_];
  piece->layer = t.layer;
  piece->part = t.part;
  piece->offset = offset_;
  piece->data = t.data.subspan(offset_, max_chunk_);
  piece->tensor = cursor_;
  offset_ += piece->data.size();
  return true;
}

void TrailerBuilder::Add(const v1::Chunk& chunk) { Add(chunk.crc32c(), chunk.data().size()); }

void TrailerBuilder::Add(uint32_t crc32c, uint64_t size) {
  ++chunks_;
  bytes_ += size;
  // The chunk's own CRC was computed over the same bytes; combine it.
  crc_ = Crc32cCombine(crc_, crc32c, size);
}

v1::Trailer TrailerBuilder::Build() const {
  v1::Trailer t;
  t.set_chunks(chunks_);
  t.set_bytes(bytes_);
  t.set_crc32c(crc_);
  return t;
}

const char* FilePartName(v1::Part part) {
  switch (part) {
    case v1::PART_PROMPT_K: return "prompt.k";
    case v1::PART_PROMPT_V: return "prompt.v";
    case v1::PART_GEN_K: return "gen.k";
    case v1::PART_GEN_V: return "gen.v";
    case v1::PART_PROMPT_SCORE: return "prompt.score";
    case v1::PART_GEN_Q: return "gen.q";
    case v1::PART_HISTORY_K: return "history.k";
    case v1::PART_HISTORY_V: return "history.v";
    case v1::PART_HISTORY_POS: return "history.pos";
    case v1::PART_K: return "k";
    case v1::PART_V: return "v";
    case v1::PART_POS: return "pos";
    case v1::PART_K_CODES: return "k.codes";
    case v1::PART_K_SCALE: return "k.scale";
    case v1::PART_K_ZERO: return "k.zero";
    case v1::PART_V_CODES: return "v.codes";
    case v1::PART_V_SCALE: return "v.scale";
    case v1::PART_V_ZERO: return "v.zero";
    case v1::PART_ACC: return "acc";
    case v1::PART_DEMOTED_K_CODES: return "demoted.k.codes";
    case v1::PART_DEMOTED_K_NORM: return "demoted.k.norm";
    case v1::PART_DEMOTED_V_CODES: return "demoted.v.codes";
    case v1::PART_DEMOTED_V_NORM: return "demoted.v.norm";
    default: return "unknown";
  }
}

v1::DType ToProtoDType(DType dtype) {
  switch (dtype) {
    case DType::kF32: return v1::DTYPE_F32;
    case DType::kF16: return v1::DTYPE_F16;
    case DType::kBF16: return v1::DTYPE_BF16;
  }
  return v1::DTYPE_UNSPECIFIED;
}

std::optional<DType> DTypeFromProto(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_F32: return DType::kF32;
    case v1::DTYPE_F16: return DType::kF16;
    case v1::DTYPE_BF16: return DType::kBF16;
    default: return std::nullopt;
  }
}

absl::StatusOr<DType> FromProtoDType(v1::DType dtype) {
  if (std::optional<DType> d = DTypeFromProto(dtype)) return *d;
  return absl::InvalidArgumentError(absl::StrCat("dtype: ", static_cast<int>(dtype), ", expected F32, F16 or BF16"));
}

absl::StatusOr<v1::TurnGeometry> TurnGeometryOf(const Turn& turn) {
  KVRELAY_ASSIGN_OR_RETURN(const TurnLayout shape, LayoutOf(turn));
  const TurnGeometry& geo = shape.geo;
  // Publish and Compress carry no history.acc: refuse rather than drop it
  // (a relay would compress another turn).
  if (geo.history_acc) {
    return absl::InvalidArgumentError(
        "layer.0.history.acc: not carried by Publish or Compress, expected none (publish with parent_id to keep "
        "the parent's acc, or compress offline with kvrelayctl compress)");
  }
  return ToProto(shape);
}

v1::TurnGeometry ToProto(const TurnLayout& layout) {
  const TurnGeometry& geo = layout.geo;
  v1::TurnGeometry g;
  g.set_layers(static_cast<uint32_t>(layout.layers));
  g.set_kv_heads(geo.kv_heads);
  g.set_score_heads(geo.score_heads);
  g.set_head_dim(geo.head_dim);
  g.set_dtype(ToProtoDType(geo.dtype));
  g.set_n_prompt(geo.n_prompt);
  g.set_n_gen(geo.n_gen);
  g.set_n_history(geo.n_history);
  g.set_first_agent(layout.first_agent);
  if (layout.prompt_pos0) g.set_prompt_pos0(*layout.prompt_pos0);
  if (geo.queries) g.set_query_dtype(ToProtoDType(geo.q_dtype));
  if (layout.softmax_scale) g.set_softmax_scale(*layout.softmax_scale);
  g.mutable_history_anchors()->Assign(geo.history_anchors.begin(), geo.history_anchors.end());
  g.set_history_score_tokens(static_cast<uint32_t>(layout.history_score_tokens));
  return g;
}

v1::MessageHeader MessageHeaderOf(const Message& msg) {
  v1::MessageHeader h;
  FillMessageHeader(msg, &h);
  v1::Accounting* a = h.mutable_accounting();
  a->set_policy(msg.policy);
  a->set_full_bytes(msg.full_bytes);
  a->set_sent_bytes(msg.sent_bytes);
  a->set_ratio(msg.Ratio());
  if (msg.attention_error) a->set_attention_error(*msg.attention_error);
  return h;
}

void FillMessageHeader(const Message& msg, v1::MessageHeader* h) {
  h->set_layers(static_cast<uint32_t>(msg.layers.size()));
  h->set_kv_heads(msg.kv_heads);
  h->set_head_dim(msg.head_dim);
  h->set_dtype(ToProtoDType(msg.dtype));
  h->set_n_history(msg.n_history);
  h->set_n_anchor(msg.n_anchor);
  h->set_n_kept(msg.n_kept);
  h->set_n_gen(msg.n_gen);
  h->set_next_pos(NextPosition(msg));
  h->mutable_anchor_pos()->Assign(msg.anchor_pos.begin(), msg.anchor_pos.end());
  std::optional<QuantOptions> quant;
  if (!msg.layers.empty() && msg.layers[0].quant) quant = OptionsOf(*msg.layers[0].quant);
  const bool demoted = msg.n_demoted > 0 && !msg.layers.empty() && msg.layers[0].demoted;
  SetQuantHeader(quant, demoted ? msg.n_demoted : 0, msg.demote_bits, demoted ? msg.layers[0].demoted->seed : 0, h);
}

void SetQuantHeader(const std::optional<QuantOptions>& quant, int n_demoted, int demote_bits, uint64_t demote_seed,
                    v1::MessageHeader* h) {
  if (quant) {
    const bool lloyd = quant->scheme == QuantScheme::kLloyd;
    h->set_quant_bits(static_cast<uint32_t>(quant->bits));
    h->set_quant_group(lloyd && !quant->keys_channel ? 0 : static_cast<uint32_t>(quant->group));
    h->set_quant_rotate(quant->rotate);
    if (lloyd) {
      h->set_quant_scheme(v1::QUANT_SCHEME_LLOYD);
      h->set_quant_keys_channel(quant->keys_channel);
      h->set_quant_seed(quant->seed);
    }
  }
  if (n_demoted > 0) {
    h->set_n_demoted(static_cast<uint32_t>(n_demoted));
    h->set_demote_bits(static_cast<uint32_t>(demote_bits));
    h->set_quant_seed(demote_seed);
  }
}

v1::Accounting ToProto(const Accounting& a) {
  v1::Accounting p;
  p.set_received_bytes(a.received_bytes);
  p.set_full_bytes(a.full_bytes);
  p.set_sent_bytes(a.sent_bytes);
  p.set_ratio(a.ratio);
  p.set_compress_seconds(a.compress_seconds);
  p.set_commit_seconds(a.commit_seconds);
  p.set_policy(a.policy);
  if (a.attention_error) p.set_attention_error(*a.attention_error);
  return p;
}

Accounting AccountingFromProto(const v1::Accounting& p) {
  Accounting a;
  a.received_bytes = p.received_bytes();
  a.full_bytes = p.full_bytes();
  a.sent_bytes = p.sent_bytes();
  a.ratio = p.ratio();
  a.compress_seconds = p.compress_seconds();
  a.commit_seconds = p.commit_seconds();
  a.policy = p.policy();
  if (p.has_attention_error()) a.attention_error = p.attention_error();
  return a;
}

}  // namespace kvrelay
