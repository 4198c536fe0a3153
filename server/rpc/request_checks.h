// Checks of request fields shared by the relay's calls. Each fails with
// INVALID_ARGUMENT naming the field, what was expected and what was found.
#ifndef KVRELAY_SERVER_RPC_REQUEST_CHECKS_H_
#define KVRELAY_SERVER_RPC_REQUEST_CHECKS_H_

#include <string>

#include "absl/status/status.h"
#include "core/ids.h"  // CheckId, for the ids of requests
#include "core/pipeline.h"
#include "core/turn.h"

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

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_RPC_REQUEST_CHECKS_H_
