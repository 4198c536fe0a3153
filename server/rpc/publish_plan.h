// Publish planning: everything a publish decides from its header before any
// tensor byte arrives, as a function of the header, the config and the store.
// No gRPC: the reactor calls PlanPublish and starts the upload it plans.
//
//   PlanInputs in{config, store, [&] { return NewMessageId(); }};
//   absl::StatusOr<PublishPlan> plan = PlanPublish(header, in);
//   if (plan.ok() && plan->duplicate) ...  // answer the retry, upload nothing
//   else if (plan.ok()) upload.Start(plan->shape, plan->pipeline, plan->parent, plan->prompt_pos0);
#ifndef KVRELAY_SERVER_RPC_PUBLISH_PLAN_H_
#define KVRELAY_SERVER_RPC_PUBLISH_PLAN_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/pipeline.h"
#include "kvrelay/v1/relay.pb.h"
#include "proto/stream_codec.h"
#include "server/config/config.h"
#include "server/store/store.h"

namespace kvrelay {

class RouteTable;

struct PlanInputs {
  const ServerConfig& config;  // the roles' default policies
  const Store& store;          // Find, LookupParent, CheckCanPublish
  // A fresh message id; called once, for a header without message_id. Its
  // error fails the publish (nothing is uploaded).
  std::function<absl::StatusOr<std::string>()> new_message_id;
  // Where recipients' mailboxes are (null: all here).
  const RouteTable* routes = nullptr;
};

struct PublishPlan {
  // The header as checked, with its message id (assigned when it had none).
  v1::PublishHeader header;
  // Set when header.message_id is already committed by the same publish (a
  // retry): the answer is this message's, and nothing is uploaded. The
  // fields below are then unset.
  MessagePtr duplicate;

  // The upload to start.
  UploadShape shape;
  std::shared_ptr<const Pipeline> pipeline;  // header.policy, or the role's default
  MessagePtr parent;                         // null without header.parent_id
  int64_t prompt_pos0 = 0;                   // the first prompt token's position id
  std::vector<std::string> recipients;       // header.recipients, in order
  // The route decision: recipients whose mailbox is here, and those on other
  // relays by destination target (each list in header order).
  std::vector<std::string> local;
  std::map<std::string, std::vector<std::string>> remote;
  uint64_t min_bytes = 0;  // MinComposedBytes: what the message holds at least
};

// Checks `h` and plans its publish, in this order:
//   - ids ([A-Za-z0-9._:-]{1,128}: session_id, message_id when set, sender,
//     1..kMaxRecipients distinct recipients, parent_id when set), role of at
//     most 128 bytes, geometry present: INVALID_ARGUMENT naming the field;
//   - idempotency: a message_id the session holds is a duplicate when
//     CheckSamePublish passes, ALREADY_EXISTS naming the field otherwise;
//   - geometry (CheckGeometry), policy (its length, its spec, its
//     quantization against head_dim): INVALID_ARGUMENT naming the field;
//   - with parent_id: n_history 0 and first_agent false (INVALID_ARGUMENT),
//     the parent: NOT_FOUND when it does not exist or the sender may not see
//     it (the same answer for both: Store::LookupParent, NotVisibleError),
//     delivered to the sender (FAILED_PRECONDITION), with the geometry's
//     layers, kv_heads, head_dim and dtype, and history_score_tokens 0 or the parent's tokens per head
//     (FAILED_PRECONDITION), prompt_pos0 unset (then the parent's
//     next_pos, whose ids must fit int32) or >= the parent's next_pos
//     (INVALID_ARGUMENT);
//   - the route of each recipient (RouteTable::Resolve: INVALID_ARGUMENT
//     naming header.recipients[i] when the template cannot name it);
//   - the composed message's least size (MinComposedBytes) against the
//     session's limits and the mailbox limit of the recipients here
//     (Store::CheckCanPublish, RESOURCE_EXHAUSTED).
[[nodiscard]] absl::StatusOr<PublishPlan> PlanPublish(const v1::PublishHeader& h, const PlanInputs& in);

// The header of the forwards of `plan`'s message (without recipients):
// ids, sender, role, parent, policy as requested and geometry, and the
// composed message's shape as the pipeline will produce it (token counts,
// quantization, the canonical policy).
v1::ForwardHeader ForwardHeaderFor(const PublishPlan& plan);

// OK when `h` asks for what the committed `prior` holds (sender, recipients
// in any order, role, policy as requested, parent, geometry): a retry of
// the same publish. ALREADY_EXISTS naming the first field that differs
// otherwise. The tensor data is not compared (a retry is answered before it
// arrives).
absl::Status CheckSamePublish(const v1::PublishHeader& h, const StoredMessage& prior);

// The bytes a composed message of `shape` holds at least (RetainedBytes),
// with `parent` (may be null: the upload's own history) as its history
// (what the pipeline's history budget keeps of it): every token's position
// ids and acc, its K/V rows dense or as quantized codes (scales, zeros and
// norms not counted), the demoted tokens' codes, and the bookkeeping. Exact
// for dense policies.
uint64_t MinComposedBytes(const Pipeline& p, const UploadShape& shape, const Message* parent);

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_RPC_PUBLISH_PLAN_H_
