// Helpers the relay's reactors share: deadlines as the client sees them,
// the accounting of a composed message, raw request parsing.
#ifndef KVRELAY_SERVER_RPC_INTERNAL_CALL_UTIL_H_
#define KVRELAY_SERVER_RPC_INTERNAL_CALL_UTIL_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/message.h"
#include "grpcpp/grpcpp.h"
#include "kvrelay/v1/relay.pb.h"
#include "proto/raw_chunk.h"
#include "server/store/store.h"

namespace kvrelay {

double SecondsSince(Clock::time_point t);

// `s` as the client sees it: gRPC cancels a call at its deadline (a waiting
// Fetch, possibly before the store's own timer; an upload mid-stream; a
// reply being written), and the client gets DEADLINE_EXCEEDED, so a
// CANCELLED after the deadline is that. Every reactor's FinishOnce applies it.
grpc::Status AsClientSees(const grpc::CallbackServerContext& ctx, const grpc::Status& s);

// The one answer to a request whose `bytes` bytes do not parse as
// `Request`: INVALID_ARGUMENT "RPC: request of N bytes is not a
// kvrelay.v1.Request (malformed, or a string field that is not UTF-8)".
template <typename Request>
absl::Status NotARequestError(absl::string_view rpc, size_t bytes) {
  return absl::InvalidArgumentError(absl::StrCat(rpc, ": request of ", bytes, " bytes is not a kvrelay.v1.",
                                                 Request::descriptor()->name(),
                                                 " (malformed, or a string field that is not UTF-8)"));
}

// Parses a raw request as `Request`: NotARequestError when the bytes are
// not one.
template <typename Request>
absl::Status ParseRequest(const grpc::ByteBuffer& wire, absl::string_view rpc, Request* req) {
  RawMessage raw;
  if (raw.Reset(wire) && raw.ParseAs(req)) return absl::OkStatus();
  return NotARequestError<Request>(rpc, wire.Length());
}

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_RPC_INTERNAL_CALL_UTIL_H_
