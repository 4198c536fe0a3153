// The spool: its formats, recovery, the corruption table, injected I/O
// faults, and crash and power-loss runs over random seeds with their
// negative controls (no fsync, no directory fsync), which must fail.
#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <iostream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>

#include "tests/testlib/eventually.h"
#include "gtest/gtest.h"
#include "core/crc32c.h"
#include "core/format/synthetic.h"
#include "core/format/turn_file.h"
#include "core/pipeline.h"
#include "proto/stream_codec.h"
#include "proto/wire.h"
#include "server/store/memory_store.h"
#include "server/store/spool/journal.h"
#include "server/store/spool/spool_format.h"
#include "server/store/spool_store.h"
#include "tests/server/store/spool/fault_fs.h"
#include "tests/server/store/spool/spool_test_util.h"
#include "tests/server/store/store_test_util.h"

namespace kvrelay {
namespace {

using testing::Commit;
using testing::FaultFs;
using testing::Fingerprint;
using testing::RealMsg;
using testing::TryFetch;

constexpr char kDir[] = "/spool";

SpoolOptions Opts(FaultFs* fs) {
  SpoolOptions o;
  o.dir = kDir;
  o.fs = fs;
  return o;
}

std::unique_ptr<SpoolStore> OpenOk(const SpoolOptions& o, StoreLimits limits = {}) {
  absl::StatusOr<std::unique_ptr<SpoolStore>> s = SpoolStore::Open(limits, o, nullptr);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

// The names in the spool's message folder (temporary files included).
std::vector<std::string> MessageFiles(FaultFs& fs) {
  absl::StatusOr<std::vector<std::string>> names = fs.List(std::string(kDir) + "/msg");
  EXPECT_TRUE(names.ok()) << names.status();
  return names.ok() ? *std::move(names) : std::vector<std::string>();
}

// A close started with CloseSessionAndPeersAsync: `answer` holds its first
// answer, and `answers` counts how many it gave.
struct AsyncClose {
  std::promise<Store::CloseResult> promise;
  std::future<Store::CloseResult> answer = promise.get_future();
  std::atomic<int> answers{0};

  void Start(SpoolStore& s, const std::string& session) {
    s.CloseSessionAndPeersAsync(session, [this](Store::CloseResult r) {
      if (answers.fetch_add(1) == 0) promise.set_value(std::move(r));
    });
  }
  bool answered(std::chrono::milliseconds wait) const {
    return answer.wait_for(wait) == std::future_status::ready;
  }
};

std::string MsgPath(uint64_t seq) {
  char b[64];
  snprintf(b, sizeof(b), "%s/msg/%016llx.kvm", kDir, static_cast<unsigned long long>(seq));
  return b;
}

// ---- Formats ----

TEST(SpoolFormat, MessageFileRoundTrip) {
  auto m = RealMsg("s", "m1", {"b"}, 7);
  spool::v1::MessageMeta meta;
  meta.set_session_id("s");
  meta.set_message_id("m1");
  meta.add_recipients("b");
  std::string bytes;
  ASSERT_TRUE(EncodeMessageFile(meta, m->msg, &bytes).ok());
  absl::StatusOr<SpoolMessage> back = DecodeMessageFile(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->meta.message_id(), "m1");
  auto copy = std::make_shared<StoredMessage>(*m);
  copy->msg = std::move(back->msg);
  EXPECT_EQ(Fingerprint(*copy), Fingerprint(*m));
}

std::string Le(uint64_t v, int bytes) {
  std::string out;
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  return out;
}

// The writer streams the layout of docs/SPOOL.md, built here by hand from
// WriteMessage, and hands the large tensors to the sink from the message's
// own buffers rather than from a copy.
TEST(SpoolFormat, MessageFileWriterStreamsTheTensorsWithoutCopying) {
  auto m = RealMsg("s", "big", {"b", "c"}, 9, /*tokens=*/20000, /*layers=*/3);  // K, V: 640,000 bytes each
  spool::v1::MessageMeta meta;
  meta.set_session_id("s");
  meta.set_message_id("big");
  meta.add_recipients("b");
  meta.add_recipients("c");
  std::string body, meta_bytes;
  ASSERT_TRUE(WriteMessage(m->msg, &body).ok());
  meta.SerializeToString(&meta_bytes);
  std::string want = std::string("KVRSPMSG") + Le(1, 4) + Le(meta_bytes.size(), 4) + Le(body.size(), 8) +
                     meta_bytes + body;
  want += Le(Crc32c(want.data(), want.size()), 4);

  absl::StatusOr<MessageFileWriter> w = MessageFileWriter::Make(meta, m->msg);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->size(), want.size());
  std::string got;
  int borrowed = 0, calls = 0;
  ASSERT_TRUE(w->WriteTo([&](absl::string_view piece) {
                 ++calls;
                 const auto* p = reinterpret_cast<const uint8_t*>(piece.data());
                 for (const MessageLayer& l : m->msg.layers) {
                   for (const KvTensor* t : {&l.k, &l.v}) {
                     if (p == t->bytes().data() && piece.size() == t->bytes().size()) ++borrowed;
                   }
                 }
                 EXPECT_TRUE(piece.size() <= (256u << 10) || borrowed > 0) << "a large piece was copied";
                 got.append(piece.data(), piece.size());
                 return absl::OkStatus();
               }).ok());
  EXPECT_EQ(got, want);
  EXPECT_EQ(borrowed, 6) << "every K and V should reach the sink from the message itself";
  EXPECT_LT(calls, 16);
  std::string encoded;
  ASSERT_TRUE(EncodeMessageFile(meta, m->msg, &encoded).ok());
  EXPECT_EQ(encoded, want);

  // The sink's first error stops the write.
  int n = 0;
  absl::Status s = w->WriteTo([&n](absl::string_view) {
    return ++n == 2 ? absl::ResourceExhaustedError("disk full") : absl::OkStatus();
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(n, 2);

  // A message that cannot be written is refused before anything is.
  Message broken = m->msg;
  broken.sent_bytes += 1;
  EXPECT_EQ(MessageFileWriter::Make(meta, broken).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SpoolFormat, EveryDamagedMessageFileIsDataLossAndAnotherVersionIsRefused) {
  auto m = RealMsg("s", "m1", {"b"}, 8);
  spool::v1::MessageMeta meta;
  meta.set_session_id("s");
  std::string bytes;
  ASSERT_TRUE(EncodeMessageFile(meta, m->msg, &bytes).ok());
  std::mt19937 rng(1);
  for (int i = 0; i < 200; ++i) {
    std::string bad = bytes;
    const size_t at = rng() % bad.size();
    bad[at] ^= static_cast<char>(1u << (rng() % 8));
    absl::StatusOr<SpoolMessage> r = DecodeMessageFile(bad);
    ASSERT_FALSE(r.ok()) << "a flipped bit at " << at << " went unnoticed";
    if (at >= 8 && at < 12) {
      EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
    } else {
      EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
    }
  }
  for (size_t n : {size_t{0}, size_t{10}, bytes.size() / 2, bytes.size() - 1}) {
    EXPECT_EQ(DecodeMessageFile(absl::string_view(bytes).substr(0, n)).status().code(), absl::StatusCode::kDataLoss);
  }
}

// ---- Coded message files ----

// Policies of every kind a spool holds: dense (the default h2o-head+obf
// too), int4, lloyd, and demotion under lloyd and under int4.
const char* const kPolicySpecs[] = {"full",
                                    "full+int4",
                                    "full+lloyd:bits=3",
                                    "h2o-head:k=32+obf:p=8,mode=fast",
                                    "h2o-head:k=8+demote:bits=2+lloyd:bits=4",
                                    "h2o-head:k=16+demote:bits=2+int4:group=32"};

// A synthetic turn (low-rank values, outlier key channels, heavy-tailed
// scores: what a model hands the relay) of 3 layers x 2 KV heads x
// head_dim 64, 96 prompt and 8 generated tokens.
SyntheticTurnOptions SmallTurn() {
  SyntheticTurnOptions o;
  o.layers = 3;
  o.kv_heads = 2;
  o.head_dim = 64;
  o.n_prompt = 96;
  o.n_gen = 8;
  return o;
}

// A message of `spec` compressed from the turn `o` of seed `seed`.
std::shared_ptr<StoredMessage> PolicyMsg(const std::string& session, const std::string& id, const std::string& spec,
                                         uint64_t seed, SyntheticTurnOptions o = SmallTurn()) {
  o.seed = seed;
  absl::StatusOr<Turn> turn = MakeSyntheticTurn(o);
  EXPECT_TRUE(turn.ok()) << turn.status();
  absl::StatusOr<std::unique_ptr<Pipeline>> p = Pipeline::Create(spec);
  EXPECT_TRUE(p.ok()) << spec << ": " << p.status();
  absl::StatusOr<Message> msg = (*p)->Compress(*turn);
  EXPECT_TRUE(msg.ok()) << spec << ": " << msg.status();
  auto m = testing::StoredMessageOf(*std::move(msg), session, id, "a", {"b"});
  m->requested_policy = spec;
  m->family = "test";
  return m;
}

// `msg` as a plain message file (FORMAT.md): every tensor and every field
// it holds, so equal exactly for bit-identical messages.
std::string PlainBytes(const Message& msg) {
  std::string out;
  EXPECT_TRUE(WriteMessage(msg, &out).ok());
  return out;
}

spool::v1::MessageMeta TestMeta(const StoredMessage& m) {
  spool::v1::MessageMeta meta;
  meta.set_session_id(m.session_id);
  meta.set_message_id(m.message_id);
  meta.set_sender(m.sender);
  meta.add_recipients("b");
  return meta;
}

uint32_t FileVersion(const std::string& file) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(file[8 + i]);
  return v;
}

// `file` with its CRC32C made right again (damage a CRC does not see).
std::string WithCrc(std::string file) {
  const uint32_t crc = Crc32c(file.data(), file.size() - 4);
  for (int i = 0; i < 4; ++i) file[file.size() - 4 + i] = static_cast<char>((crc >> (8 * i)) & 0xff);
  return file;
}

// Every policy (and dense f32) through a coded file and back, bit for bit;
// no file grows by more than the coded body's framing, and quantized ones
// shrink (their scales, norms and positions; codes of 2 to 4 bits carry
// little redundancy for an order-0 coder).
TEST(SpoolFormat, CodedMessageFilesRoundTripEveryPolicyAndShrinkQuantizedOnes) {
  SyntheticTurnOptions qwen = Qwen3_14BTurn();
  qwen.layers = 2;
  for (const auto& [shape, name] : {std::pair{SmallTurn(), "3 layers x 2 KV heads x head_dim 64, 104 tokens"},
                                    std::pair{qwen, "Qwen3_14BTurn(), 2 of its layers"}}) {
  std::cout << "spool message file bytes, plain -> coded (" << name << "):\n";
  std::vector<std::pair<std::string, DType>> cases;
  for (const char* spec : kPolicySpecs) cases.push_back({spec, DType::kBF16});
  cases.push_back({"full+int2:rotate=hadamard", DType::kBF16});
  cases.push_back({"full", DType::kF32});
  for (const auto& [spec, dtype] : cases) {
    const std::string what = spec + (dtype == DType::kF32 ? " (f32)" : " (bf16)");
    SCOPED_TRACE(what);
    SyntheticTurnOptions o = shape;
    o.dtype = dtype;
    auto m = PolicyMsg("s", "m", spec, 5, o);
    const spool::v1::MessageMeta meta = TestMeta(*m);
    std::string plain, coded;
    ASSERT_TRUE(EncodeMessageFile(meta, m->msg, &plain).ok());
    ASSERT_TRUE(EncodeMessageFile(meta, m->msg, &coded, MessageBody::kCoded).ok());
    EXPECT_EQ(FileVersion(plain), 1u);
    EXPECT_EQ(FileVersion(coded), 2u);
    absl::StatusOr<MessageFileWriter> w = MessageFileWriter::Make(meta, m->msg, MessageBody::kCoded);
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ(w->size(), coded.size());
    for (const auto& [file, body] : {std::pair{&plain, MessageBody::kPlain}, std::pair{&coded, MessageBody::kCoded}}) {
      absl::StatusOr<SpoolMessage> back = DecodeMessageFile(*file);
      ASSERT_TRUE(back.ok()) << back.status();
      EXPECT_EQ(back->body, body);
      EXPECT_EQ(back->meta.SerializeAsString(), meta.SerializeAsString());
      EXPECT_EQ(PlainBytes(back->msg), PlainBytes(m->msg));
    }
    std::cout << "  " << what << ": " << plain.size() << " -> " << coded.size() << " ("
              << 100.0 * static_cast<double>(coded.size()) / static_cast<double>(plain.size()) << "%)\n";
    // The framing a coded body adds: 12 bytes, 20 per layer, 41 per tensor.
    size_t tensors = 0;
    for (const TensorRef& t : MessageDeliveryOrder(m->msg, /*with_acc=*/true)) tensors += t.data.empty() ? 0 : 1;
    EXPECT_LE(coded.size(), plain.size() + 12 + 20 * m->msg.layers.size() + 41 * tensors);
    if (m->msg.layers[0].quant) {
      EXPECT_LT(coded.size(), plain.size());
    }
    // A coded body decodes to at most the bytes the caller allows.
    absl::StatusOr<SpoolMessage> capped = DecodeMessageFile(coded, true, /*max_tensor_bytes=*/1000);
    EXPECT_EQ(capped.status().code(), absl::StatusCode::kDataLoss) << capped.status();
    EXPECT_NE(capped.status().message().find("at most 1000"), std::string::npos) << capped.status();
  }
  }
}

// Damage a CRC32C would catch, made invisible to it: the coded body's own
// checks (lengths, the wire codec's records and per-stream CRC32C, the
// plain body's) refuse it, or it decodes to the same message. Never a crash.
TEST(SpoolFormat, ACodedBodyDamagedBehindAValidCrcIsDataLossOrTheSameMessage) {
  for (const char* spec : {"full", "h2o-head:k=8+demote:bits=2+lloyd:bits=4", "full+int4"}) {
    SCOPED_TRACE(spec);
    auto m = PolicyMsg("s", "m", spec, 6);
    const spool::v1::MessageMeta meta = TestMeta(*m);
    std::string coded;
    ASSERT_TRUE(EncodeMessageFile(meta, m->msg, &coded, MessageBody::kCoded).ok());
    const std::string want = PlainBytes(m->msg);
    const size_t body = 24 + meta.ByteSizeLong();
    uint64_t header = 0;
    for (int i = 7; i >= 0; --i) header = (header << 8) | static_cast<uint8_t>(coded[body + i]);
    const size_t groups = body + 8 + header;  // the group table, then the blobs
    std::mt19937 rng(3);
    int refused = 0, same = 0;
    for (int i = 0; i < 3000; ++i) {
      // Half the flips in the group table and the blobs, half anywhere in the body.
      const size_t lo = i % 2 ? groups : body;
      const size_t at = lo + rng() % (coded.size() - 4 - lo);
      std::string bad = coded;
      bad[at] ^= static_cast<char>(1u << (rng() % 8));
      absl::StatusOr<SpoolMessage> r = DecodeMessageFile(WithCrc(bad));
      if (!r.ok()) {
        ASSERT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << at << ": " << r.status();
        ++refused;
      } else if (at >= groups) {
        ASSERT_EQ(PlainBytes(r->msg), want) << "a flip at " << at << " changed the message";
        ++same;
      }
    }
    EXPECT_GT(refused, 2500) << same;
    // Cut short, or with bytes after the last group (lengths made right).
    for (const int64_t delta : {-1, -29, 1, 8}) {
      std::string bad = coded.substr(0, coded.size() - 4);
      if (delta < 0) {
        bad.resize(bad.size() + delta);
      } else {
        bad.append(static_cast<size_t>(delta), '\0');
      }
      uint64_t b = 0;
      for (int i = 7; i >= 0; --i) b = (b << 8) | static_cast<uint8_t>(bad[16 + i]);
      b += delta;
      for (int i = 0; i < 8; ++i) bad[16 + i] = static_cast<char>((b >> (8 * i)) & 0xff);
      absl::StatusOr<SpoolMessage> r = DecodeMessageFile(WithCrc(bad + "CRC!"));
      EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << delta << ": " << r.status();
    }
  }
}

TEST(SpoolFormat, JournalScanStopsAtTheFirstDamagedRecord) {
  std::string j = JournalHeader();
  std::vector<size_t> ends;
  for (int i = 0; i < 5; ++i) {
    spool::v1::Record r;
    r.mutable_acked()->set_session_id("s");
    r.mutable_acked()->set_message_id("m" + std::to_string(i));
    AppendJournalRecord(r, &j);
    ends.push_back(j.size());
  }
  absl::StatusOr<JournalScan> all = ScanJournal(j);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->records.size(), 5u);
  EXPECT_EQ(all->torn_bytes, 0u);
  // Cut anywhere inside record 3: records 0..2 survive.
  for (size_t cut = ends[2] + 1; cut < ends[3]; ++cut) {
    absl::StatusOr<JournalScan> s = ScanJournal(absl::string_view(j).substr(0, cut));
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(s->records.size(), 3u) << cut;
    EXPECT_EQ(s->valid_bytes, ends[2]);
  }
  // A flipped bit inside record 1: only record 0 survives.
  std::string bad = j;
  bad[ends[0] + 10] ^= 4;
  absl::StatusOr<JournalScan> s = ScanJournal(bad);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->records.size(), 1u);
  EXPECT_EQ(s->torn_bytes, j.size() - ends[0]);
  std::string v2 = j;
  v2[8] = 2;
  EXPECT_EQ(ScanJournal(v2).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ScanJournal("not a journal at all").status().code(), absl::StatusCode::kDataLoss);
}

// ---- Recovery ----

TEST(SpoolStore, RecoversMessagesDeliveriesAcksAndCloses) {
  FaultFs fs;
  std::map<std::string, uint32_t> prints;
  {
    auto s = OpenOk(Opts(&fs));
    for (int i = 0; i < 4; ++i) {
      auto m = RealMsg("s1", "m" + std::to_string(i), {"b", "c"}, i);
      prints[m->message_id] = Fingerprint(*m);
      ASSERT_TRUE(Commit(*s, m).ok());
    }
    ASSERT_TRUE(Commit(*s, RealMsg("s2", "x", {"b"}, 99)).ok());
    ASSERT_TRUE(TryFetch(*s, "s1", "b"));  // m0 delivered to b
    ASSERT_TRUE(s->Ack("s1", "b", "m0").ok());
    ASSERT_TRUE(TryFetch(*s, "s1", "b"));  // m1 delivered to b, not acked
    ASSERT_TRUE(s->CloseSessionAndPeers("s2").status.ok());
  }
  auto s = OpenOk(Opts(&fs));
  EXPECT_EQ(s->recovery().messages, 4u);
  EXPECT_EQ(s->recovery().closed, 1u);
  for (const auto& [id, fp] : prints) {
    MessagePtr m = s->Find("s1", id);
    ASSERT_TRUE(m) << id;
    EXPECT_EQ(Fingerprint(*m), fp) << id;
  }
  EXPECT_TRUE(s->IsClosed("s2"));
  EXPECT_FALSE(s->Find("s2", "x"));
  // b acked m0: its oldest is m1, which it fetched before the restart and
  // may ack without fetching again; c still has everything.
  EXPECT_TRUE(s->Ack("s1", "b", "m1").ok());
  auto d = TryFetch(*s, "s1", "b");
  ASSERT_TRUE(d);
  EXPECT_EQ(d->msg->message_id, "m2");
  d = TryFetch(*s, "s1", "c");
  ASSERT_TRUE(d);
  EXPECT_EQ(d->msg->message_id, "m0");
  EXPECT_TRUE(s->LookupParent("s1", "m0", "b").ok());
  // The closed session's file is gone; the others are there.
  EXPECT_EQ(MessageFiles(fs).size(), 4u);
}

// The header's geometry a message was published with comes back from the
// spool field for field (optional fields unset stay unset), so a retry after
// a restart is compared against what the first call said; a message that
// came without one comes back without one, and so does one whose geometry
// no longer passes the checks (the message itself is kept).
TEST(SpoolStore, RecoversTheHeaderGeometryFieldForField) {
  v1::TurnGeometry g;
  g.set_layers(2);
  g.set_kv_heads(2);
  g.set_score_heads(4);
  g.set_head_dim(8);
  g.set_dtype(v1::DTYPE_BF16);
  g.set_n_prompt(5);
  g.set_n_gen(3);
  g.set_n_history(4);
  g.set_first_agent(true);
  g.set_prompt_pos0(9);
  g.add_history_anchors(0);
  g.set_history_score_tokens(4);
  v1::TurnGeometry queries = g;
  queries.set_query_dtype(v1::DTYPE_F32);
  queries.set_softmax_scale(0.25);
  queries.set_history_score_tokens(0);
  queries.clear_prompt_pos0();
  FaultFs fs;
  {
    auto s = OpenOk(Opts(&fs));
    int i = 0;
    for (const v1::TurnGeometry* geo : {&g, &queries}) {
      const int k = i++;
      auto m = RealMsg("s1", "m" + std::to_string(k), {"b"}, k);
      absl::StatusOr<UploadShape> layout = CheckGeometry(*geo, "header.geometry");
      ASSERT_TRUE(layout.ok()) << layout.status();
      m->layout = *layout;
      ASSERT_TRUE(Commit(*s, m).ok());
    }
    ASSERT_TRUE(Commit(*s, RealMsg("s1", "bare", {"b"}, 7)).ok());
    // A geometry the checks refuse (what a file from a relay with other
    // bounds could hold): the message comes back without it.
    auto odd = RealMsg("s1", "odd", {"b"}, 8);
    TurnLayout bad = *CheckGeometry(g, "header.geometry");
    bad.geo.kv_heads = 0;
    odd->layout = bad;
    ASSERT_TRUE(Commit(*s, odd).ok());
  }
  auto s = OpenOk(Opts(&fs));
  int i = 0;
  for (const v1::TurnGeometry* geo : {&g, &queries}) {
    MessagePtr m = s->Find("s1", "m" + std::to_string(i++));
    ASSERT_TRUE(m);
    ASSERT_TRUE(m->layout.has_value());
    EXPECT_EQ(ToProto(*m->layout).DebugString(), geo->DebugString());
  }
  MessagePtr bare = s->Find("s1", "bare");
  ASSERT_TRUE(bare);
  EXPECT_FALSE(bare->layout.has_value());
  MessagePtr odd = s->Find("s1", "odd");
  ASSERT_TRUE(odd) << "a message whose geometry no longer passes is still recovered";
  EXPECT_FALSE(odd->layout.has_value());
  EXPECT_EQ(Fingerprint(*odd), Fingerprint(*RealMsg("s1", "odd", {"b"}, 8)));
  EXPECT_EQ(s->recovery().messages, 4u);
}

// Removing a closed session's files does not hold up the journal: while
// the unlinks wait (a slow disk), another session's commit is still made
// durable and answered, and the close answers once its files are gone.
TEST(SpoolStore, SlowFileRemovalDoesNotHoldUpTheJournal) {
  FaultFs fs;
  auto s = OpenOk(Opts(&fs));
  ASSERT_TRUE(Commit(*s, RealMsg("s", "m", {"b"}, 1)).ok());
  fs.Hold("unlink", "/msg/");
  AsyncClose close;
  close.Start(*s, "s");
  Eventually([&] { return fs.held() != 0; }, std::chrono::seconds(5));
  const bool unlink_waiting = fs.held() == 1;
  std::future<absl::Status> other = std::async(std::launch::async, [&] {
    return Commit(*s, RealMsg("t", "n", {"b"}, 2)).status();
  });
  const bool committed = other.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  const bool early = close.answered(std::chrono::milliseconds(0));
  fs.Release();
  EXPECT_TRUE(unlink_waiting);
  EXPECT_TRUE(committed) << "a commit waited for another session's file removal";
  EXPECT_FALSE(early) << "the close answered before its files were removed";
  EXPECT_TRUE(other.get().ok());
  EXPECT_TRUE(close.answer.get().status.ok());
  EXPECT_EQ(MessageFiles(fs).size(), 1u);  // t's
}

// A close whose record cannot be made durable answers UNAVAILABLE, once,
// and keeps the files (recovery removes what the journal freed).
TEST(SpoolStore, ACloseThatIsNotDurableIsUnavailableAndKeepsTheFiles) {
  FaultFs fs;
  auto s = OpenOk(Opts(&fs));
  ASSERT_TRUE(Commit(*s, RealMsg("s", "m", {"b"}, 1)).ok());
  fs.FailOn("fdatasync", "journal", absl::UnavailableError("fdatasync: Input/output error"));
  AsyncClose close;
  close.Start(*s, "s");
  const Store::CloseResult r = close.answer.get();
  EXPECT_EQ(r.status.code(), absl::StatusCode::kUnavailable) << r.status;
  EXPECT_FALSE(s->health().ok());
  EXPECT_EQ(MessageFiles(fs).size(), 1u);
  s.reset();
  EXPECT_EQ(close.answers.load(), 1);
}

// A close answers once its record is durable, and its caller (a gRPC
// reaction) does not wait for the disk meanwhile.
TEST(SpoolStore, CloseAnswersOnceDurableWithoutBlockingItsCaller) {
  FaultFs fs;
  {
    auto s = OpenOk(Opts(&fs));
    ASSERT_TRUE(Commit(*s, RealMsg("s", "m", {"b"}, 1)).ok());
    fs.Hold("fdatasync", "journal");
    AsyncClose close;
    std::future<void> call = std::async(std::launch::async, [&] { close.Start(*s, "s"); });
    const bool returned = call.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
    // The close's journal sync has started and waits: what "not answered
    // yet" below is about.
    const bool sync_waiting = Eventually([&] { return fs.held() != 0; }, std::chrono::seconds(5));
    const bool early = close.answered(std::chrono::milliseconds(100));
    // Not durable yet: the message's file is still there.
    const size_t files_while_held = MessageFiles(fs).size();
    fs.Release();
    EXPECT_EQ(files_while_held, 1u);
    EXPECT_TRUE(returned) << "the caller waited for the journal's sync";
    EXPECT_TRUE(sync_waiting) << "the close's journal sync never started";
    EXPECT_FALSE(early) << "answered before the close was durable";
    const Store::CloseResult r = close.answer.get();
    EXPECT_TRUE(r.status.ok()) << r.status;
    EXPECT_EQ(r.messages_freed, 1u);
    EXPECT_TRUE(r.first);
    EXPECT_TRUE(s->IsClosed("s"));
  }
  auto s = OpenOk(Opts(&fs));
  EXPECT_TRUE(s->IsClosed("s"));
  EXPECT_FALSE(s->Find("s", "m"));
  EXPECT_TRUE(MessageFiles(fs).empty());
}

TEST(SpoolStore, DuplicatesAndRefusedCommitsLeaveNoFile) {
  FaultFs fs;
  StoreLimits limits;
  limits.max_session_messages = 2;
  auto s = OpenOk(Opts(&fs), limits);
  ASSERT_TRUE(Commit(*s, RealMsg("s", "a", {"b"}, 1)).ok());
  absl::StatusOr<Store::CommitResult> dup = Commit(*s, RealMsg("s", "a", {"b"}, 1));
  ASSERT_TRUE(dup.ok());
  EXPECT_TRUE(dup->duplicate);
  ASSERT_TRUE(Commit(*s, RealMsg("s", "b", {"b"}, 2)).ok());
  EXPECT_EQ(Commit(*s, RealMsg("s", "c", {"b"}, 3)).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(MessageFiles(fs).size(), 2u);
}

TEST(SpoolStore, ForwardedMessagesTracksPeersAndTheOutboxSurvive) {
  FaultFs fs;
  {
    auto s = OpenOk(Opts(&fs));
    // Published here for b (here) and r1, r2 on relay R.
    auto m = RealMsg("s", "p1", {"b", "r1", "r2"}, 3);
    m->remote = {{"r1", "R:1"}, {"r2", "R:1"}};
    ASSERT_TRUE(Commit(*s, m).ok());
    auto q = RealMsg("s", "p2", {"r1"}, 4);
    q->remote = {{"r1", "R:1"}};
    ASSERT_TRUE(Commit(*s, q).ok());
    s->TrackRecipient("s", "p2", "r1", {TrackState::kCommitted, "R:1", "", 1});
    s->TrackRecipient("s", "p1", "r2", {TrackState::kDeadLettered, "R:1", "NOT_FOUND: x", 3});
    ASSERT_TRUE(s->AddPeer("s", "R:1"));
    s->NotePeerHolds("s", "p2", "R:1");
    // Forwarded here from relay O: one recipient, then a second.
    auto f = RealMsg("s", "f1", {"b"}, 5);
    f->forwarded = true;
    f->origin = "O:1";
    Store::PublishTicket t = s->BeginPublish("s");
    ASSERT_TRUE(s->CommitForward(f, {"b"}, t).ok());
    absl::StatusOr<Store::ForwardCommitResult> again = s->CommitForward(RealMsg("s", "f1", {"c"}, 5), {"c"}, t);
    s->EndPublish(t);
    ASSERT_TRUE(again.ok());
    EXPECT_TRUE(again->duplicate);
  }
  auto s = OpenOk(Opts(&fs));
  // The outbox: p1 to r1 had no answer; p2 was committed there, r2 dead.
  ASSERT_EQ(s->RecoveredOutbox().size(), 1u);
  EXPECT_EQ(s->RecoveredOutbox()[0].msg->message_id, "p1");
  EXPECT_EQ(s->RecoveredOutbox()[0].target, "R:1");
  EXPECT_EQ(s->RecoveredOutbox()[0].agents, std::vector<std::string>{"r1"});
  absl::StatusOr<Store::MessageReport> st = s->MessageStatus("s", "p1");
  ASSERT_TRUE(st.ok());
  ASSERT_EQ(st->recipients.size(), 3u);
  EXPECT_EQ(st->recipients[2].state, TrackState::kDeadLettered);
  EXPECT_EQ(st->recipients[2].reason, "NOT_FOUND: x");
  EXPECT_TRUE(s->PeerHolds("s", "p2", "R:1"));
  EXPECT_EQ(s->Peers("s"), (std::vector<std::string>{"O:1", "R:1"}));
  MessagePtr f = s->Find("s", "f1");
  ASSERT_TRUE(f);
  EXPECT_TRUE(f->forwarded);
  EXPECT_EQ(f->origin, "O:1");
  // Both forwarded recipients have it.
  for (const char* agent : {"b", "c"}) {
    bool found = false;
    for (int i = 0; i < 3 && !found; ++i) {
      auto d = TryFetch(*s, "s", agent);
      if (!d) break;
      found = d->msg->message_id == "f1";
      ASSERT_TRUE(s->Ack("s", agent, d->msg->message_id).ok());
    }
    EXPECT_TRUE(found) << agent;
  }
}

TEST(SpoolStore, CompactionKeepsTheStateAndBoundsTheJournal) {
  FaultFs fs;
  SpoolOptions o = Opts(&fs);
  o.compact_bytes = 4096;
  {
    auto s = OpenOk(o);
    for (int i = 0; i < 60; ++i) {
      ASSERT_TRUE(Commit(*s, RealMsg("s", "m" + std::to_string(i), {"b"}, i, 2, 1)).ok());
    }
    for (int i = 0; i < 40; ++i) {  // b takes and acks the oldest 40
      auto d = TryFetch(*s, "s", "b");
      ASSERT_TRUE(d);
      ASSERT_EQ(d->msg->message_id, "m" + std::to_string(i));
      ASSERT_TRUE(s->Ack("s", "b", d->msg->message_id).ok());
    }
  }
  const std::string j = fs.Peek(std::string(kDir) + "/journal");
  EXPECT_LT(j.size(), 4096u + 8192u) << "the journal was not compacted";
  auto s = OpenOk(o);
  EXPECT_EQ(s->recovery().messages, 60u);
  auto d = TryFetch(*s, "s", "b");
  ASSERT_TRUE(d);
  EXPECT_EQ(d->msg->message_id, "m40");
  EXPECT_TRUE(s->LookupParent("s", "m39", "b").ok());
}

// The store's destructor stops compaction before the memory store the
// snapshot reads goes away; StopCompaction must wait for one in progress.
TEST(Journal, StopCompactionWaitsForACompactionInProgress) {
  FaultFs fs;
  ASSERT_TRUE(fs.CreateDir("/j").ok());
  ASSERT_TRUE(fs.CreateDir("/j/quarantine").ok());
  JournalOptions jo;
  jo.compact_bytes = 1;  // every batch triggers a compaction
  JournalRecovery recovery;
  absl::StatusOr<std::unique_ptr<Journal>> j = Journal::Open(&fs, "/j", jo, &recovery);
  ASSERT_TRUE(j.ok()) << j.status();
  std::atomic<int> calls{0};
  std::atomic<bool> in_snapshot{false};
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  (*j)->Start(
      [&] {
        ++calls;
        in_snapshot = true;
        released.wait();
        in_snapshot = false;
        return std::vector<spool::v1::Record>{};
      },
      nullptr);
  spool::v1::Record r;
  r.mutable_peer()->set_session_id("s");
  (*j)->Append(r);
  ASSERT_TRUE(Eventually([&] { return in_snapshot.load(); })) << "no compaction started";
  std::atomic<bool> stopped{false};
  std::thread stopper([&] {
    (*j)->StopCompaction();
    stopped = true;
  });
  // The stopper waits for the compaction in progress...
  const bool waiting = Eventually([&] { return (*j)->compaction_stop_waiters() == 1; });
  EXPECT_TRUE(waiting) << "StopCompaction did not wait for the compaction in progress";
  EXPECT_FALSE(stopped) << "StopCompaction returned while the snapshot was being read";
  release.set_value();  // ...and returns once it is done
  stopper.join();
  EXPECT_FALSE(in_snapshot);
  const int seen = calls;
  for (int i = 0; i < 5; ++i) ASSERT_TRUE((*j)->AppendAndWait(r).ok());
  EXPECT_EQ(calls, seen) << "a compaction started after StopCompaction";
}

// ---- The corruption table ----

// A spool with three committed messages m0..m2 in session s for b, m0 acked.
void MakeThree(FaultFs* fs, MessageBody body = MessageBody::kPlain) {
  SpoolOptions o = Opts(fs);
  o.message_body = body;
  auto s = OpenOk(o);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(Commit(*s, RealMsg("s", "m" + std::to_string(i), {"b"}, 40 + i)).ok());
  ASSERT_TRUE(TryFetch(*s, "s", "b"));
  ASSERT_TRUE(s->Ack("s", "b", "m0").ok());
}

struct Corruption {
  const char* name;
  std::function<void(FaultFs*)> damage;
  std::set<std::string> served;  // what the recovered relay still holds
  uint64_t quarantined, missing;
  bool torn;
};

TEST(SpoolStore, CorruptionTable) {
  const std::string journal = std::string(kDir) + "/journal";
  const std::vector<Corruption> table = {
      // m0, m1, m2 are files 1, 2, 3.
      {"truncated message file",
       [](FaultFs* fs) {
         const std::string d = fs->Peek(MsgPath(3));
         fs->Poke(MsgPath(3), d.substr(0, d.size() / 2));
       },
       {"m0", "m1"}, 1, 0, false},
      {"flipped bit in a message file",
       [](FaultFs* fs) {
         std::string d = fs->Peek(MsgPath(2));
         d[d.size() / 2] ^= 0x10;
         fs->Poke(MsgPath(2), d);
       },
       {"m0", "m2"}, 1, 0, false},
      {"torn journal record",
       [&](FaultFs* fs) {
         std::string d = fs->Peek(journal);
         spool::v1::Record r;
         r.mutable_acked()->set_session_id("s");
         r.mutable_acked()->set_message_id("m1");
         r.mutable_acked()->set_agent("b");
         std::string rec;
         AppendJournalRecord(r, &rec);
         fs->Poke(journal, d + rec.substr(0, rec.size() - 3));  // the ack of m1 never finished
       },
       {"m0", "m1", "m2"}, 0, 0, true},
      {"flipped bit in the journal",
       [&](FaultFs* fs) {
         std::string d = fs->Peek(journal);
         d[d.size() - 5] ^= 0x01;  // inside the last record: the ack of m0
         fs->Poke(journal, d);
       },
       {"m0", "m1", "m2"}, 0, 0, true},
      {"missing file named by the journal",
       [](FaultFs* fs) { ASSERT_TRUE(fs->Remove(MsgPath(3)).ok()); },
       {"m0", "m1"}, 0, 1, false},
  };
  for (const Corruption& c : table) {
   for (const MessageBody body : {MessageBody::kPlain, MessageBody::kCoded}) {
    SCOPED_TRACE(std::string(c.name) + (body == MessageBody::kCoded ? ", coded files" : ", plain files"));
    FaultFs fs;
    MakeThree(&fs, body);
    c.damage(&fs);
    auto s = OpenOk(Opts(&fs));
    ASSERT_TRUE(s);
    EXPECT_EQ(s->recovery().quarantined, c.quarantined);
    EXPECT_EQ(s->recovery().missing, c.missing);
    EXPECT_EQ(s->recovery().torn_bytes > 0, c.torn);
    std::set<std::string> held;
    for (const char* id : {"m0", "m1", "m2"}) {
      if (MessagePtr m = s->Find("s", id)) {
        held.insert(id);
        EXPECT_EQ(Fingerprint(*m), Fingerprint(*RealMsg("s", id, {"b"}, 40 + (id[1] - '0')))) << id;
      }
    }
    EXPECT_EQ(held, c.served);
    // What is served is whole, and a damaged file is never served: every
    // delivery is one of the intact messages.
    for (int i = 0; i < 3; ++i) {
      auto d = TryFetch(*s, "s", "b");
      if (!d) break;
      EXPECT_TRUE(c.served.count(d->msg->message_id));
      ASSERT_TRUE(s->Ack("s", "b", d->msg->message_id).ok());
    }
    if (c.quarantined) {
      EXPECT_FALSE(fs.List(std::string(kDir) + "/quarantine")->empty());
    }
   }
  }
}

TEST(SpoolStore, AnUnknownFormatVersionIsRefusedAndLeftAlone) {
  for (const bool journal : {true, false}) {
    FaultFs fs;
    MakeThree(&fs);
    const std::string path = journal ? std::string(kDir) + "/journal" : MsgPath(2);
    std::string d = fs.Peek(path);
    d[8] = 9;  // version 9
    fs.Poke(path, d);
    absl::StatusOr<std::unique_ptr<SpoolStore>> s = SpoolStore::Open({}, Opts(&fs), nullptr);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(s.status().message().find("version 9"), std::string::npos) << s.status();
    EXPECT_EQ(fs.Peek(path), d);
  }
}

// ---- A damaged journal ----
//
// In each case the three messages of MakeThree were acknowledged (their
// Commit returned OK), so none of their files may be lost: each is either
// served whole, or sits in quarantine/ byte for byte, or the relay refuses
// to start and leaves it in place.

constexpr char kJournal[] = "/spool/journal";
constexpr char kQuarantine[] = "/spool/quarantine";

// Where each record of `journal` starts.
std::vector<size_t> RecordStarts(const std::string& journal) {
  std::vector<size_t> starts;
  for (size_t at = kJournalHeaderBytes; at + kRecordHeaderBytes <= journal.size();) {
    starts.push_back(at);
    uint32_t len = 0;
    for (int i = 3; i >= 0; --i) len = (len << 8) | static_cast<uint8_t>(journal[at + i]);
    at += kRecordHeaderBytes + len;
  }
  return starts;
}

// seq -> the bytes of msg/<seq>.kvm, for seqs 1..3 (m0..m2).
std::map<uint64_t, std::string> AcknowledgedFiles(FaultFs& fs) {
  std::map<uint64_t, std::string> files;
  for (uint64_t seq = 1; seq <= 3; ++seq) {
    files[seq] = fs.Peek(MsgPath(seq));
    EXPECT_TRUE(MessageFileCrcOk(files[seq])) << seq;
  }
  return files;
}

// The bytes of every message file in quarantine/ (the journal's copies left out).
std::set<std::string> QuarantinedMessageFiles(FaultFs& fs) {
  std::set<std::string> out;
  absl::StatusOr<std::vector<std::string>> names = fs.List(kQuarantine);
  EXPECT_TRUE(names.ok()) << names.status();
  for (const std::string& name : names.ok() ? *names : std::vector<std::string>()) {
    if (name.rfind("journal", 0) != 0) out.insert(fs.Peek(std::string(kQuarantine) + "/" + name));
  }
  return out;
}

// Refused with FAILED_PRECONDITION naming the way out, and nothing changed.
void ExpectRefusedUnchanged(FaultFs& fs, const std::map<uint64_t, std::string>& files, bool journal_exists) {
  const std::string journal = fs.Peek(kJournal);
  absl::StatusOr<std::unique_ptr<SpoolStore>> s = SpoolStore::Open({}, Opts(&fs), nullptr);
  ASSERT_FALSE(s.ok()) << "started on a journal that does not prove its acknowledged commits";
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition) << s.status();
  EXPECT_NE(s.status().message().find("--spool-salvage"), std::string::npos) << s.status();
  for (const auto& [seq, bytes] : files) EXPECT_EQ(fs.Peek(MsgPath(seq)), bytes) << seq;
  EXPECT_EQ(fs.Peek(kJournal), journal);
  EXPECT_EQ(fs.List(kDir)->size(), journal_exists ? 1u : 0u);  // no journal.tmp either
  EXPECT_EQ(MessageFiles(fs).size(), files.size());
  EXPECT_TRUE(QuarantinedMessageFiles(fs).empty());
}

// Each acknowledged message is served whole when `served` names it, and is
// otherwise in quarantine/ unchanged (and not in msg/).
void ExpectNoneLost(FaultFs& fs, SpoolStore& s, const std::map<uint64_t, std::string>& files,
                    const std::set<std::string>& served) {
  const std::set<std::string> quarantined = QuarantinedMessageFiles(fs);
  for (const auto& [seq, bytes] : files) {
    const std::string id = "m" + std::to_string(seq - 1);
    SCOPED_TRACE(id);
    if (served.count(id)) {
      MessagePtr m = s.Find("s", id);
      ASSERT_TRUE(m);
      EXPECT_EQ(Fingerprint(*m), Fingerprint(*RealMsg("s", id, {"b"}, 40 + static_cast<uint32_t>(seq) - 1)));
      EXPECT_EQ(fs.Peek(MsgPath(seq)), bytes);
    } else {
      EXPECT_FALSE(s.Find("s", id));
      EXPECT_TRUE(quarantined.count(bytes)) << "its file is neither served nor in quarantine/";
      EXPECT_TRUE(fs.Peek(MsgPath(seq)).empty());
    }
  }
}

SpoolOptions Salvage(FaultFs* fs) {
  SpoolOptions o = Opts(fs);
  o.salvage = true;
  return o;
}

TEST(SpoolFormat, JournalScanTellsATornTailFromDamageInTheMiddle) {
  std::string j = JournalHeader();
  std::vector<size_t> starts;
  for (int i = 0; i < 4; ++i) {
    starts.push_back(j.size());
    AppendJournalRecord(CommitRecord("s", "m" + std::to_string(i), i + 1, {"b"}), &j);
  }
  // Cut short by the end of the file: a torn tail.
  absl::StatusOr<JournalScan> s = ScanJournal(absl::string_view(j).substr(0, j.size() - 3));
  ASSERT_TRUE(s.ok());
  EXPECT_TRUE(s->cut_short);
  EXPECT_EQ(s->intact_after, 0u);
  // A flipped payload byte, a length too long, a length past the end: the
  // records after it are found again.
  for (uint32_t len : {0u, 0xfffffff0u, static_cast<uint32_t>(j.size())}) {
    std::string bad = j;
    if (len == 0) {
      bad[starts[1] + kRecordHeaderBytes + 2] ^= 0x40;
    } else {
      for (int i = 0; i < 4; ++i) bad[starts[1] + i] = static_cast<char>((len >> (8 * i)) & 0xff);
    }
    s = ScanJournal(bad);
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(s->records.size(), 1u) << len;
    EXPECT_FALSE(s->cut_short) << len;
    EXPECT_EQ(s->intact_after, starts[2]) << len;
  }
  // The last record damaged, nothing after it: a torn tail, not cut short.
  std::string last = j;
  last[j.size() - 2] ^= 0x40;
  s = ScanJournal(last);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->records.size(), 3u);
  EXPECT_FALSE(s->cut_short);
  EXPECT_EQ(s->intact_after, 0u);
}

TEST(SpoolStore, AFlippedByteMidJournalIsRefusedThenSalvagedIntoQuarantine) {
  FaultFs fs;
  MakeThree(&fs);  // commit m0, commit m1, commit m2, delivered m0, acked m0
  const std::map<uint64_t, std::string> files = AcknowledgedFiles(fs);
  std::string j = fs.Peek(kJournal);
  const std::vector<size_t> starts = RecordStarts(j);
  ASSERT_EQ(starts.size(), 5u);
  j[(starts[1] + starts[2]) / 2] ^= 0x20;  // inside the commit of m1
  fs.Poke(kJournal, j);

  ExpectRefusedUnchanged(fs, files, true);

  {
    auto s = OpenOk(Salvage(&fs));
    ASSERT_TRUE(s);
    EXPECT_TRUE(s->recovery().salvaged);
    EXPECT_EQ(s->recovery().unproven, 2u);
    EXPECT_GT(s->recovery().torn_bytes, 0u);
    ExpectNoneLost(fs, *s, files, {"m0"});
    // The damaged journal is kept beside them.
    EXPECT_EQ(fs.List(kQuarantine)->size(), 3u);
  }
  // Repaired: the next start needs no salvage, and quarantine/ is left alone.
  auto s = OpenOk(Opts(&fs));
  ASSERT_TRUE(s);
  EXPECT_EQ(s->recovery().unproven, 0u);
  ExpectNoneLost(fs, *s, files, {"m0"});
  ASSERT_TRUE(Commit(*s, RealMsg("s", "m9", {"b"}, 9)).ok());
  EXPECT_FALSE(fs.Peek(MsgPath(4)).empty()) << "a new file should not take a quarantined one's name";
}

TEST(SpoolStore, ABadFirstRecordLengthIsRefusedThenSalvagedIntoQuarantine) {
  for (const bool too_long : {true, false}) {
    SCOPED_TRACE(too_long ? "over 1 MiB" : "past the end of the file");
    FaultFs fs;
    MakeThree(&fs);
    const std::map<uint64_t, std::string> files = AcknowledgedFiles(fs);
    std::string j = fs.Peek(kJournal);
    const uint32_t len = too_long ? 0xfffffff0u : static_cast<uint32_t>(j.size());
    for (int i = 0; i < 4; ++i) j[kJournalHeaderBytes + i] = static_cast<char>((len >> (8 * i)) & 0xff);
    fs.Poke(kJournal, j);

    ExpectRefusedUnchanged(fs, files, true);

    auto s = OpenOk(Salvage(&fs));
    ASSERT_TRUE(s);
    EXPECT_EQ(s->recovery().unproven, 3u);
    EXPECT_EQ(s->recovery().messages, 0u);
    ExpectNoneLost(fs, *s, files, {});
  }
}

TEST(SpoolStore, AMissingJournalIsRefusedThenSalvagedIntoQuarantine) {
  FaultFs fs;
  MakeThree(&fs);
  const std::map<uint64_t, std::string> files = AcknowledgedFiles(fs);
  ASSERT_TRUE(fs.Remove(kJournal).ok());

  ExpectRefusedUnchanged(fs, files, false);
  EXPECT_TRUE(fs.Peek(kJournal).empty()) << "a refused start wrote a journal";

  {
    auto s = OpenOk(Salvage(&fs));
    ASSERT_TRUE(s);
    EXPECT_EQ(s->recovery().unproven, 3u);
    ExpectNoneLost(fs, *s, files, {});
  }
  auto s = OpenOk(Opts(&fs));  // a new journal, and no message files left
  ASSERT_TRUE(s);
  ExpectNoneLost(fs, *s, files, {});
}

TEST(SpoolStore, ADamagedJournalHeaderIsRefusedThenSalvaged) {
  FaultFs fs;
  MakeThree(&fs);
  const std::map<uint64_t, std::string> files = AcknowledgedFiles(fs);
  std::string j = fs.Peek(kJournal);
  j[2] ^= 0x01;  // the magic
  fs.Poke(kJournal, j);

  ExpectRefusedUnchanged(fs, files, true);

  {
    // The records after the header are intact: everything is recovered.
    auto s = OpenOk(Salvage(&fs));
    ASSERT_TRUE(s);
    EXPECT_TRUE(s->recovery().salvaged);
    EXPECT_EQ(s->recovery().unproven, 0u);
    ExpectNoneLost(fs, *s, files, {"m0", "m1", "m2"});
    auto d = TryFetch(*s, "s", "b");  // m0 stays acked
    ASSERT_TRUE(d);
    EXPECT_EQ(d->msg->message_id, "m1");
  }
  auto s = OpenOk(Opts(&fs));
  ASSERT_TRUE(s);
  ExpectNoneLost(fs, *s, files, {"m0", "m1", "m2"});
}

// A torn tail keeps its recovery: cut off, and the file of the publish whose
// commit record it cut (never acknowledged) removed as an orphan.
TEST(SpoolStore, ATornTailIsCutAndTheFileItNamedQuarantined) {
  FaultFs fs;
  MakeThree(&fs);
  const std::map<uint64_t, std::string> files = AcknowledgedFiles(fs);
  auto m3 = RealMsg("s", "m3", {"b"}, 43);
  spool::v1::MessageMeta meta;
  meta.set_session_id("s");
  meta.set_message_id("m3");
  meta.add_recipients("b");
  std::string file;
  ASSERT_TRUE(EncodeMessageFile(meta, m3->msg, &file).ok());
  {
    auto f = fs.NewFile(MsgPath(4));
    ASSERT_TRUE(f.ok() && (*f)->Append(file).ok() && (*f)->Sync().ok() && (*f)->Close().ok());
  }
  std::string rec;
  AppendJournalRecord(CommitRecord("s", "m3", 4, {"b"}), &rec);
  fs.Poke(kJournal, fs.Peek(kJournal) + rec.substr(0, rec.size() - 4));

  auto s = OpenOk(Opts(&fs));
  ASSERT_TRUE(s);
  EXPECT_EQ(s->recovery().torn_bytes, rec.size() - 4);
  EXPECT_EQ(s->recovery().orphans, 0u);
  EXPECT_EQ(s->recovery().unproven, 1u);
  EXPECT_FALSE(s->recovery().salvaged);
  EXPECT_TRUE(fs.Peek(MsgPath(4)).empty());
  ExpectNoneLost(fs, *s, files, {"m0", "m1", "m2"});
  // The cut record may have been whole with a rotten length: its file is
  // kept, unchanged and never served.
  EXPECT_EQ(fs.Peek(std::string(kQuarantine) + "/0000000000000004.kvm"), file);
  EXPECT_EQ(s->Find("s", "m3"), nullptr);
}

// Bit rot in the length of the last, acknowledged commit record makes it
// run past the end of the file like a torn tail: its message file goes to
// quarantine/, not away.
TEST(SpoolStore, ARottenLengthOfTheLastRecordKeepsItsFile) {
  FaultFs fs;
  {
    auto s = OpenOk(Opts(&fs));
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(Commit(*s, RealMsg("s", "m" + std::to_string(i), {"b"}, 40 + i)).ok());
  }
  const std::map<uint64_t, std::string> files = AcknowledgedFiles(fs);
  std::string j = fs.Peek(kJournal);
  const std::vector<size_t> starts = RecordStarts(j);
  ASSERT_GE(starts.size(), 3u);
  j[starts.back() + 1] = static_cast<char>(j[starts.back() + 1] ^ 0x08);  // the length grows by 2048
  fs.Poke(kJournal, j);
  auto s = OpenOk(Opts(&fs));
  ASSERT_TRUE(s);
  EXPECT_GT(s->recovery().torn_bytes, 0u);
  EXPECT_EQ(s->recovery().orphans, 0u);
  EXPECT_EQ(s->recovery().unproven, 1u);
  ExpectNoneLost(fs, *s, files, {"m0", "m1"});
}

// A last record that is whole but fails its CRC is cut off like a torn tail
// (nothing intact follows it), but it may be an acknowledged commit hit by
// bit rot: the file it named goes to quarantine/, not away.
TEST(SpoolStore, ADamagedLastRecordIsCutAndTheFileItNamedQuarantined) {
  FaultFs fs;
  {
    auto s = OpenOk(Opts(&fs));
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(Commit(*s, RealMsg("s", "m" + std::to_string(i), {"b"}, 40 + i)).ok());
  }
  const std::map<uint64_t, std::string> files = AcknowledgedFiles(fs);
  std::string j = fs.Peek(kJournal);
  j[j.size() - 3] ^= 0x08;  // inside the commit of m2
  fs.Poke(kJournal, j);

  auto s = OpenOk(Opts(&fs));
  ASSERT_TRUE(s);
  EXPECT_GT(s->recovery().torn_bytes, 0u);
  EXPECT_FALSE(s->recovery().salvaged);
  EXPECT_EQ(s->recovery().unproven, 1u);
  ExpectNoneLost(fs, *s, files, {"m0", "m1"});
}

// ---- I/O faults ----

TEST(SpoolStore, IoFaultsGiveTheirCodesAndLeaveNothingVisible) {
  struct Fault {
    const char* op;
    const char* path;
    absl::Status status;
    absl::StatusCode want;
    bool stops_writes;
  };
  const std::vector<Fault> faults = {
      {"write", ".tmp", absl::ResourceExhaustedError("write: No space left on device"),
       absl::StatusCode::kResourceExhausted, false},
      {"fdatasync", ".tmp", absl::UnavailableError("fdatasync: Input/output error"), absl::StatusCode::kUnavailable,
       false},
      {"open", ".tmp", absl::UnavailableError("open: Input/output error"), absl::StatusCode::kUnavailable, false},
      {"fsync", "/msg", absl::UnavailableError("fsync: Input/output error"), absl::StatusCode::kUnavailable, true},
      {"fdatasync", "journal", absl::UnavailableError("fdatasync: Input/output error"),
       absl::StatusCode::kUnavailable, true},
      {"write", "journal", absl::ResourceExhaustedError("write: No space left on device"),
       absl::StatusCode::kUnavailable, true},
  };
  for (const Fault& f : faults) {
    SCOPED_TRACE(std::string(f.op) + " " + f.path);
    FaultFs fs;
    auto s = OpenOk(Opts(&fs));
    bool failed_called = false;
    s->SetOnFailure([&](const absl::Status&) { failed_called = true; });
    ASSERT_TRUE(Commit(*s, RealMsg("s", "ok", {"b"}, 1)).ok());
    fs.FailOn(f.op, f.path, f.status);
    absl::StatusOr<Store::CommitResult> r = Commit(*s, RealMsg("s", "bad", {"b"}, 2));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), f.want) << r.status();
    EXPECT_EQ(!s->health().ok(), f.stops_writes);
    EXPECT_EQ(failed_called, f.stops_writes);
    if (f.stops_writes) {
      // Never appended to or written again: every later write is refused.
      EXPECT_EQ(Commit(*s, RealMsg("s", "later", {"b"}, 3)).status().code(), absl::StatusCode::kUnavailable);
      EXPECT_EQ(s->Ack("s", "b", "ok").code(), absl::StatusCode::kUnavailable);
    } else {
      // A message file that failed is not visible, and leaves no file.
      EXPECT_FALSE(s->Find("s", "bad"));
      const std::vector<std::string> names = MessageFiles(fs);
      for (const std::string& n : names) EXPECT_EQ(n.find(".tmp"), std::string::npos) << n;
      EXPECT_TRUE(Commit(*s, RealMsg("s", "after", {"b"}, 4)).ok());
    }
    s.reset();
    // Whatever happened, a restart serves "ok" and never a half-written "bad".
    auto again = OpenOk(Opts(&fs));
    EXPECT_TRUE(again->Find("s", "ok"));
    if (MessagePtr bad = again->Find("s", "bad")) {
      EXPECT_EQ(Fingerprint(*bad), Fingerprint(*RealMsg("s", "bad", {"b"}, 2)));
    }
  }
}

TEST(SpoolStore, MaxSpoolBytesIsResourceExhausted) {
  FaultFs fs;
  SpoolOptions o = Opts(&fs);
  o.max_spool_bytes = 3000;
  auto s = OpenOk(o);
  ASSERT_TRUE(Commit(*s, RealMsg("s", "a", {"b"}, 1)).ok());
  absl::StatusOr<Store::CommitResult> r = Commit(*s, RealMsg("s", "b", {"b"}, 2, 40));
  ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_NE(r.status().message().find("--max-spool-bytes=3000"), std::string::npos);
  EXPECT_FALSE(s->Find("s", "b"));
}

// What msg/ holds: each message file by seq.
std::map<std::string, std::string> FilesOf(FaultFs& fs) {
  std::map<std::string, std::string> out;
  for (const std::string& name : MessageFiles(fs)) out[name] = fs.Peek(std::string(kDir) + "/msg/" + name);
  return out;
}

// A relay that codes its files: messages of every policy come back bit for
// bit after a restart, each file smaller than its plain form when the
// message is quantized, and the spool's bytes are the files' on disk.
TEST(SpoolStore, CodedFilesRecoverEveryPolicyBitForBit) {
  FaultFs fs;
  SpoolOptions o = Opts(&fs);
  o.message_body = MessageBody::kCoded;
  std::map<std::string, std::string> want;  // id -> PlainBytes
  {
    auto s = OpenOk(o);
    int i = 0;
    for (const char* spec : kPolicySpecs) {
      auto m = PolicyMsg("s", "m" + std::to_string(i), spec, 20 + i);
      want[m->message_id] = PlainBytes(m->msg);
      ASSERT_TRUE(Commit(*s, m).ok()) << spec;
      ++i;
    }
  }
  uint64_t on_disk = fs.Peek(std::string(kDir) + "/journal").size(), plain_total = 0;
  std::cout << "spool files, plain -> coded as written by SpoolStore:\n";
  for (const auto& [name, file] : FilesOf(fs)) {
    EXPECT_EQ(FileVersion(file), 2u) << name;
    absl::StatusOr<SpoolMessage> sm = DecodeMessageFile(file);
    ASSERT_TRUE(sm.ok()) << name << ": " << sm.status();
    std::string plain;
    ASSERT_TRUE(EncodeMessageFile(sm->meta, sm->msg, &plain).ok());
    std::cout << "  " << sm->meta.requested_policy() << ": " << plain.size() << " -> " << file.size() << "\n";
    if (sm->msg.layers[0].quant) {
      EXPECT_LT(file.size(), plain.size()) << name;
    }
    on_disk += file.size();
    plain_total += plain.size();
  }
  std::cout << "  all: " << plain_total << " -> " << on_disk << " (journal included)\n";
  auto s = OpenOk(o);
  EXPECT_EQ(s->recovery().messages, want.size());
  EXPECT_EQ(s->recovery().quarantined, 0u);
  EXPECT_EQ(s->recovery().bytes, on_disk);
  for (const auto& [id, bytes] : want) {
    MessagePtr m = s->Find("s", id);
    ASSERT_TRUE(m) << id;
    EXPECT_EQ(PlainBytes(m->msg), bytes) << id;
    EXPECT_EQ(m->sender, "a");
  }
  // What a fetch delivers is the message accepted, in order.
  for (size_t i = 0; i < want.size(); ++i) {
    auto d = TryFetch(*s, "s", "b");
    ASSERT_TRUE(d);
    EXPECT_EQ(d->msg->message_id, "m" + std::to_string(i));
    EXPECT_EQ(PlainBytes(d->msg->msg), want[d->msg->message_id]);
    ASSERT_TRUE(s->Ack("s", "b", d->msg->message_id).ok());
  }
}

// Files of either form are read whatever the relay writes: an earlier
// relay's spool (plain) recovered by one that codes, and back.
TEST(SpoolStore, EitherFormIsRecoveredWhateverTheRelayWrites) {
  FaultFs fs;
  SpoolOptions plain = Opts(&fs), coded = Opts(&fs);
  coded.message_body = MessageBody::kCoded;
  std::map<std::string, std::string> want;
  int next = 0;
  auto commit = [&](SpoolStore& s, const char* spec) {
    auto m = PolicyMsg("s", "m" + std::to_string(next), spec, 30 + next);
    ++next;
    want[m->message_id] = PlainBytes(m->msg);
    ASSERT_TRUE(Commit(s, m).ok()) << spec;
  };
  auto expect_all = [&](SpoolStore& s) {
    EXPECT_EQ(s.recovery().messages, want.size());
    for (const auto& [id, bytes] : want) {
      MessagePtr m = s.Find("s", id);
      ASSERT_TRUE(m) << id;
      EXPECT_EQ(PlainBytes(m->msg), bytes) << id;
    }
  };
  {
    auto s = OpenOk(plain);
    commit(*s, "full+int4");
    commit(*s, "full");
  }
  {
    auto s = OpenOk(coded);
    expect_all(*s);
    commit(*s, "full+lloyd:bits=3");
    commit(*s, "h2o-head:k=8+demote:bits=2+lloyd:bits=4");
  }
  {
    auto s = OpenOk(plain);
    expect_all(*s);
    commit(*s, "h2o-head:k=16+demote:bits=2+int4:group=32");
  }
  auto s = OpenOk(coded);
  expect_all(*s);
  // Each file keeps the form it was written in.
  std::vector<uint32_t> versions;
  for (const auto& [name, file] : FilesOf(fs)) versions.push_back(FileVersion(file));
  EXPECT_EQ(versions, (std::vector<uint32_t>{1, 1, 2, 2, 1}));
}

// A coded file whose body is damaged is quarantined as a plain one is:
// behind a bad CRC32C, and behind a good one (the body's own checks).
TEST(SpoolStore, ADamagedCodedFileIsQuarantinedAndNeverServed) {
  for (const bool fix_crc : {false, true}) {
    SCOPED_TRACE(fix_crc ? "CRC32C made right" : "CRC32C wrong");
    FaultFs fs;
    SpoolOptions o = Opts(&fs);
    o.message_body = MessageBody::kCoded;
    std::string want;
    {
      auto s = OpenOk(o);
      auto m0 = PolicyMsg("s", "m0", "full+lloyd:bits=3", 40);
      want = PlainBytes(m0->msg);
      ASSERT_TRUE(Commit(*s, m0).ok());
      ASSERT_TRUE(Commit(*s, PolicyMsg("s", "m1", "full+int4", 41)).ok());
    }
    std::string d = fs.Peek(MsgPath(2));
    d[d.size() - 40] ^= 0x04;  // inside the last blob
    const std::string damaged = fix_crc ? WithCrc(d) : d;
    fs.Poke(MsgPath(2), damaged);
    auto s = OpenOk(o);
    ASSERT_TRUE(s);
    EXPECT_EQ(s->recovery().quarantined, 1u);
    EXPECT_FALSE(s->Find("s", "m1"));
    MessagePtr m0 = s->Find("s", "m0");
    ASSERT_TRUE(m0);
    EXPECT_EQ(PlainBytes(m0->msg), want);
    EXPECT_EQ(fs.Peek(std::string(kQuarantine) + "/0000000000000002.kvm"), damaged);
    auto dl = TryFetch(*s, "s", "b");
    ASSERT_TRUE(dl);
    EXPECT_EQ(dl->msg->message_id, "m0");
    ASSERT_TRUE(s->Ack("s", "b", "m0").ok());
    EXPECT_FALSE(TryFetch(*s, "s", "b"));
  }
}

// --max-spool-bytes counts what is on disk: a coded file that fits is
// accepted where its plain form would not fit.
TEST(SpoolStore, MaxSpoolBytesCountsTheCodedFile) {
  auto size_of = [](MessageBody body) {
    FaultFs fs;
    SpoolOptions o = Opts(&fs);
    o.message_body = body;
    auto s = OpenOk(o);
    EXPECT_TRUE(Commit(*s, PolicyMsg("s", "m", "full+lloyd:bits=3", 50)).ok());
    return std::pair<uint64_t, uint64_t>(fs.Peek(MsgPath(1)).size(), fs.Peek(std::string(kDir) + "/journal").size());
  };
  const auto [coded, journal] = size_of(MessageBody::kCoded);
  const uint64_t plain = size_of(MessageBody::kPlain).first;
  ASSERT_LT(coded, plain);
  const uint64_t limit = journal + coded;  // the journal holds at most this much when the file is checked
  for (const MessageBody body : {MessageBody::kCoded, MessageBody::kPlain}) {
    FaultFs fs;
    SpoolOptions o = Opts(&fs);
    o.message_body = body;
    o.max_spool_bytes = limit;
    auto s = OpenOk(o);
    absl::StatusOr<Store::CommitResult> r = Commit(*s, PolicyMsg("s", "m", "full+lloyd:bits=3", 50));
    if (body == MessageBody::kCoded) {
      ASSERT_TRUE(r.ok()) << r.status();
      // Full now: the next one is refused.
      r = Commit(*s, PolicyMsg("s", "m2", "full+lloyd:bits=3", 51));
    }
    EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
    EXPECT_NE(r.status().message().find("--max-spool-bytes"), std::string::npos) << r.status();
  }
}

// ---- Crashes and power losses ----

// What the clients were told: every publish that returned OK (with its
// fingerprint), every ack that returned OK, every close that returned OK.
// A call that failed may or may not have taken effect: an ack that failed
// is "maybe acked", and a close that failed frees nothing the test may
// still ask for.
struct Told {
  std::map<std::pair<std::string, std::string>, uint32_t> committed;
  std::set<std::tuple<std::string, std::string, std::string>> acked, maybe_acked;
  std::set<std::string> closed, maybe_closed;

  // After a close, the same ids may be published anew.
  void ForgetAcks(const std::string& session) {
    for (auto* set : {&acked, &maybe_acked}) {
      for (auto it = set->begin(); it != set->end();) {
        it = std::get<0>(*it) == session ? set->erase(it) : std::next(it);
      }
    }
  }
};

// Drives random publishes, fetches, acks and closes until the file system
// dies (or `steps` run out).
// SPOOL_TEST_DEBUG=SEED runs that seed alone and prints every call and crash.
bool Debug() { return std::getenv("SPOOL_TEST_DEBUG") != nullptr; }

void Drive(SpoolStore& s, std::mt19937& rng, int steps, Told* told, FaultFs& fs) {
  for (int i = 0; i < steps && !fs.dead(); ++i) {
    const std::string session = "s" + std::to_string(rng() % 3);
    const int what = static_cast<int>(rng() % 10);
    if (what < 5) {
      const std::string id = "m" + std::to_string(rng() % 40);
      const uint32_t seed = static_cast<uint32_t>(std::hash<std::string>()(session + id));
      auto m = RealMsg(session, id, {"b", "c"}, seed);
      const uint32_t fp = Fingerprint(*m);
      absl::StatusOr<Store::CommitResult> r = Commit(s, m);
      if (Debug()) std::cout << "publish " << session << "/" << id << " " << r.status() << (r.ok() && r->duplicate ? " dup" : "") << "\n";
      if (r.ok()) {
        told->committed[{session, id}] = Fingerprint(*r->msg);
        EXPECT_EQ(Fingerprint(*r->msg), fp);
      }
      // A publish reopens a closed session, and one that failed may have.
      told->closed.erase(session);
    } else if (what < 9) {
      const std::string agent = rng() % 2 ? "b" : "c";
      if (auto d = TryFetch(s, session, agent)) {
        if (rng() % 4) {
          const auto key = std::make_tuple(session, d->msg->message_id, agent);
          absl::Status a = s.Ack(session, agent, d->msg->message_id);
          if (Debug()) std::cout << "ack " << session << "/" << d->msg->message_id << " " << agent << " " << a << "\n";
          (a.ok() ? told->acked : told->maybe_acked).insert(key);
        }
      }
    } else {
      // Closed or not, its messages need not be there any more.
      for (auto it = told->committed.begin(); it != told->committed.end();) {
        it = it->first.first == session ? told->committed.erase(it) : std::next(it);
      }
      const absl::Status cs = s.CloseSessionAndPeers(session).status;
      if (Debug()) std::cout << "close " << session << " " << cs << "\n";
      if (cs.ok()) {
        told->closed.insert(session);
        told->ForgetAcks(session);
      } else {
        told->maybe_closed.insert(session);
      }
    }
  }
}

// The three invariants against a recovered store; returns the violations.
// It drains (fetches and acks) every mailbox, and records those acks.
std::vector<std::string> Check(SpoolStore& s, Told& told) {
  std::vector<std::string> bad;
  for (const auto& [key, fp] : told.committed) {
    const auto& [session, id] = key;
    MessagePtr m = s.Find(session, id);
    if (!m) {
      bad.push_back("accepted " + session + "/" + id + " is gone");
      continue;
    }
    if (Fingerprint(*m) != fp) bad.push_back("accepted " + session + "/" + id + " changed");
  }
  for (const std::string& c : told.closed) {
    if (!s.IsClosed(c)) bad.push_back("closed " + c + " is open again");
  }
  // Drain every mailbox: an acked message never comes again; each id once.
  std::set<std::tuple<std::string, std::string, std::string>> drained;
  for (const char* session : {"s0", "s1", "s2"}) {
    for (const char* agent : {"b", "c"}) {
      std::set<std::string> seen;
      for (int i = 0; i < 300; ++i) {
        auto d = TryFetch(s, session, agent);  // (re)marks it delivered: a lost delivery record is no loss
        if (!d) break;
        const std::string id = d->msg->message_id;
        if (told.acked.count({session, id, agent})) {
          bad.push_back("acked " + std::string(session) + "/" + id + " to " + agent + " came again");
        }
        seen.insert(id);
        if (!s.Ack(session, agent, id).ok()) bad.push_back("ack of " + id + " after recovery failed");
        drained.insert({session, id, agent});
      }
      // Every accepted message not acked (for sure or maybe) was in the mailbox.
      for (const auto& [key, fp] : told.committed) {
        const auto k = std::make_tuple(key.first, key.second, std::string(agent));
        if (key.first == session && !told.acked.count(k) && !told.maybe_acked.count(k) && !seen.count(key.second)) {
          bad.push_back("accepted " + key.first + "/" + key.second + " not fetchable by " + agent);
        }
      }
    }
  }
  told.acked.insert(drained.begin(), drained.end());
  return bad;
}

// Runs `seeds` crash loops; returns how many ended with a violation.
int CrashLoops(int seeds, bool power_loss, bool fsync, bool sync_dir, std::string* first,
               MessageBody body = MessageBody::kPlain) {
  int violated = 0;
  for (int seed = 1; seed <= seeds; ++seed) {
    if (Debug() && seed != std::atoi(std::getenv("SPOOL_TEST_DEBUG"))) continue;
    FaultFs fs;
    SpoolOptions o = Opts(&fs);
    o.fsync = fsync;
    o.sync_dir = sync_dir;
    o.compact_bytes = 2048;  // compactions happen in the loop too
    o.message_body = body;
    std::mt19937 rng(seed);
    Told told;
    for (int round = 0; round < 4; ++round) {
      auto s = OpenOk(o);
      if (!s) return seeds;  // counted as violations: recovery itself failed
      fs.Crash(static_cast<long>(20 + rng() % 400));
      Drive(*s, rng, 200, &told, fs);
      if (Debug()) std::cout << "--- crash\n";
      s.reset();  // the dead process's store: nothing more reaches the disk
      if (power_loss) fs.PowerLoss();
      fs.Revive();
      auto r = OpenOk(o);
      if (!r) return seeds;
      std::vector<std::string> bad = Check(*r, told);
      if (!bad.empty()) {
        ++violated;
        if (first->empty()) *first = "seed " + std::to_string(seed) + ": " + bad[0];
        break;
      }
      // A close that failed took effect or did not; now it is known.
      for (const std::string& m : told.maybe_closed) {
        if (r->IsClosed(m)) {
          told.closed.insert(m);
          told.ForgetAcks(m);
        }
      }
      told.maybe_closed.clear();
    }
  }
  return violated;
}

TEST(SpoolCrash, KillNineAtAnyStepLosesNothingAccepted) {
  std::string first;
  EXPECT_EQ(CrashLoops(30, /*power_loss=*/false, /*fsync=*/true, /*sync_dir=*/true, &first), 0) << first;
}

TEST(SpoolCrash, KillNineWithoutFsyncLosesNothingEither) {
  // The page cache survives a process crash.
  std::string first;
  EXPECT_EQ(CrashLoops(20, false, /*fsync=*/false, true, &first), 0) << first;
}

TEST(SpoolCrash, PowerLossAtAnyStepLosesNothingAccepted) {
  std::string first;
  EXPECT_EQ(CrashLoops(30, /*power_loss=*/true, true, true, &first), 0) << first;
}

TEST(SpoolCrash, KillNineAndPowerLossWithCodedFilesLoseNothingAccepted) {
  std::string first;
  EXPECT_EQ(CrashLoops(15, /*power_loss=*/false, true, true, &first, MessageBody::kCoded), 0) << first;
  EXPECT_EQ(CrashLoops(15, /*power_loss=*/true, true, true, &first, MessageBody::kCoded), 0) << first;
}

TEST(SpoolCrash, NegativeControlWithoutFsyncThePowerLossTestFails) {
  std::string first;
  EXPECT_GT(CrashLoops(10, true, /*fsync=*/false, true, &first), 0) << "the power-loss test cannot see a missing fsync";
  std::cout << "without fsync: " << first << "\n";
}

TEST(SpoolCrash, NegativeControlWithoutDirectoryFsyncThePowerLossTestFails) {
  std::string first;
  EXPECT_GT(CrashLoops(10, true, true, /*sync_dir=*/false, &first), 0)
      << "the power-loss test cannot see a missing directory fsync";
  std::cout << "without directory fsync: " << first << "\n";
}

}  // namespace
}  // namespace kvrelay
