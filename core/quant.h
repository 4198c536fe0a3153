// Asymmetric min-max quantization of message K/V (KIVI-style), BRIEF §4.
//
// Keys: statistics per (head, channel) over groups of `group` consecutive
// tokens (the last group may be shorter). Values: statistics per (head,
// token) over all channels. With `rotate`, every row is first multiplied by
// the orthonormal Walsh-Hadamard matrix H/sqrt(dim) (its own inverse), which
// spreads outlier channels before 4- or 2-bit quantization.
//
// For a statistic block with minimum lo and maximum hi, the stored fp16
// zero z is lo rounded toward -inf, and the stored fp16 scale s is
// (hi - z) / (2^bits - 1) rounded toward +inf (at least the smallest fp16
// subnormal). Code c = clamp(round((x - z) / s), 0, 2^bits - 1); decoding
// gives c * s + z. So the reconstruction error of every element is at most
// s/2 (in the rotated domain when rotating), up to f32 rounding.
//
// Pure functions, thread-safe.
#ifndef KVRELAY_CORE_QUANT_H_
#define KVRELAY_CORE_QUANT_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/message.h"
#include "core/tensor.h"

namespace kvrelay {

// The largest key token group: as many tokens as a part may hold.
inline constexpr int kMaxQuantGroup = 1 << 24;

struct QuantOptions {
  QuantScheme scheme = QuantScheme::kInt;
  int bits = 4;       // int: 8, 4 or 2; lloyd: 1 to 4
  int group = 32;     // key token group size, 1..kMaxQuantGroup (lloyd: keys_channel only)
  bool rotate = false;  // int only, with 4 or 2 bits; REQUIRES power-of-two head_dim
  bool keys_channel = false;  // lloyd: keys per channel and token group (core/lloyd.h)
  uint64_t seed = 1;          // lloyd: the rotation's seed
  // lloyd: the values' bits when they differ from the keys' `bits` (a
  // per-layer allocation, lloyd:layers=); 0: `bits`.
  int v_bits = 0;
};

// InvalidArgument naming the option when `opts` cannot apply to rows of
// `head_dim` channels: bits not in {2,4,8} (lloyd: 1..4, and v_bits 0 or
// 1..4; v_bits other than 0 with int; lloyd needs a
// power-of-two head_dim), group outside 1..kMaxQuantGroup,
// head_dim < 1, rotate with 8 bits, rotate with a head_dim that is not a
// power of two, or head_dim*bits not a multiple of 8. The message starts
// "quant: " and names the option ("quant: group: 0, expected 1..16777216").
absl::Status ValidateQuantOptions(const QuantOptions& opts, int head_dim);

// The quantization a message header carries on the wire (relay.proto
// MessageHeader: quant_bits != 0, quant_group, quant_rotate, head_dim),
// checked by the rules of ValidateQuantOptions on the unsigned values, before
// anything is narrowed to int. InvalidArgument naming the field as `field`
// followed by quant_bits, quant_group, quant_rotate or head_dim
// ("header.quant_group: 4294967295, expected 1..16777216").
absl::StatusOr<QuantOptions> QuantOptionsFromHeader(uint32_t bits, uint32_t group, bool rotate, uint32_t head_dim,
                                                    absl::string_view field);
// The same for a header that also names the scheme (quant_scheme) and, for
// lloyd, keys_channel (quant_keys_channel) and the seed; `group` is then
// checked only with keys_channel.
absl::StatusOr<QuantOptions> QuantOptionsFromHeader(QuantScheme scheme, uint32_t bits, uint32_t group, bool rotate,
                                                    bool keys_channel, uint64_t seed, uint32_t head_dim,
                                                    absl::string_view field);

// The options a quantized layer was made with.
QuantOptions OptionsOf(const QuantizedKv& q);

// Quantizes a layer's keys and values ([heads, tokens, dim] each, any
// dtype; the result records k's dtype). InvalidArgument if options are bad,
// the shapes differ, an element is inf or NaN (before or after rotation),
// or a statistic (zero or scale) does not fit in fp16; the message names
// the tensor ("k" or "v"), the head and the offending value. Zero tokens
// give empty codes and statistics.
absl::StatusOr<QuantizedKv> QuantizeKv(const KvTensor& k, const KvTensor& v,
                                       const QuantOptions& opts);

// InvalidArgument describing the first mismatch unless `q` is consistent
// (its options valid for `dim`, ValidateQuantOptions) and its K and V
// hold [heads, tokens, dim] with the codes, scales and zeros its scheme
// needs.
absl::Status CheckQuantizedShape(const QuantizedKv& q, int heads, int tokens, int dim);

// Decodes into dense tensors of `dtype` (f32, f16 or bf16), rounding to
// nearest even. REQUIRES: `q` came from QuantizeKv (shapes consistent;
// checked, InvalidArgument if not, and then *k and *v are untouched).
// Outputs that already have `dtype` and the right shape are overwritten in
// place, without reallocating.
absl::Status DequantizeKv(const QuantizedKv& q, DType dtype, KvTensor* k, KvTensor* v);

// Replaces every quantized or demoting layer of `msg` by its dense form
// (DecodeLayer: K/V in `dtype`, demoted tokens merged into the kept ones),
// so that n_kept grows by n_demoted and n_demoted becomes 0, and recomputes
// msg->sent_bytes as the sum of MessageLayer::SentBytes(). msg->dtype and
// full_bytes are left as they are. On error (the message names the layer)
// `msg` is unchanged.
absl::Status DequantizeMessage(Message* msg, DType dtype);

// Whether agents receive `msg` decoded (DecodedMessage): it holds lloyd
// codes or demoted tokens, which only relays read (relay.proto,
// MessageHeader.quant_scheme).
bool AgentsReceiveDecoded(const Message& msg);

// A dense copy of `msg` as DequantizeMessage makes it, K/V in msg.dtype,
// without acc (agents do not receive it). InvalidArgument naming the layer
// when a layer does not decode.
absl::StatusOr<Message> DecodedMessage(const Message& msg);

// In-place orthonormal Walsh-Hadamard transform of n floats.
// REQUIRES: n is a power of two.
void HadamardTransform(float* x, int n);

// The unnormalized transform H_n x times `scale` (HadamardTransform is
// scale = 1/sqrt(n)), in one pass. REQUIRES: n is a power of two.
void HadamardTransformScaled(float* x, int n, float scale);

}  // namespace kvrelay

#endif  // KVRELAY_CORE_QUANT_H_
