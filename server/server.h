// A running relay: gRPC server (Relay, grpc.health.v1, reflection), the
// worker pool, the store and the Prometheus endpoint.
//
//   auto server = RelayServer::Start(config);   // binds each address; port 0 picks one
//   std::cout << (*server)->ReadyLine() << std::endl;
//   ...
//   (*server)->Shutdown();                      // NOT_SERVING, drain, stop
//
// Thread-safe.
#ifndef KVRELAY_SERVER_SERVER_H_
#define KVRELAY_SERVER_SERVER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/mutex.h"
#include "core/time_source.h"
#include "core/thread_pool.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/server.h"
#include "prometheus/exposer.h"
#include "server/config/config.h"
#include "server/metrics/metrics.h"
#include "server/rpc/relay_service.h"
#include "server/store/store.h"

namespace kvrelay {

class Authenticator;
class Forwarder;
class RouteTable;

class RelayServer {
 public:
  // Binds every --listen address and the metrics address and starts
  // serving. A unix:PATH whose PATH is a socket nobody accepts on (left by a
  // relay that was killed) is removed first; a PATH that is not a socket is
  // left alone and refused, and so is a socket another process serves on.
  // Each socket is made mode 0666: who may connect is decided by the
  // directory it is in (as any process in the network namespace can reach
  // 127.0.0.1); gRPC removes it on Shutdown. Unavailable when an address
  // cannot be bound.
  // `time` (not owned; outlives the server) runs the relay's timers: the
  // store's TTL sweeps and Fetch deadlines, the idle watchdog, the watched
  // files' polls and the forwarder's backoff and timeout. Tests pass a fake
  // clock; the network's own deadlines stay in real time.
  static absl::StatusOr<std::unique_ptr<RelayServer>> Start(const ServerConfig& config,
                                                            TimeSource* time = TimeSource::Real());
  ~RelayServer();  // Shutdown(), then stops the metrics endpoint

  // "kvrelay-server ready grpc=ADDR[,ADDR...] metrics=HOST:PORT
  // [health=HOST:PORT]": every address of grpc_addresses(), ',' between
  // them, the bound metrics port (metrics=off without a metrics endpoint)
  // and the health port when there is one.
  std::string ReadyLine() const;
  // --listen then --local-listen, in order: HOST:PORT with the bound port,
  // unix:PATH as given.
  const std::vector<std::string>& grpc_addresses() const { return grpc_addresses_; }
  // The first of grpc_addresses(), whichever kind it is.
  const std::string& grpc_address() const { return grpc_addresses_.front(); }
  // The bound port of the first HOST:PORT address; 0 when every address is
  // a Unix socket.
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
  std::unique_ptr<RouteTable> routes_;
  std::unique_ptr<Forwarder> forwarder_;
  std::unique_ptr<RelayService> service_;
  std::unique_ptr<Authenticator> auth_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::CallbackGenericService> health_unimplemented_;
  std::unique_ptr<grpc::Server> health_server_;  // --health-listen: grpc.health.v1 alone
  std::string health_address_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::vector<std::string> grpc_addresses_;
  std::string metrics_host_;
  int grpc_port_ = 0, metrics_port_ = 0;
  // Health NOT_SERVING from now on (a spool that takes no writes).
  void SetNotServing();

  Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
  bool serving_ ABSL_GUARDED_BY(shutdown_mu_) = true;  // false once SetNotServing ran
};

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_SERVER_H_
