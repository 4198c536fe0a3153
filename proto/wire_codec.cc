#include "proto/wire_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <utility>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "absl/strings/str_cat.h"
#include "core/crc32c.h"
#include "htscodecs/rANS_static4x16.h"
#include "htscodecs/varint.h"
#include "proto/stream_codec.h"

namespace kvrelay {
namespace {

constexpr char kMagic[4] = {'K', 'V', 'W', '1'};
// rANS order bytes of the blocks written: order 0, 32-way interleaved
// (RANS_ORDER_X32: htscodecs picks its AVX2/AVX-512/SSE4 code at run time),
// or stored by the library itself (RANS_ORDER_CAT). 4-way order 0 (0x00) is
// read too.
constexpr uint8_t kRansPlain = 0x00;
constexpr uint8_t kRansX32 = RANS_ORDER_X32;
constexpr uint8_t kRansCat = RANS_ORDER_CAT;
bool KnownOrderByte(uint8_t b) {
  return b == kRansPlain || b == kRansX32 || b == kRansCat || b == (kRansCat | kRansX32);
}
// Planes larger than this are stored: htscodecs counts in unsigned int.
constexpr uint64_t kMaxPlaneBytes = uint64_t{1} << 30;

uint32_t GetU32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t{p[i]} << (8 * i);
  return v;
}
uint64_t GetU64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t{p[i]} << (8 * i);
  return v;
}

// Elements [b, e) of 2-byte elements at `in` (element 0 at in[0]) into the
// two planes lo[] and hi[] of elements: lo[i] = in[2i], hi[i] = in[2i + 1].
void SplitHalves(const uint8_t* in, size_t b, size_t e, uint8_t* lo, uint8_t* hi) {
  size_t i = b;
#if defined(__AVX2__)
  // Per 128-bit lane: the even bytes, then the odd ones.
  const __m256i even_odd = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,  //
                                            0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (; i + 32 <= e; i += 32) {
    __m256i x = _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + 2 * i)), even_odd);
    __m256i y = _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + 2 * i + 32)), even_odd);
    x = _mm256_permute4x64_epi64(x, 0xd8);  // even 0-15, odd 0-15
    y = _mm256_permute4x64_epi64(y, 0xd8);  // even 16-31, odd 16-31
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + i), _mm256_permute2x128_si256(x, y, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + i), _mm256_permute2x128_si256(x, y, 0x31));
  }
#endif
  for (; i < e; ++i) {
    lo[i] = in[2 * i];
    hi[i] = in[2 * i + 1];
  }
}

// The inverse of SplitHalves over n elements: out[2i] = lo[i], out[2i + 1] =
// hi[i].
void MergeHalves(const uint8_t* lo, const uint8_t* hi, size_t n, uint8_t* out) {
  size_t i = 0;
#if defined(__AVX2__)
  for (; i + 32 <= n; i += 32) {
    const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + i));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + i));
    const __m256i a = _mm256_unpacklo_epi8(l, h);  // elements 0-7, 16-23
    const __m256i b = _mm256_unpackhi_epi8(l, h);  // elements 8-15, 24-31
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * i), _mm256_permute2x128_si256(a, b, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * i + 32), _mm256_permute2x128_si256(a, b, 0x31));
  }
#endif
  for (; i < n; ++i) {
    out[2 * i] = lo[i];
    out[2 * i + 1] = hi[i];
  }
}

// Splits `in` (elements of `planes` bytes) into its byte planes, plane p
// (byte p of every element) at out[p], and returns the CRC32C of `in`: both
// in one pass, block by block, while each block is in L1.
uint32_t ToPlanesCrc(absl::Span<const uint8_t> in, int planes, uint8_t* const* out) {
  constexpr size_t kBlockElems = 8 << 10;
  const size_t n = in.size() / planes;
  uint32_t crc = 0;
  for (size_t b = 0; b < n; b += kBlockElems) {
    const size_t e = std::min(n, b + kBlockElems);
    crc = Crc32cExtend(crc, in.data() + b * planes, (e - b) * planes);
    if (planes == 2) {
      SplitHalves(in.data(), b, e, out[0], out[1]);
    } else {
      const uint8_t* src = in.data() + b * planes;
      for (size_t i = b; i < e; ++i, src += planes) {
        for (int p = 0; p < planes; ++p) out[p][i] = src[p];
      }
    }
  }
  return crc;
}

// The inverse of ToPlanesCrc: n elements of `planes` bytes at `out` from
// the planes at plane[p].
void FromPlanes(const uint8_t* const* plane, size_t n, int planes, uint8_t* out) {
  if (planes == 2) return MergeHalves(plane[0], plane[1], n, out);
  for (size_t i = 0; i < n; ++i) {
    for (int p = 0; p < planes; ++p) out[i * planes + p] = plane[p][i];
  }
}

// Per-row deltas of int32 elements, zigzagged, as little-endian u32 at `out`
// (in.size() bytes).
void PosDeltas(absl::Span<const uint8_t> in, uint64_t row, uint8_t* out) {
  const size_t n = in.size() / 4;
  uint32_t prev = 0;
  for (size_t i = 0; i < n; ++i) {
    if (i % row == 0) prev = 0;
    const uint32_t x = GetU32(in.data() + 4 * i);
    const uint32_t d = x - prev;
    const uint32_t z = (d << 1) ^ (0u - (d >> 31));
    prev = x;
    for (int b = 0; b < 4; ++b) out[4 * i + b] = static_cast<uint8_t>(z >> (8 * b));
  }
}

void UndoPosDeltas(uint8_t* data, size_t size, uint64_t row) {
  const size_t n = size / 4;
  uint32_t prev = 0;
  for (size_t i = 0; i < n; ++i) {
    if (i % row == 0) prev = 0;
    const uint32_t z = GetU32(data + 4 * i);
    const uint32_t d = (z >> 1) ^ (0u - (z & 1));
    const uint32_t x = prev + d;
    prev = x;
    for (int b = 0; b < 4; ++b) data[4 * i + b] = static_cast<uint8_t>(x >> (8 * b));
  }
}

// A buffer whose bytes are unspecified until written, for output written
// completely before it is read: no zero-filling. Grows, never shrinks.
class Scratch {
 public:
  uint8_t* Get(size_t n) {
    if (n > size_) {
      buf_.reset(new uint8_t[n]);
      size_ = n;
    }
    return buf_.get();
  }

 private:
  std::unique_ptr<uint8_t[]> buf_;
  size_t size_ = 0;
};

// The room CodePlanes needs at `out` for `size` bytes in `planes` planes;
// 0 when the planes cannot be coded.
size_t RansPlanesRoom(size_t size, int planes) {
  const size_t n = size / planes;
  if (n == 0 || n > kMaxPlaneBytes) return 0;
  return planes * (4 + size_t{rans_compress_bound_4x16(static_cast<unsigned int>(n), kRansX32)});
}

// Whether order-0 coding would save at least 1/16 of a plane of n bytes,
// byte i at plane[i * stride], judged by the order-0 entropy of its bytes,
// counted on evenly spaced 256-byte runs that make up at most 16 KiB of it.
// A plane that fails is stored (RANS_ORDER_CAT): coding it would cost more
// CPU than the bytes it saves are worth on any link a relay sees (bf16 and
// fp32 mantissa bytes are nearly uniform), and the decoder reads either.
bool WorthCoding(const uint8_t* plane, size_t stride, size_t n) {
  constexpr size_t kRun = 256, kSampleRuns = 64;
  const size_t runs = (n + kRun - 1) / kRun;
  const size_t step = (runs + kSampleRuns - 1) / kSampleRuns;  // at least 1: n > 0
  uint32_t counts[4][256] = {};
  size_t seen = 0;
  for (size_t r = 0; r < runs; r += step) {
    const uint8_t* run = plane + r * kRun * stride;
    const size_t len = std::min(kRun, n - r * kRun);
    size_t i = 0;
    for (; i + 4 <= len; i += 4) {
      ++counts[0][run[i * stride]];
      ++counts[1][run[(i + 1) * stride]];
      ++counts[2][run[(i + 2) * stride]];
      ++counts[3][run[(i + 3) * stride]];
    }
    for (; i < len; ++i) ++counts[0][run[i * stride]];
    seen += len;
  }
  double bits = 0;
  for (int c = 0; c < 256; ++c) {
    const uint32_t k = counts[0][c] + counts[1][c] + counts[2][c] + counts[3][c];
    if (k) bits += k * std::log2(static_cast<double>(seen) / k);
  }
  return bits < 8.0 * seen * (15.0 / 16.0);
}

// Writes the low `bytes` bytes of v at `out`, little-endian; returns the
// byte after them.
uint8_t* PutLe(uint64_t v, int bytes, uint8_t* out) {
  for (int i = 0; i < bytes; ++i) *out++ = static_cast<uint8_t>(v >> (8 * i));
  return out;
}

// One plane of n bytes as its coded length (u32) and its block at `out`,
// which has 4 + `bound` bytes: rANS order 0, or stored by the library when
// not `worth` coding. The bytes written, or 0 when no block can be made.
size_t PutPlane(const uint8_t* plane, size_t n, bool worth, size_t bound, uint8_t* out) {
  uint8_t* block = out + 4;
  unsigned int block_size = static_cast<unsigned int>(bound);
  // The library reads its input only; its API takes it non-const.
  unsigned char* r = rans_compress_to_4x16(const_cast<unsigned char*>(plane), static_cast<unsigned int>(n), block,
                                           &block_size, worth ? kRansX32 : kRansCat);
  if (r == nullptr || block_size == 0 || block_size > bound) return 0;
  if (!KnownOrderByte(block[0])) return 0;
  PutLe(block_size, 4, out);
  return 4 + size_t{block_size};
}

// The coded length (u32) and the header of the stored block of an n-byte
// plane at `out`, as the library writes them (RANS_ORDER_CAT, then n in
// htscodecs' variable-length integer); the plane's n bytes go right after.
// Returns the header's bytes, the length included.
size_t PutStoredPlaneHeader(size_t n, uint8_t* out) {
  uint8_t* block = out + 4;
  block[0] = kRansCat;
  const size_t head = 1 + static_cast<size_t>(var_put_u32(block + 1, nullptr, static_cast<uint32_t>(n)));
  PutLe(head + n, 4, out);
  return 4 + head;
}

// rANS order 0 of each byte plane of `in` (elements of `planes` bytes),
// each as coded length u32 then the block, written at `out`, which has
// RansPlanesRoom(in.size(), planes) bytes; a plane not WorthCoding is
// stored in its block. *crc is set to the CRC32C of `in`. The planes are
// split on the way: those stored before the first coded one straight into
// their blocks, the others into `split` (in.size() bytes, unused for one
// plane). Returns the bytes written, or 0 when a block cannot be made or
// the planes would take `limit` bytes or more (then the stream is stored).
size_t CodePlanes(absl::Span<const uint8_t> in, int planes, uint8_t* split, uint8_t* out, size_t limit,
                  uint32_t* crc) {
  const size_t n = in.size() / planes;
  bool worth[4] = {};
  bool any = false;
  if (n > 0 && n <= kMaxPlaneBytes) {
    for (int p = 0; p < planes; ++p) any |= worth[p] = WorthCoding(in.data() + p, planes, n);
  }
  if (!any || planes == 1) {
    // Stored whole when no plane would shrink enough; one plane is coded
    // from `in` itself.
    *crc = Crc32c(in.data(), in.size());
    if (!any) return 0;
  }
  const size_t bound = rans_compress_bound_4x16(static_cast<unsigned int>(n), kRansX32);
  size_t at = 0;
  int first = 0;
  const uint8_t* plane[4] = {in.data()};
  if (planes > 1) {
    uint8_t* to[4];
    for (; first < planes && !worth[first]; ++first) {
      at += PutStoredPlaneHeader(n, out + at);
      to[first] = out + at;
      at += n;
    }
    for (int p = first; p < planes; ++p) to[p] = split + p * n;
    *crc = ToPlanesCrc(in, planes, to);
    for (int p = 0; p < planes; ++p) plane[p] = to[p];
    if (at >= limit) return 0;
  }
  for (int p = first; p < planes; ++p) {
    const size_t w = PutPlane(plane[p], n, worth[p], bound, out + at);
    if (w == 0) return 0;
    at += w;
    if (at >= limit) return 0;
  }
  return at;
}

absl::Status Bad(absl::string_view what) { return absl::InvalidArgumentError(absl::StrCat("wire layer: ", what)); }

// The n bytes of a stored block (RANS_ORDER_CAT) of `len` bytes at
// `block`, where the library would copy them from; null for any other
// block, or one whose header does not declare exactly n bytes filling it.
const uint8_t* StoredPlaneBytes(const uint8_t* block, uint32_t len, uint64_t n) {
  if (block[0] != kRansCat) return nullptr;
  uint32_t declared = 0;
  const int used = var_get_u32(const_cast<uint8_t*>(block + 1), block + len, &declared);
  if (used <= 0 || declared != n || len != 1 + static_cast<uint64_t>(used) + n) return nullptr;
  return block + 1 + used;
}

// Decodes the rANS planes of `payload` (`size` bytes in `planes` equal
// planes), plane p into out + p * size / planes. When `plane` is not null,
// plane[p] is set to where plane p's bytes are: a stored plane's stay in
// `payload` (not copied to `out`), the others are in `out`.
absl::Status UnRansPlanes(absl::Span<const uint8_t> payload, int planes, uint8_t* out, uint64_t size,
                          const std::string& field, const uint8_t** plane = nullptr) {
  const uint64_t n = size / planes;
  if (n == 0 || n > kMaxPlaneBytes) return Bad(absl::StrCat(field, ": plane of ", n, " bytes, expected 1..2^30"));
  size_t at = 0;
  for (int p = 0; p < planes; ++p) {
    if (payload.size() - at < 4) return Bad(absl::StrCat(field, ".plane[", p, "]: truncated length"));
    const uint32_t len = GetU32(payload.data() + at);
    at += 4;
    if (len < 1 || len > payload.size() - at) {
      return Bad(absl::StrCat(field, ".plane[", p, "]: ", len, " coded bytes, expected 1..", payload.size() - at));
    }
    const uint8_t order = payload[at];
    if (!KnownOrderByte(order)) {
      return Bad(absl::StrCat(field, ".plane[", p, "]: rANS order byte ", int{order}, ", expected 0, 4, 32 or 36"));
    }
    unsigned char* dst = out + p * n;
    if (plane != nullptr) {
      plane[p] = StoredPlaneBytes(payload.data() + at, len, n);
      if (plane[p] != nullptr) {
        at += len;
        continue;
      }
      plane[p] = dst;
    }
    unsigned int out_size = static_cast<unsigned int>(n);
    unsigned char* r = rans_uncompress_to_4x16(const_cast<unsigned char*>(payload.data() + at), len, dst, &out_size);
    if (r != dst || out_size != n) {
      return absl::DataLossError(absl::StrCat("wire layer: ", field, ".plane[", p, "]: rANS block does not decode to ",
                                              n, " bytes"));
    }
    at += len;
  }
  if (at != payload.size()) {
    return Bad(absl::StrCat(field, ": ", payload.size() - at, " bytes after the last plane"));
  }
  return absl::OkStatus();
}

struct Record {
  uint32_t part;
  uint8_t method;
  uint32_t param;
  uint64_t raw;
  uint64_t coded;
  uint32_t crc;
};

}  // namespace

WireStreamKind WireStreamKindOf(v1::Part part, int dense_elem_bytes) {
  switch (part) {
    case v1::PART_POS:
    case v1::PART_HISTORY_POS:
      return WireStreamKind::kPositions;
    case v1::PART_K_SCALE:
    case v1::PART_K_ZERO:
    case v1::PART_V_SCALE:
    case v1::PART_V_ZERO:
    case v1::PART_DEMOTED_K_NORM:
    case v1::PART_DEMOTED_V_NORM:
      return WireStreamKind::kHalf;
    case v1::PART_K:
    case v1::PART_V:
      return dense_elem_bytes == 2 ? WireStreamKind::kHalf : WireStreamKind::kFloat32;
    case v1::PART_ACC:
      return WireStreamKind::kFloat32;
    case v1::PART_K_CODES:
    case v1::PART_V_CODES:
    case v1::PART_DEMOTED_K_CODES:
    case v1::PART_DEMOTED_V_CODES:
      return WireStreamKind::kBytes;
    default:
      return WireStreamKind::kRaw;
  }
}

WireEncodeOptions WireEncodeOptionsOf(int kv_heads, v1::DType dtype) {
  return WireEncodeOptions{kv_heads, dtype == v1::DTYPE_F32 ? 4 : 2};
}

uint64_t MaxWireLayerBytes(absl::Span<const WireTensor> expected) {
  uint64_t n = kWireBlobHeaderBytes;
  for (const WireTensor& t : expected) n += kWireRecordBytes + t.size;
  return n;
}

namespace {

// Codes tensor `t` (not empty) into `dst` (room for the larger of its
// coded and raw sizes): rANS by its stream kind, or stored when coding does
// not shrink it. `planes_buf` and `deltas_buf` take up to `max_raw` bytes.
// Its record, `coded` the bytes written.
Record EncodeStream(const TensorRef& t, const WireEncodeOptions& opts, size_t max_raw, Scratch* planes_buf,
                    Scratch* deltas_buf, uint8_t* dst) {
  Record r{static_cast<uint32_t>(t.part), static_cast<uint8_t>(WireMethod::kStored), 0, t.data.size(), 0, 0};
  size_t coded = 0;
  switch (WireStreamKindOf(t.part, opts.dense_elem_bytes)) {
    case WireStreamKind::kPositions:
      r.crc = Crc32c(t.data.data(), t.data.size());
      if (t.data.size() % 4 == 0) {
        const uint64_t elems = t.data.size() / 4;
        const uint64_t row = opts.kv_heads > 0 && elems % opts.kv_heads == 0 ? elems / opts.kv_heads : elems;
        if (row <= std::numeric_limits<uint32_t>::max()) {
          uint8_t* deltas = deltas_buf->Get(max_raw);
          uint8_t* split = planes_buf->Get(max_raw);
          PosDeltas(t.data, row, deltas);
          uint32_t deltas_crc;
          coded = CodePlanes(absl::MakeConstSpan(deltas, t.data.size()), 4, split, dst, t.data.size(), &deltas_crc);
          r.method = static_cast<uint8_t>(WireMethod::kRansPosDelta);
          r.param = static_cast<uint32_t>(row);
        }
      }
      break;
    case WireStreamKind::kHalf:
    case WireStreamKind::kFloat32:
    case WireStreamKind::kBytes: {
      const WireStreamKind k = WireStreamKindOf(t.part, opts.dense_elem_bytes);
      const int planes = k == WireStreamKind::kHalf ? 2 : k == WireStreamKind::kFloat32 ? 4 : 1;
      if (t.data.size() % planes != 0) {
        r.crc = Crc32c(t.data.data(), t.data.size());
      } else {
        uint8_t* split = planes == 1 ? nullptr : planes_buf->Get(max_raw);
        coded = CodePlanes(t.data, planes, split, dst, t.data.size(), &r.crc);
      }
      r.method = static_cast<uint8_t>(WireMethod::kRansPlanes);
      r.param = static_cast<uint32_t>(planes);
      break;
    }
    case WireStreamKind::kRaw:
      r.crc = Crc32c(t.data.data(), t.data.size());
      break;
  }
  // Stored whenever coding does not shrink the stream (CodePlanes gives 0).
  if (coded == 0) {
    r.method = static_cast<uint8_t>(WireMethod::kStored);
    r.param = 0;
    std::memcpy(dst, t.data.data(), t.data.size());
    coded = t.data.size();
  }
  r.coded = coded;
  return r;
}

// Writes the blob header and records (kWireBlobHeaderBytes +
// kWireRecordBytes each) at `p`; `total` is the whole blob's size.
void PutBlobHeader(const std::vector<Record>& records, uint64_t total, uint8_t* p) {
  auto put = [&p](uint64_t v, int bytes) { p = PutLe(v, bytes, p); };
  std::memcpy(p, kMagic, 4);
  p += 4;
  put(total, 8);
  put(records.size(), 4);
  for (const Record& r : records) {
    put(r.part, 4);
    put(r.method, 1);
    put(r.param, 4);
    put(r.raw, 8);
    put(r.coded, 8);
    put(r.crc, 4);
  }
}

}  // namespace

WireBlob EncodeWireLayer(absl::Span<const TensorRef> tensors, const WireEncodeOptions& opts) {
  // Each stream's room: coded, or stored when coding does not shrink it.
  std::vector<size_t> room(tensors.size(), 0);
  size_t body_room = 0, max_raw = 0, streams = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const size_t raw = tensors[i].data.size();
    const WireStreamKind k = WireStreamKindOf(tensors[i].part, opts.dense_elem_bytes);
    const int planes = k == WireStreamKind::kHalf ? 2 : k == WireStreamKind::kBytes ? 1 : 4;
    room[i] = std::max(raw, k == WireStreamKind::kRaw ? 0 : RansPlanesRoom(raw, planes));
    body_room += room[i];
    max_raw = std::max(max_raw, raw);
    streams += raw > 0;
  }
  // The header's size is known before coding; the payloads, one after the
  // other, are coded straight into the blob behind it.
  const uint64_t head = kWireBlobHeaderBytes + kWireRecordBytes * streams;
  WireBlob out(head + body_room);
  uint8_t* const body = out.data() + head;
  Scratch planes_buf, deltas_buf;
  std::vector<Record> records;
  size_t at = 0;
  for (const TensorRef& t : tensors) {
    if (t.data.empty()) continue;
    records.push_back(EncodeStream(t, opts, max_raw, &planes_buf, &deltas_buf, body + at));
    at += records.back().coded;
  }
  const uint64_t total = head + at;
  out.resize(total);
  PutBlobHeader(records, total, out.data());
  return out;
}

absl::StatusOr<uint64_t> WireLayerBlobBytes(absl::Span<const uint8_t> prefix, uint64_t max_bytes) {
  if (prefix.size() < kWireBlobHeaderBytes) {
    return Bad(absl::StrCat("header: ", prefix.size(), " bytes, expected ", kWireBlobHeaderBytes));
  }
  if (std::memcmp(prefix.data(), kMagic, 4) != 0) return Bad("magic: not \"KVW1\"");
  const uint64_t n = GetU64(prefix.data() + 4);
  if (n < kWireBlobHeaderBytes || n > max_bytes) {
    return Bad(absl::StrCat("blob_bytes: ", n, ", expected ", kWireBlobHeaderBytes, "..", max_bytes,
                            " (what the layer can hold)"));
  }
  return n;
}

namespace {

// The blob's records, once its header, every record and the payloads'
// lengths are checked against `expected` (nothing decoded yet).
absl::StatusOr<std::vector<Record>> CheckedRecords(absl::Span<const uint8_t> blob,
                                                   absl::Span<const WireTensor> expected) {
  absl::StatusOr<uint64_t> declared = WireLayerBlobBytes(blob, MaxWireLayerBytes(expected));
  if (!declared.ok()) return declared.status();
  if (*declared != blob.size()) {
    return Bad(absl::StrCat("blob_bytes: ", *declared, ", but the blob has ", blob.size()));
  }
  const uint32_t streams = GetU32(blob.data() + 12);
  if (streams != expected.size()) {
    return Bad(absl::StrCat("streams: ", streams, ", expected ", expected.size()));
  }
  const uint64_t records_end = kWireBlobHeaderBytes + uint64_t{kWireRecordBytes} * streams;
  if (records_end > blob.size()) return Bad(absl::StrCat("records: truncated at ", blob.size(), " bytes"));
  std::vector<Record> records(streams);
  uint64_t payload_total = 0;
  for (uint32_t i = 0; i < streams; ++i) {
    const uint8_t* p = blob.data() + kWireBlobHeaderBytes + uint64_t{kWireRecordBytes} * i;
    Record& r = records[i];
    r.part = GetU32(p);
    r.method = p[4];
    r.param = GetU32(p + 5);
    r.raw = GetU64(p + 9);
    r.coded = GetU64(p + 17);
    r.crc = GetU32(p + 25);
    const std::string field = absl::StrCat("stream[", i, "]");
    if (r.part != static_cast<uint32_t>(expected[i].part)) {
      return Bad(absl::StrCat(field, ".part: ", r.part, ", expected ", PartName(expected[i].part)));
    }
    if (r.raw != expected[i].size) {
      return Bad(absl::StrCat(field, ".raw_bytes: ", r.raw, ", expected ", expected[i].size));
    }
    if (r.coded > r.raw || r.coded > blob.size()) {
      return Bad(absl::StrCat(field, ".coded_bytes: ", r.coded, ", expected at most ", r.raw));
    }
    switch (static_cast<WireMethod>(r.method)) {
      case WireMethod::kStored:
        if (r.param != 0 || r.coded != r.raw) {
          return Bad(absl::StrCat(field, ": stored with param ", r.param, " and ", r.coded,
                                  " coded bytes, expected 0 and raw_bytes"));
        }
        break;
      case WireMethod::kRansPlanes:
        if ((r.param != 1 && r.param != 2 && r.param != 4) || r.raw % r.param != 0) {
          return Bad(absl::StrCat(field, ".param: ", r.param, " planes for ", r.raw,
                                  " bytes, expected 1, 2 or 4 dividing it"));
        }
        break;
      case WireMethod::kRansPosDelta:
        if (r.param < 1 || r.raw % 4 != 0) {
          return Bad(absl::StrCat(field, ": positions with row ", r.param, " over ", r.raw,
                                  " bytes, expected a row >= 1 and whole int32s"));
        }
        break;
      default:
        return Bad(absl::StrCat(field, ".method: ", int{r.method}, ", expected 0, 1 or 2"));
    }
    payload_total += r.coded;
  }
  if (records_end + payload_total != blob.size()) {
    return Bad(absl::StrCat("payloads: ", payload_total, " bytes recorded, the blob has ", blob.size() - records_end));
  }
  return records;
}

}  // namespace

absl::Status CheckWireLayer(absl::Span<const uint8_t> blob, absl::Span<const WireTensor> expected) {
  return CheckedRecords(blob, expected).status();
}

namespace {

// Decodes the payloads of `blob`, whose `records` CheckedRecords returned,
// into out[i] (records[i].raw bytes each).
absl::Status DecodeRecords(absl::Span<const uint8_t> blob, const std::vector<Record>& records,
                           absl::Span<uint8_t* const> out, uint64_t piece_bytes,
                           std::vector<std::vector<uint32_t>>* piece_crcs) {
  const uint32_t streams = static_cast<uint32_t>(records.size());
  if (piece_crcs) piece_crcs->assign(streams, {});
  uint64_t at = kWireBlobHeaderBytes + uint64_t{kWireRecordBytes} * streams;
  Scratch scratch_buf;
  for (uint32_t i = 0; i < streams; ++i) {
    const Record& r = records[i];
    const std::string field = absl::StrCat("stream[", i, "]");
    absl::Span<const uint8_t> payload = blob.subspan(at, r.coded);
    at += r.coded;
    uint8_t* const dst = out[i];
    switch (static_cast<WireMethod>(r.method)) {
      case WireMethod::kStored:
        std::memcpy(dst, payload.data(), r.raw);
        break;
      case WireMethod::kRansPlanes:
        if (r.param == 1) {
          if (absl::Status s = UnRansPlanes(payload, 1, dst, r.raw, field); !s.ok()) return s;
        } else {
          const int planes = static_cast<int>(r.param);
          const uint8_t* plane[4] = {};
          absl::Status s = UnRansPlanes(payload, planes, scratch_buf.Get(r.raw), r.raw, field, plane);
          if (!s.ok()) return s;
          FromPlanes(plane, r.raw / planes, planes, dst);
        }
        break;
      case WireMethod::kRansPosDelta: {
        const uint8_t* plane[4] = {};
        if (absl::Status s = UnRansPlanes(payload, 4, scratch_buf.Get(r.raw), r.raw, field, plane); !s.ok()) {
          return s;
        }
        FromPlanes(plane, r.raw / 4, 4, dst);
        UndoPosDeltas(dst, r.raw, r.param);
        break;
      }
    }
    uint32_t crc = 0;
    if (piece_crcs == nullptr) {
      crc = Crc32c(dst, r.raw);
    } else {
      // The pieces' CRCs make the whole one: still a single pass.
      for (uint64_t off = 0; off < r.raw; off += piece_bytes) {
        const uint64_t n = std::min(piece_bytes, r.raw - off);
        const uint32_t c = Crc32c(dst + off, n);
        (*piece_crcs)[i].push_back(c);
        crc = off == 0 ? c : Crc32cCombine(crc, c, n);
      }
    }
    if (crc != r.crc) {
      return absl::DataLossError(
          absl::StrCat("wire layer: ", field, ": decoded bytes do not match the record's crc32c"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<std::vector<uint8_t>>> DecodeWireLayer(absl::Span<const uint8_t> blob,
                                                                 absl::Span<const WireTensor> expected) {
  absl::StatusOr<std::vector<Record>> checked = CheckedRecords(blob, expected);
  if (!checked.ok()) return checked.status();
  // Every size is checked: allocate the expected tensors and decode.
  std::vector<std::vector<uint8_t>> out(checked->size());
  std::vector<uint8_t*> dst(out.size());
  for (size_t i = 0; i < out.size(); ++i) {
    out[i].resize((*checked)[i].raw);
    dst[i] = out[i].data();
  }
  if (absl::Status s = DecodeRecords(blob, *checked, dst, 0, nullptr); !s.ok()) return s;
  return out;
}

absl::Status DecodeWireLayerInto(absl::Span<const uint8_t> blob, absl::Span<const WireTensor> expected,
                                 absl::Span<uint8_t* const> out, uint64_t piece_bytes,
                                 std::vector<std::vector<uint32_t>>* piece_crcs) {
  if (out.size() != expected.size()) {
    return absl::InternalError(absl::StrCat("wire layer: ", out.size(), " outputs for ", expected.size(), " streams"));
  }
  absl::StatusOr<std::vector<Record>> checked = CheckedRecords(blob, expected);
  if (!checked.ok()) return checked.status();
  return DecodeRecords(blob, *checked, out, piece_bytes, piece_crcs);
}

}  // namespace kvrelay
