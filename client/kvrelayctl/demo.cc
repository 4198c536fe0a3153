// The demo: planner -> critic -> refiner -> judger. Each agent "generates"
// a synthetic turn (default Qwen3-14B geometry) that continues the
// positions of what it received, and publishes it to the next agent with
// the message it fetched as parent, so the relay composes the history. One
// session per round, closed at the end of it (--chain: one session for all
// rounds, the judger publishing back to the planner). With one relay per
// agent, each agent publishes to, fetches from and acks at its own relay
// only; the relays forward between them as their routes say.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "client/kvrelayctl/flags.h"
#include "client/kvrelayctl/internal/common.h"
#include "client/kvrelayctl/internal/relay.h"
#include "client/kvrelayctl/verbs.h"
#include "client/relay_client.h"
#include "core/format/synthetic.h"
#include "core/message_id.h"
#include "core/turn.h"

namespace kvrelay::ctl {
namespace {

constexpr int kAgents = 4;
constexpr const char* kAgentNames[kAgents] = {"planner", "critic", "refiner", "judger"};
constexpr char kDefaultPolicy[] = "h2o-head:k=32+obf:p=8,mode=fast";

// The demo's settings, as its flags gave them.
struct DemoConfig {
  std::vector<std::string> addrs;  // agent i's relay, one per agent
  int64_t rounds = 1;
  bool chain = false;
  SyntheticTurnOptions turn;  // every hop's geometry; seed: the first hop's
  std::string policy;         // empty: the relay's default for each role
  std::string session_base;
};

// The demo's relays, one per agent in chain order: --addr once (every agent
// on that relay) or once per agent, or --addrs with 1 or 4 comma-separated
// addresses; each one checked as --addr is.
absl::StatusOr<std::vector<std::string>> DemoAddrs(const Flags& flags) {
  std::vector<std::string> addrs = flags.GetAll("addr");
  std::string flag = "--addr";
  if (std::optional<std::string> list = flags.Get("addrs")) {
    if (!addrs.empty()) {
      return absl::InvalidArgumentError("demo: flags --addr and --addrs both given, expected one of them");
    }
    addrs = absl::StrSplit(*list, ',');
    flag = "--addrs";
  }
  if (addrs.empty()) return absl::InvalidArgumentError("demo: missing required flag --addr (or --addrs)");
  if (addrs.size() != 1 && addrs.size() != kAgents) {
    return absl::InvalidArgumentError(absl::StrCat(
        "flag ", flag, ": ", addrs.size(),
        " addresses, expected 1 (one relay for every agent) or 4 (one per agent: planner, critic, refiner, judger)"));
  }
  for (size_t i = 0; i < addrs.size(); ++i) {
    const std::string which = addrs.size() == 1 ? "" : absl::StrCat(" address ", i + 1, " (", kAgentNames[i], ")");
    if (addrs[i].empty()) return absl::InvalidArgumentError(absl::StrCat("flag ", flag, which, ": empty value"));
    if (absl::Status s = CheckRelayAddress(addrs[i]); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("flag ", flag, which, ": ", s.message()));
    }
  }
  if (addrs.size() == 1) addrs.assign(kAgents, addrs[0]);
  return addrs;
}

Outcome ReadDemoFlags(const Flags& flags, DemoConfig* c) {
  if (Outcome f = NoPositional(flags)) return f;
  c->chain = flags.Has("chain");
  KVRELAYCTL_FLAG(c->addrs, DemoAddrs(flags));
  KVRELAYCTL_FLAG(c->rounds, flags.Int("rounds", 1, 1000));
  SyntheticTurnOptions& o = c->turn;
  o = Qwen3_14BTurn();
  const int group = o.score_heads / o.kv_heads;  // Qwen3-14B: 40 query heads over 8 KV heads
  if (Outcome f = ReadTurnGeometry(flags, &o)) return f;
  // Without --score-heads the query heads follow --kv-heads in Qwen3-14B's
  // ratio; 0 means as many as KV heads (as make-turn).
  KVRELAYCTL_FLAG(o.score_heads, flags.IntOr("score-heads", o.kv_heads * group, 0, kMaxScoreHeads));
  if (o.score_heads == 0) o.score_heads = o.kv_heads;
  if (Outcome f = CheckTurnFlags(o)) return f;
  c->policy = flags.Value("policy").value_or("");
  c->session_base =
      flags.Get("session").value_or(absl::StrCat("demo-", NewMessageId().value_or("m-00000000").substr(2, 8)));
  return std::nullopt;
}

// The chain's relays: one client per distinct address, in chain order.
struct DemoRelays {
  std::vector<std::string> addrs;  // distinct
  std::vector<std::unique_ptr<RelayClient>> clients;
  RelayClient* of[kAgents] = {};  // agent i's relay

  bool mesh() const { return clients.size() > 1; }
  // Closes `session` at every relay (each relay passes a close on as well;
  // closing is idempotent).
  absl::Status CloseSession(const std::string& session) const {
    for (const auto& client : clients) {
      absl::StatusOr<uint32_t> freed = client->CloseSession(session);
      if (!freed.ok()) return freed.status();
    }
    return absl::OkStatus();
  }
};

Outcome DialRelays(const Flags& flags, const std::vector<std::string>& addrs, DemoRelays* relays) {
  for (int i = 0; i < kAgents; ++i) {
    auto it = std::find(relays->addrs.begin(), relays->addrs.end(), addrs[i]);
    if (it == relays->addrs.end()) {
      KVRELAYCTL_DIAL(client, flags, addrs[i]);
      relays->addrs.push_back(addrs[i]);
      relays->clients.push_back(std::move(client));
      it = relays->addrs.end() - 1;
    }
    relays->of[i] = relays->clients[it - relays->addrs.begin()].get();
  }
  return std::nullopt;
}

// Every relay's counters now, in the order of relays.clients.
Outcome SnapshotStats(const DemoRelays& relays, std::vector<RelayStats>* stats) {
  for (size_t i = 0; i < relays.clients.size(); ++i) {
    absl::StatusOr<RelayStats> s = relays.clients[i]->Stats();
    if (!s.ok()) return RelayError(relays.mesh() ? absl::StrCat("stats of ", relays.addrs[i]) : "stats", s.status());
    stats->push_back(*std::move(s));
  }
  return std::nullopt;
}

void PrintHeader(const DemoConfig& c, bool mesh) {
  std::string where = c.addrs[0];
  if (mesh) {
    where.clear();
    for (int i = 0; i < kAgents; ++i) absl::StrAppend(&where, i ? " " : "", kAgentNames[i], "=", c.addrs[i]);
  }
  const SyntheticTurnOptions& o = c.turn;
  std::printf("kvrelay demo: %s, %d layers, %d kv heads, %d score heads, head_dim %d, %s, "
              "%d prompt + %d generated tokens per turn, policy %s\n",
              where.c_str(), o.layers, o.kv_heads, o.score_heads, o.head_dim, std::string(DTypeName(o.dtype)).c_str(),
              o.n_prompt, o.n_gen, c.policy.empty() ? "(role default)" : c.policy.c_str());
}

// Polls the sender's relay for `to`'s state of message `id` until `done`
// is set; true (with the reason) once the relay dead-lettered it there.
// Stops polling, returning false, when the relay cannot answer (e.g. one
// without MessageStatus).
bool WatchForDeadLetter(RelayClient* sender_relay, const std::string& session, const std::string& id,
                        const std::string& to, const std::atomic<bool>& done, std::string* reason) {
  while (!done) {
    absl::StatusOr<MessageStatusResult> st = sender_relay->MessageStatus(session, id, std::chrono::seconds(5));
    if (!st.ok()) {
      if (st.status().code() == absl::StatusCode::kUnimplemented) return false;
    } else {
      for (const RecipientStatus& r : st->recipients) {
        if (r.agent == to && r.state == RecipientState::kDeadLettered) {
          *reason = r.reason;
          return true;
        }
      }
    }
    for (int i = 0; i < 10 && !done; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

// Where the chain stands between hops.
struct ChainState {
  std::string session;
  std::string parent;    // the message the next sender fetched; empty for the first agent
  int64_t next_pos = 0;  // where the next sender's turn starts
};

// What one hop did: the publish's accounting and the fetched message.
struct HopResult {
  Accounting accounting;
  FetchedMessage fetched;
  double hop_ms = 0;     // publish start to the recipient's fetch done
  uint64_t to_next = 0;  // bytes a forward to another relay carried, else 0
};

// Agent `hop`'s turn: the demo's geometry, continuing the positions of what
// the agent received.
absl::StatusOr<std::shared_ptr<const Turn>> MakeHopTurn(const DemoConfig& c, const ChainState& state, uint64_t seed) {
  SyntheticTurnOptions to_make = c.turn;
  to_make.seed = seed;
  to_make.first_agent = state.parent.empty();
  absl::StatusOr<Turn> turn = MakeSyntheticTurn(to_make);
  if (!turn.ok()) return turn.status();
  turn->prompt_pos0 = state.next_pos;
  // Shared, so the upload sends the tensors without copying them.
  return std::make_shared<const Turn>(*std::move(turn));
}

PublishOptions HopPublishOptions(const DemoConfig& c, const ChainState& state, const std::string& from,
                                 const std::string& to) {
  PublishOptions p;
  p.session = state.session;
  p.sender = from;
  p.recipients = {to};
  p.role = from;
  p.policy = c.policy;
  p.parent_id = state.parent;
  return p;
}

// Agent `hop` publishes its turn to the next agent while the next agent
// waits for it at its own relay; then the recipient acks it.
Outcome RunHop(const DemoConfig& c, const DemoRelays& relays, const ChainState& state, int hop, uint64_t seed,
               HopResult* out) {
  const int next = (hop + 1) % kAgents;
  const std::string from = kAgentNames[hop], to = kAgentNames[next];
  RelayClient* const from_relay = relays.of[hop];
  RelayClient* const to_relay = relays.of[next];
  const bool crosses = from_relay != to_relay;
  absl::StatusOr<std::shared_ptr<const Turn>> turn = MakeHopTurn(c, state, seed);
  if (!turn.ok()) return Runtime(turn.status());
  PublishOptions p = HopPublishOptions(c, state, from, to);
  ProgressLine line(absl::StrCat(from, " -> ", to));
  p.progress = line.Callback();

  absl::StatusOr<FetchedMessage> fetched = absl::UnknownError("not fetched");
  std::chrono::steady_clock::time_point fetched_at;
  std::atomic<bool> fetch_done{false};
  const auto start = std::chrono::steady_clock::now();
  std::thread recipient([&] {
    FetchOptions f;
    f.session = state.session;
    f.agent = to;
    f.wait = std::chrono::seconds(120);
    fetched = to_relay->Fetch(f);
    fetched_at = std::chrono::steady_clock::now();
    fetch_done = true;
  });
  // Unblocks the recipient (closing the session ends its wait) and returns `failure`.
  auto abandon = [&](Failure failure) {
    (void)relays.CloseSession(state.session);
    recipient.join();
    line.Clear();
    return failure;
  };
  absl::StatusOr<PublishResult> r = from_relay->Publish(*std::move(turn), p);
  if (!r.ok()) return abandon(RelayError(absl::StrCat("demo: publish ", from, " -> ", to), r.status()));
  // A forward the sender's relay gave up on never arrives: stop waiting.
  std::string dead_reason;
  if (crosses && WatchForDeadLetter(from_relay, state.session, r->message_id, to, fetch_done, &dead_reason)) {
    return abandon(Failure{kRuntimeError, absl::StrCat("demo: forward ", from, " -> ", to, " (", c.addrs[hop],
                                                       " to ", c.addrs[next], "): message ", r->message_id,
                                                       " dead-lettered: ", dead_reason)});
  }
  recipient.join();
  line.Clear();
  if (!fetched.ok()) return RelayError(absl::StrCat("demo: fetch by ", to), fetched.status());
  if (fetched->message_id != r->message_id) {
    return Failure{kRuntimeError,
                   absl::StrCat("demo: ", to, " fetched message ", fetched->message_id, ", expected ", r->message_id)};
  }
  absl::Status s = to_relay->Ack(state.session, to, fetched->message_id);
  if (!s.ok()) return RelayError(absl::StrCat("demo: ack by ", to), s);
  // What a whole forward carries: the composed message.
  *out = {r->accounting, *std::move(fetched), std::chrono::duration<double, std::milli>(fetched_at - start).count(),
          crosses ? r->accounting.sent_bytes : 0};
  return std::nullopt;
}

void PrintRoundHeader(int64_t round, const std::string& session, bool mesh) {
  std::printf("\nround %" PRId64 " session %s\n", round + 1, session.c_str());
  std::printf("%-3s %-19s %7s %13s %13s %8s %11s %13s%s\n", "hop", "from -> to", "tokens", "full_bytes", "sent_bytes",
              "ratio", "compress_ms", "hop_latency_ms", mesh ? "  to_next_relay" : "");
}

// One row of the round's table: `number` is the hop's (counted over all
// rounds with --chain).
void PrintHop(int number, int hop, const HopResult& h, bool mesh) {
  const Accounting& a = h.accounting;
  const Message& m = h.fetched.message;
  std::printf("%-3d %-19s %7d %13" PRIu64 " %13" PRIu64 " %8s %11.2f %13.2f%s\n", number,
              absl::StrCat(kAgentNames[hop], " -> ", kAgentNames[(hop + 1) % kAgents]).c_str(),
              m.layers.empty() ? 0 : m.layers[0].tokens(), a.full_bytes, a.sent_bytes,
              Ratio(a.full_bytes, a.sent_bytes).c_str(), a.compress_seconds * 1e3, h.hop_ms,
              mesh ? absl::StrFormat(" %14d", h.to_next).c_str() : "");
  if (a.attention_error) {
    std::printf("    attention output error %.4f (the sender's own queries on the message vs the full cache)\n",
                *a.attention_error);
  }
  std::fflush(stdout);
}

// The sums over every hop of every round.
struct DemoTotals {
  int hops = 0;
  uint64_t full = 0, sent = 0, saved = 0, received = 0, to_next = 0;
  double compress_ms = 0, hop_ms = 0;

  void Add(const HopResult& h) {
    const Accounting& a = h.accounting;
    full += a.full_bytes;
    sent += a.sent_bytes;
    saved += a.full_bytes > a.sent_bytes ? a.full_bytes - a.sent_bytes : 0;  // as the relay counts it
    received += a.received_bytes;
    compress_ms += a.compress_seconds * 1e3;
    hop_ms += h.hop_ms;
    to_next += h.to_next;
    ++hops;
  }
  void Print(bool mesh) const {
    std::printf("\ntotals: hops=%d received_bytes=%" PRIu64 " full_bytes=%" PRIu64 " sent_bytes=%" PRIu64
                " ratio=%s saved_bytes=%" PRIu64 " compress_ms=%.2f hop_latency_ms=%.2f%s\n",
                hops, received, full, sent, Ratio(full, sent).c_str(), saved, compress_ms, hop_ms,
                mesh ? absl::StrCat(" to_next_relay_bytes=", to_next).c_str() : "");
  }
};

// One round: its session, its table, its hops; closes the session unless
// --chain continues it in the next round.
Outcome RunRound(const DemoConfig& c, const DemoRelays& relays, int64_t round, ChainState* state,
                 DemoTotals* totals) {
  state->session =
      c.rounds == 1 || c.chain ? c.session_base : absl::StrCat(c.session_base, "-r", round + 1);
  PrintRoundHeader(round, state->session, relays.mesh());
  if (!c.chain) {
    state->parent.clear();
    state->next_pos = 0;
  }
  // With --chain the judger publishes back to the planner, so the history
  // keeps growing (or stays within hist=).
  const int hops = c.chain ? kAgents : kAgents - 1;
  for (int hop = 0; hop < hops; ++hop) {
    HopResult h;
    if (Outcome f = RunHop(c, relays, *state, hop, c.turn.seed + round * 16 + hop, &h)) return f;
    PrintHop(c.chain ? totals->hops + 1 : hop + 1, hop, h, relays.mesh());
    totals->Add(h);
    state->parent = h.fetched.message_id;
    state->next_pos = h.fetched.message.next_pos;  // where the sender's turn ended
  }
  if (!c.chain || round == c.rounds - 1) {
    if (absl::Status s = relays.CloseSession(state->session); !s.ok()) return RelayError("demo: close", s);
  }
  return std::nullopt;
}

// What each relay counted during the demo. With one relay: equal to the
// totals when nothing else used the relay meanwhile.
void PrintStatsDeltas(const DemoRelays& relays, const std::vector<RelayStats>& before) {
  for (size_t i = 0; i < relays.clients.size(); ++i) {
    absl::StatusOr<RelayStats> after = relays.clients[i]->Stats();
    if (!after.ok()) continue;
    std::printf("relay stats delta%s: committed=%" PRIu64 " received_bytes=%" PRIu64 " full_bytes=%" PRIu64
                " sent_bytes=%" PRIu64 "\n",
                relays.mesh() ? absl::StrCat(" at ", relays.addrs[i]).c_str() : "",
                after->messages_committed - before[i].messages_committed,
                after->received_bytes - before[i].received_bytes, after->full_bytes - before[i].full_bytes,
                after->sent_bytes - before[i].sent_bytes);
  }
}

}  // namespace

VerbSpec DemoSpec() {
  const SyntheticTurnOptions qwen = Qwen3_14BTurn();
  std::vector<FlagSpec> flags = {
      RepeatedFlag("addr", "HOST:PORT",
                   "the relay of every agent, or given 4 times: one relay per agent in chain order (planner, "
                   "critic, refiner, judger)"),
      ValueFlag("addrs", "A,B,C,D", "1 or 4 comma-separated addresses, as --addr"),
      ValueFlag("rounds", "N", "rounds of the chain", "1"),
      ValueFlag("policy", "SPEC", "pipeline spec; empty: the relay's default for each role", kDefaultPolicy),
      ValueFlag("session", "S", "the session (rounds add -rN); defaults to demo-<random>"),
      BoolFlag("chain",
               "the rounds continue one session, the judger publishing back to the planner (4 hops a round)"),
  };
  AppendFlags(&flags, TurnGeometryFlagSpecs(qwen));
  flags.push_back(ValueFlag("score-heads", "S",
                            absl::StrCat("query heads with attention scores; defaults to ",
                                         qwen.score_heads / qwen.kv_heads,
                                         " per KV head (Qwen3-14B's ratio); 0: as many as --kv-heads")));
  AppendFlags(&flags, ConnectFlagSpecs());
  return {"", std::move(flags)};
}

Outcome Demo(const Flags& flags) {
  DemoConfig c;
  if (Outcome f = ReadDemoFlags(flags, &c)) return f;
  DemoRelays relays;
  if (Outcome f = DialRelays(flags, c.addrs, &relays)) return f;
  std::vector<RelayStats> before;
  if (Outcome f = SnapshotStats(relays, &before)) return f;
  PrintHeader(c, relays.mesh());
  DemoTotals totals;
  ChainState state;
  for (int64_t round = 0; round < c.rounds; ++round) {
    if (Outcome f = RunRound(c, relays, round, &state, &totals)) return f;
  }
  totals.Print(relays.mesh());
  PrintStatsDeltas(relays, before);
  return std::nullopt;
}

}  // namespace kvrelay::ctl
