// The read loop of the relay's request streams (Publish, Compress, Forward):
// one header, then chunks, then one commit.
#ifndef KVRELAY_SERVER_RPC_INTERNAL_REQUEST_STREAM_H_
#define KVRELAY_SERVER_RPC_INTERNAL_REQUEST_STREAM_H_

#include <atomic>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/mutex.h"
#include "grpcpp/grpcpp.h"
#include "proto/raw_chunk.h"
#include "server/rpc/internal/call_util.h"
#include "server/rpc/relay_context.h"
#include "server/rpc/watchdog.h"

namespace kvrelay {

// A reactor that reads a stream of `Request`s (a oneof `kind` of header,
// chunk and commit) in that order. A chunk is read straight out of gRPC's
// slices (RawMessage::AsChunk); anything else is parsed as a Request. The
// loop refuses, with INVALID_ARGUMENT naming what came and what was
// expected: an unreadable or malformed request, one with no kind set, a
// second header, and a chunk or commit before the header. It reacts under
// the idle watchdog entry's mutex, so an idle firing never overlaps it.
//
// Derived supplies, each called under idle_->mu:
//   bool started() const;               // the header was accepted
//   absl::Status OnHeader(const H&);    // may finish the call itself
//   absl::Status OnChunk(const ChunkView&);  // after the header only
//   void OnCommit(const C&);            // ends the reads: it finishes the
//                                       // call or arranges that it will be
//   void Fail(const absl::Status&);     // finishes the call (once)
//   absl::Status Cancelled();           // the status of a cancelled stream
//   void ReadNext();                    // reads on (StartReading) or pauses
//   void OnIdle();                      // the watchdog found the stream idle
// and sets finished_ once it finishes the call. Derived's constructor calls
// WatchIdle() and then StartReading() last, once it is whole.
template <typename Derived, typename Reactor, typename Request>
class RequestStreamReactor : public Reactor {
 public:
  void OnReadDone(bool ok) override {
    Derived& d = self();  // (its hooks require d.idle_->mu, the same mutex)
    MutexLock activity(&d.idle_->mu);  // no idle firing during the reaction
    d.idle_->TouchLocked();
    if (finished_) return;  // failed meanwhile (idle): read no further
    if (!ok) {
      if (ctx_->IsCancelled()) return d.Fail(d.Cancelled());
      return d.Fail(absl::InvalidArgumentError(
          absl::StrCat(rpc_, d.started() ? ": stream ended before the commit, expected a commit"
                                         : ": empty stream, expected a header first")));
    }
    if (!raw_.Reset(wire_)) return d.Fail(absl::InvalidArgumentError(absl::StrCat(rpc_, ": unreadable request")));
    absl::Status s;
    if (raw_.AsChunk(Request::kChunkFieldNumber, &chunk_)) {
      s = Chunk();
    } else if (!raw_.ParseAs(&req_)) {
      return d.Fail(NotARequestError<Request>(rpc_, raw_.size()));
    } else {
      switch (req_.kind_case()) {
        case Request::kHeader:
          if (d.started()) {
            s = absl::InvalidArgumentError("header: a second header, expected chunks or the commit");
          } else {
            s = d.OnHeader(req_.header());
            if (finished_) return;  // answered from the header alone
          }
          break;
        case Request::kChunk:
          chunk_ = ChunkView::Of(req_.chunk());
          s = Chunk();
          break;
        case Request::kCommit:
          if (!d.started()) {
            s = absl::InvalidArgumentError("commit: before the header, expected the header first");
            break;
          }
          return d.OnCommit(req_.commit());
        default:
          s = absl::InvalidArgumentError("request: none of header, chunk, commit is set");
      }
    }
    if (!s.ok()) return d.Fail(s);
    ReleaseRequest();
    d.ReadNext();
  }

 protected:
  RequestStreamReactor(RelayContext* relay, grpc::CallbackServerContext* ctx, const char* rpc)
      : relay_(relay), ctx_(ctx), rpc_(rpc) {}

  // Registers with the relay's watchdog: Derived::OnIdle fires under
  // idle_->mu once nothing arrived for the idle timeout.
  void WatchIdle() {
    idle_ = relay_->watchdog()->Watch([this] {
      Derived& d = self();
      d.idle_->mu.AssertHeld();
      d.OnIdle();
    });
  }

  void StartReading() { this->StartRead(&wire_); }

  RelayContext* const relay_;
  grpc::CallbackServerContext* const ctx_;
  const char* const rpc_;  // "publish", "compress" or "forward", for messages
  std::shared_ptr<UploadWatchdog::Entry> idle_;
  std::atomic<bool> finished_{false};

 private:
  Derived& self() { return static_cast<Derived&>(*this); }

  absl::Status Chunk() {
    if (!self().started()) return absl::InvalidArgumentError("chunk: before the header, expected the header first");
    return self().OnChunk(chunk_);
  }

  // Drops the handled request's gRPC slices (a chunk's MiB) before the next
  // read, which a backpressure pause may delay.
  void ReleaseRequest() {
    chunk_ = ChunkView();
    raw_.Reset(grpc::ByteBuffer());
    wire_.Clear();
    req_.Clear();
  }

  grpc::ByteBuffer wire_;  // the request being read
  RawMessage raw_;         // wire_'s slices
  ChunkView chunk_;        // a chunk request: views into raw_ (or req_)
  Request req_;            // any other request, parsed
};

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_RPC_INTERNAL_REQUEST_STREAM_H_
