#include "server/store.h"

#include "proto/stream_codec.h"

namespace kvrelay {

uint64_t RetainedBytes(uint64_t sent_bytes, uint64_t layers) {
  return sent_bytes + kMessageOverheadBytes + kLayerOverheadBytes * layers;
}

}  // namespace kvrelay
