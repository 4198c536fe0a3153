// Writes the seed corpora of the fuzzers into DIR/<target>/ (the committed
// ones are fuzz/corpus/): small valid inputs built with kvrelay's own
// writers, plus near-valid ones (truncated, a byte changed, a field out of
// range). Deterministic: the same files on every run.
//
//   build-fuzz/bin/fuzz_make_corpus fuzz/corpus
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/crc32c.h"
#include "core/format/safetensors.h"
#include "core/format/synthetic.h"
#include "core/format/turn_file.h"
#include "core/pipeline.h"
#include "fuzz/fuzz_frames.h"
#include "fuzz/spool_fuzz.h"
#include "proto/raw_chunk.h"
#include "proto/stream_codec.h"
#include "proto/wire_codec.h"
#include "proto/wire.h"

namespace kvrelay {
namespace {

std::string g_root;

void Die(const std::string& what) {
  std::fprintf(stderr, "fuzz_make_corpus: %s\n", what.c_str());
  std::exit(1);
}

template <typename T>
T Must(absl::StatusOr<T> v, const std::string& what) {
  if (!v.ok()) Die(what + ": " + v.status().ToString());
  return *std::move(v);
}

void Write(const std::string& target, const std::string& name, const std::string& bytes) {
  const std::string dir = g_root + "/" + target;
  mkdir(g_root.c_str(), 0755);
  mkdir(dir.c_str(), 0755);
  const std::string path = dir + "/" + name;
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr || std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size() || std::fclose(f) != 0) {
    Die("cannot write " + path);
  }
}

// Near-valid variants of a binary seed: cut in half, and one byte changed.
void WriteVariants(const std::string& target, const std::string& name, const std::string& bytes, size_t flip_at) {
  Write(target, name, bytes);
  Write(target, name + ".truncated", bytes.substr(0, bytes.size() / 2));
  std::string flipped = bytes;
  if (!flipped.empty()) flipped[flip_at % flipped.size()] ^= 0x20;
  Write(target, name + ".flipped", flipped);
}

Turn TinyTurn(DType dtype, int n_history, int score_heads, uint64_t seed) {
  SyntheticTurnOptions o;
  o.layers = 2;
  o.kv_heads = 2;
  o.score_heads = score_heads;
  o.head_dim = 8;
  o.n_prompt = 12;
  o.n_gen = 3;
  o.n_history = n_history;
  o.value_rank = 2;
  o.dtype = dtype;
  o.seed = seed;
  return Must(MakeSyntheticTurn(o), "synthetic turn");
}

Message Compress(const Turn& turn, const std::string& spec) {
  std::unique_ptr<Pipeline> p = Must(Pipeline::Create(spec), spec);
  return Must(p->Compress(turn), "compress with " + spec);
}

std::string Flatten(const grpc::ByteBuffer& b) {
  std::vector<grpc::Slice> slices;
  if (!b.Dump(&slices).ok()) Die("ByteBuffer::Dump");
  std::string out;
  for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

// A whole stream of Msg: `header`, the chunks of `tensors` (at most
// `max_chunk` bytes each), the trailer; each message a frame.
template <typename Msg>
std::vector<std::string> Stream(const Msg& header, std::vector<TensorRef> tensors, size_t max_chunk) {
  std::vector<std::string> out = {header.SerializeAsString()};
  ChunkStreamWriter w(max_chunk);
  w.Append(std::move(tensors), nullptr);
  grpc::ByteBuffer b;
  while (w.FillNext<Msg>(&b)) out.push_back(Flatten(b));
  return out;
}

std::string StreamInput(uint8_t flags, uint8_t cut, const std::vector<std::string>& frames) {
  std::string out;
  out.push_back(static_cast<char>(flags));
  out.push_back(static_cast<char>(cut));
  for (const std::string& f : frames) fuzz::AppendFrame(f, &out);
  return out;
}

void FormatSeeds() {
  const Turn bf16 = TinyTurn(DType::kBF16, 0, 0, 1);
  const Turn f32_history = TinyTurn(DType::kF32, 4, 0, 2);
  const Turn f16_gqa = TinyTurn(DType::kF16, 0, 4, 3);
  std::string bytes;
  int i = 0;
  for (const Turn* t : {&bf16, &f32_history, &f16_gqa}) {
    if (!WriteTurn(*t, &bytes).ok()) Die("WriteTurn");
    WriteVariants("turn_file", "turn" + std::to_string(i), bytes, 20 + 7 * i);
    if (i == 0) Write("safetensors", "turn0", bytes);
    ++i;
  }
  i = 0;
  for (const char* spec : {"full", "h2o-head:k=4", "h2o-layer:k=4+obf:p=2,mode=fast", "h2o-head:k=4+int4:group=8",
                           "gen:sinks=2+int8"}) {
    if (!WriteMessage(Compress(f32_history, spec), &bytes).ok()) Die("WriteMessage");
    WriteVariants("message_file", "message" + std::to_string(i), bytes, 30 + 11 * i);
    if (i == 3) Write("safetensors", "message3", bytes);
    ++i;
  }

  // Generic files: every dtype the reader knows, metadata, a scalar, an
  // empty tensor, and malformed headers.
  const std::vector<uint8_t> data(64, 0x3c);
  std::vector<StTensor> tensors;
  const char* names[] = {"BOOL", "U8", "I8", "U16", "I16", "F16", "BF16", "U32",
                         "I32", "F32", "U64", "I64", "F64", "F8_E4M3", "F8_E5M2"};
  for (const char* n : names) {
    StTensor t;
    t.name = std::string("t.") + n;
    t.dtype = *ParseStDType(n);
    t.shape = {2};
    t.data = absl::MakeConstSpan(data.data(), 2 * StDTypeSize(t.dtype));
    tensors.push_back(t);
  }
  StTensor scalar{"scalar", StDType::kF32, {}, absl::MakeConstSpan(data.data(), 4)};
  StTensor empty{"empty", StDType::kF32, {0, 3}, {}};
  tensors.push_back(scalar);
  tensors.push_back(empty);
  const std::string all = Must(SerializeSafetensors(tensors, {{"format", "pt"}, {"note", "seed"}}), "serialize");
  WriteVariants("safetensors", "dtypes", all, 40);
  auto raw_file = [](const std::string& header, const std::string& body) {
    std::string out(8, '\0');
    for (int b = 0; b < 8; ++b) out[b] = static_cast<char>((uint64_t{header.size()} >> (8 * b)) & 0xff);
    return out + header + body;
  };
  Write("safetensors", "empty_header", raw_file("{}", ""));
  Write("safetensors", "metadata_only", raw_file(R"({"__metadata__":{"a":"b"}})", ""));
  Write("safetensors", "overlap",
        raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                 R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                 std::string(12, '\0')));
  Write("safetensors", "past_end",
        raw_file(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", std::string(8, '\0')));
  Write("safetensors", "bad_dtype", raw_file(R"({"a":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]}})", "x"));
  Write("safetensors", "huge_shape",
        raw_file(R"({"a":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,8]}})",
                 std::string(8, '\0')));
}

void WireSeeds() {
  const Turn turn = TinyTurn(DType::kBF16, 0, 0, 4);
  const Turn history = TinyTurn(DType::kF16, 3, 0, 5);
  Turn scored = history;  // with this agent's mass on the history
  for (TurnLayer& l : scored.layers) {
    l.history_score = ScoreMatrix(l.scores.rows, l.history_k.tokens());
    for (size_t j = 0; j < l.history_score.data.size(); ++j) l.history_score.data[j] = 0.125f * (j % 3);
  }
  int i = 0;
  for (const Turn* t : std::initializer_list<const Turn*>{&turn, &history, &scored}) {
    v1::PublishRequest header;
    v1::PublishHeader* h = header.mutable_header();
    h->set_session_id("s1");
    h->set_sender("planner");
    h->add_recipients("critic");
    *h->mutable_geometry() = Must(TurnGeometryOf(*t), "geometry");
    std::vector<std::string> frames = Stream(header, TurnUploadOrder(*t), i == 0 ? 100 : 1 << 20);
    Write("stream_codec", "upload" + std::to_string(i), StreamInput(0, 0, frames));
    Write("stream_codec", "upload" + std::to_string(i) + ".sliced", StreamInput(2, 7, frames));
    frames.pop_back();
    Write("stream_codec", "upload" + std::to_string(i) + ".no_commit", StreamInput(0, 0, frames));
    ++i;
  }
  i = 0;
  for (const char* spec : {"h2o-head:k=4", "h2o-head:k=4+int4:group=8", "gen:sinks=2+int2"}) {
    const Message m = Compress(history, spec);
    v1::FetchResponse header;
    *header.mutable_header() = MessageHeaderOf(m);
    header.mutable_header()->set_message_id("m1");
    std::vector<std::string> frames = Stream(header, MessageDeliveryOrder(m), i == 0 ? 64 : 1 << 20);
    Write("stream_codec", "delivery" + std::to_string(i), StreamInput(1, 0, frames));
    Write("stream_codec", "delivery" + std::to_string(i) + ".sliced", StreamInput(3, 5, frames));
    if (i == 0) {
      std::swap(frames[1], frames[2]);
      Write("stream_codec", "delivery0.swapped", StreamInput(1, 0, frames));
      Write("raw_chunk", "fetch_chunk", std::string(1, '\0') + frames[1]);
      Write("raw_chunk", "fetch_chunk.sliced", std::string(1, '\3') + frames[1]);
      Write("raw_chunk", "fetch_header", std::string(1, '\0') + frames[0]);
      Write("raw_chunk", "fetch_trailer", std::string(1, '\0') + frames.back());
    }
    ++i;
  }

  // Chunks: plain, unusual encodings (fields out of order, a field twice,
  // an unknown field, a part out of range), and non-chunks.
  v1::PublishRequest req;
  v1::Chunk* c = req.mutable_chunk();
  c->set_layer(1);
  c->set_part(v1::PART_GEN_V);
  c->set_offset(64);
  c->set_data("0123456789abcdef");
  c->set_crc32c(0x12345678);
  const std::string plain = req.SerializeAsString();
  Write("raw_chunk", "publish_chunk", std::string(1, '\0') + plain);
  Write("raw_chunk", "publish_chunk.sliced", std::string(1, '\1') + plain);
  Write("raw_chunk", "publish_chunk.twice", std::string(1, '\0') + plain + plain);
  v1::Chunk inner = *c;
  inner.set_part(static_cast<v1::Part>(-7));
  inner.clear_layer();
  const std::string reordered = inner.SerializeAsString() + std::string("\x08\x05", 2);  // layer = 5 after the other fields
  std::string wrapped;
  wrapped.push_back(0x12);
  wrapped.push_back(static_cast<char>(reordered.size()));
  Write("raw_chunk", "publish_chunk.reordered", std::string(1, '\0') + wrapped + reordered);
  Write("raw_chunk", "publish_chunk.unknown_field",
        std::string(1, '\0') + plain + std::string("\xf8\x01\x01", 3));
  v1::PublishRequest commit;
  commit.mutable_commit()->set_chunks(3);
  Write("raw_chunk", "publish_commit", std::string(1, '\0') + commit.SerializeAsString());
  Write("raw_chunk", "empty", std::string(1, '\0'));
}

void TextSeeds() {
  int i = 0;
  for (const char* spec : {"full", "gen:sinks=2", "h2o-head:k=32+obf:p=8,mode=fast",
                           "h2o-head:k=16+obf:mode=fast,p=4+int4:rotate=hadamard", "h2o-layer:k=8+obf:scale=ad_frac",
                           "h2o-head+obf:mode=fast,iters=5,oversample=3", "h2o-head:k=4+int8:group=32", "top8+obf",
                           "h2o-head:k=+obf", "h2o-head:k=99999999999999999999", "obf+h2o-head"}) {
    Write("policy_spec", "spec" + std::to_string(i++), spec);
  }
  i = 0;
  for (const char* cfg : {
           "{}",
           R"({"listen": "127.0.0.1:50051", "metrics-listen": "off", "worker_threads": 2,
  "max-inflight-bytes": "1GiB", "max-mailbox-bytes": 1048576, "session-ttl-seconds": 0.5,
  "default-policy": "h2o-head:k=32+obf:p=8,mode=fast", "role-policy": {"critic": "full"}})",
           R"({"listen": ["127.0.0.1:50051", "unix:/tmp/kvrelay.sock"], "routes": {"critic": "relay-b:50051"},
  "advertise": "relay-a:50051", "forward-timeout-seconds": 30, "max-outbox-bytes": "4GiB",
  "max-outbox-bytes-per-destination": "1GiB", "route-template": "{agent}.relay:50051"})",
           R"({"listen": "0.0.0.0:50051", "tls-cert": "/etc/kvrelay/tls.crt", "tls-key": "/etc/kvrelay/tls.key",
  "tls-client-ca": "/etc/kvrelay/ca.crt", "peer-identity": ["*.relay.svc", "relay-b"],
  "tokens-file": "/etc/kvrelay/tokens", "local-auth": "token", "local-listen": "127.0.0.1:50052",
  "health-listen": "0.0.0.0:8081", "log-json": true, "heap-retain-bytes": "128MiB"})",
           R"({"listen": "0.0.0.0:50051", "insecure": true, "route": ["a=b:1", "c=dns:///d:2"]})",
           R"({"worker-threads": -1})",
           R"({"max-inflight-bytes": "4XiB"})",
           R"({"listen": "0.0.0.0:50051"})",
           R"({"role-policy": {"": "full"}})",
           R"([1, 2])",
           R"({"listen": )",
       }) {
    Write("server_config", "config" + std::to_string(i++) + ".json", cfg);
  }
  i = 0;
  for (const char* routes : {
           "{}",
           R"({"critic": "relay-b:50051", "planner": "dns:///relay-a.ns.svc:50051", "coder": "unix:/run/r.sock"})",
           R"({"critic": "ipv4:10.0.0.2:50051", "x.y:z-1": "[::1]:50051"})",
           R"({"critic": "a:1", "critic": "b:2"})",
           R"({"critic": "relay-b:0"})",
           R"({"bad agent": "relay-b:1"})",
           R"({"critic": 5})",
           R"(["critic"])",
       }) {
    Write("route_file", "routes" + std::to_string(i++) + ".json", routes);
  }
  const std::string hex(64, 'a'), hex2 = std::string(63, 'b') + "F";
  i = 0;
  for (const std::string& tokens : {
           std::string(""),
           "planner sha256:" + hex + "\n",
           "# agents\nplanner sha256:" + hex + "  # the planner\n\n\tcritic\tsha256:" + hex2 + "\n",
           "planner sha256:" + hex + "\ncritic sha256:" + hex + "\n",
           "planner sha256:" + hex.substr(1) + "\n",
           "planner " + hex + "\n",
           "planner sha256:" + hex + " extra\n",
           "bad/agent sha256:" + hex + "\n",
       }) {
    Write("tokens_file", "tokens" + std::to_string(i++), tokens);
  }
}

void MustOk(const absl::Status& s, const std::string& what) {
  if (!s.ok()) Die(what + ": " + s.ToString());
}

// `file` (a message file or journal) with its version field set to
// `version`; a message file gets its CRC32C again, so that only the version
// is wrong.
std::string WithVersion(std::string file, uint32_t version, bool message_file) {
  for (int b = 0; b < 4; ++b) file[8 + b] = static_cast<char>((version >> (8 * b)) & 0xff);
  if (message_file) {
    const uint32_t crc = Crc32c(file.data(), file.size() - 4);
    for (int b = 0; b < 4; ++b) file[file.size() - 4 + b] = static_cast<char>((crc >> (8 * b)) & 0xff);
  }
  return file;
}

// The spool (server/store/spool_store.h), written by SpoolStore itself on an
// in-memory file system: journals of a commit and of a history with every
// record kind, hand-made ones that exercise the replay, foreign headers;
// message files of a small and a compressed message, plain and coded,
// another version.
void SpoolSeeds() {
  using fuzz::kSpoolJournal;
  using spool::v1::Record;
  auto open = [](testing::FaultFs* fs) {
    return Must(SpoolStore::Open({}, fuzz::SpoolOpts(fs), nullptr), "SpoolStore::Open");
  };
  std::string seed_file;
  {
    testing::FaultFs fs;
    {
      auto s = open(&fs);
      MustOk(fuzz::CommitTo(*s, fuzz::SeedMessage()), "commit");
    }
    WriteVariants("spool_journal", "commit", fs.Peek(kSpoolJournal), 20);
    seed_file = fs.Peek(fuzz::SpoolMsgPath(1));
    WriteVariants("spool_message_file", "seed", seed_file, 30);
    Write("spool_message_file", "seed.version9", WithVersion(seed_file, 9, true));
  }
  {
    testing::FaultFs fs;
    {
      SpoolOptions o = fuzz::SpoolOpts(&fs);
      o.message_body = MessageBody::kCoded;
      auto s = Must(SpoolStore::Open({}, o, nullptr), "SpoolStore::Open");
      MustOk(fuzz::CommitTo(*s, fuzz::SeedMessage()), "commit");
    }
    WriteVariants("spool_message_file", "seed.coded", fs.Peek(fuzz::SpoolMsgPath(1)), 31);
  }
  {
    testing::FaultFs fs;
    {
      auto s = open(&fs);
      MustOk(fuzz::CommitTo(*s, fuzz::SeedMessage()), "commit");
      MustOk(fuzz::CommitTo(*s, fuzz::SmallMsg("s", "m2", 2)), "commit");
      uint64_t waiter = 0;
      auto d = s->FetchOrWait("s", "b", Clock::now() + std::chrono::hours(1), [](Store::Wake) {}, &waiter);
      if (!d) Die("fetch");
      s->MarkDelivered("s", "b", d->msg->message_id);
      MustOk(s->Ack("s", "b", d->msg->message_id), "ack");
      s->TrackRecipient("s", "m2", "r", {TrackState::kCommitted, "R:1", "", 1});
      if (!s->AddPeer("s", "R:1")) Die("AddPeer");
      s->NotePeerHolds("s", "m2", "R:1");
      MustOk(fuzz::CommitTo(*s, fuzz::SmallMsg("t", "x", 3)), "commit");
      s->CloseSession("t");
      MustOk(fuzz::CommitTo(*s, fuzz::SmallMsg("t", "y", 4)), "commit");  // reopens t
    }
    std::string journal = fs.Peek(kSpoolJournal);
    Record expired;
    expired.mutable_expired()->set_session_id("t");
    AppendJournalRecord(expired, &journal);
    WriteVariants("spool_journal", "history", journal, 60);
  }
  // s/m closed, then committed again as seq 5 (its file is gone); and seq 1
  // given to two messages (the one recovery picks finds s/m's file).
  std::string reclosed = JournalHeader();
  AppendJournalRecord(CommitRecord("s", "m", 1, {"b"}), &reclosed);
  Record closed;
  closed.mutable_closed()->set_session_id("s");
  AppendJournalRecord(closed, &reclosed);
  AppendJournalRecord(CommitRecord("s", "m", 5, {"b"}), &reclosed);
  Write("spool_journal", "reclosed", reclosed);
  std::string clash = JournalHeader();
  AppendJournalRecord(CommitRecord("s", "m", 1, {"b"}), &clash);
  AppendJournalRecord(CommitRecord("z", "z", 1, {"b"}), &clash);
  Write("spool_journal", "seq_clash", clash);
  Write("spool_journal", "header_only", JournalHeader());
  Write("spool_journal", "version2", WithVersion(reclosed, 2, false));
  Write("spool_journal", "not_a_journal", "KVRSPMSG" + reclosed.substr(8));

  // A compressed (int4) message forwarded here, with remote recipients.
  const Turn turn = TinyTurn(DType::kF32, 4, 0, 2);
  spool::v1::MessageMeta meta;
  meta.set_session_id("s");
  meta.set_message_id("q");
  meta.set_sender("a");
  meta.add_recipients("b");
  meta.add_recipients("c");
  (*meta.mutable_remote())["c"] = "relay-b:50051";
  meta.set_forwarded(true);
  meta.set_origin("relay-o:50051");
  meta.set_family("h2o");
  std::string file;
  MustOk(EncodeMessageFile(meta, Compress(turn, "h2o-head:k=4+int4:group=8"), &file), "EncodeMessageFile");
  WriteVariants("spool_message_file", "int4", file, 100);
  MustOk(EncodeMessageFile(meta, Compress(turn, "h2o-head:k=4+int4:group=8"), &file, MessageBody::kCoded),
         "EncodeMessageFile");
  WriteVariants("spool_message_file", "int4.coded", file, 101);
  Write("spool_message_file", "not_a_message_file", "KVRSPJNL" + seed_file.substr(8));
}

}  // namespace
}  // namespace kvrelay

namespace kvrelay {
namespace {

// wire_codec_fuzzer.cc's input: flags, streams, (part index, size - 1) per
// stream, then the blob. Parts as that fuzzer's kParts lists them.
void WireCodecSeeds() {
  const v1::Part parts[] = {v1::PART_K,       v1::PART_V,      v1::PART_POS,     v1::PART_K_CODES,
                            v1::PART_K_SCALE, v1::PART_K_ZERO, v1::PART_V_CODES, v1::PART_V_SCALE,
                            v1::PART_V_ZERO,  v1::PART_ACC};
  const Turn history = TinyTurn(DType::kF16, 3, 0, 5);
  int i = 0;
  for (const char* spec : {"h2o-head:k=4", "h2o-head:k=4+int4:group=8", "gen:sinks=2+int2", "full+int8"}) {
    const Message m = Compress(history, spec);
    std::vector<TensorRef> tensors;
    for (const TensorRef& t : LayerDeliveryOrder(m.layers[0], 0)) {
      if (!t.data.empty() && t.data.size() <= 65536) tensors.push_back(t);
    }
    if (tensors.empty() || tensors.size() > 8) Die("wire_codec seed: layer of " + std::to_string(tensors.size()));
    std::string prefix(1, '\0');
    prefix += static_cast<char>(tensors.size() - 1);
    for (const TensorRef& t : tensors) {
      const auto* at = std::find(std::begin(parts), std::end(parts), t.part);
      prefix += static_cast<char>(at - std::begin(parts));
      prefix += static_cast<char>((t.data.size() - 1) & 0xff);
      prefix += static_cast<char>((t.data.size() - 1) >> 8);
    }
    const WireBlob blob = EncodeWireLayer(tensors, {m.kv_heads, 2});
    const std::string b(blob.begin(), blob.end());
    WriteVariants("wire_codec", "layer" + std::to_string(i), prefix + b, prefix.size() + 20);
    std::string round_trip = prefix + b;
    round_trip[0] = 1;
    Write("wire_codec", "round_trip" + std::to_string(i), round_trip);
    ++i;
  }
}

}  // namespace
}  // namespace kvrelay

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_make_corpus DIR\n");
    return 2;
  }
  kvrelay::g_root = argv[1];
  kvrelay::FormatSeeds();
  kvrelay::WireSeeds();
  kvrelay::TextSeeds();
  kvrelay::SpoolSeeds();
  kvrelay::WireCodecSeeds();
  return 0;
}
