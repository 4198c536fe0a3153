// Helpers shared by the wire fuzzers: cutting the input into messages and a
// message into the slices gRPC would deliver it in.
#ifndef KVRELAY_FUZZ_FUZZ_FRAMES_H_
#define KVRELAY_FUZZ_FUZZ_FRAMES_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

namespace kvrelay {
namespace fuzz {

// `bytes` as a ByteBuffer of slices of `cut` bytes each (the last shorter);
// cut 0: one slice.
inline grpc::ByteBuffer Sliced(const std::string& bytes, size_t cut) {
  if (cut == 0 || cut >= bytes.size()) {
    grpc::Slice one(bytes.data(), bytes.size());
    return grpc::ByteBuffer(&one, 1);
  }
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += cut) {
    slices.emplace_back(bytes.data() + at, std::min(cut, bytes.size() - at));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// Splits `data` into frames of a 2-byte little-endian length and that many
// bytes (a short last frame takes what is left).
inline std::vector<std::string> Frames(const uint8_t* data, size_t size) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at + 2 <= size) {
    const size_t n = std::min<size_t>(data[at] | (size_t{data[at + 1]} << 8), size - at - 2);
    out.emplace_back(reinterpret_cast<const char*>(data + at + 2), n);
    at += 2 + n;
  }
  return out;
}

// The inverse of Frames, for writing seeds.
inline void AppendFrame(const std::string& msg, std::string* out) {
  out->push_back(static_cast<char>(msg.size() & 0xff));
  out->push_back(static_cast<char>((msg.size() >> 8) & 0xff));
  out->append(msg);
}

}  // namespace fuzz
}  // namespace kvrelay

#endif  // KVRELAY_FUZZ_FUZZ_FRAMES_H_
