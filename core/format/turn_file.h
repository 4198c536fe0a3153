// Turns and messages as safetensors files (docs/FORMAT.md).
//
// Turn tensors: layer.{l}.prompt.k/.v, layer.{l}.gen.k/.v [H, n, d] (F32, F16
// or BF16, all the same), layer.{l}.prompt.score [S, n_prompt] F32, and
// optionally layer.{l}.history.k/.v [H, n_history, d] with
// layer.{l}.history.pos [H, n_history] I32. Metadata: first_agent
// ("true"/"false", default "true"), prompt_pos0 (decimal, default
// n_history).
//
// Message tensors: layer.{l}.k/.v [H, n, d] in the message dtype, or their
// packed form layer.{l}.k.codes/.k.scale/.k.zero/.v.codes/.v.scale/.v.zero,
// layer.{l}.pos [H, n] I32, and optionally layer.{l}.acc [H, n] F32.
// Metadata: format = kvrelay.message.v2, policy, dtype, n_history, n_anchor,
// n_kept, n_gen, full_bytes, sent_bytes, next_pos, anchor_pos, granularity
// (h2o-auto), attention_error (turns with queries), and quant_bits,
// quant_group, quant_rotate when quantized. Version 1 files are read too.
//
// Readers return InvalidArgument for malformed files, naming the tensor or
// metadata key, what was expected and what was found, e.g.
// "layer.2.prompt.score: dtype BF16, expected F32". File variants prefix the
// message with the path. Writers are deterministic (tensors layer by layer,
// in the order of the tables in docs/FORMAT.md).
//
// All functions are thread-safe (no shared state).
#ifndef KVRELAY_CORE_FORMAT_TURN_FILE_H_
#define KVRELAY_CORE_FORMAT_TURN_FILE_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/format/safetensors.h"
#include "core/message.h"
#include "core/turn.h"

namespace kvrelay {

// The value of the "format" metadata key of every message file written.
inline constexpr char kMessageFormat[] = "kvrelay.message.v2";
// The format before acc and anchor_pos; still read (acc = 0, anchors of
// the file's own anchor part).
inline constexpr char kMessageFormatV1[] = "kvrelay.message.v1";

// True when `file` carries a message format (v2 or v1), not a turn.
bool IsMessageFile(const SafetensorsReader& file);

// ---- Turns ----

struct TurnFileOptions {
  // The turn is to be composed on a parent (ComposeOnParent, a publish
  // with parent_id): layer.{l}.history.score may then come without history
  // tensors. It covers the parent's tokens, [S, the parent's tokens per
  // head], so its shape and values are checked when composed (every other
  // rule is checked here).
  bool on_parent = false;
};

// Builds a Turn from parsed tensors: enforces the naming rules (layers
// 0..L-1 without gaps, only known names, history in all layers or none,
// history.pos with history), the dtype rules (K/V F32/F16/BF16 all alike,
// score F32, pos I32), the tensor ranks, the metadata (first_agent,
// prompt_pos0), then ValidateTurn (shapes, finiteness, score signs).
// A turn without history gets history tensors of shape [H, 0, d] / [H, 0].
absl::StatusOr<Turn> TurnFromSafetensors(const SafetensorsReader& file, const TurnFileOptions& options = {});
// Parses `bytes` (a whole safetensors file) as a turn.
absl::StatusOr<Turn> ReadTurn(absl::Span<const uint8_t> bytes, const TurnFileOptions& options = {});
// Reads the file at `path` as a turn.
absl::StatusOr<Turn> ReadTurnFile(const std::string& path, const TurnFileOptions& options = {});

// Serializes `turn` into `*out` (replacing its contents). ValidateTurn runs
// first and its error is returned. History tensors are written only when
// n_history > 0; prompt_pos0 is written only when set.
absl::Status WriteTurn(const Turn& turn, std::string* out);
// Same bytes, streamed to the file at `path`.
absl::Status WriteTurnFile(const Turn& turn, const std::string& path);

// ---- Messages ----

// Builds a Message from parsed tensors, checking the metadata (format,
// dtype, token counts, byte counts, quantization keys), the tensor names,
// dtypes and shapes, that every layer holds n_history + n_anchor + n_kept +
// n_gen tokens per head, that sent_bytes matches the tensors, and that
// next_pos (optional: files before the key read as 1 + the largest position
// id held) is at least 1 + every position id held.
absl::StatusOr<Message> MessageFromSafetensors(const SafetensorsReader& file);
absl::StatusOr<Message> ReadMessage(absl::Span<const uint8_t> bytes);
absl::StatusOr<Message> ReadMessageFile(const std::string& path);

// Serializes `msg` into `*out` (replacing its contents). InvalidArgument when
// it has no layers, when layers disagree (shapes, dtypes, quantized or not,
// quantization options), when a layer is inconsistent in itself, or when
// its token counts do not add up to the layers' tokens. sent_bytes and
// full_bytes are written as given; next_pos as NextPosition(msg).
absl::Status WriteMessage(const Message& msg, std::string* out);
// Same bytes, streamed to the file at `path`.
absl::Status WriteMessageFile(const Message& msg, const std::string& path);

// The bytes WriteMessage writes, without copying the tensors: the
// safetensors header, then views of the message's own buffers in file
// order (K, V or their packed parts, and positions, layer by layer). The
// views are valid while `msg` is alive and unchanged.
struct MessagePieces {
  std::string header;
  std::vector<absl::Span<const uint8_t>> tensors;
  uint64_t size() const;  // header + tensors
};
// Same errors as WriteMessage.
absl::StatusOr<MessagePieces> SerializeMessagePieces(const Message& msg);

}  // namespace kvrelay

#endif  // KVRELAY_CORE_FORMAT_TURN_FILE_H_
