// Dense tensors of the data model.
//
// KvTensor holds one part's keys or values for one layer: row-major
// [heads, tokens, dim], stored in its own dtype (f32, f16 or bf16), so that
// rows can be copied bit-exactly. Not thread-safe for concurrent mutation;
// concurrent const access is safe.
#ifndef KVRELAY_CORE_TENSOR_H_
#define KVRELAY_CORE_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <utility>
#include <vector>

#include "absl/types/span.h"
#include "core/dtype.h"

namespace kvrelay {

namespace internal {
// Leaves elements uninitialized on resize (std::vector value-initializes).
template <typename T>
struct DefaultInitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  DefaultInitAllocator() = default;
  template <typename U>
  DefaultInitAllocator(const DefaultInitAllocator<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
}  // namespace internal

class KvTensor {
 public:
  KvTensor() = default;
  // Zero-filled tensor. REQUIRES: heads, tokens, dim >= 0.
  KvTensor(DType dtype, int heads, int tokens, int dim) : KvTensor(dtype, heads, tokens, dim, 0) {
    if (!data_.empty()) std::memset(data_.data(), 0, data_.size());
  }
  // A tensor whose contents are unspecified until written: for outputs that
  // are overwritten completely, without paying for zero-filling.
  static KvTensor Uninitialized(DType dtype, int heads, int tokens, int dim) {
    return KvTensor(dtype, heads, tokens, dim, 0);
  }

  DType dtype() const { return dtype_; }
  int heads() const { return heads_; }
  int tokens() const { return tokens_; }
  int dim() const { return dim_; }
  size_t elements() const { return static_cast<size_t>(heads_) * tokens_ * dim_; }
  size_t row_bytes() const { return static_cast<size_t>(dim_) * DTypeSize(dtype_); }
  size_t byte_size() const { return data_.size(); }

  // REQUIRES: 0 <= h < heads(), 0 <= t < tokens().
  const uint8_t* row(int h, int t) const { return data_.data() + RowOffset(h, t); }
  uint8_t* row(int h, int t) { return data_.data() + RowOffset(h, t); }

  absl::Span<const uint8_t> bytes() const { return data_; }
  absl::Span<uint8_t> mutable_bytes() { return absl::MakeSpan(data_); }

  // Reads row (h, t) as dim() floats into `out`.
  void ReadRow(int h, int t, float* out) const { ToFloat(dtype_, row(h, t), out, dim_); }
  // Converts rows (h, t) .. (h, t + count - 1), count * dim() floats, to `out`.
  // REQUIRES: t + count <= tokens().
  void ReadRows(int h, int t, int count, float* out) const {
    ToFloat(dtype_, row(h, t), out, static_cast<size_t>(count) * dim_);
  }
  // Writes dim() floats from `in` to row (h, t), rounding to dtype().
  void WriteRow(int h, int t, const float* in) { FromFloat(dtype_, in, row(h, t), dim_); }
  // Copies row (src_h, src_t) of `src` to row (h, t). REQUIRES: same dtype and dim.
  void CopyRow(int h, int t, const KvTensor& src, int src_h, int src_t) {
    std::memcpy(row(h, t), src.row(src_h, src_t), row_bytes());
  }

  bool SameShape(const KvTensor& o) const {
    return heads_ == o.heads_ && tokens_ == o.tokens_ && dim_ == o.dim_;
  }
  bool operator==(const KvTensor& o) const {
    return dtype_ == o.dtype_ && SameShape(o) && data_ == o.data_;
  }

 private:
  KvTensor(DType dtype, int heads, int tokens, int dim, int /*uninitialized*/)
      : dtype_(dtype), heads_(heads), tokens_(tokens), dim_(dim),
        data_(static_cast<size_t>(heads) * tokens * dim * DTypeSize(dtype)) {}

  size_t RowOffset(int h, int t) const {
    return (static_cast<size_t>(h) * tokens_ + t) * row_bytes();
  }

  DType dtype_ = DType::kF32;
  int heads_ = 0;
  int tokens_ = 0;
  int dim_ = 0;
  std::vector<uint8_t, internal::DefaultInitAllocator<uint8_t>> data_;
};

// Position ids, row-major [heads, tokens].
struct PosTensor {
  int heads = 0;
  int tokens = 0;
  std::vector<int32_t> data;

  PosTensor() = default;
  PosTensor(int h, int t) : heads(h), tokens(t), data(static_cast<size_t>(h) * t) {}
  int32_t& at(int h, int t) { return data[static_cast<size_t>(h) * tokens + t]; }
  int32_t at(int h, int t) const { return data[static_cast<size_t>(h) * tokens + t]; }
  bool operator==(const PosTensor& o) const {
    return heads == o.heads && tokens == o.tokens && data == o.data;
  }
};

// Attention scores, row-major [rows, cols] f32.
struct ScoreMatrix {
  int rows = 0;
  int cols = 0;
  std::vector<float> data;

  ScoreMatrix() = default;
  ScoreMatrix(int r, int c) : rows(r), cols(c), data(static_cast<size_t>(r) * c) {}
  float& at(int r, int c) { return data[static_cast<size_t>(r) * cols + c]; }
  float at(int r, int c) const { return data[static_cast<size_t>(r) * cols + c]; }

  // True when the matrix was supplied at all, even with a zero extent
  // (e.g. [S, 0] scores for an empty history): any extent or any data.
  bool given() const { return rows > 0 || cols > 0 || !data.empty(); }
};

}  // namespace kvrelay

#endif  // KVRELAY_CORE_TENSOR_H_
