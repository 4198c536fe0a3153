// A message's layers as dense K/V, and a turn composed on a parent
// message: what an agent receives (quantized layers decoded, demoted tokens
// merged back by position) and what a child turn's history holds.
//
// Pure functions, thread-safe.
#ifndef KVRELAY_CORE_HISTORY_H_
#define KVRELAY_CORE_HISTORY_H_

#include "absl/status/status.h"
#include "core/dtype.h"
#include "core/message.h"
#include "core/turn.h"

namespace kvrelay {

// `layer` (index `l`) of a message with the token counts and head_dim of
// `msg` decoded to dense K/V of `dtype` in `*out`, the
// demoted tokens merged into each head's kept prompt tokens by ascending
// position (with their pos and acc): what an agent receives. A dense layer
// without demoted tokens is copied. InvalidArgument naming the layer when
// the codes do not decode. (`layer` need not be one of msg.layers.)
absl::Status DecodeLayer(const MessageLayer& layer, int l, const Message& msg, DType dtype, MessageLayer* out);

// The history part of the geometry of a turn composed on `parent` (as a
// relay composes it): n_history = the parent's tokens per head,
// history_anchors = its anchor_pos, history_acc (its acc, or zeros).
void SetHistoryGeometry(const Message& parent, TurnGeometry* geo);

// Layer l of `parent` as the history of `layer`, as a relay composes a
// child turn: K and V (quantized layers decoded into `dtype`), positions,
// and acc (zeros when the parent has none). The turn's history_anchors
// must be parent.anchor_pos. InvalidArgument when decoding fails.
// REQUIRES: 0 <= l < parent.layers.size().
absl::Status SetHistoryFromMessage(const Message& parent, int l, DType dtype, TurnLayer* layer);

// Makes `parent` the history of `turn`, as a relay does for a publish with
// parent_id: every layer by SetHistoryFromMessage, history_anchors =
// parent.anchor_pos, first_agent = false (no anchors of its own: the chain
// has them), and prompt_pos0 = NextPosition(parent) when unset.
// A layer's history_score, when given, covers the parent's tokens: [S,
// the parent's tokens per head] (the values are checked with the composed
// turn). InvalidArgument when the turn has history of its own, its layers,
// KV heads, head_dim or dtype differ from the parent's, a history_score
// has another number of tokens, or an explicit prompt_pos0 is before
// NextPosition(parent).
absl::Status ComposeOnParent(const Message& parent, Turn* turn);

}  // namespace kvrelay

#endif  // KVRELAY_CORE_HISTORY_H_
