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
// and *out_v. A run of consecutive rows of the same tensors (a policy that
// keeps every token in order gives one run per tensor) is one copy. Rows
// that start a run are read 8 rows ahead: kept rows are scattered through a
// turn far larger than the caches, so each copy would otherwise wait on
// memory; the rows inside a run are sequential, which the hardware
// prefetches. REQUIRES: every tensor has the same dtype and dim, and the
// outputs hold src.size() rows per head.
inline void GatherHeadRows(absl::Span<const RowSource> src, int h, KvTensor* out_k, KvTensor* out_v) {
  constexpr size_t kAhead = 8;  // rows in flight
  const size_t rb = out_k->row_bytes();
  auto continues = [&](size_t i) {
    return i > 0 && src[i].k == src[i - 1].k && src[i].v == src[i - 1].v && src[i].row == src[i - 1].row + 1;
  };
  auto prefetch = [&](size_t i) {
    if (continues(i)) return;
    const uint8_t* k = src[i].k->row(h, src[i].row);
    const uint8_t* v = src[i].v->row(h, src[i].row);
    for (size_t off = 0; off < rb; off += 64) {
      __builtin_prefetch(k + off);
      __builtin_prefetch(v + off);
    }
  };
  for (size_t i = 0; i < std::min(kAhead, src.size()); ++i) prefetch(i);
  uint8_t* kd = out_k->row(h, 0);
  uint8_t* vd = out_v->row(h, 0);
  for (size_t i = 0; i < src.size();) {
    size_t end = i + 1;
    while (end < src.size() && continues(end)) ++end;
    for (size_t j = i + kAhead; j < std::min(end + kAhead, src.size()); ++j) prefetch(j);
    const size_t n = (end - i) * rb;
    std::memcpy(kd + i * rb, src[i].k->row(h, src[i].row), n);
    std::memcpy(vd + i * rb, src[i].v->row(h, src[i].row), n);
    i = end;
  }
}

}  // namespace internal
}  // namespace kvrelay

#endif  // KVRELAY_CORE_INTERNAL_GATHER_H_
