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

void FillAccounting(const Message& m, uint64_t received, double compress_s, double commit_s,
                    v1::Accounting* a) {
  a->set_received_bytes(received);
  a->set_full_bytes(m.full_bytes);
  a->set_sent_bytes(m.sent_bytes);
  a->set_ratio(m.Ratio());
  a->set_compress_seconds(compress_s);
  a->set_commit_seconds(commit_s);
  a->set_policy(m.policy);
  if (m.attention_error) a->set_attention_error(*m.attention_error);
}

}  // namespace kvrelay
