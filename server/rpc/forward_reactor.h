// The receiving side of relay-to-relay forwarding (Forward in relay.proto):
// reads a forwarded message with the delivery reader of proto/'s stream
// codec, rebuilds it when the forward elided an ancestor, and commits it
// into the mailboxes of its recipients here, idempotently by (session,
// message id). A forwarded message is never forwarded again.
#ifndef KVRELAY_SERVER_RPC_FORWARD_REACTOR_H_
#define KVRELAY_SERVER_RPC_FORWARD_REACTOR_H_

#include "absl/status/statusor.h"
#include "core/message.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_callback.h"
#include "kvrelay/v1/relay.pb.h"
#include "server/store/store.h"

#include "server/auth/auth.h"

namespace kvrelay {

class RelayContext;

// Starts a Forward call from the peer relay `caller` (authenticated).
// Raw ForwardRequest in, ForwardResponse out.
grpc::ServerReadReactor<grpc::ByteBuffer>* NewForwardReactor(RelayContext* relay, grpc::CallbackServerContext* ctx,
                                                            grpc::ByteBuffer* response, Caller caller);

// OK when forward header `h` describes the message `prior` holds (sender,
// role, policy as requested, parent, geometry, shape): a retry of the same
// forward. ALREADY_EXISTS naming the first field that differs otherwise.
absl::Status CheckSameForward(const v1::ForwardHeader& h, const StoredMessage& prior);

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_RPC_FORWARD_REACTOR_H_
