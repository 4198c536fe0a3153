#include "server/metrics/metrics.h"

#include <vector>

#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace kvrelay {

std::string PolicyFamily(const std::string& spec) {
  std::vector<std::string> names;
  for (absl::string_view stage : absl::StrSplit(spec, '+')) {
    names.emplace_back(stage.substr(0, stage.find(':')));
  }
  return absl::StrJoin(names, "+");
}

const char* GrpcCodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::OK: return "OK";
    case grpc::CANCELLED: return "CANCELLED";
    case grpc::UNKNOWN: return "UNKNOWN";
    case grpc::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::NOT_FOUND: return "NOT_FOUND";
    case grpc::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case grpc::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case grpc::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::ABORTED: return "ABORTED";
    case grpc::OUT_OF_RANGE: return "OUT_OF_RANGE";
    case grpc::UNIMPLEMENTED: return "UNIMPLEMENTED";
    case grpc::INTERNAL: return "INTERNAL";
    case grpc::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::DATA_LOSS: return "DATA_LOSS";
    case grpc::UNAUTHENTICATED: return "UNAUTHENTICATED";
    default: return "UNKNOWN";
  }
}

namespace {
prometheus::Histogram::BucketBoundaries AttentionErrorBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0};
}

prometheus::Histogram::BucketBoundaries SecondsBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30};
}
// A forward waits out retries with backoff for up to --forward-timeout-seconds
// (300 by default).
prometheus::Histogram::BucketBoundaries ForwardSecondsBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300};
}

prometheus::Family<prometheus::Counter>& Counters(prometheus::Registry& r, const char* name, const char* help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(r);
}

prometheus::Family<prometheus::Gauge>& Gauges(prometheus::Registry& r, const char* name, const char* help) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(r);
}

prometheus::Family<prometheus::Histogram>& Histograms(prometheus::Registry& r, const char* name, const char* help) {
  return prometheus::BuildHistogram().Name(name).Help(help).Register(r);
}

// The buckets of one fdatasync.
prometheus::Histogram::BucketBoundaries FsyncSecondsBuckets() {
  return {0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1};
}
}  // namespace

// Every labelled family starts with its series at 0, so that rate() and
// increase() see their first increments (Prometheus takes a new series'
// first value as its start).
Metrics::Metrics() : registry_(std::make_shared<prometheus::Registry>()) {
  RegisterTraffic();
  RegisterRpcs();
  RegisterStore();
  RegisterMesh();
  RegisterSecurity();
  RegisterSpool();
  Gauges(*registry_, "kvrelay_build_info", "Build information; the value is always 1.")
      .Add({{"version", KVRELAY_VERSION}})
      .Set(1);
}

// Bytes and messages through the relay, compression and its fidelity.
void Metrics::RegisterTraffic() {
  prometheus::Registry& r = *registry_;
  received_ = &Counters(r, "kvrelay_received_bytes_total",
                   "Tensor bytes uploaded to the relay (Publish and Compress).")
             .Add({});
  full_ = &Counters(r, "kvrelay_full_bytes_total",
                   "Bytes the `full` policy would send for the committed messages.");
  sent_ = &Counters(r, "kvrelay_sent_bytes_total",
                   "Bytes the committed messages send, after compression.");
  wire_ = &Counters(r, "kvrelay_wire_bytes_total",
                   "Bytes that crossed the network on relay-to-relay forwards sent from here, every "
                   "attempt's chunk data after the wire codec (--wire-codec).");
  saved_ = &Counters(r, "kvrelay_saved_bytes_total",
                   "Bytes saved by compression (full minus sent).");
  messages_ = &Counters(r, "kvrelay_messages_total",
                   "Messages by outcome: committed, duplicate, failed, delivered, acked, expired and closed "
                   "(unacknowledged deliveries dropped by expiry or CloseSession).");
  compress_ = &Histograms(r, "kvrelay_compress_seconds",
                   "Worker seconds spent compressing one message.")
             .Add({}, SecondsBuckets());
  attention_error_ = &Histograms(r, "kvrelay_attention_output_relative_error",
                   "Per committed message whose turn carried queries (gen.q): the mean over layers of "
                   "|o_msg - o_full| / |o_full|, how much compression changed the sender's own attention "
                   "output. A proxy for the recipient's.");
  auto& granularity = Counters(r, "kvrelay_auto_granularity_layers_total",
                               "Layers of committed h2o-auto messages, by the granularity chosen for them: \"head\" "
                               "(attention concentrated: per-head top-k) or \"layer\" (one top-k set per layer).");
  auto_head_ = &granularity.Add({{"granularity", "head"}});
  auto_layer_ = &granularity.Add({{"granularity", "layer"}});
  visible_ = &Histograms(r, "kvrelay_publish_visible_seconds",
                   "Seconds from a publish's first request to its message becoming visible.")
             .Add({}, SecondsBuckets());
  delivered_ = &Histograms(r, "kvrelay_publish_delivered_seconds",
                   "Seconds from a publish's first request to its first complete delivery to a recipient "
                   "(one observation per recipient).")
             .Add({}, SecondsBuckets());
  invariant_violations_ = &Counters(r, "kvrelay_pipeline_invariant_violations_total",
                   "Uploads refused as INTERNAL because the compression pipeline's output broke an "
                   "invariant (token counts, positions, sizes, finite acc); nothing was committed.")
             .Add({});
  for (const char* o : {"committed", "duplicate", "failed", "delivered", "acked", "expired", "closed"}) {
    messages_->Add({{"outcome", o}});
  }
}

// Finished RPCs by method and code.
void Metrics::RegisterRpcs() {
  prometheus::Registry& r = *registry_;
  errors_ = &Counters(r, "kvrelay_errors_total",
                   "Failed RPCs by gRPC status code.");
  rpcs_ = &Counters(r, "kvrelay_rpcs_total",
                   "Finished RPCs of the Relay service by method and gRPC status code (OK included).");
  // Every method with every code the relay answers with.
  const grpc::StatusCode codes[] = {grpc::OK,
                                    grpc::CANCELLED,
                                    grpc::INVALID_ARGUMENT,
                                    grpc::DEADLINE_EXCEEDED,
                                    grpc::UNAUTHENTICATED,
                                    grpc::PERMISSION_DENIED,
                                    grpc::NOT_FOUND,
                                    grpc::ALREADY_EXISTS,
                                    grpc::RESOURCE_EXHAUSTED,
                                    grpc::FAILED_PRECONDITION,
                                    grpc::UNAVAILABLE,
                                    grpc::DATA_LOSS,
                                    grpc::INTERNAL};
  for (const char* m :
       {"Publish", "Fetch", "Compress", "Ack", "CloseSession", "Stats", "MessageStatus", "Forward", "ReportRecipient"}) {
    for (grpc::StatusCode c : codes) rpcs_->Add({{"method", m}, {"code", GrpcCodeName(c)}});
  }
  for (grpc::StatusCode c : codes) {
    if (c != grpc::OK) errors_->Add({{"code", GrpcCodeName(c)}});
  }
}

// What the store holds and its limits.
void Metrics::RegisterStore() {
  prometheus::Registry& r = *registry_;
  inflight_ = &Gauges(r, "kvrelay_inflight_bytes",
                   "Bytes reserved by uploads in progress.")
             .Add({});
  mailbox_messages_ = &Gauges(r, "kvrelay_mailbox_messages",
                   "Unacknowledged deliveries held, all sessions.")
             .Add({});
  mailbox_bytes_ = &Gauges(r, "kvrelay_mailbox_bytes",
                   "Bytes of unacknowledged deliveries held, all sessions.")
             .Add({});
  store_bytes_ = &Gauges(r, "kvrelay_store_bytes",
                   "Bytes of every retained message, acked or not, all sessions.")
             .Add({});
  fetches_waiting_ = &Gauges(r, "kvrelay_fetches_waiting",
                             "Fetch calls waiting for a message for their agent (parked, not delivering).")
                         .Add({});
  limits_ = &Gauges(r, "kvrelay_limit_bytes",
                   "Configured byte limits: inflight, mailbox (per session and agent), session, store.");
}

// Forwards to and from other relays, and the outbox.
void Metrics::RegisterMesh() {
  prometheus::Registry& r = *registry_;
  forward_bytes_ = &Counters(r, "kvrelay_forward_bytes_total",
                   "Tensor bytes sent on relay-to-relay forwards, every attempt's chunk data.")
             .Add({});
  forward_full_ = &Counters(r, "kvrelay_forward_full_bytes_total",
                   "Bytes the `full` policy (dense) would have sent for the forwarded messages, once per "
                   "message and destination relay, when the destination commits it.")
             .Add({});
  forward_elided_ = &Counters(r, "kvrelay_forward_elided_bytes_total",
                   "Bytes of forwarded messages not sent because the destination relay holds the ancestor "
                   "they start with (ancestor elision).")
             .Add({});
  forwards_ = &Counters(r, "kvrelay_forwards_total",
                   "Forwards to other relays by outcome: committed, duplicate (the destination held it), "
                   "retry (an attempt failed and is retried), whole (the destination lacked the ancestor; "
                   "resent whole) and dead_letter.");
  forward_seconds_ = &Histograms(r, "kvrelay_forward_seconds",
                   "Seconds from a message's commit at this relay to its commit at the destination relay.")
             .Add({}, ForwardSecondsBuckets());
  outbox_messages_ = &Gauges(r, "kvrelay_outbox_messages",
                   "Messages waiting to be forwarded to other relays.")
             .Add({});
  outbox_bytes_ = &Gauges(r, "kvrelay_outbox_bytes",
                   "Bytes of the messages waiting to be forwarded to other relays.")
             .Add({});
  dead_letters_ = &Counters(r, "kvrelay_dead_letters_total",
                   "Forwarded messages given up for a recipient, by the gRPC code of the reason.");
  forwards_received_ = &Counters(r, "kvrelay_forwards_received_total",
                   "Forwards from other relays by outcome: committed, duplicate and refused.");
  for (const char* o : {"committed", "duplicate", "retry", "whole", "dead_letter"}) {
    forwards_->Add({{"outcome", o}});
  }
  for (grpc::StatusCode c : {grpc::INVALID_ARGUMENT, grpc::ALREADY_EXISTS, grpc::FAILED_PRECONDITION,
                             grpc::PERMISSION_DENIED, grpc::DEADLINE_EXCEEDED, grpc::UNAVAILABLE,
                             grpc::RESOURCE_EXHAUSTED, grpc::NOT_FOUND}) {
    dead_letters_->Add({{"code", GrpcCodeName(c)}});
  }
  for (const char* o : {"committed", "duplicate", "refused"}) {
    forwards_received_->Add({{"outcome", o}});
  }
}

// Refused credentials and plaintext listeners.
void Metrics::RegisterSecurity() {
  prometheus::Registry& r = *registry_;
  auth_failures_ = &Counters(r, "kvrelay_auth_failures_total",
                   "Calls refused for their credentials or their rights, by reason: missing_credentials, "
                   "bad_token, bad_certificate, peer_not_allowed, forbidden.");
  for (const char* reason : {"missing_credentials", "bad_token", "bad_certificate", "peer_not_allowed", "forbidden"}) {
    auth_failures_->Add({{"reason", reason}});
  }
  insecure_ = &Gauges(r, "kvrelay_insecure",
                   "1 when a non-loopback gRPC listener serves plaintext (--insecure), else 0.")
             .Add({});
}

// The spool: its size, fsyncs, recovery and quarantine.
void Metrics::RegisterSpool() {
  prometheus::Registry& r = *registry_;
  spool_bytes_ = &Gauges(r, "kvrelay_spool_bytes",
                   "Bytes of message files and journal in --spool-dir (0 without a spool).")
             .Add({});
  spool_failed_ = &Gauges(r, "kvrelay_spool_failed",
                   "1 once the spool took an I/O error it does not recover from: the relay takes no writes "
                   "and reports NOT_SERVING until it is restarted.")
             .Add({});
  spool_fsync_ = &Histograms(r, "kvrelay_spool_fsync_seconds",
                   "Seconds of one fdatasync of a spool message file or journal batch.")
             .Add({}, FsyncSecondsBuckets());
  spool_recovery_ = &Gauges(r, "kvrelay_spool_recovery_seconds",
                   "Seconds the last start-up spent recovering --spool-dir.")
             .Add({});
  spool_recovery_crc_ = &Gauges(r, "kvrelay_spool_recovery_crc_seconds",
                   "Of kvrelay_spool_recovery_seconds, the CRC32C checks of the message files.")
             .Add({});
  spool_recovered_ = &Gauges(r, "kvrelay_spool_recovered",
                   "What the last start-up recovered from --spool-dir: messages, sessions, closed "
                   "(tombstones), outbox (forwards resumed), orphans (files removed), torn_bytes (cut off "
                   "the journal).");
  for (const char* w : {"messages", "sessions", "closed", "outbox", "orphans", "torn_bytes"}) {
    spool_recovered_->Add({{"what", w}});
  }
  spool_quarantined_ = &Counters(r, "kvrelay_spool_quarantined_total",
                   "Damaged spool files moved to DIR/quarantine (message_file, journal), message files a "
                   "damaged or missing journal does not name (unproven), and messages the journal names "
                   "whose file is gone (missing). Never served.");
  for (const char* w : {"message_file", "journal", "unproven", "missing"}) spool_quarantined_->Add({{"what", w}});
}

void Metrics::DeclareFamily(const std::string& family) {
  for (auto* f : {full_, sent_, saved_, wire_}) f->Add({{"family", family}});
  attention_error_->Add({{"family", family}}, AttentionErrorBuckets());
}

void Metrics::ObserveAttentionError(const std::string& family, double e) {
  attention_error_->Add({{"family", family}}, AttentionErrorBuckets()).Observe(e);
}

void Metrics::AddAutoGranularity(uint64_t head_layers, uint64_t layer_layers) {
  auto_head_->Increment(static_cast<double>(head_layers));
  auto_layer_->Increment(static_cast<double>(layer_layers));
}

void Metrics::AddCommitted(const std::string& family, uint64_t full, uint64_t sent) {
  full_->Add({{"family", family}}).Increment(static_cast<double>(full));
  sent_->Add({{"family", family}}).Increment(static_cast<double>(sent));
  saved_->Add({{"family", family}}).Increment(full > sent ? static_cast<double>(full - sent) : 0.0);
}

void Metrics::AddWireBytes(const std::string& family, uint64_t bytes) {
  wire_->Add({{"family", family}}).Increment(static_cast<double>(bytes));
}

void Metrics::AddOutcome(const std::string& outcome, double n) {
  messages_->Add({{"outcome", outcome}}).Increment(n);
}

void Metrics::AddRpc(const char* method, grpc::StatusCode code) {
  rpcs_->Add({{"method", method}, {"code", GrpcCodeName(code)}}).Increment();
  if (code != grpc::StatusCode::OK) errors_->Add({{"code", GrpcCodeName(code)}}).Increment();
}

}  // namespace kvrelay
