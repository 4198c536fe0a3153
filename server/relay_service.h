// The kvrelay.v1.Relay service on gRPC's callback API.
//
// Reactions never block: chunk checks and copies run in OnReadDone, layer
// compression runs on the worker pool, Fetch waits through store waiters,
// and every reactor calls Finish exactly once with one read or write in
// flight at a time. Errors are absl::Status until ToGrpcStatus.
#ifndef KVRELAY_SERVER_RELAY_SERVICE_H_
#define KVRELAY_SERVER_RELAY_SERVICE_H_

#include <atomic>
#include <string>

#include "absl/status/status.h"
#include "core/thread_pool.h"
#include "kvrelay/v1/relay.grpc.pb.h"
#include "server/config.h"
#include "server/metrics.h"
#include "server/store.h"

namespace kvrelay {

// Checks an id against [A-Za-z0-9._:-]{1,128}. InvalidArgument naming `field`.
absl::Status CheckId(const std::string& field, const std::string& value);

class RelayService final : public v1::Relay::CallbackService {
 public:
  // All pointers must outlive the service; `metrics` may be null.
  RelayService(const ServerConfig& config, Store* store, ThreadPool* pool, Metrics* metrics);

  grpc::ServerReadReactor<v1::PublishRequest>* Publish(grpc::CallbackServerContext* ctx,
                                                       v1::PublishResponse* response) override;
  grpc::ServerWriteReactor<v1::FetchResponse>* Fetch(grpc::CallbackServerContext* ctx,
                                                     const v1::FetchRequest* request) override;
  grpc::ServerUnaryReactor* Ack(grpc::CallbackServerContext* ctx, const v1::AckRequest* request,
                                v1::AckResponse* response) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* ctx,
                                         const v1::CloseSessionRequest* request,
                                         v1::CloseSessionResponse* response) override;
  grpc::ServerBidiReactor<v1::CompressRequest, v1::CompressResponse>* Compress(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* ctx, const v1::StatsRequest* request,
                                  v1::StatsResponse* response) override;

  // For the reactors.
  const ServerConfig& config() const { return config_; }
  Store* store() const { return store_; }
  ThreadPool* pool() const { return pool_; }
  Metrics* metrics() const { return metrics_; }
  // Counts a failed RPC in kvrelay_errors_total.
  void CountError(const grpc::Status& s) const;
  std::string NewMessageId();

 private:
  const ServerConfig config_;
  Store* const store_;
  ThreadPool* const pool_;
  Metrics* const metrics_;
  std::atomic<uint64_t> id_counter_{0};
  const uint64_t id_salt_;
};

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_RELAY_SERVICE_H_
