// The unary calls of kvrelay.v1.Relay: Ack, CloseSession, Stats,
// MessageStatus and ReportRecipient. Each takes its raw request, checks the
// caller and the request, and finishes the call exactly once (at once, or
// from the store's thread once a durable store has recorded the change).
// The returned reactor is the call's; `response` is written before Finish.
#ifndef KVRELAY_SERVER_RPC_UNARY_CALLS_H_
#define KVRELAY_SERVER_RPC_UNARY_CALLS_H_

#include "grpcpp/grpcpp.h"
#include "server/rpc/relay_context.h"

namespace kvrelay {

grpc::ServerUnaryReactor* HandleAck(RelayContext* relay, grpc::CallbackServerContext* ctx,
                                    const grpc::ByteBuffer* request, grpc::ByteBuffer* response);
grpc::ServerUnaryReactor* HandleCloseSession(RelayContext* relay, grpc::CallbackServerContext* ctx,
                                             const grpc::ByteBuffer* request, grpc::ByteBuffer* response);
grpc::ServerUnaryReactor* HandleStats(RelayContext* relay, grpc::CallbackServerContext* ctx,
                                      const grpc::ByteBuffer* request, grpc::ByteBuffer* response);
grpc::ServerUnaryReactor* HandleMessageStatus(RelayContext* relay, grpc::CallbackServerContext* ctx,
                                              const grpc::ByteBuffer* request, grpc::ByteBuffer* response);
grpc::ServerUnaryReactor* HandleReportRecipient(RelayContext* relay, grpc::CallbackServerContext* ctx,
                                                const grpc::ByteBuffer* request, grpc::ByteBuffer* response);

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_RPC_UNARY_CALLS_H_
