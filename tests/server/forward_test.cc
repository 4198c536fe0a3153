// The relay-to-relay RPCs against an in-process relay, driven by the
// generated stub as another relay would: Forward (version, header checks,
// commit, idempotency, ancestor elision, CRC, broken streams, closed
// sessions), MessageStatus and ReportRecipient.
#include <algorithm>
#include <functional>
#include <limits>
#include <random>
#include <thread>

#include "absl/strings/match.h"
#include "core/pipeline.h"
#include "tests/testlib/eventually.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testlib/fake_time_source.h"
#include "proto/stream_codec.h"
#include "proto/wire_codec.h"
#include "proto/wire.h"
#include "tests/server/relay_test_util.h"
#include "server/mesh/ancestor.h"
#include "server/rpc/forward_reactor.h"
#include "server/mesh/forwarder.h"
#include "server/metrics/metrics.h"
#include "server/server.h"
#include "tests/core/test_util.h"

namespace kvrelay {
namespace {

using namespace kvrelay::testing;

Message Offline(const Turn& t, const std::string& policy) {
  auto p = Pipeline::Create(policy);
  EXPECT_TRUE(p.ok()) << p.status();
  auto m = (*p)->Compress(t);
  EXPECT_TRUE(m.ok()) << m.status();
  return *m;
}

Turn MakeTurn(uint64_t seed, bool first = true) {
  TurnShape s;
  s.layers = 3;
  s.kv_heads = 2;
  s.group = 2;
  s.head_dim = 32;
  s.n_prompt = 48;
  s.n_gen = 6;
  s.dtype = DType::kBF16;
  s.first_agent = first;
  return RandomTurn(s, seed);
}

// `t` with `parent` as its history, positions continuing after it: what a
// relay composes for a publish with that parent.
Turn WithHistory(Turn t, const Message& parent) {
  int32_t next = 0;
  for (size_t l = 0; l < t.layers.size(); ++l) {
    t.layers[l].history_k = parent.layers[l].k;
    t.layers[l].history_v = parent.layers[l].v;
    t.layers[l].history_pos = parent.layers[l].pos;
    for (int32_t p : parent.layers[l].pos.data) next = std::max(next, p + 1);
  }
  t.prompt_pos0 = next;
  return t;
}

// The header another relay sends for `msg`.
v1::ForwardHeader FwdHeader(const std::string& session, const std::string& id, const std::string& sender,
                            std::vector<std::string> to, const Message& msg, const std::string& parent = "") {
  v1::ForwardHeader h;
  h.set_protocol_version(kForwardProtocolVersion);
  h.set_origin("origin-relay:1");
  *h.mutable_message() = MessageHeaderOf(msg);
  v1::MessageHeader* m = h.mutable_message();
  m->set_session_id(session);
  m->set_message_id(id);
  m->set_sender(sender);
  m->set_role("critic");
  m->set_parent_id(parent);
  for (const std::string& r : to) h.add_recipients(r);
  h.set_requested_policy(msg.policy);
  return h;
}

// The chunks of `tensors` in order, `chunk_bytes` at most each.
std::vector<v1::Chunk> ChunksOf(std::vector<TensorRef> tensors, size_t chunk_bytes = 1000) {
  std::vector<v1::Chunk> out;
  ChunkCursor cursor(std::move(tensors), chunk_bytes);
  ChunkCursor::Piece p;
  while (cursor.Next(&p)) {
    v1::Chunk& c = out.emplace_back();
    c.set_layer(p.layer);
    c.set_part(p.part);
    c.set_offset(p.offset);
    c.set_data(p.data.data(), p.data.size());
    c.set_crc32c(Crc32c(p.data.data(), p.data.size()));
  }
  return out;
}

v1::ForwardRequest CommitFor(const std::vector<v1::Chunk>& chunks, const Message& msg) {
  v1::ForwardRequest req;
  v1::ForwardCommit* c = req.mutable_commit();
  *c->mutable_trailer() = TrailerOf(chunks);
  v1::Accounting* a = c->mutable_accounting();
  a->set_policy(msg.policy);
  a->set_full_bytes(msg.full_bytes);
  a->set_sent_bytes(msg.sent_bytes);
  a->set_received_bytes(12345);
  c->set_next_pos(msg.next_pos);
  return req;
}

// A whole forward of `msg`: header, its chunks, the commit.
std::vector<v1::ForwardRequest> WholeForward(const v1::ForwardHeader& h, const Message& msg) {
  std::vector<v1::ForwardRequest> reqs;
  *reqs.emplace_back().mutable_header() = h;
  const std::vector<v1::Chunk> chunks = ChunksOf(MessageDeliveryOrder(msg));
  for (const v1::Chunk& c : chunks) *reqs.emplace_back().mutable_chunk() = c;
  reqs.push_back(CommitFor(chunks, msg));
  return reqs;
}

// A WIRE_CODEC_RANS forward of `msg` (every tensor of each layer as one
// blob; with `a` > 0 the tokens after the first `a`, acc as given).
std::vector<v1::ForwardRequest> CodedForward(v1::ForwardHeader h, const Message& msg, const Message& carried,
                                             size_t chunk_bytes = 1000) {
  h.set_protocol_version(kForwardProtocolVersion);
  h.set_wire_codec(v1::WIRE_CODEC_RANS);
  std::vector<v1::ForwardRequest> reqs;
  *reqs.emplace_back().mutable_header() = h;
  std::vector<WireBlob> blobs;  // ChunksOf copies them
  blobs.reserve(carried.layers.size());
  std::vector<TensorRef> wire;
  for (size_t l = 0; l < carried.layers.size(); ++l) {
    const std::vector<TensorRef> t = LayerDeliveryOrder(carried.layers[l], static_cast<uint32_t>(l),
                                                        h.message().acc_tokens() > 0);
    blobs.push_back(EncodeWireLayer(t, {carried.kv_heads, msg.dtype == DType::kF32 ? 4 : 2}));
    wire.push_back({static_cast<uint32_t>(l), v1::PART_WIRE_LAYER, blobs.back()});
  }
  const std::vector<v1::Chunk> chunks = ChunksOf(wire, chunk_bytes);
  for (const v1::Chunk& c : chunks) *reqs.emplace_back().mutable_chunk() = c;
  reqs.push_back(CommitFor(chunks, msg));
  return reqs;
}

// The tokens after the first `a` of every head of every layer of `msg`.
Message SuffixOf(const Message& msg, int a) {
  Message out = msg;
  for (MessageLayer& l : out.layers) {
    const int heads = l.pos.heads, n = l.tokens() - a;
    MessageLayer s;
    s.k = KvTensor(l.k.dtype(), heads, n, l.k.dim());
    s.v = KvTensor(l.v.dtype(), heads, n, l.v.dim());
    s.pos = PosTensor(heads, n);
    for (int h = 0; h < heads; ++h) {
      for (int j = 0; j < n; ++j) {
        s.k.CopyRow(h, j, l.k, h, a + j);
        s.v.CopyRow(h, j, l.v, h, a + j);
        s.pos.at(h, j) = l.pos.at(h, a + j);
      }
    }
    l = std::move(s);
  }
  return out;
}

struct ForwardCall {
  grpc::Status status;
  v1::ForwardResponse response;
};

// Writes `reqs` (stopping when the relay ends the call), then WritesDone,
// unless `cut_when` is given: then the call is cancelled after the writes,
// once cut_when() says the relay has taken them in (false: it never did).
ForwardCall DoForward(v1::Relay::Stub* stub, const std::vector<v1::ForwardRequest>& reqs,
                      const std::function<bool()>& cut_when = nullptr) {
  ForwardCall r;
  grpc::ClientContext ctx;
  ctx.set_deadline(In(30));
  auto writer = stub->Forward(&ctx, &r.response);
  for (const auto& q : reqs) {
    if (!writer->Write(q)) break;
  }
  if (cut_when) {
    EXPECT_TRUE(cut_when()) << "the relay did not read the writes before the cut";
    ctx.TryCancel();
  } else {
    writer->WritesDone();
  }
  r.status = writer->Finish();
  return r;
}

// The sum of counter `name` over its series; with `outcome`, only the
// series with that outcome label.
double CounterSum(Metrics* m, const std::string& name, const std::string& outcome = "") {
  double sum = 0;
  for (const auto& fam : m->registry()->Collect()) {
    if (fam.name != name) continue;
    for (const auto& metric : fam.metric) {
      bool match = outcome.empty();
      for (const auto& label : metric.label) match = match || (label.name == "outcome" && label.value == outcome);
      if (match) sum += metric.counter.value;
    }
  }
  return sum;
}

class ForwardTest : public ::testing::Test {
 protected:
  void StartServer(ServerConfig cfg = {}, TimeSource* time = TimeSource::Real()) {
    if (server_) server_->Shutdown();
    cfg.listen = {"127.0.0.1:0"};
    cfg.metrics_listen = "";
    if (cfg.worker_threads <= 0) cfg.worker_threads = 2;
    cfg.shutdown_grace_seconds = 1;
    auto s = RelayServer::Start(cfg, time);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    stub_ = v1::Relay::NewStub(grpc::CreateChannel(server_->grpc_address(), grpc::InsecureChannelCredentials()));
  }
  void SetUp() override { StartServer(); }
  void TearDown() override {
    if (server_) server_->Shutdown();
  }

  void ExpectNothingFor(const std::string& session, const std::string& agent) {
    FetchResult f = DoFetch(stub_.get(), session, agent, false, 0.3);
    EXPECT_EQ(f.status.error_code(), grpc::DEADLINE_EXCEEDED) << agent << ": " << f.status.error_message();
  }

  // The forward attempts of recipient `i` of (session, id) so far.
  uint32_t AttemptsOf(const std::string& session, const std::string& id, int i) {
    v1::MessageStatusResponse resp;
    if (!Status(session, id, &resp).ok() || resp.recipients_size() <= i) return 0;
    return resp.recipients(i).attempts();
  }

  // With the relay on `clock`: fires its timers in deadline order (the
  // store's sweep, the watchdog, and the forwarder's threads waiting for a
  // queued retry) until `done`. False after 20 s of real time.
  // The relay's threads that always wait on its clock: the store's timer
  // and the upload watchdog.
  static constexpr int kTimersAlwaysWaiting = 2;

  static bool FireTimersUntil(FakeTimeSource* clock, const std::function<bool()>& done) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (std::chrono::steady_clock::now() < until) {
      if (done()) return true;
      // One more than the waiters always there: a forwarder thread waiting
      // for a queued retry (none while an attempt runs, whose retry is not
      // queued yet).
      if (clock->AwaitWaiters(kTimersAlwaysWaiting + 1, std::chrono::milliseconds(100))) {
        clock->AdvanceToNextDeadline();
      }
    }
    return done();
  }

  // A forward of `reqs` (no commit among them) cancelled once the relay has
  // read every one of them: a stream cut before its commit.
  ForwardCall CutForward(const std::vector<v1::ForwardRequest>& reqs) {
    RelayContext* relay = server_->service()->context();
    const uint64_t before = relay->forward_requests_read();
    return DoForward(stub_.get(), reqs,
                     [&] { return Eventually([&] { return relay->forward_requests_read() >= before + reqs.size(); }); });
  }

  // Failed forward attempts so far (kvrelay_forwards_total{outcome="retry"}).
  double Retries() { return CounterSum(server_->metrics(), "kvrelay_forwards_total", "retry"); }

  void WaitInflightZero() {
    Eventually([&] { return server_->store()->inflight_bytes() == 0; });
    EXPECT_EQ(server_->store()->inflight_bytes(), 0u);
  }

  grpc::Status Ack(const std::string& session, const std::string& agent, const std::string& id) {
    grpc::ClientContext ctx;
    v1::AckRequest req;
    req.set_session_id(session);
    req.set_agent(agent);
    req.set_message_id(id);
    v1::AckResponse resp;
    return stub_->Ack(&ctx, req, &resp);
  }

  grpc::Status Close(const std::string& session) {
    grpc::ClientContext ctx;
    v1::CloseSessionRequest req;
    req.set_session_id(session);
    v1::CloseSessionResponse resp;
    return stub_->CloseSession(&ctx, req, &resp);
  }

  grpc::Status Status(const std::string& session, const std::string& id, v1::MessageStatusResponse* resp) {
    grpc::ClientContext ctx;
    v1::MessageStatusRequest req;
    req.set_session_id(session);
    req.set_message_id(id);
    return stub_->MessageStatus(&ctx, req, resp);
  }

  grpc::Status Report(const std::string& session, const std::string& id, const std::string& agent,
                      v1::RecipientState state) {
    grpc::ClientContext ctx;
    v1::ReportRecipientRequest req;
    req.set_session_id(session);
    req.set_message_id(id);
    req.set_agent(agent);
    req.set_state(state);
    v1::ReportRecipientResponse resp;
    return stub_->ReportRecipient(&ctx, req, &resp);
  }

  // Expects results in `want`'s order: agent, code, duplicate.
  static void ExpectResults(const ForwardCall& r, const std::vector<std::tuple<std::string, int, bool>>& want) {
    ASSERT_TRUE(r.status.ok()) << r.status.error_code() << ": " << r.status.error_message();
    EXPECT_FALSE(r.response.ancestor_missing());
    ASSERT_EQ(r.response.results_size(), static_cast<int>(want.size())) << r.response.ShortDebugString();
    for (size_t i = 0; i < want.size(); ++i) {
      const v1::ForwardResult& x = r.response.results(static_cast<int>(i));
      EXPECT_EQ(x.agent(), std::get<0>(want[i])) << i;
      EXPECT_EQ(x.code(), std::get<1>(want[i])) << i << ": " << x.message();
      EXPECT_EQ(x.duplicate(), std::get<2>(want[i])) << i;
    }
  }

  // The time of tests that drive it (StartServer(cfg, &clock_)); outlives server_.
  FakeTimeSource clock_;
  std::unique_ptr<RelayServer> server_;
  std::unique_ptr<v1::Relay::Stub> stub_;
};

TEST_F(ForwardTest, AnUnknownProtocolVersionIsFailedPreconditionNamingTheOneSpoken) {
  const Message msg = Offline(MakeTurn(1), "full");
  v1::ForwardHeader h = FwdHeader("s", "m1", "a", {"b"}, msg);
  for (uint32_t version : {0u, 3u, 1000u}) {
    h.set_protocol_version(version);
    ForwardCall r = DoForward(stub_.get(), WholeForward(h, msg));
    EXPECT_EQ(r.status.error_code(), grpc::FAILED_PRECONDITION) << version << ": " << r.status.error_message();
    EXPECT_EQ(r.status.error_message(),
              "header.protocol_version: " + std::to_string(version) + ", this relay speaks 1 and 2");
  }
  EXPECT_FALSE(server_->store()->Find("s", "m1"));
  ExpectNothingFor("s", "b");
}

TEST_F(ForwardTest, AMalformedHeaderIsInvalidArgumentNamingTheField) {
  const Message msg = Offline(MakeTurn(2), "full");
  struct Case {
    const char* name;
    std::function<void(v1::ForwardHeader*)> edit;
    const char* want;  // the message starts with it
  };
  const std::vector<Case> cases = {
      {"bad session id", [](v1::ForwardHeader* h) { h->mutable_message()->set_session_id("a session"); },
       "header.message.session_id: 'a session', expected"},
      {"no session id", [](v1::ForwardHeader* h) { h->mutable_message()->set_session_id(""); },
       "header.message.session_id: empty"},
      {"no message id", [](v1::ForwardHeader* h) { h->mutable_message()->set_message_id(""); },
       "header.message.message_id: empty"},
      {"bad sender", [](v1::ForwardHeader* h) { h->mutable_message()->set_sender("a/b"); },
       "header.message.sender: 'a/b'"},
      {"bad parent", [](v1::ForwardHeader* h) { h->mutable_message()->set_parent_id("p p"); },
       "header.message.parent_id: 'p p'"},
      {"long role", [](v1::ForwardHeader* h) { h->mutable_message()->set_role(std::string(129, 'r')); },
       "header.message.role: 129 bytes, expected at most 128"},
      {"no recipients", [](v1::ForwardHeader* h) { h->clear_recipients(); },
       "header.recipients: empty, expected at least one agent"},
      {"too many recipients",
       [](v1::ForwardHeader* h) {
         h->clear_recipients();
         for (int i = 0; i < 65; ++i) h->add_recipients("r" + std::to_string(i));
       },
       "header.recipients: 65 agents, expected 1..64"},
      {"bad recipient",
       [](v1::ForwardHeader* h) {
         h->clear_recipients();
         h->add_recipients("b");
         h->add_recipients("c d");
       },
       "header.recipients[1]: 'c d'"},
      {"duplicate recipients",
       [](v1::ForwardHeader* h) {
         h->clear_recipients();
         h->add_recipients("b");
         h->add_recipients("c");
         h->add_recipients("b");
       },
       "header.recipients[2]: 'b' repeats recipients[0], expected distinct agents"},
      {"bad ancestor id", [](v1::ForwardHeader* h) { h->set_ancestor_id("x y"); }, "header.ancestor_id: 'x y'"},
      {"no layers", [](v1::ForwardHeader* h) { h->mutable_message()->set_layers(0); }, "header.layers: 0"},
  };
  for (const Case& c : cases) {
    v1::ForwardHeader h = FwdHeader("s", "m1", "a", {"b"}, msg);
    c.edit(&h);
    ForwardCall r = DoForward(stub_.get(), WholeForward(h, msg));
    EXPECT_EQ(r.status.error_code(), grpc::INVALID_ARGUMENT) << c.name << ": " << r.status.error_message();
    EXPECT_TRUE(absl::StartsWith(r.status.error_message(), c.want)) << c.name << ": " << r.status.error_message();
  }
  EXPECT_EQ(server_->store()->Stats().sessions, 0u);
  WaitInflightZero();
}

TEST_F(ForwardTest, AWholeForwardIsCommittedAndFetchedBitExact) {
  for (const char* policy : {"full", "h2o-head:k=8+obf:p=4,mode=fast", "h2o-layer:k=8+obf:p=4+int4:rotate=hadamard"}) {
    SCOPED_TRACE(policy);
    const std::string session = std::string("s-") + std::to_string(std::hash<std::string>()(policy) % 100000);
    const Message msg = Offline(MakeTurn(3), policy);
    ForwardCall r = DoForward(stub_.get(), WholeForward(FwdHeader(session, "m1", "a", {"b", "c"}, msg), msg));
    ExpectResults(r, {{"b", 0, false}, {"c", 0, false}});
    for (const char* agent : {"b", "c"}) {
      FetchResult f = DoFetch(stub_.get(), session, agent, /*auto_ack=*/true);
      ASSERT_TRUE(f.status.ok()) << f.status.error_message();
      EXPECT_TRUE(f.trailer_ok);
      EXPECT_EQ(f.header.message_id(), "m1");
      EXPECT_EQ(f.header.sender(), "a");
      EXPECT_EQ(f.header.role(), "critic");
      EXPECT_EQ(f.header.delivery_attempt(), 1u);
      EXPECT_EQ(f.header.next_pos(), msg.next_pos);
      EXPECT_EQ(f.header.accounting().policy(), msg.policy);
      EXPECT_EQ(f.header.accounting().full_bytes(), msg.full_bytes);
      EXPECT_EQ(f.header.accounting().sent_bytes(), msg.sent_bytes);
      ExpectSameMessage(f.msg, msg);
      ExpectNothingFor(session, agent);
    }
    MessagePtr held = server_->store()->Find(session, "m1");
    ASSERT_TRUE(held);
    EXPECT_TRUE(held->forwarded);
    EXPECT_EQ(held->origin, "origin-relay:1");
  }
  WaitInflightZero();
}

// What later selections rely on is checked on receipt: acc finite and >= 0,
// and every head holding every anchor once. Nothing is stored otherwise.
TEST_F(ForwardTest, AnAccOrAnchorsNoRelayWouldSendAreRefused) {
  Turn t = MakeTurn(5);
  const Message msg = Offline(t, "h2o-head:k=8");
  ASSERT_FALSE(msg.anchor_pos.empty());
  ASSERT_FALSE(msg.layers[1].acc.empty());
  auto forward = [&](const Message& m, const std::string& id) {
    v1::ForwardHeader h = FwdHeader("bad", id, "a", {"b"}, m);
    h.mutable_message()->set_acc_tokens(static_cast<uint32_t>(m.layers[0].tokens()));
    std::vector<v1::ForwardRequest> reqs;
    *reqs.emplace_back().mutable_header() = h;
    const std::vector<v1::Chunk> chunks = ChunksOf(MessageDeliveryOrder(m, /*with_acc=*/true));
    for (const v1::Chunk& c : chunks) *reqs.emplace_back().mutable_chunk() = c;
    reqs.push_back(CommitFor(chunks, m));
    return DoForward(stub_.get(), reqs);
  };
  ExpectResults(forward(msg, "good"), {{"b", 0, false}});
  EXPECT_EQ(server_->store()->Find("bad", "good")->msg.layers[1].acc, msg.layers[1].acc);

  Message nan = msg;
  const int n = msg.layers[1].tokens();
  nan.layers[1].acc[static_cast<size_t>(n) + 3] = std::nanf("");
  ForwardCall r = forward(nan, "nan");
  EXPECT_EQ(r.status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_EQ(r.status.error_message(), "layer.1.acc: nan at [1,3], expected a finite accumulated importance >= 0");
  EXPECT_EQ(server_->store()->Find("bad", "nan"), nullptr);

  Message neg = msg;
  neg.layers[0].acc[0] = -0.5f;
  r = forward(neg, "neg");
  EXPECT_EQ(r.status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_EQ(r.status.error_message(), "layer.0.acc: -0.5 at [0,0], expected a finite accumulated importance >= 0");

  Message lost = msg;  // head 1 of layer 2 no longer holds the first anchor
  const int32_t a0 = msg.anchor_pos[0];
  for (int j = 0; j < lost.layers[2].tokens(); ++j) {
    if (lost.layers[2].pos.at(1, j) == a0) lost.layers[2].pos.at(1, j) = 1 << 30;
  }
  r = forward(lost, "lost");
  EXPECT_EQ(r.status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_EQ(r.status.error_message(),
            absl::StrCat("header.message.anchor_pos: position ", a0, " is held 0 times by head 1 of layer.2.pos, "
                         "expected exactly once (every head keeps every anchor of the chain)"));
  EXPECT_EQ(server_->store()->Find("bad", "lost"), nullptr);
  WaitInflightZero();
}

// A norm or scale no relay computes (NaN or Inf: decoding multiplies it
// into every value of its row) is refused as it arrives; nothing is stored.
TEST_F(ForwardTest, ANonFiniteNormIsRefused) {
  Message msg = Offline(MakeTurn(6), "h2o-head:k=8+demote:bits=2+lloyd:bits=4");
  ASSERT_TRUE(msg.layers[2].demoted.has_value());
  msg.layers[2].demoted->v.scale[1] = 0x7C00;  // fp16 +Inf
  ForwardCall r = DoForward(stub_.get(), WholeForward(FwdHeader("s", "inf", "a", {"b"}, msg), msg));
  EXPECT_EQ(r.status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_EQ(r.status.error_message(), "layer.2.demoted.v.norm: non-finite value inf at [0,1,0], expected finite values");
  EXPECT_EQ(server_->store()->Find("s", "inf"), nullptr);
  WaitInflightZero();
}

// A coded forward's K/V are decoded straight into the message's tensors and
// checked there: a NaN a peer encoded is refused, nothing is stored, and
// the same message sent clean is then committed.
TEST_F(ForwardTest, ANonFiniteValueInARansForwardIsRefused) {
  const Message clean = Offline(MakeTurn(12), "full");
  Message msg = clean;
  ASSERT_EQ(msg.dtype, DType::kBF16);
  absl::Span<uint8_t> k = msg.layers[1].k.mutable_bytes();
  k[k.size() - 2] = 0xc0;  // the last element: bf16 0x7fc0, a NaN
  k[k.size() - 1] = 0x7f;
  const v1::ForwardHeader h = FwdHeader("s", "nan", "a", {"b"}, msg);
  ForwardCall r = DoForward(stub_.get(), CodedForward(h, msg, msg));
  EXPECT_EQ(r.status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_THAT(r.status.error_message(), ::testing::HasSubstr("layer.1.k: non-finite value nan"));
  EXPECT_EQ(server_->store()->Find("s", "nan"), nullptr);
  ExpectNothingFor("s", "b");
  WaitInflightZero();
  ExpectResults(DoForward(stub_.get(), CodedForward(h, clean, clean)), {{"b", 0, false}});
  FetchResult f = DoFetch(stub_.get(), "s", "b", /*auto_ack=*/true);
  ASSERT_TRUE(f.status.ok()) << f.status.error_message();
  ExpectSameMessage(f.msg, clean);
  WaitInflightZero();
}

// A lloyd message with demoted tokens is delivered decoded to dense; the
// decoded copy counts in flight while the delivery is open, and no longer
// once it is done.
TEST_F(ForwardTest, ADecodedDeliveryIsCountedInFlightUntilItEnds) {
  // Decoded, tens of MB: more than HTTP/2 flow control lets the relay write
  // before the client reads, so the delivery is open while it is checked.
  TurnShape s;
  s.layers = 2;
  s.kv_heads = 4;
  s.group = 1;
  s.head_dim = 128;
  s.n_prompt = 6000;
  s.n_gen = 4;
  s.dtype = DType::kBF16;
  const Message msg = Offline(RandomTurn(s, 8), "h2o-head:k=8+demote:bits=2+lloyd:bits=3");
  absl::StatusOr<Message> dense = DecodedMessage(msg);
  ASSERT_TRUE(dense.ok()) << dense.status();
  ExpectResults(DoForward(stub_.get(), WholeForward(FwdHeader("s", "m", "a", {"b"}, msg), msg)), {{"b", 0, false}});
  WaitInflightZero();
  const uint64_t held = server_->store()->inflight_bytes();
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(10));
    v1::FetchRequest req;
    req.set_session_id("s");
    req.set_agent("b");
    auto reader = stub_->Fetch(&ctx, req);
    Reassembler<v1::FetchResponse> ra;
    v1::FetchResponse resp;
    ASSERT_TRUE(reader->Read(&resp));
    ASSERT_TRUE(resp.has_header());
    EXPECT_EQ(resp.header().n_demoted(), 0u);
    EXPECT_EQ(resp.header().quant_bits(), 0u);
    EXPECT_GE(server_->store()->inflight_bytes(), held + RetainedBytes(*dense));
    ra.Add(resp);
    while (reader->Read(&resp)) ra.Add(resp);
    ra.r.status = reader->Finish();
    ASSERT_TRUE(ra.r.status.ok()) << ra.r.status.error_message();
    ra.Build();
    ExpectSameMessage(ra.r.msg, *dense);
  }
  WaitInflightZero();
}

// The same forward again is answered from its header alone (no tensor is
// read: the stream here has none), per recipient, and delivers nothing twice.
TEST_F(ForwardTest, AForwardAgainIsADuplicateWithoutItsTensors) {
  const Message msg = Offline(MakeTurn(4), "full");
  const v1::ForwardHeader h = FwdHeader("s", "m1", "a", {"b"}, msg);
  ExpectResults(DoForward(stub_.get(), WholeForward(h, msg)), {{"b", 0, false}});
  std::vector<v1::ForwardRequest> header_only(1);
  *header_only[0].mutable_header() = h;
  ExpectResults(DoForward(stub_.get(), header_only), {{"b", 0, true}});
  ExpectResults(DoForward(stub_.get(), WholeForward(h, msg)), {{"b", 0, true}});
  EXPECT_EQ(server_->store()->Stats().mailbox_messages, 1u);

  FetchResult f = DoFetch(stub_.get(), "s", "b", /*auto_ack=*/true);
  ASSERT_TRUE(f.status.ok()) << f.status.error_message();
  EXPECT_EQ(f.header.delivery_attempt(), 1u);
  ExpectNothingFor("s", "b");
  ExpectResults(DoForward(stub_.get(), header_only), {{"b", 0, true}});
  ExpectNothingFor("s", "b");

  // Another recipient of the same message joins with a header alone.
  v1::ForwardHeader more = h;
  more.add_recipients("c");
  *header_only[0].mutable_header() = more;
  ExpectResults(DoForward(stub_.get(), header_only), {{"b", 0, true}, {"c", 0, false}});
  FetchResult fc = DoFetch(stub_.get(), "s", "c", /*auto_ack=*/true);
  ASSERT_TRUE(fc.status.ok()) << fc.status.error_message();
  ExpectSameMessage(fc.msg, msg);
  ExpectNothingFor("s", "b");
  EXPECT_EQ(server_->store()->Stats().sessions, 1u);
  WaitInflightZero();
}

TEST_F(ForwardTest, TheSameIdWithAnotherHeaderIsAlreadyExists) {
  const Message msg = Offline(MakeTurn(5), "full");
  ExpectResults(DoForward(stub_.get(), WholeForward(FwdHeader("s", "m1", "a", {"b"}, msg), msg)), {{"b", 0, false}});
  v1::ForwardHeader other = FwdHeader("s", "m1", "intruder", {"b"}, msg);
  ForwardCall r = DoForward(stub_.get(), WholeForward(other, msg));
  EXPECT_EQ(r.status.error_code(), grpc::ALREADY_EXISTS) << r.status.error_message();
  // Another sender's message: nothing of it is told, not even its sender.
  EXPECT_EQ(r.status.error_message(),
            "header.message.message_id: 'm1' is already committed in session 's' by another sender; choose another "
            "message id");
  other = FwdHeader("s", "m1", "a", {"b"}, msg, /*parent=*/"m0");
  r = DoForward(stub_.get(), WholeForward(other, msg));
  EXPECT_EQ(r.status.error_code(), grpc::ALREADY_EXISTS) << r.status.error_message();
  EXPECT_TRUE(absl::StrContains(r.status.error_message(), "with header.message.parent_id '', this forward has 'm0'")) << r.status.error_message();
  EXPECT_EQ(server_->store()->Stats().mailbox_messages, 1u);
}

TEST_F(ForwardTest, AFullMailboxIsAnsweredForItsRecipientOnly) {
  const Message msg = Offline(MakeTurn(6), "full");
  ServerConfig cfg;
  cfg.max_mailbox_bytes = RetainedBytes(msg) * 3 / 2;
  StartServer(cfg);
  ExpectResults(DoForward(stub_.get(), WholeForward(FwdHeader("s", "m1", "a", {"b"}, msg), msg)), {{"b", 0, false}});
  ForwardCall r = DoForward(stub_.get(), WholeForward(FwdHeader("s", "m2", "a", {"b", "c"}, msg), msg));
  ExpectResults(r, {{"b", grpc::RESOURCE_EXHAUSTED, false}, {"c", 0, false}});
  if (r.response.results_size() == 2) {
    EXPECT_TRUE(absl::StrContains(r.response.results(0).message(), "mailbox of 'b' in session 's'"))
        << r.response.results(0).message();
    EXPECT_TRUE(absl::StrContains(r.response.results(0).message(),
                                  "--max-mailbox-bytes=" + std::to_string(cfg.max_mailbox_bytes)))
        << r.response.results(0).message();
  }
  FetchResult fb = DoFetch(stub_.get(), "s", "b", /*auto_ack=*/true);
  ASSERT_TRUE(fb.status.ok());
  EXPECT_EQ(fb.header.message_id(), "m1");
  // The sending relay retries b alone: the header is enough now.
  std::vector<v1::ForwardRequest> retry(1);
  *retry[0].mutable_header() = FwdHeader("s", "m2", "a", {"b"}, msg);
  ExpectResults(DoForward(stub_.get(), retry), {{"b", 0, false}});
  fb = DoFetch(stub_.get(), "s", "b", /*auto_ack=*/true);
  ASSERT_TRUE(fb.status.ok());
  EXPECT_EQ(fb.header.message_id(), "m2");
  ExpectSameMessage(fb.msg, msg);
}

TEST_F(ForwardTest, AnAncestorNotHeldIsAnsweredAncestorMissing) {
  const Message parent = Offline(MakeTurn(7), "full");
  const Message child = Offline(WithHistory(MakeTurn(8, false), parent), "full");
  const int a = parent.layers[0].tokens();
  v1::ForwardHeader h = FwdHeader("s", "m2", "b", {"c"}, child, "m1");
  h.set_ancestor_id("m1");
  h.set_ancestor_tokens(a);
  std::vector<v1::ForwardRequest> reqs = WholeForward(h, SuffixOf(child, a));
  ForwardCall r = DoForward(stub_.get(), reqs);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_TRUE(r.response.ancestor_missing());
  EXPECT_EQ(r.response.results_size(), 0);
  EXPECT_FALSE(server_->store()->Find("s", "m2"));
  ExpectNothingFor("s", "c");

  // Held, but not as the header describes it (other token count): the same.
  ExpectResults(DoForward(stub_.get(), WholeForward(FwdHeader("s", "m1", "a", {"b"}, parent), parent)),
                {{"b", 0, false}});
  h.set_ancestor_tokens(a - 1);
  reqs = WholeForward(h, SuffixOf(child, a - 1));
  r = DoForward(stub_.get(), reqs);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_TRUE(r.response.ancestor_missing());
  EXPECT_FALSE(server_->store()->Find("s", "m2"));
  ExpectNothingFor("s", "c");
  WaitInflightZero();
}

// The ancestor held here (forwarded earlier) plus the tokens after it: the
// message the sending relay composed, bit for bit.
TEST_F(ForwardTest, AForwardAfterItsAncestorIsRebuiltBitExact) {
  const Message parent = Offline(MakeTurn(9), "full");
  const Message child = Offline(WithHistory(MakeTurn(10, false), parent), "full");
  const int a = parent.layers[0].tokens();
  ASSERT_EQ(child.n_history, a);
  ASSERT_GT(child.layers[0].tokens(), a);
  ExpectResults(DoForward(stub_.get(), WholeForward(FwdHeader("s", "m1", "a", {"b"}, parent), parent)),
                {{"b", 0, false}});
  v1::ForwardHeader h = FwdHeader("s", "m2", "b", {"c"}, child, "m1");
  h.set_ancestor_id("m1");
  h.set_ancestor_tokens(a);
  const Message suffix = SuffixOf(child, a);
  const std::vector<v1::Chunk> chunks = ChunksOf(MessageDeliveryOrder(suffix));
  std::vector<v1::ForwardRequest> reqs;
  *reqs.emplace_back().mutable_header() = h;
  uint64_t wire = 0;
  for (const v1::Chunk& c : chunks) {
    *reqs.emplace_back().mutable_chunk() = c;
    wire += c.data().size();
  }
  reqs.push_back(CommitFor(chunks, child));  // the accounting of the whole message
  EXPECT_LT(wire, child.sent_bytes);
  ExpectResults(DoForward(stub_.get(), reqs), {{"c", 0, false}});

  FetchResult f = DoFetch(stub_.get(), "s", "c", /*auto_ack=*/true);
  ASSERT_TRUE(f.status.ok()) << f.status.error_message();
  EXPECT_TRUE(f.trailer_ok);
  EXPECT_EQ(f.header.parent_id(), "m1");
  EXPECT_EQ(f.header.n_history(), static_cast<uint32_t>(a));
  EXPECT_EQ(f.header.n_kept() + f.header.n_anchor() + f.header.n_gen(),
            static_cast<uint32_t>(child.layers[0].tokens() - a));
  EXPECT_EQ(f.header.accounting().sent_bytes(), child.sent_bytes);
  EXPECT_EQ(f.header.next_pos(), child.next_pos);
  ExpectSameMessage(f.msg, child);
  MessagePtr held = server_->store()->Find("s", "m2");
  ASSERT_TRUE(held);
  EXPECT_EQ(held->msg.sent_bytes, child.sent_bytes);
  EXPECT_EQ(held->bytes, RetainedBytes(child.sent_bytes, child.layers.size()));  // forwarded without acc
  WaitInflightZero();
}

TEST_F(ForwardTest, ARansForwardIsCommittedAndFetchedBitExact) {
  int i = 0;
  for (const char* policy : {"full", "h2o-head:k=8+obf:p=4,mode=fast", "h2o-layer:k=8+obf:p=4+int4:rotate=hadamard",
                             "full+int8"}) {
    SCOPED_TRACE(policy);
    const std::string session = "rans" + std::to_string(i++);
    const Message msg = Offline(MakeTurn(3 + i), policy);
    ForwardCall r = DoForward(stub_.get(), CodedForward(FwdHeader(session, "m1", "a", {"b"}, msg), msg, msg));
    ExpectResults(r, {{"b", 0, false}});
    FetchResult f = DoFetch(stub_.get(), session, "b", /*auto_ack=*/true);
    ASSERT_TRUE(f.status.ok()) << f.status.error_message();
    EXPECT_TRUE(f.trailer_ok);
    EXPECT_EQ(f.header.accounting().sent_bytes(), msg.sent_bytes);
    ExpectSameMessage(f.msg, msg);
  }
  WaitInflightZero();
}

TEST_F(ForwardTest, ARansForwardAfterItsAncestorIsRebuiltBitExact) {
  const Message parent = Offline(MakeTurn(9), "full");
  const Message child = Offline(WithHistory(MakeTurn(10, false), parent), "full");
  const int a = parent.layers[0].tokens();
  ExpectResults(DoForward(stub_.get(), CodedForward(FwdHeader("s", "m1", "a", {"b"}, parent), parent, parent)),
                {{"b", 0, false}});
  v1::ForwardHeader h = FwdHeader("s", "m2", "b", {"c"}, child, "m1");
  h.set_ancestor_id("m1");
  h.set_ancestor_tokens(a);
  ExpectResults(DoForward(stub_.get(), CodedForward(h, child, SuffixOf(child, a))), {{"c", 0, false}});
  FetchResult f = DoFetch(stub_.get(), "s", "c", /*auto_ack=*/true);
  ASSERT_TRUE(f.status.ok()) << f.status.error_message();
  ExpectSameMessage(f.msg, child);
  WaitInflightZero();
}

TEST_F(ForwardTest, AHostileRansForwardIsRefusedAndLeavesNothing) {
  const Message msg = Offline(MakeTurn(11), "h2o-head:k=8+int4");
  const v1::ForwardHeader h = FwdHeader("s", "m1", "a", {"b"}, msg);
  // A blob byte changed under matching chunk CRCs and trailer: the blob's
  // own checks refuse it.
  for (size_t at : {size_t{2}, size_t{7}, size_t{20}, size_t{400}, size_t{900}}) {
    std::vector<v1::ForwardRequest> reqs = CodedForward(h, msg, msg, 1 << 20);
    v1::Chunk* c = reqs[1].mutable_chunk();
    std::string data = c->data();
    ASSERT_LT(at, data.size());
    data[at] ^= 0x11;
    c->set_data(data);
    c->set_crc32c(Crc32c(data.data(), data.size()));
    std::vector<v1::Chunk> chunks;
    for (size_t j = 1; j + 1 < reqs.size(); ++j) chunks.push_back(reqs[j].chunk());
    *reqs.back().mutable_commit()->mutable_trailer() = TrailerOf(chunks);
    ForwardCall r = DoForward(stub_.get(), reqs);
    EXPECT_FALSE(r.status.ok()) << at;
    EXPECT_TRUE(r.status.error_code() == grpc::INVALID_ARGUMENT || r.status.error_code() == grpc::DATA_LOSS)
        << at << ": " << r.status.error_message();
  }
  // A chunk cut short, the trailer matching what was sent.
  {
    std::vector<v1::ForwardRequest> reqs = CodedForward(h, msg, msg, 1 << 20);
    reqs.erase(reqs.begin() + 2);
    std::vector<v1::Chunk> chunks;
    for (size_t j = 1; j + 1 < reqs.size(); ++j) chunks.push_back(reqs[j].chunk());
    *reqs.back().mutable_commit()->mutable_trailer() = TrailerOf(chunks);
    EXPECT_FALSE(DoForward(stub_.get(), reqs).status.ok());
  }
  // RANS with protocol 1, and an unknown codec.
  {
    std::vector<v1::ForwardRequest> reqs = CodedForward(h, msg, msg);
    reqs[0].mutable_header()->set_protocol_version(kForwardProtocolVersionV1);
    EXPECT_EQ(DoForward(stub_.get(), reqs).status.error_code(), grpc::INVALID_ARGUMENT);
    reqs[0].mutable_header()->set_protocol_version(kForwardProtocolVersion);
    reqs[0].mutable_header()->set_wire_codec(static_cast<v1::WireCodec>(7));
    EXPECT_EQ(DoForward(stub_.get(), reqs).status.error_code(), grpc::INVALID_ARGUMENT);
  }
  EXPECT_FALSE(server_->store()->Find("s", "m1"));
  ExpectNothingFor("s", "b");
  WaitInflightZero();
  ExpectResults(DoForward(stub_.get(), CodedForward(h, msg, msg)), {{"b", 0, false}});
}

// RebuildFromAncestor against a row-by-row concatenation, on random dense
// layers of several shapes and dtypes.
TEST(RebuildFromAncestorTest, MatchesAStraightforwardConcatenation) {
  for (uint64_t seed = 1; seed <= 12; ++seed) {
    std::mt19937_64 rng(seed);
    auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    const DType dtype = seed % 3 == 0 ? DType::kF32 : (seed % 3 == 1 ? DType::kBF16 : DType::kF16);
    const int layers = pick(1, 4), heads = pick(1, 4), dim = 8 * pick(1, 8);
    const int na = pick(0, 40), ns = pick(seed % 4 == 0 ? 0 : 1, 30);
    Message ancestor, suffix;
    for (Message* m : {&ancestor, &suffix}) {
      m->dtype = dtype;
      m->kv_heads = heads;
      m->head_dim = dim;
    }
    suffix.policy = "full";
    suffix.next_pos = 777;
    auto fill = [&](int n) {
      MessageLayer l;
      l.k = KvTensor(dtype, heads, n, dim);
      l.v = KvTensor(dtype, heads, n, dim);
      l.pos = PosTensor(heads, n);
      for (uint8_t& b : l.k.mutable_bytes()) b = static_cast<uint8_t>(rng());
      for (uint8_t& b : l.v.mutable_bytes()) b = static_cast<uint8_t>(rng());
      for (int32_t& p : l.pos.data) p = static_cast<int32_t>(rng() % 100000);
      return l;
    };
    for (int l = 0; l < layers; ++l) {
      ancestor.layers.push_back(fill(na));
      suffix.layers.push_back(fill(ns));
    }
    const Message got = RebuildFromAncestor(ancestor, suffix);
    EXPECT_EQ(got.policy, "full");
    EXPECT_EQ(got.next_pos, 777);
    ASSERT_EQ(got.layers.size(), static_cast<size_t>(layers)) << seed;
    for (int l = 0; l < layers; ++l) {
      const MessageLayer& g = got.layers[l];
      const MessageLayer& A = ancestor.layers[l];
      const MessageLayer& S = suffix.layers[l];
      ASSERT_EQ(g.tokens(), na + ns) << seed;
      ASSERT_EQ(g.k.heads(), heads);
      ASSERT_EQ(g.k.tokens(), na + ns);
      ASSERT_EQ(g.k.dim(), dim);
      ASSERT_EQ(g.k.dtype(), dtype);
      EXPECT_FALSE(g.quant);
      for (int h = 0; h < heads; ++h) {
        for (int j = 0; j < na + ns; ++j) {
          const MessageLayer& src = j < na ? A : S;
          const int sj = j < na ? j : j - na;
          ASSERT_EQ(0, std::memcmp(g.k.row(h, j), src.k.row(h, sj), g.k.row_bytes()))
              << "seed " << seed << " layer " << l << " head " << h << " token " << j;
          ASSERT_EQ(0, std::memcmp(g.v.row(h, j), src.v.row(h, sj), g.v.row_bytes()))
              << "seed " << seed << " layer " << l << " head " << h << " token " << j;
          ASSERT_EQ(g.pos.at(h, j), src.pos.at(h, sj)) << "seed " << seed << " layer " << l << " head " << h;
        }
      }
    }
  }
}

TEST_F(ForwardTest, AChunkWithABadCrcIsDataLossAndLeavesNothing) {
  const Message msg = Offline(MakeTurn(11), "full");
  std::vector<v1::ForwardRequest> reqs = WholeForward(FwdHeader("s", "m1", "a", {"b"}, msg), msg);
  ASSERT_GT(reqs.size(), 4u);
  v1::Chunk* c = reqs[3].mutable_chunk();
  c->set_crc32c(c->crc32c() ^ 1);
  ForwardCall r = DoForward(stub_.get(), reqs);
  EXPECT_EQ(r.status.error_code(), grpc::DATA_LOSS) << r.status.error_message();
  EXPECT_FALSE(server_->store()->Find("s", "m1"));
  ExpectNothingFor("s", "b");
  EXPECT_EQ(server_->store()->Stats().mailbox_messages, 0u);
  // Data changed under a matching chunk CRC is caught by the trailer.
  reqs = WholeForward(FwdHeader("s", "m1", "a", {"b"}, msg), msg);
  c = reqs[3].mutable_chunk();
  std::string data = c->data();
  data[0] ^= 1;
  c->set_data(data);
  c->set_crc32c(Crc32c(data.data(), data.size()));
  r = DoForward(stub_.get(), reqs);
  EXPECT_EQ(r.status.error_code(), grpc::DATA_LOSS) << r.status.error_message();
  EXPECT_FALSE(server_->store()->Find("s", "m1"));
  WaitInflightZero();
  // The intact forward still commits.
  ExpectResults(DoForward(stub_.get(), WholeForward(FwdHeader("s", "m1", "a", {"b"}, msg), msg)), {{"b", 0, false}});
}

TEST_F(ForwardTest, AStreamCutBeforeTheCommitLeavesNothing) {
  const Message msg = Offline(MakeTurn(12), "full");
  std::vector<v1::ForwardRequest> reqs = WholeForward(FwdHeader("s", "m1", "a", {"b"}, msg), msg);
  reqs.pop_back();  // no commit
  ForwardCall ended = DoForward(stub_.get(), reqs);
  EXPECT_EQ(ended.status.error_code(), grpc::INVALID_ARGUMENT) << ended.status.error_message();
  EXPECT_EQ(ended.status.error_message(), "forward: stream ended before the commit, expected a commit");
  ForwardCall cut = CutForward(reqs);
  EXPECT_EQ(cut.status.error_code(), grpc::CANCELLED) << cut.status.error_message();
  std::vector<v1::ForwardRequest> half(reqs.begin(), reqs.begin() + reqs.size() / 2);
  cut = CutForward(half);
  EXPECT_EQ(cut.status.error_code(), grpc::CANCELLED) << cut.status.error_message();
  EXPECT_FALSE(server_->store()->Find("s", "m1"));
  ExpectNothingFor("s", "b");
  WaitInflightZero();
  // A retry of the whole forward commits it once.
  ExpectResults(DoForward(stub_.get(), WholeForward(FwdHeader("s", "m1", "a", {"b"}, msg), msg)), {{"b", 0, false}});
  FetchResult f = DoFetch(stub_.get(), "s", "b", /*auto_ack=*/true);
  ASSERT_TRUE(f.status.ok()) << f.status.error_message();
  ExpectSameMessage(f.msg, msg);
  ExpectNothingFor("s", "b");
}

// A forward's message header passes the rules a publish's header passes
// (ValidateQuantOptions, CheckGeometry), ranges included: a quant_group past
// int's range is refused at the header, not stored as a negative group.
// Groups of 64 over at most 64 tokens per head: the stream of a message with
// any larger group has the same sizes, so only the header check refuses it.
TEST_F(ForwardTest, QuantizationAndGeometryOutOfRangeAreRefusedAtTheHeader) {
  const Message msg = Offline(MakeTurn(14), "h2o-head:k=8+int4:group=64");
  ASSERT_TRUE(msg.layers[0].quant.has_value());
  ASSERT_LE(msg.layers[0].tokens(), 64);
  const struct {
    std::function<void(v1::ForwardHeader*)> edit;
    std::string says;
  } cases[] = {
      {[](auto* h) { h->mutable_message()->set_quant_group(uint32_t{1} << 31); },
       "header.quant_group: 2147483648, expected 1..16777216"},
      {[](auto* h) { h->mutable_message()->set_quant_group(std::numeric_limits<uint32_t>::max()); },
       "header.quant_group: 4294967295, expected 1..16777216"},
      {[](auto* h) { h->mutable_message()->set_quant_group((1u << 24) + 1); },
       "header.quant_group: 16777217, expected 1..16777216"},
      {[](auto* h) { h->mutable_message()->set_quant_group(0); }, "header.quant_group: 0, expected 1..16777216"},
      {[](auto* h) { h->mutable_message()->set_quant_bits(3); }, "header.quant_bits: 3, expected 2, 4 or 8"},
      {[](auto* h) {
         h->mutable_message()->set_quant_bits(8);
         h->mutable_message()->set_quant_rotate(true);
       },
       "header.quant_rotate=hadamard needs 4 or 2 bits, got header.quant_bits=8"},
      {[](auto* h) { h->mutable_geometry()->set_head_dim(4096); },
       "header.geometry.head_dim: 4096, expected 1..1024"},
      {[](auto* h) { h->set_requested_policy(std::string(2000, 'x')); },
       "header.requested_policy: 2000 bytes, expected at most 1024"},
  };
  for (const auto& c : cases) {
    v1::ForwardHeader h = FwdHeader("s", "m1", "a", {"b"}, msg);
    *h.mutable_geometry() = ProtoGeometry(MakeTurn(14));
    c.edit(&h);
    ForwardCall r = DoForward(stub_.get(), WholeForward(h, msg));
    EXPECT_EQ(r.status.error_code(), grpc::INVALID_ARGUMENT) << c.says << ": " << r.status.error_message();
    EXPECT_EQ(r.status.error_message(), c.says);
  }
  EXPECT_EQ(server_->store()->Find("s", "m1"), nullptr);
  EXPECT_EQ(server_->store()->Stats().sessions, 0u);
  ExpectNothingFor("s", "b");
  // The same forward, in range: committed and delivered with its group.
  v1::ForwardHeader h = FwdHeader("s", "m1", "a", {"b"}, msg);
  *h.mutable_geometry() = ProtoGeometry(MakeTurn(14));
  ExpectResults(DoForward(stub_.get(), WholeForward(h, msg)), {{"b", 0, false}});
  FetchResult f = DoFetch(stub_.get(), "s", "b", /*auto_ack=*/true);
  ASSERT_TRUE(f.status.ok()) << f.status.error_message();
  EXPECT_EQ(f.header.quant_bits(), 4u);
  EXPECT_EQ(f.header.quant_group(), 64u);
}

TEST_F(ForwardTest, AForwardOfASessionClosedHereIsFailedPrecondition) {
  const Message msg = Offline(MakeTurn(13), "full");
  const v1::ForwardHeader h = FwdHeader("s", "m1", "a", {"b"}, msg);
  ExpectResults(DoForward(stub_.get(), WholeForward(h, msg)), {{"b", 0, false}});
  ASSERT_TRUE(Close("s").ok());
  // A retry of the forward it held, and a new one: neither undoes the close.
  for (const char* id : {"m1", "m2"}) {
    ForwardCall r = DoForward(stub_.get(), WholeForward(FwdHeader("s", id, "a", {"b"}, msg), msg));
    EXPECT_EQ(r.status.error_code(), grpc::FAILED_PRECONDITION) << id << ": " << r.status.error_message();
    EXPECT_EQ(r.status.error_message(),
              "header.message.session_id: 's' was closed on this relay (CloseSession); a close is not undone by a "
              "later forward");
  }
  // Closed before anything of it arrived: refused too.
  ASSERT_TRUE(Close("early").ok());
  ForwardCall r = DoForward(stub_.get(), WholeForward(FwdHeader("early", "m1", "a", {"b"}, msg), msg));
  EXPECT_EQ(r.status.error_code(), grpc::FAILED_PRECONDITION) << r.status.error_message();
  EXPECT_EQ(server_->store()->Stats().sessions, 0u);
  ExpectNothingFor("s", "b");
}

TEST_F(ForwardTest, MessageStatusAndReportRecipientRefuseWhatIsNotHeld) {
  v1::MessageStatusResponse resp;
  grpc::Status s = Status("nosuch", "m1", &resp);
  EXPECT_EQ(s.error_code(), grpc::NOT_FOUND) << s.error_message();
  EXPECT_TRUE(absl::StartsWith(s.error_message(), "session_id: 'nosuch'")) << s.error_message();
  Turn t = MakeTurn(14);
  ASSERT_TRUE(PublishTurn(stub_.get(), Header("s", "m1", "a", {"b"}, "full", t), t).status.ok());
  s = Status("s", "nope", &resp);
  EXPECT_EQ(s.error_code(), grpc::NOT_FOUND) << s.error_message();
  EXPECT_TRUE(absl::StartsWith(s.error_message(), "message_id: 'nope'")) << s.error_message();
  s = Status("s", "bad id", &resp);
  EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT) << s.error_message();
  EXPECT_TRUE(absl::StartsWith(s.error_message(), "message_id: 'bad id'")) << s.error_message();

  s = Report("s", "m1", "b", v1::RECIPIENT_STATE_QUEUED);
  EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT) << s.error_message();
  EXPECT_EQ(s.error_message(),
            "state: RECIPIENT_STATE_QUEUED, expected RECIPIENT_STATE_DELIVERED or RECIPIENT_STATE_ACKED");
  for (v1::RecipientState bad : {v1::RECIPIENT_STATE_UNSPECIFIED, v1::RECIPIENT_STATE_COMMITTED,
                                 v1::RECIPIENT_STATE_DEAD_LETTERED}) {
    EXPECT_EQ(Report("s", "m1", "b", bad).error_code(), grpc::INVALID_ARGUMENT) << v1::RecipientState_Name(bad);
  }
  s = Report("s", "nope", "b", v1::RECIPIENT_STATE_DELIVERED);
  EXPECT_EQ(s.error_code(), grpc::NOT_FOUND) << s.error_message();
  EXPECT_TRUE(absl::StartsWith(s.error_message(), "message_id: 'nope'")) << s.error_message();
  // b's mailbox is here: only a relay of a remote recipient reports.
  s = Report("s", "m1", "b", v1::RECIPIENT_STATE_DELIVERED);
  EXPECT_EQ(s.error_code(), grpc::NOT_FOUND) << s.error_message();
  EXPECT_EQ(s.error_message(), "agent: 'b': not a recipient of message 'm1' on another relay");
  s = Report("s", "m1", "z", v1::RECIPIENT_STATE_ACKED);
  EXPECT_EQ(s.error_code(), grpc::NOT_FOUND) << s.error_message();
  ASSERT_TRUE(Status("s", "m1", &resp).ok());
  ASSERT_EQ(resp.recipients_size(), 1);
  EXPECT_EQ(resp.recipients(0).state(), v1::RECIPIENT_STATE_COMMITTED) << "a refused report changes nothing";
}

TEST_F(ForwardTest, MessageStatusFollowsALocalRecipient) {
  Turn t = MakeTurn(15);
  ASSERT_TRUE(PublishTurn(stub_.get(), Header("s", "m1", "a", {"b", "c"}, "full", t), t).status.ok());
  v1::MessageStatusResponse resp;
  ASSERT_TRUE(Status("s", "m1", &resp).ok());
  EXPECT_EQ(resp.sender(), "a");
  ASSERT_EQ(resp.recipients_size(), 2);
  EXPECT_EQ(resp.recipients(0).agent(), "b");
  EXPECT_EQ(resp.recipients(0).state(), v1::RECIPIENT_STATE_COMMITTED);
  EXPECT_EQ(resp.recipients(0).relay(), "");
  EXPECT_EQ(resp.recipients(1).agent(), "c");
  ASSERT_TRUE(DoFetch(stub_.get(), "s", "b", /*auto_ack=*/false).status.ok());
  ASSERT_TRUE(Status("s", "m1", &resp).ok());
  EXPECT_EQ(resp.recipients(0).state(), v1::RECIPIENT_STATE_DELIVERED);
  EXPECT_EQ(resp.recipients(1).state(), v1::RECIPIENT_STATE_COMMITTED);
  ASSERT_TRUE(Ack("s", "b", "m1").ok());
  ASSERT_TRUE(Status("s", "m1", &resp).ok());
  EXPECT_EQ(resp.recipients(0).state(), v1::RECIPIENT_STATE_ACKED);
  EXPECT_EQ(resp.recipients(1).state(), v1::RECIPIENT_STATE_COMMITTED);
}

// A recipient routed to a relay that is down stays queued with the reason;
// the destination's reports move it on, and later retries do not move it back.
TEST_F(ForwardTest, ReportsOfARemoteRecipientMoveItsStatusForwardOnly) {
  FakeTimeSource& clock = clock_;
  ServerConfig cfg;
  cfg.routes = {{"far", "127.0.0.1:1"}};
  cfg.forward_timeout_seconds = 60;
  StartServer(cfg, &clock);
  Turn t = MakeTurn(16);
  ASSERT_TRUE(PublishTurn(stub_.get(), Header("s", "m1", "a", {"near", "far"}, "full", t), t).status.ok());
  v1::MessageStatusResponse resp;
  // Wait for a failed attempt against the dead relay.
  EXPECT_TRUE(Eventually([&] {
    return Status("s", "m1", &resp).ok() && resp.recipients_size() == 2 && resp.recipients(1).attempts() > 0 &&
           !resp.recipients(1).reason().empty();
  })) << "no failed attempt recorded";
  ASSERT_TRUE(Status("s", "m1", &resp).ok());
  ASSERT_EQ(resp.recipients_size(), 2);
  EXPECT_EQ(resp.recipients(0).agent(), "near");
  EXPECT_EQ(resp.recipients(0).state(), v1::RECIPIENT_STATE_COMMITTED);
  EXPECT_EQ(resp.recipients(1).agent(), "far");
  EXPECT_EQ(resp.recipients(1).state(), v1::RECIPIENT_STATE_QUEUED);
  EXPECT_EQ(resp.recipients(1).relay(), "127.0.0.1:1");
  EXPECT_GE(resp.recipients(1).attempts(), 1u);
  EXPECT_TRUE(absl::StartsWith(resp.recipients(1).reason(), "UNAVAILABLE: ")) << resp.recipients(1).reason();

  ASSERT_TRUE(Report("s", "m1", "far", v1::RECIPIENT_STATE_DELIVERED).ok());
  ASSERT_TRUE(Status("s", "m1", &resp).ok());
  EXPECT_EQ(resp.recipients(1).state(), v1::RECIPIENT_STATE_DELIVERED);
  EXPECT_EQ(resp.recipients(1).relay(), "127.0.0.1:1");
  ASSERT_TRUE(Report("s", "m1", "far", v1::RECIPIENT_STATE_ACKED).ok());
  ASSERT_TRUE(Report("s", "m1", "far", v1::RECIPIENT_STATE_DELIVERED).ok());  // late, out of order
  // Two more failed attempts meanwhile.
  const double retries = Retries();
  ASSERT_TRUE(FireTimersUntil(&clock, [&] { return Retries() >= retries + 2; })) << "no retries";
  ASSERT_TRUE(Status("s", "m1", &resp).ok());
  EXPECT_EQ(resp.recipients(1).state(), v1::RECIPIENT_STATE_ACKED);
  EXPECT_EQ(resp.recipients(0).state(), v1::RECIPIENT_STATE_COMMITTED);
}


// A relay that never answers dead-letters its recipients after the forward
// timeout, with the reason; one the destination reported acked meanwhile
// (its answer to the forward was lost) stays acked.
TEST_F(ForwardTest, ADeadLetterDoesNotUndoADestinationsReport) {
  ServerConfig cfg;
  cfg.routes = {{"far", "127.0.0.1:1"}, {"far2", "127.0.0.1:1"}};
  cfg.forward_timeout_seconds = 1;
  StartServer(cfg);
  Turn t = MakeTurn(17);
  ASSERT_TRUE(PublishTurn(stub_.get(), Header("s", "m1", "a", {"far", "far2"}, "full", t), t).status.ok());
  ASSERT_TRUE(Report("s", "m1", "far2", v1::RECIPIENT_STATE_ACKED).ok());
  Eventually([&] { return CounterSum(server_->metrics(), "kvrelay_dead_letters_total") >= 2; });
  EXPECT_EQ(CounterSum(server_->metrics(), "kvrelay_dead_letters_total"), 2);
  v1::MessageStatusResponse resp;
  ASSERT_TRUE(Status("s", "m1", &resp).ok());
  ASSERT_EQ(resp.recipients_size(), 2);
  EXPECT_EQ(resp.recipients(0).agent(), "far");
  EXPECT_EQ(resp.recipients(0).state(), v1::RECIPIENT_STATE_DEAD_LETTERED);
  EXPECT_TRUE(absl::StartsWith(resp.recipients(0).reason(), "DEADLINE_EXCEEDED: gave up after "))
      << resp.recipients(0).reason();
  EXPECT_TRUE(absl::StrContains(resp.recipients(0).reason(), "last: UNAVAILABLE: ")) << resp.recipients(0).reason();
  EXPECT_GE(resp.recipients(0).attempts(), 1u);
  EXPECT_EQ(resp.recipients(0).relay(), "127.0.0.1:1");
  EXPECT_EQ(resp.recipients(1).agent(), "far2");
  EXPECT_EQ(resp.recipients(1).state(), v1::RECIPIENT_STATE_ACKED) << resp.recipients(1).reason();
}

// A forward whose first attempt fails before the publish commits (the
// destination is down) is retried once the message is committed, not
// dropped as if its session were gone.
TEST_F(ForwardTest, AFailureBeforeTheCommitIsRetriedAfterIt) {
  FakeTimeSource& clock = clock_;
  ServerConfig cfg;
  cfg.routes = {{"far", "127.0.0.1:1"}};
  cfg.forward_timeout_seconds = 60;
  StartServer(cfg, &clock);
  Turn t0 = MakeTurn(20);
  ASSERT_TRUE(PublishTurn(stub_.get(), Header("s", "m0", "a", {"near"}, "full", t0), t0).status.ok());
  Turn t = MakeTurn(21);
  auto chunks = TurnChunks(t);
  auto reqs = PublishStream(Header("s", "m1", "a", {"near", "far"}, "full", t), chunks, TrailerOf(chunks));
  PublishResult r;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(30));
    auto writer = stub_->Publish(&ctx, &r.response);
    ASSERT_TRUE(writer->Write(reqs[0]));
    // The first attempt fails against the dead relay before the commit, and
    // then waits for the publish's outcome.
    Forwarder* forwarder = server_->service()->context()->forwarder();
    ASSERT_TRUE(Eventually([&] { return forwarder->attempts_awaiting_outcome() == 1; }))
        << "the first attempt did not end before the commit";
    for (size_t i = 1; i < reqs.size(); ++i) ASSERT_TRUE(writer->Write(reqs[i]));
    writer->WritesDone();
    r.status = writer->Finish();
  }
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  v1::MessageStatusResponse resp;
  ASSERT_TRUE(Status("s", "m1", &resp).ok());
  const uint32_t a0 = resp.recipients(1).attempts();
  ASSERT_TRUE(FireTimersUntil(&clock, [&] { return AttemptsOf("s", "m1", 1) > a0; }))
      << "no retry after the commit: the forward was dropped";
  ASSERT_TRUE(Status("s", "m1", &resp).ok());
  EXPECT_EQ(resp.recipients(1).state(), v1::RECIPIENT_STATE_QUEUED);
  EXPECT_GT(resp.recipients(1).attempts(), a0) << "no retry after the commit: the forward was dropped";
  EXPECT_TRUE(absl::StartsWith(resp.recipients(1).reason(), "UNAVAILABLE: ")) << resp.recipients(1).reason();
}

// A committed message waiting in the outbox holds its retained bytes, not
// the upload's in-flight reservation: one dead peer cannot use up
// --max-inflight-bytes for everyone.
TEST_F(ForwardTest, AQueuedForwardHoldsNoUploadReservation) {
  ServerConfig cfg;
  cfg.routes = {{"far", "127.0.0.1:1"}};
  cfg.forward_timeout_seconds = 60;
  StartServer(cfg);
  Turn t = MakeTurn(22);
  ASSERT_TRUE(PublishTurn(stub_.get(), Header("s", "m1", "a", {"far"}, "full", t), t).status.ok());
  Eventually([&] { return server_->store()->inflight_bytes() == 0; });
  EXPECT_EQ(server_->store()->inflight_bytes(), 0u);
  v1::MessageStatusResponse resp;
  ASSERT_TRUE(Status("s", "m1", &resp).ok());
  EXPECT_EQ(resp.recipients(0).state(), v1::RECIPIENT_STATE_QUEUED);
}

}  // namespace
}  // namespace kvrelay
