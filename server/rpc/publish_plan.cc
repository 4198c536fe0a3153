#include "server/rpc/publish_plan.h"

#include <optional>

#include <algorithm>
#include <limits>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/history.h"
#include "core/status_macros.h"
#include "proto/wire.h"
#include "server/rpc/request_checks.h"
#include "server/mesh/routing.h"

namespace kvrelay {
absl::Status CheckSamePublish(const v1::PublishHeader& h, const StoredMessage& prior) {
  const std::vector<std::string> recipients(h.recipients().begin(), h.recipients().end());
  return CheckRetryOf({/*call=*/"publish", /*prefix=*/"header.", /*policy_field=*/"header.policy", h.sender(),
                       h.role(), h.parent_id(), h.policy(), &h.geometry(), &recipients},
                      prior);
}

uint64_t MinComposedBytes(const Pipeline& p, const UploadShape& shape, const Message* parent) {
  TurnGeometry g = shape.geo;
  if (parent) SetHistoryGeometry(*parent, &g);
  Message counts;
  p.CountTokens(g, shape.first_agent, &counts);
  const uint64_t tokens = static_cast<uint64_t>(counts.n_history) + counts.n_anchor + counts.n_kept + counts.n_gen;
  const uint64_t row = p.config().quant ? static_cast<uint64_t>(g.head_dim) * p.config().quant->bits / 8
                                        : static_cast<uint64_t>(g.head_dim) * DTypeSize(g.dtype);
  const uint64_t demoted_row = static_cast<uint64_t>(g.head_dim) * counts.demote_bits / 8;
  // Per token and head: K and V rows, its position id and its acc; the
  // demoted tokens' rows at their own bits.
  const uint64_t per_head = tokens * (2 * row + 4 + 4) + counts.n_demoted * (2 * demoted_row + 4 + 4);
  return RetainedBytes(static_cast<uint64_t>(shape.layers) * g.kv_heads * per_head,
                       static_cast<uint64_t>(shape.layers));
}

// The parent of a publish with parent_id, checked against the upload's
// shape (PlanPublish's contract, "with parent_id").
absl::StatusOr<MessagePtr> PlanParent(const v1::PublishHeader& h, const UploadShape& shape, const PlanInputs& in) {
  if (shape.geo.n_history != 0) {
    return absl::InvalidArgumentError(absl::StrCat("header.geometry.n_history: ", shape.geo.n_history,
                                                   ", expected 0 with parent_id (the relay supplies the history)"));
  }
  if (shape.first_agent) {
    return absl::InvalidArgumentError(
        "header.geometry.first_agent: true, expected false with parent_id (the parent holds the anchors)");
  }
  KVRELAY_ASSIGN_OR_RETURN(MessagePtr parent, in.store.LookupParent(h.session_id(), h.parent_id(), h.sender()));
  const Message& pm = parent->msg;
  if (static_cast<int>(pm.layers.size()) != shape.layers || pm.kv_heads != shape.geo.kv_heads ||
      pm.head_dim != shape.geo.head_dim || pm.dtype != shape.geo.dtype) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "header.parent_id: '%s' has %d layers x %d kv_heads x head_dim %d %s, expected the geometry's "
        "%d x %d x %d %s",
        h.parent_id(), pm.layers.size(), pm.kv_heads, pm.head_dim, std::string(DTypeName(pm.dtype)),
        shape.layers, shape.geo.kv_heads, shape.geo.head_dim, std::string(DTypeName(shape.geo.dtype))));
  }
  if (const int n = pm.layers[0].tokens(); shape.geo.history_score && shape.history_score_tokens != n) {
    return absl::FailedPreconditionError(absl::StrCat(
        "header.geometry.history_score_tokens: ", shape.history_score_tokens, ", expected 0 or ", n,
        " (the tokens per head of the parent '", h.parent_id(), "', which history.score covers)"));
  }
  if (shape.prompt_pos0 && *shape.prompt_pos0 < parent->msg.next_pos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.geometry.prompt_pos0: ", *shape.prompt_pos0, ", expected >= ", parent->msg.next_pos,
        " (where the parent '", h.parent_id(), "' ended: its history would share position ids with this "
        "prompt), or unset to continue there"));
  }
  if (!shape.prompt_pos0) {
    const int64_t pos0 = parent->msg.next_pos;  // computed when the parent was compressed
    if (pos0 + shape.geo.n_prompt + shape.geo.n_gen - 1 > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(absl::StrCat("header.geometry.prompt_pos0: ", pos0,
                                                     " (after the parent) puts position ids past int32"));
    }
  }
  return parent;
}

absl::StatusOr<PublishPlan> PlanPublish(const v1::PublishHeader& h, const PlanInputs& in) {
  PublishPlan plan;
  plan.header = h;
  KVRELAY_RETURN_IF_ERROR(CheckId("header.session_id", h.session_id()));
  if (!h.message_id().empty()) KVRELAY_RETURN_IF_ERROR(CheckId("header.message_id", h.message_id()));
  KVRELAY_RETURN_IF_ERROR(CheckId("header.sender", h.sender()));
  KVRELAY_RETURN_IF_ERROR(CheckRecipients(h.recipients(), "header.recipients"));
  if (h.role().size() > 128) {
    return absl::InvalidArgumentError(absl::StrCat("header.role: ", h.role().size(), " bytes, expected at most 128"));
  }
  if (!h.parent_id().empty()) KVRELAY_RETURN_IF_ERROR(CheckId("header.parent_id", h.parent_id()));
  if (!h.has_geometry()) return absl::InvalidArgumentError("header.geometry: missing, expected the turn's geometry");
  if (plan.header.message_id().empty()) {
    KVRELAY_ASSIGN_OR_RETURN(std::string id, in.new_message_id());
    plan.header.set_message_id(std::move(id));
  }

  // Idempotency: a committed id answers with the original accounting, if
  // this is a retry of the same publish.
  if (MessagePtr prior = in.store.Find(plan.header.session_id(), plan.header.message_id())) {
    KVRELAY_RETURN_IF_ERROR(CheckSamePublish(plan.header, *prior));
    plan.duplicate = std::move(prior);
    return plan;
  }
  KVRELAY_ASSIGN_OR_RETURN(UploadShape shape,
                           CheckGeometry(h.geometry(), "header.geometry", /*with_parent=*/!h.parent_id().empty()));
  KVRELAY_RETURN_IF_ERROR(CheckPolicyLength(h.policy()));
  const std::string& spec = h.policy().empty() ? in.config.PolicyForRole(h.role()) : h.policy();
  absl::StatusOr<std::unique_ptr<Pipeline>> pipeline = Pipeline::Create(spec);
  if (!pipeline.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(h.policy().empty() ? "policy (role default)" : "header.policy",
                                                   " '", spec, "': ", pipeline.status().message()));
  }
  KVRELAY_RETURN_IF_ERROR(CheckPolicyFor(**pipeline, shape.geo, "header.policy"));
  MessagePtr parent;
  if (!h.parent_id().empty()) {
    KVRELAY_ASSIGN_OR_RETURN(parent, PlanParent(h, shape, in));
  }
  // The prompt's first position id: as the header says, else after the
  // parent (its next_pos, computed when it was compressed), else after the
  // uploaded history.
  const int64_t pos0 = shape.prompt_pos0.value_or(parent ? parent->msg.next_pos : shape.geo.n_history);
  std::vector<std::string> recipients(h.recipients().begin(), h.recipients().end());
  // Where each recipient's mailbox is: here, or on the relay its route names.
  for (size_t i = 0; i < recipients.size(); ++i) {
    std::optional<std::string> target;
    if (in.routes) {
      KVRELAY_ASSIGN_OR_RETURN(target, in.routes->Resolve(recipients[i], absl::StrCat("header.recipients[", i, "]")));
    }
    if (target) {
      plan.remote[*target].push_back(recipients[i]);
    } else {
      plan.local.push_back(recipients[i]);
    }
  }
  // The composed message ([parent; kept prompt; generated]) must fit the
  // mailboxes here and the session's and store's byte limits: refuse it
  // before anything is uploaded or reserved.
  plan.min_bytes = MinComposedBytes(**pipeline, shape, parent ? &parent->msg : nullptr);
  KVRELAY_RETURN_IF_ERROR(in.store.CheckCanPublish(h.session_id(), plan.local, plan.min_bytes));
  plan.shape = shape;
  plan.pipeline = std::move(*pipeline);
  plan.parent = std::move(parent);
  plan.prompt_pos0 = pos0;
  plan.recipients = std::move(recipients);
  return plan;
}

v1::ForwardHeader ForwardHeaderFor(const PublishPlan& plan) {
  v1::ForwardHeader fh;
  const v1::PublishHeader& h = plan.header;
  v1::MessageHeader* m = fh.mutable_message();
  m->set_session_id(h.session_id());
  m->set_message_id(h.message_id());
  m->set_sender(h.sender());
  m->set_role(h.role());
  m->set_parent_id(h.parent_id());
  TurnGeometry geo = plan.shape.geo;
  if (plan.parent) SetHistoryGeometry(plan.parent->msg, &geo);
  Message counts;
  plan.pipeline->CountTokens(geo, plan.shape.first_agent, &counts);
  m->set_layers(static_cast<uint32_t>(plan.shape.layers));
  m->set_kv_heads(static_cast<uint32_t>(geo.kv_heads));
  m->set_head_dim(static_cast<uint32_t>(geo.head_dim));
  m->set_dtype(ToProtoDType(geo.dtype));
  m->set_n_history(static_cast<uint32_t>(counts.n_history));
  m->set_n_anchor(static_cast<uint32_t>(counts.n_anchor));
  m->set_n_kept(static_cast<uint32_t>(counts.n_kept));
  m->set_n_gen(static_cast<uint32_t>(counts.n_gen));
  for (int32_t p : AnchorPositions(geo, counts.n_anchor, plan.prompt_pos0)) m->add_anchor_pos(p);
  const PipelineConfig& cfg = plan.pipeline->config();
  SetQuantHeader(cfg.quant, counts.n_demoted, counts.demote_bits, cfg.LloydSeed(), m);
  m->mutable_accounting()->set_policy(plan.pipeline->spec());
  fh.set_requested_policy(h.policy());
  *fh.mutable_geometry() = h.geometry();
  return fh;
}

}  // namespace kvrelay
