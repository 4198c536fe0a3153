// The Compress reactor.
#ifndef KVRELAY_SERVER_RPC_COMPRESS_REACTOR_H_
#define KVRELAY_SERVER_RPC_COMPRESS_REACTOR_H_

#include "grpcpp/grpcpp.h"
#include "server/rpc/relay_context.h"

namespace kvrelay {

// Compress: uploads a turn like Publish (UploadReactor), and streams the
// compressed message back instead of committing it.
grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* NewCompressReactor(RelayContext* relay,
                                                                               grpc::CallbackServerContext* ctx);

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_RPC_COMPRESS_REACTOR_H_
