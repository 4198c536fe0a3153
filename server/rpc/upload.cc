#include "server/rpc/upload.h"

namespace kvrelay {

uint64_t DenseHistoryBytes(const UploadShape& shape, const StoredMessage& parent) {
  const uint64_t tokens = parent.msg.layers.empty() ? 0 : parent.msg.layers[0].tokens();
  return static_cast<uint64_t>(shape.layers) * shape.geo.kv_heads * tokens *
         (2ull * shape.geo.head_dim * DTypeSize(shape.geo.dtype) + 4);
}

}  // namespace kvrelay
