#include "server/rpc/forward_reactor.h"

#include "core/mutex.h"
#include "proto/wire.h"
#include "server/mesh/routing.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "proto/raw_chunk.h"
#include "proto/status_util.h"
#include "proto/stream_codec.h"
#include "proto/wire_codec.h"
#include "server/mesh/ancestor.h"
#include "server/mesh/forwarder.h"
#include "server/metrics/metrics.h"
#include "server/rpc/internal/request_stream.h"
#include "server/rpc/relay_context.h"
#include "server/rpc/request_checks.h"
#include "spdlog/spdlog.h"

namespace kvrelay {
namespace {

// A coded layer's blob as its chunks arrive. Its room, the largest blob
// the layer can take, is allocated with the first chunk and neither
// zero-filled nor grown: only the bytes that arrived are read.
class LayerBlob {
 public:
  uint64_t size() const { return size_; }
  absl::Span<const uint8_t> bytes() const { return absl::Span<const uint8_t>(buf_.get(), size_); }
  // Where the next `n` bytes go; they count once Commit(n) is called.
  // REQUIRES: size() + n <= room.
  uint8_t* Next(uint64_t room) {
    if (!buf_) buf_.reset(new uint8_t[room]);
    return buf_.get() + size_;
  }
  void Commit(uint64_t n) { size_ += n; }
  void Reset() {
    buf_.reset();
    size_ = 0;
  }

 private:
  std::unique_ptr<uint8_t[]> buf_;
  uint64_t size_ = 0;
};

// A WIRE_CODEC_RANS forward: the blob of the layer arriving, and what
// each layer must decode to.
struct CodedState {
  std::vector<std::vector<WireTensor>> layers;  // expected tensors per layer
  uint32_t layer = 0;                           // the layer whose blob arrives
  size_t slot = 0;                              // reader_'s index of its first tensor
  LayerBlob blob;                               // its bytes so far
  uint64_t blob_bytes = 0;                      // its size, once its header is in (0: not yet)
  TrailerBuilder trailer;                       // of the coded chunks that arrived
  TrailerBuilder decoded;                       // of the decoded chunks given to reader_
};

// The header's protocol version and wire codec: one this relay speaks.
absl::Status CheckForwardProtocol(const v1::ForwardHeader& h) {
  if (h.protocol_version() != kForwardProtocolVersionV1 && h.protocol_version() != kForwardProtocolVersion) {
    return absl::FailedPreconditionError(absl::StrCat("header.protocol_version: ", h.protocol_version(),
                                                      ", this relay speaks ", kForwardProtocolVersionV1, " and ",
                                                      kForwardProtocolVersion));
  }
  if (h.wire_codec() != v1::WIRE_CODEC_NONE &&
      (h.protocol_version() == kForwardProtocolVersionV1 || h.wire_codec() != v1::WIRE_CODEC_RANS)) {
    const bool v1 = h.protocol_version() == kForwardProtocolVersionV1;
    return absl::InvalidArgumentError(absl::StrCat("header.wire_codec: ", h.wire_codec(), " with protocol_version ",
                                                   h.protocol_version(), ", expected NONE (0)",
                                                   v1 ? "" : " or RANS (1)"));
  }
  return absl::OkStatus();
}

class ForwardReactor final
    : public RequestStreamReactor<ForwardReactor, grpc::ServerReadReactor<grpc::ByteBuffer>, v1::ForwardRequest> {
 public:
  ForwardReactor(RelayContext* relay, grpc::CallbackServerContext* ctx, grpc::ByteBuffer* response, Caller caller)
      : RequestStreamReactor(relay, ctx, "forward"),
        wire_resp_(response),
        caller_(std::move(caller)),
        started_(Clock::now()) {
    WatchIdle();
    StartReading();
  }

  void OnDone() override {
    idle_->Disarm();
    if (reserved_) relay_->store()->ReleaseInflight(reserved_);
    if (ticket_) relay_->store()->EndPublish(*ticket_);
    delete this;
  }

 private:
  friend RequestStreamReactor;

  bool started() const { return header_.has_value(); }

  absl::Status Cancelled() const { return absl::CancelledError("forward: cancelled by the sending relay"); }

  // After a header or chunk was accepted.
  void ReadNext() {
    relay_->CountForwardRequestRead();
    StartReading();
  }

  // A peer relay speaks only for its own agents: with mTLS, `sender` must
  // route, in this relay's table, to a host the peer's certificate names.
  absl::Status CheckPeerSpeaksFor(const std::string& sender) {
    if (caller_.identity.empty()) return absl::OkStatus();  // no TLS: nothing to check against
    std::optional<std::string> target;
    if (relay_->routes()) {
      absl::StatusOr<std::optional<std::string>> r = relay_->routes()->Resolve(sender, "header.message.sender");
      if (r.ok()) target = *r;
    }
    const std::string host = target ? TargetHost(*target) : "";
    if (!host.empty() && caller_.PeerIsHost(host)) {
      verified_origin_ = *target;
      return absl::OkStatus();
    }
    if (relay_->metrics()) relay_->metrics()->AddForwardReceived("refused");
    return relay_->Forbid(*ctx_, "forward",
                        absl::StrCat("header.message.sender: ", caller_.Describe(), " does not serve agent \"", sender,
                                     "\" (", target ? absl::StrCat("it routes here to ", *target)
                                                     : std::string("it is local to this relay"),
                                     ", and the peer certificate does not name that host)"));
  }

  // Whether the calling peer is a relay that holds `a`: the one that
  // forwarded it here, or one this relay forwarded it to.
  bool PeerHolds(const StoredMessage& a) const {
    if (caller_.identity.empty()) return true;  // no TLS: nothing to check against
    if (a.forwarded && IsOneOf(a.forwarded_by, caller_.sans)) return true;
    for (const auto& [agent, target] : a.remote) {
      if (caller_.PeerIsHost(TargetHost(target))) return true;
    }
    return false;
  }

  static bool IsOneOf(const std::string& san, const std::vector<std::string>& sans) {
    return !san.empty() && std::find(sans.begin(), sans.end(), san) != sans.end();
  }

  absl::Status OnHeader(const v1::ForwardHeader& h) ABSL_EXCLUSIVE_LOCKS_REQUIRED(idle_->mu) {
    header_ = h;
    KVRELAY_RETURN_IF_ERROR(CheckForwardProtocol(h));
    KVRELAY_RETURN_IF_ERROR(CheckHeaderFields(h));
    const v1::MessageHeader& m = h.message();
    const std::string& session = m.session_id();
    if (relay_->store()->IsClosed(session)) {
      if (relay_->metrics()) relay_->metrics()->AddForwardReceived("refused");
      return absl::FailedPreconditionError(absl::StrCat("header.message.session_id: '", session,
                                                        "' was closed on this relay (CloseSession); a close is "
                                                        "not undone by a later forward"));
    }
    ticket_ = relay_->store()->BeginPublish(session);
    recipients_.assign(h.recipients().begin(), h.recipients().end());

    if (MessagePtr prior = relay_->store()->Find(session, m.message_id())) {
      KVRELAY_RETURN_IF_ERROR(CheckSameForward(h, *prior));
      return Answer(prior, /*received=*/"duplicate");
    }
    if (!h.ancestor_id().empty()) {
      KVRELAY_ASSIGN_OR_RETURN(const bool held, TakeAncestor(h));
      if (!held) {
        spdlog::info("forward session={} message={}: ancestor {} not held as described, asking for it whole",
                     session, m.message_id(), h.ancestor_id());
        resp_.set_ancestor_missing(true);
        FinishOnce(grpc::Status::OK);
        return absl::OkStatus();
      }
    }
    return OpenMessage(h, ancestor_ ? h.ancestor_tokens() : 0);
  }

  // The header's own fields, each as a publish's header checks its twin;
  // keeps the checked geometry in layout_.
  absl::Status CheckHeaderFields(const v1::ForwardHeader& h) ABSL_EXCLUSIVE_LOCKS_REQUIRED(idle_->mu) {
    const v1::MessageHeader& m = h.message();
    KVRELAY_RETURN_IF_ERROR(CheckId("header.message.session_id", m.session_id()));
    KVRELAY_RETURN_IF_ERROR(CheckId("header.message.message_id", m.message_id()));
    KVRELAY_RETURN_IF_ERROR(CheckId("header.message.sender", m.sender()));
    KVRELAY_RETURN_IF_ERROR(CheckPeerSpeaksFor(m.sender()));
    if (!m.parent_id().empty()) KVRELAY_RETURN_IF_ERROR(CheckId("header.message.parent_id", m.parent_id()));
    if (m.role().size() > 128) {
      return absl::InvalidArgumentError(absl::StrCat("header.message.role: ", m.role().size(), " bytes, expected at most 128"));
    }
    // What a publish's header passes, the forward's passes too: the turn's
    // geometry (CheckGeometry) and the requested policy's length; the
    // message header's fields in OpenMessage (DeliveryReader::CheckHeader).
    if (h.has_geometry()) {
      KVRELAY_ASSIGN_OR_RETURN(layout_, CheckGeometry(h.geometry(), "header.geometry", !m.parent_id().empty()));
    }
    KVRELAY_RETURN_IF_ERROR(CheckPolicyLength(h.requested_policy(), "header.requested_policy"));
    KVRELAY_RETURN_IF_ERROR(CheckPolicyLength(m.accounting().policy(), "header.message.accounting.policy"));
    return CheckRecipients(h.recipients(), "header.recipients");
  }

  // Takes the ancestor the header names into ancestor_ when this relay
  // holds it as described; false (nothing taken) otherwise.
  absl::StatusOr<bool> TakeAncestor(const v1::ForwardHeader& h) ABSL_EXCLUSIVE_LOCKS_REQUIRED(idle_->mu) {
    KVRELAY_RETURN_IF_ERROR(CheckId("header.ancestor_id", h.ancestor_id()));
    const v1::MessageHeader& m = h.message();
    MessagePtr a = relay_->store()->Find(m.session_id(), h.ancestor_id());
    // Only an ancestor the peer holds itself (it forwarded it here, or this
    // relay forwarded it there): a peer cannot splice in someone else's KV.
    // Anything else reads as missing, which tells nothing.
    const bool usable = a && PeerHolds(*a) && MayElideWith(*a, m) &&
                        static_cast<uint32_t>(a->msg.layers[0].tokens()) == h.ancestor_tokens();
    if (!usable) return false;
    ancestor_ = std::move(a);
    return true;
  }

  // Reserves the message's bytes and starts reading its stream, which
  // carries the tokens after the ancestor's (`elided` of them).
  absl::Status OpenMessage(const v1::ForwardHeader& h, uint32_t elided) ABSL_EXCLUSIVE_LOCKS_REQUIRED(idle_->mu) {
    const v1::MessageHeader& m = h.message();
    // A message of `elided` fewer history tokens, whose sent bytes are its
    // tensors'.
    const uint64_t n_full = uint64_t{m.n_history()} + m.n_anchor() + m.n_kept() + m.n_gen() + m.n_demoted();
    if (m.acc_tokens() != 0 && m.acc_tokens() != n_full && m.acc_tokens() != n_full - elided) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header.message.acc_tokens: ", m.acc_tokens(), ", expected 0, the message's ", n_full,
          " tokens per head", elided ? absl::StrCat(" or the ", n_full - elided, " after the ancestor") : ""));
    }
    v1::MessageHeader wire = m;
    wire.set_n_history(m.n_history() - elided);
    wire.mutable_accounting()->set_sent_bytes(MessageLayerBytes(wire) * wire.layers());
    // Reserved before anything is allocated for it.
    uint64_t tensor_bytes;
    KVRELAY_RETURN_IF_ERROR(UploadStatus(DeliveryReader::CheckHeader(wire, &tensor_bytes)));
    const uint64_t bytes = RetainedBytes(tensor_bytes, m.layers()) + (ancestor_ ? RetainedBytes(ancestor_->msg) : 0);
    KVRELAY_RETURN_IF_ERROR(relay_->store()->ReserveInflight(bytes, absl::StrCat("forward of ", bytes, " bytes")));
    reserved_ = bytes;
    KVRELAY_RETURN_IF_ERROR(UploadStatus(reader_.Start(wire)));
    if (h.wire_codec() == v1::WIRE_CODEC_RANS) {
      coded_.emplace();
      coded_->layers.resize(wire.layers());
      for (const ChunkSequence::Slot& slot : reader_.slots()) {
        coded_->layers[slot.layer].push_back({slot.part, slot.size});
      }
    }
    return absl::OkStatus();
  }

  absl::Status OnChunk(const ChunkView& c) {
    if (coded_) {
      KVRELAY_RETURN_IF_ERROR(OnCodedChunk(c));
    } else {
      KVRELAY_RETURN_IF_ERROR(UploadStatus(reader_.Add(c)));
    }
    received_ += c.size;
    return absl::OkStatus();
  }

  // A chunk of layer `coded_->layer`'s blob (WIRE_CODEC_RANS): in order and
  // within the largest blob the layer can take; once the blob is whole, its
  // decoded tensors go to reader_ as the chunks an uncoded forward sends.
  absl::Status OnCodedChunk(const ChunkView& c) {
    CodedState& w = *coded_;
    const std::string name = absl::StrCat("chunk (layer ", c.layer, ", ", PartName(c.part), ", offset ", c.offset, ")");
    if (w.layer >= w.layers.size()) {
      return UploadStatus(StreamError(StreamErrorKind::kExtraChunk, absl::StrCat(name, ": after every layer")));
    }
    if (c.layer != w.layer || c.part != v1::PART_WIRE_LAYER || c.offset != w.blob.size()) {
      return UploadStatus(StreamError(
          StreamErrorKind::kOrder, absl::StrCat(name, ", expected (layer ", w.layer, ", PART_WIRE_LAYER, offset ",
                                                w.blob.size(), ")")));
    }
    const uint64_t max = w.blob_bytes ? w.blob_bytes : MaxWireLayerBytes(w.layers[w.layer]);
    if (c.size < 1 || c.size > kMaxChunkBytes || c.size > max - w.blob.size()) {
      return UploadStatus(StreamError(StreamErrorKind::kChunkSize,
                                      absl::StrCat(name, ": ", c.size, " bytes, expected 1..",
                                                   std::min<uint64_t>(kMaxChunkBytes, max - w.blob.size()))));
    }
    if (c.CopyTo(w.blob.Next(MaxWireLayerBytes(w.layers[w.layer]))) != c.crc32c) {
      return UploadStatus(StreamError(StreamErrorKind::kChunkCrc, absl::StrCat(name, ": crc32c mismatch")));
    }
    w.blob.Commit(c.size);
    w.trailer.Add(c.crc32c, c.size);
    if (w.blob_bytes == 0 && w.blob.size() >= kWireBlobHeaderBytes) {
      absl::StatusOr<uint64_t> n = WireLayerBlobBytes(w.blob.bytes(), MaxWireLayerBytes(w.layers[w.layer]));
      if (!n.ok()) return absl::InvalidArgumentError(absl::StrCat("layer ", w.layer, " ", n.status().message()));
      if (w.blob.size() > *n) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": runs past the layer's blob of ", *n, " bytes"));
      }
      w.blob_bytes = *n;
    }
    if (w.blob_bytes == 0 || w.blob.size() < w.blob_bytes) return absl::OkStatus();
    // The layer's blob is whole: decoded straight into the message's
    // tensors, which the decoded chunks then fill in place (checked and
    // counted as an uncoded forward's, without a copy or a second CRC pass).
    const std::vector<WireTensor>& expected = w.layers[w.layer];
    std::vector<uint8_t*> dst(expected.size());
    for (size_t i = 0; i < expected.size(); ++i) dst[i] = reader_.SlotData(w.slot + i);
    std::vector<std::vector<uint32_t>> crcs;  // per tensor, per chunk
    if (absl::Status st = DecodeWireLayerInto(w.blob.bytes(), expected, dst, kMaxChunkBytes, &crcs); !st.ok()) {
      return absl::Status(st.code(), absl::StrCat("layer ", w.layer, " ", st.message()));
    }
    for (size_t i = 0; i < expected.size(); ++i) {
      for (uint64_t off = 0; off < expected[i].size; off += kMaxChunkBytes) {
        ChunkView d;
        d.layer = w.layer;
        d.part = expected[i].part;
        d.offset = off;
        d.size = std::min<uint64_t>(kMaxChunkBytes, expected[i].size - off);
        d.pieces.push_back(absl::Span<const uint8_t>(dst[i] + off, d.size));
        d.crc32c = crcs[i][off / kMaxChunkBytes];
        w.decoded.Add(d.crc32c, d.size);
        KVRELAY_RETURN_IF_ERROR(UploadStatus(reader_.AddInPlace(d)));
      }
    }
    w.slot += expected.size();
    ++w.layer;
    w.blob.Reset();
    w.blob_bytes = 0;
    return absl::OkStatus();
  }

  // The commit's trailer against the coded chunks that arrived; OK for an
  // uncoded forward (reader_ checks it).
  absl::Status CheckCodedTrailer(const v1::Trailer& t) const {
    if (!coded_) return absl::OkStatus();
    const CodedState& w = *coded_;
    if (w.layer < w.layers.size()) {
      return UploadStatus(StreamError(StreamErrorKind::kIncomplete,
                                      absl::StrCat("commit: before layer ", w.layer, "'s blob was complete (",
                                                   w.blob.size(), " bytes of it arrived)")));
    }
    const v1::Trailer got = w.trailer.Build();
    if (t.chunks() != got.chunks() || t.bytes() != got.bytes()) {
      return UploadStatus(StreamError(StreamErrorKind::kTrailerCount,
                                      absl::StrCat("commit.trailer: ", t.chunks(), " chunks of ", t.bytes(),
                                                   " bytes, ", got.chunks(), " chunks of ", got.bytes(), " arrived")));
    }
    if (t.crc32c() != got.crc32c()) {
      return UploadStatus(StreamError(StreamErrorKind::kTrailerCrc,
                                      absl::StrCat("commit.trailer.crc32c: ", t.crc32c(), ", the chunks that arrived have ",
                                                   got.crc32c())));
    }
    return absl::OkStatus();
  }

  void OnCommit(const v1::ForwardCommit& c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(idle_->mu) {
    const v1::ForwardHeader& h = *header_;
    Message suffix;
    if (absl::Status st = CheckCodedTrailer(c.trailer()); !st.ok()) return Fail(st);
    const v1::Trailer trailer = coded_ ? coded_->decoded.Build() : c.trailer();
    if (StreamError e = reader_.Finish(trailer, &suffix); !e.ok()) return Fail(UploadStatus(e));
    Message msg = ancestor_ ? RebuildFromAncestor(ancestor_->msg, std::move(suffix)) : std::move(suffix);
    // A child composed on this message relies on every head holding the
    // chain's anchors.
    if (absl::Status st = CheckMessageAnchors(msg, "header.message.anchor_pos"); !st.ok()) return Fail(st);
    msg.n_history = static_cast<int>(h.message().n_history());
    msg.policy = c.accounting().policy();
    msg.full_bytes = c.accounting().full_bytes();
    msg.next_pos = c.next_pos();
    uint64_t sent = 0;
    for (const MessageLayer& l : msg.layers) sent += l.SentBytes();
    msg.sent_bytes = sent;
    if (sent != c.accounting().sent_bytes()) {
      return Fail(absl::InvalidArgumentError(absl::StrCat("commit.accounting.sent_bytes: ", c.accounting().sent_bytes(),
                                                          ", expected ", sent, " (what the message holds)")));
    }
    auto m = std::make_shared<StoredMessage>();
    const v1::MessageHeader& mh = h.message();
    m->session_id = mh.session_id();
    m->message_id = mh.message_id();
    m->sender = mh.sender();
    m->role = mh.role();
    m->parent_id = mh.parent_id();
    m->recipients = recipients_;
    m->requested_policy = h.requested_policy();
    m->layout = layout_;
    m->accounting = AccountingFromProto(c.accounting());
    // With mTLS the origin is the relay the certificate proved, as this
    // relay routes to it, not what the forward says about itself.
    m->origin = caller_.identity.empty() ? h.origin() : verified_origin_;
    m->forwarded = true;
    m->forwarded_by = caller_.identity;
    m->msg = std::move(msg);
    m->family = PolicyFamily(m->msg.policy);
    m->bytes = RetainedBytes(m->msg);
    m->started = started_;
    if (ctx_->IsCancelled()) return Fail(absl::CancelledError("forward: cancelled before the commit"));
    absl::StatusOr<Store::ForwardCommitResult> r = relay_->store()->CommitForward(m, recipients_, *ticket_);
    if (!r.ok()) return Fail(r.status());
    if (r->duplicate) {  // the same id committed meanwhile
      if (absl::Status same = CheckSameForward(h, *r->msg); !same.ok()) return Fail(same);
    }
    FillResults(*r);
    if (Metrics* mx = relay_->metrics()) {
      mx->AddForwardReceived(r->duplicate ? "duplicate" : "committed");
      if (!r->duplicate) mx->AddReceived(received_);
    }
    spdlog::info("forward committed here session={} message={} from={} origin={} recipients={} elided_tokens={} "
                 "bytes={}",
                 m->session_id, m->message_id, m->sender, h.origin(), recipients_.size(),
                 ancestor_ ? h.ancestor_tokens() : 0, received_);
    FinishOnce(grpc::Status::OK);
  }

  // Answers from the header: the message is held already.
  absl::Status Answer(const MessagePtr& prior, const char* received) ABSL_EXCLUSIVE_LOCKS_REQUIRED(idle_->mu) {
    absl::StatusOr<Store::ForwardCommitResult> r = relay_->store()->CommitForward(
        std::const_pointer_cast<StoredMessage>(prior), recipients_, *ticket_);
    if (!r.ok()) return r.status();
    FillResults(*r);
    if (relay_->metrics()) relay_->metrics()->AddForwardReceived(received);
    FinishOnce(grpc::Status::OK);
    return absl::OkStatus();
  }

  void FillResults(const Store::ForwardCommitResult& r) {
    resp_.clear_results();
    for (const Store::RecipientResult& x : r.recipients) {
      v1::ForwardResult* out = resp_.add_results();
      out->set_agent(x.agent);
      out->set_code(static_cast<int32_t>(x.status.code()));
      out->set_message(std::string(x.status.message()));
      out->set_duplicate(x.duplicate);
    }
  }

  void OnIdle() ABSL_EXCLUSIVE_LOCKS_REQUIRED(idle_->mu) {
    if (finished_) return;
    Fail(absl::DeadlineExceededError(absl::StrCat("forward: idle for ", relay_->watchdog()->timeout_seconds(),
                                                  " s (--upload-idle-timeout-seconds)")));
  }

  void Fail(const absl::Status& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(idle_->mu) {
    if (header_) {
      spdlog::info("forward refused session={} message={} origin={}: {}", header_->message().session_id(),
                   header_->message().message_id(), header_->origin(), s.ToString());
    }
    FinishOnce(ToGrpcStatus(s));
  }

  void FinishOnce(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(idle_->mu) {
    if (finished_.exchange(true)) return;
    idle_->armed = false;
    relay_->CountRpc("Forward", status);
    if (status.ok()) *wire_resp_ = EncodeProto(resp_);
    Finish(status);
  }

  grpc::ByteBuffer* const wire_resp_;
  const Caller caller_;
  std::string verified_origin_;  // with mTLS: the sender's route target here
  const Clock::time_point started_;
  std::optional<v1::ForwardHeader> header_;
  std::optional<TurnLayout> layout_;  // header_->geometry as checked, when it has one
  std::optional<Store::PublishTicket> ticket_;
  std::vector<std::string> recipients_;
  MessagePtr ancestor_;
  DeliveryReader reader_;
  // A WIRE_CODEC_RANS forward's state (CodedState).
  std::optional<CodedState> coded_;
  uint64_t reserved_ = 0, received_ = 0;
  v1::ForwardResponse resp_;
};

}  // namespace

grpc::ServerReadReactor<grpc::ByteBuffer>* NewForwardReactor(RelayContext* relay, grpc::CallbackServerContext* ctx,
                                                            grpc::ByteBuffer* response, Caller caller) {
  return new ForwardReactor(relay, ctx, response, std::move(caller));
}

absl::Status CheckSameForward(const v1::ForwardHeader& h, const StoredMessage& prior) {
  const v1::MessageHeader& m = h.message();
  return CheckRetryOf({/*call=*/"forward", /*prefix=*/"header.message.", /*policy_field=*/"header.requested_policy",
                       m.sender(), m.role(), m.parent_id(), h.requested_policy(), &h.geometry()},
                      prior);
}

}  // namespace kvrelay
