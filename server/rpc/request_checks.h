// Checks of request fields shared by the relay's calls. Each fails with
// INVALID_ARGUMENT naming the field, what was expected and what was found.
#ifndef KVRELAY_SERVER_RPC_REQUEST_CHECKS_H_
#define KVRELAY_SERVER_RPC_REQUEST_CHECKS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/ids.h"  // CheckId, for the ids of requests
#include "core/pipeline.h"
#include "core/turn.h"
#include "kvrelay/v1/relay.pb.h"
#include "server/store/store.h"

namespace kvrelay {

// At most this many recipients per publish (INVALID_ARGUMENT beyond).
inline constexpr int kMaxRecipients = 64;


// The spec bound (kMaxSpecBytes), checked before parsing so that the error
// names the header field. Specs are tens of bytes; the bound keeps error
// messages (which quote the spec) and log lines small, and under the 8 KiB of
// trailing metadata gRPC clients accept by default.
// `field` names the policy in the error.
absl::Status CheckPolicyLength(const std::string& policy, const std::string& field = "header.policy");

// An estimate of the multiply-adds compressing `layers` layers of geometry
// `geo` (n_history: the history each layer's compression holds, a parent's
// included) with `p` takes, from the header alone: with queries, scoring
// (score heads x the window's steps x every key x (head_dim + 96)) and the
// fidelity figure (score heads x n_gen x (every key + the message's keys) x
// (2 head_dim + 96)); with OBF, per KV head n_cand x head_dim^2 + head_dim^3.
// A softmax weight counts as 96 multiply-adds (what it costs on one core,
// so that head_dim 1 is not cheap). Selection, copies and quantization are
// linear in the upload's bytes and not counted. One core does some 2e10 a
// second (docs/OPERATING.md, "Compute per upload").
double UploadWork(const Pipeline& p, const TurnGeometry& geo, int layers, bool first_agent);

// INVALID_ARGUMENT when one layer's scoring from queries is past the core's
// per-layer bound (CheckQueryScoreWork, naming layer.0.gen.q: every layer
// has the header's geometry); else RESOURCE_EXHAUSTED naming the estimate
// (UploadWork), the limit and --max-upload-work when the estimate is over
// `limit`. The one check of Publish and Compress, made on the header before
// any chunk is accepted.
absl::Status CheckUploadWork(const Pipeline& p, const TurnGeometry& geo, int layers, bool first_agent,
                             double limit);

// The policy against the geometry: its quantization options against
// head_dim, and `window` only with queries. The error is prefixed by `field`.
absl::Status CheckPolicyFor(const Pipeline& p, const TurnGeometry& geo, const std::string& field);

// `recipients` (the field `field`): 1..kMaxRecipients ids (CheckId), each
// once; INVALID_ARGUMENT naming the field, or the first repeat and the
// recipient it repeats.
absl::Status CheckRecipients(const google::protobuf::RepeatedPtrField<std::string>& recipients,
                             absl::string_view field);

// What a retry of a message (a Publish or a Forward with a message id the
// session holds) repeats of it, as the request says it.
struct RetryHeader {
  const char* call;         // "publish" or "forward", for messages
  const char* prefix;       // of the request's message fields: "header." or "header.message."
  const char* policy_field;  // the field of the requested policy
  absl::string_view sender, role, parent_id, requested_policy;
  const v1::TurnGeometry* geometry = nullptr;
  // Compared as a set when set (a forward names only its destination's).
  const std::vector<std::string>* recipients = nullptr;
};

// OK when `now` asks for what the held `prior` holds: sender, recipients
// (when `now` names them), role, policy as requested, parent and each
// geometry field. ALREADY_EXISTS naming the first field that differs and
// both values otherwise; for another sender's message, only that it is
// another sender's (nothing of it is told). The tensor data is not compared
// (a retry is answered before it arrives).
absl::Status CheckRetryOf(const RetryHeader& now, const StoredMessage& prior);

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_RPC_REQUEST_CHECKS_H_
