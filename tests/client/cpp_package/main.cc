// relay_roundtrip --addr HOST:PORT: publishes a small BF16 turn with policy
// "full" from "planner" to "critic", fetches it as "critic", and checks that
// every K/V byte and position id came back as sent (`full` keeps every
// token in order: prompt, then generated). Acks, reads the stats, closes
// the session. Exit 0 and one "ok" line, or 1 and what differed.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "client/relay_client.h"
#include "core/turn.h"

namespace {

constexpr int kLayers = 2, kKvHeads = 2, kHeadDim = 8, kPrompt = 6, kGen = 3;

int Fail(const std::string& what) {
  std::fprintf(stderr, "relay_roundtrip: %s\n", what.c_str());
  return 1;
}

// Deterministic, finite, not constant: sin of the element's index and `salt`.
kvrelay::KvTensor Filled(int tokens, float salt) {
  kvrelay::KvTensor t(kvrelay::DType::kBF16, kKvHeads, tokens, kHeadDim);
  std::vector<float> row(kHeadDim);
  for (int h = 0; h < kKvHeads; ++h) {
    for (int tok = 0; tok < tokens; ++tok) {
      for (int d = 0; d < kHeadDim; ++d) row[d] = std::sin(salt + 0.37f * ((h * tokens + tok) * kHeadDim + d));
      t.WriteRow(h, tok, row.data());
    }
  }
  return t;
}

kvrelay::Turn MakeTurn() {
  kvrelay::Turn turn;
  for (int l = 0; l < kLayers; ++l) {
    kvrelay::TurnLayer layer;
    layer.prompt_k = Filled(kPrompt, 10.0f * l + 1);
    layer.prompt_v = Filled(kPrompt, 10.0f * l + 2);
    layer.gen_k = Filled(kGen, 10.0f * l + 3);
    layer.gen_v = Filled(kGen, 10.0f * l + 4);
    layer.scores = kvrelay::ScoreMatrix(kKvHeads, kPrompt);
    for (size_t i = 0; i < layer.scores.data.size(); ++i) layer.scores.data[i] = 0.05f * (i % 7) + 0.01f;
    turn.layers.push_back(std::move(layer));
  }
  return turn;
}

// Whether rows [first, first + n) of head h of `got` equal head h of `want`.
bool SameRows(const kvrelay::KvTensor& got, int first, const kvrelay::KvTensor& want, int h) {
  for (int t = 0; t < want.tokens(); ++t) {
    if (std::memcmp(got.row(h, first + t), want.row(h, t), want.row_bytes()) != 0) return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 || std::string(argv[1]) != "--addr") return Fail("usage: relay_roundtrip --addr HOST:PORT");
  const std::string addr = argv[2];
  if (absl::Status s = kvrelay::CheckRelayAddress(addr); !s.ok()) return Fail(s.ToString());

  std::unique_ptr<kvrelay::RelayClient> client = kvrelay::RelayClient::Connect(addr);
  absl::StatusOr<kvrelay::HealthStatus> health = client->Health("kvrelay.v1.Relay");
  if (!health.ok()) return Fail("health: " + health.status().ToString());
  if (*health != kvrelay::HealthStatus::kServing)
    return Fail(std::string("health: ") + kvrelay::HealthStatusName(*health));

  const kvrelay::Turn turn = MakeTurn();
  kvrelay::PublishOptions p;
  p.session = "package";
  p.sender = "planner";
  p.recipients = {"critic"};
  p.policy = "full";
  absl::StatusOr<kvrelay::PublishResult> published = client->Publish(turn, p);
  if (!published.ok()) return Fail("publish: " + published.status().ToString());

  kvrelay::FetchOptions f;
  f.session = "package";
  f.agent = "critic";
  f.wait = std::chrono::seconds(20);
  absl::StatusOr<kvrelay::FetchedMessage> m = client->Fetch(f);
  if (!m.ok()) return Fail("fetch: " + m.status().ToString());
  if (m->message_id != published->message_id)
    return Fail("fetched " + m->message_id + ", published " + published->message_id);
  if (m->sender != "planner") return Fail("sender " + m->sender);
  const kvrelay::Message& msg = m->message;
  if (msg.policy != "full") return Fail("policy " + msg.policy);
  if (static_cast<int>(msg.layers.size()) != kLayers) return Fail("layer count");
  for (int l = 0; l < kLayers; ++l) {
    const kvrelay::MessageLayer& got = msg.layers[l];
    const kvrelay::TurnLayer& sent = turn.layers[l];
    if (got.k.dtype() != kvrelay::DType::kBF16 || got.k.heads() != kKvHeads ||
        got.k.tokens() != kPrompt + kGen || got.k.dim() != kHeadDim || !got.v.SameShape(got.k))
      return Fail("layer " + std::to_string(l) + ": shape");
    for (int h = 0; h < kKvHeads; ++h) {
      if (!SameRows(got.k, 0, sent.prompt_k, h) || !SameRows(got.k, kPrompt, sent.gen_k, h) ||
          !SameRows(got.v, 0, sent.prompt_v, h) || !SameRows(got.v, kPrompt, sent.gen_v, h))
        return Fail("layer " + std::to_string(l) + " head " + std::to_string(h) + ": K/V bytes differ");
      for (int t = 0; t < kPrompt + kGen; ++t) {
        if (got.pos.at(h, t) != t) return Fail("layer " + std::to_string(l) + ": position ids");
      }
    }
  }

  if (absl::Status s = client->Ack("package", "critic", m->message_id); !s.ok())
    return Fail("ack: " + s.ToString());
  absl::StatusOr<kvrelay::RelayStats> stats = client->Stats();
  if (!stats.ok()) return Fail("stats: " + stats.status().ToString());
  if (stats->messages_acked < 1) return Fail("stats: messages_acked 0");
  absl::StatusOr<uint32_t> closed = client->CloseSession("package");
  if (!closed.ok()) return Fail("close: " + closed.status().ToString());

  std::printf("relay_roundtrip ok message_id=%s sent_bytes=%llu relay_version=%s\n",
              m->message_id.c_str(), static_cast<unsigned long long>(msg.sent_bytes),
              stats->version.c_str());
  return 0;
}
