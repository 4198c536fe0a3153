#include "server/relay_service.h"

#include <chrono>
#include <random>

#include "absl/strings/str_format.h"
#include "server/compress_reactor.h"
#include "server/fetch_reactor.h"
#include "server/forward_reactor.h"
#include "server/internal/call_util.h"
#include "server/publish_reactor.h"

namespace kvrelay {

RelayService::RelayService(const ServerConfig& config, Store* store, ThreadPool* pool, Metrics* metrics,
                           Forwarder* forwarder, const RouteTable* routes)
    : config_(config), store_(store), pool_(pool), metrics_(metrics), forwarder_(forwarder), routes_(routes),
      id_salt_(std::random_device{}() * 0x9e3779b97f4a7c15ull ^ static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count())),
      watchdog_(config.upload_idle_timeout_seconds) {}

std::string RelayService::NewMessageId() {
  return absl::StrFormat("m-%016x-%d", id_salt_, id_counter_.fetch_add(1) + 1);
}

void RelayService::CountRpc(const char* method, const grpc::Status& s) const {
  if (metrics_) metrics_->AddRpc(method, s.error_code());
}

void RelayService::SetLayerObserver(std::function<void(int outstanding)> observe) {
  std::lock_guard<std::mutex> lock(observer_mu_);
  layer_observer_ = std::move(observe);
}

std::function<void(int outstanding)> RelayService::layer_observer() const {
  std::lock_guard<std::mutex> lock(observer_mu_);
  return layer_observer_;
}

grpc::ServerReadReactor<grpc::ByteBuffer>* RelayService::Publish(grpc::CallbackServerContext* ctx,
                                                                 grpc::ByteBuffer* response) {
  return NewPublishReactor(this, ctx, response);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* RelayService::Fetch(grpc::CallbackServerContext* ctx,
                                                               const grpc::ByteBuffer* request) {
  v1::FetchRequest req;
  const absl::Status parsed = ParseRequest(*request, "fetch", &req);
  return NewFetchReactor(this, ctx, req, parsed);
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* RelayService::Compress(
    grpc::CallbackServerContext* ctx) {
  return NewCompressReactor(this, ctx);
}

grpc::ServerReadReactor<grpc::ByteBuffer>* RelayService::Forward(grpc::CallbackServerContext* ctx,
                                                                 grpc::ByteBuffer* response) {
  return NewForwardReactor(this, ctx, response);
}

}  // namespace kvrelay
