// The Fetch reactor.
#ifndef KVRELAY_SERVER_RPC_FETCH_REACTOR_H_
#define KVRELAY_SERVER_RPC_FETCH_REACTOR_H_

#include "grpcpp/grpcpp.h"
#include "kvrelay/v1/relay.pb.h"
#include "server/rpc/relay_context.h"

namespace kvrelay {

// Fetch: waits through a store waiter for the oldest unacknowledged
// delivery of (session, agent), then streams it (header, chunks, trailer).
// `parsed`: whether the request was a FetchRequest at all (ParseRequest).
grpc::ServerWriteReactor<grpc::ByteBuffer>* NewFetchReactor(RelayContext* relay, grpc::CallbackServerContext* ctx,
                                                           const v1::FetchRequest& req, const absl::Status& parsed);

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_RPC_FETCH_REACTOR_H_
