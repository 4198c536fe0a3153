#include "core/dtype.h"

#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace kvrelay {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace

size_t DTypeSize(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
  }
  return "?";
}

std::optional<DType> ParseDType(absl::string_view name) {
  if (name == "F32") return DType::kF32;
  if (name == "F16") return DType::kF16;
  if (name == "BF16") return DType::kBF16;
  return std::nullopt;
}

uint16_t FloatToBf16(float f) {
  uint32_t u = Bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}


uint16_t FloatToF16(float f) {
  const uint32_t u = Bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u | static_cast<uint16_t>((a >> 13) & 0x3ffu);
  if (a >= 0x47800000u) {
    // |f| >= 65536 (or inf): inf. Values in [65520, 65536) round to inf below.
    return sign | 0x7c00u;
  }
  if (a >= 0x38800000u) {  // normal f16 range: |f| >= 2^-14
    uint32_t m = a - 0x38000000u;  // rebias exponent 127 -> 15
    m += 0xfffu + ((m >> 13) & 1u);
    if (m >= 0x0f800000u) return sign | 0x7c00u;  // rounded up past 65504
    return sign | static_cast<uint16_t>(m >> 13);
  }
  // Subnormal f16 (or zero): value = mant * 2^-24.
  const int exp = static_cast<int>(a >> 23);
  if (exp < 102) return sign;  // < 2^-25: rounds to zero (2^-25 exactly ties to even 0)
  const uint32_t mant = (a & 0x7fffffu) | 0x800000u;  // 24-bit significand
  const int shift = 126 - exp;                          // 14..24
  uint32_t q = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return sign | static_cast<uint16_t>(q);
}

float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;  // 2^-24
    return sign ? -v : v;
  }
  if (exp == 31) return FromBits(sign | 0x7f800000u | (mant << 13));
  return FromBits(sign | ((exp + 112u) << 23) | (mant << 13));
}

void ToFloat(DType dtype, const void* src, float* dst, size_t n) {
  if (n == 0) return;  // an empty tensor's data may be null (memcpy would be UB)
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::kBF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) {
        const uint32_t u = static_cast<uint32_t>(s[i]) << 16;
        std::memcpy(dst + i, &u, sizeof u);
      }
      return;
    }
    case DType::kF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      size_t i = 0;
#if defined(__F16C__)
      for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
      }
#endif
      for (; i < n; ++i) dst[i] = F16ToFloat(s[i]);
      return;
    }
  }
}

void FromFloat(DType dtype, const float* src, void* dst, size_t n) {
  if (n == 0) return;
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::kBF16: {
      // Branch-free form of FloatToBf16, so the loop vectorizes.
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) {
        uint32_t u;
        std::memcpy(&u, src + i, sizeof u);
        const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
        const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        const uint32_t quiet = (u >> 16) | 0x40u;
        d[i] = static_cast<uint16_t>(nan ? quiet : rounded);
      }
      return;
    }
    case DType::kF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      size_t i = 0;
#if defined(__F16C__)
      for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), h);
      }
#endif
      for (; i < n; ++i) d[i] = FloatToF16(src[i]);
      return;
    }
  }
}

void FromFloatSaturating(DType dtype, float* src, void* dst, size_t n) {
  float limit = 0;
  if (dtype == DType::kF16) limit = 65504.0f;
  if (dtype == DType::kBF16) limit = 0x1.fep127f;  // largest finite BF16
  if (limit > 0) {
    for (size_t i = 0; i < n; ++i) src[i] = src[i] < -limit ? -limit : (src[i] > limit ? limit : src[i]);
  }
  FromFloat(dtype, src, dst, n);
}

}  // namespace kvrelay
