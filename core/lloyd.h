// Rotated Lloyd-Max scalar quantization of K/V rows (docs/FORMAT.md, step 7b).
//
// Row form: each row x of d channels (d a power of two) is rotated by
// R = (H_d / sqrt(d)) diag(sigma), sigma the SplitMix64 signs of a seed,
// scaled by sqrt(d) / ||x|| (the norm stored as one fp16 per row), and each
// coordinate is replaced by the index of its cell in the fixed Lloyd-Max
// codebook of the standard normal distribution at 1 to 4 bits.
//
// Channel form (keys=channel): no rotation; per head, channel and token
// group the fp16 mean and rms, and the same codebook on (x - mean) / rms.
//
// Codes are packed as core/message.h's QuantizedTensor says (element i of a
// row in bits [i*bits, (i+1)*bits), least significant first; a 3-bit code
// may straddle two bytes). Row form: `scale` holds the norms [heads,
// tokens], `zero` is empty. Channel form: `scale` the rms and `zero` the
// mean, [heads, groups, dim].
//
// Pure functions, thread-safe.
#ifndef KVRELAY_CORE_LLOYD_H_
#define KVRELAY_CORE_LLOYD_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/message.h"
#include "core/tensor.h"

namespace kvrelay {

// The seed of the rotation when a policy names none.
inline constexpr uint64_t kDefaultLloydSeed = 1;

// The non-negative levels of the B-bit codebook, ascending (2^(B-1) of
// them; the others are their negatives). REQUIRES: 1 <= bits <= 4.
absl::Span<const float> LloydLevels(int bits);

// The signs sigma_i (+1 or -1) of a rotation of `dim` channels.
void LloydSigns(uint64_t seed, int dim, float* signs);

// Quantizes rows of `x` ([heads, tokens, dim], any dtype) in row form into
// `*q`. `tensor` names x in errors ("k", "v", "demoted.k"). InvalidArgument
// naming the tensor, head and token when a row holds NaN or Inf or its norm
// does not fit in fp16. REQUIRES: dim a power of two, dim*bits % 8 == 0,
// 1 <= bits <= 4.
absl::Status LloydQuantizeRows(const KvTensor& x, int bits, uint64_t seed, const char* tensor,
                               QuantizedTensor* q);

// Channel form over token groups of `group`. Errors as LloydQuantizeRows,
// naming the channel and token range for a mean or rms outside fp16.
absl::Status LloydQuantizeChannels(const KvTensor& x, int bits, int group, const char* tensor,
                                   QuantizedTensor* q);

// Decodes a row-form tensor into `out` (same shape, any dtype; rows
// rounded to nearest even, saturated to the dtype's finite range).
// REQUIRES: q consistent (CheckLloydTensor) and `out` of q's shape.
void LloydDecodeRows(const QuantizedTensor& q, uint64_t seed, KvTensor* out);
void LloydDecodeChannels(const QuantizedTensor& q, int group, KvTensor* out);

// InvalidArgument naming `name` unless q's codes, scale and zero have the
// sizes its shape, bits and form need.
absl::Status CheckLloydTensor(const QuantizedTensor& q, const char* name, int bits, bool channel, int group);

}  // namespace kvrelay

#endif  // KVRELAY_CORE_LLOYD_H_
