// The Publish reactor.
#ifndef KVRELAY_SERVER_PUBLISH_REACTOR_H_
#define KVRELAY_SERVER_PUBLISH_REACTOR_H_

#include "grpcpp/grpcpp.h"
#include "server/relay_service.h"

namespace kvrelay {

// Publish: plans the publish from its header (PlanPublish), uploads and
// compresses the turn (UploadReactor), and commits the message to the store.
grpc::ServerReadReactor<grpc::ByteBuffer>* NewPublishReactor(RelayService* svc, grpc::CallbackServerContext* ctx,
                                                            grpc::ByteBuffer* response);

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_PUBLISH_REACTOR_H_
