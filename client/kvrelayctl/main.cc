// kvrelayctl: offline compression and inspection of kvrelay turns and
// messages (docs/FORMAT.md), the client verbs of the relay (publish,
// fetch, ack, close, health, stats, status, demo), and agent tokens
// (token new).
//
// This file holds the usage text and the dispatch table; each verb group
// lives in a file of its own (verbs.h), and every verb's arguments go
// through the one flag parser (flags.h). Exit status and error format:
// verbs.h.
#include <cstdio>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "client/kvrelayctl/flags.h"
#include "client/kvrelayctl/verbs.h"
#include "core/heap_retain.h"

namespace kvrelay::ctl {
namespace {

constexpr char kUsage[] = R"(usage: kvrelayctl <verb> [flags]

verbs:
  compress --policy SPEC --in TURN.safetensors --out MSG.safetensors
           [--parent MSG.safetensors] [--decode] [--threads N] [--addr HOST:PORT]
      Compresses a turn with a pipeline spec (docs/FORMAT.md, e.g.
      "h2o-head:k=32+obf:p=8+int4:group=32") and writes the message.
      --parent composes on a message file as a relay composes a publish with
      parent_id: the parent (decoded, with its acc and anchors) is the
      history, and prompt_pos0 defaults to where it ended.
      --decode writes quantized K/V decoded back to the turn's dtype.
      --threads defaults to the number of hardware threads. With --addr the
      relay compresses (its stateless Compress call) instead.
      Prints one summary line: tokens per part, full bytes, sent bytes,
      ratio and compression time.

  inspect FILE
      Describes a turn or a message (detected by metadata
      format=kvrelay.message.v2 or v1): tokens and bytes of each part, and for
      messages full/sent bytes and the ratio.

  make-turn --out FILE [--layers L] [--kv-heads H] [--score-heads S]
            [--head-dim D] [--prompt N] [--gen G] [--history M]
            [--dtype F32|F16|BF16] [--seed X] [--first-agent true|false]
            [--queries]
      Writes a synthetic turn (heavy-tailed scores, low-rank-plus-noise
      values). Defaults: 4 layers, 2 kv heads, score heads = kv heads,
      head dim 64, 128 prompt, 16 generated, 0 history tokens, BF16,
      seed 1, first agent true when there is no history, else false.
      --queries: the generated steps' queries (gen.q) instead of scores.

relay verbs (a running kvrelay-server; --addr HOST:PORT or unix:PATH):
  publish --addr A --session S --from AGENT --to AGENT [--to AGENT ...]
          [--id MSGID] [--policy SPEC] [--role R] [--parent MSGID]
          [--timeout SECONDS] [--retries N] --in TURN.safetensors
      Uploads a turn; prints the message id and the accounting. An empty
      --policy uses the relay's default for the role. --parent names a
      message the relay delivered to --from: the relay supplies the history.
      Retries (default 3) only on UNAVAILABLE/ABORTED, with the same id.

  fetch --addr A --session S --agent AGENT --out MSG.safetensors
        [--wait SECONDS] [--no-ack]
      Waits (default 30 s) for the oldest unacknowledged message, writes it
      (metadata adds message_id, session, from, delivery_attempt and the
      accounting, and role and parent_id when the message has them), then
      acknowledges it unless --no-ack.

  ack --addr A --session S --agent AGENT --id MSGID
  close --addr A --session S
  health --addr A [--service NAME] [--timeout SECONDS]
      Prints the grpc.health.v1 status; exit 0 only when SERVING.
  stats --addr A
      The relay's counters and what it holds now.
  status --addr A --session S --id MSGID [--timeout SECONDS]
      Where a message is, as the relay it was published to knows it: a line
      sender=NAME (and forwarded_by=IDENTITY when another relay forwarded it
      there over mTLS: that relay's certificate SAN), then per recipient (in
      the publish's order)
        agent=NAME state=STATE relay=TARGET attempts=N reason="TEXT"
      STATE: queued, committed, delivered, acked, dead_lettered or
      unspecified. relay= is empty for a recipient on relay A, else the
      recipient's relay as routed; attempts counts forwards. reason (the dead
      letter's, or the last failed attempt's) is quoted, with \ " and line
      breaks escaped by a backslash, and may be empty.

  demo --addr A [--rounds N] [--policy SPEC] [--session S] [--layers L]
       [--kv-heads H] [--score-heads S] [--head-dim D] [--prompt N]
       [--gen G] [--dtype DT] [--seed X] [--queries] [--chain]
  demo --addr A --addr B --addr C --addr D [flags as above]
  demo --addrs A,B,C,D [flags as above]
      A planner -> critic -> refiner -> judger chain of simulated agents
      (default Qwen3-14B geometry: 40 layers, 8 kv heads, 40 score heads,
      head_dim 128, BF16, 512 prompt + 40 generated tokens; policy
      h2o-head:k=32+obf:p=8,mode=fast). Each hop publishes with the fetched
      message as parent; prints a table per round and the totals.
      --queries: the turns carry the generated steps' queries (gen.q); the
      relay scores from them and reports each hop's attention output error.
      --chain: the rounds continue one session, the judger publishing back
      to the planner (4 hops a round), so each message's history is the
      whole chain so far: it keeps growing, unless the policy caps it
      (e.g. h2o-head:k=32,hist=64).
      With 4 addresses (one relay per agent, in chain order) each agent
      publishes to, fetches from and acks at its own relay only; the relays
      must route each agent to its relay (kvrelay-server --route). The table
      then adds to_next_relay: the message's sent_bytes when the next agent
      is on another relay (its address differs), else 0 (a forward that
      elides an ancestor carries less); one stats delta line per relay.

  Every relay verb (and compress with --addr) also takes
      [--tls-ca FILE] [--tls-cert FILE --tls-key FILE] [--token-file FILE]
  --tls-ca turns TLS on: the relay's certificate must chain to the CA(s) in
  FILE (PEM) and name the address's host. --tls-cert/--tls-key: a client
  certificate and key (PEM) for a relay that asks for one (mTLS); both, and
  only with --tls-ca. --token-file: the agent's bearer token, the first
  line of FILE with surrounding whitespace removed; without it, the
  environment's KVRELAY_TOKEN when set. The token goes with every call as
  "authorization: Bearer TOKEN", over TLS and plaintext alike, and is never
  printed. A call the relay refuses prints its code by name and exits 1,
  e.g. "kvrelayctl: fetch: UNAUTHENTICATED: ..." (no or a wrong token),
  "PERMISSION_DENIED: ..." (acting for another agent), "UNAVAILABLE: ..."
  (no connection, or a failed TLS handshake such as an untrusted CA).

token verbs (offline):
  token new AGENT
      Prints a fresh random token (32 bytes from the kernel, URL-safe base64)
      on the first line and, on the second, its line for the relay's
      --tokens-file: "AGENT sha256:HEX", HEX the lowercase hex SHA-256 of the
      token as printed. AGENT: [A-Za-z0-9._:-]{1,128}. The relay never sees
      the token itself; give it to the agent (the whole output works as a
      --token-file, whose first line is read).

  help, --help, -h
      Prints this text.
  VERB --help
      Prints VERB's flags, each with its default.

exit status: 0 ok, 1 runtime error, 2 usage error.
)";

// One row of the dispatch table.
struct Verb {
  const char* name;
  const char* group;    // as `kvrelayctl help` lists them
  const char* summary;  // the first line of `kvrelayctl VERB --help`
  VerbSpec (*spec)();   // its flag table
  Outcome (*run)(const Flags& flags);
};

constexpr Verb kVerbs[] = {
    {"compress", "offline", "Compresses a turn with a pipeline spec and writes the message.", CompressSpec, Compress},
    {"inspect", "offline", "Describes a turn or a message file: tokens and bytes of each part.", InspectSpec,
     Inspect},
    {"make-turn", "offline", "Writes a synthetic turn.", MakeTurnSpec, MakeTurn},
    {"token", "offline", "Prints a fresh agent token and its line for the relay's --tokens-file.", TokenSpec, Token},
#ifdef KVRELAYCTL_WITH_RELAY
    {"publish", "relay", "Uploads a turn; prints the message id and the accounting.", PublishSpec, Publish},
    {"fetch", "relay", "Waits for the oldest unacknowledged message, writes it and acknowledges it.", FetchSpec,
     Fetch},
    {"ack", "relay", "Acknowledges a message.", AckSpec, Ack},
    {"close", "relay", "Closes a session, freeing its messages.", CloseSpec, Close},
    {"health", "relay", "Prints the grpc.health.v1 status; exit 0 only when SERVING.", HealthSpec, Health},
    {"stats", "relay", "The relay's counters and what it holds now.", StatsSpec, Stats},
    {"status", "relay", "Where a message is, as the relay it was published to knows it.", StatusSpec, Status},
    {"demo", "demo", "A planner -> critic -> refiner -> judger chain of simulated agents.", DemoSpec, Demo},
#endif
};

// The usage text and, per group, the verbs of this build.
std::string UsageText() {
  std::string out = kUsage;
  absl::StrAppend(&out, "\nverbs of this build:\n");
  std::string group;
  for (const Verb& v : kVerbs) {
    if (v.group != group) absl::StrAppend(&out, group.empty() ? "" : "\n", "  ", v.group, ":");
    group = v.group;
    absl::StrAppend(&out, " ", v.name);
  }
  return absl::StrCat(out, "\n");
}

// Parses a verb's arguments against its table and runs it (or prints its help).
Outcome RunVerb(const Verb& verb, int argc, char** argv) {
  const VerbSpec spec = verb.spec();
  absl::StatusOr<Flags> flags = Flags::Parse(verb.name, spec, std::vector<std::string>(argv, argv + argc));
  if (!flags.ok()) return Usage(std::string(flags.status().message()));
  if (flags->help_requested()) {
    std::fputs(HelpText(verb.name, verb.summary, spec).c_str(), stdout);
    return std::nullopt;
  }
  return verb.run(*flags);
}

int Main(int argc, char** argv) {
  if (argc < 2) {
    std::fputs(UsageText().c_str(), stderr);
    std::fprintf(stderr, "kvrelayctl: missing verb\n");
    return kUsageError;
  }
  const std::string name = argv[1];
  if (name == "help" || name == "--help" || name == "-h") {
    std::fputs(UsageText().c_str(), stdout);
    return 0;
  }
  Outcome failure = Usage(absl::StrCat("unknown verb \"", name, "\" (try kvrelayctl help)"));
  for (const Verb& verb : kVerbs) {
    if (name == verb.name) failure = RunVerb(verb, argc - 2, argv + 2);
  }
  if (!failure) return 0;
  std::fprintf(stderr, "kvrelayctl: %s\n", failure->message.c_str());
  return failure->code;
}

}  // namespace
}  // namespace kvrelay::ctl

int main(int argc, char** argv) {
  // Turns are tens of MB: keep freed tensors for reuse (core/heap_retain.h).
  kvrelay::RetainFreedHeap(kvrelay::kDefaultHeapRetainBytes);
  try {
    return kvrelay::ctl::Main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvrelayctl: internal error: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "kvrelayctl: internal error\n");
  }
  return 1;
}
