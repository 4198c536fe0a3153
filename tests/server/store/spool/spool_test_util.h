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
#include "tests/testlib/stored_message.h"

namespace kvrelay::testing {

// A dense BF16 message of `layers` x [2 heads, tokens, 8] with random values
// (from `seed`) and positions 0..tokens-1, from "a" to `to` (DenseMessage).
inline std::shared_ptr<StoredMessage> RealMsg(const std::string& session, const std::string& id,
                                              std::vector<std::string> to, uint32_t seed, int tokens = 5,
                                              int layers = 2) {
  std::mt19937 rng(seed);
  return StoredMessageOf(DenseMessage({layers, /*kv_heads=*/2, /*head_dim=*/8, tokens}, rng), session, id, "a",
                         std::move(to));
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
