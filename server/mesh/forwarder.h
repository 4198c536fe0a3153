// Relay-to-relay forwarding: the outbox of messages published here for
// recipients whose mailbox is on another relay, and the threads that send
// them (the Forward RPC of relay.proto).
//
// One forward per (message, destination relay): recipients that share a
// relay share it, and the destination answers per recipient. The first
// attempt starts when the publish's header is accepted and streams each
// compressed layer as soon as it exists (cut-through); its commit goes out
// only once the message is committed here, so a destination never holds a
// message whose publish failed. Later attempts send the committed message.
//
// Failures: UNAVAILABLE, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, ABORTED,
// DATA_LOSS, a broken stream, and a forward that makes no progress for
// the stall time (cancelled, and its connection dropped) are retried with
// exponential backoff and jitter until the forward timeout; any other
// answer, or the timeout, dead-letters the recipient (logged with the
// destination and the reason, counted, and shown by MessageStatus).
// Retries keep the message id, so the destination's idempotent commit
// cannot duplicate.
//
// Wire codec (--wire-codec rans): each layer goes as one PART_WIRE_LAYER
// blob (proto/wire_codec.h) in a protocol 2 forward. A destination that
// answers FAILED_PRECONDITION naming header.protocol_version does not speak
// it: the forward is retried at once with protocol 1, and that peer gets
// protocol 1 for kLegacyPeerRecheck.
//
// Ancestor elision: when the destination holds an ancestor of the message
// (one forwarded to it, or received from it, in the same session) whose
// tokens are exactly the message's leading tokens (dense messages and
// ancestors, history passed through unchanged), only the tokens after it
// are sent. A destination that no longer holds the ancestor says so and
// the message goes whole.
//
// Thread-safe. Forward attempts block their own threads (never a gRPC
// reaction); every wait is bounded by the stall time or the job's deadline.
// An attempt that starts before the commit (the first) waits for the
// publish's outcome before it records anything or schedules a retry: a
// publish that fails forwards nothing, and retries send the committed
// message.
#ifndef KVRELAY_SERVER_MESH_FORWARDER_H_
#define KVRELAY_SERVER_MESH_FORWARDER_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/message.h"
#include "core/mutex.h"
#include "core/time_source.h"
#include "kvrelay/v1/relay.pb.h"
#include "proto/wire.h"
#include "server/mesh/peer_channels.h"
#include "server/store/store.h"

namespace kvrelay {

class Metrics;
class RouteTable;

// The layers of one message as they become available to its forwards: as
// a publish compresses them (cut-through), or all at once for a committed
// message. Views stay valid while the source lives (it holds the owners of
// the buffers). Thread-safe.
class ForwardSource {
 public:
  // One layer's tensors in delivery order, and (dense layers) K, V and the
  // position ids for ancestor elision.
  struct LayerView {
    std::vector<TensorRef> wire;
    int tokens = 0;
    bool dense = false;
    absl::Span<const uint8_t> k, v;  // [kv_heads, tokens, row bytes]
    absl::Span<const int32_t> pos;   // [kv_heads, tokens]
    // The layer's acc ([kv_heads, tokens]; `zeros` when it has none), sent
    // whole after the other tensors, also when the tokens are elided.
    TensorRef acc;
    std::vector<float> zeros;
  };

  // A source for a publish in progress; `owner` keeps the compression (and
  // so the layers' buffers) alive.
  ForwardSource(int layers, std::shared_ptr<const void> owner);
  // A committed message's source: every layer ready, the outcome known.
  static std::shared_ptr<ForwardSource> OfCommitted(MessagePtr m);

  // Called once per layer, when it is compressed. `layer`'s buffers must
  // stay where they are while any owner lives (they may be moved between
  // Message objects, not reallocated).
  void SetLayer(int l, const MessageLayer& layer);
  // Keeps `owner` alive with the source (e.g. the message the layers were
  // moved into before its commit).
  void AddOwner(std::shared_ptr<const void> owner);
  // The publish's outcome: the committed message, or null when it failed.
  // The first call counts. Once committed, the source holds only the
  // message (which owns every layer's buffers by then): the compression and
  // its in-flight reservation go; after a failure it keeps its owners, which
  // views handed out may still point into.
  void Resolve(MessagePtr committed);

  // Waits for layer `l` until `deadline`; false when the publish failed or
  // the deadline passed.
  bool WaitLayer(int l, LayerView* out, Clock::time_point deadline);
  // Waits for the outcome until `deadline` (null: the publish failed, or
  // the deadline passed).
  MessagePtr WaitOutcome(Clock::time_point deadline);
  // When the commit was resolved (the forward latency starts there).
  Clock::time_point resolved_at();
  int layers() const { return n_layers_; }

 private:
  const int n_layers_;  // layers_.size(), read without mu_
  Mutex mu_;
  CondVar cv_;
  std::vector<std::unique_ptr<LayerView>> layers_ ABSL_GUARDED_BY(mu_);  // n_layers_ entries
  std::vector<std::shared_ptr<const void>> owners_ ABSL_GUARDED_BY(mu_);
  bool resolved_ ABSL_GUARDED_BY(mu_) = false;
  MessagePtr outcome_ ABSL_GUARDED_BY(mu_);
  Clock::time_point resolved_at_ ABSL_GUARDED_BY(mu_);
};

// The header of a forward of the committed message `m` (what its publish's
// forwards sent): for the forwards a restart resumes.
v1::ForwardHeader ForwardHeaderOf(const StoredMessage& m);

// The Forward protocol versions this relay speaks (ForwardHeader): 2 adds
// the wire codec; 1 is what relays without it speak.
inline constexpr uint32_t kForwardProtocolVersion = 2;
inline constexpr uint32_t kForwardProtocolVersionV1 = 1;

// How long a peer that refused protocol 2 is sent protocol 1 before it is
// tried with 2 again (it may have been upgraded).
inline constexpr std::chrono::minutes kLegacyPeerRecheck{10};

struct ForwarderOptions {
  std::string advertise;               // this relay's own target, sent as the forward's origin
  double forward_timeout_seconds = 300;
  double stall_seconds = 10;
  int threads = 8;
  // Backoff before retry n (n >= 1): initial * 2^(n-1), at most max, then
  // +-25% jitter.
  std::chrono::milliseconds initial_backoff{200};
  std::chrono::milliseconds max_backoff{5000};
  // How the peers are dialled: mTLS (auth.h, PeerChannelCredentials) once
  // TLS is configured; null: plaintext.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  // Code each layer with the wire codec (protocol 2, WIRE_CODEC_RANS);
  // false: protocol 1, tensors as Fetch sends them.
  bool wire_codec_rans = true;
  // The time of the backoff, the forward timeout and the legacy-peer
  // recheck (not owned; outlives the forwarder). The network's own
  // timeouts (stalls, the call's deadline) stay in real time.
  TimeSource* time = TimeSource::Real();
};

class Forwarder {
 public:
  // Pointers must outlive the forwarder; `metrics` may be null.
  // `messages`, `outbox` and `peers` (the relay's store, in its three
  // roles), `routes` and `metrics` (may be null) are not owned and outlive
  // this.
  Forwarder(const ForwarderOptions& opts, const MessageIndex* messages, Outbox* outbox, PeerBook* peers,
            const RouteTable* routes, Metrics* metrics);
  ~Forwarder();  // cancels what is in flight; see Drain
  Forwarder(const Forwarder&) = delete;
  Forwarder& operator=(const Forwarder&) = delete;

  // A message for `recipients` on relay `target`. `header` describes the
  // message (ids, sender, role, parent, policy as requested, geometry, the
  // message header's shape); `outbox_bytes` were reserved with
  // Outbox::ReserveOutbox(target, ...) and are released when the forward
  // ends. The first attempt starts at once.
  void Enqueue(const std::string& target, std::vector<std::string> recipients, const v1::ForwardHeader& header,
               std::shared_ptr<ForwardSource> source, uint64_t outbox_bytes);

  // Stops taking new work, waits up to `grace` for the outbox to empty,
  // then cancels what is left and logs every message not forwarded.
  // Returns the number of (message, destination) forwards left.
  int Drain(std::chrono::milliseconds grace);

  // Best effort: tells the relay a forwarded message came from that `agent`
  // received it whole or acked it.
  void Report(const StoredMessage& m, const std::string& agent, TrackState state);
  // Best effort: passes a close on to `peers`.
  void PropagateClose(const std::string& session, const std::vector<std::string>& peers);

  PeerChannels* peers() { return &peers_; }

  // Attempts whose stream ended before their publish's outcome was known
  // and that wait for it now (a first attempt that failed before the
  // commit): nothing of theirs is recorded, and no retry scheduled, until
  // it is known. For tests that must know such an attempt has ended.
  int attempts_awaiting_outcome();

 private:
  struct Job;
  void Loop();
  // One attempt; schedules the next or ends the job.
  void Attempt(const std::shared_ptr<Job>& job);
  // The attempt's stream: `header`, each layer (after `ancestor`'s tokens
  // when given), and the commit once the publish has committed.
  struct Sent;
  Sent SendForward(const std::shared_ptr<Job>& job, const v1::ForwardRequest& header, const MessagePtr& ancestor,
                   bool acc_suffix, BlockingStream* stream);
  // Waits for the publish's outcome when the attempt ended before it (up to
  // the forward timeout); marks `sent` committed or its publish failed.
  void AwaitPublish(const std::shared_ptr<Job>& job, Sent* sent);
  // True when the answer asks for the message again in another form (whole,
  // or by protocol 1 to a relay that does not speak the wire codec): the
  // attempt is then scheduled again at once.
  bool ResendIfAsked(const std::shared_ptr<Job>& job, const grpc::Status& status, const v1::ForwardResponse& resp,
                     bool coded, const MessagePtr& ancestor);
  // Records the destination's answer for each recipient (committed, queued
  // for a retry, dead-lettered); the recipients to retry.
  std::vector<std::string> ApplyAnswer(const std::shared_ptr<Job>& job, grpc::Status status,
                                       const v1::ForwardResponse& resp, const StoredMessage& m, uint64_t elided);
  // Schedules the next attempt with backoff, or dead-letters the job's
  // recipients when that would pass the forward timeout.
  void ScheduleRetry(const std::shared_ptr<Job>& job);
  void Schedule(const std::shared_ptr<Job>& job, Clock::time_point at);
  void EndJob(const std::shared_ptr<Job>& job);
  // The real-clock time point by which `job` must end (its deadline is in
  // time_'s time).
  Clock::time_point RealDeadline(const Job& job);
  void DeadLetter(const std::shared_ptr<Job>& job, const std::vector<std::string>& agents, grpc::StatusCode code,
                  const std::string& reason);
  // Whether forwards to `target` use the wire codec now.
  bool UseWireCodec(const std::string& target);
  // `target` refused protocol 2: protocol 1 for kLegacyPeerRecheck.
  void NoteLegacyPeer(const std::string& target);

  const ForwarderOptions opts_;
  TimeSource* const time_;
  const MessageIndex* const messages_;
  Outbox* const outbox_;
  PeerBook* const peer_book_;
  const RouteTable* const routes_;
  Metrics* const metrics_;
  PeerChannels peers_;

  Mutex mu_;
  CondVar cv_;
  std::multimap<Clock::time_point, std::shared_ptr<Job>> queue_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<Job>> running_ ABSL_GUARDED_BY(mu_);
  int awaiting_outcome_ ABSL_GUARDED_BY(mu_) = 0;  // attempts_awaiting_outcome()
  bool stop_ ABSL_GUARDED_BY(mu_) = false;  // no new attempts (Drain, the destructor)
  // Peers that refused protocol 2, until when they get protocol 1.
  std::map<std::string, Clock::time_point> legacy_until_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_;
};

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_MESH_FORWARDER_H_
