#include "server/mesh/ancestor.h"

#include <algorithm>
#include <cstring>
#include <tuple>
#include <utility>

#include "proto/wire.h"

namespace kvrelay {
namespace {

const float* AccOf(const ForwardSource::LayerView& v) { return reinterpret_cast<const float*>(v.acc.data.data()); }

// A chain of parents longer than this is not followed.
constexpr int kMaxParentHops = 4096;

}  // namespace

bool MayElideWith(const StoredMessage& ancestor, const v1::MessageHeader& m) {
  const Message& a = ancestor.msg;
  return m.quant_bits() == 0 && m.n_demoted() == 0 && !a.layers.empty() && !a.layers[0].quant &&
         !a.layers[0].demoted && a.layers.size() == m.layers() && static_cast<uint32_t>(a.kv_heads) == m.kv_heads() &&
         static_cast<uint32_t>(a.head_dim) == m.head_dim() && ToProtoDType(a.dtype) == m.dtype() &&
         static_cast<uint32_t>(a.layers[0].tokens()) <= m.n_history();
}

MessagePtr FindElisionAncestor(const MessageIndex& messages, const PeerBook& peers, const std::string& session,
                               const v1::MessageHeader& m, const std::string& target) {
  std::string pid = m.parent_id();
  for (int hops = 0; !pid.empty() && hops < kMaxParentHops; ++hops) {
    MessagePtr p = messages.Find(session, pid);
    if (!p) return nullptr;
    if (peers.PeerHolds(session, pid, target)) return MayElideWith(*p, m) ? p : nullptr;
    pid = p->parent_id;
  }
  return nullptr;
}

bool PrefixMatches(const ForwardSource::LayerView& v, const MessageLayer& anc, int a) {
  if (!v.dense || anc.quant || anc.tokens() != a || v.tokens < a) return false;
  const int heads = anc.pos.heads;
  if (heads == 0 || static_cast<int>(v.pos.size()) != heads * v.tokens) return false;
  const size_t rb = anc.k.row_bytes();
  if (v.k.size() != static_cast<size_t>(heads) * v.tokens * rb || anc.k.heads() != heads) return false;
  for (int h = 0; h < heads; ++h) {
    const size_t off = static_cast<size_t>(h) * v.tokens * rb, aoff = static_cast<size_t>(h) * a * rb;
    if (std::memcmp(v.k.data() + off, anc.k.bytes().data() + aoff, a * rb) != 0) return false;
    if (std::memcmp(v.v.data() + off, anc.v.bytes().data() + aoff, a * rb) != 0) return false;
    if (std::memcmp(v.pos.data() + static_cast<size_t>(h) * v.tokens, anc.pos.data.data() + static_cast<size_t>(h) * a,
                    a * sizeof(int32_t)) != 0) {
      return false;
    }
  }
  return true;
}

bool AccPrefixMatches(const ForwardSource::LayerView& v, const MessageLayer& anc, int a) {
  const int heads = anc.pos.heads;
  if (v.acc.data.size() != static_cast<size_t>(heads) * v.tokens * sizeof(float)) return false;
  for (int h = 0; h < heads; ++h) {
    for (int t = 0; t < a; ++t) {
      const float want = anc.acc.empty() ? 0.0f : anc.acc[static_cast<size_t>(h) * a + t];
      if (AccOf(v)[static_cast<size_t>(h) * v.tokens + t] != want) return false;
    }
  }
  return true;
}

std::shared_ptr<MessageLayer> SuffixAfter(const ForwardSource::LayerView& v, const MessageLayer& anc, int a, bool acc) {
  auto out = std::make_shared<MessageLayer>();
  const int heads = anc.pos.heads, n = v.tokens - a, dim = anc.k.dim();
  const size_t rb = anc.k.row_bytes();
  out->k = KvTensor::Uninitialized(anc.k.dtype(), heads, n, dim);
  out->v = KvTensor::Uninitialized(anc.k.dtype(), heads, n, dim);
  out->pos = PosTensor(heads, n);
  for (int h = 0; h < heads; ++h) {
    const size_t src = (static_cast<size_t>(h) * v.tokens + a) * rb, dst = static_cast<size_t>(h) * n * rb;
    std::memcpy(out->k.mutable_bytes().data() + dst, v.k.data() + src, n * rb);
    std::memcpy(out->v.mutable_bytes().data() + dst, v.v.data() + src, n * rb);
    std::memcpy(out->pos.data.data() + static_cast<size_t>(h) * n, v.pos.data() + static_cast<size_t>(h) * v.tokens + a,
                n * sizeof(int32_t));
  }
  if (acc) {
    out->acc.resize(static_cast<size_t>(heads) * n);
    for (int h = 0; h < heads; ++h) {
      std::copy_n(AccOf(v) + static_cast<size_t>(h) * v.tokens + a, n, out->acc.begin() + static_cast<size_t>(h) * n);
    }
  }
  return out;
}

Message RebuildFromAncestor(const Message& ancestor, Message suffix) {
  for (size_t l = 0; l < suffix.layers.size(); ++l) {
    const MessageLayer& a = ancestor.layers[l];
    MessageLayer& s = suffix.layers[l];
    const int heads = a.pos.heads, na = a.tokens(), ns = s.tokens(), n = na + ns;
    const size_t rb = a.k.row_bytes();
    MessageLayer out;
    out.k = KvTensor::Uninitialized(a.k.dtype(), heads, n, a.k.dim());
    out.v = KvTensor::Uninitialized(a.k.dtype(), heads, n, a.k.dim());
    out.pos = PosTensor(heads, n);
    if (s.acc.size() == static_cast<size_t>(heads) * n) {
      out.acc = std::move(s.acc);  // the whole message's
    } else if (!s.acc.empty()) {   // the tokens after the ancestor's, whose acc is the ancestor's
      out.acc.assign(static_cast<size_t>(heads) * n, 0.0f);
      for (int h = 0; h < heads; ++h) {
        if (!a.acc.empty()) {
          std::copy_n(a.acc.begin() + static_cast<size_t>(h) * na, na, out.acc.begin() + static_cast<size_t>(h) * n);
        }
        std::copy_n(s.acc.begin() + static_cast<size_t>(h) * ns, ns, out.acc.begin() + static_cast<size_t>(h) * n + na);
      }
    }
    for (int h = 0; h < heads; ++h) {
      for (auto [dst, src_a, src_s] : {std::tuple{&out.k, &a.k, &s.k}, std::tuple{&out.v, &a.v, &s.v}}) {
        uint8_t* d = dst->mutable_bytes().data() + static_cast<size_t>(h) * n * rb;
        std::memcpy(d, src_a->bytes().data() + static_cast<size_t>(h) * na * rb, na * rb);
        std::memcpy(d + na * rb, src_s->bytes().data() + static_cast<size_t>(h) * ns * rb, ns * rb);
      }
      int32_t* p = out.pos.data.data() + static_cast<size_t>(h) * n;
      std::memcpy(p, a.pos.data.data() + static_cast<size_t>(h) * na, na * sizeof(int32_t));
      std::memcpy(p + na, s.pos.data.data() + static_cast<size_t>(h) * ns, ns * sizeof(int32_t));
    }
    s = std::move(out);
  }
  return suffix;
}

}  // namespace kvrelay
