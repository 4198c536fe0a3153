#include "core/message.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/quant.h"
#include "core/status_macros.h"

namespace kvrelay {

std::string FormatLayerBits(const std::vector<std::pair<int, int>>& bits) {
  return absl::StrJoin(bits, ".", [](std::string* o, const std::pair<int, int>& b) {
    absl::StrAppend(o, b.first, b.second);
  });
}

absl::StatusOr<std::vector<std::pair<int, int>>> ParseLayerBits(absl::string_view text) {
  std::vector<std::pair<int, int>> out;
  for (absl::string_view e : absl::StrSplit(text, '.')) {
    if (e.size() != 2 || e[0] < '1' || e[0] > '4' || e[1] < '1' || e[1] > '4') {
      return absl::InvalidArgumentError(absl::StrCat("entry '", e, "' of layer ", out.size(),
                                                     ", expected two digits 1..4 (keys' bits, values' bits) per "
                                                     "layer joined by '.', e.g. 43.32.44"));
    }
    out.emplace_back(e[0] - '0', e[1] - '0');
  }
  return out;
}

QuantizedSizes QuantizedSizesOf(QuantScheme scheme, int bits, int group, bool keys_channel, bool is_key,
                                uint64_t heads, uint64_t tokens, uint64_t dim) {
  QuantizedSizes s;
  s.codes = heads * tokens * (dim * static_cast<uint64_t>(bits) / 8);
  const bool per_row = !is_key || (scheme == QuantScheme::kLloyd && !keys_channel);
  const uint64_t groups = per_row || tokens == 0 || group < 1 ? 0 : (tokens - 1) / static_cast<uint64_t>(group) + 1;
  s.scales = per_row ? heads * tokens : heads * groups * dim;
  // lloyd keeps a mean only for keys per channel.
  s.zeros = scheme == QuantScheme::kLloyd && per_row ? 0 : s.scales;
  return s;
}

uint64_t MessageLayer::SentBytes() const {
  uint64_t payload;
  if (quant.has_value()) {
    payload = quant->k.ByteSize() + quant->v.ByteSize();
  } else {
    payload = static_cast<uint64_t>(k.byte_size()) + v.byte_size();
  }
  if (demoted.has_value()) payload += demoted->k.ByteSize() + demoted->v.ByteSize();
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

absl::Status DecodeLayer(const MessageLayer& p, int l, const Message& msg, DType dtype, MessageLayer* out) {
  const int heads = p.pos.heads, total = p.pos.tokens, nd = p.demoted_tokens(), n = total - nd;
  KvTensor k, v;
  if (p.quant) {
    if (absl::Status s = DequantizeKv(*p.quant, dtype, &k, &v); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("layer.", l, ": ", s.message()));
    }
  } else if (p.k.dtype() == dtype) {
    k = p.k;
    v = p.v;
  } else {
    k = KvTensor::Uninitialized(dtype, p.k.heads(), p.k.tokens(), p.k.dim());
    v = KvTensor::Uninitialized(dtype, p.v.heads(), p.v.tokens(), p.v.dim());
    std::vector<float> row(p.k.dim());
    for (int h = 0; h < p.k.heads(); ++h) {
      for (int t = 0; t < p.k.tokens(); ++t) {
        p.k.ReadRow(h, t, row.data());
        k.WriteRow(h, t, row.data());
        p.v.ReadRow(h, t, row.data());
        v.WriteRow(h, t, row.data());
      }
    }
  }
  MessageLayer d;
  d.granularity = p.granularity;
  d.attention_error = p.attention_error;
  if (nd == 0) {
    d.k = std::move(k);
    d.v = std::move(v);
    d.pos = p.pos;
    d.acc = p.acc;
    *out = std::move(d);
    return absl::OkStatus();
  }
  KvTensor dk, dv;
  if (absl::Status s = DequantizeKv(*p.demoted, dtype, &dk, &dv); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("layer.", l, ".demoted: ", s.message()));
  }
  const int dim = msg.head_dim;
  d.k = KvTensor::Uninitialized(dtype, heads, total, dim);
  d.v = KvTensor::Uninitialized(dtype, heads, total, dim);
  d.pos = PosTensor(heads, total);
  if (!p.acc.empty()) d.acc.resize(p.acc.size());
  const int kept0 = msg.n_history + msg.n_anchor, kept1 = kept0 + msg.n_kept;
  const size_t row_bytes = static_cast<size_t>(dim) * DTypeSize(dtype);
  for (int h = 0; h < heads; ++h) {
    const int32_t* pos = p.pos.data.data() + static_cast<size_t>(h) * total;
    int32_t* opos = d.pos.data.data() + static_cast<size_t>(h) * total;
    int t = 0;
    auto put = [&](const KvTensor& sk, const KvTensor& sv, int row, int src_index) {
      std::memcpy(d.k.row(h, t), sk.row(h, row), row_bytes);
      std::memcpy(d.v.row(h, t), sv.row(h, row), row_bytes);
      opos[t] = pos[src_index];
      if (!p.acc.empty()) {
        d.acc[static_cast<size_t>(h) * total + t] = p.acc[static_cast<size_t>(h) * total + src_index];
      }
      ++t;
    };
    for (int i = 0; i < kept0; ++i) put(k, v, i, i);
    int a = kept0, b = 0;  // merge kept [kept0, kept1) with demoted [0, nd)
    while (a < kept1 || b < nd) {
      if (b >= nd || (a < kept1 && pos[a] < pos[n + b])) {
        put(k, v, a, a);
        ++a;
      } else {
        put(dk, dv, b, n + b);
        ++b;
      }
    }
    for (int i = kept1; i < n; ++i) put(k, v, i, i);
  }
  *out = std::move(d);
  return absl::OkStatus();
}

absl::Status SetHistoryFromMessage(const Message& parent, int l, DType dtype, TurnLayer* layer) {
  MessageLayer p;
  KVRELAY_RETURN_IF_ERROR(DecodeLayer(parent.layers[l], l, parent, dtype, &p));
  layer->history_pos = std::move(p.pos);
  layer->history_k = std::move(p.k);
  layer->history_v = std::move(p.v);
  layer->history_acc = ScoreMatrix(layer->history_pos.heads, layer->history_pos.tokens);
  if (!p.acc.empty()) layer->history_acc.data = std::move(p.acc);
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
