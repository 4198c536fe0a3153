// In-process integration: a RelayServer on 127.0.0.1:0 driven by the
// generated stub.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <map>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "core/history.h"
#include "core/internal/pipeline_checks.h"
#include "core/mutex.h"
#include "core/pipeline.h"
#include "core/token.h"
#include "grpcpp/support/client_interceptor.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/impl/rpc_method.h"
#include "grpcpp/support/sync_stream.h"
#include "tests/testlib/eventually.h"
#include "tests/testlib/fake_time_source.h"
#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"
#include "grpcpp/impl/codegen/client_unary_call.h"
#include "proto/raw_chunk.h"
#include "tests/server/relay_test_util.h"
#include "proto/stream_codec.h"
#include "server/rpc/pending.h"
#include "server/rpc/relay_service.h"
#include "server/rpc/request_checks.h"
#include "server/server.h"
#include "tests/core/test_util.h"

namespace kvrelay {
namespace {

using namespace kvrelay::testing;

class RelayTest : public ::testing::Test {
 protected:
  void StartServer(ServerConfig cfg = {}) {
    cfg.listen = {"127.0.0.1:0"};
    cfg.metrics_listen = "";
    if (cfg.worker_threads <= 0) cfg.worker_threads = 2;
    cfg.shutdown_grace_seconds = 2;
    auto s = RelayServer::Start(cfg);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    channel_ = grpc::CreateChannel(server_->grpc_address(), grpc::InsecureChannelCredentials());
    stub_ = v1::Relay::NewStub(channel_);
  }
  void SetUp() override { StartServer(); }
  void TearDown() override {
    if (server_) server_->Shutdown();
  }

  // Calls of `method` the relay finished with `code` (kvrelay_rpcs_total).
  double RpcCount(const std::string& method, const std::string& code) {
    double n = 0;
    for (const auto& fam : server_->metrics()->registry()->Collect()) {
      if (fam.name != "kvrelay_rpcs_total") continue;
      for (const auto& m : fam.metric) {
        bool same_method = false, same_code = false;
        for (const auto& l : m.label) {
          same_method = same_method || (l.name == "method" && l.value == method);
          same_code = same_code || (l.name == "code" && l.value == code);
        }
        if (same_method && same_code) n += m.counter.value;
      }
    }
    return n;
  }

  static Turn MakeTurn(uint64_t seed, bool first = true, DType dtype = DType::kBF16) {
    TurnShape s;
    s.layers = 3;
    s.kv_heads = 2;
    s.group = 2;
    s.head_dim = 32;
    s.n_prompt = 48;
    s.n_gen = 6;
    s.dtype = dtype;
    s.first_agent = first;
    return RandomTurn(s, seed);
  }

  static Message Offline(const Turn& t, const std::string& policy) {
    auto p = Pipeline::Create(policy);
    EXPECT_TRUE(p.ok());
    auto m = (*p)->Compress(t);
    EXPECT_TRUE(m.ok()) << m.status();
    return *m;
  }

  // Nothing is waiting for `agent` (short fetch times out).
  void ExpectNothingFor(const std::string& session, const std::string& agent) {
    FetchResult f = DoFetch(stub_.get(), session, agent, false, 0.3);
    EXPECT_EQ(f.status.error_code(), grpc::DEADLINE_EXCEEDED) << f.status.error_message();
  }

  void WaitInflightZero() {
    Eventually([&] { return server_->store()->inflight_bytes() == 0; });
    EXPECT_EQ(server_->store()->inflight_bytes(), 0u);
  }

  std::unique_ptr<RelayServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Relay::Stub> stub_;
};

// Every --listen address serves the same relay; grpc_port() is the first
// TCP one, grpc_addresses() lists them all in order as the ready line does.
TEST_F(RelayTest, ServesEveryListenAddressTcpAndUnix) {
  server_->Shutdown();
  const std::string sock = ::testing::TempDir() + "kvrelay_service_test.sock";
  std::remove(sock.c_str());
  ServerConfig cfg;
  cfg.listen = {"unix:" + sock, "127.0.0.1:0"};
  cfg.metrics_listen = "";
  cfg.worker_threads = 2;
  cfg.shutdown_grace_seconds = 2;
  auto s = RelayServer::Start(cfg);
  ASSERT_TRUE(s.ok()) << s.status();
  server_ = std::move(*s);
  ASSERT_EQ(server_->grpc_addresses().size(), 2u);
  EXPECT_EQ(server_->grpc_addresses()[0], "unix:" + sock);
  EXPECT_EQ(server_->grpc_address(), "unix:" + sock);
  EXPECT_GT(server_->grpc_port(), 0);
  EXPECT_EQ(server_->grpc_addresses()[1], "127.0.0.1:" + std::to_string(server_->grpc_port()));
  EXPECT_EQ(server_->ReadyLine(), "kvrelay-server ready grpc=unix:" + sock + ",127.0.0.1:" +
                                      std::to_string(server_->grpc_port()) + " metrics=off");
  auto unix_stub = v1::Relay::NewStub(grpc::CreateChannel("unix:" + sock, grpc::InsecureChannelCredentials()));
  auto tcp_stub =
      v1::Relay::NewStub(grpc::CreateChannel(server_->grpc_addresses()[1], grpc::InsecureChannelCredentials()));
  Turn t = MakeTurn(40);
  const std::string policy = "h2o-head:k=8+obf:p=4";
  auto pub = PublishTurn(unix_stub.get(), Header("ux", "m1", "planner", {"critic"}, policy, t), t, 1000);
  ASSERT_TRUE(pub.status.ok()) << pub.status.error_message();
  FetchResult f = DoFetch(tcp_stub.get(), "ux", "critic", /*auto_ack=*/true);
  ASSERT_TRUE(f.status.ok()) << f.status.error_message();
  EXPECT_TRUE(f.trailer_ok);
  ExpectSameMessage(f.msg, Offline(t, policy));
  pub = PublishTurn(tcp_stub.get(), Header("ux", "m2", "planner", {"critic"}, policy, t), t, 1000);
  ASSERT_TRUE(pub.status.ok()) << pub.status.error_message();
  f = DoFetch(unix_stub.get(), "ux", "critic", /*auto_ack=*/true);
  ASSERT_TRUE(f.status.ok()) << f.status.error_message();
  EXPECT_EQ(f.header.message_id(), "m2");
  ExpectSameMessage(f.msg, Offline(t, policy));
  server_->Shutdown();
  EXPECT_NE(access(sock.c_str(), F_OK), 0) << sock << " is left after Shutdown";
}

TEST_F(RelayTest, FullRoundTripIsBitExactWithRedeliveryAndAck) {
  Turn t = MakeTurn(1);
  auto pub = PublishTurn(stub_.get(), Header("s1", "m1", "planner", {"critic"}, "full", t), t, 1000);
  ASSERT_TRUE(pub.status.ok()) << pub.status.error_message();
  EXPECT_EQ(pub.response.message_id(), "m1");
  EXPECT_FALSE(pub.response.duplicate());
  const Message want = Offline(t, "full");
  EXPECT_EQ(pub.response.accounting().full_bytes(), want.full_bytes);
  EXPECT_EQ(pub.response.accounting().sent_bytes(), want.sent_bytes);
  EXPECT_EQ(pub.response.accounting().policy(), "full");

  FetchResult f = DoFetch(stub_.get(), "s1", "critic", /*auto_ack=*/false);
  ASSERT_TRUE(f.status.ok()) << f.status.error_message();
  EXPECT_TRUE(f.trailer_ok);
  EXPECT_EQ(f.header.message_id(), "m1");
  EXPECT_EQ(f.header.sender(), "planner");
  EXPECT_EQ(f.header.delivery_attempt(), 1u);
  ExpectSameMessage(f.msg, want);
  // `full` keeps every token: prompt rows then generated rows, bit-exact.
  for (size_t l = 0; l < t.layers.size(); ++l) {
    const auto& L = t.layers[l];
    for (int h = 0; h < L.prompt_k.heads(); ++h) {
      for (int j = 0; j < L.prompt_k.tokens(); ++j) {
        ASSERT_EQ(0, std::memcmp(f.msg.layers[l].k.row(h, j), L.prompt_k.row(h, j), L.prompt_k.row_bytes()));
        ASSERT_EQ(0, std::memcmp(f.msg.layers[l].v.row(h, j), L.prompt_v.row(h, j), L.prompt_v.row_bytes()));
      }
    }
  }
  // At least once: delivered again until acked.
  FetchResult again = DoFetch(stub_.get(), "s1", "critic", false);
  ASSERT_TRUE(again.status.ok());
  EXPECT_EQ(again.header.delivery_attempt(), 2u);
  grpc::ClientContext actx;
  v1::AckRequest ack;
  ack.set_session_id("s1");
  ack.set_agent("critic");
  ack.set_message_id("m1");
  v1::AckResponse aresp;
  ASSERT_TRUE(stub_->Ack(&actx, ack, &aresp).ok());
  ExpectNothingFor("s1", "critic");
  grpc::ClientContext actx2;
  ack.set_message_id("unknown");
  EXPECT_EQ(stub_->Ack(&actx2, ack, &aresp).error_code(), grpc::NOT_FOUND);
}

TEST_F(RelayTest, CompressedMessageMatchesTheCoreLibrary) {
  for (const char* policy : {"h2o-head:k=8+obf:p=4,mode=fast", "h2o-layer:k=8+obf:p=4+int4:rotate=hadamard", "gen"}) {
    Turn t = MakeTurn(2);
    const std::string session = std::string("s-") + std::to_string(std::hash<std::string>()(policy) % 100000);
    auto pub = PublishTurn(stub_.get(), Header(session, "m", "a", {"b"}, policy, t), t);
    ASSERT_TRUE(pub.status.ok()) << policy << ": " << pub.status.error_message();
    const Message want = Offline(t, policy);
    EXPECT_EQ(pub.response.accounting().sent_bytes(), want.sent_bytes) << policy;
    EXPECT_EQ(pub.response.accounting().full_bytes(), want.full_bytes) << policy;
    EXPECT_EQ(pub.response.accounting().policy(), want.policy);
    FetchResult f = DoFetch(stub_.get(), session, "b", true);
    ASSERT_TRUE(f.status.ok()) << f.status.error_message();
    EXPECT_TRUE(f.trailer_ok);
    ExpectSameMessage(f.msg, want);
  }
}

TEST_F(RelayTest, IdempotentRepublish) {
  Turn t = MakeTurn(3);
  auto h = Header("s", "same", "a", {"b"}, "h2o-head:k=8", t);
  auto p1 = PublishTurn(stub_.get(), h, t);
  auto p2 = PublishTurn(stub_.get(), h, t);
  ASSERT_TRUE(p1.status.ok() && p2.status.ok()) << p2.status.error_message();
  EXPECT_FALSE(p1.response.duplicate());
  EXPECT_TRUE(p2.response.duplicate());
  EXPECT_EQ(p2.response.accounting().SerializeAsString(), p1.response.accounting().SerializeAsString());
  EXPECT_EQ(server_->store()->Stats().mailbox_messages, 1u);
  // Server-assigned ids are distinct.
  h.clear_message_id();
  auto p3 = PublishTurn(stub_.get(), h, t);
  auto p4 = PublishTurn(stub_.get(), h, t);
  ASSERT_TRUE(p3.status.ok() && p4.status.ok());
  EXPECT_NE(p3.response.message_id(), p4.response.message_id());
  EXPECT_FALSE(p4.response.duplicate());
}

// A message id reused for a different publish is ALREADY_EXISTS naming the
// first field that differs; nothing changes. Recipients in another order
// are the same publish.
TEST_F(RelayTest, RepublishOfAnIdWithADifferentHeaderIsAlreadyExists) {
  Turn t = MakeTurn(3);
  auto h = Header("s", "same", "a", {"b", "c"}, "h2o-head:k=8", t);
  ASSERT_TRUE(PublishTurn(stub_.get(), h, t).status.ok());
  struct Case {
    std::string name;
    std::function<void(v1::PublishHeader*)> edit;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"sender", [](auto* x) { x->set_sender("z"); }, "by another sender; choose another message id"},
      {"recipients", [](auto* x) { x->add_recipients("d"); }, "with header.recipients [b,c], this publish has [b,c,d]"},
      {"role", [](auto* x) { x->set_role("judge"); }, "with header.role '', this publish has 'judge'"},
      {"policy", [](auto* x) { x->set_policy("full"); }, "with header.policy 'h2o-head:k=8', this publish has 'full'"},
      {"parent", [](auto* x) { x->set_parent_id("p"); }, "with header.parent_id '', this publish has 'p'"},
      {"n_gen", [](auto* x) { x->mutable_geometry()->set_n_gen(x->geometry().n_gen() + 1); },
       "with header.geometry.n_gen "},
      {"prompt_pos0", [](auto* x) { x->mutable_geometry()->set_prompt_pos0(7); },
       "with header.geometry.prompt_pos0 unset, this publish has 7"},
  };
  for (const Case& c : cases) {
    v1::PublishHeader other = h;
    c.edit(&other);
    auto r = PublishTurn(stub_.get(), other, t);
    EXPECT_EQ(r.status.error_code(), grpc::ALREADY_EXISTS) << c.name << ": " << r.status.error_message();
    EXPECT_NE(r.status.error_message().find("header.message_id: 'same' is already committed in session 's' " +
                                            c.message),
              std::string::npos)
        << c.name << ": " << r.status.error_message();
  }
  v1::PublishHeader reordered = h;
  reordered.clear_recipients();
  reordered.add_recipients("c");
  reordered.add_recipients("b");
  auto r = PublishTurn(stub_.get(), reordered, t);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_TRUE(r.response.duplicate());
  EXPECT_EQ(server_->store()->Stats().mailbox_messages, 2u);
  EXPECT_EQ(server_->store()->Stats().committed, 1u);
}

TEST_F(RelayTest, ParentChainComposesHistoryLikeTheCoreLibrary) {
  const std::string policy = "h2o-head:k=8+obf:p=4,mode=fast";
  Turn t1 = MakeTurn(4, /*first=*/true);
  ASSERT_TRUE(PublishTurn(stub_.get(), Header("chain", "m1", "planner", {"critic"}, policy, t1), t1).status.ok());
  // Not yet delivered to critic: FAILED_PRECONDITION.
  Turn t2 = MakeTurn(5, /*first=*/false);
  auto h2 = Header("chain", "m2", "critic", {"refiner"}, policy, t2);
  h2.set_parent_id("m1");
  auto early = PublishTurn(stub_.get(), h2, t2);
  EXPECT_EQ(early.status.error_code(), grpc::FAILED_PRECONDITION) << early.status.error_message();
  FetchResult f1 = DoFetch(stub_.get(), "chain", "critic", true);
  ASSERT_TRUE(f1.status.ok());
  // Another agent may not use it, nor learn that it exists.
  auto h_bad = Header("chain", "mx", "judger", {"refiner"}, policy, t2);
  h_bad.set_parent_id("m1");
  EXPECT_EQ(PublishTurn(stub_.get(), h_bad, t2).status.error_code(), grpc::NOT_FOUND);
  auto p2 = PublishTurn(stub_.get(), h2, t2);
  ASSERT_TRUE(p2.status.ok()) << p2.status.error_message();
  FetchResult f2 = DoFetch(stub_.get(), "chain", "refiner", true);
  ASSERT_TRUE(f2.status.ok());
  EXPECT_EQ(f2.header.parent_id(), "m1");
  // Offline: the same turn with the parent message as history, positions
  // continuing after the parent's.
  const Message m1 = Offline(t1, policy);
  Turn t2h = t2;
  int32_t next = 0;
  for (size_t l = 0; l < t2h.layers.size(); ++l) {
    t2h.layers[l].history_k = m1.layers[l].k;
    t2h.layers[l].history_v = m1.layers[l].v;
    t2h.layers[l].history_pos = m1.layers[l].pos;
    for (int32_t p : m1.layers[l].pos.data) next = std::max(next, p + 1);
  }
  t2h.prompt_pos0 = next;
  const Message want = Offline(t2h, policy);
  EXPECT_EQ(f2.header.n_history(), static_cast<uint32_t>(m1.layers[0].tokens()));
  EXPECT_EQ(f2.header.n_anchor(), 0u);
  EXPECT_EQ(p2.response.accounting().full_bytes(), want.full_bytes);
  ExpectSameMessage(f2.msg, want);
}

// Turns that carry the generated steps' queries instead of scores: the relay
// scores from them (history from the parent included) exactly as offline
// compression of the same turn does.
TEST_F(RelayTest, QueriesInsteadOfScoresThroughAParentChain) {
  const std::string policy = "h2o-head:k=8,window=4+obf:p=4,mode=fast";
  auto queries = [](uint64_t seed, bool first) {
    TurnShape s;
    s.layers = 3;
    s.kv_heads = 2;
    s.group = 3;
    s.head_dim = 32;
    s.n_prompt = 48;
    s.n_gen = 6;
    s.dtype = DType::kBF16;
    s.first_agent = first;
    s.queries = true;
    s.q_dtype = seed % 2 ? DType::kF32 : DType::kBF16;
    Turn t = RandomTurn(s, seed);
    t.softmax_scale = 0.2;
    return t;
  };
  Turn t1 = queries(31, true);
  auto p1 = PublishTurn(stub_.get(), Header("q", "m1", "planner", {"critic"}, policy, t1), t1);
  ASSERT_TRUE(p1.status.ok()) << p1.status.error_message();
  FetchResult f1 = DoFetch(stub_.get(), "q", "critic", true);
  ASSERT_TRUE(f1.status.ok());
  const Message m1 = Offline(t1, policy);
  ExpectSameMessage(f1.msg, m1);
  Turn t2 = queries(32, false);
  auto h2 = Header("q", "m2", "critic", {"refiner"}, policy, t2);
  h2.set_parent_id("m1");
  auto p2 = PublishTurn(stub_.get(), h2, t2);
  ASSERT_TRUE(p2.status.ok()) << p2.status.error_message();
  FetchResult f2 = DoFetch(stub_.get(), "q", "refiner", true);
  ASSERT_TRUE(f2.status.ok());
  Turn t2h = t2;
  for (size_t l = 0; l < t2h.layers.size(); ++l) {
    t2h.layers[l].history_k = m1.layers[l].k;
    t2h.layers[l].history_v = m1.layers[l].v;
    t2h.layers[l].history_pos = m1.layers[l].pos;
  }
  t2h.prompt_pos0 = m1.next_pos;
  ExpectSameMessage(f2.msg, Offline(t2h, policy));

  // window= with precomputed scores is refused from the header, before any chunk.
  Turn scored = MakeTurn(33);
  auto bad = PublishTurn(stub_.get(), Header("q", "m3", "planner", {"critic"}, "h2o-layer:window=2", scored), scored);
  EXPECT_EQ(bad.status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_EQ(bad.status.error_message(),
            "header.policy: policy stage 'h2o-layer': window=2 scores from the generated steps' queries: expected "
            "layer.0.gen.q, the turn carries layer.0.prompt.score (header.geometry.query_dtype is unset)");
}

// A parent turn that generated nothing and whose last prompt tokens were
// evicted still ends at prompt_pos0 + n_prompt: a child continues there, not
// after the last position the parent kept (those ids belonged to evicted
// tokens).
TEST_F(RelayTest, ChildContinuesAfterTheParentsLastToken) {
  TurnShape s;
  s.layers = 2;
  s.kv_heads = 2;
  s.group = 1;
  s.head_dim = 16;
  s.n_prompt = 20;
  s.n_gen = 0;
  s.dtype = DType::kF32;
  Turn t1 = RandomTurn(s, 41);
  for (TurnLayer& l : t1.layers) {
    for (int h = 0; h < 2; ++h) {
      for (int j = 0; j < 20; ++j) l.scores.at(h, j) = j < 10 ? 1.0f : 0.0f;  // the tail is evicted
    }
  }
  ASSERT_TRUE(PublishTurn(stub_.get(), Header("end", "m1", "a", {"b"}, "h2o-head:k=4", t1), t1).status.ok());
  FetchResult f1 = DoFetch(stub_.get(), "end", "b", true);
  ASSERT_TRUE(f1.status.ok()) << f1.status.error_message();
  // The receiver learns where the turn ended, past the last id it holds.
  EXPECT_EQ(f1.header.next_pos(), 20);
  EXPECT_EQ(HeldEnd(f1.msg), 8);  // anchors 0..3, then k=4 of the tied 4..9 (ties go low)
  s.first_agent = false;
  s.n_prompt = 3;
  Turn t2 = RandomTurn(s, 42);
  auto h2 = Header("end", "m2", "b", {"c"}, "full", t2);
  h2.set_parent_id("m1");
  // An explicit start inside the parent's turn would reuse its position ids.
  auto early = h2;
  early.set_message_id("m-early");
  early.mutable_geometry()->set_prompt_pos0(19);
  auto e = PublishTurn(stub_.get(), early, t2);
  EXPECT_EQ(e.status.error_code(), grpc::INVALID_ARGUMENT) << e.status.error_message();
  EXPECT_NE(e.status.error_message().find("header.geometry.prompt_pos0: 19, expected >= 20 (where the parent 'm1' "
                                          "ended"),
            std::string::npos)
      << e.status.error_message();
  ASSERT_TRUE(PublishTurn(stub_.get(), h2, t2).status.ok());
  FetchResult f = DoFetch(stub_.get(), "end", "c", true);
  ASSERT_TRUE(f.status.ok()) << f.status.error_message();
  const MessageLayer& l0 = f.msg.layers[0];
  const int n_hist = static_cast<int>(f.header.n_history());
  for (int h = 0; h < 2; ++h) {
    for (int j = 0; j < n_hist; ++j) EXPECT_LT(l0.pos.at(h, j), 10) << "parent kept only tokens 0..9";
    for (int j = 0; j < 3; ++j) EXPECT_EQ(l0.pos.at(h, n_hist + j), 20 + j) << "head " << h;
  }
  EXPECT_EQ(f.header.next_pos(), 23);
}

TEST_F(RelayTest, FanOutAndSessionClose) {
  Turn t = MakeTurn(6);
  ASSERT_TRUE(PublishTurn(stub_.get(), Header("fan", "m", "a", {"b", "c", "d"}, "gen", t), t).status.ok());
  for (const char* agent : {"b", "c", "d"}) {
    FetchResult f = DoFetch(stub_.get(), "fan", agent, true);
    ASSERT_TRUE(f.status.ok()) << agent;
    EXPECT_EQ(f.header.message_id(), "m");
    EXPECT_EQ(f.header.delivery_attempt(), 1u);
  }
  ASSERT_TRUE(PublishTurn(stub_.get(), Header("fan", "m2", "a", {"b"}, "gen", t), t).status.ok());
  grpc::ClientContext ctx;
  v1::CloseSessionRequest req;
  req.set_session_id("fan");
  v1::CloseSessionResponse resp;
  ASSERT_TRUE(stub_->CloseSession(&ctx, req, &resp).ok());
  EXPECT_EQ(resp.messages_freed(), 2u);
  ExpectNothingFor("fan", "b");
  const StoreStats st = server_->store()->Stats();
  EXPECT_EQ(st.sessions, 0u);
  EXPECT_EQ(st.mailbox_bytes, 0u);
}

TEST_F(RelayTest, FetchWaitsForAPublish) {
  Turn t = MakeTurn(7);
  std::thread publisher([&] {
    // Once the Fetch waits: it must be woken, not find the message there.
    EXPECT_TRUE(Eventually([&] { return server_->store()->Stats().fetch_waiters == 1; }));
    EXPECT_TRUE(PublishTurn(stub_.get(), Header("w", "m", "a", {"b"}, "gen", t), t).status.ok());
  });
  FetchResult f = DoFetch(stub_.get(), "w", "b", true, 10);
  publisher.join();
  ASSERT_TRUE(f.status.ok()) << f.status.error_message();
  EXPECT_EQ(f.header.message_id(), "m");
}

TEST_F(RelayTest, SessionsExpireAfterTheTtl) {
  server_->Shutdown();
  ServerConfig cfg;
  cfg.session_ttl_seconds = 0.3;
  StartServer(cfg);
  Turn t = MakeTurn(8);
  ASSERT_TRUE(PublishTurn(stub_.get(), Header("ttl", "m", "a", {"b"}, "gen", t), t).status.ok());
  EXPECT_EQ(server_->store()->Stats().sessions, 1u);
  Eventually([&] { return server_->store()->Stats().sessions == 0; }, std::chrono::seconds(5));
  EXPECT_EQ(server_->store()->Stats().sessions, 0u);
  ExpectNothingFor("ttl", "b");
}

TEST_F(RelayTest, DisconnectMidUploadLeavesNothing) {
  TurnShape s;
  s.layers = 6;
  s.n_prompt = 512;
  s.head_dim = 64;
  s.dtype = DType::kF32;
  Turn t = RandomTurn(s, 9);
  auto chunks = TurnChunks(t, 4096);
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(10));
    v1::PublishResponse resp;
    auto w = stub_->Publish(&ctx, &resp);
    v1::PublishRequest req;
    *req.mutable_header() = Header("cut", "m", "a", {"b"}, "h2o-head:k=8", t);
    ASSERT_TRUE(w->Write(req));
    for (size_t i = 0; i < chunks.size() / 2; ++i) {
      *req.mutable_chunk() = chunks[i];
      ASSERT_TRUE(w->Write(req));
    }
    // Let the server take some of it in before the cut.
    Eventually([&] { return server_->store()->Stats().received_bytes != 0; }, std::chrono::seconds(5));
    EXPECT_GT(server_->store()->inflight_bytes(), 0u);
    ctx.TryCancel();
    EXPECT_EQ(w->Finish().error_code(), grpc::CANCELLED);
  }
  WaitInflightZero();
  ExpectNothingFor("cut", "b");
  EXPECT_EQ(server_->store()->Stats().committed, 0u);
}

TEST_F(RelayTest, EightConcurrentPublishers) {
  constexpr int kN = 8;
  std::vector<Turn> turns;
  for (int i = 0; i < kN; ++i) turns.push_back(MakeTurn(100 + i));
  std::vector<PublishResult> results(kN);
  std::vector<std::thread> threads;
  for (int i = 0; i < kN; ++i) {
    threads.emplace_back([&, i] {
      results[i] = PublishTurn(stub_.get(),
                               Header("conc", "m" + std::to_string(i), "a" + std::to_string(i), {"sink"},
                                      "h2o-head:k=8+obf:p=4,mode=fast", turns[i]),
                               turns[i], 2048);
    });
  }
  for (auto& th : threads) th.join();
  for (int i = 0; i < kN; ++i) ASSERT_TRUE(results[i].status.ok()) << i << ": " << results[i].status.error_message();
  std::set<std::string> got;
  for (int i = 0; i < kN; ++i) {
    FetchResult f = DoFetch(stub_.get(), "conc", "sink", true);
    ASSERT_TRUE(f.status.ok());
    const int idx = std::stoi(f.header.message_id().substr(1));
    ExpectSameMessage(f.msg, Offline(turns[idx], "h2o-head:k=8+obf:p=4,mode=fast"));
    got.insert(f.header.message_id());
  }
  EXPECT_EQ(got.size(), static_cast<size_t>(kN));
  WaitInflightZero();
}

// Every bad input: its exact code, and nothing visible afterwards.
TEST_F(RelayTest, BadInputsTable) {
  Turn t = MakeTurn(10);
  Turn nan_turn = MakeTurn(10);
  {
    float nanv = std::nanf("");
    nan_turn.layers[2].gen_v.WriteRow(1, 2, std::vector<float>(32, nanv).data());
  }
  const auto good_chunks = TurnChunks(t, 1024);
  const auto header = Header("bad", "m", "a", {"b"}, "h2o-head:k=8", t);
  struct Case {
    std::string name;
    std::function<std::vector<v1::PublishRequest>()> make;
    grpc::StatusCode code;
    std::string needle;
  };
  auto with_header = [&](std::function<void(v1::PublishHeader*)> f) {
    return [&, f] {
      v1::PublishHeader h = header;
      f(&h);
      return PublishStream(h, good_chunks, TrailerOf(good_chunks));
    };
  };
  auto with_chunks = [&](std::function<void(std::vector<v1::Chunk>*)> f) {
    return [&, f] {
      auto c = good_chunks;
      f(&c);
      return PublishStream(header, c, TrailerOf(c));
    };
  };
  std::vector<Case> cases = {
      {"missing header", [&] { auto r = PublishStream(header, good_chunks, TrailerOf(good_chunks)); r.erase(r.begin()); return r; },
       grpc::INVALID_ARGUMENT, "expected the header first"},
      {"empty stream", [] { return std::vector<v1::PublishRequest>{}; }, grpc::INVALID_ARGUMENT, "expected a header"},
      {"no commit", [&] { auto r = PublishStream(header, good_chunks, TrailerOf(good_chunks)); r.pop_back(); return r; },
       grpc::INVALID_ARGUMENT, "before the commit"},
      {"bad session id", with_header([](auto* h) { h->set_session_id("has space"); }), grpc::INVALID_ARGUMENT, "header.session_id"},
      {"no recipients", with_header([](auto* h) { h->clear_recipients(); }), grpc::INVALID_ARGUMENT, "header.recipients"},
      {"no sender", with_header([](auto* h) { h->clear_sender(); }), grpc::INVALID_ARGUMENT, "header.sender"},
      {"unknown policy token", with_header([](auto* h) { h->set_policy("h2o-head:k=8+bogus"); }), grpc::INVALID_ARGUMENT, "bogus"},
      // Quoting a long spec in the status would pass gRPC's 8 KiB metadata
      // limit, which clients report as RESOURCE_EXHAUSTED.
      {"long policy", with_header([](auto* h) { h->set_policy(std::string(5000, 'x')); }), grpc::INVALID_ARGUMENT,
       "header.policy: 5000 bytes, expected at most 1024"},
      {"unknown dtype", with_header([](auto* h) { h->mutable_geometry()->set_dtype(v1::DTYPE_UNSPECIFIED); }),
       grpc::INVALID_ARGUMENT, "header.geometry.dtype"},
      {"shape mismatch", with_header([](auto* h) { h->mutable_geometry()->set_head_dim(16); }), grpc::INVALID_ARGUMENT, "chunk"},
      {"missing geometry", with_header([](auto* h) { h->clear_geometry(); }), grpc::INVALID_ARGUMENT, "header.geometry"},
      {"bad parent", with_header([](auto* h) { h->set_parent_id("nope"); h->mutable_geometry()->set_first_agent(false); }),
       grpc::NOT_FOUND, "header.parent_id"},
      {"out of order", with_chunks([](auto* c) { std::swap((*c)[0], (*c)[1]); }), grpc::INVALID_ARGUMENT, "expected layer 0"},
      {"duplicate chunk", with_chunks([](auto* c) { c->insert(c->begin() + 3, (*c)[2]); }), grpc::INVALID_ARGUMENT, "offset"},
      {"bad chunk crc", with_chunks([](auto* c) { (*c)[5].set_crc32c(1); }), grpc::DATA_LOSS, "chunk.crc32c"},
      {"bad commit crc", [&] { auto tr = TrailerOf(good_chunks); tr.set_crc32c(tr.crc32c() ^ 1); return PublishStream(header, good_chunks, tr); },
       grpc::DATA_LOSS, "commit.crc32c"},
      {"bad commit count", [&] { auto tr = TrailerOf(good_chunks); tr.set_chunks(1); return PublishStream(header, good_chunks, tr); },
       grpc::INVALID_ARGUMENT, "commit.chunks"},
      {"nan value", [&] { auto c = TurnChunks(nan_turn, 1024); return PublishStream(header, c, TrailerOf(c)); },
       grpc::INVALID_ARGUMENT, "layer.2.gen.v"},
      {"second header", [&] { auto r = PublishStream(header, good_chunks, TrailerOf(good_chunks)); r.insert(r.begin() + 2, r[0]); return r; },
       grpc::INVALID_ARGUMENT, "second header"},
      {"empty request", [&] { auto r = PublishStream(header, good_chunks, TrailerOf(good_chunks)); r.insert(r.begin() + 1, v1::PublishRequest()); return r; },
       grpc::INVALID_ARGUMENT, "none of header"},
  };
  for (const Case& tc : cases) {
    PublishResult r = DoPublish(stub_.get(), tc.make(), 10);
    EXPECT_EQ(r.status.error_code(), tc.code) << tc.name << ": " << r.status.error_message();
    EXPECT_NE(r.status.error_message().find(tc.needle), std::string::npos) << tc.name << ": " << r.status.error_message();
  }
  WaitInflightZero();
  EXPECT_EQ(server_->store()->Stats().committed, 0u);
  EXPECT_EQ(server_->store()->Stats().sessions, 0u);
  ExpectNothingFor("bad", "b");
}

// Raw calls: any gRPC client may send bytes that are not relay.proto's.
std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> RawPublish(grpc::Channel* ch, grpc::ClientContext* ctx,
                                                                 grpc::ByteBuffer* resp) {
  static const grpc::internal::RpcMethod kMethod("/kvrelay.v1.Relay/Publish",
                                                 grpc::internal::RpcMethod::CLIENT_STREAMING);
  return std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>>(
      grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(ch, kMethod, ctx, resp));
}

TEST_F(RelayTest, RequestsThatAreNotProtobufAreInvalidArgument) {
  Turn t = MakeTurn(11);
  const grpc::Slice junk_slice(std::string(9, '\xff'));
  const grpc::ByteBuffer junk(&junk_slice, 1);
  {  // a valid header, then bytes that are no PublishRequest
    grpc::ClientContext ctx;
    grpc::ByteBuffer resp;
    auto w = RawPublish(channel_.get(), &ctx, &resp);
    v1::PublishRequest h;
    *h.mutable_header() = Header("raw", "m1", "a", {"b"}, "h2o-head:k=8", t);
    w->Write(EncodeProto(h));
    w->Write(junk);
    w->WritesDone();
    const grpc::Status s = w->Finish();
    EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT) << s.error_message();
    EXPECT_NE(s.error_message().find(absl::StrCat(": request of ", junk.Length(),
                                                  " bytes is not a kvrelay.v1.PublishRequest (malformed")),
              std::string::npos)
        << s.error_message();
  }
  {  // a Fetch whose request is no FetchRequest
    static const grpc::internal::RpcMethod kFetch("/kvrelay.v1.Relay/Fetch",
                                                  grpc::internal::RpcMethod::SERVER_STREAMING);
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> r(
        grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(channel_.get(), kFetch, &ctx, junk));
    grpc::ByteBuffer b;
    while (r->Read(&b)) {
    }
    const grpc::Status s = r->Finish();
    EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT) << s.error_message();
    EXPECT_NE(s.error_message().find(absl::StrCat(": request of ", junk.Length(),
                                                  " bytes is not a kvrelay.v1.FetchRequest (malformed")),
              std::string::npos)
        << s.error_message();
  }
  // The unary calls name the message they expected too.
  for (const char* method : {"Ack", "CloseSession", "Stats"}) {
    const std::string path = std::string("/kvrelay.v1.Relay/") + method;  // RpcMethod keeps the pointer
    const grpc::internal::RpcMethod m(path.c_str(), grpc::internal::RpcMethod::NORMAL_RPC);
    grpc::ClientContext ctx;
    grpc::ByteBuffer resp;
    const grpc::Status s = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
        channel_.get(), m, &ctx, junk, &resp);
    EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT) << method << ": " << s.error_message();
    EXPECT_NE(s.error_message().find(absl::StrCat(": request of ", junk.Length(), " bytes is not a kvrelay.v1.",
                                                  method, "Request (malformed")),
              std::string::npos)
        << method << ": " << s.error_message();
  }
  WaitInflightZero();
  EXPECT_EQ(server_->store()->Stats().committed, 0u);
  ExpectNothingFor("raw", "b");
}

// The relay reads plain chunk messages straight from gRPC's buffers; a
// chunk encoded some other valid way (here each after an empty header
// field, which protobuf's oneof replaces) is parsed as a PublishRequest and
// must give the same message.
TEST_F(RelayTest, UnusuallyEncodedChunksGiveTheSameMessage) {
  Turn t = MakeTurn(12);
  const std::string policy = "h2o-head:k=8+obf:p=4";
  const auto chunks = TurnChunks(t, 1000);
  grpc::ClientContext ctx;
  grpc::ByteBuffer resp;
  auto w = RawPublish(channel_.get(), &ctx, &resp);
  v1::PublishRequest req;
  *req.mutable_header() = Header("odd", "m1", "a", {"b"}, policy, t);
  ASSERT_TRUE(w->Write(EncodeProto(req)));
  v1::PublishRequest empty_header;
  empty_header.mutable_header();
  for (const v1::Chunk& c : chunks) {
    *req.mutable_chunk() = c;
    const std::string bytes = empty_header.SerializeAsString() + req.SerializeAsString();
    const grpc::Slice slice(bytes);
    ASSERT_TRUE(w->Write(grpc::ByteBuffer(&slice, 1)));
  }
  *req.mutable_commit() = TrailerOf(chunks);
  ASSERT_TRUE(w->Write(EncodeProto(req)));
  w->WritesDone();
  const grpc::Status s = w->Finish();
  ASSERT_TRUE(s.ok()) << s.error_message();
  FetchResult f = DoFetch(stub_.get(), "odd", "b", true);
  ASSERT_TRUE(f.status.ok()) << f.status.error_message();
  ExpectSameMessage(f.msg, Offline(t, policy));
}

TEST_F(RelayTest, LimitsAreResourceExhausted) {
  server_->Shutdown();
  ServerConfig cfg;
  cfg.max_inflight_bytes = 4096;
  StartServer(cfg);
  Turn t = MakeTurn(11);
  auto r = PublishTurn(stub_.get(), Header("lim", "m", "a", {"b"}, "gen", t), t);
  EXPECT_EQ(r.status.error_code(), grpc::RESOURCE_EXHAUSTED) << r.status.error_message();
  EXPECT_NE(r.status.error_message().find("--max-inflight-bytes"), std::string::npos);

  server_->Shutdown();
  cfg = ServerConfig();
  cfg.max_session_messages = 1;
  StartServer(cfg);
  ASSERT_TRUE(PublishTurn(stub_.get(), Header("lim", "m1", "a", {"b"}, "gen", t), t).status.ok());
  r = PublishTurn(stub_.get(), Header("lim", "m2", "a", {"b"}, "gen", t), t);
  EXPECT_EQ(r.status.error_code(), grpc::RESOURCE_EXHAUSTED) << r.status.error_message();
  WaitInflightZero();
}

TEST_F(RelayTest, CompressRpcIsStateless) {
  Turn t = MakeTurn(12);
  const std::string policy = "h2o-head:k=8+obf:p=4+int8";
  const FetchResult r = DoCompress(stub_.get(), t, policy, 3000);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_TRUE(r.trailer_ok);
  const Message want = Offline(t, policy);
  EXPECT_EQ(r.header.accounting().sent_bytes(), want.sent_bytes);
  ExpectSameMessage(r.msg, want);
  EXPECT_EQ(server_->store()->Stats().sessions, 0u);
  WaitInflightZero();
  // A long spec is named by its length, not quoted (see BadInputsTable).
  const FetchResult bad = DoCompress(stub_.get(), t, std::string(5000, 'x'), 3000);
  EXPECT_EQ(bad.status.error_code(), grpc::INVALID_ARGUMENT) << bad.status.error_message();
  EXPECT_EQ(bad.status.error_message(), "header.policy: 5000 bytes, expected at most 1024");
  WaitInflightZero();
}

TEST_F(RelayTest, MetricsMatchTheAccountingAndStats) {
  Turn t = MakeTurn(13);
  uint64_t full = 0, sent = 0, received = 0;
  for (int i = 0; i < 3; ++i) {
    auto r = PublishTurn(stub_.get(), Header("met", "m" + std::to_string(i), "a", {"b"}, "h2o-head:k=8", t), t);
    ASSERT_TRUE(r.status.ok());
    full += r.response.accounting().full_bytes();
    sent += r.response.accounting().sent_bytes();
    received += r.response.accounting().received_bytes();
  }
  grpc::ClientContext ctx;
  v1::StatsResponse st;
  ASSERT_TRUE(stub_->Stats(&ctx, v1::StatsRequest(), &st).ok());
  EXPECT_EQ(st.messages_committed(), 3u);
  EXPECT_EQ(st.full_bytes(), full);
  EXPECT_EQ(st.sent_bytes(), sent);
  EXPECT_EQ(st.received_bytes(), received);
  EXPECT_EQ(st.mailbox_messages(), 3u);
  // Each message retains its sent bytes, its acc and its bookkeeping.
  const uint64_t retained = sent + 3 * (AccBytes(Offline(t, "h2o-head:k=8")) + kMessageOverheadBytes +
                                        kLayerOverheadBytes * t.layers.size());
  EXPECT_EQ(st.store_bytes(), retained);
  EXPECT_EQ(st.mailbox_bytes(), retained);
  const std::string text = prometheus::TextSerializer().Serialize(server_->metrics()->registry()->Collect());
  EXPECT_NE(text.find("kvrelay_full_bytes_total{family=\"h2o-head\"} " + std::to_string(full)), std::string::npos) << text;
  EXPECT_NE(text.find("kvrelay_sent_bytes_total{family=\"h2o-head\"} " + std::to_string(sent)), std::string::npos);
  EXPECT_NE(text.find("kvrelay_saved_bytes_total{family=\"h2o-head\"} " + std::to_string(full - sent)), std::string::npos);
  EXPECT_NE(text.find("kvrelay_received_bytes_total " + std::to_string(received)), std::string::npos);
  EXPECT_NE(text.find("kvrelay_messages_total{outcome=\"committed\"} 3"), std::string::npos);
  EXPECT_NE(text.find("kvrelay_mailbox_messages 3"), std::string::npos);
  EXPECT_NE(text.find("kvrelay_store_bytes " + std::to_string(retained)), std::string::npos);
}

// An uploaded history with the chain's anchors in the header: the budget
// keeps them, the message equals offline compression, and a retry of the
// same publish (anchors and all) is a duplicate.
TEST_F(RelayTest, UploadedHistoryKeepsItsAnchorsUnderABudget) {
  testing::TurnShape s;
  s.n_history = 12;
  s.first_agent = false;
  Turn t = testing::RandomTurn(s, 23);
  for (TurnLayer& l : t.layers) {
    for (int h = 0; h < s.kv_heads; ++h) {
      l.history_pos.at(h, 0) = 0;
      l.history_pos.at(h, 1) = 2;
    }
  }
  t.history_anchors = {0, 2};
  // This agent's mass on the uploaded history travels too (history.score).
  for (TurnLayer& l : t.layers) {
    l.history_score = ScoreMatrix(l.scores.rows, s.n_history);
    for (size_t i = 0; i < l.history_score.data.size(); ++i) l.history_score.data[i] = 0.1f * (i % 11);
  }
  const std::string policy = "h2o-head:k=6,hist=3";
  auto h = Header("anch", "u1", "a", {"b"}, policy, t);
  ASSERT_EQ(h.geometry().history_anchors_size(), 2);
  ASSERT_EQ(h.geometry().history_score_tokens(), 12u);
  auto r = PublishTurn(stub_.get(), h, t);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  FetchResult f = DoFetch(stub_.get(), "anch", "b", true);
  ASSERT_TRUE(f.status.ok());
  const Message want = Offline(t, policy);
  EXPECT_EQ(want.n_history, 2 + 3);
  EXPECT_EQ(f.header.n_history(), 5u);
  EXPECT_EQ(std::vector<int32_t>(f.header.anchor_pos().begin(), f.header.anchor_pos().end()),
            (std::vector<int32_t>{0, 2}));
  ExpectSameMessage(f.msg, want);
  MessagePtr stored = server_->store()->Find("anch", "u1");
  ASSERT_NE(stored, nullptr);
  EXPECT_EQ(stored->msg.layers[1].acc, want.layers[1].acc);
  auto again = PublishTurn(stub_.get(), h, t);
  ASSERT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_TRUE(again.response.duplicate());
  // The same id with other anchors is another publish: ALREADY_EXISTS naming the field.
  Turn other = t;
  other.history_anchors = {0};
  auto h2 = Header("anch", "u1", "a", {"b"}, policy, other);
  auto clash = PublishTurn(stub_.get(), h2, other);
  EXPECT_EQ(clash.status.error_code(), grpc::ALREADY_EXISTS);
  EXPECT_NE(clash.status.error_message().find("header.geometry.history_anchors [0,2], this publish has [0]"), std::string::npos)
      << clash.status.error_message();
}

// An agent with scores (no queries) publishing on a parent sends its mass on
// the parent's tokens (history.score): it adds to their acc, so a history
// budget keeps what this agent attended to. The stored message (acc
// included) is bit-exact with ComposeOnParent + offline compression.
TEST_F(RelayTest, HistoryScoreOnAParentAddsToAcc) {
  const std::string policy = "h2o-head:k=6,hist=4";
  Turn t1 = MakeTurn(41, /*first=*/true);
  ASSERT_TRUE(PublishTurn(stub_.get(), Header("hs", "m1", "planner", {"critic"}, policy, t1), t1).status.ok());
  ASSERT_TRUE(DoFetch(stub_.get(), "hs", "critic", true).status.ok());
  const Message m1 = Offline(t1, policy);
  const int n1 = m1.layers[0].tokens();
  const int S = t1.layers[0].scores.rows;
  Turn t2 = MakeTurn(42, /*first=*/false);
  std::mt19937 rng(42);
  std::uniform_real_distribution<float> mass(0.0f, 1.0f);
  for (TurnLayer& l : t2.layers) {
    l.history_score = ScoreMatrix(S, n1);
    // Heavy mass on the last tokens: they displace the parent's own ranking.
    for (int q = 0; q < S; ++q) {
      for (int j = 0; j < n1; ++j) l.history_score.at(q, j) = mass(rng) * (j >= n1 - 3 ? 50.0f : 1.0f);
    }
  }
  Turn composed = t2;
  ASSERT_TRUE(ComposeOnParent(m1, &composed).ok());
  const Message want = Offline(composed, policy);
  Turn unscored = t2;
  for (TurnLayer& l : unscored.layers) l.history_score = ScoreMatrix();
  ASSERT_TRUE(ComposeOnParent(m1, &unscored).ok());
  const Message without = Offline(unscored, policy);
  ASSERT_NE(want.layers[0].pos.data, without.layers[0].pos.data) << "the mass should change what is kept";

  // A count other than the parent's tokens: FAILED_PRECONDITION, from the header.
  {
    auto h = Header("hs", "bad", "critic", {"refiner"}, policy, t2);
    h.set_parent_id("m1");
    h.mutable_geometry()->set_history_score_tokens(n1 + 1);
    auto r = PublishTurn(stub_.get(), h, t2);
    EXPECT_EQ(r.status.error_code(), grpc::FAILED_PRECONDITION);
    EXPECT_EQ(r.status.error_message(),
              absl::StrCat("header.geometry.history_score_tokens: ", n1 + 1, ", expected 0 or ", n1,
                           " (the tokens per head of the parent 'm1', which history.score covers)"));
  }
  // A negative mass: INVALID_ARGUMENT naming the tensor; nothing is stored.
  {
    Turn neg = t2;
    neg.layers[1].history_score.at(0, 2) = -1.0f;
    auto h = Header("hs", "neg", "critic", {"refiner"}, policy, neg);
    h.set_parent_id("m1");
    auto r = PublishTurn(stub_.get(), h, neg);
    EXPECT_EQ(r.status.error_code(), grpc::INVALID_ARGUMENT);
    EXPECT_NE(r.status.error_message().find("layer.1.history.score: value -1 at [0,2], expected a finite attention "
                                            "mass >= 0"),
              std::string::npos)
        << r.status.error_message();
    EXPECT_EQ(server_->store()->Find("hs", "neg"), nullptr);
  }
  auto h2 = Header("hs", "m2", "critic", {"refiner"}, policy, t2);
  h2.set_parent_id("m1");
  ASSERT_EQ(h2.geometry().history_score_tokens(), static_cast<uint32_t>(n1));
  auto p2 = PublishTurn(stub_.get(), h2, t2);
  ASSERT_TRUE(p2.status.ok()) << p2.status.error_message();
  FetchResult f2 = DoFetch(stub_.get(), "hs", "refiner", true);
  ASSERT_TRUE(f2.status.ok());
  ExpectSameMessage(f2.msg, want);
  MessagePtr stored = server_->store()->Find("hs", "m2");
  ASSERT_NE(stored, nullptr);
  for (size_t l = 0; l < want.layers.size(); ++l) {
    EXPECT_EQ(stored->msg.layers[l].acc, want.layers[l].acc) << "layer " << l;
  }
}

// h2o-auto's choice per layer is counted, as the offline compression of the
// same turn makes it.
TEST_F(RelayTest, AutoGranularityIsCountedPerLayer) {
  Turn t = MakeTurn(17);
  const std::string spec = "h2o-auto:k=8,tau=0.97";
  absl::StatusOr<Message> offline = (*Pipeline::Create(spec))->Compress(t);
  ASSERT_TRUE(offline.ok()) << offline.status();
  int head = 0, layer = 0;
  for (const MessageLayer& l : offline->layers) {
    head += l.granularity == Granularity::kHead;
    layer += l.granularity == Granularity::kLayer;
  }
  ASSERT_EQ(head + layer, static_cast<int>(t.layers.size()));
  auto r = PublishTurn(stub_.get(), Header("auto", "a1", "a", {"b"}, spec, t), t);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  const std::string text = prometheus::TextSerializer().Serialize(server_->metrics()->registry()->Collect());
  EXPECT_NE(text.find("kvrelay_auto_granularity_layers_total{granularity=\"head\"} " + std::to_string(head)),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("kvrelay_auto_granularity_layers_total{granularity=\"layer\"} " + std::to_string(layer)),
            std::string::npos);
}

// ---- review fixes ----

grpc::Status Close(v1::Relay::Stub* stub, const std::string& session, uint32_t* messages_freed = nullptr) {
  grpc::ClientContext ctx;
  v1::CloseSessionRequest req;
  req.set_session_id(session);
  v1::CloseSessionResponse resp;
  grpc::Status s = stub->CloseSession(&ctx, req, &resp);
  if (messages_freed) *messages_freed = resp.messages_freed();
  return s;
}

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// 3a: CloseSession ends a Fetch waiting on the session, promptly, NOT_FOUND.
TEST_F(RelayTest, CloseSessionEndsWaitingFetches) {
  Turn t = MakeTurn(20);
  ASSERT_TRUE(PublishTurn(stub_.get(), Header("cl", "m", "a", {"b"}, "gen", t), t).status.ok());
  FetchResult waiting, waiting_empty;
  const auto t0 = std::chrono::steady_clock::now();
  std::thread f1([&] { waiting = DoFetch(stub_.get(), "cl", "c", true, 30); });
  std::thread f2([&] { waiting_empty = DoFetch(stub_.get(), "nothing-yet", "c", true, 30); });
  ASSERT_TRUE(Eventually([&] { return server_->store()->Stats().fetch_waiters == 2; }));
  ASSERT_TRUE(Close(stub_.get(), "cl").ok());
  ASSERT_TRUE(Close(stub_.get(), "nothing-yet").ok());
  f1.join();
  f2.join();
  EXPECT_LT(Seconds(t0), 5.0);
  EXPECT_EQ(waiting.status.error_code(), grpc::NOT_FOUND) << waiting.status.error_message();
  EXPECT_NE(waiting.status.error_message().find("session_id: 'cl'"), std::string::npos)
      << waiting.status.error_message();
  EXPECT_NE(waiting.status.error_message().find("closed"), std::string::npos);
  EXPECT_EQ(waiting_empty.status.error_code(), grpc::NOT_FOUND) << waiting_empty.status.error_message();
}

// 3a: shutdown wakes waiting Fetches (UNAVAILABLE) instead of draining for the grace period.
TEST_F(RelayTest, ShutdownEndsWaitingFetchesWithoutTheGracePeriod) {
  FetchResult waiting;
  std::thread f([&] { waiting = DoFetch(stub_.get(), "sd", "b", true, 30); });
  ASSERT_TRUE(Eventually([&] { return server_->store()->Stats().fetch_waiters == 1; }));
  const auto t0 = std::chrono::steady_clock::now();
  server_->Shutdown();  // grace 2 s
  const double took = Seconds(t0);
  f.join();
  EXPECT_LT(took, 1.5);
  EXPECT_EQ(waiting.status.error_code(), grpc::UNAVAILABLE) << waiting.status.error_message();
}

// 2a/3b: geometry past the core's bounds is refused at the header; nothing reserved.
TEST_F(RelayTest, GeometryPastTheCoreBoundsIsRefusedAtTheHeader) {
  Turn t = MakeTurn(21);
  auto h = Header("geo", "m", "a", {"b"}, "gen", t);
  h.mutable_geometry()->set_layers(1025);
  auto chunks = TurnChunks(t);
  PublishResult r = DoPublish(stub_.get(), PublishStream(h, chunks, TrailerOf(chunks)));
  EXPECT_EQ(r.status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_EQ(r.status.error_message(), "header.geometry.layers: 1025, expected 1..1024");
  h = Header("geo", "m", "a", {"b"}, "gen", t);
  h.mutable_geometry()->set_head_dim(4096);
  r = DoPublish(stub_.get(), PublishStream(h, chunks, TrailerOf(chunks)));
  EXPECT_EQ(r.status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_EQ(r.status.error_message(), "header.geometry.head_dim: 4096, expected 1..1024");
  EXPECT_EQ(server_->store()->Stats().received_bytes, 0u);
  EXPECT_EQ(server_->store()->inflight_bytes(), 0u);
}

// Starts a publish and leaves it open after `n_chunks` chunks; Finish() cuts it.
struct OpenPublish {
  grpc::ClientContext ctx;
  v1::PublishResponse resp;
  std::unique_ptr<grpc::ClientWriter<v1::PublishRequest>> w;
  OpenPublish(v1::Relay::Stub* stub, const v1::PublishHeader& h, const std::vector<v1::Chunk>& chunks,
              size_t n_chunks) {
    ctx.set_deadline(In(30));
    w = stub->Publish(&ctx, &resp);
    v1::PublishRequest req;
    *req.mutable_header() = h;
    EXPECT_TRUE(w->Write(req));
    for (size_t i = 0; i < n_chunks; ++i) {
      *req.mutable_chunk() = chunks[i];
      EXPECT_TRUE(w->Write(req));
    }
  }
  grpc::Status Cut() {
    ctx.TryCancel();
    return w->Finish();
  }
  // Sends chunks[from..], the commit over all of `chunks`, and finishes.
  grpc::Status Complete(const std::vector<v1::Chunk>& chunks, size_t from) {
    v1::PublishRequest req;
    for (size_t i = from; i < chunks.size(); ++i) {
      *req.mutable_chunk() = chunks[i];
      EXPECT_TRUE(w->Write(req)) << "chunk " << i;
    }
    *req.mutable_commit() = TrailerOf(chunks);
    EXPECT_TRUE(w->Write(req)) << "commit";
    w->WritesDone();
    return w->Finish();
  }
};

uint64_t WaitFor(const std::function<uint64_t()>& get, uint64_t want) {
  Eventually([&] { return get() == want; });
  return get();
}

// Two uploads of one id at once: the one that commits second is a duplicate
// if it is the same publish, ALREADY_EXISTS if its header differs.
TEST_F(RelayTest, RacingPublishesOfOneIdAreComparedAtCommit) {
  Turn t = MakeTurn(31);
  const auto chunks = TurnChunks(t, 1024);
  for (const bool same : {true, false}) {
    SCOPED_TRACE(same);
    const std::string id = same ? "race-same" : "race-other";
    auto first = Header("race", id, "a", {"b"}, "gen", t);
    auto second = first;
    if (!same) second.set_policy("full");
    WaitInflightZero();  // the previous round's reservations are gone
    OpenPublish open(stub_.get(), first, chunks, 1);
    // Its reservation shows the header was read: past the header's duplicate check.
    ASSERT_EQ(WaitFor([&] { return server_->store()->inflight_bytes() > 0 ? 1u : 0u; }, 1), 1u);
    ASSERT_TRUE(PublishTurn(stub_.get(), second, t).status.ok());
    const grpc::Status st = open.Complete(chunks, 1);
    if (same) {
      ASSERT_TRUE(st.ok()) << st.error_message();
      EXPECT_TRUE(open.resp.duplicate());
    } else {
      EXPECT_EQ(st.error_code(), grpc::ALREADY_EXISTS) << st.error_message();
      EXPECT_NE(st.error_message().find("with header.policy 'full', this publish has 'gen'"), std::string::npos)
          << st.error_message();
    }
  }
  EXPECT_EQ(server_->store()->Stats().committed, 2u);
  WaitInflightZero();
}

// A publish whose session is closed during its upload stores nothing and
// does not bring the session back; its parent's lookup was already done.
TEST_F(RelayTest, CloseSessionFencesAPublishInProgress) {
  Turn t1 = MakeTurn(4, /*first=*/true);
  ASSERT_TRUE(PublishTurn(stub_.get(), Header("fence", "m1", "planner", {"critic"}, "gen", t1), t1).status.ok());
  ASSERT_TRUE(DoFetch(stub_.get(), "fence", "critic", true).status.ok());
  Turn t2 = MakeTurn(5, /*first=*/false);
  auto h2 = Header("fence", "m2", "critic", {"refiner"}, "gen", t2);
  h2.set_parent_id("m1");
  const auto chunks = TurnChunks(t2, 4096);
  const uint64_t received_before = server_->store()->Stats().received_bytes;
  OpenPublish open(stub_.get(), h2, chunks, 1);
  Eventually([&] { return server_->store()->Stats().received_bytes != received_before; }, std::chrono::seconds(5));
  uint32_t freed = 0;
  ASSERT_TRUE(Close(stub_.get(), "fence", &freed).ok());
  EXPECT_EQ(freed, 1u);
  const grpc::Status st = open.Complete(chunks, 1);
  EXPECT_EQ(st.error_code(), grpc::FAILED_PRECONDITION) << st.error_message();
  EXPECT_NE(st.error_message().find("session 'fence': closed while this publish was in progress"), std::string::npos)
      << st.error_message();
  WaitInflightZero();
  ExpectNothingFor("fence", "refiner");
  EXPECT_EQ(server_->store()->Stats().sessions, 0u);
  // The id is free again: a new publish starts the session afresh.
  ASSERT_TRUE(PublishTurn(stub_.get(), Header("fence", "m1", "planner", {"critic"}, "gen", t1), t1).status.ok());
  EXPECT_EQ(server_->store()->Stats().sessions, 1u);
}

// 2a + 2b: an upload reserves its tensor bytes, 1 KiB per layer and, with a
// parent, the parent's dense size.
TEST_F(RelayTest, InflightReservationCountsLayerOverheadAndTheParent) {
  Turn t1 = MakeTurn(22, true);
  auto shape = CheckGeometry(ProtoGeometry(t1), "g");
  ASSERT_TRUE(shape.ok());
  const uint64_t upload = shape->UploadBytes();
  const uint64_t reserve = upload + 3 * 1024;
  ASSERT_EQ(shape->ReserveBytes(), reserve);

  server_->Shutdown();
  ServerConfig cfg;
  cfg.max_inflight_bytes = reserve - 1;  // the tensors fit, the overhead does not
  StartServer(cfg);
  auto r = PublishTurn(stub_.get(), Header("res", "m", "a", {"b"}, "full", t1), t1);
  EXPECT_EQ(r.status.error_code(), grpc::RESOURCE_EXHAUSTED) << r.status.error_message();
  EXPECT_NE(r.status.error_message().find(std::to_string(reserve) + " bytes, expected at most --max-inflight-bytes=" +
                                          std::to_string(reserve - 1)),
            std::string::npos)
      << r.status.error_message();

  server_->Shutdown();
  StartServer();
  auto* store = server_->store();
  {
    const auto chunks = TurnChunks(t1, 1024);
    OpenPublish open(stub_.get(), Header("res", "m0", "a", {"b"}, "full", t1), chunks, 2);
    EXPECT_EQ(WaitFor([&] { return store->inflight_bytes(); }, reserve), reserve);
    EXPECT_EQ(open.Cut().error_code(), grpc::CANCELLED);
  }
  WaitInflightZero();
  // The parent: published with `full`, delivered to `critic`.
  ASSERT_TRUE(PublishTurn(stub_.get(), Header("res", "m1", "planner", {"critic"}, "full", t1), t1).status.ok());
  FetchResult f1 = DoFetch(stub_.get(), "res", "critic", true);
  ASSERT_TRUE(f1.status.ok());
  const uint64_t parent_tokens = f1.header.n_history() + f1.header.n_anchor() + f1.header.n_kept() + f1.header.n_gen();
  EXPECT_EQ(parent_tokens, 54u);
  const uint64_t parent_dense = 3ull * 2 * parent_tokens * (2 * 32 * 2 + 4);  // layers * kv_heads * tokens * row
  Turn t2 = MakeTurn(23, false);
  auto h2 = Header("res", "m2", "critic", {"refiner"}, "full", t2);
  h2.set_parent_id("m1");
  {
    const auto chunks = TurnChunks(t2, 1024);
    OpenPublish open(stub_.get(), h2, chunks, 2);
    EXPECT_EQ(WaitFor([&] { return store->inflight_bytes(); }, reserve + parent_dense), reserve + parent_dense);
    EXPECT_EQ(open.Cut().error_code(), grpc::CANCELLED);
  }
  WaitInflightZero();
}

// 2b: a publish whose composed message ([parent; turn]) cannot fit a
// recipient's mailbox is refused at the header, before its upload.
TEST_F(RelayTest, ComposedSizeIsCheckedAgainstMailboxesUpFront) {
  server_->Shutdown();
  ServerConfig cfg;
  cfg.max_mailbox_bytes = 60000;  // the parent (42768 bytes) fits, parent + turn (85536) does not
  StartServer(cfg);
  Turn t1 = MakeTurn(24, true);
  auto p1 = PublishTurn(stub_.get(), Header("cmp", "m1", "planner", {"critic"}, "full", t1), t1);
  ASSERT_TRUE(p1.status.ok()) << p1.status.error_message();
  EXPECT_EQ(p1.response.accounting().sent_bytes(), 42768u);
  ASSERT_TRUE(DoFetch(stub_.get(), "cmp", "critic", true).status.ok());
  const uint64_t received = server_->store()->Stats().received_bytes;
  Turn t2 = MakeTurn(25, false);
  auto h2 = Header("cmp", "m2", "critic", {"refiner"}, "full", t2);
  h2.set_parent_id("m1");
  auto r = PublishTurn(stub_.get(), h2, t2);
  EXPECT_EQ(r.status.error_code(), grpc::RESOURCE_EXHAUSTED) << r.status.error_message();
  EXPECT_NE(r.status.error_message().find("mailbox of 'refiner'"), std::string::npos) << r.status.error_message();
  // K, V and position ids of both turns' tokens, their acc, the bookkeeping.
  const uint64_t composed = 85536 + AccBytes(Offline(t1, "full")) + AccBytes(Offline(t2, "full")) +
                            kMessageOverheadBytes + kLayerOverheadBytes * t2.layers.size();
  EXPECT_NE(r.status.error_message().find(absl::StrCat(composed, " bytes")), std::string::npos)
      << r.status.error_message();
  EXPECT_NE(r.status.error_message().find("--max-mailbox-bytes=60000"), std::string::npos);
  EXPECT_EQ(server_->store()->Stats().received_bytes, received);  // refused before any chunk
  EXPECT_EQ(server_->store()->Stats().committed, 1u);
  WaitInflightZero();
}

// 3d: at most 64 recipients, distinct.
TEST_F(RelayTest, RecipientsAreCappedAndDistinct) {
  Turn t = MakeTurn(26);
  std::vector<std::string> many;
  for (int i = 0; i < 65; ++i) many.push_back("r" + std::to_string(i));
  auto r = PublishTurn(stub_.get(), Header("rc", "m", "a", many, "gen", t), t);
  EXPECT_EQ(r.status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_EQ(r.status.error_message(), "header.recipients: 65 agents, expected 1..64");
  many.pop_back();
  r = PublishTurn(stub_.get(), Header("rc", "m", "a", many, "gen", t), t);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(server_->store()->Stats().mailbox_messages, 64u);
  r = PublishTurn(stub_.get(), Header("rc", "m2", "a", {"x", "y", "x"}, "gen", t), t);
  EXPECT_EQ(r.status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_EQ(r.status.error_message(), "header.recipients[2]: 'x' repeats recipients[0], expected distinct agents");
}

double Gauge(RelayServer* s, const std::string& name) {
  for (const auto& fam : s->metrics()->registry()->Collect()) {
    if (fam.name == name && !fam.metric.empty()) return fam.metric[0].gauge.value;
  }
  ADD_FAILURE() << "no gauge " << name;
  return -1;
}

// The counter `name` with exactly `labels`; -1 (and a failure) when the
// series does not exist.
double CounterValue(RelayServer* s, const std::string& name, const std::map<std::string, std::string>& labels) {
  for (const auto& fam : s->metrics()->registry()->Collect()) {
    if (fam.name != name) continue;
    for (const auto& m : fam.metric) {
      std::map<std::string, std::string> got;
      for (const auto& l : m.label) got[l.name] = l.value;
      if (got == labels) return m.counter.value;
    }
  }
  ADD_FAILURE() << "no series " << name;
  return -1;
}

uint64_t HistogramCount(RelayServer* s, const std::string& name) {
  for (const auto& fam : s->metrics()->registry()->Collect()) {
    if (fam.name == name && !fam.metric.empty()) return fam.metric[0].histogram.sample_count;
  }
  ADD_FAILURE() << "no histogram " << name;
  return 0;
}

// 2c: acked messages still count against --max-session-bytes and
// --max-store-bytes; kvrelay_store_bytes shows them.
TEST_F(RelayTest, RetainedBytesAreLimitedPerSessionAndStore) {
  server_->Shutdown();
  ServerConfig cfg;
  Turn t = MakeTurn(27);
  const uint64_t msg =  // retained: tensors, acc, bookkeeping
      42768 + AccBytes(Offline(t, "full")) + kMessageOverheadBytes + kLayerOverheadBytes * t.layers.size();
  cfg.max_session_bytes = 2 * msg;
  cfg.max_store_bytes = 3 * msg;
  StartServer(cfg);
  for (const char* id : {"m1", "m2"}) {
    ASSERT_TRUE(PublishTurn(stub_.get(), Header("sb", id, "a", {"b"}, "full", t), t).status.ok());
    ASSERT_TRUE(DoFetch(stub_.get(), "sb", "b", /*auto_ack=*/true).status.ok());
  }
  EXPECT_EQ(server_->store()->Stats().mailbox_bytes, 0u);
  EXPECT_EQ(server_->store()->Stats().store_bytes, 2u * msg);
  EXPECT_EQ(Gauge(server_.get(), "kvrelay_store_bytes"), 2.0 * msg);
  auto r = PublishTurn(stub_.get(), Header("sb", "m3", "a", {"b"}, "full", t), t);
  EXPECT_EQ(r.status.error_code(), grpc::RESOURCE_EXHAUSTED) << r.status.error_message();
  EXPECT_NE(r.status.error_message().find(absl::StrCat("--max-session-bytes=", 2 * msg)), std::string::npos)
      << r.status.error_message();
  ASSERT_TRUE(PublishTurn(stub_.get(), Header("sb2", "m1", "a", {"b"}, "full", t), t).status.ok());
  r = PublishTurn(stub_.get(), Header("sb3", "m1", "a", {"b"}, "full", t), t);
  EXPECT_EQ(r.status.error_code(), grpc::RESOURCE_EXHAUSTED) << r.status.error_message();
  EXPECT_NE(r.status.error_message().find(absl::StrCat("--max-store-bytes=", 3 * msg)), std::string::npos)
      << r.status.error_message();
  ASSERT_TRUE(Close(stub_.get(), "sb").ok());
  EXPECT_EQ(Gauge(server_.get(), "kvrelay_store_bytes"), static_cast<double>(msg));
  EXPECT_TRUE(PublishTurn(stub_.get(), Header("sb3", "m1", "a", {"b"}, "full", t), t).status.ok());
  WaitInflightZero();
}

// 2d: Compress keeps the reply's size in flight until the call is done.
// A turn whose `full` reply (~64 MiB) is more than flow control lets
// through while the client reads nothing.
Turn LargeTurn() {
  TurnShape ts;
  ts.layers = 4;
  ts.kv_heads = 8;
  ts.group = 1;
  ts.head_dim = 128;
  ts.n_prompt = 2048;
  ts.n_gen = 4;
  ts.dtype = DType::kF32;
  return RandomTurn(ts, 28);
}

TEST_F(RelayTest, CompressHoldsTheReplyInFlightUntilDone) {
  grpc::ClientContext ctx;
  ctx.set_deadline(In(60));
  auto stream = stub_->Compress(&ctx);
  ASSERT_TRUE(WriteCompressUpload(stream.get(), LargeTurn(), "full"));
  v1::CompressResponse resp;
  ASSERT_TRUE(stream->Read(&resp));
  ASSERT_TRUE(resp.has_header());
  const uint64_t sent = resp.header().accounting().sent_bytes();
  EXPECT_GT(sent, 32u << 20);
  // The upload's reservation goes, the reply's (its bytes, its acc and
  // bookkeeping, as a retained message counts them) stays while it streams.
  const v1::MessageHeader& mh = resp.header();
  const uint64_t acc = 4ull * mh.layers() * mh.kv_heads() * (mh.n_history() + mh.n_anchor() + mh.n_kept() + mh.n_gen());
  const uint64_t held = sent + acc + kMessageOverheadBytes + kLayerOverheadBytes * mh.layers();
  EXPECT_EQ(WaitFor([&] { return server_->store()->inflight_bytes(); }, held), held);
  // Still held once the reply has gone on streaming (it is far larger than
  // what flow control lets the relay write ahead of its reader).
  ASSERT_TRUE(stream->Read(&resp));
  ASSERT_TRUE(resp.has_chunk());
  EXPECT_EQ(server_->store()->inflight_bytes(), held);
  while (stream->Read(&resp)) {
  }
  ASSERT_TRUE(stream->Finish().ok());
  WaitInflightZero();
}

// A reaction holds its watchdog entry's mutex and may register another
// entry meanwhile (Compress does when the last layer completes inline): the
// watchdog must never wait for an entry's mutex while it holds its own.
// The watchdog's clock is advanced whenever it waits, so that its rounds
// run back to back against the reaction's registrations; after each one the
// reaction waits for a whole round of the watchdog (it waits on the clock
// twice) with both entries held.
TEST(UploadWatchdogTest, WatchWhileHoldingAnEntry) {
  FakeTimeSource clock;
  UploadWatchdog watchdog(0.02, &clock);  // looks every 10 ms of `clock`
  std::shared_ptr<UploadWatchdog::Entry> held = watchdog.Watch(nullptr);
  {
    MutexLock lock(&held->mu);
    held->armed = false;  // for the clean-up pass to look at
  }
  std::atomic<bool> stop{false};
  std::thread ticker([&] {
    while (!stop) {
      if (clock.AwaitWaiters(1, std::chrono::milliseconds(10))) clock.Advance(std::chrono::milliseconds(10));
    }
  });
  std::future<int> reaction = std::async(std::launch::async, [&] {
    MutexLock lock(&held->mu);
    int rounds = 0;
    for (int i = 0; i < 30; ++i) {
      std::shared_ptr<UploadWatchdog::Entry> e = watchdog.Watch(nullptr);
      MutexLock el(&e->mu);
      e->armed = false;
      const uint64_t waits = clock.waits();
      if (!Eventually([&] { return clock.waits() >= waits + 2; })) break;
      ++rounds;
    }
    return rounds;
  });
  if (reaction.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
    std::fprintf(stderr, "UploadWatchdogTest.WatchWhileHoldingAnEntry: deadlocked\n");
    std::abort();  // nothing can unwind a deadlock
  }
  EXPECT_EQ(reaction.get(), 30) << "the watchdog stopped going round while the reaction held its entries";
  stop = true;
  ticker.join();
}

// A Compress reply that the client stops reading holds its memory and
// in-flight bytes: after the idle timeout the relay cancels the call.
TEST_F(RelayTest, CompressReplyNotReadIsCancelled) {
  server_->Shutdown();
  ServerConfig cfg;
  // Long enough for the upload on a loaded machine; the turn is built
  // before the call opens, so that the upload has no idle gap to begin with.
  cfg.upload_idle_timeout_seconds = 1.0;
  StartServer(cfg);
  const Turn turn = LargeTurn();
  grpc::ClientContext ctx;
  ctx.set_deadline(In(60));
  auto stream = stub_->Compress(&ctx);
  ASSERT_TRUE(WriteCompressUpload(stream.get(), turn, "full"));
  v1::CompressResponse resp;
  ASSERT_TRUE(stream->Read(&resp));
  ASSERT_TRUE(resp.has_header());
  EXPECT_GT(server_->store()->inflight_bytes(), 32u << 20);
  const auto t0 = std::chrono::steady_clock::now();
  WaitInflightZero();  // without reading anything more
  EXPECT_LT(Seconds(t0), 10.0);
  while (stream->Read(&resp)) {
  }
  const grpc::Status s = stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::CANCELLED) << s.error_message();
}

// A Fetch whose client stops reading is cancelled after the idle timeout
// (it would otherwise hold its message, also one its session has dropped,
// for as long as the client keeps the call open); the message stays
// unacknowledged and is delivered again.
TEST_F(RelayTest, FetchNotReadIsCancelledAndRedelivered) {
  server_->Shutdown();
  ServerConfig cfg;
  cfg.upload_idle_timeout_seconds = 1.0;
  StartServer(cfg);
  const Turn turn = LargeTurn();
  auto p = PublishTurn(stub_.get(), Header("stall", "m", "a", {"b"}, "full", turn), turn);
  ASSERT_TRUE(p.status.ok()) << p.status.error_message();
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(60));
    v1::FetchRequest req;
    req.set_session_id("stall");
    req.set_agent("b");
    auto reader = stub_->Fetch(&ctx, req);
    v1::FetchResponse resp;
    ASSERT_TRUE(reader->Read(&resp));
    ASSERT_TRUE(resp.has_header());
    EXPECT_EQ(resp.header().delivery_attempt(), 1u);
    // Read nothing more until the relay has cancelled the call.
    Eventually([&] { return RpcCount("Fetch", "CANCELLED") >= 1; }, std::chrono::seconds(20));
    ASSERT_EQ(RpcCount("Fetch", "CANCELLED"), 1) << "the relay did not cancel the Fetch its client stopped reading";
    while (reader->Read(&resp)) {
    }
    const grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::CANCELLED) << s.error_message();
  }
  // Never delivered whole: not ackable (it would be lost unseen).
  grpc::ClientContext actx;
  v1::AckRequest ack;
  ack.set_session_id("stall");
  ack.set_agent("b");
  ack.set_message_id("m");
  v1::AckResponse ack_resp;
  const grpc::Status acked = stub_->Ack(&actx, ack, &ack_resp);
  EXPECT_EQ(acked.error_code(), grpc::FAILED_PRECONDITION) << acked.error_message();
  EXPECT_EQ(server_->store()->Stats().delivered, 0u);
  EXPECT_EQ(HistogramCount(server_.get(), "kvrelay_publish_delivered_seconds"), 0u);
  FetchResult again = DoFetch(stub_.get(), "stall", "b", /*auto_ack=*/false);
  ASSERT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_EQ(again.header.delivery_attempt(), 2u);
  // The hop latency is observed at the first complete delivery, attempt 2
  // here; a redelivery of a message delivered whole before adds nothing.
  EXPECT_EQ(HistogramCount(server_.get(), "kvrelay_publish_delivered_seconds"), 1u);
  FetchResult third = DoFetch(stub_.get(), "stall", "b", /*auto_ack=*/true);
  ASSERT_TRUE(third.status.ok()) << third.status.error_message();
  EXPECT_EQ(third.header.delivery_attempt(), 3u);
  EXPECT_EQ(HistogramCount(server_.get(), "kvrelay_publish_delivered_seconds"), 1u);
  EXPECT_EQ(CounterValue(server_.get(), "kvrelay_messages_total", {{"outcome", "delivered"}}), 2.0);
}

// A Fetch that waits in vain ends DEADLINE_EXCEEDED, and is counted so,
// whichever comes first: gRPC's cancel at the deadline or the relay's timer.
TEST_F(RelayTest, FetchesThatWaitInVainCountAsDeadlineExceeded) {
  constexpr int kFetches = 12;
  for (int i = 0; i < kFetches; ++i) {
    FetchResult r = DoFetch(stub_.get(), "idle", "b", true, 0.05 + 0.01 * i);
    EXPECT_EQ(r.status.error_code(), grpc::DEADLINE_EXCEEDED) << r.status.error_message();
  }
  // The client's own deadline timer may end its call before the relay
  // finishes it: wait until the relay has counted every call.
  auto fetches = [this](const char* code) {
    return CounterValue(server_.get(), "kvrelay_rpcs_total", {{"method", "Fetch"}, {"code", code}});
  };
  Eventually([&] { return fetches("DEADLINE_EXCEEDED") + fetches("CANCELLED") >= kFetches; });
  EXPECT_EQ(fetches("DEADLINE_EXCEEDED"), kFetches);
  EXPECT_EQ(fetches("CANCELLED"), 0.0);
}

// kvrelay_fetches_waiting follows the Fetch calls parked in the store:
// up as they park, down as a publish wakes one, a close ends the other, and
// a deadline ends a third.
TEST_F(RelayTest, WaitingFetchesAreCounted) {
  auto waiting = [this] {
    for (const auto& fam : server_->metrics()->registry()->Collect()) {
      if (fam.name == "kvrelay_fetches_waiting" && !fam.metric.empty()) return fam.metric[0].gauge.value;
    }
    ADD_FAILURE() << "no gauge kvrelay_fetches_waiting";
    return -1.0;
  };
  EXPECT_EQ(waiting(), 0.0);
  FetchResult b, c;
  std::thread fb([&] { b = DoFetch(stub_.get(), "gw", "b", true, 30); });
  std::thread fc([&] { c = DoFetch(stub_.get(), "gw", "c", true, 30); });
  ASSERT_TRUE(Eventually([&] { return server_->store()->Stats().fetch_waiters == 2; }));
  EXPECT_EQ(waiting(), 2.0);
  Turn t = MakeTurn(31);
  ASSERT_TRUE(PublishTurn(stub_.get(), Header("gw", "m", "a", {"b"}, "gen", t), t).status.ok());
  fb.join();
  ASSERT_TRUE(b.status.ok()) << b.status.error_message();
  EXPECT_EQ(waiting(), 1.0);
  ASSERT_TRUE(Close(stub_.get(), "gw").ok());
  fc.join();
  EXPECT_EQ(c.status.error_code(), grpc::NOT_FOUND) << c.status.error_message();
  EXPECT_EQ(waiting(), 0.0);
  FetchResult d = DoFetch(stub_.get(), "gw2", "b", true, 0.2);
  EXPECT_EQ(d.status.error_code(), grpc::DEADLINE_EXCEEDED) << d.status.error_message();
  EXPECT_TRUE(Eventually([&] { return server_->store()->Stats().fetch_waiters == 0; }));
  EXPECT_EQ(waiting(), 0.0);
}

// A publish whose deadline passes while its last layer compresses: the
// client has DEADLINE_EXCEEDED, so nothing may be committed (a sender that
// retries with a fresh id would deliver the turn twice), and the relay
// counts what the client saw.
TEST_F(RelayTest, PublishPastItsDeadlineCommitsNothing) {
  TurnShape ts;
  ts.layers = 1;
  ts.kv_heads = 4;
  ts.group = 1;
  ts.head_dim = 1024;  // exact OBF's d^3 work: ~0.1 s per head
  ts.n_prompt = 1024;
  ts.n_gen = 4;
  ts.dtype = DType::kBF16;
  const Turn t = RandomTurn(ts, 31);
  const std::string policy = "h2o-head:k=64+obf:p=16,mode=exact";
  // Timing of the whole publish, from a first one without a deadline.
  auto timed = PublishTurn(stub_.get(), Header("dl", "timed", "a", {"b"}, policy, t), t);
  ASSERT_TRUE(timed.status.ok()) << timed.status.error_message();
  const double commit_s = timed.response.accounting().commit_seconds();
  const double compress_s = timed.response.accounting().compress_seconds();
  ASSERT_GT(compress_s, 0.05) << "too fast to land a deadline inside the compression: " << compress_s << " s of " << commit_s;
  const auto chunks = TurnChunks(t);
  const auto reqs = PublishStream(Header("dl", "late", "a", {"b"}, policy, t), chunks, TrailerOf(chunks));
  // The deadline early in the compression of the only layer (a slower run
  // moves it into the upload, which must commit nothing either).
  PublishResult late = DoPublish(stub_.get(), reqs, commit_s - 0.8 * compress_s);
  ASSERT_EQ(late.status.error_code(), grpc::DEADLINE_EXCEEDED) << late.status.error_message();
  auto publishes = [this](const char* code) {
    return CounterValue(server_.get(), "kvrelay_rpcs_total", {{"method", "Publish"}, {"code", code}});
  };
  Eventually([&] { return publishes("DEADLINE_EXCEEDED") + publishes("CANCELLED") + publishes("OK") >= 2; });
  EXPECT_EQ(publishes("OK"), 1.0);
  EXPECT_EQ(publishes("DEADLINE_EXCEEDED"), 1.0);
  EXPECT_EQ(server_->store()->Stats().committed, 1u);
  FetchResult first = DoFetch(stub_.get(), "dl", "b", true);
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_EQ(first.header.message_id(), "timed");
  EXPECT_EQ(DoFetch(stub_.get(), "dl", "b", true, 0.3).status.error_code(), grpc::DEADLINE_EXCEEDED);
}

// Series that exist at 0 from the start, so that Prometheus' rate() and
// increase() see their first increments: every method with every code the
// relay answers with, and the families of the default and role policies.
TEST_F(RelayTest, CountersExistFromTheStart) {
  server_->Shutdown();
  ServerConfig cfg;
  cfg.default_policy = "h2o-layer:k=8+int4";
  cfg.role_policies["judge"] = "gen";
  StartServer(cfg);
  for (const char* m : {"Publish", "Fetch", "Compress", "Ack", "CloseSession", "Stats"}) {
    for (const char* c : {"OK", "CANCELLED", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
                          "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "UNAVAILABLE", "DATA_LOSS", "INTERNAL"}) {
      EXPECT_EQ(CounterValue(server_.get(), "kvrelay_rpcs_total", {{"method", m}, {"code", c}}), 0.0) << m << " " << c;
      if (std::string(c) != "OK") {
        EXPECT_EQ(CounterValue(server_.get(), "kvrelay_errors_total", {{"code", c}}), 0.0) << c;
      }
    }
  }
  for (const char* family : {"h2o-layer+int4", "gen"}) {
    for (const char* name : {"kvrelay_full_bytes_total", "kvrelay_sent_bytes_total", "kvrelay_saved_bytes_total",
                             "kvrelay_wire_bytes_total"}) {
      EXPECT_EQ(CounterValue(server_.get(), name, {{"family", family}}), 0.0) << name << " " << family;
    }
  }
}

// 2e: an upload that goes quiet is failed with DEADLINE_EXCEEDED and frees its reservation.
TEST_F(RelayTest, IdleUploadsAreCancelled) {
  server_->Shutdown();
  ServerConfig cfg;
  cfg.upload_idle_timeout_seconds = 0.3;
  StartServer(cfg);
  Turn t = MakeTurn(29);
  const auto chunks = TurnChunks(t, 1024);
  {
    const auto t0 = std::chrono::steady_clock::now();
    OpenPublish open(stub_.get(), Header("idle", "m", "a", {"b"}, "gen", t), chunks, 2);
    Eventually([&] { return server_->store()->inflight_bytes() != 0; }, std::chrono::seconds(5));
    EXPECT_GT(server_->store()->inflight_bytes(), 0u);
    // Write nothing more until the relay has failed the upload.
    Eventually([&] { return RpcCount("Publish", "DEADLINE_EXCEEDED") >= 1; }, std::chrono::seconds(20));
    ASSERT_EQ(RpcCount("Publish", "DEADLINE_EXCEEDED"), 1) << "the relay did not fail the idle upload";
    grpc::Status s = open.w->Finish();
    EXPECT_LT(Seconds(t0), 5.0);
    EXPECT_EQ(s.error_code(), grpc::DEADLINE_EXCEEDED) << s.error_message();
    EXPECT_NE(s.error_message().find("publish: upload idle for 0.3 s"), std::string::npos) << s.error_message();
  }
  WaitInflightZero();
  EXPECT_EQ(server_->store()->Stats().committed, 0u);
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(30));
    auto stream = stub_->Compress(&ctx);
    v1::CompressRequest req;
    req.mutable_header()->set_policy("gen");
    *req.mutable_header()->mutable_geometry() = ProtoGeometry(t);
    ASSERT_TRUE(stream->Write(req));
    v1::CompressResponse resp;
    EXPECT_FALSE(stream->Read(&resp));  // ends once the server fails the call
    grpc::Status s = stream->Finish();
    EXPECT_EQ(s.error_code(), grpc::DEADLINE_EXCEEDED) << s.error_message();
    EXPECT_NE(s.error_message().find("compress: upload idle for 0.3 s"), std::string::npos) << s.error_message();
  }
  WaitInflightZero();
  // An upload that keeps sending is not idle, however slow overall. Real
  // time is the subject here: the writer is slow on purpose, with pauses of
  // a third of the timeout, and the whole upload outlasts the timeout.
  auto stream = PublishStream(Header("idle", "m2", "a", {"b"}, "gen", t), chunks, TrailerOf(chunks));
  grpc::ClientContext ctx;
  ctx.set_deadline(In(30));
  v1::PublishResponse resp;
  const auto t1 = std::chrono::steady_clock::now();
  auto w = stub_->Publish(&ctx, &resp);
  for (size_t i = 0; i < stream.size(); ++i) {
    if (i % 8 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));  // pacing
    ASSERT_TRUE(w->Write(stream[i]));
  }
  w->WritesDone();
  EXPECT_TRUE(w->Finish().ok());
  EXPECT_GT(Seconds(t1), 0.3) << "the upload did not outlast the idle timeout: nothing was tested";
}


// Backpressure: with one worker and a policy slower per layer than the
// upload, the server reads no further while max(2, workers) = 2 layers
// are queued or compressing.
class BackpressureTest : public RelayTest {
 protected:
  static constexpr int kBound = 2;  // max(2, 1 worker)
  static constexpr const char* kPolicy = "h2o-head:k=32+obf:p=8";  // obf exact: slow per layer
  void SetUp() override {}
  void Start(double idle_timeout_s = 60) {
    ServerConfig cfg;
    cfg.worker_threads = 1;
    cfg.upload_idle_timeout_seconds = idle_timeout_s;
    StartServer(cfg);
    peak_ = 0;
    server_->service()->context()->SetLayerObserver([this](int outstanding) {
      int peak = peak_.load();
      while (peak < outstanding && !peak_.compare_exchange_weak(peak, outstanding)) {
      }
    });
  }
  // The most layers queued or compressing at once, in any upload, since
  // Start (or a reset).
  int peak() const { return peak_.load(); }
  std::atomic<int> peak_{0};
  static Turn BigTurn(uint64_t seed, int n_prompt = 512) {
    TurnShape s;
    s.layers = 24;
    s.kv_heads = 8;
    s.group = 1;
    s.head_dim = 128;
    s.n_prompt = n_prompt;
    s.n_gen = 8;
    s.dtype = DType::kBF16;
    return RandomTurn(s, seed);
  }
};

TEST_F(BackpressureTest, QueuedLayersStayBoundedAndTheResultIsBitExact) {
  Start();
  Turn t = BigTurn(41);
  const Message want = Offline(t, kPolicy);
  auto pub = PublishTurn(stub_.get(), Header("bp", "m1", "a", {"b"}, kPolicy, t), t, 64 << 10);
  ASSERT_TRUE(pub.status.ok()) << pub.status.error_message();
  EXPECT_GE(peak(), 1);
  EXPECT_LE(peak(), kBound);
  FetchResult f = DoFetch(stub_.get(), "bp", "b", /*auto_ack=*/true);
  ASSERT_TRUE(f.status.ok()) << f.status.error_message();
  EXPECT_TRUE(f.trailer_ok);
  EXPECT_EQ(f.header.accounting().sent_bytes(), want.sent_bytes);
  ExpectSameMessage(f.msg, want);

  // Compress shares the upload path.
  peak_ = 0;
  const FetchResult c = DoCompress(stub_.get(), t, kPolicy, 64 << 10, 120);
  ASSERT_TRUE(c.status.ok()) << c.status.error_message();
  EXPECT_TRUE(c.trailer_ok);
  ExpectSameMessage(c.msg, want);
  EXPECT_GE(peak(), 1);
  EXPECT_LE(peak(), kBound);
  WaitInflightZero();
}

// Cancelled while paused (the client blocked by flow control): the call
// ends promptly, nothing is committed, the reservation comes back.
TEST_F(BackpressureTest, CancelWhilePausedLeavesNothing) {
  Start();
  // The relay's only worker is held until the cancel: the upload's layers
  // queue, and it stays paused at the bound, reading nothing, for as long
  // as the test needs. Each layer outweighs the flow-control windows
  // (34 MB), so the client cannot write the turn meanwhile.
  std::promise<void> release;
  server_->service()->context()->pool()->Schedule([held = release.get_future().share()] { held.wait(); });
  auto let_go = absl::MakeCleanup([&] { release.set_value(); });
  TurnShape s;
  s.layers = 5;
  s.kv_heads = 8;
  s.group = 1;
  s.head_dim = 128;
  s.n_prompt = 8192;
  s.n_gen = 8;
  s.dtype = DType::kBF16;
  v1::PublishRequest head;
  std::vector<v1::Chunk> chunks;
  uint64_t turn_bytes = 0;
  {
    Turn t = RandomTurn(s, 42);
    *head.mutable_header() = Header("bpcut", "m", "a", {"b"}, "h2o-head:k=4096+obf:p=8", t);
    chunks = TurnChunks(t, 256 << 10);
  }
  for (const v1::Chunk& c : chunks) turn_bytes += c.data().size();
  grpc::ClientContext ctx;
  ctx.set_deadline(In(60));
  v1::PublishResponse resp;
  auto w = stub_->Publish(&ctx, &resp);
  std::atomic<size_t> written{0};
  std::atomic<uint64_t> written_bytes{0};
  std::thread writer([&] {
    v1::PublishRequest req = head;
    if (!w->Write(req)) return;
    for (const auto& c : chunks) {
      *req.mutable_chunk() = c;
      if (!w->Write(req)) return;
      ++written;
      written_bytes += c.data().size();
    }
  });
  // Paused at the bound, and it stays paused while the worker is held: the
  // client, once it has written past what the relay read, is held back by
  // the flow-control windows the relay leaves full.
  RelayContext* relay = server_->service()->context();
  EXPECT_TRUE(Eventually([&] { return relay->backpressure_pauses() >= 1; }, std::chrono::seconds(20)))
      << "the upload was never paused";
  EXPECT_EQ(peak(), kBound);
  EXPECT_TRUE(Eventually([&] { return written_bytes.load() > server_->store()->Stats().received_bytes; },
                         std::chrono::seconds(20)))
      << "the client never got ahead of the relay";
  EXPECT_LT(server_->store()->Stats().received_bytes, turn_bytes);  // the relay reads no further
  EXPECT_LT(written.load(), chunks.size());                          // held back by flow control
  EXPECT_GT(server_->store()->inflight_bytes(), 0u);
  const auto t0 = std::chrono::steady_clock::now();
  ctx.TryCancel();
  writer.join();
  std::move(let_go).Invoke();  // the worker drains the skipped layers
  EXPECT_EQ(w->Finish().error_code(), grpc::CANCELLED);
  WaitInflightZero();
  EXPECT_LT(Seconds(t0), 10.0);
  EXPECT_LE(peak(), kBound);
  ExpectNothingFor("bpcut", "b");
  EXPECT_EQ(server_->store()->Stats().committed, 0u);
  EXPECT_EQ(server_->store()->Stats().failed, 1u);
}

// A backpressure pause is the server's doing: the idle watchdog (shorter
// than a layer's compression here) does not fail the upload for it.
TEST_F(BackpressureTest, IdleWatchdogIgnoresPauses) {
  TurnShape s;
  s.layers = 4;
  s.kv_heads = 8;
  s.group = 1;
  s.head_dim = 128;
  s.n_prompt = 8192;
  s.n_gen = 8;
  s.dtype = DType::kBF16;
  Turn t = RandomTurn(s, 43);
  const std::string policy = "h2o-head:k=4096+obf:p=8";  // 0.1-0.4 s a layer
  const auto c0 = std::chrono::steady_clock::now();
  const Message want = Offline(t, policy);
  const double layer_s = Seconds(c0) / s.layers;
  // A third of a layer's compression, so that every pause outlasts it.
  const double timeout = std::min(0.15, layer_s / 3);
  if (timeout < 0.05) GTEST_SKIP() << "a layer compresses in " << layer_s << " s, too fast to pause long";
  Start(timeout);
  auto pub = PublishTurn(stub_.get(), Header("bpidle", "m", "a", {"b"}, policy, t), t, 256 << 10);
  ASSERT_TRUE(pub.status.ok()) << pub.status.error_message();
  EXPECT_EQ(peak(), kBound);  // it did pause
  FetchResult f = DoFetch(stub_.get(), "bpidle", "b", true);
  ASSERT_TRUE(f.status.ok()) << f.status.error_message();
  ExpectSameMessage(f.msg, want);
  WaitInflightZero();
}


// An agent that saw the id the relay assigned to its own publish cannot
// claim the next ones in another session: the ids it would guess (the next
// counter values, or the next numbers) are not the ones the relay assigns,
// so another agent's publish without an id still commits.
TEST_F(RelayTest, RelayAssignedIdsCannotBeClaimedAhead) {
  Turn t = MakeTurn(60);
  const std::string policy = "h2o-head:k=8";
  auto own = PublishTurn(stub_.get(), Header("own", "", "mallory", {"mallory"}, policy, t), t);
  ASSERT_TRUE(own.status.ok()) << own.status.error_message();
  const std::string seen = own.response.message_id();
  ASSERT_TRUE(CheckId("message_id", seen).ok()) << seen;
  // The guesses: the id with its last number (after the last '-') plus 1..8,
  // and its hex digits as a number plus 1..8.
  std::vector<std::string> guesses;
  const size_t dash = seen.rfind('-');
  const std::string head = seen.substr(0, dash + 1), tail = seen.substr(dash + 1);
  for (uint64_t k = 1; k <= 8; ++k) {
    if (!tail.empty() && tail.size() <= 18 && tail.find_first_not_of("0123456789") == std::string::npos) {
      guesses.push_back(head + std::to_string(std::stoull(tail) + k));
    }
    if (tail.size() >= 16 && tail.find_first_not_of("0123456789abcdef") == std::string::npos) {
      const uint64_t low = std::stoull(tail.substr(tail.size() - 16), nullptr, 16);
      char hex[17];
      std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(low + k));
      guesses.push_back(head + tail.substr(0, tail.size() - 16) + hex);
    }
  }
  ASSERT_FALSE(guesses.empty()) << seen;
  for (const std::string& g : guesses) {
    auto claim = PublishTurn(stub_.get(), Header("victim", g, "mallory", {"mallory"}, policy, t), t);
    ASSERT_TRUE(claim.status.ok()) << g << ": " << claim.status.error_message();
  }
  auto victim = PublishTurn(stub_.get(), Header("victim", "", "alice", {"bob"}, policy, t), t);
  ASSERT_TRUE(victim.status.ok()) << victim.status.error_code() << ": " << victim.status.error_message();
  EXPECT_EQ(victim.response.message_id().size(), 34u) << victim.response.message_id();
  EXPECT_EQ(victim.response.message_id().substr(0, 2), "m-");
  EXPECT_EQ(std::find(guesses.begin(), guesses.end(), victim.response.message_id()), guesses.end());
  MessagePtr m = server_->store()->Find("victim", victim.response.message_id());
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->sender, "alice");
}

// Adds "authorization: Bearer TOKEN" to every call of a channel.
class BearerInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit BearerInterceptor(std::string token) : token_(std::move(token)) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* m) override {
    if (m->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      m->GetSendInitialMetadata()->insert({"authorization", "Bearer " + token_});
    }
    m->Proceed();
  }

 private:
  std::string token_;
};

class BearerInterceptorFactory : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit BearerInterceptorFactory(std::string token) : token_(std::move(token)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(grpc::experimental::ClientRpcInfo*) override {
    return new BearerInterceptor(token_);
  }

 private:
  std::string token_;
};

// A relay with a tokens file: planner, critic and judge, each with a stub
// that carries its token.
class TokenRelayTest : public RelayTest {
 protected:
  void SetUp() override {
    tokens_path_ = ::testing::TempDir() + "kvrelay_service_test_tokens_" + std::to_string(::getpid());
    std::string content;
    for (const char* agent : {"planner", "critic", "judge"}) {
      content += std::string(agent) + " sha256:" + Sha256Hex(std::string("token-of-") + agent) + "\n";
    }
    FILE* f = std::fopen(tokens_path_.c_str(), "w");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(std::fwrite(content.data(), 1, content.size(), f), content.size());
    ASSERT_EQ(std::fclose(f), 0);
    ServerConfig cfg;
    cfg.tokens_file = tokens_path_;
    StartServer(cfg);
  }
  void TearDown() override {
    RelayTest::TearDown();
    std::remove(tokens_path_.c_str());
  }

  std::unique_ptr<v1::Relay::Stub> StubOf(const std::string& agent) {
    std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> creators;
    creators.push_back(std::make_unique<BearerInterceptorFactory>("token-of-" + agent));
    return v1::Relay::NewStub(grpc::experimental::CreateCustomChannelWithInterceptors(
        server_->grpc_address(), grpc::InsecureChannelCredentials(), grpc::ChannelArguments(), std::move(creators)));
  }

  static grpc::Status StatusOf(v1::Relay::Stub* stub, const std::string& session, const std::string& id) {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(10));
    v1::MessageStatusRequest req;
    req.set_session_id(session);
    req.set_message_id(id);
    v1::MessageStatusResponse resp;
    return stub->MessageStatus(&ctx, req, &resp);
  }

  std::string tokens_path_;
};

// MessageStatus: to an agent that is neither the sender nor a recipient, a
// message that exists and one that does not get the same code and words.
TEST_F(TokenRelayTest, MessageStatusOfAHiddenMessageReadsAsMissing) {
  auto planner = StubOf("planner"), critic = StubOf("critic"), judge = StubOf("judge");
  Turn t = MakeTurn(61);
  auto pub = PublishTurn(planner.get(), Header("s", "m1", "planner", {"critic"}, "h2o-head:k=8", t), t);
  ASSERT_TRUE(pub.status.ok()) << pub.status.error_message();
  EXPECT_TRUE(StatusOf(planner.get(), "s", "m1").ok());
  EXPECT_TRUE(StatusOf(critic.get(), "s", "m1").ok());
  const grpc::Status hidden = StatusOf(judge.get(), "s", "m1");
  const grpc::Status missing = StatusOf(judge.get(), "s", "m2");
  EXPECT_EQ(hidden.error_code(), grpc::NOT_FOUND);
  EXPECT_EQ(missing.error_code(), grpc::NOT_FOUND);
  EXPECT_EQ(hidden.error_message(), "message_id: no message 'm1' visible to agent \"judge\" in session 's'");
  EXPECT_EQ(missing.error_message(), "message_id: no message 'm2' visible to agent \"judge\" in session 's'");
  const grpc::Status other_session = StatusOf(judge.get(), "t", "m1");
  EXPECT_EQ(other_session.error_code(), grpc::NOT_FOUND);
  EXPECT_EQ(other_session.error_message(), "message_id: no message 'm1' visible to agent \"judge\" in session 't'");
}

// parent_id: the same rule. A publish naming a parent the sender may not see
// fails as one naming a parent that does not exist, and commits nothing.
TEST_F(TokenRelayTest, AParentTheSenderMayNotSeeReadsAsMissing) {
  auto planner = StubOf("planner"), critic = StubOf("critic"), judge = StubOf("judge");
  const std::string policy = "h2o-head:k=8";
  Turn t1 = MakeTurn(62);
  ASSERT_TRUE(PublishTurn(planner.get(), Header("s", "m1", "planner", {"critic"}, policy, t1), t1).status.ok());
  FetchResult f = DoFetch(critic.get(), "s", "critic", /*auto_ack=*/true);
  ASSERT_TRUE(f.status.ok()) << f.status.error_message();
  Turn t2 = MakeTurn(63, /*first=*/false);
  auto child = [&](const std::string& id, const std::string& from, const std::string& parent) {
    auto h = Header("s", id, from, {"planner"}, policy, t2);
    h.set_parent_id(parent);
    return h;
  };
  const PublishResult hidden = PublishTurn(judge.get(), child("j1", "judge", "m1"), t2);
  const PublishResult missing = PublishTurn(judge.get(), child("j2", "judge", "m9"), t2);
  EXPECT_EQ(hidden.status.error_code(), grpc::NOT_FOUND);
  EXPECT_EQ(missing.status.error_code(), grpc::NOT_FOUND);
  EXPECT_EQ(hidden.status.error_message(),
            "header.parent_id: no message 'm1' visible to agent \"judge\" in session 's'");
  EXPECT_EQ(missing.status.error_message(),
            "header.parent_id: no message 'm9' visible to agent \"judge\" in session 's'");
  EXPECT_EQ(server_->store()->Find("s", "j1"), nullptr);
  EXPECT_EQ(server_->store()->Find("s", "j2"), nullptr);
  // The recipient it was delivered to composes on it.
  const PublishResult ok = PublishTurn(critic.get(), child("c1", "critic", "m1"), t2);
  EXPECT_TRUE(ok.status.ok()) << ok.status.error_message();
}

// The bound on an upload's compression work (--max-upload-work) is checked
// on the header, for Publish and Compress alike: past it RESOURCE_EXHAUSTED
// naming the flag, before any chunk is read or anything reserved.
TEST_F(RelayTest, UploadWorkPastTheLimitIsRefusedAtTheHeader) {
  ServerConfig cfg;
  cfg.max_upload_work = 1e6;
  server_->Shutdown();
  StartServer(cfg);
  TurnShape s;
  s.layers = 3;
  s.kv_heads = 2;
  s.group = 2;
  s.head_dim = 32;
  s.n_prompt = 48;
  s.n_gen = 6;
  s.queries = true;
  const Turn t = RandomTurn(s, 51);
  const std::string policy = "h2o-head:k=8";
  auto p = Pipeline::Create(policy);
  ASSERT_TRUE(p.ok());
  TurnGeometry geo;
  geo.kv_heads = 2, geo.score_heads = 4, geo.head_dim = 32, geo.n_prompt = 48, geo.n_gen = 6, geo.queries = true;
  ASSERT_GT(UploadWork(**p, geo, 3, true), 1e6);
  PublishResult r = PublishTurn(stub_.get(), Header("work", "m", "a", {"b"}, policy, t), t);
  EXPECT_EQ(r.status.error_code(), grpc::RESOURCE_EXHAUSTED) << r.status.error_message();
  EXPECT_NE(r.status.error_message().find("expected at most --max-upload-work=1e+06"), std::string::npos)
      << r.status.error_message();
  EXPECT_NE(r.status.error_message().find("header.geometry: compressing 3 layers"), std::string::npos)
      << r.status.error_message();
  const FetchResult c = DoCompress(stub_.get(), t, policy);
  EXPECT_EQ(c.status.error_code(), grpc::RESOURCE_EXHAUSTED) << c.status.error_message();
  EXPECT_NE(c.status.error_message().find("--max-upload-work"), std::string::npos) << c.status.error_message();
  EXPECT_EQ(server_->store()->Stats().received_bytes, 0u);  // refused on the header
  EXPECT_EQ(server_->store()->inflight_bytes(), 0u);
  ExpectNothingFor("work", "b");
  // Scores instead of queries, with obf: within the bound (obf's Gram and
  // eigenvectors, under 2 x (48 x 32^2 + 32^3) per layer).
  const Turn scored = MakeTurn(52);
  r = PublishTurn(stub_.get(), Header("work", "m2", "a", {"b"}, "h2o-head:k=8+obf:p=4", scored), scored);
  EXPECT_TRUE(r.status.ok()) << r.status.error_message();
}

// The core's per-layer bound on scoring from queries (2^36 multiply-adds)
// is checked on the header too: INVALID_ARGUMENT before a chunk is read.
TEST_F(RelayTest, PerLayerScoringWorkPastTheBoundIsRefusedAtTheHeader) {
  const Turn small = MakeTurn(53);
  v1::PublishHeader h = Header("lw", "m", "a", {"b"}, "h2o-head:k=8", small);
  v1::TurnGeometry* g = h.mutable_geometry();
  g->set_kv_heads(1);
  g->set_score_heads(1);
  g->set_head_dim(1);
  g->set_n_prompt(1 << 20);
  g->set_n_gen(1 << 17);
  g->set_query_dtype(v1::DTYPE_F32);
  g->set_layers(1);
  std::vector<v1::PublishRequest> reqs(1);
  *reqs[0].mutable_header() = h;
  const PublishResult r = DoPublish(stub_.get(), reqs);
  EXPECT_EQ(r.status.error_code(), grpc::INVALID_ARGUMENT) << r.status.error_message();
  EXPECT_NE(r.status.error_message().find(
                "layer.0.gen.q: scoring from these queries takes 1.46e+11 multiply-adds per layer"),
            std::string::npos)
      << r.status.error_message();
  EXPECT_EQ(server_->store()->Stats().received_bytes, 0u);
  EXPECT_EQ(server_->store()->inflight_bytes(), 0u);
}

// A large upload scoring from queries, 2 workers: layers of 1024 score
// heads, head_dim 1, 64 steps over 65,536 prompt tokens (each one is
// seconds of one core), as many as the default --max-upload-work allows.
class LargeUploadTest : public RelayTest {
 protected:
  static constexpr const char* kPolicy = "h2o-head:k=32";
  void SetUp() override {
    StartServer();  // 2 workers, the default bound
    server_->service()->context()->SetLayerObserver([this](int outstanding) {
      int peak = peak_.load();
      while (peak < outstanding && !peak_.compare_exchange_weak(peak, outstanding)) {
      }
    });
  }
  static TurnShape LayerShape() {
    TurnShape s;
    s.layers = 3;  // uploaded; the header declares Layers()
    s.kv_heads = 1;
    s.group = 1024;
    s.head_dim = 1;
    s.n_prompt = 65536;
    s.n_gen = 64;
    s.dtype = DType::kBF16;
    s.queries = true;
    return s;
  }
  // The most layers of LayerShape() the default bound allows.
  static int Layers() {
    const TurnShape s = LayerShape();
    TurnGeometry geo;
    geo.kv_heads = s.kv_heads, geo.score_heads = s.kv_heads * s.group, geo.head_dim = s.head_dim;
    geo.n_prompt = s.n_prompt, geo.n_gen = s.n_gen, geo.queries = true;
    auto p = Pipeline::Create(kPolicy);
    EXPECT_TRUE(p.ok());
    return static_cast<int>(kDefaultMaxUploadWork / UploadWork(**p, geo, 1, true));
  }
  // Opens the large publish with its first layers' chunks and waits until
  // its layers fill the upload's share of the pool (2 queued or running).
  std::unique_ptr<OpenPublish> StartLargeUpload() {
    const Turn t = RandomTurn(LayerShape(), 61);
    v1::PublishHeader h = Header("large", "big", "a", {"b"}, kPolicy, t);
    h.mutable_geometry()->set_layers(Layers());
    const auto chunks = TurnChunks(t);
    auto open = std::make_unique<OpenPublish>(stub_.get(), h, chunks, chunks.size());
    Eventually([&] { return peak_.load() >= 2; }, std::chrono::seconds(20));
    EXPECT_EQ(peak_.load(), 2);
    return open;
  }
  ThreadPool* pool() { return server_->service()->context()->pool(); }
  std::atomic<int> peak_{0};
};

TEST_F(LargeUploadTest, TheLargestAllowedUploadIsRefusedOneLayerLater) {
  const int layers = Layers();
  ASSERT_GE(layers, 2);
  const Turn t = RandomTurn([] { TurnShape s = LayerShape(); s.layers = 1; return s; }(), 62);
  v1::PublishHeader h = Header("large", "over", "a", {"b"}, kPolicy, t);
  h.mutable_geometry()->set_layers(layers + 1);
  PublishResult r = DoPublish(stub_.get(), {[&] { v1::PublishRequest q; *q.mutable_header() = h; return q; }()});
  EXPECT_EQ(r.status.error_code(), grpc::RESOURCE_EXHAUSTED) << r.status.error_message();
  EXPECT_EQ(server_->store()->Stats().received_bytes, 0u);
}

// A cancelled upload's running layer stops within about a GEMM block: its
// worker is free well before the layer would have finished (seconds).
TEST_F(LargeUploadTest, CancelledUploadFreesItsWorkerPromptly) {
  std::unique_ptr<OpenPublish> big = StartLargeUpload();
  ASSERT_FALSE(pool()->WaitIdle(std::chrono::milliseconds(200)));  // a layer is compressing
  const auto t0 = std::chrono::steady_clock::now();
  big->ctx.TryCancel();
  const bool idle = pool()->WaitIdle(std::chrono::milliseconds(1000));
  const double freed_s = Seconds(t0);
  EXPECT_TRUE(idle) << "the pool still works on the cancelled upload " << freed_s << " s after the cancel";
  std::printf("cancel to an idle pool: %.1f ms\n", 1e3 * freed_s);
  EXPECT_EQ(big->w->Finish().error_code(), grpc::CANCELLED);
  WaitInflightZero();
  EXPECT_EQ(server_->store()->Stats().committed, 0u);
}

// While the largest upload the default bound allows compresses, a small
// publish is not queued behind it: the upload runs at most workers - 1
// layers at once and the lanes are served in turn.
TEST_F(LargeUploadTest, SmallPublishCompletesWhileALargeUploadRuns) {
  std::unique_ptr<OpenPublish> big = StartLargeUpload();
  ASSERT_FALSE(pool()->WaitIdle(std::chrono::milliseconds(100)));  // a layer is compressing
  const Turn small = MakeTurn(63);
  double worst = 0;
  for (int i = 0; i < 3; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    PublishResult r =
        PublishTurn(stub_.get(), Header("small", "m" + std::to_string(i), "a", {"b"}, "h2o-head:k=8", small), small);
    worst = std::max(worst, Seconds(t0));
    EXPECT_TRUE(r.status.ok()) << r.status.error_message();
  }
  std::printf("small publish while a large upload runs, worst of 3: %.1f ms\n", 1e3 * worst);
  // Alone it takes milliseconds; a layer of the large upload takes seconds.
  EXPECT_LT(worst, 1.0);
  ASSERT_FALSE(pool()->WaitIdle(std::chrono::milliseconds(0)));  // the large upload still runs
  EXPECT_EQ(big->Cut().error_code(), grpc::CANCELLED);
  EXPECT_TRUE(pool()->WaitIdle(std::chrono::milliseconds(5000)));
  WaitInflightZero();
}


// A turn with queries whose keys and queries are finite but whose products
// q.k overflow float32 (the attention mass was NaN, and h2o-head kept
// different counts per head: a heap overflow in the relay).
Turn OverflowingQueryTurn(uint64_t seed) {
  TurnShape s;
  s.layers = 3;
  s.kv_heads = 2;
  s.group = 2;
  s.head_dim = 32;
  s.n_prompt = 48;
  s.n_gen = 6;
  s.dtype = DType::kBF16;
  s.queries = true;
  Turn t = RandomTurn(s, seed);
  std::vector<float> row(s.head_dim);
  for (TurnLayer& l : t.layers) {
    for (KvTensor* x : {&l.prompt_k, &l.gen_k, &l.gen_q}) {
      for (int h = 0; h < x->heads(); ++h) {
        for (int j = 0; j < x->tokens(); ++j) {
          x->ReadRow(h, j, row.data());
          for (float& v : row) v *= 1e20f;
          x->WriteRow(h, j, row.data());
        }
      }
    }
  }
  return t;
}

std::string MetricsText(RelayServer* server) {
  return prometheus::TextSerializer().Serialize(server->metrics()->registry()->Collect());
}

// Hostile numbers are INVALID_ARGUMENT naming the tensor, nothing is
// committed, the relay keeps serving, and a good message published after
// them is the first the recipient fetches.
TEST_F(RelayTest, OverflowingNumbersAreRefusedAndTheMailboxStaysReadable) {
  const Turn bad = OverflowingQueryTurn(71);
  int i = 0;
  for (const char* policy : {"h2o-head:k=8", "h2o-layer:k=8", "h2o-auto:k=8+obf:p=2", "full"}) {
    SCOPED_TRACE(policy);
    auto r = PublishTurn(stub_.get(), Header("hn", "bad" + std::to_string(i++), "a", {"b"}, policy, bad), bad);
    EXPECT_EQ(r.status.error_code(), grpc::INVALID_ARGUMENT) << r.status.error_message();
    EXPECT_NE(r.status.error_message().find(".gen.q: the attention of score head"), std::string::npos)
        << r.status.error_message();
  }
  // softmax_scale past the documented range is refused from the header.
  Turn scaled = MakeTurn(72);
  auto h = Header("hn", "bad-scale", "a", {"b"}, "h2o-head:k=8", scaled);
  h.mutable_geometry()->set_softmax_scale(1e300);
  auto r = PublishTurn(stub_.get(), h, scaled);
  EXPECT_EQ(r.status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_NE(r.status.error_message().find("softmax_scale: 1e+300, expected a finite number in [1e-06, 1000]"),
            std::string::npos)
      << r.status.error_message();

  const Turn good = MakeTurn(73);
  auto ok = PublishTurn(stub_.get(), Header("hn", "good", "a", {"b"}, "h2o-head:k=8", good), good);
  ASSERT_TRUE(ok.status.ok()) << ok.status.error_message();
  FetchResult f = DoFetch(stub_.get(), "hn", "b", true);
  ASSERT_TRUE(f.status.ok()) << f.status.error_message();
  EXPECT_EQ(f.header.message_id(), "good");
  ExpectSameMessage(f.msg, Offline(good, "h2o-head:k=8"));
  grpc::ClientContext ctx;
  v1::StatsResponse st;
  ASSERT_TRUE(stub_->Stats(&ctx, v1::StatsRequest(), &st).ok());
  EXPECT_EQ(st.messages_committed(), 1u);
  WaitInflightZero();
}

// With the finite checks off (tests only), the pipeline's own output check
// stops the same turn: INTERNAL, logged and counted, nothing committed in
// the memory store or in the spool, and the mailbox stays readable.
class InvariantRelayTest : public RelayTest {
 protected:
  void SetUp() override {}
};

TEST_F(InvariantRelayTest, ABrokenInvariantIsInternalCountedAndNothingIsCommitted) {
  for (bool spool : {false, true}) {
    SCOPED_TRACE(spool ? "spool" : "memory");
    char dir[] = "/tmp/kvrelay_invariant_XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    ServerConfig cfg;
    if (spool) cfg.spool_dir = std::string(dir) + "/spool";
    StartServer(cfg);
    const Turn bad = OverflowingQueryTurn(74);
    internal::PipelineChecksForTesting().finite = false;
    auto r = PublishTurn(stub_.get(), Header("inv", "bad", "a", {"b"}, "h2o-head:k=8", bad), bad);
    internal::PipelineChecksForTesting().finite = true;
    EXPECT_EQ(r.status.error_code(), grpc::INTERNAL) << r.status.error_message();
    EXPECT_NE(r.status.error_message().find("pipeline invariant violated"), std::string::npos)
        << r.status.error_message();
    EXPECT_NE(MetricsText(server_.get()).find("kvrelay_pipeline_invariant_violations_total 1"), std::string::npos);
    EXPECT_EQ(server_->store()->Find("inv", "bad"), nullptr);
    const Turn good = MakeTurn(75);
    auto ok = PublishTurn(stub_.get(), Header("inv", "good", "a", {"b"}, "h2o-head:k=8", good), good);
    ASSERT_TRUE(ok.status.ok()) << ok.status.error_message();
    FetchResult f = DoFetch(stub_.get(), "inv", "b", true);
    ASSERT_TRUE(f.status.ok()) << f.status.error_message();
    EXPECT_EQ(f.header.message_id(), "good");
    WaitInflightZero();
    server_->Shutdown();
    server_.reset();
    std::system((std::string("rm -rf ") + dir).c_str());
  }
}

}  // namespace
}  // namespace kvrelay
