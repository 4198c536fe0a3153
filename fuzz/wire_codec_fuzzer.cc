// The wire codec's decoder (proto/wire_codec.h), fed hostile blobs, and its
// round trip fed arbitrary tensors.
//
// Input: a flags byte, a streams byte (1 + value % 8 streams), per stream a
// part byte (an index into kParts, unknown parts included) and a size u16
// little-endian (1 + value), then the rest. Flags bit 0 clear: the rest is
// a blob, decoded against those parts and sizes. Set: the rest is tensor
// data (repeated to fill the sizes), encoded then decoded.
//
// Properties: decoding never crashes, over-reads or allocates beyond the
// expected sizes (ASan); an accepted blob yields exactly the expected
// sizes; encode then decode gives back the same bytes; a blob is never
// larger than MaxWireLayerBytes.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fuzz/fuzz_check.h"
#include "proto/wire_codec.h"

namespace kvrelay {
namespace {

constexpr v1::Part kParts[] = {v1::PART_K,      v1::PART_V,      v1::PART_POS,    v1::PART_K_CODES,
                               v1::PART_K_SCALE, v1::PART_K_ZERO, v1::PART_V_CODES, v1::PART_V_SCALE,
                               v1::PART_V_ZERO,  v1::PART_ACC,    static_cast<v1::Part>(33),
                               static_cast<v1::Part>(39)};

void Run(const uint8_t* data, size_t size) {
  if (size < 2) return;
  const bool round_trip = data[0] & 1;
  const int heads = 1 + ((data[0] >> 1) & 3);
  const size_t streams = 1 + data[1] % 8;
  size_t at = 2;
  std::vector<WireTensor> expected;
  for (size_t i = 0; i < streams; ++i) {
    if (size - at < 3) return;
    const v1::Part part = kParts[data[at] % (sizeof(kParts) / sizeof(kParts[0]))];
    const uint64_t n = 1 + (data[at + 1] | uint64_t{data[at + 2]} << 8);
    expected.push_back({part, n});
    at += 3;
  }
  const uint8_t* rest = data + at;
  const size_t rest_size = size - at;
  if (!round_trip) {
    auto out = DecodeWireLayer({rest, rest_size}, expected);
    if (out.ok()) {
      FUZZ_CHECK(out->size() == expected.size());
      for (size_t i = 0; i < expected.size(); ++i) FUZZ_CHECK((*out)[i].size() == expected[i].size);
    }
    return;
  }
  if (rest_size == 0) return;
  std::vector<std::vector<uint8_t>> bufs;
  std::vector<TensorRef> tensors;
  size_t k = 0;
  for (const WireTensor& t : expected) {
    std::vector<uint8_t> b(t.size);
    for (uint8_t& x : b) x = rest[k++ % rest_size];
    bufs.push_back(std::move(b));
  }
  for (size_t i = 0; i < expected.size(); ++i) tensors.push_back({0, expected[i].part, bufs[i]});
  const WireBlob blob = EncodeWireLayer(tensors, {heads, data[0] & 8 ? 4 : 2});
  FUZZ_CHECK(blob.size() <= MaxWireLayerBytes(expected));
  auto out = DecodeWireLayer(blob, expected);
  FUZZ_CHECK(out.ok());
  for (size_t i = 0; i < bufs.size(); ++i) FUZZ_CHECK((*out)[i] == bufs[i]);
}

}  // namespace
}  // namespace kvrelay

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvrelay::Run(data, size);
  return 0;
}
