// The kvrelay.v1.Relay service on gRPC's callback API.
//
// Reactions never block: chunk checks and copies run in OnReadDone, layer
// compression runs on the worker pool, Fetch waits through store waiters,
// and every reactor calls Finish exactly once with one read or write in
// flight at a time. Errors are absl::Status until ToGrpcStatus.
#ifndef KVRELAY_SERVER_RELAY_SERVICE_H_
#define KVRELAY_SERVER_RELAY_SERVICE_H_

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "core/thread_pool.h"
#include "kvrelay/v1/relay.grpc.pb.h"
#include "server/config.h"
#include "server/metrics.h"
#include "server/store.h"

namespace kvrelay {

// At most this many recipients per publish (INVALID_ARGUMENT beyond).
inline constexpr int kMaxRecipients = 64;

// Checks an id against [A-Za-z0-9._:-]{1,128}. InvalidArgument naming `field`.
absl::Status CheckId(const std::string& field, const std::string& value);

// Cancels uploads (Publish, Compress) that send nothing for the idle
// timeout, and replies (Fetch, Compress) whose client reads nothing for as
// long. A reactor holds its Entry's mutex while it reacts to a read or a
// completed write and touches `last`; the watchdog fires an armed entry that has been idle past
// the timeout under that mutex (skipping it while the reactor is busy), so a
// firing never overlaps a reaction, and OnDone disarms it under the mutex
// before the reactor goes away. The watchdog never waits for an Entry's
// mutex, so a reaction may call Watch while holding one.
class UploadWatchdog {
 public:
  struct Entry {
    std::mutex mu;
    Clock::time_point last = Clock::now();  // guarded by mu
    bool armed = true;                      // guarded by mu
    std::function<void()> fire;             // runs once, under mu

    // Marks activity now (e.g. a reply's write completed).
    void Touch() {
      std::lock_guard<std::mutex> lock(mu);
      last = Clock::now();
    }
    // No firing from now on (e.g. from OnDone, before the reactor goes).
    void Disarm() {
      std::lock_guard<std::mutex> lock(mu);
      armed = false;
      fire = nullptr;
    }
  };
  explicit UploadWatchdog(double timeout_seconds);
  ~UploadWatchdog();
  UploadWatchdog(const UploadWatchdog&) = delete;
  UploadWatchdog& operator=(const UploadWatchdog&) = delete;

  std::shared_ptr<Entry> Watch(std::function<void()> fire);
  double timeout_seconds() const { return timeout_s_; }

 private:
  void Loop();
  const double timeout_s_;
  const Clock::duration timeout_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<Entry>> entries_;
  bool stop_ = false;
  std::thread thread_;
};

// The tensor streams (Publish, Fetch, Compress) are registered raw: their
// messages stay gRPC byte buffers, so chunk data is copied once on the way in
// (into the turn being assembled) and not at all on the way out
// (proto/raw_chunk.h). The wire format is relay.proto's.
// The unary methods are raw too, so that a request that is not relay.proto's
// gets INVALID_ARGUMENT naming the expected message (gRPC's generated
// handlers answer an unparsable request without a message).
using RelayCallbackBase = v1::Relay::WithRawCallbackMethod_Ack<v1::Relay::WithRawCallbackMethod_CloseSession<
    v1::Relay::WithRawCallbackMethod_Stats<v1::Relay::WithRawCallbackMethod_Publish<
        v1::Relay::WithRawCallbackMethod_Fetch<v1::Relay::WithRawCallbackMethod_Compress<v1::Relay::Service>>>>>>;

class RelayService final : public RelayCallbackBase {
 public:
  // All pointers must outlive the service; `metrics` may be null.
  RelayService(const ServerConfig& config, Store* store, ThreadPool* pool, Metrics* metrics);

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

  // For the reactors.
  const ServerConfig& config() const { return config_; }
  Store* store() const { return store_; }
  ThreadPool* pool() const { return pool_; }
  Metrics* metrics() const { return metrics_; }
  // Counts a failed RPC in kvrelay_errors_total.
  // Counts a finished RPC in the metrics (kvrelay_rpcs_total, kvrelay_errors_total).
  void CountRpc(const char* method, const grpc::Status& s) const;
  std::string NewMessageId();
  UploadWatchdog* watchdog() { return &watchdog_; }

 private:
  const ServerConfig config_;
  Store* const store_;
  ThreadPool* const pool_;
  Metrics* const metrics_;
  std::atomic<uint64_t> id_counter_{0};
  const uint64_t id_salt_;
  UploadWatchdog watchdog_;
};

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_RELAY_SERVICE_H_
