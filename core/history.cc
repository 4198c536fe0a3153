#include "core/history.h"

#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/quant.h"
#include "core/status_macros.h"

namespace kvrelay {

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
