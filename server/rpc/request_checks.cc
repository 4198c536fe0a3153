#include "server/rpc/request_checks.h"

#include <algorithm>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/text_format.h"
#include "core/quant.h"
#include "core/status_macros.h"
#include "proto/wire.h"

namespace kvrelay {
namespace {

// A field's value for an error message; "unset" for an optional one not set.
std::string FieldText(const google::protobuf::Message& m, const google::protobuf::FieldDescriptor* f) {
  if (f->has_presence() && !m.GetReflection()->HasField(m, f)) return "unset";
  std::string out;
  if (f->is_repeated()) {
    out = "[";
    for (int i = 0; i < m.GetReflection()->FieldSize(m, f); ++i) {
      std::string item;
      google::protobuf::TextFormat::PrintFieldValueToString(m, f, i, &item);
      absl::StrAppend(&out, i ? "," : "", item);
    }
    return out + "]";
  }
  google::protobuf::TextFormat::PrintFieldValueToString(m, f, -1, &out);
  return out;
}

std::string Quoted(absl::string_view v) { return absl::StrCat("'", absl::CHexEscape(v), "'"); }

}  // namespace

absl::Status CheckRecipients(const google::protobuf::RepeatedPtrField<std::string>& recipients,
                             absl::string_view field) {
  if (recipients.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": empty, expected at least one agent"));
  if (recipients.size() > kMaxRecipients) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", recipients.size(), " agents, expected 1..", kMaxRecipients));
  }
  absl::flat_hash_map<absl::string_view, int> seen;
  for (int i = 0; i < recipients.size(); ++i) {
    const std::string name = absl::StrCat(field, "[", i, "]");
    KVRELAY_RETURN_IF_ERROR(CheckId(name, recipients[i]));
    auto [it, fresh] = seen.emplace(recipients[i], i);
    if (!fresh) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": ", Quoted(recipients[i]), " repeats ",
                                                     field.substr(field.rfind('.') + 1), "[",
                                                     it->second, "], expected distinct agents"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckRetryOf(const RetryHeader& now, const StoredMessage& prior) {
  const std::string held = absl::StrCat(now.prefix, "message_id: '", prior.message_id,
                                        "' is already committed in session '", prior.session_id, "'");
  if (now.sender != prior.sender) {
    return absl::AlreadyExistsError(absl::StrCat(held, " by another sender; choose another message id"));
  }
  auto differs = [&](absl::string_view field, absl::string_view was, absl::string_view is) {
    return absl::AlreadyExistsError(absl::StrCat(held, " with ", field, " ", was, ", this ", now.call, " has ", is,
                                                 "; reuse a message id only to retry the same ", now.call));
  };
  if (now.recipients) {
    std::vector<std::string> is = *now.recipients, was = prior.recipients;
    std::sort(is.begin(), is.end());
    std::sort(was.begin(), was.end());
    if (is != was) {
      return differs(absl::StrCat(now.prefix, "recipients"), absl::StrCat("[", absl::StrJoin(was, ","), "]"),
                     absl::StrCat("[", absl::StrJoin(is, ","), "]"));
    }
  }
  if (now.role != prior.role) return differs(absl::StrCat(now.prefix, "role"), Quoted(prior.role), Quoted(now.role));
  if (now.requested_policy != prior.requested_policy) {
    return differs(now.policy_field, Quoted(prior.requested_policy), Quoted(now.requested_policy));
  }
  if (now.parent_id != prior.parent_id) {
    return differs(absl::StrCat(now.prefix, "parent_id"), Quoted(prior.parent_id), Quoted(now.parent_id));
  }
  // What the prior call's header said, field for field (none: every field
  // at its default, as a header without geometry reads).
  const v1::TurnGeometry prior_geometry = prior.layout ? ToProto(*prior.layout) : v1::TurnGeometry();
  const google::protobuf::Descriptor* d = v1::TurnGeometry::descriptor();
  for (int i = 0; i < d->field_count(); ++i) {
    const std::string was = FieldText(prior_geometry, d->field(i)), is = FieldText(*now.geometry, d->field(i));
    if (was != is) return differs(absl::StrCat("header.geometry.", d->field(i)->name()), was, is);
  }
  return absl::OkStatus();
}

absl::Status CheckPolicyLength(const std::string& policy, const std::string& field) {
  if (policy.size() <= kMaxSpecBytes) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": ", policy.size(), " bytes, expected at most ", kMaxSpecBytes));
}

absl::Status CheckPolicyFor(const Pipeline& p, const TurnGeometry& geo, const std::string& field) {
  if (absl::Status s = p.CheckLayerwise(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", s.message()));
  }
  if (absl::Status s = p.CheckHeadDim(geo.head_dim); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", s.message()));
  }
  if (absl::Status s = p.CheckWindow(geo); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", s.message(),
                                                   " (header.geometry.query_dtype is unset)"));
  }
  return absl::OkStatus();
}

double UploadWork(const Pipeline& p, const TurnGeometry& geo, int layers, bool first_agent) {
  // A softmax weight (its exponential, the sums and the mass it adds), in
  // multiply-adds: what it costs on one core next to the GEMMs' FMAs, as
  // measured on a layer of head_dim 1 and a Qwen3-14B layer.
  constexpr double kExp = 96;
  const double d = geo.head_dim, score_heads = geo.score_heads, n_gen = geo.n_gen;
  const double keys = static_cast<double>(geo.n_history) + geo.n_prompt + geo.n_gen;
  Message counts;
  p.CountTokens(geo, first_agent, &counts);
  double layer = 0;
  if (geo.queries) {
    const int window = p.config().select.window;
    const double steps = window > 0 ? std::min(window, geo.n_gen) : geo.n_gen;
    layer += score_heads * steps * keys * (d + kExp);
    const double msg_keys = static_cast<double>(counts.n_history) + counts.n_anchor + counts.n_kept + counts.n_gen;
    layer += score_heads * n_gen * (keys + msg_keys) * (2 * d + kExp);
  }
  if (p.config().obf && counts.n_kept > 0) {
    const double n_cand = geo.n_prompt - counts.n_anchor;
    layer += static_cast<double>(geo.kv_heads) * (n_cand * d * d + d * d * d);
  }
  return layer * layers;
}

absl::Status CheckUploadWork(const Pipeline& p, const TurnGeometry& geo, int layers, bool first_agent,
                             double limit) {
  KVRELAY_RETURN_IF_ERROR(CheckQueryScoreWork(geo, "layer.0.gen.q"));
  const double work = UploadWork(p, geo, layers, first_agent);
  if (work <= limit) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrFormat(
      "header.geometry: compressing %d layers with '%s' takes about %.4g multiply-adds (%s), expected at most "
      "--max-upload-work=%.4g; the request alone is over the limit, so retrying cannot succeed (send fewer "
      "layers or tokens, prompt.score instead of gen.q, or a policy without obf)",
      layers, p.spec(), work,
      !geo.queries ? "obf" : p.config().obf ? "scoring from gen.q, the fidelity figure and obf"
                                            : "scoring from gen.q and the fidelity figure",
      limit));
}

}  // namespace kvrelay
