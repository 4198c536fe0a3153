// What every call of the relay service reaches: the configuration, the
// store, the worker pool, the metrics, the mesh (forwarder and routes),
// authentication and the idle watchdog, with the checks and counts every
// call shares. Reactors take a RelayContext, never the service, so a
// reactor can be built and tested on its parts alone.
//
// Thread-safe: every method may be called from any reaction or pool thread.
#ifndef KVRELAY_SERVER_RPC_RELAY_CONTEXT_H_
#define KVRELAY_SERVER_RPC_RELAY_CONTEXT_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/mutex.h"
#include "core/thread_pool.h"
#include "core/time_source.h"
#include "grpcpp/grpcpp.h"
#include "server/config/config.h"
#include "server/metrics/metrics.h"
#include "server/rpc/watchdog.h"
#include "server/store/store.h"

namespace kvrelay {

class Authenticator;
class Forwarder;
class RouteTable;
struct Caller;

class RelayContext {
 public:
  // All pointers must outlive the context; `metrics` may be null, and so
  // may `forwarder` and `routes` (then every recipient is local, and
  // deliveries of forwarded messages are not reported back), and `auth`
  // (then every caller may act as any agent and as a peer relay).
  // `time` (not owned; outlives the context) is the idle watchdog's.
  RelayContext(const ServerConfig& config, Store* store, ThreadPool* pool, Metrics* metrics,
               Forwarder* forwarder = nullptr, const RouteTable* routes = nullptr,
               const Authenticator* auth = nullptr, TimeSource* time = TimeSource::Real());
  RelayContext(const RelayContext&) = delete;
  RelayContext& operator=(const RelayContext&) = delete;

  const ServerConfig& config() const { return config_; }
  Store* store() const { return store_; }
  ThreadPool* pool() const { return pool_; }
  Metrics* metrics() const { return metrics_; }
  Forwarder* forwarder() const { return forwarder_; }
  const RouteTable* routes() const { return routes_; }
  UploadWatchdog* watchdog() { return &watchdog_; }

  // The caller of an agent's RPC / of a relay-to-relay RPC (auth/auth.h);
  // without an authenticator, anyone (as any agent, or as a peer).
  absl::StatusOr<Caller> AuthenticateAgent(const grpc::CallbackServerContext& ctx, absl::string_view rpc) const;
  absl::StatusOr<Caller> AuthenticatePeer(const grpc::CallbackServerContext& ctx, absl::string_view rpc) const;
  // OK when `caller` may act as `agent`; PERMISSION_DENIED naming `field`
  // and both identities otherwise (counted as forbidden).
  absl::Status CheckActsAs(const grpc::CallbackServerContext& ctx, absl::string_view rpc, const Caller& caller,
                           absl::string_view field, absl::string_view agent) const;
  // PERMISSION_DENIED with `message`, counted as forbidden.
  absl::Status Forbid(const grpc::CallbackServerContext& ctx, absl::string_view rpc, const std::string& message) const;

  // Counts a finished RPC in the metrics (kvrelay_rpcs_total, kvrelay_errors_total).
  void CountRpc(const char* method, const grpc::Status& s) const;
  // An upload failed with `s`: a broken pipeline invariant is logged as an
  // error and counted (kvrelay_pipeline_invariant_violations_total).
  void NoteUploadFailure(const char* rpc, const absl::Status& s) const;
  // A relay-assigned message id (core/message_id.h); INTERNAL when the
  // CSPRNG fails.
  absl::StatusOr<std::string> NewMessageId() const;

  // Sees, for every upload that starts from now on, its count of queued or
  // compressing layers each time a layer is submitted
  // (PendingCompression::set_outstanding_observer); e.g. a test of
  // backpressure. `observe` must not block and must outlive the uploads.
  void SetLayerObserver(std::function<void(int outstanding)> observe);
  // The current observer (empty: none).
  std::function<void(int outstanding)> layer_observer() const;

  // Counts an upload (Publish, Compress) that backpressure paused: it reads
  // no further until its queued layers drain (Upload::PauseIfBusy).
  void CountBackpressurePause() { backpressure_pauses_.fetch_add(1, std::memory_order_relaxed); }
  // The pauses counted so far, all uploads together: a test that must know
  // an upload is held back waits for this count.
  uint64_t backpressure_pauses() const { return backpressure_pauses_.load(std::memory_order_relaxed); }

  // Counts one request that a Forward call read and accepted (its header or
  // a chunk; not the commit, which ends the call).
  void CountForwardRequestRead() { forward_requests_read_.fetch_add(1, std::memory_order_relaxed); }
  // The requests counted so far, all Forward calls together: a test that
  // must know the relay has taken in what a peer wrote (e.g. before it cuts
  // the stream) waits for this count.
  uint64_t forward_requests_read() const { return forward_requests_read_.load(std::memory_order_relaxed); }

 private:
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
  std::atomic<uint64_t> backpressure_pauses_{0};
  std::atomic<uint64_t> forward_requests_read_{0};
};

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_RPC_RELAY_CONTEXT_H_
