// A running relay: gRPC server (Relay, grpc.health.v1, reflection), the
// worker pool, the store and the Prometheus endpoint.
//
//   auto server = RelayServer::Start(config);   // binds; port 0 picks one
//   std::cout << (*server)->ReadyLine() << std::endl;
//   ...
//   (*server)->Shutdown();                      // NOT_SERVING, drain, stop
//
// Thread-safe.
#ifndef KVRELAY_SERVER_SERVER_H_
#define KVRELAY_SERVER_SERVER_H_

#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "core/thread_pool.h"
#include "grpcpp/server.h"
#include "prometheus/exposer.h"
#include "server/config.h"
#include "server/metrics.h"
#include "server/relay_service.h"
#include "server/store.h"

namespace kvrelay {

class RelayServer {
 public:
  // Binds both addresses and starts serving. Unavailable when an address
  // cannot be bound.
  static absl::StatusOr<std::unique_ptr<RelayServer>> Start(const ServerConfig& config);
  ~RelayServer();  // Shutdown(), then stops the metrics endpoint

  // "kvrelay-server ready grpc=HOST:PORT metrics=HOST:PORT" with the bound
  // ports (metrics=off without a metrics endpoint).
  std::string ReadyLine() const;
  std::string grpc_address() const;  // HOST:PORT as bound
  int grpc_port() const { return grpc_port_; }
  int metrics_port() const { return metrics_port_; }

  // Health NOT_SERVING, then drains in-flight calls for up to the grace
  // period (config.shutdown_grace_seconds) before cancelling the rest, and
  // waits for the compression workers. /metrics keeps answering until the
  // destructor (stopping its HTTP server takes up to ~2 s of civetweb's poll
  // interval, which a process that exits right after may skip).
  // Idempotent.
  void Shutdown();

  Store* store() { return store_.get(); }
  RelayService* service() { return service_.get(); }
  Metrics* metrics() { return metrics_.get(); }

 private:
  RelayServer() = default;

  ServerConfig config_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<RelayService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::string grpc_host_, metrics_host_;
  int grpc_port_ = 0, metrics_port_ = 0;
  std::mutex shutdown_mu_;
  bool shut_down_ = false;
};

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_SERVER_H_
