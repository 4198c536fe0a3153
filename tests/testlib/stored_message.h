// Synthetic stored messages, as a publish leaves them committed: for the
// store's and the spool's tests and for bench/spool_recovery_bench.cc.
//
//   std::mt19937 rng(seed);
//   auto m = StoredMessageOf(DenseMessage({/*layers=*/40, /*kv_heads=*/8, /*head_dim=*/128, /*tokens=*/n}, rng),
//                            "s", "m1", "a", {"b"});
//
// Header-only: it needs only the store's types (server/store/store.h).
#ifndef KVRELAY_TESTS_TESTLIB_STORED_MESSAGE_H_
#define KVRELAY_TESTS_TESTLIB_STORED_MESSAGE_H_

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/message.h"
#include "server/store/store.h"

namespace kvrelay::testing {

struct DenseMessageShape {
  int layers = 2;
  int kv_heads = 2;
  int head_dim = 8;
  int tokens = 5;
};

// A dense BF16 message of policy `full`: shape.layers layers of K and V
// [kv_heads, tokens, head_dim], each value finite and moderate (sign +,
// exponent byte 0x3c..0x3f, the rest random: one rng() per value), and
// positions 0..tokens-1 in every head. Its sent and full bytes are its
// tensors'.
inline Message DenseMessage(const DenseMessageShape& shape, std::mt19937& rng) {
  Message msg;
  msg.policy = "full";
  msg.dtype = DType::kBF16;
  msg.kv_heads = shape.kv_heads;
  msg.head_dim = shape.head_dim;
  msg.n_kept = shape.tokens;
  for (int l = 0; l < shape.layers; ++l) {
    MessageLayer layer;
    layer.k = KvTensor::Uninitialized(DType::kBF16, shape.kv_heads, shape.tokens, shape.head_dim);
    layer.v = KvTensor::Uninitialized(DType::kBF16, shape.kv_heads, shape.tokens, shape.head_dim);
    for (KvTensor* t : {&layer.k, &layer.v}) {
      for (int h = 0; h < shape.kv_heads; ++h) {
        for (int j = 0; j < shape.tokens; ++j) {
          auto* row = reinterpret_cast<uint16_t*>(t->row(h, j));
          for (int d = 0; d < shape.head_dim; ++d) row[d] = static_cast<uint16_t>(0x3c00 | (rng() & 0x3ff));
        }
      }
    }
    layer.pos = PosTensor(shape.kv_heads, shape.tokens);
    for (int h = 0; h < shape.kv_heads; ++h) {
      for (int j = 0; j < shape.tokens; ++j) layer.pos.at(h, j) = j;
    }
    msg.sent_bytes += layer.SentBytes();
    msg.layers.push_back(std::move(layer));
  }
  msg.full_bytes = msg.sent_bytes;
  msg.next_pos = shape.tokens;
  return msg;
}

// `msg` as the store holds it once committed: message `id` of `session`
// from `sender` to `recipients`, its accounting (policy, sent and full
// bytes) and metrics family (its policy) taken from it, and its retained
// bytes counted (RetainedBytes).
inline std::shared_ptr<StoredMessage> StoredMessageOf(Message msg, const std::string& session,
                                                      const std::string& id, const std::string& sender,
                                                      std::vector<std::string> recipients) {
  auto m = std::make_shared<StoredMessage>();
  m->session_id = session;
  m->message_id = id;
  m->sender = sender;
  m->recipients = std::move(recipients);
  m->msg = std::move(msg);
  m->accounting.policy = m->msg.policy;
  m->accounting.sent_bytes = m->msg.sent_bytes;
  m->accounting.full_bytes = m->msg.full_bytes;
  m->family = m->msg.policy;
  m->bytes = RetainedBytes(m->msg);
  return m;
}

}  // namespace kvrelay::testing

#endif  // KVRELAY_TESTS_TESTLIB_STORED_MESSAGE_H_
