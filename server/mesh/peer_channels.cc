#include "server/mesh/peer_channels.h"

#include <utility>
#include <vector>

#include "core/mutex.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "proto/raw_chunk.h"

namespace kvrelay {

struct PeerChannels::AsyncCall {
  grpc::ClientContext ctx;
  grpc::ByteBuffer req, resp;
  std::shared_ptr<grpc::Channel> channel;
  std::function<void(const grpc::Status&)> done;
};

PeerChannels::PeerChannels(std::shared_ptr<grpc::ChannelCredentials> credentials)
    : credentials_(credentials ? std::move(credentials) : grpc::InsecureChannelCredentials()) {}

PeerChannels::~PeerChannels() {
  std::vector<AsyncCall*> pending;
  {
    MutexLock lock(&calls_mu_);
    // From here on a callback leaves its call to this destructor: a call's
    // callback may run inside its TryCancel below (on this thread, while
    // gRPC still uses the context), and none releases the last reference
    // to a channel on a gRPC thread. So every call in `pending` lives on
    // until the end of this destructor.
    stopping_ = true;
    pending.assign(calls_.begin(), calls_.end());
  }
  for (AsyncCall* call : pending) call->ctx.TryCancel();  // without the lock: a callback takes it
  MutexLock lock(&calls_mu_);
  while (!calls_.empty()) calls_done_.Wait(&calls_mu_);
  for (AsyncCall* call : finished_) delete call;
}

std::shared_ptr<grpc::Channel> PeerChannels::Get(const std::string& target) {
  MutexLock lock(&mu_);
  auto it = channels_.find(target);
  if (it != channels_.end()) return it->second;
  grpc::ChannelArguments args;
  // A fresh channel after a stall must dial a fresh connection, not reuse
  // the (possibly dead) one from gRPC's global subchannel pool.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  args.SetMaxReceiveMessageSize(4 << 20);
  args.SetMaxSendMessageSize(4 << 20);
  auto ch = grpc::CreateCustomChannel(target, credentials_, args);
  channels_.emplace(target, ch);
  return ch;
}

void PeerChannels::Reset(const std::string& target, const std::shared_ptr<grpc::Channel>& stale) {
  MutexLock lock(&mu_);
  auto it = channels_.find(target);
  if (it != channels_.end() && it->second == stale) channels_.erase(it);
}

void PeerChannels::CallAsync(const std::string& target, const std::string& method,
                             const google::protobuf::MessageLite& req, std::chrono::milliseconds timeout,
                             std::function<void(const grpc::Status&)> done) {
  auto* call = new AsyncCall;
  call->channel = Get(target);
  call->req = EncodeProto(req);
  call->done = std::move(done);
  call->ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  {
    MutexLock lock(&calls_mu_);
    calls_.insert(call);
  }
  grpc::GenericStub stub(call->channel);
  stub.UnaryCall(&call->ctx, method, grpc::StubOptions(), &call->req, &call->resp, [this, call](grpc::Status s) {
    if (call->done) call->done(s);
    MutexLock lock(&calls_mu_);
    calls_.erase(call);
    if (stopping_) {
      finished_.push_back(call);  // the destructor deletes it
      if (calls_.empty()) calls_done_.SignalAll();
    } else {
      delete call;
    }
  });
}

BlockingStream::BlockingStream(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                               grpc::ClientContext* ctx)
    : ctx_(ctx) {
  grpc::GenericStub stub(channel);
  stub.PrepareBidiStreamingCall(ctx, method, grpc::StubOptions(), this);
  StartRead(&read_buf_);
  StartCall();
}

BlockingStream::~BlockingStream() = default;

bool BlockingStream::WaitFor(const std::function<bool()>& ready, std::chrono::milliseconds stall) {
  const auto deadline = std::chrono::steady_clock::now() + stall;
  {
    MutexLock lock(&mu_);
    while (!ready()) {
      if (!cv_.WaitUntil(&mu_, deadline)) break;
    }
    if (ready()) return true;
    stalled_ = true;
  }
  ctx_->TryCancel();
  return false;
}

bool BlockingStream::Write(const grpc::ByteBuffer& msg, std::chrono::milliseconds stall) {
  {
    MutexLock lock(&mu_);
    if (done_ || read_done_ || !write_ok_ || stalled_ || write_pending_) return false;
    write_pending_ = true;
    write_buf_ = msg;
  }
  StartWrite(&write_buf_);
  if (!WaitFor([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !write_pending_; }, stall)) return false;
  MutexLock lock(&mu_);
  write_buf_.Clear();
  return write_ok_ && !read_done_;
}

bool BlockingStream::WritesDone(std::chrono::milliseconds stall) {
  {
    MutexLock lock(&mu_);
    if (done_ || !write_ok_ || stalled_ || write_pending_) return false;
    write_pending_ = true;
  }
  StartWritesDone();
  if (!WaitFor([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !write_pending_; }, stall)) return false;
  MutexLock lock(&mu_);
  return write_ok_;
}

bool BlockingStream::ReadResponse(grpc::ByteBuffer* out, std::chrono::milliseconds stall) {
  if (!WaitFor([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return read_done_ || done_; }, stall)) return false;
  MutexLock lock(&mu_);
  if (!read_done_ || !read_ok_) return false;
  *out = read_buf_;
  return true;
}

bool BlockingStream::answered() {
  MutexLock lock(&mu_);
  return read_done_ && read_ok_;
}

void BlockingStream::Cancel() { ctx_->TryCancel(); }

grpc::Status BlockingStream::Finish() {
  MutexLock lock(&mu_);
  while (!done_) cv_.Wait(&mu_);
  return status_;
}

void BlockingStream::OnWriteDone(bool ok) {
  MutexLock lock(&mu_);
  write_pending_ = false;
  write_ok_ = write_ok_ && ok;
  cv_.SignalAll();
}

void BlockingStream::OnWritesDoneDone(bool ok) { OnWriteDone(ok); }

void BlockingStream::OnReadDone(bool ok) {
  MutexLock lock(&mu_);
  read_done_ = true;
  read_ok_ = ok;
  cv_.SignalAll();
}

void BlockingStream::OnDone(const grpc::Status& s) {
  MutexLock lock(&mu_);
  done_ = true;
  status_ = s;
  cv_.SignalAll();
}

}  // namespace kvrelay
