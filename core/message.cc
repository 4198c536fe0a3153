#include "core/message.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
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

Accounting AccountingOf(const Message& m, uint64_t received, double compress_s, double commit_s) {
  Accounting a;
  a.received_bytes = received;
  a.full_bytes = m.full_bytes;
  a.sent_bytes = m.sent_bytes;
  a.ratio = m.Ratio();
  a.compress_seconds = compress_s;
  a.commit_seconds = commit_s;
  a.policy = m.policy;
  a.attention_error = m.attention_error;
  return a;
}

}  // namespace kvrelay
