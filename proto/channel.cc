#include "proto/channel.h"

#include <cstdint>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/mutex.h"
#include "core/status_macros.h"
#include "proto/address.h"
#include "grpcpp/client_context.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "proto/status_util.h"

namespace kvrelay {
namespace {

// grpc.health.v1 wire format, hand-rolled (Debian ships no health.proto):
// HealthCheckRequest { string service = 1; }
// HealthCheckResponse { ServingStatus status = 1; }
std::string EncodeHealthRequest(const std::string& service) {
  std::string out;
  if (service.empty()) return out;
  out.push_back(0x0a);  // field 1, length-delimited
  for (uint64_t n = service.size();;) {
    const uint8_t b = n & 0x7f;
    n >>= 7;
    out.push_back(static_cast<char>(n ? (b | 0x80) : b));
    if (!n) break;
  }
  return out + service;
}

bool ReadVarint(const std::string& s, size_t* i, uint64_t* v) {
  *v = 0;
  for (int shift = 0; shift < 64 && *i < s.size(); shift += 7) {
    const uint8_t b = static_cast<uint8_t>(s[(*i)++]);
    *v |= static_cast<uint64_t>(b & 0x7f) << shift;
    if (!(b & 0x80)) return true;
  }
  return false;
}

absl::StatusOr<int> DecodeHealthResponse(const std::string& s) {
  int status = 0;
  for (size_t i = 0; i < s.size();) {
    uint64_t key, v;
    if (!ReadVarint(s, &i, &key)) break;
    const int field = static_cast<int>(key >> 3), wire = static_cast<int>(key & 7);
    if (wire == 0) {
      if (!ReadVarint(s, &i, &v)) break;
      if (field == 1) status = static_cast<int>(v);
    } else if (wire == 2) {
      if (!ReadVarint(s, &i, &v) || v > s.size() - i) break;
      i += v;
    } else if (wire == 1 && i + 8 <= s.size()) {
      i += 8;
    } else if (wire == 5 && i + 4 <= s.size()) {
      i += 4;
    } else {
      break;
    }
    if (i == s.size()) return status;
  }
  if (s.empty()) return status;
  return absl::InvalidArgumentError("grpc.health.v1.HealthCheckResponse: malformed reply");
}

}  // namespace

const char* HealthStatusName(HealthStatus s) {
  switch (s) {
    case HealthStatus::kUnknown: return "UNKNOWN";
    case HealthStatus::kServing: return "SERVING";
    case HealthStatus::kNotServing: return "NOT_SERVING";
    case HealthStatus::kServiceUnknown: return "SERVICE_UNKNOWN";
  }
  return "UNKNOWN";
}

absl::Status CheckRelayAddress(const std::string& addr) { return CheckGrpcTarget(addr); }

absl::StatusOr<HealthStatus> CheckHealth(const std::shared_ptr<grpc::Channel>& channel,
                                         const std::string& service, std::chrono::milliseconds deadline,
                                         grpc::ClientContext* caller_ctx) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext own_ctx;
  grpc::ClientContext& ctx = caller_ctx ? *caller_ctx : own_ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + deadline);
  const std::string body = EncodeHealthRequest(service);
  grpc::Slice slice(body);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  Mutex mu;
  CondVar cv;
  bool done = false;
  grpc::Status status;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) {
                   MutexLock lock(&mu);
                   status = std::move(s);
                   done = true;
                   cv.Signal();
                 });
  {
    MutexLock lock(&mu);
    while (!done) cv.Wait(&mu);
  }
  // The health protocol answers Check for a service it does not know with
  // NOT_FOUND (SERVICE_UNKNOWN is Watch's).
  if (status.error_code() == grpc::StatusCode::NOT_FOUND) return HealthStatus::kServiceUnknown;
  KVRELAY_RETURN_IF_ERROR(FromGrpcStatus(status));
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (response.Valid()) {
    KVRELAY_RETURN_IF_ERROR(FromGrpcStatus(response.Dump(&slices)));
    for (const grpc::Slice& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  KVRELAY_ASSIGN_OR_RETURN(const int st, DecodeHealthResponse(bytes));
  if (st < 0 || st > 3) return HealthStatus::kUnknown;
  return static_cast<HealthStatus>(st);
}

}  // namespace kvrelay
