#include "server/mesh/forwarder.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/crc32c.h"
#include "core/mutex.h"
#include "proto/raw_chunk.h"
#include "proto/stream_codec.h"
#include "proto/wire.h"
#include "proto/wire_codec.h"
#include "server/mesh/ancestor.h"
#include "server/metrics/metrics.h"
#include "server/mesh/routing.h"
#include "server/store/spool/crash_point.h"
#include "spdlog/spdlog.h"

namespace kvrelay {
namespace {

constexpr char kForwardMethod[] = "/kvrelay.v1.Relay/Forward";
constexpr char kReportMethod[] = "/kvrelay.v1.Relay/ReportRecipient";
constexpr char kCloseMethod[] = "/kvrelay.v1.Relay/CloseSession";
constexpr std::chrono::seconds kPeerCallTimeout(10);

template <typename D>
std::chrono::milliseconds Millis(D d) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(d);
}

bool Retryable(grpc::StatusCode c) {
  switch (c) {
    case grpc::INVALID_ARGUMENT:
    case grpc::ALREADY_EXISTS:
    case grpc::FAILED_PRECONDITION:
    case grpc::PERMISSION_DENIED:
    case grpc::UNAUTHENTICATED:
    case grpc::UNIMPLEMENTED:
    case grpc::NOT_FOUND:
    case grpc::OUT_OF_RANGE:
      return false;
    default:
      return true;
  }
}

}  // namespace

// ------------------------------------------------------------ ForwardSource

ForwardSource::ForwardSource(int layers, std::shared_ptr<const void> owner)
    : n_layers_(layers), layers_(layers) {
  if (owner) owners_.push_back(std::move(owner));
}

std::shared_ptr<ForwardSource> ForwardSource::OfCommitted(MessagePtr m) {
  auto s = std::make_shared<ForwardSource>(static_cast<int>(m->msg.layers.size()), m);
  for (size_t l = 0; l < m->msg.layers.size(); ++l) s->SetLayer(static_cast<int>(l), m->msg.layers[l]);
  s->Resolve(m);
  return s;
}

void ForwardSource::SetLayer(int l, const MessageLayer& layer) {
  auto v = std::make_unique<LayerView>();
  v->wire = LayerDeliveryOrder(layer, static_cast<uint32_t>(l));
  v->tokens = layer.tokens();
  v->dense = !layer.quant;
  if (v->dense) {
    v->k = layer.k.bytes();
    v->v = layer.v.bytes();
  }
  v->pos = absl::MakeConstSpan(layer.pos.data);
  if (layer.acc.empty()) v->zeros.assign(layer.pos.data.size(), 0.0f);
  const std::vector<float>& acc = layer.acc.empty() ? v->zeros : layer.acc;
  v->acc = {static_cast<uint32_t>(l), v1::PART_ACC,
            absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(acc.data()), acc.size() * sizeof(float))};
  v->wire.push_back(v->acc);
  MutexLock lock(&mu_);
  layers_[l] = std::move(v);
  cv_.SignalAll();
}

void ForwardSource::AddOwner(std::shared_ptr<const void> owner) {
  MutexLock lock(&mu_);
  owners_.push_back(std::move(owner));
}

void ForwardSource::Resolve(MessagePtr committed) {
  std::vector<std::shared_ptr<const void>> released;
  MutexLock lock(&mu_);
  if (resolved_) return;
  resolved_ = true;
  outcome_ = std::move(committed);
  if (outcome_) {
    resolved_at_ = Clock::now();
    released.swap(owners_);  // freed after the lock (the compression's reservation with it)
    owners_.push_back(outcome_);
  }
  cv_.SignalAll();
}

bool ForwardSource::WaitLayer(int l, LayerView* out, Clock::time_point deadline) {
  MutexLock lock(&mu_);
  while (layers_[l] == nullptr && !(resolved_ && !outcome_)) {
    if (!cv_.WaitUntil(&mu_, deadline)) break;
  }
  if (!layers_[l]) return false;
  *out = *layers_[l];
  return true;
}

MessagePtr ForwardSource::WaitOutcome(Clock::time_point deadline) {
  MutexLock lock(&mu_);
  while (!resolved_) {
    if (!cv_.WaitUntil(&mu_, deadline)) break;
  }
  return outcome_;
}

Clock::time_point ForwardSource::resolved_at() {
  MutexLock lock(&mu_);
  return resolved_at_;
}

// --------------------------------------------------------------- Forwarder

struct Forwarder::Job {
  std::string target;
  std::vector<std::string> recipients;  // neither committed nor dead-lettered yet
  v1::ForwardHeader header;
  std::shared_ptr<ForwardSource> source;
  uint64_t outbox_bytes = 0;
  Clock::time_point deadline;
  int attempts = 0;
  bool whole = false;          // elision refused or impossible: send whole
  bool counted = false;        // latency and full bytes observed
  std::string last_error;      // "CODE: message" of the last failed attempt
  grpc::ClientContext* ctx = nullptr;  // the attempt in flight (guarded by mu_)

  const std::string& session() const { return header.message().session_id(); }
  const std::string& id() const { return header.message().message_id(); }
};

Clock::time_point Forwarder::RealDeadline(const Job& job) { return Clock::now() + (job.deadline - time_->Now()); }

Forwarder::Forwarder(const ForwarderOptions& opts, const MessageIndex* messages, Outbox* outbox, PeerBook* peers,
                     const RouteTable* routes, Metrics* metrics)
    : opts_(opts),
      time_(opts.time),
      messages_(messages),
      outbox_(outbox),
      peer_book_(peers),
      routes_(routes),
      metrics_(metrics),
      peers_(opts.credentials) {
  for (int i = 0; i < std::max(1, opts_.threads); ++i) threads_.emplace_back([this] { Loop(); });
}

Forwarder::~Forwarder() {
  std::vector<std::shared_ptr<Job>> running;
  {
    MutexLock lock(&mu_);
    stop_ = true;
    for (const auto& j : running_) {
      if (j->ctx) j->ctx->TryCancel();
      running.push_back(j);
    }
  }
  for (const auto& j : running) j->source->Resolve(nullptr);  // wakes attempts waiting for layers
  cv_.SignalAll();
  for (std::thread& t : threads_) t.join();
}

v1::ForwardHeader ForwardHeaderOf(const StoredMessage& m) {
  v1::ForwardHeader fh;
  v1::MessageHeader* h = fh.mutable_message();
  FillMessageHeader(m.msg, h);
  h->set_session_id(m.session_id);
  h->set_message_id(m.message_id);
  h->set_sender(m.sender);
  h->set_role(m.role);
  h->set_parent_id(m.parent_id);
  h->mutable_accounting()->set_policy(m.msg.policy);
  fh.set_requested_policy(m.requested_policy);
  if (m.layout) *fh.mutable_geometry() = ToProto(*m.layout);
  return fh;
}

void Forwarder::Enqueue(const std::string& target, std::vector<std::string> recipients,
                        const v1::ForwardHeader& header, std::shared_ptr<ForwardSource> source,
                        uint64_t outbox_bytes) {
  auto job = std::make_shared<Job>();
  job->target = target;
  job->recipients = std::move(recipients);
  job->header = header;
  job->header.set_protocol_version(kForwardProtocolVersion);
  job->header.set_origin(opts_.advertise);
  job->source = std::move(source);
  job->outbox_bytes = outbox_bytes;
  job->deadline = time_->Now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(opts_.forward_timeout_seconds));
  for (const std::string& a : job->recipients) {
    outbox_->TrackRecipient(job->session(), job->id(), a, {TrackState::kQueued, target, "", 0});
  }
  peer_book_->AddPeer(job->session(), target);
  Schedule(job, time_->Now());
}

void Forwarder::Schedule(const std::shared_ptr<Job>& job, Clock::time_point at) {
  {
    MutexLock lock(&mu_);
    if (!stop_) {
      queue_.emplace(at, job);
      cv_.Signal();
      return;
    }
  }
  EndJob(job);  // drained or stopping: it was logged by Drain
}

void Forwarder::Loop() {
  MutexLock lock(&mu_);
  while (!stop_) {
    if (queue_.empty()) {
      cv_.Wait(&mu_);
      continue;
    }
    auto first = queue_.begin();
    if (first->first > time_->Now()) {
      time_->WaitUntil(&cv_, &mu_, first->first);
      continue;
    }
    std::shared_ptr<Job> job = first->second;
    queue_.erase(first);
    running_.push_back(job);
    mu_.Unlock();
    Attempt(job);
    mu_.Lock();
    running_.erase(std::find(running_.begin(), running_.end(), job));
    cv_.SignalAll();  // Drain watches the outbox empty
  }
}

void Forwarder::EndJob(const std::shared_ptr<Job>& job) {
  outbox_->ReleaseOutbox(job->target, job->outbox_bytes);
  job->outbox_bytes = 0;
}

void Forwarder::DeadLetter(const std::shared_ptr<Job>& job, const std::vector<std::string>& agents,
                           grpc::StatusCode code, const std::string& reason) {
  for (const std::string& a : agents) {
    spdlog::warn("forward dead-lettered session={} message={} to={} destination={} attempts={}: {}", job->session(),
                 job->id(), a, job->target, job->attempts, reason);
    outbox_->TrackRecipient(job->session(), job->id(), a,
                           {TrackState::kDeadLettered, job->target, reason, static_cast<uint32_t>(job->attempts)});
    if (metrics_) {
      metrics_->AddDeadLetter(code);
      metrics_->AddForwardOutcome("dead_letter");
    }
  }
}

bool Forwarder::UseWireCodec(const std::string& target) {
  if (!opts_.wire_codec_rans) return false;
  MutexLock lock(&mu_);
  auto it = legacy_until_.find(target);
  if (it == legacy_until_.end()) return true;
  if (time_->Now() < it->second) return false;
  legacy_until_.erase(it);
  return true;
}

void Forwarder::NoteLegacyPeer(const std::string& target) {
  MutexLock lock(&mu_);
  legacy_until_[target] = time_->Now() + kLegacyPeerRecheck;
}

namespace {

// The first request of a forward of `job`: its header for these recipients,
// the protocol, and the ancestor its tokens are elided after (if any).
v1::ForwardRequest ForwardHeaderRequest(const v1::ForwardHeader& header, const std::vector<std::string>& recipients,
                                        const MessagePtr& ancestor, bool coded, bool acc_suffix) {
  v1::ForwardRequest req;
  v1::ForwardHeader* h = req.mutable_header();
  *h = header;
  h->set_protocol_version(coded ? kForwardProtocolVersion : kForwardProtocolVersionV1);
  h->set_wire_codec(coded ? v1::WIRE_CODEC_RANS : v1::WIRE_CODEC_NONE);
  h->clear_recipients();
  for (const std::string& r : recipients) h->add_recipients(r);
  const uint32_t a = ancestor ? static_cast<uint32_t>(ancestor->msg.layers[0].tokens()) : 0;
  if (ancestor) {
    h->set_ancestor_id(ancestor->message_id);
    h->set_ancestor_tokens(a);
  }
  const v1::MessageHeader& m = h->message();
  const uint32_t n = m.n_history() + m.n_anchor() + m.n_kept() + m.n_gen() + m.n_demoted();
  h->mutable_message()->set_acc_tokens(acc_suffix ? n - a : n);
  return req;
}

// The destination's answer, or why there is none: a status that is not OK
// when the call failed, answered nothing, or answered something else.
grpc::Status ReadAnswer(grpc::Status status, bool answered, const grpc::ByteBuffer& wire, bool stalled,
                        double stall_seconds, v1::ForwardResponse* resp) {
  if (status.ok() && answered) {
    RawMessage raw;
    if (!raw.Reset(wire) || !raw.ParseAs(resp)) {
      status = grpc::Status(grpc::INTERNAL, "forward: the destination's answer is not a kvrelay.v1.ForwardResponse");
    }
  } else if (status.ok()) {
    status = grpc::Status(grpc::UNKNOWN, "forward: the destination answered nothing");
  }
  if (stalled) {
    status = grpc::Status(grpc::DEADLINE_EXCEEDED,
                          absl::StrCat("no progress for ", stall_seconds, " s (--forward-stall-seconds)"));
  }
  return status;
}

}  // namespace

// What one attempt's stream did.
struct Forwarder::Sent {
  bool ok = false;              // every write went through
  bool publish_failed = false;  // the publish failed, or its session is gone here
  bool mismatch = false;        // the message does not start with the ancestor's tokens
  MessagePtr committed;         // the publish's outcome, once known
  uint64_t sent = 0, wire = 0, elided = 0;
};

Forwarder::Sent Forwarder::SendForward(const std::shared_ptr<Job>& job, const v1::ForwardRequest& header,
                                       const MessagePtr& ancestor, bool acc_suffix, BlockingStream* stream) {
  const std::chrono::milliseconds stall(static_cast<int64_t>(opts_.stall_seconds * 1000));
  const bool coded = header.header().wire_codec() == v1::WIRE_CODEC_RANS;
  const WireEncodeOptions wire_opts =
      WireEncodeOptionsOf(static_cast<int>(header.header().message().kv_heads()), header.header().message().dtype());
  const int a = ancestor ? ancestor->msg.layers[0].tokens() : 0;
  Sent out;
  out.ok = stream->Write(EncodeProto(header), stall);
  TrailerBuilder trailer;
  for (int l = 0; out.ok && l < job->source->layers(); ++l) {
    ForwardSource::LayerView v;
    if (!job->source->WaitLayer(l, &v, RealDeadline(*job))) {
      out.publish_failed = true;
      break;
    }
    std::vector<TensorRef> tensors = v.wire;
    std::shared_ptr<const void> hold = job->source;
    if (ancestor) {
      const MessageLayer& al = ancestor->msg.layers[l];
      if (!PrefixMatches(v, al, a) || (acc_suffix && !AccPrefixMatches(v, al, a))) {
        out.mismatch = true;
        break;
      }
      std::shared_ptr<MessageLayer> suffix = SuffixAfter(v, al, a, acc_suffix);
      tensors = LayerDeliveryOrder(*suffix, static_cast<uint32_t>(l), /*with_acc=*/acc_suffix);
      if (!acc_suffix) tensors.push_back(v.acc);  // the source's
      out.elided += TotalBytes(v.wire) - TotalBytes(tensors);
      hold = std::make_shared<std::pair<std::shared_ptr<const void>, std::shared_ptr<const void>>>(suffix, hold);
    }
    if (coded) {
      out.sent += TotalBytes(tensors);  // what is carried, elided or not, as one blob
      auto blob = std::make_shared<WireBlob>(EncodeWireLayer(tensors, wire_opts));
      tensors = {TensorRef{static_cast<uint32_t>(l), v1::PART_WIRE_LAYER, *blob}};
      hold = std::make_shared<std::pair<std::shared_ptr<const void>, std::shared_ptr<const void>>>(blob, hold);
    }
    ChunkCursor cursor(std::move(tensors));
    ChunkCursor::Piece p;
    while (out.ok && cursor.Next(&p)) {
      const uint32_t crc = Crc32c(p.data.data(), p.data.size());
      trailer.Add(crc, p.data.size());
      out.wire += p.data.size();
      if (!coded) out.sent += p.data.size();
      out.ok = stream->Write(EncodeChunkNoCopy(v1::ForwardRequest::kChunkFieldNumber, p.layer, p.part, p.offset,
                                               p.data, crc, hold),
                             stall);
    }
    CrashPoint("forward.mid_stream");
  }
  if (out.ok && !out.publish_failed && !out.mismatch) {
    out.committed = job->source->WaitOutcome(RealDeadline(*job));
    if (!out.committed) out.publish_failed = true;
  }
  // From here a close of the session here is passed on to the destination;
  // a session already gone (closed right after the commit) sends nothing.
  if (out.ok && out.committed && !peer_book_->AddPeer(job->session(), job->target)) out.publish_failed = true;
  if (out.publish_failed || out.mismatch) stream->Cancel();
  if (out.ok && out.committed && !out.publish_failed) {
    v1::ForwardRequest commit;
    *commit.mutable_commit()->mutable_trailer() = trailer.Build();
    *commit.mutable_commit()->mutable_accounting() = ToProto(out.committed->accounting);
    commit.mutable_commit()->set_next_pos(out.committed->msg.next_pos);
    out.ok = stream->Write(EncodeProto(commit), stall) && stream->WritesDone(stall);
  }
  return out;
}

void Forwarder::AwaitPublish(const std::shared_ptr<Job>& job, Sent* sent) {
  if (sent->publish_failed || sent->committed) return;
  {
    MutexLock lock(&mu_);
    ++awaiting_outcome_;
  }
  sent->committed = job->source->WaitOutcome(RealDeadline(*job));
  {
    MutexLock lock(&mu_);
    --awaiting_outcome_;
  }
  if (!sent->committed) sent->publish_failed = true;
}

bool Forwarder::ResendIfAsked(const std::shared_ptr<Job>& job, const grpc::Status& status,
                              const v1::ForwardResponse& resp, bool coded, const MessagePtr& ancestor) {
  if (coded && status.error_code() == grpc::FAILED_PRECONDITION &&
      status.error_message().find("header.protocol_version") != std::string::npos) {
    spdlog::info("forward session={} message={} destination={}: it does not speak protocol {} ({}), sending "
                 "protocol {} (--wire-codec none) to it for {} min",
                 job->session(), job->id(), job->target, kForwardProtocolVersion, status.error_message(),
                 kForwardProtocolVersionV1, kLegacyPeerRecheck.count());
    NoteLegacyPeer(job->target);
    return true;
  }
  if (status.ok() && resp.ancestor_missing()) {
    spdlog::info("forward session={} message={} destination={}: it no longer holds ancestor {}, sending it whole",
                 job->session(), job->id(), job->target, ancestor ? ancestor->message_id : std::string("?"));
    if (metrics_) metrics_->AddForwardOutcome("whole");
    job->whole = true;
    return true;
  }
  return false;
}

void Forwarder::Attempt(const std::shared_ptr<Job>& job) {
  // A retry of a message this relay no longer holds (its session was closed
  // or expired here) is dropped. The first attempt starts before the commit.
  if (job->attempts > 0 && !messages_->Find(job->session(), job->id())) {
    spdlog::info("forward dropped session={} message={} destination={}: the session is gone here (closed or "
                 "expired)",
                 job->session(), job->id(), job->target);
    return EndJob(job);
  }
  ++job->attempts;
  const std::chrono::milliseconds stall(static_cast<int64_t>(opts_.stall_seconds * 1000));

  MessagePtr ancestor =
      job->whole ? nullptr : FindElisionAncestor(*messages_, *peer_book_, job->session(), job->header.message(), job->target);
  const bool coded = UseWireCodec(job->target);
  // The acc goes whole, or with an ancestor only for the tokens after it
  // when the ancestor's tokens keep their acc: a turn without queries adds
  // no mass to its history (none can upload history.score with a parent).
  // A layer where that does not hold fails the elided attempt (mismatch),
  // and the message goes whole.
  const bool acc_suffix = ancestor && job->header.geometry().query_dtype() == v1::DTYPE_UNSPECIFIED;
  const v1::ForwardRequest req = ForwardHeaderRequest(job->header, job->recipients, ancestor, coded, acc_suffix);

  std::shared_ptr<grpc::Channel> channel = peers_.Get(job->target);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::duration_cast<std::chrono::system_clock::duration>(RealDeadline(*job) - Clock::now()));
  {
    mu_.Lock();
    if (stop_) {
      mu_.Unlock();
      return EndJob(job);
    }
    job->ctx = &ctx;
    mu_.Unlock();
  }
  BlockingStream stream(channel, kForwardMethod, &ctx);
  Sent sent = SendForward(job, req, ancestor, acc_suffix, &stream);
  grpc::ByteBuffer resp_wire;
  const bool answered = !sent.publish_failed && !sent.mismatch && stream.ReadResponse(&resp_wire, stall);
  grpc::Status status = stream.Finish();
  {
    MutexLock lock(&mu_);
    job->ctx = nullptr;
  }
  if (metrics_) {
    metrics_->AddForwardBytes(sent.sent);
    metrics_->AddWireBytes(PolicyFamily(job->header.message().accounting().policy()), sent.wire);
  }
  if (stream.stalled()) peers_.Reset(job->target, channel);
  // Nothing is recorded, and no retry scheduled, before the publish's
  // outcome: a message that is not committed here forwards nothing.
  AwaitPublish(job, &sent);
  if (sent.publish_failed) {
    spdlog::info("forward dropped session={} message={} destination={}: the publish failed", job->session(),
                 job->id(), job->target);
    return EndJob(job);
  }
  if (sent.mismatch) {
    spdlog::info("forward session={} message={} destination={}: its leading tokens differ from ancestor {}, "
                 "sending it whole",
                 job->session(), job->id(), job->target, ancestor->message_id);
    job->whole = true;
    return Schedule(job, time_->Now());
  }
  v1::ForwardResponse resp;
  status = ReadAnswer(status, answered, resp_wire, stream.stalled(), opts_.stall_seconds, &resp);
  if (ResendIfAsked(job, status, resp, coded, ancestor)) return Schedule(job, time_->Now());
  job->recipients = ApplyAnswer(job, status, resp, *sent.committed, sent.elided);
  if (job->recipients.empty()) return EndJob(job);
  ScheduleRetry(job);
}

int Forwarder::attempts_awaiting_outcome() {
  MutexLock lock(&mu_);
  return awaiting_outcome_;
}

std::vector<std::string> Forwarder::ApplyAnswer(const std::shared_ptr<Job>& job, grpc::Status status,
                                                const v1::ForwardResponse& resp, const StoredMessage& m,
                                                uint64_t elided) {
  if (status.ok() && resp.results_size() != static_cast<int>(job->recipients.size())) {
    status = grpc::Status(grpc::INTERNAL, absl::StrCat("forward: the destination answered for ", resp.results_size(),
                                                       " recipients, expected ", job->recipients.size()));
  }
  std::vector<std::string> retry;
  if (!status.ok()) {
    job->last_error = absl::StrCat(GrpcCodeName(status.error_code()), ": ", status.error_message());
    if (!Retryable(status.error_code())) {
      DeadLetter(job, job->recipients, status.error_code(), job->last_error);
      return retry;
    }
    retry = job->recipients;
    for (const std::string& agent : retry) {
      outbox_->TrackRecipient(job->session(), job->id(), agent,
                             {TrackState::kQueued, job->target, job->last_error, static_cast<uint32_t>(job->attempts)});
    }
    spdlog::info("forward attempt {} failed session={} message={} destination={}: {}", job->attempts,
                 job->session(), job->id(), job->target, job->last_error);
    return retry;
  }
  bool committed_any = false;
  for (int i = 0; i < resp.results_size(); ++i) {
    const v1::ForwardResult& r = resp.results(i);
    const std::string& agent = job->recipients[i];
    const auto code = static_cast<grpc::StatusCode>(r.code());
    if (code == grpc::OK) {
      committed_any = true;
      outbox_->TrackRecipient(job->session(), job->id(), agent,
                             {TrackState::kCommitted, job->target, "", static_cast<uint32_t>(job->attempts)});
      if (metrics_) metrics_->AddForwardOutcome(r.duplicate() ? "duplicate" : "committed");
      spdlog::info("forward committed session={} message={} to={} destination={} attempt={} duplicate={}",
                   job->session(), job->id(), agent, job->target, job->attempts, r.duplicate());
    } else if (Retryable(code)) {
      retry.push_back(agent);
      job->last_error = absl::StrCat(GrpcCodeName(code), ": ", r.message());
      outbox_->TrackRecipient(job->session(), job->id(), agent,
                             {TrackState::kQueued, job->target, job->last_error, static_cast<uint32_t>(job->attempts)});
    } else {
      DeadLetter(job, {agent}, code, absl::StrCat(GrpcCodeName(code), ": ", r.message()));
    }
  }
  if (committed_any) {
    peer_book_->NotePeerHolds(job->session(), job->id(), job->target);
    if (metrics_) {
      if (elided) metrics_->AddForwardElided(elided);
      if (!job->counted) {
        job->counted = true;
        metrics_->AddForwardFull(m.msg.full_bytes);
        metrics_->ObserveForward(std::chrono::duration<double>(Clock::now() - job->source->resolved_at()).count());
      }
    }
  }
  return retry;
}

void Forwarder::ScheduleRetry(const std::shared_ptr<Job>& job) {
  // Retry, unless that would pass the forward timeout.
  if (metrics_) metrics_->AddForwardOutcome("retry");
  const auto base = std::min<int64_t>(opts_.max_backoff.count(),
                                      opts_.initial_backoff.count() << std::min(job->attempts - 1, 20));
  thread_local std::mt19937_64 rng(std::random_device{}());
  const double jitter = std::uniform_real_distribution<double>(0.75, 1.25)(rng);
  const Clock::time_point at = time_->Now() + std::chrono::milliseconds(static_cast<int64_t>(base * jitter));
  if (at >= job->deadline) {
    DeadLetter(job, job->recipients, grpc::DEADLINE_EXCEEDED,
               absl::StrCat(GrpcCodeName(grpc::DEADLINE_EXCEEDED), ": gave up after ", job->attempts,
                            " attempts (--forward-timeout-seconds ",
                            opts_.forward_timeout_seconds, "), last: ", job->last_error));
    job->recipients.clear();
    return EndJob(job);
  }
  Schedule(job, at);
}

int Forwarder::Drain(std::chrono::milliseconds grace) {
  const Clock::time_point deadline = Clock::now() + grace;
  mu_.Lock();
  while (!(queue_.empty() && running_.empty())) {
    if (!cv_.WaitUntil(&mu_, deadline)) break;
  }
  int left = 0;
  for (const auto& [at, job] : queue_) {
    ++left;
    spdlog::warn("shutdown: not forwarded session={} message={} destination={} recipients={} attempts={} last={}",
                 job->session(), job->id(), job->target, absl::StrJoin(job->recipients, ","), job->attempts,
                 job->last_error);
  }
  for (const auto& job : running_) {  // its attempt's thread owns the recipients list
    ++left;
    spdlog::warn("shutdown: not forwarded (in flight, cancelled) session={} message={} destination={}",
                 job->session(), job->id(), job->target);
    if (job->ctx) job->ctx->TryCancel();
  }
  std::vector<std::shared_ptr<Job>> cleared;
  for (auto& [at, job] : queue_) cleared.push_back(job);
  queue_.clear();
  stop_ = true;  // attempts in flight end without a retry
  mu_.Unlock();
  for (const auto& job : cleared) EndJob(job);
  return left;
}

void Forwarder::Report(const StoredMessage& m, const std::string& agent, TrackState state) {
  std::string target = m.origin;
  if (target.empty() && routes_) {
    absl::StatusOr<std::optional<std::string>> r = routes_->Resolve(m.sender);
    if (r.ok() && *r) target = **r;
  }
  if (target.empty()) return;
  v1::ReportRecipientRequest req;
  req.set_session_id(m.session_id);
  req.set_message_id(m.message_id);
  req.set_agent(agent);
  req.set_state(static_cast<v1::RecipientState>(state));  // the same values
  peers_.CallAsync(target, kReportMethod, req, Millis(kPeerCallTimeout),
                   [target, id = m.message_id](const grpc::Status& s) {
                     if (!s.ok()) {
                       spdlog::info("report to {} for message {} failed (best effort): {}", target, id,
                                    s.error_message());
                     }
                   });
}

void Forwarder::PropagateClose(const std::string& session, const std::vector<std::string>& peers) {
  v1::CloseSessionRequest req;
  req.set_session_id(session);
  req.set_propagated(true);
  for (const std::string& peer : peers) {
    peers_.CallAsync(peer, kCloseMethod, req, Millis(kPeerCallTimeout), [peer, session](const grpc::Status& s) {
      if (!s.ok()) {
        spdlog::warn("close of session {} not passed on to {} (its TTL will expire it): {}", session, peer,
                     s.error_message());
      }
    });
  }
}

}  // namespace kvrelay
