#include "server/rpc/internal/call_util.h"

#include <chrono>

namespace kvrelay {
namespace {

// Whether the call's deadline has passed (none: never). gRPC's deadline
// timer may fire a little before ctx.deadline() reads as past: within
// kDeadlineSlack counts as passed.
constexpr std::chrono::milliseconds kDeadlineSlack(20);
bool DeadlinePassed(const grpc::CallbackServerContext& ctx) {
  return ctx.deadline() <= std::chrono::system_clock::now() + kDeadlineSlack;
}

}  // namespace

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

grpc::Status AsClientSees(const grpc::CallbackServerContext& ctx, const grpc::Status& s) {
  if (s.error_code() != grpc::CANCELLED || !DeadlinePassed(ctx)) return s;
  return grpc::Status(grpc::DEADLINE_EXCEEDED, absl::StrCat(s.error_message(), " (the call's deadline passed)"));
}

}  // namespace kvrelay
