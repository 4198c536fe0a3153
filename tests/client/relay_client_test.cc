// RelayClient against an in-process fake relay (sync gRPC service built from
// core/): publish with retries, fetch, ack, compress, stats and health over a
// real channel, without kvrelay-server; the token's metadata on every call
// (seen by a server interceptor) and ConnectOptions' checks. The real server
// is exercised by tests/client/test_relay_e2e.py, and over TLS with tokens by
// tests/client/test_kvrelayctl.py.
#include "client/relay_client.h"
#include "core/message_id.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <unistd.h>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "core/crc32c.h"
#include "core/format/synthetic.h"
#include "core/format/turn_file.h"
#include "core/pipeline.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/support/server_interceptor.h"
#include "tests/testlib/eventually.h"
#include "gtest/gtest.h"
#include "proto/status_util.h"
#include "proto/stream_codec.h"
#include "proto/wire.h"

namespace kvrelay {
namespace {

using ::testing::HasSubstr;

// Rebuilds a turn from an upload's geometry and chunks (no validation beyond
// what the test needs: the client under test is what is checked).
class TurnBuilder {
 public:
  void Start(const v1::TurnGeometry& g) {
    turn_.first_agent = g.first_agent();
    if (g.has_prompt_pos0()) turn_.prompt_pos0 = g.prompt_pos0();
    const DType dt = *FromProtoDType(g.dtype());
    const int H = g.kv_heads(), d = g.head_dim();
    turn_.layers.resize(g.layers());
    for (TurnLayer& l : turn_.layers) {
      l.prompt_k = l.prompt_v = KvTensor(dt, H, g.n_prompt(), d);
      l.gen_k = l.gen_v = KvTensor(dt, H, g.n_gen(), d);
      l.history_k = l.history_v = KvTensor(dt, H, g.n_history(), d);
      l.history_pos = PosTensor(H, g.n_history());
      l.scores = ScoreMatrix(g.score_heads(), g.n_prompt());
    }
  }
  bool Add(const v1::Chunk& c) {
    if (Crc32c(c.data().data(), c.data().size()) != c.crc32c()) return false;
    trailer_.Add(c);
    TurnLayer& l = turn_.layers.at(c.layer());
    uint8_t* dst = nullptr;
    switch (c.part()) {
      case v1::PART_PROMPT_K: dst = l.prompt_k.mutable_bytes().data(); break;
      case v1::PART_PROMPT_V: dst = l.prompt_v.mutable_bytes().data(); break;
      case v1::PART_GEN_K: dst = l.gen_k.mutable_bytes().data(); break;
      case v1::PART_GEN_V: dst = l.gen_v.mutable_bytes().data(); break;
      case v1::PART_PROMPT_SCORE: dst = reinterpret_cast<uint8_t*>(l.scores.data.data()); break;
      case v1::PART_HISTORY_K: dst = l.history_k.mutable_bytes().data(); break;
      case v1::PART_HISTORY_V: dst = l.history_v.mutable_bytes().data(); break;
      case v1::PART_HISTORY_POS: dst = reinterpret_cast<uint8_t*>(l.history_pos.data.data()); break;
      default: return false;
    }
    std::memcpy(dst + c.offset(), c.data().data(), c.data().size());
    return true;
  }
  bool TrailerMatches(const v1::Trailer& t) const {
    v1::Trailer mine = trailer_.Build();
    return mine.chunks() == t.chunks() && mine.bytes() == t.bytes() && mine.crc32c() == t.crc32c();
  }
  Turn& turn() { return turn_; }

 private:
  Turn turn_;
  TrailerBuilder trailer_;
};

template <typename Writer, typename Response>
void SendMessage(const Message& m, const v1::MessageHeader& header, Writer* w, bool corrupt) {
  Response r;
  *r.mutable_header() = header;
  w->Write(r);
  TrailerBuilder tb;
  for (const TensorRef& t : MessageDeliveryOrder(m)) {
    (void)ForEachChunk(t, kMaxChunkBytes, r.mutable_chunk(),
                                        [&](const v1::Chunk& c) {
                                          tb.Add(c);
                                          if (corrupt) r.mutable_chunk()->set_crc32c(c.crc32c() ^ 1);
                                          w->Write(r);
                                          return absl::OkStatus();
                                        });
  }
  *r.mutable_trailer() = tb.Build();
  w->Write(r);
}

class FakeRelay final : public v1::Relay::Service {
 public:
  std::atomic<int> fail_publishes{0};  // answer UNAVAILABLE this many times
  std::atomic<int> publish_calls{0};
  std::atomic<bool> corrupt_fetch{false};

  grpc::Status Publish(grpc::ServerContext*, grpc::ServerReader<v1::PublishRequest>* reader,
                       v1::PublishResponse* resp) override {
    ++publish_calls;
    v1::PublishRequest req;
    if (!reader->Read(&req) || !req.has_header()) return {grpc::INVALID_ARGUMENT, "header"};
    const v1::PublishHeader h = req.header();
    {
      // Like the real relay: a committed id is answered from the header,
      // without reading the rest of the upload.
      std::lock_guard<std::mutex> lock(mu_);
      if (stored_.count(h.message_id()) && fail_publishes == 0) {
        resp->set_message_id(h.message_id());
        resp->set_duplicate(true);
        *resp->mutable_accounting() = stored_[h.message_id()].accounting();
        return grpc::Status::OK;
      }
    }
    TurnBuilder b;
    b.Start(h.geometry());
    bool committed = false;
    while (reader->Read(&req)) {
      if (req.has_chunk() && !b.Add(req.chunk())) return {grpc::DATA_LOSS, "chunk crc"};
      if (req.has_commit()) {
        if (!b.TrailerMatches(req.commit())) return {grpc::DATA_LOSS, "trailer"};
        committed = true;
      }
    }
    if (!committed) return {grpc::INVALID_ARGUMENT, "no commit"};
    if (fail_publishes > 0) {
      --fail_publishes;
      return {grpc::UNAVAILABLE, "try again"};
    }
    std::lock_guard<std::mutex> lock(mu_);
    resp->set_message_id(h.message_id());
    if (stored_.count(h.message_id())) {
      resp->set_duplicate(true);
      *resp->mutable_accounting() = stored_[h.message_id()].accounting();
      return grpc::Status::OK;
    }
    auto p = Pipeline::Create(h.policy().empty() ? "full" : h.policy());
    if (!p.ok()) return ToGrpcStatus(p.status());
    absl::StatusOr<Message> m = (*p)->Compress(b.turn());
    if (!m.ok()) return ToGrpcStatus(m.status());
    v1::MessageHeader mh = MessageHeaderOf(*m);
    mh.set_message_id(h.message_id());
    mh.set_session_id(h.session_id());
    mh.set_sender(h.sender());
    mh.set_role(h.role());
    mh.mutable_accounting()->set_received_bytes(b.turn().layers.size());
    *resp->mutable_accounting() = mh.accounting();
    stored_[h.message_id()] = mh;
    for (const std::string& r : h.recipients()) queue_[r].push_back(h.message_id());
    messages_[h.message_id()] = *std::move(m);
    return grpc::Status::OK;
  }

  grpc::Status Fetch(grpc::ServerContext*, const v1::FetchRequest* req,
                     grpc::ServerWriter<v1::FetchResponse>* w) override {
    std::unique_lock<std::mutex> lock(mu_);
    auto& q = queue_[req->agent()];
    if (q.empty()) return {grpc::DEADLINE_EXCEEDED, "no message"};
    const std::string id = q.front();
    v1::MessageHeader h = stored_[id];
    h.set_delivery_attempt(++attempts_[req->agent() + "/" + id]);
    const Message& m = messages_[id];
    lock.unlock();
    SendMessage<grpc::ServerWriter<v1::FetchResponse>, v1::FetchResponse>(m, h, w, corrupt_fetch);
    return grpc::Status::OK;
  }

  grpc::Status Ack(grpc::ServerContext*, const v1::AckRequest* req, v1::AckResponse*) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto& q = queue_[req->agent()];
    if (q.empty() || q.front() != req->message_id()) return {grpc::NOT_FOUND, "unknown message"};
    q.erase(q.begin());
    return grpc::Status::OK;
  }

  grpc::Status Compress(grpc::ServerContext*,
                        grpc::ServerReaderWriter<v1::CompressResponse, v1::CompressRequest>* s) override {
    v1::CompressRequest req;
    if (!s->Read(&req) || !req.has_header()) return {grpc::INVALID_ARGUMENT, "header"};
    const std::string policy = req.header().policy();
    TurnBuilder b;
    b.Start(req.header().geometry());
    while (s->Read(&req)) {
      if (req.has_chunk() && !b.Add(req.chunk())) return {grpc::DATA_LOSS, "chunk crc"};
    }
    auto p = Pipeline::Create(policy);
    if (!p.ok()) return ToGrpcStatus(p.status());
    absl::StatusOr<Message> m = (*p)->Compress(b.turn());
    if (!m.ok()) return ToGrpcStatus(m.status());
    SendMessage<grpc::ServerReaderWriter<v1::CompressResponse, v1::CompressRequest>, v1::CompressResponse>(*m, MessageHeaderOf(*m), s, false);
    return grpc::Status::OK;
  }

  // Answers `status_reply` for (status_session, status_id), NOT_FOUND otherwise.
  std::atomic<int> status_calls{0};
  std::string status_session, status_id;
  v1::MessageStatusResponse status_reply;
  grpc::Status MessageStatus(grpc::ServerContext*, const v1::MessageStatusRequest* req,
                             v1::MessageStatusResponse* resp) override {
    ++status_calls;
    if (req->session_id() != status_session || req->message_id() != status_id) {
      return {grpc::NOT_FOUND, absl::StrCat("message ", req->message_id(), " of session ", req->session_id())};
    }
    *resp = status_reply;
    return grpc::Status::OK;
  }

  grpc::Status Stats(grpc::ServerContext*, const v1::StatsRequest*, v1::StatsResponse* r) override {
    std::lock_guard<std::mutex> lock(mu_);
    r->set_messages_committed(stored_.size());
    r->set_version("fake");
    return grpc::Status::OK;
  }

 private:
  std::mutex mu_;
  std::map<std::string, v1::MessageHeader> stored_;
  std::map<std::string, Message> messages_;
  std::map<std::string, std::vector<std::string>> queue_;
  std::map<std::string, uint32_t> attempts_;
};

// The "authorization" metadata of every call the server received, by
// method, in arrival order (a call without it records "<none>").
class AuthRecorder {
 public:
  void Add(std::string method, std::string value) {
    std::lock_guard<std::mutex> lock(mu_);
    seen_.emplace_back(std::move(method), std::move(value));
  }
  std::vector<std::pair<std::string, std::string>> Take() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::move(seen_);
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<std::string, std::string>> seen_;
};

class AuthInterceptor : public grpc::experimental::Interceptor {
 public:
  AuthInterceptor(grpc::experimental::ServerRpcInfo* info, AuthRecorder* rec) : info_(info), rec_(rec) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      std::string value = "<none>";
      int n = 0;
      for (const auto& [k, v] : *methods->GetRecvInitialMetadata()) {
        if (k == "authorization") {
          value = ++n == 1 ? std::string(v.data(), v.size()) : "<twice>";
        }
      }
      rec_->Add(info_->method(), value);
    }
    methods->Proceed();
  }

 private:
  grpc::experimental::ServerRpcInfo* info_;
  AuthRecorder* rec_;
};

class AuthInterceptorFactory : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit AuthInterceptorFactory(AuthRecorder* rec) : rec_(rec) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override {
    return new AuthInterceptor(info, rec_);
  }

 private:
  AuthRecorder* rec_;
};

class RelayClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(&relay_);
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
    interceptors.push_back(std::make_unique<AuthInterceptorFactory>(&auth_));
    b.experimental().SetInterceptorCreators(std::move(interceptors));
    server_ = b.BuildAndStart();
    ASSERT_TRUE(server_ != nullptr);
    addr_ = absl::StrCat("127.0.0.1:", port);
    client_ = RelayClient::Connect(addr_);

    SyntheticTurnOptions o;
    o.layers = 2;
    o.kv_heads = 2;
    o.score_heads = 4;
    o.head_dim = 64;
    o.n_prompt = 3000;  // > 1 MiB per K tensor: several chunks
    o.n_gen = 5;
    turn_ = *MakeSyntheticTurn(o);
    opts_.session = "s1";
    opts_.sender = "a";
    opts_.recipients = {"b"};
  }
  void TearDown() override { server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5)); }

  // As an agent receives it: without acc (relay-side state).
  static std::string Bytes(const Message& m) {
    Message delivered = m;
    for (MessageLayer& l : delivered.layers) l.acc.clear();
    std::string out;
    EXPECT_TRUE(WriteMessage(delivered, &out).ok());
    return out;
  }
  Message Offline(const std::string& policy) { return *(*Pipeline::Create(policy))->Compress(turn_); }

  FakeRelay relay_;
  AuthRecorder auth_;
  std::unique_ptr<grpc::Server> server_;
  std::string addr_;
  std::unique_ptr<RelayClient> client_;
  Turn turn_;
  PublishOptions opts_;
};

TEST_F(RelayClientTest, PublishFetchAckRoundTripIsBitExact) {
  for (const std::string policy : {"full", "h2o-head:k=32+int4"}) {
    opts_.policy = policy;
    uint64_t last_done = 0, total = 0;
    opts_.progress = [&](const TransferProgress& p) {
      EXPECT_GE(p.bytes_done, last_done);
      last_done = p.bytes_done;
      total = p.bytes_total;
    };
    absl::StatusOr<PublishResult> r = client_->Publish(turn_, opts_);
    ASSERT_TRUE(r.ok()) << r.status();
    // A fresh id from the CSPRNG (core/message_id.h): "m-" and 32 hex digits.
    EXPECT_EQ(r->message_id.rfind("m-", 0), 0u) << r->message_id;
    EXPECT_EQ(r->message_id.size(), kMessageIdLength) << r->message_id;
    EXPECT_EQ(r->attempts, 1);
    EXPECT_EQ(last_done, total);
    EXPECT_GT(total, 2u << 20);

    FetchOptions f;
    f.session = "s1";
    f.agent = "b";
    absl::StatusOr<FetchedMessage> m = client_->Fetch(f);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(m->message_id, r->message_id);
    EXPECT_EQ(m->sender, "a");
    EXPECT_EQ(m->delivery_attempt, 1u);
    EXPECT_EQ(Bytes(m->message), Bytes(Offline(policy))) << policy;
    // Redelivered until acked.
    absl::StatusOr<FetchedMessage> again = client_->Fetch(f);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->delivery_attempt, 2u);
    ASSERT_TRUE(client_->Ack("s1", "b", m->message_id).ok());
    EXPECT_EQ(client_->Fetch(f).status().code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_EQ(client_->Ack("s1", "b", m->message_id).code(), absl::StatusCode::kNotFound);
  }
}

// The shared-turn Publish sends the tensors without copying them; the result
// is the same message, retries resend the same bytes, and the client lets go
// of the turn once gRPC is done with it.
TEST_F(RelayClientTest, SharedTurnPublishIsTheSameMessageAndReleasesTheTurn) {
  opts_.policy = "h2o-head:k=32+obf:p=4";
  opts_.message_id = "shared";
  opts_.initial_backoff = std::chrono::milliseconds(1);
  relay_.fail_publishes = 1;  // one retry: the second attempt re-sends from the turn
  auto turn = std::make_shared<const Turn>(turn_);
  std::weak_ptr<const Turn> watch = turn;
  absl::StatusOr<PublishResult> r = client_->Publish(std::move(turn), opts_);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->attempts, 2);
  Eventually([&] { return watch.expired(); });
  EXPECT_TRUE(watch.expired()) << "the client still holds the turn";
  FetchOptions f;
  f.session = "s1";
  f.agent = "b";
  absl::StatusOr<FetchedMessage> m = client_->Fetch(f);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(Bytes(m->message), Bytes(Offline(opts_.policy)));
  EXPECT_EQ(client_->Publish(std::shared_ptr<const Turn>(), opts_).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(RelayClientTest, RetriesUnavailableWithTheSameId) {
  relay_.fail_publishes = 2;
  opts_.message_id = "fixed";
  opts_.initial_backoff = std::chrono::milliseconds(1);
  absl::StatusOr<PublishResult> r = client_->Publish(turn_, opts_);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->attempts, 3);
  EXPECT_EQ(r->message_id, "fixed");
  EXPECT_FALSE(r->duplicate);
  absl::StatusOr<PublishResult> dup = client_->Publish(turn_, opts_);
  ASSERT_TRUE(dup.ok());
  EXPECT_TRUE(dup->duplicate);
}

TEST_F(RelayClientTest, RepublishOfALargeTurnIsADuplicateWhenTheRelayStopsReading) {
  // 4 MB: more than gRPC buffers, so the writes after the header fail once
  // the relay has answered from the header.
  SyntheticTurnOptions o;
  o.layers = 2;
  o.kv_heads = 4;
  o.head_dim = 128;
  o.n_prompt = 1000;
  o.n_gen = 8;
  o.seed = 9;
  const Turn big = *MakeSyntheticTurn(o);
  opts_.message_id = "big";
  opts_.policy = "h2o-head:k=8";
  ASSERT_TRUE(client_->Publish(big, opts_).ok());
  absl::StatusOr<PublishResult> dup = client_->Publish(big, opts_);
  ASSERT_TRUE(dup.ok()) << dup.status();
  EXPECT_TRUE(dup->duplicate);
  EXPECT_EQ(dup->message_id, "big");
}

TEST_F(RelayClientTest, RetriesAreBounded) {
  relay_.fail_publishes = 10;
  opts_.retries = 2;
  opts_.initial_backoff = std::chrono::milliseconds(1);
  int retried = 0;
  opts_.on_retry = [&](int attempt, const absl::Status& s) {
    EXPECT_EQ(attempt, ++retried);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  };
  absl::StatusOr<PublishResult> r = client_->Publish(turn_, opts_);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(relay_.publish_calls.load(), 3);
  EXPECT_EQ(retried, 2) << "on_retry runs before each retry, not after the last attempt";
  opts_.on_retry = nullptr;
  // The error names the generated id, so that the caller can retry with it.
  const auto id = r.status().GetPayload(kMessageIdPayload);
  ASSERT_TRUE(id.has_value()) << r.status();
  EXPECT_EQ(std::string(*id).rfind("m-", 0), 0u) << *id;
  EXPECT_NE(r.status().message().find(absl::StrCat("(message_id ", std::string(*id), ")")), absl::string_view::npos)
      << r.status();
  opts_.message_id = "chosen";
  r = client_->Publish(turn_, opts_);
  ASSERT_TRUE(r.status().GetPayload(kMessageIdPayload).has_value());
  EXPECT_EQ(std::string(*r.status().GetPayload(kMessageIdPayload)), "chosen");
}

// A one-layer turn of a few tokens, and options routing it from a to b.
Turn TinyTurn() {
  SyntheticTurnOptions o;
  o.layers = 1;
  o.kv_heads = 1;
  o.score_heads = 1;
  o.head_dim = 16;
  o.n_prompt = 32;
  o.n_gen = 2;
  return *MakeSyntheticTurn(o);
}

PublishOptions TinyRoute() {
  PublishOptions opts;
  opts.session = "s";
  opts.sender = "a";
  opts.recipients = {"b"};
  return opts;
}

// A relay that starts listening after a publish's first attempt failed (a
// restart) is reached by the retries: the channel tries to reconnect at
// each retry instead of waiting out gRPC's own reconnect backoff (1 s and
// growing).
TEST(RelayClientRestart, RetriesReachARelayThatComesBack) {
  int port = 0;
  {
    FakeRelay idle;
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(&idle);
    std::unique_ptr<grpc::Server> probe = b.BuildAndStart();
    ASSERT_TRUE(probe != nullptr);
    probe->Shutdown();
  }
  const std::string addr = absl::StrCat("127.0.0.1:", port);
  auto client = RelayClient::Connect(addr);
  const Turn turn = TinyTurn();
  PublishOptions opts = TinyRoute();
  opts.retries = 3;  // backoff 0.1, 0.2, 0.4 s
  FakeRelay relay;
  std::unique_ptr<grpc::Server> server;
  std::vector<absl::StatusCode> failed;  // the attempts that failed, in order
  opts.on_retry = [&](int attempt, const absl::Status& s) {
    failed.push_back(s.code());
    if (attempt > 1) return;
    grpc::ServerBuilder b;
    b.AddListeningPort(addr, grpc::InsecureServerCredentials());
    b.RegisterService(&relay);
    server = b.BuildAndStart();
  };
  absl::StatusOr<PublishResult> r = client->Publish(turn, opts);
  ASSERT_FALSE(failed.empty()) << "the first attempt did not fail: no relay was down";
  EXPECT_EQ(failed[0], absl::StatusCode::kUnavailable);
  ASSERT_TRUE(server != nullptr);
  EXPECT_TRUE(r.ok()) << r.status();
  if (r.ok()) {
    EXPECT_GE(r->attempts, 2);
    EXPECT_EQ(r->attempts, static_cast<int>(failed.size()) + 1) << "on_retry is called once per failed attempt";
  }
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

TEST_F(RelayClientTest, NoRetryOnOtherErrors) {
  opts_.policy = "bogus";
  EXPECT_EQ(client_->Publish(turn_, opts_).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(relay_.publish_calls.load(), 1);
}

TEST_F(RelayClientTest, CorruptDeliveryIsDataLoss) {
  ASSERT_TRUE(client_->Publish(turn_, opts_).ok());
  relay_.corrupt_fetch = true;
  FetchOptions f;
  f.session = "s1";
  f.agent = "b";
  absl::Status s = client_->Fetch(f).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
}

TEST_F(RelayClientTest, BadOptionsFailBeforeTheCall) {
  PublishOptions o = opts_;
  o.recipients.clear();
  EXPECT_THAT(client_->Publish(turn_, o).status().message(), HasSubstr("recipients"));
  o = opts_;
  o.session = "";
  EXPECT_THAT(client_->Publish(turn_, o).status().message(), HasSubstr("session: empty"));
  o = opts_;
  o.sender = "a b";
  EXPECT_THAT(client_->Publish(turn_, o).status().message(), HasSubstr("sender: 'a b'"));
  SyntheticTurnOptions h;
  h.n_history = 4;
  o = opts_;
  o.parent_id = "p";
  EXPECT_THAT(client_->Publish(*MakeSyntheticTurn(h), o).status().message(), HasSubstr("n_history"));
  EXPECT_EQ(relay_.publish_calls.load(), 0);
}

TEST_F(RelayClientTest, CompressMatchesOffline) {
  absl::StatusOr<CompressedMessage> m = client_->Compress(turn_, "h2o-head:k=16+obf:p=4");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(Bytes(m->message), Bytes(Offline("h2o-head:k=16+obf:p=4")));
  EXPECT_EQ(client_->Compress(turn_, "nope").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(RelayClientTest, HealthAndStats) {
  absl::StatusOr<HealthStatus> h = client_->Health();
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(*h, HealthStatus::kServing);
  server_->GetHealthCheckService()->SetServingStatus(false);
  EXPECT_EQ(*client_->Health(), HealthStatus::kNotServing);
  // Check answers NOT_FOUND for an unknown service: reported as such.
  absl::StatusOr<HealthStatus> unknown = client_->Health("no.such.Service");
  ASSERT_TRUE(unknown.ok()) << unknown.status();
  EXPECT_EQ(*unknown, HealthStatus::kServiceUnknown);
  absl::StatusOr<RelayStats> s = client_->Stats();
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->version, "fake");
}

TEST_F(RelayClientTest, MessageStatusMapsEveryRecipient) {
  relay_.status_session = "s1";
  relay_.status_id = "m-1";
  v1::MessageStatusResponse& r = relay_.status_reply;
  r.set_sender("planner");
  const struct {
    const char* agent;
    int state;
    const char* relay;
    const char* reason;
    uint32_t attempts;
  } rows[] = {
      {"critic", v1::RECIPIENT_STATE_COMMITTED, "", "", 0},
      {"refiner", v1::RECIPIENT_STATE_QUEUED, "10.0.0.2:50051", "UNAVAILABLE: connection refused", 3},
      {"judger", v1::RECIPIENT_STATE_DEAD_LETTERED, "dns:///judger:50051", "ALREADY_EXISTS: \"x\" differs", 1},
      {"d", v1::RECIPIENT_STATE_DELIVERED, "", "", 0},
      {"e", v1::RECIPIENT_STATE_ACKED, "h:1", "", 2},
      {"f", v1::RECIPIENT_STATE_UNSPECIFIED, "", "", 0},
      {"g", 99, "", "", 0},  // a state from a newer relay
  };
  for (const auto& row : rows) {
    v1::RecipientStatus* s = r.add_recipients();
    s->set_agent(row.agent);
    s->set_state(static_cast<v1::RecipientState>(row.state));
    s->set_relay(row.relay);
    s->set_reason(row.reason);
    s->set_attempts(row.attempts);
  }
  absl::StatusOr<MessageStatusResult> m = client_->MessageStatus("s1", "m-1");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->sender, "planner");
  ASSERT_EQ(m->recipients.size(), std::size(rows));
  const RecipientState want[] = {RecipientState::kCommitted, RecipientState::kQueued,
                                 RecipientState::kDeadLettered, RecipientState::kDelivered,
                                 RecipientState::kAcked, RecipientState::kUnspecified,
                                 RecipientState::kUnspecified};
  for (size_t i = 0; i < std::size(rows); ++i) {
    const RecipientStatus& got = m->recipients[i];
    EXPECT_EQ(got.agent, rows[i].agent) << i;
    EXPECT_EQ(got.state, want[i]) << i;
    EXPECT_EQ(got.relay, rows[i].relay) << i;
    EXPECT_EQ(got.reason, rows[i].reason) << i;
    EXPECT_EQ(got.attempts, rows[i].attempts) << i;
  }
  absl::Status missing = client_->MessageStatus("s1", "m-2").status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound) << missing;
  EXPECT_THAT(missing.message(), HasSubstr("m-2"));
  EXPECT_EQ(relay_.status_calls.load(), 2);
}

TEST_F(RelayClientTest, MessageStatusChecksItsArgumentsBeforeTheCall) {
  EXPECT_THAT(client_->MessageStatus("", "m-1").status().message(), HasSubstr("session: empty"));
  EXPECT_THAT(client_->MessageStatus("s1", "").status().message(), HasSubstr("message_id: empty"));
  absl::Status bad = client_->MessageStatus("s 1", "m-1").status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("session: 's 1'"));
  EXPECT_EQ(client_->MessageStatus("s1", std::string(129, 'm')).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(relay_.status_calls.load(), 0);
}

TEST(RecipientStateNames, LowerCaseWithoutPrefix) {
  EXPECT_STREQ(RecipientStateName(RecipientState::kUnspecified), "unspecified");
  EXPECT_STREQ(RecipientStateName(RecipientState::kQueued), "queued");
  EXPECT_STREQ(RecipientStateName(RecipientState::kCommitted), "committed");
  EXPECT_STREQ(RecipientStateName(RecipientState::kDelivered), "delivered");
  EXPECT_STREQ(RecipientStateName(RecipientState::kAcked), "acked");
  EXPECT_STREQ(RecipientStateName(RecipientState::kDeadLettered), "dead_lettered");
}

// Over a caller's in-process channel a retry only sleeps its backoff (gRPC
// aborts on connectivity watches of non-client channels).
TEST(RelayClientInProcess, RetriesOverAnInProcessChannel) {
  FakeRelay relay;
  grpc::ServerBuilder b;
  b.RegisterService(&relay);
  std::unique_ptr<grpc::Server> server = b.BuildAndStart();
  ASSERT_TRUE(server != nullptr);
  grpc::ChannelArguments args;
  RelayClient client(server->InProcessChannel(args));
  PublishOptions opts = TinyRoute();
  opts.initial_backoff = std::chrono::milliseconds(1);
  relay.fail_publishes = 1;
  absl::StatusOr<PublishResult> r = client.Publish(TinyTurn(), opts);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->attempts, 2);
  server->Shutdown();
}

// Every call the client makes: publish, fetch, ack, status, compress,
// stats, health, close.
void CallEverything(RelayClient* c, const Turn& turn, const PublishOptions& opts) {
  absl::StatusOr<PublishResult> p = c->Publish(turn, opts);
  ASSERT_TRUE(p.ok()) << p.status();
  FetchOptions f;
  f.session = opts.session;
  f.agent = opts.recipients[0];
  absl::StatusOr<FetchedMessage> m = c->Fetch(f);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_TRUE(c->Ack(opts.session, f.agent, m->message_id).ok());
  EXPECT_EQ(c->MessageStatus(opts.session, m->message_id).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(c->Compress(turn, "h2o-head:k=8").ok());
  ASSERT_TRUE(c->Stats().ok());
  ASSERT_TRUE(c->Health().ok());
  EXPECT_EQ(c->CloseSession(opts.session).status().code(), absl::StatusCode::kUnimplemented);
}

std::vector<std::pair<std::string, std::string>> EveryMethodWith(const std::string& value) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const char* m : {"Publish", "Fetch", "Ack", "MessageStatus", "Compress", "Stats"}) {
    out.emplace_back(absl::StrCat("/kvrelay.v1.Relay/", m), value);
  }
  out.emplace_back("/grpc.health.v1.Health/Check", value);
  out.emplace_back("/kvrelay.v1.Relay/CloseSession", value);
  return out;
}

// Sets (or with nullptr unsets) an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    value ? setenv(name, value, 1) : unsetenv(name);
  }
  ~ScopedEnv() { old_ ? setenv(name_, old_->c_str(), 1) : unsetenv(name_); }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST_F(RelayClientTest, TokenGoesAsBearerMetadataOnEveryCall) {
  ConnectOptions o;
  o.token = "tok-1.A_b~";
  absl::StatusOr<std::unique_ptr<RelayClient>> c = RelayClient::Connect(addr_, o);
  ASSERT_TRUE(c.ok()) << c.status();
  auth_.Take();
  CallEverything(c->get(), turn_, opts_);
  EXPECT_EQ(auth_.Take(), EveryMethodWith("Bearer tok-1.A_b~"));
}

TEST_F(RelayClientTest, NoTokenSendsNoAuthorization) {
  ScopedEnv env(kTokenEnvVar, "from-env");
  auth_.Take();
  CallEverything(client_.get(), turn_, opts_);  // Connect(addr): never a token
  EXPECT_EQ(auth_.Take(), EveryMethodWith("<none>"));
  ConnectOptions o;
  o.token = "";  // explicitly none, whatever the environment says
  absl::StatusOr<std::unique_ptr<RelayClient>> c = RelayClient::Connect(addr_, o);
  ASSERT_TRUE(c.ok()) << c.status();
  opts_.session = "s2";
  CallEverything(c->get(), turn_, opts_);
  EXPECT_EQ(auth_.Take(), EveryMethodWith("<none>"));
}

TEST_F(RelayClientTest, TokenFromTheEnvironmentWhenNotGiven) {
  {
    ScopedEnv env(kTokenEnvVar, " env-token\n");
    absl::StatusOr<std::unique_ptr<RelayClient>> c = RelayClient::Connect(addr_, ConnectOptions());
    ASSERT_TRUE(c.ok()) << c.status();
    auth_.Take();
    ASSERT_TRUE((*c)->Stats().ok());
    EXPECT_EQ(auth_.Take(), (std::vector<std::pair<std::string, std::string>>{
                                {"/kvrelay.v1.Relay/Stats", "Bearer env-token"}}));
    ConnectOptions explicit_token;
    explicit_token.token = "mine";  // an explicit token wins
    c = RelayClient::Connect(addr_, explicit_token);
    ASSERT_TRUE(c.ok()) << c.status();
    ASSERT_TRUE((*c)->Stats().ok());
    EXPECT_EQ(auth_.Take(), (std::vector<std::pair<std::string, std::string>>{
                                {"/kvrelay.v1.Relay/Stats", "Bearer mine"}}));
  }
  ScopedEnv empty(kTokenEnvVar, "");
  absl::StatusOr<std::unique_ptr<RelayClient>> c = RelayClient::Connect(addr_, ConnectOptions());
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE((*c)->Stats().ok());
  EXPECT_EQ(auth_.Take(), (std::vector<std::pair<std::string, std::string>>{{"/kvrelay.v1.Relay/Stats", "<none>"}}));
}

class TempFile {
 public:
  explicit TempFile(const std::string& content) {
    char name[] = "/tmp/kvrelay-client-test-XXXXXX";
    const int fd = mkstemp(name);
    EXPECT_GE(fd, 0);
    close(fd);
    path_ = name;
    std::ofstream(path_) << content;
  }
  ~TempFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

void ExpectBadOption(const ConnectOptions& o, const std::string& message) {
  absl::StatusOr<std::unique_ptr<RelayClient>> c = RelayClient::Connect("127.0.0.1:1", o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  EXPECT_THAT(c.status().message(), HasSubstr(message));
}

TEST(RelayClientConnectOptions, BadOptionsAreInvalidArgumentNamingTheOption) {
  const TempFile cert("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n");
  const TempFile key("-----BEGIN EC PRIVATE KEY-----\nAAAA\n-----END EC PRIVATE KEY-----\n");
  const TempFile text("not a certificate\n");
  ConnectOptions o;
  o.token = "";
  o.tls_ca_file = "/nonexistent/ca.pem";
  ExpectBadOption(o, "tls_ca_file: cannot read \"/nonexistent/ca.pem\": No such file or directory");
  o.tls_ca_file = text.path();
  ExpectBadOption(o, absl::StrCat("tls_ca_file: \"", text.path(), "\" holds no PEM CERTIFICATE block"));
  o.tls_ca_file = key.path();
  ExpectBadOption(o, "tls_ca_file: ");
  o.tls_ca_file = cert.path();
  o.tls_cert_file = cert.path();
  ExpectBadOption(o, "tls_cert_file: given without tls_key_file, expected both or neither");
  o.tls_cert_file = "";
  o.tls_key_file = key.path();
  ExpectBadOption(o, "tls_key_file: given without tls_cert_file, expected both or neither");
  o.tls_cert_file = "/nonexistent/cert.pem";
  ExpectBadOption(o, "tls_cert_file: cannot read \"/nonexistent/cert.pem\"");
  o.tls_cert_file = cert.path();
  o.tls_key_file = cert.path();
  ExpectBadOption(o, absl::StrCat("tls_key_file: \"", cert.path(), "\" holds no PEM PRIVATE KEY block"));
  o.tls_key_file = "/nonexistent/key.pem";
  ExpectBadOption(o, "tls_key_file: cannot read \"/nonexistent/key.pem\"");
  o.tls_ca_file = "";
  o.tls_key_file = key.path();
  ExpectBadOption(o, "tls_cert_file: given without tls_ca_file");
}

TEST(RelayClientConnectOptions, ABadTokenIsNeverShown) {
  for (const std::string& bad : {std::string("has space-secret"), std::string("line\nsecret"),
                                std::string(4097, 'x'), std::string("caf\xc3\xa9-secret")}) {
    ConnectOptions o;
    o.token = bad;
    absl::StatusOr<std::unique_ptr<RelayClient>> c = RelayClient::Connect("127.0.0.1:1", o);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(c.status().message(), HasSubstr("token: "));
    EXPECT_THAT(c.status().message(), HasSubstr("expected 1 to 4096 visible ASCII characters"));
    EXPECT_THAT(c.status().message(), ::testing::Not(HasSubstr("secret")));
  }
  ScopedEnv env(kTokenEnvVar, "env secret");
  absl::StatusOr<std::unique_ptr<RelayClient>> c = RelayClient::Connect("127.0.0.1:1", ConnectOptions());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("KVRELAY_TOKEN: 10 characters (not shown)"));
  EXPECT_THAT(c.status().message(), ::testing::Not(HasSubstr("secret")));
}

TEST(RelayClientNoServer, UnavailableAndUniqueIds) {
  auto c = RelayClient::Connect("127.0.0.1:1");
  EXPECT_EQ(c->Health("", std::chrono::seconds(2)).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(c->MessageStatus("s", "m", std::chrono::seconds(2)).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(NewMessageId().value(), NewMessageId().value());
}

}  // namespace
}  // namespace kvrelay
