#include "client/relay_client.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/ids.h"
#include "core/message_id.h"
#include "core/status_macros.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/impl/rpc_method.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/channel_arguments.h"
#include "grpcpp/support/sync_stream.h"
#include "proto/address.h"
#include "proto/raw_chunk.h"
#include "proto/status_util.h"
#include "proto/stream_codec.h"
#include "proto/wire.h"

namespace kvrelay {

namespace {

// `s` naming the message id a failed publish used (see Publish).
absl::Status WithMessageId(const absl::Status& s, const std::string& id) {
  absl::Status out(s.code(), absl::StrCat(s.message(), " (message_id ", id, ")"));
  out.SetPayload(kMessageIdPayload, absl::Cord(id));
  return out;
}

// The PEM file `path` of option `field`, which must hold a block that
// begins "-----BEGIN " followed by `kind` ("CERTIFICATE", "PRIVATE KEY": a
// "-----BEGIN EC PRIVATE KEY-----" block has the key's kind in between).
absl::StatusOr<std::string> ReadPem(absl::string_view field, const std::string& path, absl::string_view kind) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": cannot read \"", path, "\": ", std::strerror(errno)));
  }
  std::ostringstream buf;
  buf << in.rdbuf();
  if (in.bad()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": cannot read \"", path, "\""));
  }
  std::string pem = buf.str();
  bool found = false;
  for (size_t at = pem.find("-----BEGIN "); at != std::string::npos && !found;
       at = pem.find("-----BEGIN ", at + 1)) {
    const size_t end = pem.find("-----", at + 11);
    found = end != std::string::npos && absl::EndsWith(absl::string_view(pem).substr(at, end - at), kind);
  }
  if (!found) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": \"", path, "\" holds no PEM ", kind, " block, expected a PEM file"));
  }
  return pem;
}

// A token as metadata can carry it; the message never shows the token.
absl::Status CheckToken(absl::string_view field, absl::string_view token) {
  bool ok = !token.empty() && token.size() <= 4096;
  for (char c : token) ok = ok && c > ' ' && c <= '~';
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": ", token.size(), " characters (not shown), expected 1 to 4096 visible ASCII characters"));
  }
  return absl::OkStatus();
}

// The token `options` give: explicit, or the environment's, or none ("").
absl::StatusOr<std::string> TokenOf(const ConnectOptions& options) {
  if (options.token) {
    if (options.token->empty()) return std::string();
    KVRELAY_RETURN_IF_ERROR(CheckToken("token", *options.token));
    return *options.token;
  }
  const char* env = std::getenv(kTokenEnvVar);
  const absl::string_view token = absl::StripAsciiWhitespace(env ? env : "");
  if (token.empty()) return std::string();
  KVRELAY_RETURN_IF_ERROR(CheckToken(kTokenEnvVar, token));
  return std::string(token);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> CredentialsOf(const ConnectOptions& o) {
  if (o.tls_cert_file.empty() != o.tls_key_file.empty()) {
    return o.tls_cert_file.empty()
               ? absl::InvalidArgumentError("tls_key_file: given without tls_cert_file, expected both or neither")
               : absl::InvalidArgumentError("tls_cert_file: given without tls_key_file, expected both or neither");
  }
  if (o.tls_ca_file.empty()) {
    if (!o.tls_cert_file.empty()) {
      return absl::InvalidArgumentError(
          "tls_cert_file: given without tls_ca_file, expected a CA file (it turns TLS on)");
    }
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions ssl;
  KVRELAY_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadPem("tls_ca_file", o.tls_ca_file, "CERTIFICATE"));
  if (!o.tls_cert_file.empty()) {
    KVRELAY_ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadPem("tls_cert_file", o.tls_cert_file, "CERTIFICATE"));
    KVRELAY_ASSIGN_OR_RETURN(ssl.pem_private_key, ReadPem("tls_key_file", o.tls_key_file, "PRIVATE KEY"));
  }
  return grpc::SslCredentials(ssl);
}

// Values this client does not know (a newer relay's) are kUnspecified.
RecipientState FromProto(v1::RecipientState s) {
  switch (s) {
    case v1::RECIPIENT_STATE_QUEUED: return RecipientState::kQueued;
    case v1::RECIPIENT_STATE_COMMITTED: return RecipientState::kCommitted;
    case v1::RECIPIENT_STATE_DELIVERED: return RecipientState::kDelivered;
    case v1::RECIPIENT_STATE_ACKED: return RecipientState::kAcked;
    case v1::RECIPIENT_STATE_DEAD_LETTERED: return RecipientState::kDeadLettered;
    default: return RecipientState::kUnspecified;
  }
}

// The tensor streams run raw (proto/raw_chunk.h): a chunk's data is copied
// once into the outgoing message, its CRC32C computed during that copy, and
// delivered chunks are copied once out of gRPC's slices into the message.
// The wire format is relay.proto's. These are the methods' full names (the
// generated stub's, which the raw calls cannot use).
constexpr char kPublishMethod[] = "/kvrelay.v1.Relay/Publish";
constexpr char kFetchMethod[] = "/kvrelay.v1.Relay/Fetch";
constexpr char kCompressMethod[] = "/kvrelay.v1.Relay/Compress";

using WriteFn = std::function<bool(const grpc::ByteBuffer&)>;

// Writes the chunks of every tensor of `turn` (as Request.chunk) and the
// trailer (Request.commit) through `write` (returns false once the stream
// broke). Ok when the whole upload was written; Cancelled when the stream
// broke (the call's status says why). With `hold` (which owns `turn`) the
// chunks refer to the tensors instead of copying them.
template <typename Request>
absl::Status UploadTurn(const Turn& turn, const std::shared_ptr<const Turn>& hold, const WriteFn& write,
                        const ProgressCallback& progress) {
  std::vector<TensorRef> tensors = TurnUploadOrder(turn);
  TransferProgress p;
  p.phase = TransferProgress::Phase::kUpload;
  p.bytes_total = TotalBytes(tensors);
  const absl::Status broken = absl::CancelledError("upload stream broke");
  ChunkStreamWriter writer;
  writer.Append(std::move(tensors), hold);
  grpc::ByteBuffer msg;
  uint64_t n = 0;
  while (writer.NextChunk<Request>(&msg, &n)) {
    if (!write(msg)) return broken;
    p.bytes_done += n;
    if (progress) progress(p);
  }
  if (!write(writer.EncodeTrailer<Request>())) return broken;
  return absl::OkStatus();
}

// Consumes one delivery stream response (header, chunk or trailer).
// `done` is set once the trailer checked out and `*out` holds the message.
template <typename Response>
class DeliveryStream {
 public:
  explicit DeliveryStream(ProgressCallback progress) : progress_(std::move(progress)) {
    p_.phase = TransferProgress::Phase::kDownload;
  }

  // A response as it arrived: a chunk is copied straight out of gRPC's
  // slices; anything else is parsed as a Response. A bad delivery is
  // DATA_LOSS (DeliveryStatus): the relay sent it, or it broke on the way.
  absl::Status Consume(const grpc::ByteBuffer& wire) {
    if (!raw_.Reset(wire)) return absl::DataLossError("delivery stream: unreadable response");
    if (raw_.AsChunk(Response::kChunkFieldNumber, &chunk_)) return DeliveryStatus(Consume(chunk_));
    if (!raw_.ParseAs(&resp_)) {
      return absl::DataLossError(absl::StrCat("delivery stream: a response of ", raw_.size(),
                                              " bytes that is not a kvrelay.v1.", Response::descriptor()->name()));
    }
    return DeliveryStatus(Consume(resp_));
  }

  bool done() const { return reader_.done(); }
  const v1::MessageHeader& header() const { return header_; }
  Message TakeMessage() { return std::move(message_); }

 private:
  StreamError Consume(const Response& r) {
    switch (r.kind_case()) {
      case Response::kHeader: {
        if (!reader_.started() && !reader_.done()) header_ = r.header();
        StreamError e = reader_.Start(r.header());
        if (!e.ok()) return e;
        p_.bytes_total = reader_.bytes_expected();
        if (progress_) progress_(p_);
        return e;
      }
      case Response::kChunk:
        return Consume(ChunkView::Of(r.chunk()));
      case Response::kTrailer:
        return reader_.Finish(r.trailer(), &message_);
      default:
        return StreamError(StreamErrorKind::kSequence,
                           "delivery stream: empty response, expected header, chunk or trailer");
    }
  }

  StreamError Consume(const ChunkView& c) {
    StreamError e = reader_.Add(c);
    if (!e.ok()) return e;
    p_.bytes_done = reader_.bytes_received();
    if (progress_) progress_(p_);
    return e;
  }

  RawMessage raw_;
  ChunkView chunk_;
  Response resp_;
  ProgressCallback progress_;
  TransferProgress p_;
  DeliveryReader reader_;
  v1::MessageHeader header_;
  Message message_;
};

// Feeds every response of `stream` to `delivery`. On the first one it
// rejects, cancels the call and drains the rest; returns that error, or OK.
template <typename Stream, typename Response>
absl::Status ConsumeDelivery(Stream* stream, grpc::ClientContext* ctx, DeliveryStream<Response>* delivery) {
  grpc::ByteBuffer resp;
  while (stream->Read(&resp)) {
    absl::Status s = delivery->Consume(resp);
    if (!s.ok()) {
      ctx->TryCancel();
      while (stream->Read(&resp)) {
      }
      return s;
    }
  }
  return absl::OkStatus();
}

// An id option; an optional one may be empty.
absl::Status CheckId(absl::string_view field, const std::string& v, bool required) {
  if (v.empty() && !required) return absl::OkStatus();
  return kvrelay::CheckId(field, v);
}

}  // namespace

RelayClient::RelayClient(std::shared_ptr<grpc::Channel> channel)
    : channel_(std::move(channel)), stub_(v1::Relay::NewStub(channel_)) {}

std::unique_ptr<RelayClient> RelayClient::Connect(const std::string& addr) {
  ConnectOptions plain;
  plain.token = "";
  return *Connect(addr, plain);
}

absl::StatusOr<std::unique_ptr<RelayClient>> RelayClient::Connect(const std::string& addr,
                                                                  const ConnectOptions& options) {
  KVRELAY_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> creds, CredentialsOf(options));
  KVRELAY_ASSIGN_OR_RETURN(const std::string token, TokenOf(options));
  grpc::ChannelArguments args;
  // gRPC's default reconnect backoff (1 s, growing x1.6 to 120 s) outlasts
  // the publish retries' own backoff: a relay back after a restart would not
  // be tried again in time.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  auto client = std::make_unique<RelayClient>(grpc::CreateCustomChannel(addr, creds, args));
  client->own_channel_ = true;
  // Per call rather than as CallCredentials: gRPC drops call credentials on
  // a plaintext channel, and local listeners are plaintext.
  if (!token.empty()) client->authorization_ = absl::StrCat("Bearer ", token);
  return client;
}

void RelayClient::Prepare(grpc::ClientContext* ctx, std::chrono::milliseconds deadline) const {
  ctx->set_deadline(std::chrono::system_clock::now() + deadline);
  if (!authorization_.empty()) ctx->AddMetadata("authorization", authorization_);
}

absl::StatusOr<PublishResult> RelayClient::Publish(const Turn& turn, const PublishOptions& opts) {
  return PublishImpl(turn, nullptr, opts);
}

absl::StatusOr<PublishResult> RelayClient::Publish(std::shared_ptr<const Turn> turn, const PublishOptions& opts) {
  if (!turn) return absl::InvalidArgumentError("turn: null, expected a turn");
  const Turn& t = *turn;
  return PublishImpl(t, std::move(turn), opts);
}

absl::StatusOr<PublishResult> RelayClient::PublishImpl(const Turn& turn, std::shared_ptr<const Turn> hold,
                                                       const PublishOptions& opts) {
  KVRELAY_RETURN_IF_ERROR(CheckId("session", opts.session, true));
  KVRELAY_RETURN_IF_ERROR(CheckId("message_id", opts.message_id, false));
  KVRELAY_RETURN_IF_ERROR(CheckId("sender", opts.sender, true));
  KVRELAY_RETURN_IF_ERROR(CheckId("parent_id", opts.parent_id, false));
  if (opts.recipients.empty()) {
    return absl::InvalidArgumentError("recipients: none, expected at least one agent");
  }
  for (size_t i = 0; i < opts.recipients.size(); ++i) {
    KVRELAY_RETURN_IF_ERROR(CheckId(absl::StrCat("recipients[", i, "]"), opts.recipients[i], true));
  }
  if (opts.retries < 0) return absl::InvalidArgumentError("retries: negative, expected >= 0");
  KVRELAY_ASSIGN_OR_RETURN(v1::TurnGeometry geometry, TurnGeometryOf(turn));
  if (!opts.parent_id.empty() && geometry.n_history() > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "geometry.n_history: ", geometry.n_history(),
        ", expected 0 with a parent (the relay supplies the history of parent_id)"));
  }
  // With a parent the turn continues a chain: it is never the first agent's
  // (the relay requires first_agent = false then).
  if (!opts.parent_id.empty()) geometry.set_first_agent(false);
  v1::PublishHeader header;
  header.set_session_id(opts.session);
  std::string message_id = opts.message_id;
  if (message_id.empty()) {
    KVRELAY_ASSIGN_OR_RETURN(message_id, NewMessageId());
  }
  header.set_message_id(message_id);
  header.set_sender(opts.sender);
  for (const std::string& r : opts.recipients) header.add_recipients(r);
  header.set_role(opts.role);
  header.set_policy(opts.policy);
  header.set_parent_id(opts.parent_id);
  *header.mutable_geometry() = std::move(geometry);

  std::chrono::milliseconds backoff = opts.initial_backoff;
  for (int attempt = 1;; ++attempt) {
    absl::StatusOr<PublishResult> r = PublishOnce(turn, hold, header, opts);
    if (r.ok()) {
      r->attempts = attempt;
      return r;
    }
    const absl::StatusCode code = r.status().code();
    const bool retryable =
        code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kAborted;
    if (!retryable || attempt > opts.retries) return WithMessageId(r.status(), header.message_id());
    if (opts.on_retry) opts.on_retry(attempt, r.status());
    std::this_thread::sleep_for(backoff);
    // A channel whose connection failed waits out its reconnect backoff
    // before trying again, and until then fails every call at once: try now,
    // and give the relay up to another backoff to accept the connection.
    if (own_channel_) {
      grpc::experimental::ChannelResetConnectionBackoff(channel_.get());
      channel_->WaitForConnected(std::chrono::system_clock::now() + backoff);
    }
    backoff = std::min<std::chrono::milliseconds>(backoff * 2, std::chrono::seconds(2));
  }
}

absl::StatusOr<PublishResult> RelayClient::PublishOnce(const Turn& turn, const std::shared_ptr<const Turn>& hold,
                                                       const v1::PublishHeader& header,
                                                       const PublishOptions& opts) {
  grpc::ClientContext ctx;
  Prepare(&ctx, opts.deadline);
  v1::PublishResponse resp;
  const grpc::internal::RpcMethod method(kPublishMethod, grpc::internal::RpcMethod::CLIENT_STREAMING);
  std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer(
      grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(channel_.get(), method, &ctx, &resp));
  v1::PublishRequest req;
  *req.mutable_header() = header;
  const WriteFn write = [&](const grpc::ByteBuffer& b) { return writer->Write(b); };
  absl::Status up = absl::CancelledError("upload stream broke");
  if (write(EncodeProto(req))) up = UploadTurn<v1::PublishRequest>(turn, hold, write, opts.progress);
  if (up.ok()) writer->WritesDone();
  const grpc::Status s = writer->Finish();
  if (!s.ok()) return FromGrpcStatus(s);
  // A relay that already committed this message_id answers from the header
  // (duplicate = true) without reading the rest, so our later writes fail:
  // that is a success, and exactly what a retry after a lost reply meets.
  if (!up.ok() && !resp.duplicate()) return up;
  PublishResult out;
  out.message_id = resp.message_id();
  out.accounting = AccountingFromProto(resp.accounting());
  out.duplicate = resp.duplicate();
  return out;
}

absl::StatusOr<FetchedMessage> RelayClient::Fetch(const FetchOptions& opts) {
  KVRELAY_RETURN_IF_ERROR(CheckId("session", opts.session, true));
  KVRELAY_RETURN_IF_ERROR(CheckId("agent", opts.agent, true));
  grpc::ClientContext ctx;
  Prepare(&ctx, opts.wait);
  v1::FetchRequest req;
  req.set_session_id(opts.session);
  req.set_agent(opts.agent);
  req.set_auto_ack(opts.auto_ack);
  const grpc::internal::RpcMethod method(kFetchMethod, grpc::internal::RpcMethod::SERVER_STREAMING);
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(channel_.get(), method, &ctx, req));
  DeliveryStream<v1::FetchResponse> delivery(opts.progress);
  const absl::Status local = ConsumeDelivery(reader.get(), &ctx, &delivery);
  const grpc::Status s = reader->Finish();
  if (!local.ok()) return local;
  if (!s.ok()) return FromGrpcStatus(s);
  if (!delivery.done()) {
    return absl::DataLossError("fetch stream: ended without a trailer, expected header, chunks, trailer");
  }
  const v1::MessageHeader& h = delivery.header();
  FetchedMessage out;
  out.message_id = h.message_id();
  out.session_id = h.session_id();
  out.sender = h.sender();
  out.role = h.role();
  out.parent_id = h.parent_id();
  out.delivery_attempt = h.delivery_attempt();
  out.accounting = AccountingFromProto(h.accounting());
  out.message = delivery.TakeMessage();
  return out;
}

absl::Status RelayClient::Ack(const std::string& session, const std::string& agent,
                              const std::string& message_id, std::chrono::milliseconds deadline) {
  KVRELAY_RETURN_IF_ERROR(CheckId("session", session, true));
  KVRELAY_RETURN_IF_ERROR(CheckId("agent", agent, true));
  KVRELAY_RETURN_IF_ERROR(CheckId("message_id", message_id, true));
  grpc::ClientContext ctx;
  Prepare(&ctx, deadline);
  v1::AckRequest req;
  req.set_session_id(session);
  req.set_agent(agent);
  req.set_message_id(message_id);
  v1::AckResponse resp;
  return FromGrpcStatus(stub_->Ack(&ctx, req, &resp));
}

absl::StatusOr<uint32_t> RelayClient::CloseSession(const std::string& session,
                                                   std::chrono::milliseconds deadline) {
  KVRELAY_RETURN_IF_ERROR(CheckId("session", session, true));
  grpc::ClientContext ctx;
  Prepare(&ctx, deadline);
  v1::CloseSessionRequest req;
  req.set_session_id(session);
  v1::CloseSessionResponse resp;
  KVRELAY_RETURN_IF_ERROR(FromGrpcStatus(stub_->CloseSession(&ctx, req, &resp)));
  return resp.messages_freed();
}

absl::StatusOr<RelayStats> RelayClient::Stats(std::chrono::milliseconds deadline) {
  grpc::ClientContext ctx;
  Prepare(&ctx, deadline);
  v1::StatsRequest req;
  v1::StatsResponse r;
  KVRELAY_RETURN_IF_ERROR(FromGrpcStatus(stub_->Stats(&ctx, req, &r)));
  RelayStats s;
  s.messages_committed = r.messages_committed();
  s.messages_failed = r.messages_failed();
  s.messages_delivered = r.messages_delivered();
  s.messages_acked = r.messages_acked();
  s.received_bytes = r.received_bytes();
  s.full_bytes = r.full_bytes();
  s.sent_bytes = r.sent_bytes();
  s.sessions = r.sessions();
  s.mailbox_messages = r.mailbox_messages();
  s.mailbox_bytes = r.mailbox_bytes();
  s.inflight_bytes = r.inflight_bytes();
  s.store_bytes = r.store_bytes();
  s.version = r.version();
  return s;
}

const char* RecipientStateName(RecipientState state) {
  switch (state) {
    case RecipientState::kQueued: return "queued";
    case RecipientState::kCommitted: return "committed";
    case RecipientState::kDelivered: return "delivered";
    case RecipientState::kAcked: return "acked";
    case RecipientState::kDeadLettered: return "dead_lettered";
    case RecipientState::kUnspecified: break;
  }
  return "unspecified";
}

absl::StatusOr<MessageStatusResult> RelayClient::MessageStatus(const std::string& session,
                                                               const std::string& message_id,
                                                               std::chrono::milliseconds deadline) {
  KVRELAY_RETURN_IF_ERROR(CheckId("session", session, true));
  KVRELAY_RETURN_IF_ERROR(CheckId("message_id", message_id, true));
  grpc::ClientContext ctx;
  Prepare(&ctx, deadline);
  v1::MessageStatusRequest req;
  req.set_session_id(session);
  req.set_message_id(message_id);
  v1::MessageStatusResponse resp;
  KVRELAY_RETURN_IF_ERROR(FromGrpcStatus(stub_->MessageStatus(&ctx, req, &resp)));
  MessageStatusResult out;
  out.sender = resp.sender();
  out.forwarded_by = resp.forwarded_by();
  out.recipients.reserve(resp.recipients_size());
  for (const v1::RecipientStatus& r : resp.recipients()) {
    RecipientStatus& o = out.recipients.emplace_back();
    o.agent = r.agent();
    o.state = FromProto(r.state());
    o.relay = r.relay();
    o.reason = r.reason();
    o.attempts = r.attempts();
  }
  return out;
}

absl::StatusOr<CompressedMessage> RelayClient::Compress(const Turn& turn,
                                                        const std::string& policy,
                                                        std::chrono::milliseconds deadline,
                                                        const ProgressCallback& progress) {
  if (policy.empty()) return absl::InvalidArgumentError("policy: empty, expected a pipeline spec");
  KVRELAY_ASSIGN_OR_RETURN(v1::TurnGeometry geometry, TurnGeometryOf(turn));
  grpc::ClientContext ctx;
  Prepare(&ctx, deadline);
  const grpc::internal::RpcMethod method(kCompressMethod, grpc::internal::RpcMethod::BIDI_STREAMING);
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(channel_.get(), method,
                                                                                           &ctx));

  // The relay may stream the message back while the upload is still going
  // (layer by layer), so the reply is read on its own thread: one reader and
  // one writer at a time is what a gRPC sync stream allows.
  DeliveryStream<v1::CompressResponse> delivery(progress);
  absl::Status local;
  std::thread reader([&] { local = ConsumeDelivery(stream.get(), &ctx, &delivery); });
  v1::CompressRequest req;
  req.mutable_header()->set_policy(policy);
  *req.mutable_header()->mutable_geometry() = std::move(geometry);
  const WriteFn write = [&](const grpc::ByteBuffer& b) { return stream->Write(b); };
  absl::Status up = absl::CancelledError("upload stream broke");
  if (write(EncodeProto(req))) up = UploadTurn<v1::CompressRequest>(turn, nullptr, write, progress);
  if (up.ok()) stream->WritesDone();
  reader.join();
  const grpc::Status s = stream->Finish();
  if (!local.ok()) return local;
  if (!s.ok()) return FromGrpcStatus(s);
  if (!up.ok()) return up;
  if (!delivery.done()) {
    return absl::DataLossError("compress stream: ended without a trailer, expected header, chunks, trailer");
  }
  CompressedMessage out;
  out.accounting = AccountingFromProto(delivery.header().accounting());
  out.message = delivery.TakeMessage();
  return out;
}

absl::StatusOr<HealthStatus> RelayClient::Health(const std::string& service,
                                                 std::chrono::milliseconds deadline) {
  grpc::ClientContext ctx;
  Prepare(&ctx, deadline);
  return CheckHealth(channel_, service, deadline, &ctx);
}

}  // namespace kvrelay
