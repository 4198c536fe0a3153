#include "proto/raw_chunk.h"

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "core/crc32c.h"
#include "gtest/gtest.h"
#include "kvrelay/v1/relay.pb.h"
#include "proto/wire.h"

namespace kvrelay {
namespace {

std::vector<uint8_t> RandomBytes(std::mt19937_64& rng, size_t n) {
  std::vector<uint8_t> v(n);
  for (uint8_t& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// `bytes` as a ByteBuffer of slices cut at random places (empty ones too),
// the way a message arrives from the transport.
grpc::ByteBuffer Sliced(const std::string& bytes, std::mt19937_64& rng) {
  std::vector<grpc::Slice> slices;
  size_t at = 0;
  while (at < bytes.size()) {
    const size_t n = std::min<size_t>(bytes.size() - at, rng() % 3 == 0 ? 0 : 1 + rng() % 700);
    slices.emplace_back(bytes.data() + at, n);
    at += n;
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::string Flatten(const grpc::ByteBuffer& b) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(b.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

std::string Data(const ChunkView& c) {
  std::string out;
  for (absl::Span<const uint8_t> p : c.pieces) out.append(reinterpret_cast<const char*>(p.data()), p.size());
  EXPECT_EQ(out.size(), c.size);
  return out;
}

v1::Chunk RandomChunk(std::mt19937_64& rng) {
  v1::Chunk c;
  // Zero fields too (proto3 leaves them off the wire), and large values.
  c.set_layer(rng() % 4 == 0 ? 0 : static_cast<uint32_t>(rng()));
  c.set_part(static_cast<v1::Part>(rng() % 5 == 0 ? -static_cast<int>(rng() % 100) : static_cast<int>(rng() % 30)));
  c.set_offset(rng() % 4 == 0 ? 0 : rng() >> (rng() % 64));
  const std::vector<uint8_t> data = RandomBytes(rng, rng() % 4 == 0 ? rng() % 8 : rng() % 5000);
  c.set_data(std::string(data.begin(), data.end()));
  c.set_crc32c(rng() % 4 == 0 ? 0 : static_cast<uint32_t>(rng()));
  return c;
}

void ExpectSame(const ChunkView& v, const v1::Chunk& c) {
  EXPECT_EQ(v.layer, c.layer());
  EXPECT_EQ(v.part, c.part());
  EXPECT_EQ(v.offset, c.offset());
  EXPECT_EQ(v.crc32c, c.crc32c());
  EXPECT_EQ(Data(v), c.data());
}

TEST(RawChunk, ReadsWhatProtobufWritesAcrossAnySlicing) {
  std::mt19937_64 rng(1);
  for (int i = 0; i < 300; ++i) {
    v1::PublishRequest req;
    *req.mutable_chunk() = RandomChunk(rng);
    RawMessage raw;
    ASSERT_TRUE(raw.Reset(Sliced(req.SerializeAsString(), rng)));
    ChunkView v;
    ASSERT_TRUE(raw.AsChunk(v1::PublishRequest::kChunkFieldNumber, &v)) << i;
    ExpectSame(v, req.chunk());
    // Another message's chunk field number is not this one.
    EXPECT_FALSE(raw.AsChunk(v1::PublishRequest::kCommitFieldNumber, &v));
  }
}

TEST(RawChunk, ProtobufReadsWhatTheEncodersWrite) {
  std::mt19937_64 rng(2);
  for (int i = 0; i < 200; ++i) {
    const v1::Chunk want = RandomChunk(rng);
    const absl::Span<const uint8_t> data(reinterpret_cast<const uint8_t*>(want.data().data()), want.data().size());

    uint32_t crc = 0;
    grpc::ByteBuffer copied = EncodeChunkCopy(v1::FetchResponse::kChunkFieldNumber, want.layer(), want.part(),
                                              want.offset(), data, &crc);
    EXPECT_EQ(crc, Crc32c(data.data(), data.size()));
    v1::FetchResponse a;
    ASSERT_TRUE(a.ParseFromString(Flatten(copied)));
    ASSERT_EQ(a.kind_case(), v1::FetchResponse::kChunk);
    v1::Chunk with_crc = want;
    with_crc.set_crc32c(crc);
    EXPECT_EQ(a.chunk().SerializeAsString(), with_crc.SerializeAsString());

    grpc::ByteBuffer shared = EncodeChunkNoCopy(v1::CompressResponse::kChunkFieldNumber, want.layer(), want.part(),
                                                want.offset(), data, want.crc32c(), nullptr);
    v1::CompressResponse b;
    ASSERT_TRUE(b.ParseFromString(Flatten(shared)));
    ASSERT_EQ(b.kind_case(), v1::CompressResponse::kChunk);
    EXPECT_EQ(b.chunk().SerializeAsString(), want.SerializeAsString());

    // And our own reader, on the same bytes re-sliced.
    RawMessage raw;
    ASSERT_TRUE(raw.Reset(Sliced(Flatten(shared), rng)));
    ChunkView v;
    ASSERT_TRUE(raw.AsChunk(v1::CompressResponse::kChunkFieldNumber, &v));
    ExpectSame(v, want);
  }
}

TEST(RawChunk, NoCopyDataIsTheTensorAndIsHeldUntilReleased) {
  auto tensor = std::make_shared<std::vector<uint8_t>>(std::vector<uint8_t>{1, 2, 3, 4, 5, 6, 7, 8});
  std::weak_ptr<std::vector<uint8_t>> watch = tensor;
  {
    grpc::ByteBuffer b =
        EncodeChunkNoCopy(v1::FetchResponse::kChunkFieldNumber, 1, v1::PART_K, 0,
                          absl::MakeConstSpan(tensor->data() + 2, 4), Crc32c(tensor->data() + 2, 4), tensor);
    const uint8_t* first = tensor->data();
    tensor.reset();
    ASSERT_FALSE(watch.expired());  // the message holds it
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(b.Dump(&slices).ok());
    ASSERT_EQ(slices.size(), 2u);
    EXPECT_EQ(slices[1].begin(), first + 2);  // not a copy
    grpc::ByteBuffer copy = b;                // gRPC's own references
    b.Clear();
    slices.clear();
    EXPECT_FALSE(watch.expired());
  }
  EXPECT_TRUE(watch.expired());
}

TEST(RawChunk, UnusualEncodingsAreLeftToProtobuf) {
  std::mt19937_64 rng(3);
  v1::PublishRequest chunk_req;
  *chunk_req.mutable_chunk() = RandomChunk(rng);
  chunk_req.mutable_chunk()->set_data("abcdef");
  const std::string chunk_bytes = chunk_req.SerializeAsString();
  RawMessage raw;
  ChunkView v;

  // A header field before the chunk: protobuf's oneof keeps the last one.
  v1::PublishRequest header_req;
  header_req.mutable_header()->set_session_id("s");
  ASSERT_TRUE(raw.Reset(Sliced(header_req.SerializeAsString() + chunk_bytes, rng)));
  EXPECT_FALSE(raw.AsChunk(v1::PublishRequest::kChunkFieldNumber, &v));
  v1::PublishRequest parsed;
  ASSERT_TRUE(raw.ParseAs(&parsed));
  EXPECT_EQ(parsed.kind_case(), v1::PublishRequest::kChunk);
  EXPECT_EQ(parsed.chunk().data(), "abcdef");

  // A chunk field twice: protobuf merges them; left to protobuf.
  ASSERT_TRUE(raw.Reset(Sliced(chunk_bytes + chunk_bytes, rng)));
  EXPECT_FALSE(raw.AsChunk(v1::PublishRequest::kChunkFieldNumber, &v));

  // Truncated anywhere: never read as a chunk.
  for (size_t n = 0; n < chunk_bytes.size(); ++n) {
    ASSERT_TRUE(raw.Reset(Sliced(chunk_bytes.substr(0, n), rng)));
    EXPECT_FALSE(raw.AsChunk(v1::PublishRequest::kChunkFieldNumber, &v)) << n;
  }

  // Inside the chunk: the data field twice (the last wins) and an unknown
  // field of every wire type are read like protobuf reads them.
  std::string inner = chunk_req.chunk().SerializeAsString();
  inner += std::string("\x22\x03xyz", 5);                   // data = "xyz"
  inner += std::string("\x30\x96\x01", 3);                  // field 6 varint
  inner += std::string("\x39") + std::string(8, '\x01');   // field 7 fixed64
  inner += std::string("\x42\x02zz", 4);                    // field 8 bytes
  inner += std::string("\x4d") + std::string(4, '\x02');   // field 9 fixed32
  const std::string outer = std::string("\x12") + static_cast<char>(inner.size()) + inner;
  ASSERT_LT(inner.size(), 128u);
  ASSERT_TRUE(raw.Reset(Sliced(outer, rng)));
  ASSERT_TRUE(raw.AsChunk(v1::PublishRequest::kChunkFieldNumber, &v));
  ASSERT_TRUE(raw.ParseAs(&parsed));
  EXPECT_EQ(parsed.chunk().data(), "xyz");
  ExpectSame(v, parsed.chunk());

  // A known field with another wire type (layer as bytes): left to protobuf.
  const std::string odd = std::string("\x12\x04\x0a\x02zz", 6);
  ASSERT_TRUE(raw.Reset(Sliced(odd, rng)));
  EXPECT_FALSE(raw.AsChunk(v1::PublishRequest::kChunkFieldNumber, &v));

  // Tags and lengths are read as protobuf reads them (at most 5 bytes, a tag
  // of 32 bits with a field number, a length below 2^31); anything else is
  // left to protobuf, whichever way protobuf decides.
  const auto in_chunk = [](const std::string& inner) {
    return std::string("\x12") + static_cast<char>(inner.size()) + inner;
  };
  const std::string odd_encodings[] = {
      // data "ab", then a 5-byte tag whose 32-bit truncation is data again.
      in_chunk(std::string("\x22\x02" "ab" "\xa2\x80\x80\x80\x10\x02" "xy", 12)),
      in_chunk(std::string("\x88\x80\x80\x80\x10\x05", 6)),    // layer = 5 behind a 5-byte tag
      in_chunk(std::string("\x88\x80\x80\x80\x80\x00\x05", 7)),  // a 6-byte tag
      in_chunk(std::string("\x00\x05", 2)),                         // field number 0
      in_chunk(std::string("\x02\x01z", 3)),                        // field number 0, bytes
      in_chunk(std::string("\x22\x81\x80\x80\x80\x80\x00" "a", 8)),  // a 6-byte length
      std::string("\x92\x80\x80\x80\x00\x02\x22\x00", 8),        // outer tag in 5 bytes, bits above 32 clear
  };
  for (const std::string& bytes : odd_encodings) {
    ASSERT_TRUE(raw.Reset(Sliced(bytes, rng)));
    ChunkView got;
    const bool fast = raw.AsChunk(v1::PublishRequest::kChunkFieldNumber, &got);
    v1::PublishRequest pb;
    const bool parsed = raw.ParseAs(&pb);
    if (fast) {  // then protobuf must read the very same chunk
      ASSERT_TRUE(parsed) << absl::CHexEscape(bytes);
      ASSERT_EQ(pb.kind_case(), v1::PublishRequest::kChunk) << absl::CHexEscape(bytes);
      ExpectSame(got, pb.chunk());
    }
  }
  // None of the first six may take the fast path: protobuf reads them
  // differently from a plain 64-bit varint reader, or rejects them.
  for (int i = 0; i < 6; ++i) {
    ASSERT_TRUE(raw.Reset(Sliced(odd_encodings[i], rng)));
    EXPECT_FALSE(raw.AsChunk(v1::PublishRequest::kChunkFieldNumber, &v)) << i;
  }

  // Not protobuf at all.
  ASSERT_TRUE(raw.Reset(Sliced(std::string(9, '\xff'), rng)));
  EXPECT_FALSE(raw.AsChunk(v1::PublishRequest::kChunkFieldNumber, &v));
  EXPECT_FALSE(raw.ParseAs(&parsed));
}

TEST(RawChunk, CopyToCopiesEveryPieceAndReturnsItsCrc) {
  std::mt19937_64 rng(4);
  for (int i = 0; i < 50; ++i) {
    std::vector<std::vector<uint8_t>> parts;
    ChunkView v;
    std::vector<uint8_t> all;
    for (int p = rng() % 6; p >= 0; --p) {
      parts.push_back(RandomBytes(rng, rng() % 3 == 0 ? 40000 + rng() % 30000 : rng() % 300));
    }
    for (const auto& p : parts) {
      v.pieces.emplace_back(p.data(), p.size());
      v.size += p.size();
      all.insert(all.end(), p.begin(), p.end());
    }
    std::vector<uint8_t> dst(v.size + 1, 0xab);
    EXPECT_EQ(v.CopyTo(dst.data()), Crc32c(all.data(), all.size()));
    EXPECT_TRUE(std::equal(all.begin(), all.end(), dst.begin()));
    EXPECT_EQ(dst.back(), 0xab);  // nothing past the data
  }
}

// Property over random tensor sizes: the pieces tile every tensor in order,
// each 1..max_chunk bytes, and empty tensors give none.
TEST(ChunkCursorTest, PiecesTileEveryTensorInOrder) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 200; ++trial) {
    const size_t max_chunk = 1 + rng() % 9;
    std::vector<std::vector<uint8_t>> bufs(rng() % 6);
    std::vector<TensorRef> tensors;
    for (size_t i = 0; i < bufs.size(); ++i) {
      bufs[i].resize(rng() % 3 == 0 ? 0 : rng() % 30);
      tensors.push_back({static_cast<uint32_t>(i), v1::PART_K, bufs[i]});
    }
    ChunkCursor cursor(tensors, max_chunk);
    ChunkCursor::Piece piece;
    for (size_t i = 0; i < bufs.size(); ++i) {
      for (size_t off = 0; off < bufs[i].size(); off += max_chunk) {
        ASSERT_TRUE(cursor.Next(&piece)) << "tensor " << i << " offset " << off;
        EXPECT_EQ(piece.layer, i);
        EXPECT_EQ(piece.offset, off);
        EXPECT_EQ(piece.data.data(), bufs[i].data() + off);
        EXPECT_EQ(piece.data.size(), std::min(max_chunk, bufs[i].size() - off));
      }
    }
    EXPECT_FALSE(cursor.Next(&piece));
    EXPECT_FALSE(cursor.Next(&piece)) << "stays done";
  }
}

}  // namespace
}  // namespace kvrelay
