// Messages with real tensors for the spool's tests, and a fingerprint of
// what a message holds.
#ifndef KVRELAY_TESTS_SERVER_SPOOL_SPOOL_TEST_UTIL_H_
#define KVRELAY_TESTS_SERVER_SPOOL_SPOOL_TEST_UTIL_H_

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/crc32c.h"
#include "server/store/store.h"

namespace kvrelay::testing {

// A dense BF16 message of `layers` x [2 heads, tokens, 8] with random bytes
// (from `seed`) and positions 0..tokens-1, from "a" to `to`.
inline std::shared_ptr<StoredMessage> RealMsg(const std::string& session, const std::string& id,
                                              std::vector<std::string> to, uint32_t seed, int tokens = 5,
                                              int layers = 2) {
  std::mt19937 rng(seed);
  auto m = std::make_shared<StoredMessage>();
  m->session_id = session;
  m->message_id = id;
  m->sender = "a";
  m->recipients = std::move(to);
  Message& msg = m->msg;
  msg.policy = "full";
  msg.dtype = DType::kBF16;
  msg.kv_heads = 2;
  msg.head_dim = 8;
  msg.n_kept = tokens;
  for (int l = 0; l < layers; ++l) {
    MessageLayer layer;
    layer.k = KvTensor(DType::kBF16, 2, tokens, 8);
    layer.v = KvTensor(DType::kBF16, 2, tokens, 8);
    for (KvTensor* t : {&layer.k, &layer.v}) {
      for (int h = 0; h < 2; ++h) {
        for (int i = 0; i < tokens; ++i) {
          uint8_t* row = t->row(h, i);
          for (size_t b = 0; b < t->row_bytes(); b += 2) {
            row[b] = static_cast<uint8_t>(rng());
            row[b + 1] = static_cast<uint8_t>(0x3c + rng() % 4);  // finite, moderate values
          }
        }
      }
    }
    layer.pos = PosTensor(2, tokens);
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < tokens; ++i) layer.pos.at(h, i) = i;
    }
    msg.sent_bytes += layer.SentBytes();
    msg.layers.push_back(std::move(layer));
  }
  msg.full_bytes = msg.sent_bytes;
  msg.next_pos = tokens;
  m->accounting.set_policy("full");
  m->accounting.set_sent_bytes(msg.sent_bytes);
  m->accounting.set_full_bytes(msg.full_bytes);
  m->family = "full";
  m->bytes = RetainedBytes(msg);
  return m;
}

// CRC32C of every tensor byte and position of `m`, with its ids.
inline uint32_t Fingerprint(const StoredMessage& m) {
  uint32_t c = Crc32c(m.session_id.data(), m.session_id.size());
  c = Crc32cExtend(c, m.message_id.data(), m.message_id.size());
  for (const MessageLayer& l : m.msg.layers) {
    c = Crc32cExtend(c, l.k.bytes().data(), l.k.bytes().size());
    c = Crc32cExtend(c, l.v.bytes().data(), l.v.bytes().size());
    c = Crc32cExtend(c, l.pos.data.data(), l.pos.data.size() * sizeof(int32_t));
  }
  return c;
}

}  // namespace kvrelay::testing

#endif  // KVRELAY_TESTS_SERVER_SPOOL_SPOOL_TEST_UTIL_H_
