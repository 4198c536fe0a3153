// Helpers for the relay tests: turn -> upload stream, and stream -> message.
#ifndef KVRELAY_TESTS_SERVER_RELAY_TEST_UTIL_H_
#define KVRELAY_TESTS_SERVER_RELAY_TEST_UTIL_H_

#include <chrono>
#include <cstring>
#include <map>

#include "gtest/gtest.h"
#include <memory>
#include <string>
#include <vector>

#include "core/crc32c.h"
#include "core/message.h"
#include "core/turn.h"
#include "proto/wire.h"
#include "grpcpp/grpcpp.h"
#include "kvrelay/v1/relay.grpc.pb.h"

namespace kvrelay::testing {

inline v1::DType ProtoDType(DType d) {
  return ToProtoDType(d);
}

inline v1::TurnGeometry ProtoGeometry(const Turn& t, bool with_history = true) {
  v1::TurnGeometry g;
  const TurnLayer& l0 = t.layers[0];
  g.set_layers(t.layers.size());
  g.set_kv_heads(l0.prompt_k.heads());
  g.set_score_heads(l0.has_queries() ? l0.gen_q.heads() : l0.scores.rows);
  if (l0.has_queries()) g.set_query_dtype(ProtoDType(l0.gen_q.dtype()));
  if (t.softmax_scale) g.set_softmax_scale(*t.softmax_scale);
  g.set_head_dim(l0.prompt_k.dim());
  g.set_dtype(ProtoDType(l0.prompt_k.dtype()));
  g.set_n_prompt(l0.prompt_k.tokens());
  g.set_n_gen(l0.gen_k.tokens());
  g.set_n_history(with_history ? l0.history_k.tokens() : 0);
  if (with_history) g.mutable_history_anchors()->Assign(t.history_anchors.begin(), t.history_anchors.end());
  g.set_first_agent(t.first_agent);
  if (t.prompt_pos0) g.set_prompt_pos0(*t.prompt_pos0);
  if (!l0.history_score.data.empty()) g.set_history_score_tokens(l0.history_score.cols);
  return g;
}

// The bytes of a message's acc (relay-side, not sent to agents): 4 per
// token, head and layer.
inline uint64_t AccBytes(const Message& m) {
  uint64_t n = 0;
  for (const MessageLayer& l : m.layers) n += 4 * static_cast<uint64_t>(l.pos.heads) * l.pos.tokens;
  return n;
}

// The chunks of a turn in upload order, `chunk_bytes` at most each.
inline std::vector<v1::Chunk> TurnChunks(const Turn& t, size_t chunk_bytes = 1 << 20) {
  std::vector<v1::Chunk> out;
  for (size_t l = 0; l < t.layers.size(); ++l) {
    const TurnLayer& L = t.layers[l];
    auto add = [&](v1::Part part, const void* data, size_t size) {
      const uint8_t* p = static_cast<const uint8_t*>(data);
      for (size_t off = 0; off < size; off += chunk_bytes) {
        v1::Chunk c;
        c.set_layer(l);
        c.set_part(part);
        c.set_offset(off);
        const size_t n = std::min(chunk_bytes, size - off);
        c.set_data(p + off, n);
        c.set_crc32c(Crc32c(p + off, n));
        out.push_back(std::move(c));
      }
    };
    add(v1::PART_PROMPT_K, L.prompt_k.bytes().data(), L.prompt_k.byte_size());
    add(v1::PART_PROMPT_V, L.prompt_v.bytes().data(), L.prompt_v.byte_size());
    add(v1::PART_GEN_K, L.gen_k.bytes().data(), L.gen_k.byte_size());
    add(v1::PART_GEN_V, L.gen_v.bytes().data(), L.gen_v.byte_size());
    if (L.has_queries()) {
      add(v1::PART_GEN_Q, L.gen_q.bytes().data(), L.gen_q.byte_size());
    } else {
      add(v1::PART_PROMPT_SCORE, L.scores.data.data(), 4 * L.scores.data.size());
      add(v1::PART_HISTORY_SCORE, L.history_score.data.data(), 4 * L.history_score.data.size());
    }
    if (L.history_k.tokens() > 0) {
      add(v1::PART_HISTORY_K, L.history_k.bytes().data(), L.history_k.byte_size());
      add(v1::PART_HISTORY_V, L.history_v.bytes().data(), L.history_v.byte_size());
      add(v1::PART_HISTORY_POS, L.history_pos.data.data(), 4 * L.history_pos.data.size());
    }
  }
  return out;
}

inline v1::Trailer TrailerOf(const std::vector<v1::Chunk>& chunks) {
  v1::Trailer t;
  uint32_t crc = 0;
  uint64_t bytes = 0;
  for (const auto& c : chunks) {
    crc = Crc32cExtend(crc, c.data().data(), c.data().size());
    bytes += c.data().size();
  }
  t.set_chunks(chunks.size());
  t.set_bytes(bytes);
  t.set_crc32c(crc);
  return t;
}

inline std::vector<v1::PublishRequest> PublishStream(const v1::PublishHeader& h, const std::vector<v1::Chunk>& chunks,
                                                     const v1::Trailer& trailer) {
  std::vector<v1::PublishRequest> reqs;
  *reqs.emplace_back().mutable_header() = h;
  for (const auto& c : chunks) *reqs.emplace_back().mutable_chunk() = c;
  *reqs.emplace_back().mutable_commit() = trailer;
  return reqs;
}

inline std::chrono::system_clock::time_point In(double seconds) {
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(std::chrono::duration<double>(seconds));
}

struct PublishResult {
  grpc::Status status;
  v1::PublishResponse response;
};

inline PublishResult DoPublish(v1::Relay::Stub* stub, const std::vector<v1::PublishRequest>& reqs,
                               double timeout_s = 30) {
  PublishResult r;
  grpc::ClientContext ctx;
  ctx.set_deadline(In(timeout_s));
  auto writer = stub->Publish(&ctx, &r.response);
  for (const auto& q : reqs) {
    if (!writer->Write(q)) break;
  }
  writer->WritesDone();
  r.status = writer->Finish();
  return r;
}

inline v1::PublishHeader Header(const std::string& session, const std::string& id, const std::string& from,
                                std::vector<std::string> to, const std::string& policy, const Turn& turn) {
  v1::PublishHeader h;
  h.set_session_id(session);
  h.set_message_id(id);
  h.set_sender(from);
  for (auto& r : to) h.add_recipients(r);
  h.set_policy(policy);
  *h.mutable_geometry() = ProtoGeometry(turn);
  return h;
}

inline PublishResult PublishTurn(v1::Relay::Stub* stub, const v1::PublishHeader& h, const Turn& turn,
                                 size_t chunk_bytes = 1 << 20) {
  auto chunks = TurnChunks(turn, chunk_bytes);
  return DoPublish(stub, PublishStream(h, chunks, TrailerOf(chunks)));
}

struct FetchResult {
  grpc::Status status;
  v1::MessageHeader header;
  Message msg;  // dense or packed layers, as delivered
  bool trailer_ok = false;
};

// Reassembles a delivery (Fetch or Compress response stream).
template <typename Resp>
struct Reassembler {
  FetchResult r;
  uint32_t crc = 0;
  uint64_t bytes = 0, chunks = 0;
  std::vector<std::map<int, std::string>> parts;

  void Add(const Resp& resp) {
    if (resp.has_header()) {
      r.header = resp.header();
      parts.assign(r.header.layers(), {});
    } else if (resp.has_chunk()) {
      const auto& c = resp.chunk();
      EXPECT_EQ(Crc32c(c.data().data(), c.data().size()), c.crc32c());
      std::string& dst = parts.at(c.layer())[c.part()];
      EXPECT_EQ(dst.size(), c.offset());
      dst += c.data();
      crc = Crc32cExtend(crc, c.data().data(), c.data().size());
      bytes += c.data().size();
      ++chunks;
    } else if (resp.has_trailer()) {
      r.trailer_ok = resp.trailer().crc32c() == crc && resp.trailer().bytes() == bytes &&
                     resp.trailer().chunks() == chunks;
    }
  }

  void Build() {
    const auto& h = r.header;
    const DType dt = DTypeFromProto(h.dtype()).value_or(DType::kBF16);
    const int n = h.n_history() + h.n_anchor() + h.n_kept() + h.n_gen();
    r.msg.dtype = dt;
    r.msg.kv_heads = h.kv_heads();
    r.msg.head_dim = h.head_dim();
    r.msg.policy = h.accounting().policy();
    for (auto& p : parts) {
      MessageLayer L;
      L.pos = PosTensor(h.kv_heads(), n);
      std::memcpy(L.pos.data.data(), p[v1::PART_POS].data(), std::min(p[v1::PART_POS].size(), 4 * L.pos.data.size()));
      if (h.quant_bits() == 0) {
        L.k = KvTensor(dt, h.kv_heads(), n, h.head_dim());
        L.v = KvTensor(dt, h.kv_heads(), n, h.head_dim());
        std::memcpy(L.k.mutable_bytes().data(), p[v1::PART_K].data(), std::min(p[v1::PART_K].size(), L.k.byte_size()));
        std::memcpy(L.v.mutable_bytes().data(), p[v1::PART_V].data(), std::min(p[v1::PART_V].size(), L.v.byte_size()));
      } else {
        QuantizedKv q;
        q.bits = h.quant_bits();
        q.k.codes.assign(p[v1::PART_K_CODES].begin(), p[v1::PART_K_CODES].end());
        q.v.codes.assign(p[v1::PART_V_CODES].begin(), p[v1::PART_V_CODES].end());
        auto u16 = [](const std::string& s) {
          std::vector<uint16_t> v(s.size() / 2);
          std::memcpy(v.data(), s.data(), s.size());
          return v;
        };
        q.k.scale = u16(p[v1::PART_K_SCALE]);
        q.k.zero = u16(p[v1::PART_K_ZERO]);
        q.v.scale = u16(p[v1::PART_V_SCALE]);
        q.v.zero = u16(p[v1::PART_V_ZERO]);
        L.quant = std::move(q);
      }
      r.msg.layers.push_back(std::move(L));
    }
  }
};

inline FetchResult DoFetch(v1::Relay::Stub* stub, const std::string& session, const std::string& agent,
                           bool auto_ack, double timeout_s = 10) {
  grpc::ClientContext ctx;
  ctx.set_deadline(In(timeout_s));
  v1::FetchRequest req;
  req.set_session_id(session);
  req.set_agent(agent);
  req.set_auto_ack(auto_ack);
  auto reader = stub->Fetch(&ctx, req);
  Reassembler<v1::FetchResponse> ra;
  v1::FetchResponse resp;
  while (reader->Read(&resp)) ra.Add(resp);
  ra.r.status = reader->Finish();
  if (ra.r.status.ok()) ra.Build();
  return std::move(ra.r);
}

using CompressStream = grpc::ClientReaderWriter<v1::CompressRequest, v1::CompressResponse>;

// Writes a whole Compress upload: the header, the turn's chunks, the commit,
// then WritesDone. False when the server ended the call early.
inline bool WriteCompressUpload(CompressStream* stream, const Turn& t, const std::string& policy,
                                size_t chunk_bytes = 1 << 20) {
  v1::CompressRequest req;
  req.mutable_header()->set_policy(policy);
  *req.mutable_header()->mutable_geometry() = ProtoGeometry(t);
  if (!stream->Write(req)) return false;
  const auto chunks = TurnChunks(t, chunk_bytes);
  for (const auto& c : chunks) {
    *req.mutable_chunk() = c;
    if (!stream->Write(req)) return false;
  }
  *req.mutable_commit() = TrailerOf(chunks);
  if (!stream->Write(req)) return false;
  return stream->WritesDone();
}

// One stateless Compress call: the turn in, the reassembled message out.
inline FetchResult DoCompress(v1::Relay::Stub* stub, const Turn& t, const std::string& policy,
                              size_t chunk_bytes = 1 << 20, double timeout_s = 20) {
  grpc::ClientContext ctx;
  ctx.set_deadline(In(timeout_s));
  auto stream = stub->Compress(&ctx);
  Reassembler<v1::CompressResponse> ra;
  if (WriteCompressUpload(stream.get(), t, policy, chunk_bytes)) {
    v1::CompressResponse resp;
    while (stream->Read(&resp)) ra.Add(resp);
  }
  ra.r.status = stream->Finish();
  if (ra.r.status.ok()) ra.Build();
  return std::move(ra.r);
}

// Every tensor of `got` equals `want`'s, and both are dense or both quantized.
inline void ExpectSameMessage(const Message& got, const Message& want) {
  ASSERT_EQ(got.layers.size(), want.layers.size());
  for (size_t l = 0; l < want.layers.size(); ++l) {
    const MessageLayer& g = got.layers[l];
    const MessageLayer& w = want.layers[l];
    EXPECT_EQ(g.pos, w.pos) << "layer " << l;
    if (w.quant) {
      ASSERT_TRUE(g.quant) << "layer " << l;
      EXPECT_EQ(g.quant->k.codes, w.quant->k.codes);
      EXPECT_EQ(g.quant->k.scale, w.quant->k.scale);
      EXPECT_EQ(g.quant->k.zero, w.quant->k.zero);
      EXPECT_EQ(g.quant->v.codes, w.quant->v.codes);
      EXPECT_EQ(g.quant->v.scale, w.quant->v.scale);
      EXPECT_EQ(g.quant->v.zero, w.quant->v.zero);
    } else {
      ASSERT_FALSE(g.quant) << "layer " << l;
      EXPECT_TRUE(g.k == w.k) << "layer " << l << " k";
      EXPECT_TRUE(g.v == w.v) << "layer " << l << " v";
    }
  }
}

}  // namespace kvrelay::testing

#endif  // KVRELAY_TESTS_SERVER_RELAY_TEST_UTIL_H_
