#include "server/metrics.h"

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
}  // namespace

Metrics::Metrics() : registry_(std::make_shared<prometheus::Registry>()) {
  using namespace prometheus;
  received_ = &BuildCounter()
                   .Name("kvrelay_received_bytes_total")
                   .Help("Tensor bytes uploaded to the relay (Publish and Compress).")
                   .Register(*registry_)
                   .Add({});
  full_ = &BuildCounter()
               .Name("kvrelay_full_bytes_total")
               .Help("Bytes the `full` policy would send for the committed messages.")
               .Register(*registry_);
  sent_ = &BuildCounter()
               .Name("kvrelay_sent_bytes_total")
               .Help("Bytes the committed messages send, after compression.")
               .Register(*registry_);
  wire_ = &BuildCounter()
               .Name("kvrelay_wire_bytes_total")
               .Help("Bytes that crossed the network on relay-to-relay forwards sent from here, every attempt's "
                     "chunk data after the wire codec (--wire-codec).")
               .Register(*registry_);
  saved_ = &BuildCounter()
                .Name("kvrelay_saved_bytes_total")
                .Help("Bytes saved by compression (full minus sent).")
                .Register(*registry_);
  messages_ = &BuildCounter()
                   .Name("kvrelay_messages_total")
                   .Help("Messages by outcome: committed, duplicate, failed, delivered, acked, expired and closed "
                         "(unacknowledged deliveries dropped by expiry or CloseSession).")
                   .Register(*registry_);
  errors_ = &BuildCounter()
                 .Name("kvrelay_errors_total")
                 .Help("Failed RPCs by gRPC status code.")
                 .Register(*registry_);
  rpcs_ = &BuildCounter()
               .Name("kvrelay_rpcs_total")
               .Help("Finished RPCs of the Relay service by method and gRPC status code (OK included).")
               .Register(*registry_);
  compress_ = &BuildHistogram()
                   .Name("kvrelay_compress_seconds")
                   .Help("Worker seconds spent compressing one message.")
                   .Register(*registry_)
                   .Add({}, SecondsBuckets());
  attention_error_ = &BuildHistogram()
                          .Name("kvrelay_attention_output_relative_error")
                          .Help("Per committed message whose turn carried queries (gen.q): the mean over layers of "
                                "|o_msg - o_full| / |o_full|, how much compression changed the sender's own "
                                "attention output. A proxy for the recipient's.")
                          .Register(*registry_);
  {
    auto& g = BuildCounter()
                  .Name("kvrelay_auto_granularity_layers_total")
                  .Help("Layers of committed h2o-auto messages, by the granularity chosen for them: \"head\" "
                        "(attention concentrated: per-head top-k) or \"layer\" (one top-k set per layer).")
                  .Register(*registry_);
    auto_head_ = &g.Add({{"granularity", "head"}});
    auto_layer_ = &g.Add({{"granularity", "layer"}});
  }
  visible_ = &BuildHistogram()
                  .Name("kvrelay_publish_visible_seconds")
                  .Help("Seconds from a publish's first request to its message becoming visible.")
                  .Register(*registry_)
                  .Add({}, SecondsBuckets());
  delivered_ = &BuildHistogram()
                    .Name("kvrelay_publish_delivered_seconds")
                    .Help("Seconds from a publish's first request to its first complete delivery to a recipient "
                          "(one observation per recipient).")
                    .Register(*registry_)
                    .Add({}, SecondsBuckets());
  inflight_ = &BuildGauge()
                   .Name("kvrelay_inflight_bytes")
                   .Help("Bytes reserved by uploads in progress.")
                   .Register(*registry_)
                   .Add({});
  mailbox_messages_ = &BuildGauge()
                           .Name("kvrelay_mailbox_messages")
                           .Help("Unacknowledged deliveries held, all sessions.")
                           .Register(*registry_)
                           .Add({});
  mailbox_bytes_ = &BuildGauge()
                        .Name("kvrelay_mailbox_bytes")
                        .Help("Bytes of unacknowledged deliveries held, all sessions.")
                        .Register(*registry_)
                        .Add({});
  store_bytes_ = &BuildGauge()
                      .Name("kvrelay_store_bytes")
                      .Help("Bytes of every retained message, acked or not, all sessions.")
                      .Register(*registry_)
                      .Add({});
  limits_ = &BuildGauge()
                 .Name("kvrelay_limit_bytes")
                 .Help("Configured byte limits: inflight, mailbox (per session and agent), session, store.")
                 .Register(*registry_);
  forward_bytes_ = &BuildCounter()
                        .Name("kvrelay_forward_bytes_total")
                        .Help("Tensor bytes sent on relay-to-relay forwards, every attempt's chunk data.")
                        .Register(*registry_)
                        .Add({});
  forward_full_ = &BuildCounter()
                       .Name("kvrelay_forward_full_bytes_total")
                       .Help("Bytes the `full` policy (dense) would have sent for the forwarded messages, once per "
                             "message and destination relay, when the destination commits it.")
                       .Register(*registry_)
                       .Add({});
  invariant_violations_ = &BuildCounter()
                              .Name("kvrelay_pipeline_invariant_violations_total")
                              .Help("Uploads refused as INTERNAL because the compression pipeline's output broke an "
                                    "invariant (token counts, positions, sizes, finite acc); nothing was committed.")
                              .Register(*registry_)
                              .Add({});
  forward_elided_ = &BuildCounter()
                         .Name("kvrelay_forward_elided_bytes_total")
                         .Help("Bytes of forwarded messages not sent because the destination relay holds the "
                               "ancestor they start with (ancestor elision).")
                         .Register(*registry_)
                         .Add({});
  forwards_ = &BuildCounter()
                   .Name("kvrelay_forwards_total")
                   .Help("Forwards to other relays by outcome: committed, duplicate (the destination held it), "
                         "retry (an attempt failed and is retried), whole (the destination lacked the ancestor; "
                         "resent whole) and dead_letter.")
                   .Register(*registry_);
  forward_seconds_ = &BuildHistogram()
                          .Name("kvrelay_forward_seconds")
                          .Help("Seconds from a message's commit at this relay to its commit at the destination relay.")
                          .Register(*registry_)
                          .Add({}, ForwardSecondsBuckets());
  outbox_messages_ = &BuildGauge()
                          .Name("kvrelay_outbox_messages")
                          .Help("Messages waiting to be forwarded to other relays.")
                          .Register(*registry_)
                          .Add({});
  outbox_bytes_ = &BuildGauge()
                       .Name("kvrelay_outbox_bytes")
                       .Help("Bytes of the messages waiting to be forwarded to other relays.")
                       .Register(*registry_)
                       .Add({});
  dead_letters_ = &BuildCounter()
                       .Name("kvrelay_dead_letters_total")
                       .Help("Forwarded messages given up for a recipient, by the gRPC code of the reason.")
                       .Register(*registry_);
  forwards_received_ = &BuildCounter()
                            .Name("kvrelay_forwards_received_total")
                            .Help("Forwards from other relays by outcome: committed, duplicate and refused.")
                            .Register(*registry_);
  auth_failures_ = &BuildCounter()
                        .Name("kvrelay_auth_failures_total")
                        .Help("Calls refused for their credentials or their rights, by reason: missing_credentials, "
                              "bad_token, bad_certificate, peer_not_allowed, forbidden.")
                        .Register(*registry_);
  for (const char* r : {"missing_credentials", "bad_token", "bad_certificate", "peer_not_allowed", "forbidden"}) {
    auth_failures_->Add({{"reason", r}});
  }
  insecure_ = &BuildGauge()
                   .Name("kvrelay_insecure")
                   .Help("1 when a non-loopback gRPC listener serves plaintext (--insecure), else 0.")
                   .Register(*registry_)
                   .Add({});
  spool_bytes_ = &BuildGauge()
                      .Name("kvrelay_spool_bytes")
                      .Help("Bytes of message files and journal in --spool-dir (0 without a spool).")
                      .Register(*registry_)
                      .Add({});
  spool_failed_ = &BuildGauge()
                       .Name("kvrelay_spool_failed")
                       .Help("1 once the spool took an I/O error it does not recover from: the relay takes no "
                             "writes and reports NOT_SERVING until it is restarted.")
                       .Register(*registry_)
                       .Add({});
  spool_fsync_ = &BuildHistogram()
                      .Name("kvrelay_spool_fsync_seconds")
                      .Help("Seconds of one fdatasync of a spool message file or journal batch.")
                      .Register(*registry_)
                      .Add({}, prometheus::Histogram::BucketBoundaries{0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                                                                       0.025, 0.05, 0.1, 0.25, 1});
  spool_recovery_ = &BuildGauge()
                         .Name("kvrelay_spool_recovery_seconds")
                         .Help("Seconds the last start-up spent recovering --spool-dir.")
                         .Register(*registry_)
                         .Add({});
  spool_recovery_crc_ = &BuildGauge()
                             .Name("kvrelay_spool_recovery_crc_seconds")
                             .Help("Of kvrelay_spool_recovery_seconds, the CRC32C checks of the message files.")
                             .Register(*registry_)
                             .Add({});
  spool_recovered_ = &BuildGauge()
                          .Name("kvrelay_spool_recovered")
                          .Help("What the last start-up recovered from --spool-dir: messages, sessions, closed "
                                "(tombstones), outbox (forwards resumed), orphans (files removed), torn_bytes "
                                "(cut off the journal).")
                          .Register(*registry_);
  for (const char* w : {"messages", "sessions", "closed", "outbox", "orphans", "torn_bytes"}) {
    spool_recovered_->Add({{"what", w}});
  }
  spool_quarantined_ = &BuildCounter()
                            .Name("kvrelay_spool_quarantined_total")
                            .Help("Damaged spool files moved to DIR/quarantine (message_file, journal), message "
                                  "files a damaged or missing journal does not name (unproven), and messages "
                                  "the journal names whose file is gone (missing). Never served.")
                            .Register(*registry_);
  for (const char* w : {"message_file", "journal", "unproven", "missing"}) spool_quarantined_->Add({{"what", w}});
  BuildGauge()
      .Name("kvrelay_build_info")
      .Help("Build information; the value is always 1.")
      .Register(*registry_)
      .Add({{"version", KVRELAY_VERSION}})
      .Set(1);
  for (const char* o : {"committed", "duplicate", "failed", "delivered", "acked", "expired", "closed"}) {
    messages_->Add({{"outcome", o}});
  }
  // Series that exist from the start at 0, so that rate() and increase()
  // see their first increments (Prometheus takes a new series' first value
  // as its start): every method with every code the relay answers with.
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
