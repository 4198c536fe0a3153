#include "proto/raw_chunk.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>

#include "core/crc32c.h"
#include "grpc/slice.h"

namespace kvrelay {
namespace {

// Wire types (protobuf encoding).
constexpr int kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5;

// Chunk's field numbers (relay.proto).
constexpr int kLayer = 1, kPart = 2, kOffset = 3, kData = 4, kCrc = 5;

// Reads a message held in slices, byte by byte or as views.
class Cursor {
 public:
  explicit Cursor(const std::vector<grpc::Slice>& s) : s_(s) { Settle(); }

  uint64_t pos() const { return pos_; }

  bool Byte(uint8_t* b) {
    if (i_ == s_.size()) return false;
    *b = s_[i_].begin()[off_];
    Advance(1);
    return true;
  }

  // A value varint: at most 10 bytes, 64 bits (uint32 and enum fields take
  // the low 32 bits, as protobuf does).
  // A 10th byte above 1 is left to protobuf.
  bool Varint(uint64_t* v) { return VarintOf(10, v) && (bytes_ < 10 || last_ <= 1); }

  // A tag as protobuf reads it: at most 5 bytes and 32 bits, field number
  // not 0. Anything else is left to protobuf (which rejects it).
  bool Tag(uint64_t* key) { return VarintOf(5, key) && *key <= UINT32_MAX && (*key >> 3) != 0; }

  // A length as protobuf reads it: at most 5 bytes, below 2^31.
  bool Length(uint64_t* n) { return VarintOf(5, n) && *n <= INT32_MAX; }

  // The next n bytes as views (appended to *out); false past the end.
  bool Take(uint64_t n, std::vector<absl::Span<const uint8_t>>* out) {
    while (n > 0) {
      if (i_ == s_.size()) return false;
      const size_t here = std::min<uint64_t>(n, s_[i_].size() - off_);
      if (out) out->emplace_back(s_[i_].begin() + off_, here);
      Advance(here);
      n -= here;
    }
    return true;
  }

 private:
  void Advance(size_t n) {
    off_ += n;
    pos_ += n;
    Settle();
  }
  void Settle() {  // skips exhausted (and empty) slices
    while (i_ < s_.size() && off_ == s_[i_].size()) {
      ++i_;
      off_ = 0;
    }
  }

  // Reads a varint of at most `max_bytes` bytes; its length and last byte
  // are left in bytes_ and last_.
  bool VarintOf(int max_bytes, uint64_t* v) {
    *v = 0;
    for (int i = 0; i < max_bytes; ++i) {
      uint8_t b;
      if (!Byte(&b)) return false;
      bytes_ = i + 1;
      last_ = b;
      *v |= static_cast<uint64_t>(b & 0x7f) << (7 * i);
      if (!(b & 0x80)) return true;
    }
    return false;
  }

  const std::vector<grpc::Slice>& s_;
  size_t i_ = 0, off_ = 0;
  uint64_t pos_ = 0;
  int bytes_ = 0;
  uint8_t last_ = 0;
};

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

uint8_t* PutVarint(uint8_t* p, uint64_t v) {
  while (v >= 0x80) {
    *p++ = static_cast<uint8_t>(v | 0x80);
    v >>= 7;
  }
  *p++ = static_cast<uint8_t>(v);
  return p;
}

// Most bytes EncodeChunkPrefix writes: two tags and lengths, four varint
// fields.
constexpr size_t kMaxPrefix = 2 * (1 + 10) + 4 * (1 + 10);

// Writes the message's bytes that precede the data: the outer tag and
// length, Chunk's scalar fields (zeros left out, as proto3 does) and the
// data field's tag and length. Returns the end.
uint8_t* EncodeChunkPrefix(uint8_t* p, int field, uint32_t layer, v1::Part part, uint64_t offset, uint64_t n,
                           uint32_t crc) {
  // int32 enums are sign-extended to 64 bits on the wire.
  const uint64_t part64 = static_cast<uint64_t>(static_cast<int64_t>(static_cast<int32_t>(part)));
  const uint64_t inner = (layer ? 1 + VarintSize(layer) : 0) + (part64 ? 1 + VarintSize(part64) : 0) +
                         (offset ? 1 + VarintSize(offset) : 0) + (crc ? 1 + VarintSize(crc) : 0) + 1 +
                         VarintSize(n) + n;
  p = PutVarint(p, static_cast<uint64_t>(field) << 3 | kLengthDelimited);
  p = PutVarint(p, inner);
  if (layer) p = PutVarint(PutVarint(p, kLayer << 3 | kVarint), layer);
  if (part64) p = PutVarint(PutVarint(p, kPart << 3 | kVarint), part64);
  if (offset) p = PutVarint(PutVarint(p, kOffset << 3 | kVarint), offset);
  if (crc) p = PutVarint(PutVarint(p, kCrc << 3 | kVarint), crc);
  return PutVarint(PutVarint(p, kData << 3 | kLengthDelimited), n);
}

void ReleaseHold(void* hold) { delete static_cast<std::shared_ptr<const void>*>(hold); }

}  // namespace

ChunkView ChunkView::Of(const v1::Chunk& c) {
  ChunkView v;
  v.layer = c.layer();
  v.part = c.part();
  v.offset = c.offset();
  v.crc32c = c.crc32c();
  v.size = c.data().size();
  if (v.size) v.pieces.emplace_back(reinterpret_cast<const uint8_t*>(c.data().data()), v.size);
  return v;
}

uint32_t ChunkView::CopyTo(uint8_t* dst) const {
  // Blocks that stay in L1 between the copy and the CRC (and are long
  // enough for Crc32cExtend's three streams).
  constexpr size_t kBlock = 24 << 10;
  uint32_t crc = 0;
  for (absl::Span<const uint8_t> p : pieces) {
    for (size_t i = 0; i < p.size(); i += kBlock) {
      const size_t n = std::min(kBlock, p.size() - i);
      std::memcpy(dst, p.data() + i, n);
      crc = Crc32cExtend(crc, dst, n);
      dst += n;
    }
  }
  return crc;
}

bool RawMessage::Reset(const grpc::ByteBuffer& buf) {
  slices_.clear();
  size_ = 0;
  if (!buf.Valid()) return true;  // an empty message
  if (!buf.Dump(&slices_).ok()) return false;
  for (const grpc::Slice& s : slices_) size_ += s.size();
  return true;
}

bool RawMessage::AsChunk(int field, ChunkView* chunk) const {
  Cursor c(slices_);
  uint64_t key, len;
  if (!c.Tag(&key) || key != (static_cast<uint64_t>(field) << 3 | kLengthDelimited)) return false;
  if (!c.Length(&len) || len != size_ - c.pos()) return false;  // exactly this one field
  ChunkView v;
  while (c.pos() < size_) {
    uint64_t value;
    if (!c.Tag(&key)) return false;
    const uint64_t f = key >> 3;
    const int wire = static_cast<int>(key & 7);
    const bool known = f >= kLayer && f <= kCrc;
    if (known && wire != (f == kData ? kLengthDelimited : kVarint)) return false;  // leave it to protobuf
    switch (wire) {
      case kVarint:
        if (!c.Varint(&value)) return false;
        if (f == kLayer) v.layer = static_cast<uint32_t>(value);
        if (f == kPart) v.part = static_cast<v1::Part>(static_cast<int32_t>(value));
        if (f == kOffset) v.offset = value;
        if (f == kCrc) v.crc32c = static_cast<uint32_t>(value);
        break;
      case kLengthDelimited:
        if (!c.Length(&value) || value > size_ - c.pos()) return false;
        if (f == kData) {
          v.pieces.clear();  // the last occurrence wins
          v.size = value;
          if (!c.Take(value, &v.pieces)) return false;
        } else if (!c.Take(value, nullptr)) {
          return false;
        }
        break;
      case kFixed64:
        if (!c.Take(8, nullptr)) return false;
        break;
      case kFixed32:
        if (!c.Take(4, nullptr)) return false;
        break;
      default:
        return false;  // groups, or not protobuf at all
    }
  }
  *chunk = std::move(v);
  return true;
}

bool RawMessage::ParseAs(google::protobuf::MessageLite* msg) const {
  if (slices_.size() == 1) {
    return msg->ParseFromArray(slices_[0].begin(), static_cast<int>(slices_[0].size()));
  }
  std::string bytes;
  bytes.reserve(size_);
  for (const grpc::Slice& s : slices_) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return msg->ParseFromString(bytes);
}

grpc::ByteBuffer EncodeProto(const google::protobuf::MessageLite& msg) {
  grpc_slice s = grpc_slice_malloc(msg.ByteSizeLong());
  msg.SerializeWithCachedSizesToArray(GRPC_SLICE_START_PTR(s));
  grpc::Slice slice(s, grpc::Slice::STEAL_REF);
  return grpc::ByteBuffer(&slice, 1);
}

grpc::ByteBuffer EncodeChunkNoCopy(int field, uint32_t layer, v1::Part part, uint64_t offset,
                                   absl::Span<const uint8_t> data, uint32_t crc32c,
                                   std::shared_ptr<const void> hold) {
  uint8_t prefix[kMaxPrefix];
  const uint8_t* end = EncodeChunkPrefix(prefix, field, layer, part, offset, data.size(), crc32c);
  grpc::Slice slices[2] = {
      grpc::Slice(prefix, static_cast<size_t>(end - prefix)),
      grpc::Slice(grpc_slice_new_with_user_data(const_cast<uint8_t*>(data.data()), data.size(), ReleaseHold,
                                                new std::shared_ptr<const void>(std::move(hold))),
                  grpc::Slice::STEAL_REF)};
  return grpc::ByteBuffer(slices, data.empty() ? 1 : 2);
}

grpc::ByteBuffer EncodeChunkCopy(int field, uint32_t layer, v1::Part part, uint64_t offset,
                                 absl::Span<const uint8_t> data, uint32_t* crc32c) {
  // [room for the prefix][data]: copy the data first (computing its CRC),
  // then write the prefix, which holds the CRC, right before it.
  grpc_slice s = grpc_slice_malloc(kMaxPrefix + data.size());
  uint8_t* base = GRPC_SLICE_START_PTR(s);
  ChunkView v;
  v.size = data.size();
  v.pieces.push_back(data);
  *crc32c = v.CopyTo(base + kMaxPrefix);
  uint8_t prefix[kMaxPrefix];
  const size_t n = static_cast<size_t>(
      EncodeChunkPrefix(prefix, field, layer, part, offset, data.size(), *crc32c) - prefix);
  std::memcpy(base + kMaxPrefix - n, prefix, n);
  grpc::Slice slice(grpc_slice_sub(s, kMaxPrefix - n, kMaxPrefix + data.size()), grpc::Slice::STEAL_REF);
  grpc_slice_unref(s);
  return grpc::ByteBuffer(&slice, 1);
}

}  // namespace kvrelay
