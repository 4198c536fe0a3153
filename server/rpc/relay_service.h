// The kvrelay.v1.Relay service on gRPC's callback API.
//
// Reactions never block: chunk checks and copies run in OnReadDone, layer
// compression runs on the worker pool, Fetch waits through store waiters,
// and every reactor calls Finish exactly once with one read or write in
// flight at a time. Errors are absl::Status until ToGrpcStatus.
//
// RelayService only hands each call to its reactor: publish_reactor.h
// (planned by publish_plan.h), fetch_reactor.h, compress_reactor.h,
// forward_reactor.h, the upload half Publish and Compress share in upload.h,
// and the unary calls in unary_calls.h. Each reactor reaches the relay's
// parts through relay_context.h, never through the service.
#ifndef KVRELAY_SERVER_RPC_RELAY_SERVICE_H_
#define KVRELAY_SERVER_RPC_RELAY_SERVICE_H_

#include "core/thread_pool.h"
#include "core/time_source.h"
#include "kvrelay/v1/relay.grpc.pb.h"
#include "server/config/config.h"
#include "server/metrics/metrics.h"
#include "server/rpc/relay_context.h"
#include "server/store/store.h"

namespace kvrelay {

// The tensor streams (Publish, Fetch, Compress) are registered raw: their
// messages stay gRPC byte buffers, so chunk data is copied once on the way in
// (into the turn being assembled) and not at all on the way out
// (proto/raw_chunk.h). The wire format is relay.proto's.
// The unary methods are raw too, so that a request that is not relay.proto's
// gets INVALID_ARGUMENT naming the expected message (gRPC's generated
// handlers answer an unparsable request without a message).
using RelayCallbackBase = v1::Relay::WithRawCallbackMethod_Ack<v1::Relay::WithRawCallbackMethod_CloseSession<
    v1::Relay::WithRawCallbackMethod_Stats<v1::Relay::WithRawCallbackMethod_Publish<
        v1::Relay::WithRawCallbackMethod_Fetch<v1::Relay::WithRawCallbackMethod_Compress<
            v1::Relay::WithRawCallbackMethod_MessageStatus<v1::Relay::WithRawCallbackMethod_Forward<
                v1::Relay::WithRawCallbackMethod_ReportRecipient<v1::Relay::Service>>>>>>>>>;

class RelayService final : public RelayCallbackBase {
 public:
  // The arguments are RelayContext's, with its contract.
  RelayService(const ServerConfig& config, Store* store, ThreadPool* pool, Metrics* metrics,
               Forwarder* forwarder = nullptr, const RouteTable* routes = nullptr,
               const Authenticator* auth = nullptr, TimeSource* time = TimeSource::Real());

  // Raw PublishRequest in, PublishResponse out.
  grpc::ServerReadReactor<grpc::ByteBuffer>* Publish(grpc::CallbackServerContext* ctx,
                                                     grpc::ByteBuffer* response) override;
  // Raw FetchRequest in, FetchResponse out.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Fetch(grpc::CallbackServerContext* ctx,
                                                    const grpc::ByteBuffer* request) override;
  // Raw AckRequest / CloseSessionRequest / StatsRequest in, the response out.
  grpc::ServerUnaryReactor* Ack(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;
  // Raw CompressRequest in, CompressResponse out.
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Compress(grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                  grpc::ByteBuffer* response) override;
  // Relay to relay: raw ForwardRequest in, ForwardResponse out.
  grpc::ServerReadReactor<grpc::ByteBuffer>* Forward(grpc::CallbackServerContext* ctx,
                                                     grpc::ByteBuffer* response) override;
  // Raw MessageStatusRequest / ReportRecipientRequest in, the response out.
  grpc::ServerUnaryReactor* MessageStatus(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ReportRecipient(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                            grpc::ByteBuffer* response) override;

  // The parts every call reaches (relay_context.h).
  RelayContext* context() { return &relay_; }

 private:
  RelayContext relay_;
};

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_RPC_RELAY_SERVICE_H_
