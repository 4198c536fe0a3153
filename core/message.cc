#include "core/message.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/quant.h"

namespace kvrelay {

uint64_t MessageLayer::SentBytes() const {
  uint64_t payload;
  if (quant.has_value()) {
    payload = quant->k.ByteSize() + quant->v.ByteSize();
  } else {
    payload = static_cast<uint64_t>(k.byte_size()) + v.byte_size();
  }
  return payload + 4 * static_cast<uint64_t>(pos.data.size());
}

int64_t HeldEnd(const Message& msg) {
  int64_t end = 0;
  for (const MessageLayer& l : msg.layers) {
    for (int32_t p : l.pos.data) end = std::max<int64_t>(end, int64_t{p} + 1);
  }
  return end;
}

int64_t NextPosition(const Message& msg) { return std::max(msg.next_pos, HeldEnd(msg)); }

absl::Status CheckMessageAnchors(const Message& msg, absl::string_view field) {
  if (const int i = FirstUnorderedId(msg.anchor_pos); i >= 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", msg.anchor_pos[i], " at index ", i,
                                                   ", expected ascending distinct position ids >= 0"));
  }
  for (size_t l = 0; l < msg.layers.size(); ++l) {
    if (std::optional<AnchorMiss> miss = FindAnchorMiss(msg.layers[l].pos, msg.anchor_pos)) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": position ", miss->anchor, " is held ", miss->held,
                                                     " times by head ", miss->head, " of layer.", l,
                                                     ".pos, expected exactly once (every head keeps every anchor "
                                                     "of the chain)"));
    }
  }
  return absl::OkStatus();
}

const char* GranularityName(Granularity g) {
  switch (g) {
    case Granularity::kHead: return "head";
    case Granularity::kLayer: return "layer";
    case Granularity::kNone: break;
  }
  return "";
}

void SetHistoryGeometry(const Message& parent, TurnGeometry* geo) {
  geo->n_history = parent.layers.empty() ? 0 : parent.layers[0].tokens();
  geo->history_anchors = parent.anchor_pos;
  geo->history_acc = true;
}

absl::Status SetHistoryFromMessage(const Message& parent, int l, DType dtype, TurnLayer* layer) {
  const MessageLayer& p = parent.layers[l];
  layer->history_pos = p.pos;
  if (p.quant) {
    absl::Status s = DequantizeKv(*p.quant, dtype, &layer->history_k, &layer->history_v);
    if (!s.ok()) return s;
  } else {
    layer->history_k = p.k;
    layer->history_v = p.v;
  }
  layer->history_acc = ScoreMatrix(p.pos.heads, p.pos.tokens);
  if (!p.acc.empty()) layer->history_acc.data = p.acc;
  return absl::OkStatus();
}

}  // namespace kvrelay

namespace kvrelay {

absl::Status ComposeOnParent(const Message& parent, Turn* turn) {
  if (turn->layers.empty()) return absl::InvalidArgumentError("turn: no layers, expected at least 1");
  const TurnLayer& l0 = turn->layers[0];
  if (l0.history_k.tokens() > 0) {
    return absl::InvalidArgumentError(absl::StrCat("layer.0.history.k: ", l0.history_k.tokens(),
                                                   " tokens, expected none with a parent (the parent is the history)"));
  }
  if (parent.layers.size() != turn->layers.size() || parent.kv_heads != l0.prompt_k.heads() ||
      parent.head_dim != l0.prompt_k.dim() || parent.dtype != l0.prompt_k.dtype()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parent: ", parent.layers.size(), " layers x ", parent.kv_heads, " kv heads x head_dim ", parent.head_dim, " ",
        DTypeName(parent.dtype), ", expected the turn's ", turn->layers.size(), " x ", l0.prompt_k.heads(), " x ",
        l0.prompt_k.dim(), " ", DTypeName(l0.prompt_k.dtype())));
  }
  for (size_t l = 0; l < turn->layers.size(); ++l) {
    const ScoreMatrix& sc = turn->layers[l].history_score;
    const int n = parent.layers[l].tokens();
    if (sc.given() && sc.cols != n) {
      return absl::InvalidArgumentError(absl::StrCat("layer.", l, ".history.score: ", sc.cols,
                                                     " tokens, expected the parent's ", n, " (its tokens per head)"));
    }
  }
  const int64_t end = NextPosition(parent);
  if (turn->prompt_pos0 && *turn->prompt_pos0 < end) {
    return absl::InvalidArgumentError(absl::StrCat("prompt_pos0: ", *turn->prompt_pos0, ", expected >= ", end,
                                                   " (where the parent ended), or unset to continue there"));
  }
  if (!turn->prompt_pos0) turn->prompt_pos0 = end;
  for (size_t l = 0; l < turn->layers.size(); ++l) {
    absl::Status s = SetHistoryFromMessage(parent, static_cast<int>(l), l0.prompt_k.dtype(), &turn->layers[l]);
    if (!s.ok()) return s;
  }
  turn->history_anchors = parent.anchor_pos;
  turn->first_agent = false;  // a turn on a parent continues the chain
  return absl::OkStatus();
}

}  // namespace kvrelay
