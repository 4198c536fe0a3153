// The kvrelay.v1.Relay service on gRPC's callback API.
//
// Reactions never block: chunk checks and copies run in OnReadDone, layer
// compression runs on the worker pool, Fetch waits through store waiters,
// and every reactor calls Finish exactly once with one read or write in
// flight at a time. Errors are absl::Status until ToGrpcStatus.
//
// RelayService only hands each call to its reactor: publish_reactor.h
// (planned by publish_plan.h), fetch_reactor.h, compress_reactor.h, the
// upload half Publish and Compress share in upload.h, the unary calls in
// unary_calls.cc, and the idle watchdog in watchdog.h.
#ifndef KVRELAY_SERVER_RELAY_SERVICE_H_
#define KVRELAY_SERVER_RELAY_SERVICE_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/mutex.h"
#include "core/time_source.h"
#include "core/thread_pool.h"
#include "kvrelay/v1/relay.grpc.pb.h"
#include "server/config.h"
#include "server/metrics.h"
#include "server/store.h"
#include "server/watchdog.h"

namespace kvrelay {

class Authenticator;
class Forwarder;
class RouteTable;
struct Caller;

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
  // All pointers must outlive the service; `metrics` may be null, and so
  // may `forwarder` and `routes` (then every recipient is local, and
  // deliveries of forwarded messages are not reported back), and `auth`
  // (then every caller may act as any agent and as a peer relay).
  // `time` (not owned; outlives the service) is the idle watchdog's.
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

  // For the reactors.
  const ServerConfig& config() const { return config_; }
  Store* store() const { return store_; }
  ThreadPool* pool() const { return pool_; }
  Metrics* metrics() const { return metrics_; }
  Forwarder* forwarder() const { return forwarder_; }
  const RouteTable* routes() const { return routes_; }
  // The caller of an agent's RPC / of a relay-to-relay RPC (auth.h);
  // without an authenticator, anyone (as any agent, or as a peer).
  absl::StatusOr<Caller> AuthenticateAgent(const grpc::CallbackServerContext& ctx, absl::string_view rpc) const;
  absl::StatusOr<Caller> AuthenticatePeer(const grpc::CallbackServerContext& ctx, absl::string_view rpc) const;
  // OK when `caller` may act as `agent`; PERMISSION_DENIED naming `field`
  // and both identities otherwise (counted as forbidden).
  absl::Status CheckActsAs(const grpc::CallbackServerContext& ctx, absl::string_view rpc, const Caller& caller,
                           absl::string_view field, absl::string_view agent) const;
  // PERMISSION_DENIED with `message`, counted as forbidden.
  absl::Status Forbid(const grpc::CallbackServerContext& ctx, absl::string_view rpc, const std::string& message) const;
  // Counts a failed RPC in kvrelay_errors_total.
  // Counts a finished RPC in the metrics (kvrelay_rpcs_total, kvrelay_errors_total).
  void CountRpc(const char* method, const grpc::Status& s) const;
  // An upload failed with `s`: a broken pipeline invariant is logged as an
  // error and counted (kvrelay_pipeline_invariant_violations_total).
  void NoteUploadFailure(const char* rpc, const absl::Status& s) const;
  // A relay-assigned message id (core/message_id.h); INTERNAL when the
  // CSPRNG fails.
  absl::StatusOr<std::string> NewMessageId();
  UploadWatchdog* watchdog() { return &watchdog_; }

  // Sees, for every upload that starts from now on, its count of queued or
  // compressing layers each time a layer is submitted
  // (PendingCompression::set_outstanding_observer); e.g. a test of
  // backpressure. `observe` must not block and must outlive the uploads.
  void SetLayerObserver(std::function<void(int outstanding)> observe);
  // The current observer (empty: none).
  std::function<void(int outstanding)> layer_observer() const;

 private:
  absl::StatusOr<Caller> CheckMayClose(const grpc::CallbackServerContext& ctx,
                                       const v1::CloseSessionRequest& req) const;
  // OK when `caller` may read the status of the message: any caller without
  // tokens, an agent when MaySee. NotVisibleError otherwise, the same for a
  // message that exists and one that does not.
  absl::Status CheckMayReadStatus(const Caller& caller, const v1::MessageStatusRequest& req) const;

  const ServerConfig config_;
  Store* const store_;
  ThreadPool* const pool_;
  Metrics* const metrics_;
  Forwarder* const forwarder_;
  const RouteTable* const routes_;
  const Authenticator* const auth_;
  UploadWatchdog watchdog_;
  mutable Mutex observer_mu_;
  std::function<void(int)> layer_observer_ ABSL_GUARDED_BY(observer_mu_);
};

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_RELAY_SERVICE_H_
