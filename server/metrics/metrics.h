// Prometheus metrics of the relay (prometheus-cpp).
//
//   kvrelay_received_bytes_total                 tensor bytes uploaded (Publish + Compress)
//   kvrelay_full_bytes_total{family}             what `full` would send, per committed message
//   kvrelay_sent_bytes_total{family}             what the committed messages send
//   kvrelay_wire_bytes_total{family}             what crossed the network on forwards sent from
//                                                here (every attempt's chunk data, wire-coded)
//   kvrelay_saved_bytes_total{family}            full - sent
//   kvrelay_messages_total{outcome}              committed, duplicate, failed, delivered, acked, expired,
//                                                closed
//   kvrelay_rpcs_total{method, code}             finished RPCs by method and gRPC code name (OK too)
//   kvrelay_errors_total{code}                   failed RPCs by gRPC code name
//   kvrelay_compress_seconds                     worker seconds per message
//   kvrelay_pipeline_invariant_violations_total  uploads refused as INTERNAL because the pipeline's
//                                                output broke an invariant (CheckLayerOutput)
//   kvrelay_attention_output_relative_error{family}  fidelity figure per committed message whose
//                                                turn carried queries (gen.q)
//   kvrelay_publish_visible_seconds              first request to visibility
//   kvrelay_publish_delivered_seconds            first request to the first complete delivery,
//                                                one observation per recipient
//   kvrelay_inflight_bytes                       reserved by uploads in progress
//   kvrelay_mailbox_messages, kvrelay_mailbox_bytes   unacked deliveries held
//   kvrelay_store_bytes                          every retained message (acked ones too)
//   kvrelay_limit_bytes{limit}                   the configured byte limits
//   kvrelay_forward_bytes_total                  tensor bytes sent relay to relay (every attempt)
//   kvrelay_forward_full_bytes_total             what `full` would send for the forwarded messages,
//                                                once per message and destination, at its commit
//   kvrelay_forward_elided_bytes_total           bytes ancestor elision kept off the wire
//   kvrelay_forwards_total{outcome}              committed, duplicate, retry, whole, dead_letter
//   kvrelay_forward_seconds                      sender relay's commit to the destination's commit
//   kvrelay_outbox_messages, kvrelay_outbox_bytes     messages waiting to be forwarded
//   kvrelay_dead_letters_total{code}             forwards given up, by the reason's gRPC code name
//   kvrelay_forwards_received_total{outcome}     forwards this relay took: committed, duplicate,
//                                                refused
//   kvrelay_auth_failures_total{reason}          calls refused for credentials or rights:
//                                                missing_credentials, bad_token, bad_certificate,
//                                                peer_not_allowed, forbidden
//   kvrelay_insecure                             1 when a non-loopback listener is plaintext
//   kvrelay_spool_bytes                          message files and journal on disk (--spool-dir)
//   kvrelay_spool_failed                         1 once the spool took an I/O error it cannot
//                                                recover from (NOT_SERVING until restarted)
//   kvrelay_spool_fsync_seconds                  one fdatasync of a message file or the journal
//   kvrelay_spool_recovery_seconds               the last start-up's recovery, and of it
//   kvrelay_spool_recovery_crc_seconds           the CRC32C checks of the message files
//   kvrelay_spool_recovered{what}                what it found: messages, sessions, closed, outbox,
//                                                orphans, torn_bytes
//   kvrelay_spool_quarantined_total{what}        files moved to DIR/quarantine (message_file, journal,
//                                                unproven: not named by a damaged or missing journal)
//                                                and messages the journal names without a file (missing)
//   kvrelay_build_info{version}                  1
//
// Forward outcomes: "retry" is an attempt that failed and will be retried,
// "whole" a destination that lacked the ancestor (the message is resent
// whole), "dead_letter" a recipient given up. No forward series carries the
// peer: peers can be many (per-peer detail is in the logs and the status RPC).
// Outcomes "expired" and "closed" count unacked deliveries dropped by the
// session's TTL and by CloseSession. `family` is the policy's stage names
// ("h2o-head+obf+int4"): low cardinality. Counters of every method and code
// the relay answers with, of every declared family, every forward outcome
// and every dead-letter code a forward can end with exist from the start at 0
// (so that rate() sees their first increments).
// Thread-safe.
#ifndef KVRELAY_SERVER_METRICS_METRICS_H_
#define KVRELAY_SERVER_METRICS_METRICS_H_

#include <map>
#include <memory>
#include <string>

#include "grpcpp/support/status.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace kvrelay {

// "h2o-head:k=32,sinks=4+obf:p=8+int4:group=32" -> "h2o-head+obf+int4".
std::string PolicyFamily(const std::string& canonical_spec);

// gRPC code name, e.g. "RESOURCE_EXHAUSTED".
const char* GrpcCodeName(grpc::StatusCode code);

class Metrics {
 public:
  Metrics();

  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  void AddReceived(uint64_t bytes) { received_->Increment(static_cast<double>(bytes)); }
  void AddCommitted(const std::string& family, uint64_t full, uint64_t sent);
  // Creates the byte counters of `family` at 0 (the server declares its
  // default and per-role policies' families at start).
  void DeclareFamily(const std::string& family);
  void AddOutcome(const std::string& outcome, double n = 1);
  // One finished RPC: kvrelay_rpcs_total{method, code}, and for a non-OK
  // code also kvrelay_errors_total{code}. `method` is the RPC's name
  // ("Publish", "Fetch", "Compress", "Ack", "CloseSession", "Stats",
  // "MessageStatus", "Forward", "ReportRecipient").
  void AddRpc(const char* method, grpc::StatusCode code);
  void ObserveCompress(double s) { compress_->Observe(s); }
  // kvrelay_attention_output_relative_error{family}: a committed message's
  // fidelity figure (turns with queries only).
  void ObserveAttentionError(const std::string& family, double e);
  // kvrelay_auto_granularity_layers_total{granularity}: layers of committed
  // h2o-auto messages selected per head ("head") or per layer ("layer").
  void AddAutoGranularity(uint64_t head_layers, uint64_t layer_layers);
  void ObserveVisible(double s) { visible_->Observe(s); }
  void ObserveDelivered(double s) { delivered_->Observe(s); }
  void SetInflight(double bytes) { inflight_->Set(bytes); }
  void SetMailbox(double messages, double bytes) {
    mailbox_messages_->Set(messages);
    mailbox_bytes_->Set(bytes);
  }
  void SetStoreBytes(double bytes) { store_bytes_->Set(bytes); }
  // Fetch calls parked in the store until a message for their agent arrives.
  void SetFetchesWaiting(double n) { fetches_waiting_->Set(n); }
  // Exports a configured limit as kvrelay_limit_bytes{limit=NAME}, so alerts
  // can compare usage gauges with it (e.g. "inflight", "mailbox", "store").
  void SetLimit(const std::string& name, double bytes) { limits_->Add({{"limit", name}}).Set(bytes); }

  // Relay-to-relay forwarding, as the sending relay sees it.
  // Chunk bytes of one forward attempt as they are sent (retries count again).
  void AddForwardBytes(uint64_t bytes) { forward_bytes_->Increment(static_cast<double>(bytes)); }
  // The same attempt's bytes as they crossed the network (after the wire
  // codec; equal to the tensor bytes with --wire-codec none).
  void AddWireBytes(const std::string& family, uint64_t bytes);
  // What `full` (dense, unquantized) would have sent for a message, once per
  // message and destination, when the destination commits it.
  void AddForwardFull(uint64_t bytes) { forward_full_->Increment(static_cast<double>(bytes)); }
  // Bytes that ancestor elision did not send.
  void AddForwardElided(uint64_t bytes) { forward_elided_->Increment(static_cast<double>(bytes)); }
  void AddInvariantViolation() { invariant_violations_->Increment(); }
  // REQUIRES: `outcome` is one of committed, duplicate, retry, whole,
  // dead_letter.
  void AddForwardOutcome(const std::string& outcome) { forwards_->Add({{"outcome", outcome}}).Increment(); }
  // Seconds from the commit at this relay to the commit at the destination.
  void ObserveForward(double s) { forward_seconds_->Observe(s); }
  void SetOutbox(double messages, double bytes) {
    outbox_messages_->Set(messages);
    outbox_bytes_->Set(bytes);
  }
  // One recipient given up; `reason` is the code of the last answer (or
  // DEADLINE_EXCEEDED past --forward-timeout-seconds).
  void AddDeadLetter(grpc::StatusCode reason) {
    dead_letters_->Add({{"code", GrpcCodeName(reason)}}).Increment();
  }
  // At the destination. REQUIRES: `outcome` is one of committed, duplicate,
  // refused.
  void AddForwardReceived(const std::string& outcome) {
    forwards_received_->Add({{"outcome", outcome}}).Increment();
  }

  // REQUIRES: `reason` is one of AuthFailureName's (server/auth/auth.h).
  void AddAuthFailure(const char* reason) { auth_failures_->Add({{"reason", reason}}).Increment(); }
  void SetInsecure(bool insecure) { insecure_->Set(insecure ? 1 : 0); }
  void SetSpoolBytes(double bytes) { spool_bytes_->Set(bytes); }
  void SetSpoolFailed(bool failed) { spool_failed_->Set(failed ? 1 : 0); }
  void ObserveSpoolFsync(double s) { spool_fsync_->Observe(s); }
  void SetSpoolRecovery(double seconds, double crc_seconds) {
    spool_recovery_->Set(seconds);
    spool_recovery_crc_->Set(crc_seconds);
  }
  void SetSpoolRecovered(const std::string& what, double n) { spool_recovered_->Add({{"what", what}}).Set(n); }
  void AddSpoolQuarantined(const std::string& what, double n = 1) {
    spool_quarantined_->Add({{"what", what}}).Increment(n);
  }

 private:
  // The constructor's parts, one per row of the dashboard.
  void RegisterTraffic();
  void RegisterRpcs();
  void RegisterStore();
  void RegisterMesh();
  void RegisterSecurity();
  void RegisterSpool();

  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Counter* received_;
  prometheus::Counter* invariant_violations_;
  prometheus::Family<prometheus::Counter>* full_;
  prometheus::Family<prometheus::Counter>* sent_;
  prometheus::Family<prometheus::Counter>* wire_;
  prometheus::Family<prometheus::Counter>* saved_;
  prometheus::Family<prometheus::Counter>* messages_;
  prometheus::Family<prometheus::Counter>* errors_;
  prometheus::Family<prometheus::Counter>* rpcs_;
  prometheus::Histogram* compress_;
  prometheus::Family<prometheus::Histogram>* attention_error_;
  prometheus::Counter* auto_head_;
  prometheus::Counter* auto_layer_;
  prometheus::Histogram* visible_;
  prometheus::Histogram* delivered_;
  prometheus::Gauge* inflight_;
  prometheus::Gauge* mailbox_messages_;
  prometheus::Gauge* mailbox_bytes_;
  prometheus::Gauge* store_bytes_;
  prometheus::Gauge* fetches_waiting_;
  prometheus::Family<prometheus::Gauge>* limits_;
  prometheus::Counter* forward_bytes_;
  prometheus::Counter* forward_full_;
  prometheus::Counter* forward_elided_;
  prometheus::Family<prometheus::Counter>* forwards_;
  prometheus::Histogram* forward_seconds_;
  prometheus::Gauge* outbox_messages_;
  prometheus::Gauge* outbox_bytes_;
  prometheus::Family<prometheus::Counter>* dead_letters_;
  prometheus::Family<prometheus::Counter>* forwards_received_;
  prometheus::Family<prometheus::Counter>* auth_failures_;
  prometheus::Gauge* insecure_;
  prometheus::Gauge* spool_bytes_;
  prometheus::Gauge* spool_failed_;
  prometheus::Histogram* spool_fsync_;
  prometheus::Gauge* spool_recovery_;
  prometheus::Gauge* spool_recovery_crc_;
  prometheus::Family<prometheus::Gauge>* spool_recovered_;
  prometheus::Family<prometheus::Counter>* spool_quarantined_;
};

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_METRICS_METRICS_H_
