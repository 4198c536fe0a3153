// The output of compression: the composed message M_i (BRIEF §2).
//
// Every layer holds [history; anchors; kept prompt; generated] in that order,
// per KV head, with the original position id of every token. Head-level
// selection keeps different positions per head but the same count, so the
// tensors stay rectangular.
#ifndef KVRELAY_CORE_MESSAGE_H_
#define KVRELAY_CORE_MESSAGE_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/tensor.h"
#include "core/turn.h"

namespace kvrelay {

// How codes map to values: min-max (core/quant.h) or rotated Lloyd-Max
// (core/lloyd.h).
enum class QuantScheme : uint8_t { kInt, kLloyd };

// One K or V tensor after quantization (see core/quant.h, core/lloyd.h).
struct QuantizedTensor {
  int bits = 0;             // int: 8, 4 or 2; lloyd: 1 to 4
  int heads = 0, tokens = 0, dim = 0;
  // Codes of row (h, t) packed little-endian, element i of a row in bits
  // [i*bits, (i+1)*bits) of the row's dim*bits/8 bytes. [heads, tokens, dim*bits/8]
  std::vector<uint8_t> codes;
  // fp16 bit patterns. int keys: [heads, groups, dim] (per channel, per
  // token group); int values: [heads, tokens] (per token, over channels).
  // lloyd rows: scale = the norms [heads, tokens], zero empty; lloyd
  // keys_channel: rms and mean, [heads, groups, dim].
  std::vector<uint16_t> scale;
  std::vector<uint16_t> zero;

  size_t ByteSize() const { return codes.size() + 2 * scale.size() + 2 * zero.size(); }
};

// The sizes of one quantized K or V tensor of [heads, tokens, dim]: code
// bytes, and fp16 scales and zeros (statistics). int keys: scale and zero
// per channel and token group; int values: per row; lloyd rows (either
// tensor): a norm per row, no zero; lloyd keys per channel: an rms and a
// mean per channel and token group. The one rule for the shape of a
// QuantizedTensor (checked by CheckQuantizedShape, allocated by the stream
// readers) and for its bytes on the wire (MessageLayerBytes). A group < 1
// (a header not yet checked) counts no groups.
struct QuantizedSizes {
  uint64_t codes = 0, scales = 0, zeros = 0;
  uint64_t Bytes() const { return codes + 2 * scales + 2 * zeros; }
};
QuantizedSizes QuantizedSizesOf(QuantScheme scheme, int bits, int group, bool keys_channel, bool is_key,
                                uint64_t heads, uint64_t tokens, uint64_t dim);

struct QuantizedKv {
  QuantScheme scheme = QuantScheme::kInt;
  int bits = 0;
  int group = 0;        // token group size of the key statistics
  bool rotate = false;  // int: Walsh-Hadamard rotation along head_dim before quantization
  bool keys_channel = false;  // lloyd: keys in channel form
  uint64_t seed = 0;          // lloyd: the rotation's seed
  int v_bits = 0;             // lloyd: the values' bits when not `bits`; 0: bits
  DType dtype = DType::kBF16;  // dtype that decoding restores by default
  QuantizedTensor k, v;

  int VBits() const { return v_bits ? v_bits : bits; }
};

// The granularity h2o-auto chose for a layer (docs/FORMAT.md, step 3a).
enum class Granularity : uint8_t { kNone, kHead, kLayer };

struct MessageLayer {
  KvTensor k, v;  // [kv_heads, n, head_dim]; empty (0 elements) when quantized
  // [kv_heads, n + n_demoted]: the main part's n tokens, then the demoted
  // ones (docs/FORMAT.md, step 6a).
  PosTensor pos;
  // Accumulated importance of every token, [kv_heads, n] row-major
  // (docs/FORMAT.md, step 5); empty means 0 everywhere (a message read from
  // a file or stream without it). Relay-side state: not sent to agents,
  // not counted in SentBytes.
  std::vector<float> acc;
  Granularity granularity = Granularity::kNone;  // set by h2o-auto only
  std::optional<QuantizedKv> quant;
  // The demoted tokens' K and V ([kv_heads, n_demoted, head_dim], lloyd row
  // form), when the policy demotes.
  std::optional<QuantizedKv> demoted;
  // The layer's fidelity figure (AttentionOutputError), for turns with
  // queries; never sent itself (the message's mean is).
  std::optional<double> attention_error;

  // Every token the layer holds, demoted ones included.
  int tokens() const { return pos.tokens; }
  int demoted_tokens() const { return demoted ? demoted->k.tokens : 0; }
  // Bytes this layer sends: K/V payload (dense, or codes + scales + zeros),
  // the demoted tokens' codes and norms, plus 4 bytes per position id.
  uint64_t SentBytes() const;
};

struct Message {
  std::string policy;  // canonical pipeline spec that produced the message
  DType dtype = DType::kBF16;
  int kv_heads = 0;
  int head_dim = 0;
  int n_history = 0, n_anchor = 0, n_kept = 0, n_gen = 0;  // tokens per head, per layer
  // Demoted tokens per head, per layer, after the others, and their bits
  // (0: none).
  int n_demoted = 0, demote_bits = 0;
  // Bytes `full` would send for the same turn (dense K/V in the turn's dtype
  // plus position ids), and bytes this message sends.
  uint64_t full_bytes = 0;
  uint64_t sent_bytes = 0;
  // Position id where the receiving agent's own tokens start: the end of the
  // relayed sequence, prompt_pos0 + n_prompt + n_gen of the turn (and at
  // least 1 + every position id held), even when the turn's last tokens were
  // evicted. 0 when unknown (a message built by hand); see NextPosition().
  int64_t next_pos = 0;
  // For a turn with queries: the mean over layers of the fidelity figure,
  // |o_msg - o_full| / |o_full| of the sender's own attention output
  // (docs/FORMAT.md, "Fidelity"). A proxy: the recipient's queries are not
  // known.
  std::optional<double> attention_error;
  // Position ids of the chain's anchors that the message holds (every head
  // of every layer holds each once), ascending.
  std::vector<int32_t> anchor_pos;
  std::vector<MessageLayer> layers;

  double Ratio() const { return sent_bytes ? static_cast<double>(full_bytes) / sent_bytes : 0.0; }
};

// Byte accounting of one message (relay.proto, Accounting): what a publish
// reports, a fetch delivers and a relay holds with the message.
struct Accounting {
  uint64_t received_bytes = 0;  // tensor bytes uploaded
  uint64_t full_bytes = 0;      // what `full` would send
  uint64_t sent_bytes = 0;      // what the message sends
  double ratio = 0;             // full_bytes / sent_bytes
  double compress_seconds = 0;  // worker time spent compressing
  double commit_seconds = 0;    // first request to visibility
  std::string policy;           // canonical spec that was applied
  // For a turn with queries: how much compression changed the sender's own
  // attention output (mean over layers of |o_msg - o_full| / |o_full|).
  std::optional<double> attention_error;
};

// The accounting of the composed `m` (its policy too) from an upload of
// `received` tensor bytes.
Accounting AccountingOf(const Message& m, uint64_t received, double compress_s, double commit_s);

// Per layer, the keys' and values' lloyd bits, as lloyd:layers= and the
// message metadata quant_layer_bits write them: two digits 1..4 per layer
// (keys, values) joined by '.', e.g. "43.32.44".
std::string FormatLayerBits(const std::vector<std::pair<int, int>>& bits);
// InvalidArgument naming the first bad entry and its layer ("entry '5' of
// layer 1, expected two digits 1..4 ...").
absl::StatusOr<std::vector<std::pair<int, int>>> ParseLayerBits(absl::string_view text);

// 1 + the largest position id held in any layer and head; 0 for a message
// that holds no token.
int64_t HeldEnd(const Message& msg);

// Where the receiver continues: max(msg.next_pos, HeldEnd(msg)).
int64_t NextPosition(const Message& msg);

// InvalidArgument unless msg.anchor_pos is ascending distinct ids >= 0,
// each held exactly once by every head of every layer (FirstUnorderedId,
// FindAnchorMiss). `field` names the list in the message ("metadata
// anchor_pos").
absl::Status CheckMessageAnchors(const Message& msg, absl::string_view field);

// "head" / "layer" / "" for Granularity::kHead / kLayer / kNone.
const char* GranularityName(Granularity g);

}  // namespace kvrelay

#endif  // KVRELAY_CORE_MESSAGE_H_
