// Gathering kept K/V rows into a message layer (internal to kvrelay_core).
#ifndef KVRELAY_CORE_INTERNAL_GATHER_H_
#define KVRELAY_CORE_INTERNAL_GATHER_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "absl/types/span.h"
#include "core/tensor.h"

namespace kvrelay {
namespace internal {

// One row to copy: row `row` of head h of the pair (k, v).
struct RowSource {
  const KvTensor* k;
  const KvTensor* v;
  int row;
};

// Copies head h's rows `src`, in order, into rows 0.. of head h of *out_k
// and *out_v, with the reads issued 8 rows ahead: kept rows are scattered
// through a turn far larger than the caches, so each copy would otherwise
// wait on memory. REQUIRES: every tensor has the same dtype and dim, and
// the outputs hold src.size() rows per head.
inline void GatherHeadRows(absl::Span<const RowSource> src, int h, KvTensor* out_k, KvTensor* out_v) {
  constexpr size_t kAhead = 8;  // rows in flight
  const size_t rb = out_k->row_bytes();
  auto prefetch = [&](const RowSource& s) {
    const uint8_t* k = s.k->row(h, s.row);
    const uint8_t* v = s.v->row(h, s.row);
    for (size_t off = 0; off < rb; off += 64) {
      __builtin_prefetch(k + off);
      __builtin_prefetch(v + off);
    }
  };
  for (size_t i = 0; i < std::min(kAhead, src.size()); ++i) prefetch(src[i]);
  uint8_t* kd = out_k->row(h, 0);
  uint8_t* vd = out_v->row(h, 0);
  for (size_t i = 0; i < src.size(); ++i) {
    if (i + kAhead < src.size()) prefetch(src[i + kAhead]);
    std::memcpy(kd + i * rb, src[i].k->row(h, src[i].row), rb);
    std::memcpy(vd + i * rb, src[i].v->row(h, src[i].row), rb);
  }
}

}  // namespace internal
}  // namespace kvrelay

#endif  // KVRELAY_CORE_INTERNAL_GATHER_H_
