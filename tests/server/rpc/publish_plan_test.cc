// PlanPublish without gRPC: every way a publish header is refused, with its
// status code and the field it names, and what the plan holds for a fresh
// publish, a retry and a child.
#include "server/rpc/publish_plan.h"

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "core/pipeline.h"
#include "proto/stream_codec.h"
#include "gtest/gtest.h"
#include "tests/server/relay_test_util.h"
#include "server/store/memory_store.h"
#include "core/message_id.h"
#include "server/rpc/request_checks.h"
#include "tests/core/test_util.h"

namespace kvrelay {
namespace {

using namespace kvrelay::testing;

// The canonical form of a pipeline spec.
std::string Canonical(const std::string& spec) {
  auto p = Pipeline::Create(spec);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? (*p)->spec() : "";
}

Turn SmallTurn(uint64_t seed, bool first_agent = true) {
  TurnShape s;  // 2 layers x 2 kv_heads (4 score heads) x head_dim 16, F32, 40 + 5 tokens
  s.first_agent = first_agent;
  return RandomTurn(s, seed);
}

// What Publish would store for `h` with the message `msg`.
std::shared_ptr<StoredMessage> StoredFor(const v1::PublishHeader& h, Message msg) {
  auto m = std::make_shared<StoredMessage>();
  m->session_id = h.session_id();
  m->message_id = h.message_id();
  m->sender = h.sender();
  m->role = h.role();
  m->parent_id = h.parent_id();
  m->recipients.assign(h.recipients().begin(), h.recipients().end());
  m->requested_policy = h.policy();
  absl::StatusOr<UploadShape> layout = CheckGeometry(h.geometry(), "header.geometry", !h.parent_id().empty());
  EXPECT_TRUE(layout.ok()) << layout.status();
  if (layout.ok()) m->layout = *layout;
  m->msg = std::move(msg);
  m->bytes = RetainedBytes(m->msg);
  return m;
}

MessagePtr CommitTo(Store& s, std::shared_ptr<StoredMessage> m) {
  const Store::PublishTicket t = s.BeginPublish(m->session_id);
  absl::StatusOr<Store::CommitResult> r = s.Commit(std::move(m), t);
  s.EndPublish(t);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? r->msg : nullptr;
}

// As a Fetch that wrote the whole delivery does.
void Deliver(Store& s, const std::string& session, const std::string& agent) {
  uint64_t w = 0;
  auto d = s.FetchOrWait(session, agent, Clock::now() + std::chrono::hours(1), [](Store::Wake) {}, &w);
  ASSERT_TRUE(d);
  s.MarkDelivered(session, agent, d->msg->message_id);
}

class PlanPublishTest : public ::testing::Test {
 protected:
  PlanPublishTest() : store_(StoreLimits{}, nullptr) {}

  PlanInputs Inputs(const Store& store) {
    return PlanInputs{config_, store, [this] { return "gen-" + std::to_string(++ids_); }};
  }
  absl::StatusOr<PublishPlan> Plan(const v1::PublishHeader& h) { return PlanPublish(h, Inputs(store_)); }

  // The header of a first publish: session "s", id "m", from "a" to "b".
  v1::PublishHeader Fresh(const std::string& policy = "h2o-head:k=8") {
    return Header("s", "m", "a", {"b"}, policy, turn_);
  }
  // The header of b's reply to the parent "p" that a sent it.
  v1::PublishHeader Child() {
    v1::PublishHeader h = Header("s", "c", "b", {"a"}, "h2o-head:k=8", child_turn_);
    h.set_parent_id("p");
    return h;
  }
  // Commits "p" from a to b, composed with `full` from turn_, and delivers it
  // to b when `delivered`.
  MessagePtr CommitParent(bool delivered = true, int64_t next_pos = -1) {
    auto p = Pipeline::Create("full");
    EXPECT_TRUE(p.ok());
    absl::StatusOr<Message> msg = (*p)->Compress(turn_);
    EXPECT_TRUE(msg.ok()) << msg.status();
    if (next_pos >= 0) msg->next_pos = next_pos;
    MessagePtr m = CommitTo(store_, StoredFor(Header("s", "p", "a", {"b"}, "full", turn_), *msg));
    if (delivered) Deliver(store_, "s", "b");
    return m;
  }

  static void ExpectError(const absl::StatusOr<PublishPlan>& r, absl::StatusCode code, const std::string& prefix) {
    ASSERT_FALSE(r.ok()) << "expected " << code << " '" << prefix << "...'";
    EXPECT_EQ(r.status().code(), code) << r.status();
    EXPECT_TRUE(absl::StartsWith(r.status().message(), prefix)) << r.status() << "\nexpected it to start with: " << prefix;
  }

  ServerConfig config_;
  MemoryStore store_;
  int ids_ = 0;
  const Turn turn_ = SmallTurn(1);
  const Turn child_turn_ = SmallTurn(2, /*first_agent=*/false);
};

TEST_F(PlanPublishTest, AFreshPublishPlansItsUpload) {
  v1::PublishHeader h = Fresh();
  h.clear_recipients();
  for (const char* r : {"c", "b", "d"}) h.add_recipients(r);
  absl::StatusOr<PublishPlan> plan = Plan(h);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->header.SerializeAsString(), h.SerializeAsString());
  EXPECT_EQ(plan->duplicate, nullptr);
  EXPECT_EQ(plan->parent, nullptr);
  ASSERT_NE(plan->pipeline, nullptr);
  EXPECT_EQ(plan->pipeline->spec(), Canonical("h2o-head:k=8"));
  EXPECT_EQ(plan->shape.layers, 2);
  EXPECT_EQ(plan->shape.geo.kv_heads, 2);
  EXPECT_EQ(plan->shape.geo.head_dim, 16);
  EXPECT_EQ(plan->shape.geo.n_prompt, 40);
  EXPECT_TRUE(plan->shape.first_agent);
  EXPECT_EQ(plan->prompt_pos0, 0);  // n_history, with prompt_pos0 unset
  EXPECT_EQ(plan->recipients, (std::vector<std::string>{"c", "b", "d"}));
  EXPECT_EQ(ids_, 0);  // the header had an id
  // Planning reserves and stores nothing.
  const StoreStats st = store_.Stats();
  EXPECT_EQ(st.sessions, 0u);
  EXPECT_EQ(st.inflight_bytes, 0u);
}

TEST_F(PlanPublishTest, AHeaderWithoutIdGetsAFreshOne) {
  v1::PublishHeader h = Fresh();
  h.clear_message_id();
  absl::StatusOr<PublishPlan> plan = Plan(h);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->header.message_id(), "gen-1");
  EXPECT_EQ(ids_, 1);
  // Refused before the id is assigned: no id is drawn.
  h.clear_sender();
  ExpectError(Plan(h), absl::StatusCode::kInvalidArgument, "header.sender: empty");
  EXPECT_EQ(ids_, 1);
}

TEST_F(PlanPublishTest, PolicyComesFromTheHeaderTheRoleOrTheDefault) {
  config_.default_policy = "h2o-head:k=16";
  config_.role_policies["critic"] = "h2o-head:k=4";
  v1::PublishHeader h = Fresh("");
  absl::StatusOr<PublishPlan> plan = Plan(h);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->pipeline->spec(), Canonical("h2o-head:k=16"));
  h.set_role("critic");
  plan = Plan(h);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->pipeline->spec(), Canonical("h2o-head:k=4"));
  EXPECT_EQ(plan->header.policy(), "");  // as requested, for CheckSamePublish
  h.set_policy("h2o-head:k=2");
  plan = Plan(h);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->pipeline->spec(), Canonical("h2o-head:k=2"));
}

TEST_F(PlanPublishTest, PromptPos0IsTakenAsGiven) {
  v1::PublishHeader h = Fresh();
  h.mutable_geometry()->set_prompt_pos0(1000);
  absl::StatusOr<PublishPlan> plan = Plan(h);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->prompt_pos0, 1000);
}

TEST_F(PlanPublishTest, BadIdsAreInvalidArgumentNamingTheField) {
  const std::string too_long(129, 'x');
  struct Case {
    std::function<void(v1::PublishHeader*)> edit;
    std::string prefix;
  };
  const std::vector<Case> cases = {
      {[](auto* h) { h->clear_session_id(); }, "header.session_id: empty, expected [A-Za-z0-9._:-]{1,128}"},
      {[](auto* h) { h->set_session_id("has space"); }, "header.session_id: 'has space', expected"},
      {[&](auto* h) { h->set_session_id(too_long); }, "header.session_id: 129 bytes"},
      {[](auto* h) { h->set_message_id("a/b"); }, "header.message_id: 'a/b', expected"},
      {[](auto* h) { h->clear_sender(); }, "header.sender: empty"},
      {[](auto* h) { h->set_sender("a\nb"); }, "header.sender: 'a\\nb', expected"},
      {[](auto* h) { h->add_recipients("x y"); }, "header.recipients[1]: 'x y', expected"},
      {[](auto* h) { h->add_recipients(""); }, "header.recipients[1]: empty"},
      {[](auto* h) { h->set_parent_id("no/pe"); }, "header.parent_id: 'no/pe', expected"},
  };
  for (const Case& c : cases) {
    v1::PublishHeader h = Fresh();
    c.edit(&h);
    ExpectError(Plan(h), absl::StatusCode::kInvalidArgument, c.prefix);
  }
  EXPECT_EQ(ids_, 0);
}

TEST_F(PlanPublishTest, RecipientsAreOneToSixtyFourDistinctAgents) {
  v1::PublishHeader h = Fresh();
  h.clear_recipients();
  ExpectError(Plan(h), absl::StatusCode::kInvalidArgument, "header.recipients: empty, expected at least one agent");
  for (int i = 0; i < kMaxRecipients; ++i) h.add_recipients("r" + std::to_string(i));
  absl::StatusOr<PublishPlan> plan = Plan(h);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->recipients.size(), static_cast<size_t>(kMaxRecipients));
  h.add_recipients("one-too-many");
  ExpectError(Plan(h), absl::StatusCode::kInvalidArgument, "header.recipients: 65 agents, expected 1..64");

  h = Fresh();
  h.clear_recipients();
  for (const char* r : {"b", "c", "b"}) h.add_recipients(r);
  ExpectError(Plan(h), absl::StatusCode::kInvalidArgument,
              "header.recipients[2]: 'b' repeats recipients[0], expected distinct agents");
}

TEST_F(PlanPublishTest, RoleIsAtMost128Bytes) {
  v1::PublishHeader h = Fresh();
  h.set_role(std::string(128, 'r'));
  EXPECT_TRUE(Plan(h).ok());
  h.set_role(std::string(129, 'r'));
  ExpectError(Plan(h), absl::StatusCode::kInvalidArgument, "header.role: 129 bytes, expected at most 128");
}

TEST_F(PlanPublishTest, GeometryMustBePresentAndWithinTheCoreBounds) {
  v1::PublishHeader h = Fresh();
  h.clear_geometry();
  ExpectError(Plan(h), absl::StatusCode::kInvalidArgument, "header.geometry: missing, expected the turn's geometry");
  h = Fresh();
  h.mutable_geometry()->set_kv_heads(0);
  ExpectError(Plan(h), absl::StatusCode::kInvalidArgument, "header.geometry.kv_heads: 0");
  h = Fresh();
  h.mutable_geometry()->set_dtype(v1::DTYPE_UNSPECIFIED);
  ExpectError(Plan(h), absl::StatusCode::kInvalidArgument, "header.geometry.dtype:");
}

TEST_F(PlanPublishTest, BadPoliciesAreInvalidArgumentNamingTheirSource) {
  ExpectError(Plan(Fresh(std::string(kMaxSpecBytes + 1, 'x'))), absl::StatusCode::kInvalidArgument,
              "header.policy: 1025 bytes, expected at most 1024");
  ExpectError(Plan(Fresh("h2o-head:k=8+bogus")), absl::StatusCode::kInvalidArgument,
              "header.policy 'h2o-head:k=8+bogus': ");
  config_.role_policies["critic"] = "bogus";
  v1::PublishHeader h = Fresh("");
  h.set_role("critic");
  ExpectError(Plan(h), absl::StatusCode::kInvalidArgument, "policy (role default) 'bogus': ");
  // Quantization that the geometry's head_dim cannot take.
  h = Fresh("h2o-layer:k=8+int4:rotate=hadamard");
  h.mutable_geometry()->set_head_dim(24);
  ExpectError(Plan(h), absl::StatusCode::kInvalidArgument,
              "header.policy: quant: rotate=hadamard needs a power-of-two head_dim, got head_dim=24");
}

TEST_F(PlanPublishTest, ARetryOfTheSamePublishIsADuplicate) {
  const v1::PublishHeader h = Header("s", "m", "a", {"b", "c"}, "h2o-head:k=8", turn_);
  MessagePtr prior = CommitTo(store_, StoredFor(h, Message()));
  absl::StatusOr<PublishPlan> plan = Plan(h);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->duplicate, prior);
  EXPECT_EQ(plan->header.message_id(), "m");
  EXPECT_EQ(plan->pipeline, nullptr);
  // Recipients in another order are the same publish.
  plan = Plan(Header("s", "m", "a", {"c", "b"}, "h2o-head:k=8", turn_));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->duplicate, prior);
}

TEST_F(PlanPublishTest, ARetryThatDiffersIsAlreadyExistsNamingTheField) {
  v1::PublishHeader committed = Header("s", "m", "a", {"b", "c"}, "h2o-head:k=8", turn_);
  committed.set_role("planner");
  CommitTo(store_, StoredFor(committed, Message()));
  v1::PublishHeader same = committed;
  same.clear_recipients();
  for (const char* r : {"c", "b"}) same.add_recipients(r);
  ASSERT_TRUE(Plan(same).ok());
  struct Case {
    std::function<void(v1::PublishHeader*)> edit;
    std::string with;
  };
  const std::vector<Case> cases = {
      {[](auto* h) { h->set_sender("z"); }, "by another sender; choose another message id"},
      {[](auto* h) { h->add_recipients("d"); }, "with header.recipients [b,c], this publish has [b,c,d]"},
      {[](auto* h) { h->set_role("critic"); }, "with header.role 'planner', this publish has 'critic'"},
      {[](auto* h) { h->set_policy("h2o-head:k=4"); }, "with header.policy 'h2o-head:k=8', this publish has 'h2o-head:k=4'"},
      {[](auto* h) { h->set_parent_id("p"); }, "with header.parent_id '', this publish has 'p'"},
      {[](auto* h) { h->mutable_geometry()->set_n_prompt(41); }, "with header.geometry.n_prompt 40, this publish has 41"},
      {[](auto* h) { h->mutable_geometry()->set_prompt_pos0(7); }, "with header.geometry.prompt_pos0 unset, this publish has 7"},
  };
  for (const Case& c : cases) {
    v1::PublishHeader h = committed;
    c.edit(&h);
    absl::StatusOr<PublishPlan> r = Plan(h);
    ExpectError(r, absl::StatusCode::kAlreadyExists, "header.message_id: 'm' is already committed in session 's' ");
    EXPECT_NE(r.status().message().find(c.with), std::string::npos) << r.status() << "\nexpected: " << c.with;
  }
}

TEST_F(PlanPublishTest, AChildContinuesAfterItsParent) {
  MessagePtr parent = CommitParent();
  ASSERT_EQ(parent->msg.next_pos, 45);  // 40 prompt + 5 generated tokens from 0
  absl::StatusOr<PublishPlan> plan = Plan(Child());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->parent, parent);
  EXPECT_EQ(plan->prompt_pos0, 45);
  EXPECT_FALSE(plan->shape.first_agent);
  EXPECT_EQ(plan->shape.geo.n_history, 0);
  // A prompt_pos0 at or past the parent's end is kept.
  v1::PublishHeader h = Child();
  h.mutable_geometry()->set_prompt_pos0(45);
  plan = Plan(h);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->prompt_pos0, 45);
}

TEST_F(PlanPublishTest, AChildCarriesNoHistoryAndNoAnchors) {
  CommitParent();
  v1::PublishHeader h = Child();
  h.mutable_geometry()->set_n_history(3);
  ExpectError(Plan(h), absl::StatusCode::kInvalidArgument,
              "header.geometry.n_history: 3, expected 0 with parent_id (the relay supplies the history)");
  h = Child();
  h.mutable_geometry()->set_first_agent(true);
  ExpectError(Plan(h), absl::StatusCode::kInvalidArgument,
              "header.geometry.first_agent: true, expected false with parent_id");
}

TEST_F(PlanPublishTest, TheParentMustBeAMessageDeliveredToTheSender) {
  ExpectError(Plan(Child()), absl::StatusCode::kNotFound,
              "header.parent_id: no message 'p' visible to agent \"b\" in session 's'");
  CommitParent(/*delivered=*/false);
  ExpectError(Plan(Child()), absl::StatusCode::kFailedPrecondition,
              "header.parent_id: 'p': expected a message delivered to the sender 'b'");
  v1::PublishHeader h = Child();
  h.set_parent_id("q");
  ExpectError(Plan(h), absl::StatusCode::kNotFound,
              "header.parent_id: no message 'q' visible to agent \"b\" in session 's'");
}

// An agent that is neither the sender nor a recipient of a message learns
// nothing of it from parent_id: the same answer as for an id that is not
// there.
TEST_F(PlanPublishTest, AParentTheSenderMayNotSeeReadsAsMissing) {
  CommitParent();  // "p" from a to b, delivered
  v1::PublishHeader h = Header("s", "c", "x", {"a"}, "h2o-head:k=8", child_turn_);
  h.set_parent_id("p");
  absl::StatusOr<PublishPlan> hidden = Plan(h);
  h.set_parent_id("q");
  absl::StatusOr<PublishPlan> missing = Plan(h);
  ASSERT_FALSE(hidden.ok());
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(hidden.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(hidden.status().message(), "header.parent_id: no message 'p' visible to agent \"x\" in session 's'");
  EXPECT_EQ(missing.status().message(), "header.parent_id: no message 'q' visible to agent \"x\" in session 's'");
}

// A relay-assigned id that cannot be made (the CSPRNG failed) fails the
// publish; no weaker id is used in its place.
TEST_F(PlanPublishTest, AnIdThatCannotBeAssignedFailsThePublish) {
  v1::PublishHeader h = Fresh();
  h.clear_message_id();
  PlanInputs in{config_, store_, [] { return NewMessageId([](void*, size_t) { return absl::InternalError("getrandom: EIO"); }); }};
  absl::StatusOr<PublishPlan> r = PlanPublish(h, in);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal) << r.status();
  EXPECT_TRUE(absl::StartsWith(r.status().message(), "header.message_id: empty, and no random id could be made for it"))
      << r.status();
  EXPECT_EQ(store_.Stats().sessions, 0u);
}

TEST_F(PlanPublishTest, TheParentMustHaveTheChildsGeometry) {
  CommitParent();
  for (auto edit : std::vector<std::function<void(v1::TurnGeometry*)>>{
           [](auto* g) { g->set_layers(3); }, [](auto* g) { g->set_kv_heads(1); g->set_score_heads(2); },
           [](auto* g) { g->set_head_dim(32); }, [](auto* g) { g->set_dtype(v1::DTYPE_BF16); }}) {
    v1::PublishHeader h = Child();
    edit(h.mutable_geometry());
    ExpectError(Plan(h), absl::StatusCode::kFailedPrecondition, "header.parent_id: 'p' has 2 layers x 2 kv_heads x head_dim 16");
  }
}

TEST_F(PlanPublishTest, PromptPos0MayNotOverlapTheParent) {
  CommitParent();
  v1::PublishHeader h = Child();
  h.mutable_geometry()->set_prompt_pos0(44);
  ExpectError(Plan(h), absl::StatusCode::kInvalidArgument,
              "header.geometry.prompt_pos0: 44, expected >= 45 (where the parent 'p' ended");
}

TEST_F(PlanPublishTest, PositionsAfterTheParentMustFitInt32) {
  const int64_t max = std::numeric_limits<int32_t>::max();
  CommitParent(/*delivered=*/true, /*next_pos=*/max - 44);  // 45 tokens end exactly at max
  absl::StatusOr<PublishPlan> plan = Plan(Child());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->prompt_pos0, max - 44);
  store_.CloseSession("s");
  CommitParent(/*delivered=*/true, /*next_pos=*/max - 43);
  ExpectError(Plan(Child()), absl::StatusCode::kInvalidArgument,
              absl::StrCat("header.geometry.prompt_pos0: ", max - 43, " (after the parent) puts position ids past int32"));
}

// The least size is a lower bound of what every policy's message holds,
// and it counts the demoted tokens' codes (within their 2 fp16 norms per
// token and head of the real size).
TEST_F(PlanPublishTest, TheLeastSizeBoundsEveryPolicyAndCountsDemotedTokens) {
  const v1::PublishHeader h = Fresh("full");
  absl::StatusOr<UploadShape> shape = CheckGeometry(h.geometry(), "header.geometry");
  ASSERT_TRUE(shape.ok());
  for (const char* policy : {"full", "h2o-head:k=8", "h2o-head:k=8+int4", "full+lloyd:bits=3",
                             "h2o-head:k=8+demote:bits=2+lloyd:bits=4", "h2o-layer:k=4+demote:bits=1+int2",
                             "h2o-head:k=8+obf:p=4+int8"}) {
    auto p = Pipeline::Create(policy);
    ASSERT_TRUE(p.ok()) << p.status();
    auto offline = (*p)->Compress(turn_);
    ASSERT_TRUE(offline.ok()) << offline.status();
    const uint64_t need = MinComposedBytes(**p, *shape, nullptr);
    const uint64_t held = RetainedBytes(*offline);
    EXPECT_LE(need, held) << policy;
    if (offline->n_demoted > 0) {
      const uint64_t norms = 2 * 2 * offline->layers.size() * offline->kv_heads * offline->n_demoted;
      const uint64_t stats = offline->layers[0].quant ? 2 * (offline->layers[0].quant->k.scale.size() +
                                                             offline->layers[0].quant->k.zero.size() +
                                                             offline->layers[0].quant->v.scale.size() +
                                                             offline->layers[0].quant->v.zero.size()) *
                                                            offline->layers.size()
                                                      : 0;
      EXPECT_EQ(need + norms + stats, held) << policy;
    }
  }
}

TEST_F(PlanPublishTest, TheComposedMessageMustFitTheLimitsUpFront) {
  const v1::PublishHeader h = Fresh("full");
  absl::StatusOr<UploadShape> shape = CheckGeometry(h.geometry(), "header.geometry");
  ASSERT_TRUE(shape.ok());
  auto full = Pipeline::Create("full");
  ASSERT_TRUE(full.ok());
  const uint64_t need = MinComposedBytes(**full, *shape, nullptr);
  // Exact for a dense policy: what the store would hold once committed.
  auto offline = (*full)->Compress(turn_);
  ASSERT_TRUE(offline.ok());
  EXPECT_EQ(need, RetainedBytes(*offline));

  StoreLimits lim;
  lim.max_mailbox_bytes = need;
  MemoryStore fits(lim, nullptr);
  EXPECT_TRUE(PlanPublish(h, Inputs(fits)).ok());
  lim.max_mailbox_bytes = need - 1;
  MemoryStore small(lim, nullptr);
  ExpectError(PlanPublish(h, Inputs(small)), absl::StatusCode::kResourceExhausted,
              absl::StrCat("mailbox of 'b' in session 's': 0 bytes unacked + ", need, " bytes of the message (at least)"));

  StoreLimits one;
  one.max_session_messages = 1;
  MemoryStore full_session(one, nullptr);
  CommitTo(full_session, StoredFor(Header("s", "other", "a", {"b"}, "full", turn_), Message()));
  ExpectError(PlanPublish(h, Inputs(full_session)), absl::StatusCode::kResourceExhausted,
              "session 's': 1 messages, expected at most --max-session-messages=1");
}

TEST_F(PlanPublishTest, ChecksRunInOrder) {
  // The first failing check names the error: ids before geometry, and
  // idempotency before policy.
  v1::PublishHeader h = Fresh("h2o-head:k=8+bogus");
  h.clear_sender();
  h.clear_geometry();
  ExpectError(Plan(h), absl::StatusCode::kInvalidArgument, "header.sender");
  CommitTo(store_, StoredFor(Fresh("h2o-head:k=8+bogus"), Message()));
  absl::StatusOr<PublishPlan> plan = Plan(Fresh("h2o-head:k=8+bogus"));
  ASSERT_TRUE(plan.ok()) << plan.status();  // the retry is answered, its policy never parsed
  EXPECT_NE(plan->duplicate, nullptr);
}

}  // namespace
}  // namespace kvrelay
