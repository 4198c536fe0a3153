// Calls from this relay to the other relays of the mesh: one channel per
// target, and a blocking wrapper around gRPC's generic callback stream for
// the forwarder's threads.
//
// Thread-safe (PeerChannels); a BlockingStream is driven by one thread.
#ifndef KVRELAY_SERVER_MESH_PEER_CHANNELS_H_
#define KVRELAY_SERVER_MESH_PEER_CHANNELS_H_

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <vector>
#include <string>

#include "core/mutex.h"
#include "google/protobuf/message_lite.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/client_callback.h"
#include "grpcpp/support/status.h"

namespace kvrelay {

class PeerChannels {
 public:
  // Dials with `credentials` (null: plaintext). Channels are kept and
  // reused, so a forward pays no TLS handshake but the first to a peer.
  explicit PeerChannels(std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr);
  // Cancels the CallAsync calls in flight and waits until their callbacks
  // have run: none outlives the channels or this object.
  ~PeerChannels();
  PeerChannels(const PeerChannels&) = delete;
  PeerChannels& operator=(const PeerChannels&) = delete;

  // The channel to `target`, created on first use. Each channel has a
  // connection of its own (not shared with other channels to the target).
  std::shared_ptr<grpc::Channel> Get(const std::string& target);
  // Drops the channel to `target` if it is still `stale`: the next Get
  // dials a fresh connection (after a stalled call, whose connection may be
  // dead without TCP knowing yet).
  void Reset(const std::string& target, const std::shared_ptr<grpc::Channel>& stale);

  // A unary call of `method` ("/kvrelay.v1.Relay/ReportRecipient") to
  // `target` that nobody waits for: `done` (may be empty) runs on a gRPC
  // thread with the status. Gives up after `timeout`, or when this object
  // is destroyed (CANCELLED).
  void CallAsync(const std::string& target, const std::string& method, const google::protobuf::MessageLite& req,
                 std::chrono::milliseconds timeout, std::function<void(const grpc::Status&)> done);

 private:
  struct AsyncCall;

  const std::shared_ptr<grpc::ChannelCredentials> credentials_;
  Mutex mu_;
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mu_);
  // The CallAsync calls in flight. The destructor cancels them without
  // the lock: a cancelled call's callback (which takes it) may run inside
  // TryCancel on the same thread.
  Mutex calls_mu_;
  CondVar calls_done_;
  std::set<AsyncCall*> calls_ ABSL_GUARDED_BY(calls_mu_);
  bool stopping_ ABSL_GUARDED_BY(calls_mu_) = false;  // the destructor has begun
  std::vector<AsyncCall*> finished_ ABSL_GUARDED_BY(calls_mu_);  // done while stopping
};

// A streaming call on gRPC's generic callback API, driven by one blocking
// thread: one write and one read in flight at most. Every wait is bounded;
// a wait that times out cancels the call. The response is read as soon as
// the call starts, so an early answer (the peer finishing before the end of
// the stream) ends the writes.
class BlockingStream : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  // Starts `method` on `channel` with `ctx` (which must outlive Finish()).
  BlockingStream(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                 grpc::ClientContext* ctx);
  ~BlockingStream() override;  // REQUIRES: Finish() returned

  // Writes `msg`, waiting at most `stall` for gRPC to take it. False when
  // the call is over, the peer already answered, or the wait timed out
  // (stalled() then says so and the call is cancelled).
  bool Write(const grpc::ByteBuffer& msg, std::chrono::milliseconds stall);
  // Half-closes, waiting at most `stall`.
  bool WritesDone(std::chrono::milliseconds stall);
  // Waits at most `stall` for the response; false if none came (the call is
  // then cancelled when the wait timed out).
  bool ReadResponse(grpc::ByteBuffer* out, std::chrono::milliseconds stall);
  // Whether the peer answered (the response is in) before the stream ended.
  bool answered();
  // Cancels the call; every wait returns.
  void Cancel();
  // Waits for the call to end and returns its status.
  grpc::Status Finish();
  bool stalled() const {
    MutexLock lock(&mu_);
    return stalled_;
  }

  void OnWriteDone(bool ok) override;
  void OnWritesDoneDone(bool ok) override;
  void OnReadDone(bool ok) override;
  void OnDone(const grpc::Status& s) override;

 private:
  // Waits at most `stall` for `ready` (called under mu_); on a timeout
  // marks the stream stalled and cancels the call. Real time, not the
  // forwarder's TimeSource: it watches gRPC's progress on a real stream,
  // which a test's fake clock does not move (advancing that clock for the
  // store's or the backoff's timers would otherwise stall a live write).
  bool WaitFor(const std::function<bool()>& ready, std::chrono::milliseconds stall);

  grpc::ClientContext* const ctx_;
  grpc::ByteBuffer write_buf_, read_buf_;
  mutable Mutex mu_;
  CondVar cv_;
  bool write_pending_ ABSL_GUARDED_BY(mu_) = false;
  bool write_ok_ ABSL_GUARDED_BY(mu_) = true;
  bool read_done_ ABSL_GUARDED_BY(mu_) = false;
  bool read_ok_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  bool stalled_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_MESH_PEER_CHANNELS_H_
