// Ancestor elision, both ends. When the destination relay holds an ancestor
// of a forwarded message whose tokens lead it (a parent chain of dense
// messages passes history through unchanged), the forward carries only the
// tokens after the ancestor's, and the destination splices the ancestor's
// back in front. The rules of which ancestor may stand for those tokens,
// how the suffix is cut and how the message is rebuilt live here.
//
// Thread-safety: pure functions over their arguments (FindElisionAncestor
// reads the store, which is thread-safe).
#ifndef KVRELAY_SERVER_MESH_ANCESTOR_H_
#define KVRELAY_SERVER_MESH_ANCESTOR_H_

#include <memory>
#include <string>

#include "core/message.h"
#include "kvrelay/v1/relay.pb.h"
#include "server/mesh/forwarder.h"
#include "server/store/store.h"

namespace kvrelay {

// Whether `ancestor` may stand for the leading tokens of the message `m`
// describes: both dense (neither quantized nor demoting), of the same
// layers, kv_heads, head_dim and dtype, and the ancestor no longer than m's
// history. The sender picks by it; the destination checks it again.
bool MayElideWith(const StoredMessage& ancestor, const v1::MessageHeader& m);

// The sender's pick: the nearest ancestor of `m` (following parent ids in
// `session`) that relay `target` holds, when MayElideWith it; null when
// there is none.
MessagePtr FindElisionAncestor(const MessageIndex& messages, const PeerBook& peers, const std::string& session,
                               const v1::MessageHeader& m, const std::string& target);

// Whether the first `a` tokens of every head of `v` are exactly `anc`'s
// (K, V and position ids).
bool PrefixMatches(const ForwardSource::LayerView& v, const MessageLayer& anc, int a);
// Whether the first `a` acc values of every head of `v` are exactly `anc`'s
// (0 where it has none).
bool AccPrefixMatches(const ForwardSource::LayerView& v, const MessageLayer& anc, int a);
// The tokens after the first `a` of every head of `v`, as a layer of its
// own (with their acc when `acc`). REQUIRES: PrefixMatches(v, anc, a).
std::shared_ptr<MessageLayer> SuffixAfter(const ForwardSource::LayerView& v, const MessageLayer& anc, int a,
                                          bool acc);

// The destination's rebuild: per layer and head, the ancestor's tokens
// followed by the suffix's. REQUIRES: MayElideWith held for the message.
Message RebuildFromAncestor(const Message& ancestor, Message suffix);

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_MESH_ANCESTOR_H_
