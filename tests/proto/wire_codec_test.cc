#include "proto/wire_codec.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/crc32c.h"
#include "core/pipeline.h"
#include "gtest/gtest.h"
#include "proto/stream_codec.h"
#include "tests/core/test_util.h"

namespace kvrelay {
namespace {

using testing::RandomTurn;
using testing::TurnShape;

std::vector<WireTensor> Expected(absl::Span<const TensorRef> tensors) {
  std::vector<WireTensor> out;
  for (const TensorRef& t : tensors) {
    if (!t.data.empty()) out.push_back({t.part, t.data.size()});
  }
  return out;
}

// decode(encode(x)) == x, bit for bit, for every layer of `msg`.
void ExpectRoundTrip(const Message& msg, bool with_acc, const std::string& what) {
  const int elem = msg.layers.empty() || msg.layers[0].quant ? 2 : static_cast<int>(DTypeSize(msg.dtype));
  for (size_t l = 0; l < msg.layers.size(); ++l) {
    const std::vector<TensorRef> tensors = LayerDeliveryOrder(msg.layers[l], static_cast<uint32_t>(l), with_acc);
    const WireBlob blob = EncodeWireLayer(tensors, {msg.kv_heads, elem});
    const std::vector<WireTensor> expected = Expected(tensors);
    ASSERT_LE(blob.size(), MaxWireLayerBytes(expected)) << what;
    absl::StatusOr<std::vector<std::vector<uint8_t>>> out = DecodeWireLayer(blob, expected);
    ASSERT_TRUE(out.ok()) << what << " layer " << l << ": " << out.status();
    ASSERT_EQ(out->size(), expected.size());
    size_t i = 0;
    for (const TensorRef& t : tensors) {
      if (t.data.empty()) continue;
      const std::vector<uint8_t>& got = (*out)[i++];
      ASSERT_EQ(got.size(), t.data.size()) << what << " " << PartName(t.part);
      ASSERT_EQ(std::memcmp(got.data(), t.data.data(), got.size()), 0) << what << " " << PartName(t.part);
    }
  }
}

Message Compress(const Turn& turn, const std::string& spec) {
  auto p = Pipeline::Create(spec);
  EXPECT_TRUE(p.ok()) << p.status();
  absl::StatusOr<Message> m = (*p)->Compress(turn);
  EXPECT_TRUE(m.ok()) << m.status();
  return *std::move(m);
}

TEST(WireCodec, KindsAreDecidedByPart) {
  EXPECT_EQ(WireStreamKindOf(v1::PART_POS), WireStreamKind::kPositions);
  EXPECT_EQ(WireStreamKindOf(v1::PART_K_SCALE), WireStreamKind::kHalf);
  EXPECT_EQ(WireStreamKindOf(v1::PART_V_ZERO), WireStreamKind::kHalf);
  EXPECT_EQ(WireStreamKindOf(v1::PART_K_CODES), WireStreamKind::kBytes);
  EXPECT_EQ(WireStreamKindOf(v1::PART_ACC), WireStreamKind::kFloat32);
  EXPECT_EQ(WireStreamKindOf(v1::PART_K, 4), WireStreamKind::kFloat32);
  EXPECT_EQ(WireStreamKindOf(v1::PART_K, 2), WireStreamKind::kHalf);
  EXPECT_EQ(WireStreamKindOf(static_cast<v1::Part>(37)), WireStreamKind::kRaw);  // unknown: stored
}

// Every policy family, random turns and seeds: the codec is lossless.
TEST(WireCodec, RoundTripsEveryPolicy) {
  const char* specs[] = {"full", "h2o-head:k=8", "h2o-layer:k=8+obf:p=4", "full+int4",
                         "h2o-head:k=8+int2:rotate=hadamard", "full+int8", "full+lloyd:bits=3,seed=9",
                         "h2o-head:k=8+demote:bits=2+lloyd:bits=4,keys=channel,group=4",
                         "h2o-layer:k=4+demote:bits=1"};
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    std::mt19937_64 rng(seed);
    TurnShape s;
    s.layers = 2;
    s.kv_heads = 1 + static_cast<int>(rng() % 4);
    s.head_dim = 16 << (rng() % 3);
    s.n_prompt = 20 + static_cast<int>(rng() % 50);
    s.n_gen = 1 + static_cast<int>(rng() % 6);
    s.dtype = seed % 2 ? DType::kF16 : DType::kF32;
    const Turn turn = RandomTurn(s, seed);
    for (const char* spec : specs) {
      Message m = Compress(turn, spec);
      ExpectRoundTrip(m, false, std::string(spec) + " seed " + std::to_string(seed));
      // Relay to relay: with each layer's acc.
      for (MessageLayer& layer : m.layers) {
        layer.acc.resize(static_cast<size_t>(m.kv_heads) * layer.tokens());
        for (float& a : layer.acc) a = std::uniform_real_distribution<float>(0, 4)(rng);
      }
      ExpectRoundTrip(m, true, std::string(spec) + "+acc seed " + std::to_string(seed));
    }
  }
}

TEST(WireCodec, PositionsAnyOrderAndRawParts) {
  std::mt19937_64 rng(9);
  std::vector<int32_t> pos(3 * 50);
  for (int32_t& p : pos) p = static_cast<int32_t>(rng());  // not ascending, extremes included
  pos[0] = INT32_MIN;
  pos[1] = INT32_MAX;
  std::vector<uint8_t> odd(7, 0x5a);  // an unknown part, and a half tensor of odd length
  std::vector<TensorRef> ts = {
      {0, v1::PART_POS, {reinterpret_cast<const uint8_t*>(pos.data()), pos.size() * 4}},
      {0, static_cast<v1::Part>(35), odd},
      {0, v1::PART_K_SCALE, odd},
  };
  const WireBlob blob = EncodeWireLayer(ts, {3, 2});
  auto out = DecodeWireLayer(blob, Expected(ts));
  ASSERT_TRUE(out.ok()) << out.status();
  for (size_t i = 0; i < ts.size(); ++i) {
    ASSERT_EQ((*out)[i], std::vector<uint8_t>(ts[i].data.begin(), ts[i].data.end()));
  }
}

TEST(WireCodec, CompressibleStreamsShrink) {
  std::vector<int32_t> pos(4 * 1000);
  for (size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<int32_t>(i % 1000) * 3;
  std::vector<uint8_t> codes(64 * 1024);
  std::mt19937_64 rng(3);
  for (uint8_t& c : codes) c = static_cast<uint8_t>(rng() % 4);  // 2 bits of entropy
  std::vector<TensorRef> ts = {{0, v1::PART_K_CODES, codes},
                               {0, v1::PART_POS, {reinterpret_cast<const uint8_t*>(pos.data()), pos.size() * 4}}};
  const WireBlob blob = EncodeWireLayer(ts, {4, 2});
  EXPECT_LT(blob.size(), (codes.size() + pos.size() * 4) / 3);
  EXPECT_TRUE(DecodeWireLayer(blob, Expected(ts)).ok());
}

// A byte plane whose order-0 entropy leaves less than 1/16 to save is
// stored in its block (rANS order byte 0x20), not coded: bf16 values of
// one scale keep their high bytes coded and their near-uniform low bytes
// stored, and the layer still decodes exactly. A stream with no plane worth
// coding is stored whole (method 0).
TEST(WireCodec, NearlyUniformPlanesAreStoredNotCoded) {
  constexpr size_t kElems = 32 * 1024;
  std::vector<uint8_t> k(2 * kElems), noise(2 * kElems);
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal(0, 1);
  for (size_t i = 0; i < kElems; ++i) {
    const float f = normal(rng);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint16_t b = static_cast<uint16_t>(u >> 16);  // bf16, truncated
    std::memcpy(k.data() + 2 * i, &b, 2);
  }
  for (uint8_t& c : noise) c = static_cast<uint8_t>(rng());
  for (bool uniform : {false, true}) {
    SCOPED_TRACE(uniform ? "uniform bytes" : "bf16 normal");
    const std::vector<uint8_t>& data = uniform ? noise : k;
    const std::vector<TensorRef> ts = {{0, v1::PART_K, data}};
    const WireBlob blob = EncodeWireLayer(ts, {4, 2});
    absl::StatusOr<std::vector<std::vector<uint8_t>>> out = DecodeWireLayer(blob, Expected(ts));
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ((*out)[0], data);
    // One stream: its record's method byte, then the payload.
    const size_t record = kWireBlobHeaderBytes;
    const uint8_t method = blob[record + 4];
    if (uniform) {
      EXPECT_EQ(method, 0) << "stored whole";
      continue;
    }
    ASSERT_EQ(method, 1) << "rANS byte planes";
    const uint8_t* payload = blob.data() + kWireBlobHeaderBytes + kWireRecordBytes;
    uint32_t lo_len;
    std::memcpy(&lo_len, payload, 4);
    EXPECT_EQ(payload[4], 0x20) << "the low bytes' plane is stored";
    EXPECT_GT(lo_len, kElems) << "order byte, its size, the bytes";
    EXPECT_LE(lo_len, kElems + 6);
    const uint8_t* hi = payload + 4 + lo_len;
    uint32_t hi_len;
    std::memcpy(&hi_len, hi, 4);
    EXPECT_EQ(hi[4] & 0x20, 0) << "the high bytes' plane is coded";
    EXPECT_LT(hi_len, kElems / 2) << "sign and exponent: under 4 bits a value";
  }
}

// Structured streams of every kind: half-width K (its byte planes differ),
// codes, positions in 4 rows with a jump, float32 acc, an unknown part.
std::vector<TensorRef> PinnedStreams() {
  static std::vector<uint8_t> k(2 * 4 * 300), codes(777), pos(4 * 4 * 300), acc(4 * 4 * 300);
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<uint8_t>(i % 2 ? 0x3c + (i * 7919) % 5 : (i * 2654435761u) >> 7);
  }
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>((i * i) % 11);
  for (size_t i = 0; i < pos.size() / 4; ++i) {
    const uint32_t v = static_cast<uint32_t>(i % 300 + (i % 300 > 150 ? 40 : 0));
    std::memcpy(pos.data() + 4 * i, &v, 4);
  }
  for (size_t i = 0; i < acc.size(); ++i) acc[i] = static_cast<uint8_t>((i * 31) >> 3);
  return {{0, v1::PART_K, k}, {0, v1::PART_K_CODES, codes}, {0, v1::PART_POS, pos}, {0, v1::PART_ACC, acc},
          {0, static_cast<v1::Part>(35), codes}};
}

// The blob's bytes are the wire format: a faster encoder writes the same
// bytes (size and CRC32C of the blobs as pinned). The pins changed once, on
// purpose: the half-width K's low-byte plane, nearly uniform, is stored by
// the encoder's choice (order byte 0x20) where the library used to code it
// and then store it itself (0x24); same size, and decoders read both.
TEST(WireCodec, EncodingIsPinned) {
  const std::vector<TensorRef> ts = PinnedStreams();
  const WireBlob half = EncodeWireLayer(ts, {4, 2});
  EXPECT_EQ(half.size(), 8258u);
  EXPECT_EQ(Crc32c(half.data(), half.size()), 2506911155u);
  const WireBlob wide = EncodeWireLayer(ts, {4, 4});
  EXPECT_EQ(wide.size(), 8206u);
  EXPECT_EQ(Crc32c(wide.data(), wide.size()), 2290578228u);
  for (const WireBlob* blob : {&half, &wide}) {
    absl::StatusOr<std::vector<std::vector<uint8_t>>> out = DecodeWireLayer(*blob, Expected(ts));
    ASSERT_TRUE(out.ok()) << out.status();
    for (size_t i = 0; i < ts.size(); ++i) {
      EXPECT_EQ((*out)[i], std::vector<uint8_t>(ts[i].data.begin(), ts[i].data.end())) << i;
    }
  }
}

// DecodeWireLayerInto decodes into the caller's buffers, and the per-piece
// CRC32Cs it hands out are those of the decoded pieces, for every method
// (stored, planes, positions) and piece size.
TEST(WireCodec, PieceCrcsAreThoseOfTheDecodedPieces) {
  TurnShape s;
  s.kv_heads = 2;
  s.n_prompt = 50;
  for (const char* spec : {"full", "h2o-head:k=8+int4"}) {
    const Message msg = Compress(RandomTurn(s, 9), spec);
    const std::vector<TensorRef> tensors = LayerDeliveryOrder(msg.layers[0], 0, /*with_acc=*/true);
    const std::vector<WireTensor> expected = Expected(tensors);
    const WireBlob blob = EncodeWireLayer(tensors, {msg.kv_heads, 2});
    std::vector<TensorRef> streams;
    for (const TensorRef& t : tensors) {
      if (!t.data.empty()) streams.push_back(t);
    }
    for (uint64_t piece : {uint64_t{1}, uint64_t{100}, uint64_t{4096}, uint64_t{1} << 20}) {
      std::vector<std::vector<uint8_t>> out;
      std::vector<uint8_t*> dst;
      for (const WireTensor& e : expected) out.emplace_back(e.size, uint8_t{0xee});
      for (std::vector<uint8_t>& t : out) dst.push_back(t.data());
      std::vector<std::vector<uint32_t>> crcs;
      const absl::Status st = DecodeWireLayerInto(blob, expected, dst, piece, &crcs);
      ASSERT_TRUE(st.ok()) << spec << ": " << st;
      ASSERT_EQ(crcs.size(), out.size());
      for (size_t i = 0; i < out.size(); ++i) {
        const std::vector<uint8_t>& t = out[i];
        ASSERT_EQ(std::memcmp(t.data(), streams[i].data.data(), t.size()), 0) << spec << " stream " << i;
        ASSERT_EQ(crcs[i].size(), (t.size() + piece - 1) / piece) << spec << " stream " << i;
        for (uint64_t off = 0; off < t.size(); off += piece) {
          const uint64_t n = std::min<uint64_t>(piece, t.size() - off);
          ASSERT_EQ(crcs[i][off / piece], Crc32c(t.data() + off, n)) << spec << " stream " << i << " at " << off;
        }
      }
    }
  }
}

class WireCodecHostile : public ::testing::Test {
 protected:
  void SetUp() override {
    TurnShape s;
    s.kv_heads = 2;
    s.n_prompt = 30;
    s.dtype = DType::kF16;
    msg_ = Compress(RandomTurn(s, 5), "h2o-head:k=8+int4");
    tensors_ = LayerDeliveryOrder(msg_.layers[0], 0);
    expected_ = Expected(tensors_);
    blob_ = EncodeWireLayer(tensors_, {2, 2});
    ASSERT_TRUE(DecodeWireLayer(blob_, expected_).ok());
  }
  Message msg_;
  std::vector<TensorRef> tensors_;
  std::vector<WireTensor> expected_;
  WireBlob blob_;
};

TEST_F(WireCodecHostile, EveryTruncationFails) {
  for (size_t n = 0; n < blob_.size(); ++n) {
    absl::Span<const uint8_t> cut(blob_.data(), n);
    EXPECT_FALSE(DecodeWireLayer(cut, expected_).ok()) << n;
  }
  WireBlob longer = blob_;
  longer.push_back(0);
  EXPECT_FALSE(DecodeWireLayer(longer, expected_).ok());
}

// A flipped byte anywhere is an error, or (a bit the coder never reads)
// decodes to the very same bytes: never to other bytes.
TEST_F(WireCodecHostile, EveryByteFlipFailsOrIsHarmless) {
  std::mt19937_64 rng(17);
  int harmless = 0;
  for (size_t at = 0; at < blob_.size(); ++at) {
    WireBlob b = blob_;
    b[at] ^= static_cast<uint8_t>(1 + rng() % 255);
    auto out = DecodeWireLayer(b, expected_);
    if (!out.ok()) continue;
    ++harmless;
    for (size_t t = 0, i = 0; t < tensors_.size(); ++t) {
      if (tensors_[t].data.empty()) continue;
      EXPECT_EQ((*out)[i++], std::vector<uint8_t>(tensors_[t].data.begin(), tensors_[t].data.end())) << "flip at " << at;
    }
  }
  EXPECT_LT(harmless, static_cast<int>(blob_.size() / 10));  // bits of the rANS states nobody reads
}

TEST_F(WireCodecHostile, ForgedSizesAndPartsFail) {
  auto forged = [&](size_t offset, uint64_t value, int bytes) {
    WireBlob b = blob_;
    for (int i = 0; i < bytes; ++i) b[offset + i] = static_cast<uint8_t>(value >> (8 * i));
    return DecodeWireLayer(b, expected_).status();
  };
  const size_t rec0 = kWireBlobHeaderBytes;
  EXPECT_EQ(forged(4, blob_.size() + 1, 8).code(), absl::StatusCode::kInvalidArgument);   // blob_bytes
  EXPECT_EQ(forged(4, uint64_t{1} << 60, 8).code(), absl::StatusCode::kInvalidArgument);  // blob_bytes huge
  EXPECT_EQ(forged(12, expected_.size() + 1, 4).code(), absl::StatusCode::kInvalidArgument);  // streams
  EXPECT_EQ(forged(12, 0xffffffff, 4).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(forged(rec0, v1::PART_V_CODES, 4).code(), absl::StatusCode::kInvalidArgument);  // part
  EXPECT_EQ(forged(rec0 + 4, 9, 1).code(), absl::StatusCode::kInvalidArgument);             // method
  EXPECT_EQ(forged(rec0 + 5, 3, 4).code(), absl::StatusCode::kInvalidArgument);             // planes
  EXPECT_EQ(forged(rec0 + 9, expected_[0].size * 2, 8).code(), absl::StatusCode::kInvalidArgument);  // raw
  EXPECT_EQ(forged(rec0 + 17, uint64_t{1} << 40, 8).code(), absl::StatusCode::kInvalidArgument);     // coded
  EXPECT_EQ(forged(0, 0, 1).code(), absl::StatusCode::kInvalidArgument);  // magic
  // The expected layer disagrees with the blob.
  std::vector<WireTensor> other = expected_;
  other[0].size += 2;
  EXPECT_FALSE(DecodeWireLayer(blob_, other).ok());
  other = expected_;
  other.pop_back();
  EXPECT_FALSE(DecodeWireLayer(blob_, other).ok());
}

TEST_F(WireCodecHostile, HostileRansTablesFail) {
  // Overwrite the first rANS block (after its u32 length) with noise, keep
  // its order byte: the decoder must refuse or decode to the exact size.
  const size_t payload0 = kWireBlobHeaderBytes + kWireRecordBytes * expected_.size();
  std::mt19937_64 rng(4);
  for (int i = 0; i < 500; ++i) {
    WireBlob b = blob_;
    const uint32_t len = b[payload0] | b[payload0 + 1] << 8 | b[payload0 + 2] << 16 | uint32_t{b[payload0 + 3]} << 24;
    for (uint32_t j = 1; j < len && payload0 + 4 + j < b.size(); ++j) b[payload0 + 4 + j] = static_cast<uint8_t>(rng());
    EXPECT_FALSE(DecodeWireLayer(b, expected_).ok());
  }
}

}  // namespace
}  // namespace kvrelay
