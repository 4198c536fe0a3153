#include "core/internal/gather.h"

#include <cstring>
#include <vector>

#include "core/tensor.h"
#include "gtest/gtest.h"

namespace kvrelay {
namespace internal {
namespace {

// A tensor whose every byte tells where it came from.
KvTensor Filled(int heads, int tokens, int dim, uint8_t tag) {
  KvTensor t(DType::kBF16, heads, tokens, dim);
  absl::Span<uint8_t> b = t.mutable_bytes();
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint8_t>(tag + i * 7 + i / 251);
  return t;
}

// Runs of consecutive rows (one copy each), scattered rows, a run that
// ends where the next tensor starts at the following row number, and a
// repeated row: the result is what row-by-row copies give.
TEST(GatherHeadRowsTest, RunsAndScatteredRowsMatchRowByRowCopies) {
  constexpr int kHeads = 3, kDim = 16;
  const KvTensor ak = Filled(kHeads, 40, kDim, 1), av = Filled(kHeads, 40, kDim, 2);
  const KvTensor bk = Filled(kHeads, 12, kDim, 3), bv = Filled(kHeads, 12, kDim, 4);
  std::vector<RowSource> src;
  for (int r = 0; r < 30; ++r) src.push_back({&ak, &av, r});        // one run
  for (int r : {33, 31, 39, 39, 2}) src.push_back({&ak, &av, r});   // scattered, repeated
  for (int r = 3; r < 12; ++r) src.push_back({&bk, &bv, r});        // the next tensor, row 3 after row 2
  src.push_back({&ak, &av, 12});
  const int n = static_cast<int>(src.size());
  for (int h = 0; h < kHeads; ++h) {
    KvTensor k = KvTensor::Uninitialized(DType::kBF16, kHeads, n, kDim);
    KvTensor v = KvTensor::Uninitialized(DType::kBF16, kHeads, n, kDim);
    KvTensor want_k(DType::kBF16, kHeads, n, kDim), want_v(DType::kBF16, kHeads, n, kDim);
    GatherHeadRows(src, h, &k, &v);
    for (int t = 0; t < n; ++t) {
      want_k.CopyRow(h, t, *src[t].k, h, src[t].row);
      want_v.CopyRow(h, t, *src[t].v, h, src[t].row);
      ASSERT_EQ(std::memcmp(k.row(h, t), want_k.row(h, t), k.row_bytes()), 0) << "head " << h << " row " << t;
      ASSERT_EQ(std::memcmp(v.row(h, t), want_v.row(h, t), v.row_bytes()), 0) << "head " << h << " row " << t;
    }
  }
}

}  // namespace
}  // namespace internal
}  // namespace kvrelay
