// kvrelayctl: offline compression and inspection of kvrelay turns and
// messages (docs/FORMAT.md), the client verbs of the relay (publish,
// fetch, ack, close, health, stats, status, demo), and agent tokens
// (token new).
//
// This file holds the dispatch table and the usage text built from it; each verb group
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
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "client/kvrelayctl/flags.h"
#include "client/kvrelayctl/verbs.h"
#include "core/heap_retain.h"

namespace kvrelay::ctl {
namespace {

// One row of the dispatch table. `kvrelayctl help` shows each verb's
// synopsis (from its flag table) and `details`; `kvrelayctl VERB --help`
// its summary and flag table.
struct Verb {
  const char* name;
  const char* group;    // a key of kGroups
  const char* summary;  // the first line of `kvrelayctl VERB --help`
  const char* details;  // what the verb does, for `kvrelayctl help`
  VerbSpec (*spec)();   // its flag table
  Outcome (*run)(const Flags& flags);
};

constexpr Verb kVerbs[] = {
    {"compress", "offline", "Compresses a turn with a pipeline spec and writes the message.",
     R"(Compresses a turn with a pipeline spec (docs/FORMAT.md, e.g.
"h2o-head:k=32+obf:p=8+int4:group=32") and writes the message. --parent
composes on a message file as a relay composes a publish with parent_id:
the parent (decoded, with its acc and anchors) is the history, and
prompt_pos0 defaults to where it ended. --decode writes quantized K/V
decoded back to the turn's dtype. With --addr the relay compresses (its
stateless Compress call) instead. Prints one summary line: tokens per
part, full bytes, sent bytes, ratio and compression time.)",
     CompressSpec, Compress},
    {"inspect", "offline", "Describes a turn or a message file: tokens and bytes of each part.",
     R"(Describes a turn or a message (detected by metadata
format=kvrelay.message.v2 or v1): tokens and bytes of each part, and for
messages full/sent bytes and the ratio.)",
     InspectSpec, Inspect},
    {"make-turn", "offline", "Writes a synthetic turn.",
     R"(Writes a synthetic turn (heavy-tailed scores, low-rank-plus-noise
values). --queries: the generated steps' queries (gen.q) instead of
scores.)",
     MakeTurnSpec, MakeTurn},
    {"token", "offline", "Prints a fresh agent token and its line for the relay's --tokens-file.",
     R"(Prints a fresh random token (32 bytes from the kernel, URL-safe base64)
on the first line and, on the second, its line for the relay's
--tokens-file: "AGENT sha256:HEX", HEX the lowercase hex SHA-256 of the
token as printed. AGENT: [A-Za-z0-9._:-]{1,128}. The relay never sees the
token itself; give it to the agent (the whole output works as a
--token-file, whose first line is read).)",
     TokenSpec, Token},
#ifdef KVRELAYCTL_WITH_RELAY
    {"publish", "relay", "Uploads a turn; prints the message id and the accounting.",
     R"(Uploads a turn; prints the message id and the accounting. An empty
--policy uses the relay's default for the role. --parent names a message
the relay delivered to --from: the relay supplies the history. Retries
only on UNAVAILABLE/ABORTED, with the same id.)",
     PublishSpec, Publish},
    {"fetch", "relay", "Waits for the oldest unacknowledged message, writes it and acknowledges it.",
     R"(Waits for the oldest unacknowledged message, writes it (metadata adds
message_id, session, from, delivery_attempt and the accounting, and role
and parent_id when the message has them), then acknowledges it unless
--no-ack.)",
     FetchSpec, Fetch},
    {"ack", "relay", "Acknowledges a message.", "Acknowledges a message.", AckSpec, Ack},
    {"close", "relay", "Closes a session, freeing its messages.", "Closes a session, freeing its messages.",
     CloseSpec, Close},
    {"health", "relay", "Prints the grpc.health.v1 status; exit 0 only when SERVING.",
     "Prints the grpc.health.v1 status; exit 0 only when SERVING.", HealthSpec, Health},
    {"stats", "relay", "The relay's counters and what it holds now.", "The relay's counters and what it holds now.",
     StatsSpec, Stats},
    {"status", "relay", "Where a message is, as the relay it was published to knows it.",
     R"(Where a message is, as the relay it was published to knows it: a line
sender=NAME (and forwarded_by=IDENTITY when another relay forwarded it
there over mTLS: that relay's certificate SAN), then per recipient (in the
publish's order)
  agent=NAME state=STATE relay=TARGET attempts=N reason="TEXT"
STATE: queued, committed, delivered, acked, dead_lettered or unspecified.
relay= is empty for a recipient on relay A, else the recipient's relay as
routed; attempts counts forwards. reason (the dead letter's, or the last
failed attempt's) is quoted, with \ " and line breaks escaped by a
backslash, and may be empty.)",
     StatusSpec, Status},
    {"demo", "relay", "A planner -> critic -> refiner -> judger chain of simulated agents.",
     R"(A planner -> critic -> refiner -> judger chain of simulated agents (by
default of a Qwen3-14B turn's geometry). Each hop publishes with the
fetched message as parent; prints a table per round and the totals.
--queries: the turns carry the generated steps' queries (gen.q); the relay
scores from them and reports each hop's attention output error. --chain:
the rounds continue one session, the judger publishing back to the
planner (4 hops a round), so each message's history is the whole chain so
far: it keeps growing, unless the policy caps it (e.g.
h2o-head:k=32,hist=64). With 4 addresses (--addr given 4 times, or
--addrs A,B,C,D; one relay per agent, in chain order) each agent
publishes to, fetches from and acks at its own relay only; the relays must
route each agent to its relay (kvrelay-server --route). The table then
adds to_next_relay: the message's sent_bytes when the next agent is on
another relay (its address differs), else 0 (a forward that elides an
ancestor carries less); one stats delta line per relay.)",
     DemoSpec, Demo},
#endif
};

// The groups of `kvrelayctl help`, in order: key, heading, and text after
// the group's verbs.
struct Group {
  const char* key;
  const char* heading;
  const char* after;
};

constexpr Group kGroups[] = {
    {"offline", "offline verbs:", ""},
    {"relay", "relay verbs (a running kvrelay-server; --addr HOST:PORT or unix:PATH):",
     R"(Every relay verb (and compress with --addr) takes --tls-ca, --tls-cert,
--tls-key and --token-file. --tls-ca turns TLS on: the relay's certificate
must chain to the CA(s) in FILE (PEM) and name the address's host.
--tls-cert/--tls-key: a client certificate and key (PEM) for a relay that
asks for one (mTLS); both, and only with --tls-ca. --token-file: the
agent's bearer token, the first line of FILE with surrounding whitespace
removed; without it, the environment's KVRELAY_TOKEN when set. The token
goes with every call as "authorization: Bearer TOKEN", over TLS and
plaintext alike, and is never printed. A call the relay refuses prints its
code by name and exits 1, e.g. "kvrelayctl: fetch: UNAUTHENTICATED: ..."
(no or a wrong token), "PERMISSION_DENIED: ..." (acting for another
agent), "UNAVAILABLE: ..." (no connection, or a failed TLS handshake such
as an untrusted CA).)"},
};

constexpr char kUsageTail[] = R"(  help, --help, -h
      Prints this text.
  VERB --help
      Prints VERB's flags, each with its help and default.

exit status: 0 ok, 1 runtime error, 2 usage error.
)";

// `text`'s lines, each indented by `indent` spaces.
std::string Indented(absl::string_view text, int indent) {
  std::string out;
  for (absl::string_view line : absl::StrSplit(text, '\n')) absl::StrAppend(&out, std::string(indent, ' '), line, "\n");
  return out;
}

// The usage text: per group of this build, each verb's synopsis and details.
std::string UsageText() {
  std::string out = "usage: kvrelayctl <verb> [flags]\n\n";
  for (const Group& g : kGroups) {
    bool any = false;
    for (const Verb& v : kVerbs) {
      if (absl::string_view(v.group) != g.key) continue;
      absl::StrAppend(&out, any ? "" : absl::StrCat(g.heading, "\n"), Synopsis(v.name, v.spec()),
                      Indented(v.details, 6), "\n");
      any = true;
    }
    if (any && *g.after) absl::StrAppend(&out, Indented(g.after, 2), "\n");
  }
  return absl::StrCat(out, kUsageTail);
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
