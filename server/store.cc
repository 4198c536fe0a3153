#include "server/store.h"

#include "server/assembler.h"

namespace kvrelay {

uint64_t RetainedBytes(uint64_t sent_bytes, uint64_t layers) {
  return sent_bytes + kMessageOverheadBytes + kLayerOverheadBytes * layers;
}

}  // namespace kvrelay
