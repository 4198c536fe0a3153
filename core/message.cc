#include "core/message.h"

#include <algorithm>

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

}  // namespace kvrelay
