// The Publish reactor.
#ifndef KVRELAY_SERVER_RPC_PUBLISH_REACTOR_H_
#define KVRELAY_SERVER_RPC_PUBLISH_REACTOR_H_

#include "grpcpp/grpcpp.h"
#include "server/auth/auth.h"
#include "server/rpc/relay_context.h"

namespace kvrelay {

// Publish: plans the publish from its header (PlanPublish), uploads and
// compresses the turn (UploadReactor), and commits the message to the store.
// `caller` (authenticated) may publish only as an agent it may act as, and,
// on a relay with routes, only for a sender that is local to it.
grpc::ServerReadReactor<grpc::ByteBuffer>* NewPublishReactor(RelayContext* relay, grpc::CallbackServerContext* ctx,
                                                            grpc::ByteBuffer* response, Caller caller);

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_RPC_PUBLISH_REACTOR_H_
