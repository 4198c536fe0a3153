// Element types of KV tensors and their conversions.
//
// All conversions to a narrower type round to nearest, ties to even, and are
// exact whenever the value is representable. NaN stays NaN (quiet), infinities
// stay infinities; a finite f32 beyond the f16 range becomes +-inf, as IEEE
// rounding requires. All functions are thread-safe (pure).
#ifndef KVRELAY_CORE_DTYPE_H_
#define KVRELAY_CORE_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include "absl/strings/string_view.h"

namespace kvrelay {

enum class DType : uint8_t { kF32, kF16, kBF16 };

// Bytes per element: 4, 2, 2.
size_t DTypeSize(DType dtype);

// The safetensors name: "F32", "F16", "BF16".
absl::string_view DTypeName(DType dtype);

// Inverse of DTypeName; nullopt for any other string.
std::optional<DType> ParseDType(absl::string_view name);

uint16_t FloatToBf16(float f);
inline float Bf16ToFloat(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
uint16_t FloatToF16(float f);
float F16ToFloat(uint16_t h);

// Converts `n` elements stored as `dtype` at `src` to f32.
void ToFloat(DType dtype, const void* src, float* dst, size_t n);
// Converts `n` f32 values to `dtype` at `dst`, rounding as described above.
void FromFloat(DType dtype, const float* src, void* dst, size_t n);
// As FromFloat, but first clamps src[0..n) in place to the dtype's finite
// range, so that a decoded value just past it (within a quantization cell)
// becomes the largest finite value instead of an infinity.
void FromFloatSaturating(DType dtype, float* src, void* dst, size_t n);

}  // namespace kvrelay

#endif  // KVRELAY_CORE_DTYPE_H_
