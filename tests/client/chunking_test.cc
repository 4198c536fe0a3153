// Chunking of uploads and reassembly of deliveries (client/internal/chunking.h),
// without a relay: the test plays the relay's side of a delivery stream.
#include "client/internal/chunking.h"

#include <string>
#include <vector>

#include "core/crc32c.h"
#include "core/format/synthetic.h"
#include "core/format/turn_file.h"
#include "core/pipeline.h"
#include "core/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvrelay::client_internal {
namespace {

using ::testing::HasSubstr;

Turn MakeTurn(uint64_t seed, int n_history = 0, int head_dim = 64) {
  SyntheticTurnOptions o;
  o.layers = 3;
  o.kv_heads = 2;
  o.score_heads = 4;
  o.head_dim = head_dim;
  o.n_prompt = 300;
  o.n_gen = 9;
  o.n_history = n_history;
  o.first_agent = n_history == 0;
  o.seed = seed;
  absl::StatusOr<Turn> t = MakeSyntheticTurn(o);
  EXPECT_TRUE(t.ok()) << t.status();
  return *std::move(t);
}

Message Compress(const Turn& turn, const std::string& policy) {
  auto p = Pipeline::Create(policy);
  EXPECT_TRUE(p.ok()) << p.status();
  absl::StatusOr<Message> m = (*p)->Compress(turn);
  EXPECT_TRUE(m.ok()) << m.status();
  return *std::move(m);
}

// The chunks of a whole stream, and its trailer.
struct Stream {
  std::vector<v1::Chunk> chunks;
  v1::Trailer trailer;
};

Stream Chunk(const std::vector<TensorRef>& tensors, size_t max_chunk) {
  Stream s;
  TrailerBuilder tb;
  v1::Chunk scratch;
  for (const TensorRef& t : tensors) {
    EXPECT_TRUE(ForEachChunk(t, max_chunk, &scratch, [&](const v1::Chunk& c) {
                  tb.Add(c);
                  s.chunks.push_back(c);
                  return absl::OkStatus();
                }).ok());
  }
  s.trailer = tb.Build();
  return s;
}

absl::StatusOr<Message> Assemble(const v1::MessageHeader& h, const Stream& s) {
  MessageAssembler a;
  KVRELAY_RETURN_IF_ERROR(a.Start(h));
  for (const v1::Chunk& c : s.chunks) KVRELAY_RETURN_IF_ERROR(a.Add(c));
  return a.Finish(s.trailer);
}

std::string Bytes(const Message& m) {
  std::string out;
  absl::Status s = WriteMessage(m, &out);
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

TEST(UploadOrder, PartsAndSizesWithoutHistory) {
  Turn turn = MakeTurn(1);
  std::vector<TensorRef> t = TurnUploadOrder(turn);
  ASSERT_EQ(t.size(), 3u * 5);
  const v1::Part parts[] = {v1::PART_PROMPT_K, v1::PART_PROMPT_V, v1::PART_GEN_K, v1::PART_GEN_V,
                            v1::PART_PROMPT_SCORE};
  for (size_t i = 0; i < t.size(); ++i) {
    EXPECT_EQ(t[i].layer, i / 5);
    EXPECT_EQ(t[i].part, parts[i % 5]);
  }
  EXPECT_EQ(t[0].data.size(), 2u * 300 * 64 * 2);  // bf16
  EXPECT_EQ(t[2].data.size(), 2u * 9 * 64 * 2);
  EXPECT_EQ(t[4].data.size(), 4u * 300 * 4);       // f32 scores [4, 300]
  EXPECT_EQ(t[4].data.data(), reinterpret_cast<const uint8_t*>(turn.layers[0].scores.data.data()));
}

TEST(UploadOrder, HistoryPartsWhenTheTurnHasHistory) {
  Turn turn = MakeTurn(2, /*n_history=*/7);
  std::vector<TensorRef> t = TurnUploadOrder(turn);
  ASSERT_EQ(t.size(), 3u * 8);
  EXPECT_EQ(t[5].part, v1::PART_HISTORY_K);
  EXPECT_EQ(t[6].part, v1::PART_HISTORY_V);
  EXPECT_EQ(t[7].part, v1::PART_HISTORY_POS);
  EXPECT_EQ(t[7].data.size(), 2u * 7 * 4);
  EXPECT_EQ(t[8].part, v1::PART_PROMPT_K);
  EXPECT_EQ(t[8].layer, 1u);

  absl::StatusOr<v1::TurnGeometry> g = TurnGeometryOf(turn);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->layers(), 3u);
  EXPECT_EQ(g->kv_heads(), 2u);
  EXPECT_EQ(g->score_heads(), 4u);
  EXPECT_EQ(g->head_dim(), 64u);
  EXPECT_EQ(g->dtype(), v1::DTYPE_BF16);
  EXPECT_EQ(g->n_prompt(), 300u);
  EXPECT_EQ(g->n_gen(), 9u);
  EXPECT_EQ(g->n_history(), 7u);
  EXPECT_FALSE(g->first_agent());
  ASSERT_TRUE(g->has_prompt_pos0());
  EXPECT_EQ(g->prompt_pos0(), 14);
  EXPECT_FALSE(TurnGeometryOf(Turn{}).ok());
}

TEST(ForEachChunk, SplitsWithContiguousOffsetsAndCrcs) {
  std::vector<uint8_t> data(2500);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 7 + 3);
  TensorRef t{4, v1::PART_GEN_V, data};
  for (size_t max : {size_t{1}, size_t{1000}, size_t{2500}, kMaxChunkBytes}) {
    Stream s = Chunk({t}, max);
    ASSERT_EQ(s.chunks.size(), (data.size() + max - 1) / max) << max;
    uint64_t off = 0;
    for (const v1::Chunk& c : s.chunks) {
      EXPECT_EQ(c.layer(), 4u);
      EXPECT_EQ(c.part(), v1::PART_GEN_V);
      EXPECT_EQ(c.offset(), off);
      EXPECT_LE(c.data().size(), max);
      EXPECT_EQ(c.crc32c(), Crc32c(c.data().data(), c.data().size()));
      off += c.data().size();
    }
    EXPECT_EQ(off, data.size());
    EXPECT_EQ(s.trailer.chunks(), s.chunks.size());
    EXPECT_EQ(s.trailer.bytes(), data.size());
    EXPECT_EQ(s.trailer.crc32c(), Crc32c(data.data(), data.size()));
  }
  EXPECT_TRUE(Chunk({TensorRef{0, v1::PART_K, {}}}, 10).chunks.empty());
}

TEST(ForEachChunk, StopsAtTheSinksError) {
  std::vector<uint8_t> data(100, 1);
  int calls = 0;
  v1::Chunk scratch;
  absl::Status s = ForEachChunk({0, v1::PART_K, data}, 10, &scratch, [&](const v1::Chunk&) {
    return ++calls == 3 ? absl::CancelledError("stop") : absl::OkStatus();
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(calls, 3);
}

// A message delivered in chunks reassembles bit-exactly, for dense and
// quantized messages, with history, and for several chunk sizes.
TEST(Assembler, RoundTripIsBitExact) {
  struct Case {
    std::string policy;
    int n_history;
  };
  const Case cases[] = {{"full", 0},
                        {"gen", 5},
                        {"h2o-head:k=16+obf:p=4", 0},
                        {"h2o-layer:k=8+int4:group=32,rotate=hadamard", 11},
                        {"h2o-head:k=8+int8:group=7", 0},
                        {"h2o-head:k=8+int2", 3}};
  uint64_t seed = 10;
  for (const Case& c : cases) {
    Turn turn = MakeTurn(++seed, c.n_history);
    Message m = Compress(turn, c.policy);
    const std::string want = Bytes(m);
    for (size_t max : {size_t{977}, kMaxChunkBytes}) {
      Stream s = Chunk(MessageDeliveryOrder(m), max);
      absl::StatusOr<Message> got = Assemble(MessageHeaderOf(m), s);
      ASSERT_TRUE(got.ok()) << c.policy << ": " << got.status();
      EXPECT_EQ(Bytes(*got), want) << c.policy << " max_chunk " << max;
      EXPECT_EQ(got->policy, m.policy);
      EXPECT_EQ(got->full_bytes, m.full_bytes);
      EXPECT_EQ(got->sent_bytes, m.sent_bytes);
      EXPECT_EQ(got->next_pos, m.next_pos);
    }
  }
}

// next_pos comes from the header; a relay before the field sends 0 and the
// receiver falls back to 1 + the largest position id it holds.
TEST(Assembler, NextPosFromTheHeaderOrTheIds) {
  Turn turn = MakeTurn(31, 0);
  Message m = Compress(turn, "h2o-head:k=4");
  const int64_t held = HeldEnd(m);
  ASSERT_GT(held, 0);
  Stream s = Chunk(MessageDeliveryOrder(m), kMaxChunkBytes);
  for (int64_t header_next : {int64_t{0}, held - 1, held, held + 7, int64_t{1} << 31}) {
    v1::MessageHeader h = MessageHeaderOf(m);
    h.set_next_pos(header_next);
    absl::StatusOr<Message> got = Assemble(h, s);
    ASSERT_TRUE(got.ok()) << header_next << ": " << got.status();
    EXPECT_EQ(got->next_pos, std::max(header_next, held)) << header_next;
  }
}

class AssemblerErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    turn_ = MakeTurn(77);
    msg_ = Compress(turn_, "h2o-head:k=16");
    header_ = MessageHeaderOf(msg_);
    stream_ = Chunk(MessageDeliveryOrder(msg_), 1000);
  }
  absl::Status Run() { return Assemble(header_, stream_).status(); }

  Turn turn_;
  Message msg_;
  v1::MessageHeader header_;
  Stream stream_;
};

TEST_F(AssemblerErrors, ChunkCrcMismatchIsDataLoss) {
  stream_.chunks[5].mutable_data()->at(3) ^= 1;
  absl::Status s = Run();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("crc32c"));
}

TEST_F(AssemblerErrors, WrongChunkCrcFieldIsDataLoss) {
  stream_.chunks[0].set_crc32c(stream_.chunks[0].crc32c() + 1);
  EXPECT_EQ(Run().code(), absl::StatusCode::kDataLoss);
}

TEST_F(AssemblerErrors, TrailerMismatchIsDataLoss) {
  Stream orig = stream_;
  stream_.trailer.set_crc32c(stream_.trailer.crc32c() ^ 0x10);
  EXPECT_EQ(Run().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(Run().message(), HasSubstr("trailer.crc32c"));
  stream_ = orig;
  stream_.trailer.set_chunks(stream_.trailer.chunks() + 1);
  EXPECT_THAT(Run().message(), HasSubstr("trailer.chunks"));
  EXPECT_EQ(Run().code(), absl::StatusCode::kDataLoss);
  stream_ = orig;
  stream_.trailer.set_bytes(1);
  EXPECT_EQ(Run().code(), absl::StatusCode::kDataLoss);
}

TEST_F(AssemblerErrors, SwappedChunksAreOutOfOrder) {
  std::swap(stream_.chunks[0], stream_.chunks[1]);
  absl::Status s = Run();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("offset 1000, expected 0"));
}

TEST_F(AssemblerErrors, WrongPartIsOutOfOrder) {
  stream_.chunks[0].set_part(v1::PART_V);
  absl::Status s = Run();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("out of order, expected chunk layer 0 part k offset 0"));
}

TEST_F(AssemblerErrors, DuplicatedChunk) {
  stream_.chunks.insert(stream_.chunks.begin() + 2, stream_.chunks[1]);
  EXPECT_EQ(Run().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(AssemblerErrors, MissingLastChunk) {
  stream_.chunks.pop_back();
  absl::Status s = Run();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("stream ended with chunk layer 2 part pos"));
}

TEST_F(AssemblerErrors, ExtraChunkAfterTheEnd) {
  v1::Chunk extra = stream_.chunks.back();
  extra.set_offset(extra.offset() + extra.data().size());
  stream_.chunks.push_back(extra);
  absl::Status s = Run();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("expected the trailer"));
}

TEST_F(AssemblerErrors, OversizedOrEmptyChunk) {
  Stream orig = stream_;
  stream_.chunks[0].mutable_data()->clear();
  stream_.chunks[0].set_crc32c(0);
  EXPECT_EQ(Run().code(), absl::StatusCode::kInvalidArgument);
  stream_ = orig;
  // A chunk that runs past its tensor.
  v1::Chunk& last_k = stream_.chunks[0];
  last_k.mutable_data()->append(msg_.layers[0].k.byte_size(), 'x');
  last_k.set_crc32c(Crc32c(last_k.data().data(), last_k.data().size()));
  absl::Status s = Run();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(AssemblerErrors, BadHeaders) {
  MessageAssembler a;
  v1::MessageHeader h = header_;
  h.set_layers(0);
  EXPECT_THAT(a.Start(h).message(), HasSubstr("header.layers: 0, expected >= 1"));
  h = header_;
  h.set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(a.Start(h).code(), absl::StatusCode::kInvalidArgument);
  h = header_;
  h.set_next_pos(-1);
  EXPECT_THAT(a.Start(h).message(), HasSubstr("header.next_pos: -1, expected 0..2^31"));
  h = header_;
  h.set_next_pos((int64_t{1} << 31) + 1);
  EXPECT_EQ(a.Start(h).code(), absl::StatusCode::kInvalidArgument);
  h = header_;
  h.set_quant_bits(3);
  EXPECT_THAT(a.Start(h).message(), HasSubstr("quant_bits"));
  h = header_;
  h.set_n_kept(0x7fffffff);
  EXPECT_EQ(a.Start(h).code(), absl::StatusCode::kInvalidArgument);
  h = header_;
  h.set_layers(1u << 30);
  h.set_kv_heads(1u << 20);
  EXPECT_EQ(a.Start(h).code(), absl::StatusCode::kInvalidArgument);  // no huge allocation
}

TEST_F(AssemblerErrors, SentBytesMustMatchTheTensors) {
  header_.mutable_accounting()->set_sent_bytes(msg_.sent_bytes + 4);
  absl::Status s = Run();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("sent_bytes"));
}

TEST_F(AssemblerErrors, ChunkBeforeHeader) {
  MessageAssembler a;
  EXPECT_EQ(a.Add(stream_.chunks[0]).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvrelay::client_internal
