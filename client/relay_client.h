// RelayClient: the C++ client of the kvrelay.v1.Relay service
// (proto/kvrelay/v1/relay.proto) over a grpc::Channel.
//
//   auto client = kvrelay::RelayClient::Connect("127.0.0.1:50051");
//   kvrelay::PublishOptions p;
//   p.session = "s1"; p.sender = "planner"; p.recipients = {"critic"};
//   p.policy = "h2o-head:k=32+obf:p=8";
//   absl::StatusOr<kvrelay::PublishResult> r = client->Publish(turn, p);
//   kvrelay::FetchOptions f;
//   f.session = "s1"; f.agent = "critic";
//   absl::StatusOr<kvrelay::FetchedMessage> m = client->Fetch(f);
//   client->Ack("s1", "critic", m->message_id);
//
// Over TLS, as agent "critic" with its token (ConnectOptions):
//
//   kvrelay::ConnectOptions o;
//   o.tls_ca_file = "/etc/kvrelay/ca.pem";
//   o.token = "...";  // or leave unset: $KVRELAY_TOKEN
//   absl::StatusOr<std::unique_ptr<kvrelay::RelayClient>> c =
//       kvrelay::RelayClient::Connect("relay.example:50051", o);
//
// Errors are the relay's gRPC status converted to absl::Status (the
// canonical codes map one to one), or the client's own checks of what the
// relay sent: DATA_LOSS for any malformed delivery stream (a chunk or
// trailer CRC32C mismatch, a chunk out of order, a header that describes no
// message; proto/stream_codec.h).
//
// Retries: only Publish retries, and only because every publish carries a
// message id (the idempotency key; generated when the caller gives none):
// on UNAVAILABLE or ABORTED, at most PublishOptions::retries more attempts,
// with exponential backoff. Nothing else retries: a Fetch already delivers
// at least once, and an Ack may have taken effect before its reply was lost.
//
// Thread-safety: a RelayClient is thread-safe; concurrent calls share the
// channel. Progress callbacks run on the calling thread (Compress: on the
// thread that reads the reply stream).
#ifndef KVRELAY_CLIENT_RELAY_CLIENT_H_
#define KVRELAY_CLIENT_RELAY_CLIENT_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/message.h"
#include "core/turn.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "proto/channel.h"
#include "kvrelay/v1/relay.grpc.pb.h"

namespace kvrelay {

// Progress of one transfer: tensor bytes moved so far and in all.
struct TransferProgress {
  enum class Phase { kUpload, kDownload };
  Phase phase = Phase::kUpload;
  uint64_t bytes_done = 0;
  uint64_t bytes_total = 0;
};
// Called after every chunk; must be cheap (throttle any printing).
using ProgressCallback = std::function<void(const TransferProgress&)>;

struct PublishOptions {
  std::string session;                  // required
  std::string message_id;               // empty: a fresh random id (core/message_id.h)
  std::string sender;                   // required
  std::vector<std::string> recipients;  // >= 1
  std::string role;                     // optional
  std::string policy;                   // empty: the relay's default for the role
  // History by reference; REQUIRES a turn without history. The turn is then
  // sent with first_agent = false, whatever turn.first_agent says.
  std::string parent_id;
  // Deadline of each attempt, from its start.
  std::chrono::milliseconds deadline{std::chrono::minutes(2)};
  int retries = 3;  // extra attempts on UNAVAILABLE / ABORTED
  std::chrono::milliseconds initial_backoff{100};  // doubles per retry, at most 2 s
  // Called on the calling thread after an attempt failed with a status that
  // is retried, before the backoff: the attempt's number (1 for the first)
  // and its status. The retry waits for it to return.
  std::function<void(int attempt, const absl::Status& status)> on_retry;
  ProgressCallback progress;
};

struct PublishResult {
  std::string message_id;
  Accounting accounting;
  bool duplicate = false;  // the id was already committed; nothing changed
  int attempts = 1;
};

struct FetchOptions {
  std::string session;  // required
  std::string agent;    // required
  // How long to wait for a message to arrive. This is the call's deadline
  // (relay.proto has no separate wait): it bounds the transfer too.
  std::chrono::milliseconds wait{std::chrono::seconds(30)};
  // The relay acknowledges once the trailer is sent, i.e. before this client
  // has verified the stream; a message that then fails verification is lost.
  // Prefer Ack() after the message is safely stored.
  bool auto_ack = false;
  ProgressCallback progress;
};

// A delivered message with its header fields (relay.proto, MessageHeader).
struct FetchedMessage {
  std::string message_id;
  std::string session_id;
  std::string sender;
  std::string role;
  std::string parent_id;
  uint32_t delivery_attempt = 0;  // 1 on first delivery
  Accounting accounting;
  // policy, full_bytes, sent_bytes taken from the accounting; next_pos (where
  // this agent's own tokens start) from the header, or 1 + the largest
  // position id held from a relay without that field.
  Message message;
};

// Compress() result: the message and the relay's accounting.
struct CompressedMessage {
  Accounting accounting;
  Message message;
};

struct RelayStats {
  uint64_t messages_committed = 0, messages_failed = 0, messages_delivered = 0,
           messages_acked = 0;
  uint64_t received_bytes = 0, full_bytes = 0, sent_bytes = 0;
  uint64_t sessions = 0, mailbox_messages = 0, mailbox_bytes = 0, inflight_bytes = 0;
  uint64_t store_bytes = 0;  // every retained message, acked ones too
  std::string version;
};

// Where a message is for one recipient (relay.proto, RecipientState).
enum class RecipientState {
  kUnspecified,   // a state this client does not know, or none reported
  kQueued,        // waiting in the sender relay's outbox (see reason after a failed attempt)
  kCommitted,     // in the recipient's mailbox, at the sender's relay or the recipient's
  kDelivered,     // the recipient received it whole
  kAcked,         // the recipient acknowledged it
  kDeadLettered,  // given up: see reason
};

// The enum's name in lower case without its prefix: "unspecified", "queued",
// "committed", "delivered", "acked", "dead_lettered".
const char* RecipientStateName(RecipientState state);

// One recipient of a message (relay.proto, RecipientStatus).
struct RecipientStatus {
  std::string agent;
  RecipientState state = RecipientState::kUnspecified;
  std::string relay;   // the recipient's relay as routed; empty: the relay that was asked
  std::string reason;  // dead letter, or the last failed attempt: "CODE: message"; may be empty
  uint32_t attempts = 0;  // forward attempts (0 for a recipient on the relay that was asked)
};

// MessageStatus() result (relay.proto, MessageStatusResponse).
struct MessageStatusResult {
  std::string sender;
  // The relay that forwarded it to the relay asked, as its mTLS certificate
  // names it; empty when it was published there (or forwarded without TLS).
  std::string forwarded_by;
  std::vector<RecipientStatus> recipients;  // in the publish's order
};

// The absl::Status payload type URL under which a failed Publish reports
// the message id it used.
inline constexpr char kMessageIdPayload[] = "type.googleapis.com/kvrelay.v1.MessageId";

// HealthStatus, HealthStatusName and CheckRelayAddress: proto/channel.h.

// How Connect reaches a relay and who it says it is. Every field is
// optional; files are PEM, read once by Connect.
struct ConnectOptions {
  // CA certificate(s) the relay's certificate must chain to. Non-empty turns
  // TLS on; the relay's certificate must then also name the address's host
  // (a DNS or IP SAN). Empty: plaintext, for a relay's --local-listen
  // address, a Unix socket, or a relay run with --insecure.
  std::string tls_ca_file;
  // A client certificate chain and its private key, presented when the
  // relay asks for one (mTLS). Both or neither, and only with tls_ca_file.
  std::string tls_cert_file;
  std::string tls_key_file;
  // Bearer token, sent as "authorization: Bearer TOKEN" metadata on every
  // call, over TLS and plaintext alike; never logged or put in an error.
  // std::nullopt: the environment's KVRELAY_TOKEN (whitespace trimmed) when
  // set and non-empty, else none. An empty string: no token.
  std::optional<std::string> token;
};

// The environment variable ConnectOptions::token falls back to.
inline constexpr char kTokenEnvVar[] = "KVRELAY_TOKEN";

class RelayClient {
 public:
  // Over a channel of the caller's. Publish retries then only sleep their
  // backoff: set GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS on the channel for a
  // relay back from a restart to be reached in time.
  explicit RelayClient(std::shared_ptr<grpc::Channel> channel);
  // A plaintext channel to `addr` ("HOST:PORT", "dns:///HOST:PORT",
  // "unix:PATH") without a token that reconnects within 100 ms (at most
  // 2 s); publish retries ask it to reconnect at once and wait up to one
  // backoff for the connection. The address is not checked here
  // (CheckRelayAddress).
  static std::unique_ptr<RelayClient> Connect(const std::string& addr);
  // The same channel, with TLS and a token as `options` say.
  // INVALID_ARGUMENT, naming the option (tls_ca_file, tls_cert_file,
  // tls_key_file, token, or KVRELAY_TOKEN for the environment's), for a
  // file that cannot be read or holds no PEM block of the kind expected, a
  // certificate without its key (or the reverse), a client certificate
  // without tls_ca_file, or a token that is not 1 to 4096 visible ASCII
  // characters. Nothing is dialled yet: a relay that refuses the handshake
  // (an untrusted CA, a wrong host name) fails each call with UNAVAILABLE;
  // a missing or wrong token fails it with UNAUTHENTICATED.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<RelayClient>> Connect(const std::string& addr,
                                                                            const ConnectOptions& options);

  RelayClient(const RelayClient&) = delete;
  RelayClient& operator=(const RelayClient&) = delete;

  // Uploads `turn` (header, chunks of every tensor, commit) and returns the
  // message id and accounting. INVALID_ARGUMENT without contacting the relay
  // when the options are incomplete or the turn is inconsistent in itself
  // (turn values are not scanned for NaN/Inf here; the relay does that).
  // Any other error names the message id the publish used (generated when
  // opts.message_id is empty): its message ends "(message_id ID)" and the
  // payload kMessageIdPayload holds ID, so that the caller can retry with
  // that id; the relay may have committed it (e.g. DEADLINE_EXCEEDED after
  // the upload). The tensor bytes are copied once, into gRPC's buffers.
  [[nodiscard]] absl::StatusOr<PublishResult> Publish(const Turn& turn,
                                                      const PublishOptions& opts);
  // The same, without copying the tensor bytes: gRPC sends them from `turn`
  // itself and holds a reference to it until it is done with them, which
  // may be shortly after Publish returns. REQUIRES: nobody modifies `turn`
  // while a reference is held. For large turns the copy costs about as
  // much CPU as the kernel's own.
  [[nodiscard]] absl::StatusOr<PublishResult> Publish(std::shared_ptr<const Turn> turn,
                                                      const PublishOptions& opts);

  // Receives the oldest unacknowledged message for (session, agent).
  // DEADLINE_EXCEEDED when none arrived within opts.wait.
  [[nodiscard]] absl::StatusOr<FetchedMessage> Fetch(const FetchOptions& opts);

  // Acknowledges a delivered message: NOT_FOUND for an unknown message,
  // FAILED_PRECONDITION for one not yet delivered to `agent`.
  [[nodiscard]] absl::Status Ack(const std::string& session, const std::string& agent,
                                 const std::string& message_id,
                                 std::chrono::milliseconds deadline = std::chrono::seconds(10));

  // Frees the session; returns the number of messages freed. Idempotent.
  [[nodiscard]] absl::StatusOr<uint32_t> CloseSession(
      const std::string& session, std::chrono::milliseconds deadline = std::chrono::seconds(10));

  [[nodiscard]] absl::StatusOr<RelayStats> Stats(
      std::chrono::milliseconds deadline = std::chrono::seconds(10));

  // Where message `message_id` of `session` is, per recipient, as the relay
  // it was published to knows it (ask the sender's relay: another relay
  // answers NOT_FOUND, or only for the recipients it holds). Deliveries and
  // acks at other relays are reported back to it best effort, so a remote
  // recipient may show an earlier state than it has reached. NOT_FOUND for a
  // session or message the relay does not hold; INVALID_ARGUMENT without
  // contacting the relay for a malformed session or message id.
  [[nodiscard]] absl::StatusOr<MessageStatusResult> MessageStatus(
      const std::string& session, const std::string& message_id,
      std::chrono::milliseconds deadline = std::chrono::seconds(10));

  // Stateless compression by the relay (nothing stored). `progress` sees
  // the upload, then the download.
  [[nodiscard]] absl::StatusOr<CompressedMessage> Compress(
      const Turn& turn, const std::string& policy,
      std::chrono::milliseconds deadline = std::chrono::minutes(2),
      const ProgressCallback& progress = nullptr);

  // grpc.health.v1.Health/Check for `service` ("" = the whole server;
  // "kvrelay.v1.Relay" = the relay service). kServiceUnknown for a service
  // the server does not know (the protocol's NOT_FOUND).
  [[nodiscard]] absl::StatusOr<HealthStatus> Health(
      const std::string& service = "",
      std::chrono::milliseconds deadline = std::chrono::seconds(5));

 private:
  // `hold`: non-null when `turn` is owned by it (sent without a copy).
  absl::StatusOr<PublishResult> PublishImpl(const Turn& turn, std::shared_ptr<const Turn> hold,
                                            const PublishOptions& opts);
  absl::StatusOr<PublishResult> PublishOnce(const Turn& turn, const std::shared_ptr<const Turn>& hold,
                                            const v1::PublishHeader& header, const PublishOptions& opts);

  // A context for one call: its deadline, and the token's metadata.
  void Prepare(grpc::ClientContext* ctx, std::chrono::milliseconds deadline) const;

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Relay::Stub> stub_;
  std::string authorization_;  // "Bearer TOKEN", or empty: no metadata
  // The channel is Connect()'s own TCP client channel: publish retries may
  // reset its reconnect backoff and wait for it to connect. Not for a
  // caller's channel (it may be shared, or in-process, where gRPC aborts on
  // connectivity watches).
  bool own_channel_ = false;
};

}  // namespace kvrelay

#endif  // KVRELAY_CLIENT_RELAY_CLIENT_H_
