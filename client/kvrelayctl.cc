// kvrelayctl: offline compression and inspection of kvrelay turns and
// messages (docs/FORMAT.md), the client verbs of the relay (publish,
// fetch, ack, close, health, stats, status, demo), and agent tokens
// (token new).
//
// Exit status: 0 on success, 1 for runtime errors (bad files, bad policies,
// I/O), 2 for usage errors (unknown verb or flag, missing or malformed flag
// value). Errors go to stderr as "kvrelayctl: <message>".
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/heap_retain.h"
#include "core/format/safetensors.h"
#include "core/format/synthetic.h"
#include "core/format/turn_file.h"
#include "core/history.h"
#include "core/message.h"
#include "core/pipeline.h"
#include "core/quant.h"
#include "core/status_macros.h"
#include "core/thread_pool.h"
#include "core/token.h"
#include "core/turn.h"
#ifdef KVRELAYCTL_WITH_RELAY
#include <unistd.h>

#include "proto/stream_codec.h"
#include "proto/wire_codec.h"

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <thread>

#include "absl/status/status.h"
#include "client/relay_client.h"
#include "core/message_id.h"
#endif

namespace kvrelay {
namespace {

constexpr int kRuntimeError = 1;
constexpr int kUsageError = 2;

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

exit status: 0 ok, 1 runtime error, 2 usage error.
)";

// A usage error (exit 2) or a runtime error (exit 1).
struct Failure {
  int code;
  std::string message;
};

Failure Usage(std::string msg) { return {kUsageError, std::move(msg)}; }
Failure Runtime(const absl::Status& s) { return {kRuntimeError, std::string(s.message())}; }

// Flags of one verb: --name VALUE, --name=VALUE, or a bare --name for
// booleans; anything else is a positional argument.
class Flags {
 public:
  // `repeated` names valued flags that may be given more than once (GetAll).
  Flags(std::string verb, std::set<std::string> valued, std::set<std::string> booleans,
        std::set<std::string> repeated = {})
      : verb_(std::move(verb)), valued_(std::move(valued)), booleans_(std::move(booleans)),
        repeated_(std::move(repeated)) {}

  std::optional<Failure> Parse(int argc, char** argv) {
    for (int i = 0; i < argc; ++i) {
      std::string arg = argv[i];
      if (arg.size() < 3 || arg.compare(0, 2, "--") != 0) {
        if (arg.size() > 1 && arg[0] == '-') {
          return Usage(absl::StrCat("unknown flag ", arg, " for ", verb_));
        }
        positional_.push_back(arg);
        continue;
      }
      std::string name = arg.substr(2), value;
      bool has_value = false;
      if (size_t eq = name.find('='); eq != std::string::npos) {
        value = name.substr(eq + 1);
        name = name.substr(0, eq);
        has_value = true;
      }
      if (booleans_.count(name)) {
        if (has_value) return Usage(absl::StrCat("flag --", name, " takes no value"));
        if (!bools_.insert(name).second)
          return Usage(absl::StrCat("flag --", name, " given twice"));
        continue;
      }
      if (!valued_.count(name) && !repeated_.count(name))
        return Usage(absl::StrCat("unknown flag --", name, " for ", verb_));
      if (!has_value) {
        if (i + 1 >= argc) return Usage(absl::StrCat("flag --", name, " needs a value"));
        value = argv[++i];
      }
      if (repeated_.count(name)) {
        multi_[name].push_back(value);
        continue;
      }
      if (!values_.emplace(name, value).second) {
        return Usage(absl::StrCat("flag --", name, " given twice"));
      }
    }
    return std::nullopt;
  }

  bool Has(const std::string& name) const {
    return values_.count(name) || bools_.count(name) || multi_.count(name);
  }
  // Every value of a repeated flag, in order.
  std::vector<std::string> GetAll(const std::string& name) const {
    auto it = multi_.find(name);
    return it == multi_.end() ? std::vector<std::string>() : it->second;
  }
  std::optional<std::string> Get(const std::string& name) const {
    auto it = values_.find(name);
    if (it == values_.end()) return std::nullopt;
    return it->second;
  }
  absl::StatusOr<std::string> Required(const std::string& name) const {
    auto v = Get(name);
    if (!v)
      return absl::InvalidArgumentError(absl::StrCat(verb_, ": missing required flag --", name));
    if (v->empty())
      return absl::InvalidArgumentError(absl::StrCat("flag --", name, ": empty value"));
    return *v;
  }
#ifdef KVRELAYCTL_WITH_RELAY
  // The relay address --addr (required), checked (CheckRelayAddress).
  absl::StatusOr<std::string> Addr() const {
    KVRELAY_ASSIGN_OR_RETURN(std::string addr, Required("addr"));
    if (absl::Status s = CheckRelayAddress(addr); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("flag --addr: ", s.message()));
    }
    return addr;
  }
#endif
  // An integer flag in [lo, hi], or `dflt` when absent.
  absl::StatusOr<int64_t> Int(const std::string& name, int64_t dflt, int64_t lo, int64_t hi) const {
    auto v = Get(name);
    if (!v) return dflt;
    int64_t x;
    if (!absl::SimpleAtoi(*v, &x) || x < lo || x > hi) {
      return absl::InvalidArgumentError(absl::StrCat(
          "flag --", name, ": \"", *v, "\", expected an integer in [", lo, ", ", hi, "]"));
    }
    return x;
  }
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  std::string verb_;
  std::set<std::string> valued_, booleans_, repeated_;
  std::map<std::string, std::string> values_;
  std::map<std::string, std::vector<std::string>> multi_;
  std::set<std::string> bools_;
  std::vector<std::string> positional_;
};

// Unwraps a flag-derived StatusOr into a usage failure.
#define KVRELAYCTL_FLAG(lhs, expr)                                                          \
  auto KVRELAY_INTERNAL_CONCAT(flag_, __LINE__) = (expr);                                   \
  if (!KVRELAY_INTERNAL_CONCAT(flag_, __LINE__).ok())                                       \
    return Usage(std::string(KVRELAY_INTERNAL_CONCAT(flag_, __LINE__).status().message())); \
  lhs = *std::move(KVRELAY_INTERNAL_CONCAT(flag_, __LINE__))

std::string Ratio(uint64_t full, uint64_t sent) {
  return sent ? absl::StrFormat("%.3f", static_cast<double>(full) / sent) : "inf";
}

std::optional<Failure> NoPositional(const Flags& flags, absl::string_view verb) {
  if (!flags.positional().empty()) {
    return Usage(absl::StrCat(verb, ": unexpected argument \"", flags.positional()[0], "\""));
  }
  return std::nullopt;
}

#ifdef KVRELAYCTL_WITH_RELAY
Failure RelayError(absl::string_view what, const absl::Status& s);

// `valued` plus the flags of every verb that dials a relay.
std::set<std::string> WithConnectFlags(std::set<std::string> valued) {
  valued.insert({"tls-ca", "tls-cert", "tls-key", "token-file"});
  return valued;
}

// The token of --token-file: its first line, whitespace trimmed.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || (!std::getline(in, line) && in.bad())) {
    return absl::InvalidArgumentError(
        absl::StrCat("flag --token-file: cannot read \"", path, "\": ", std::strerror(errno)));
  }
  const absl::string_view token = absl::StripAsciiWhitespace(line);
  if (token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("flag --token-file: \"", path, "\": first line is empty, expected the token"));
  }
  return std::string(token);
}

// ConnectOptions from --tls-ca, --tls-cert, --tls-key and --token-file (no
// --token-file: KVRELAY_TOKEN, which RelayClient::Connect reads).
std::optional<Failure> ConnectFlags(const Flags& flags, ConnectOptions* o) {
  for (const char* name : {"tls-ca", "tls-cert", "tls-key", "token-file"}) {
    if (flags.Get(name) && flags.Get(name)->empty()) return Usage(absl::StrCat("flag --", name, ": empty value"));
  }
  o->tls_ca_file = flags.Get("tls-ca").value_or("");
  o->tls_cert_file = flags.Get("tls-cert").value_or("");
  o->tls_key_file = flags.Get("tls-key").value_or("");
  if (o->tls_cert_file.empty() != o->tls_key_file.empty()) {
    return Usage(o->tls_cert_file.empty() ? "flag --tls-key: given without --tls-cert, expected both or neither"
                                          : "flag --tls-cert: given without --tls-key, expected both or neither");
  }
  if (!o->tls_cert_file.empty() && o->tls_ca_file.empty()) {
    return Usage("flag --tls-cert: given without --tls-ca, expected --tls-ca FILE too (it turns TLS on)");
  }
  if (std::optional<std::string> path = flags.Get("token-file")) {
    absl::StatusOr<std::string> token = ReadTokenFile(*path);
    if (!token.ok()) return Runtime(token.status());
    o->token = *std::move(token);
  }
  return std::nullopt;
}

// A client of `addr` as the connection flags say; on failure `*failure`
// names the flag (RelayClient::Connect names the option).
std::unique_ptr<RelayClient> Dial(const Flags& flags, const std::string& addr, std::optional<Failure>* failure) {
  ConnectOptions o;
  if ((*failure = ConnectFlags(flags, &o))) return nullptr;
  absl::StatusOr<std::unique_ptr<RelayClient>> client = RelayClient::Connect(addr, o);
  if (client.ok()) return *std::move(client);
  static constexpr std::pair<absl::string_view, absl::string_view> kFlagOf[] = {
      {"tls_ca_file:", "flag --tls-ca:"},
      {"tls_cert_file:", "flag --tls-cert:"},
      {"tls_key_file:", "flag --tls-key:"},
      {"token:", "flag --token-file:"}};
  std::string msg(client.status().message());
  for (const auto& [option, flag] : kFlagOf) {
    if (absl::StartsWith(msg, option)) {
      msg = absl::StrCat(flag, msg.substr(option.size()));
      break;
    }
  }
  *failure = Failure{kRuntimeError, msg};
  return nullptr;
}

// Declares std::unique_ptr<RelayClient> `var` dialled as Dial does, or
// returns Dial's failure from the calling verb.
#define KVRELAYCTL_DIAL(var, flags, addr)                     \
  std::optional<Failure> var##_failure;                       \
  std::unique_ptr<RelayClient> var = Dial(flags, addr, &var##_failure); \
  if (!var) return var##_failure
#endif

std::optional<Failure> Compress(int argc, char** argv) {
  Flags flags("compress",
              {"policy", "in", "out", "parent", "threads", "addr", "tls-ca", "tls-cert", "tls-key", "token-file"},
              {"decode"});
  if (auto f = flags.Parse(argc, argv)) return f;
  if (auto f = NoPositional(flags, "compress")) return f;
  KVRELAYCTL_FLAG(const std::string policy, flags.Required("policy"));
  KVRELAYCTL_FLAG(const std::string in, flags.Required("in"));
  KVRELAYCTL_FLAG(const std::string out, flags.Required("out"));
  KVRELAYCTL_FLAG(const int64_t threads,
                  flags.Int("threads", ThreadPool::HardwareThreads(), 1, 4096));
  const bool decode = flags.Has("decode");

  const std::optional<std::string> addr = flags.Get("addr");
  if (addr && flags.Has("threads")) {
    return Usage("compress: --threads is for compressing here; with --addr the relay compresses");
  }
  for (const char* name : {"tls-ca", "tls-cert", "tls-key", "token-file"}) {
    if (!addr && flags.Has(name)) {
      return Usage(absl::StrCat("compress: --", name, " is for the relay; it needs --addr"));
    }
  }
#ifdef KVRELAYCTL_WITH_RELAY
  if (addr) {
    absl::StatusOr<std::string> checked = flags.Addr();
    if (!checked.ok()) return Usage(std::string(checked.status().message()));
  }
#endif
  absl::StatusOr<std::unique_ptr<Pipeline>> pipeline = Pipeline::Create(policy);
  if (!pipeline.ok() && !addr) return Runtime(pipeline.status());
  const std::optional<std::string> parent_path = flags.Get("parent");
  TurnFileOptions read;
  read.on_parent = parent_path.has_value();
  absl::StatusOr<Turn> turn = ReadTurnFile(in, read);
  if (!turn.ok()) return Runtime(turn.status());
  const DType dtype = turn->layers[0].prompt_k.dtype();
  if (parent_path) {
    if (addr) return Usage("compress: --parent is for compressing here; a relay composes on a parent by publish");
    absl::StatusOr<Message> parent = ReadMessageFile(*parent_path);
    if (!parent.ok()) return Runtime(parent.status());
    if (absl::Status s = ComposeOnParent(*parent, &*turn); !s.ok()) {
      return Runtime(absl::Status(s.code(), absl::StrCat(in, " on parent ", *parent_path, ": ", s.message())));
    }
  }

  absl::StatusOr<Message> msg;
  double ms = 0;
  if (addr) {
#ifdef KVRELAYCTL_WITH_RELAY
    // The relay's stateless Compress RPC; the time is the relay's.
    KVRELAYCTL_DIAL(client, flags, *addr);
    absl::StatusOr<CompressedMessage> r = client->Compress(*turn, policy);
    if (!r.ok()) return RelayError("compress", r.status());
    ms = r->accounting.compress_seconds * 1e3;
    msg = std::move(r->message);
#else
    return Usage("compress: --addr needs a build with the relay (KVRELAY_BUILD_SERVICE)");
#endif
  } else {
    std::unique_ptr<ThreadPool> pool;
    if (threads > 1) pool = std::make_unique<ThreadPool>(static_cast<int>(threads));
    const auto start = std::chrono::steady_clock::now();
    // ReadTurnFile validated every value already; a parent's decoded
    // history has not been.
    msg = parent_path ? (*pipeline)->Compress(*turn, pool.get()) : (*pipeline)->CompressValidated(*turn, pool.get());
    const auto stop = std::chrono::steady_clock::now();
    if (!msg.ok()) return Runtime(msg.status());
    ms = std::chrono::duration<double, std::milli>(stop - start).count();
  }
  // What the relay sends; with --decode the file itself holds dense tensors
  // and its metadata describes those.
  const uint64_t sent_bytes = msg->sent_bytes;
  // What a forward with --wire-codec rans puts on the network for the
  // message's tensors (its acc, relay-side state, aside).
  std::string wire;
#ifdef KVRELAYCTL_WITH_RELAY
  {
    uint64_t wire_bytes = 0;
    const WireEncodeOptions wo = WireEncodeOptionsOf(msg->kv_heads, ToProtoDType(msg->dtype));
    for (size_t l = 0; l < msg->layers.size(); ++l) {
      wire_bytes += EncodeWireLayer(LayerDeliveryOrder(msg->layers[l], static_cast<uint32_t>(l)), wo).size();
    }
    wire = absl::StrCat(" wire_bytes=", wire_bytes);
  }
#endif
  if (decode) {
    absl::Status s = DequantizeMessage(&*msg, dtype);
    if (!s.ok()) return Runtime(s);
  }
  absl::Status s = WriteMessageFile(*msg, out);
  if (!s.ok()) return Runtime(s);
  // threads: this process's workers; a relay's are its own.
  std::printf("policy=%s layers=%zu history=%d anchor=%d kept=%d gen=%d full_bytes=%" PRIu64
              " sent_bytes=%" PRIu64 "%s ratio=%s compress_ms=%.3f %s%s\n",
              msg->policy.c_str(), msg->layers.size(), msg->n_history, msg->n_anchor, msg->n_kept,
              msg->n_gen, msg->full_bytes, sent_bytes, wire.c_str(), Ratio(msg->full_bytes, sent_bytes).c_str(), ms,
              addr ? "relay=true" : absl::StrCat("threads=", threads).c_str(), decode ? " decoded=true" : "");
  return std::nullopt;
}

void PrintPart(const char* name, int64_t tokens, uint64_t bytes) {
  std::printf("part %s: tokens=%" PRId64 " bytes=%" PRIu64 "\n", name, tokens, bytes);
}

void InspectTurn(const std::string& path, const Turn& turn) {
  const TurnLayer& l0 = turn.layers[0];
  const uint64_t L = turn.layers.size();
  const uint64_t H = l0.prompt_k.heads(), d = l0.prompt_k.dim();
  const uint64_t esize = DTypeSize(l0.prompt_k.dtype());
  const int64_t nh = l0.history_k.tokens(), np = l0.prompt_k.tokens(), ng = l0.gen_k.tokens();
  const uint64_t kv_per_token = L * 2 * H * d * esize;  // K+V, all layers
  std::printf("kind: turn\nfile: %s\n", path.c_str());
  std::printf("layers: %" PRIu64 "\ndtype: %s\nkv_heads: %" PRIu64 "\nhead_dim: %" PRIu64
              "\nscore_heads: %d\n",
              L, std::string(DTypeName(l0.prompt_k.dtype())).c_str(), H, d, l0.scores.rows);
  std::printf("first_agent: %s\nprompt_pos0: %" PRId64 "\n", turn.first_agent ? "true" : "false",
              turn.PromptPos0());
  PrintPart("history", nh, kv_per_token * nh + L * 4 * H * nh);
  PrintPart("prompt", np, kv_per_token * np);
  PrintPart("gen", ng, kv_per_token * ng);
  std::printf("scores_bytes: %" PRIu64 "\n", L * 4 * static_cast<uint64_t>(l0.scores.rows) * np);
  // What `full` sends: every token's K/V plus 4-byte position ids.
  std::printf("full_bytes: %" PRIu64 "\n", (kv_per_token + L * 4 * H) * (nh + np + ng));
}

void InspectMessage(const std::string& path, const Message& msg) {
  const MessageLayer& l0 = msg.layers[0];
  const uint64_t L = msg.layers.size(), H = msg.kv_heads, d = msg.head_dim;
  std::printf("kind: message\nfile: %s\npolicy: %s\n", path.c_str(), msg.policy.c_str());
  std::printf("layers: %" PRIu64 "\ndtype: %s\nkv_heads: %" PRIu64 "\nhead_dim: %" PRIu64 "\n", L,
              std::string(DTypeName(msg.dtype)).c_str(), H, d);
  // Bytes per token (all layers and heads): K/V payload + stats per token + position id.
  uint64_t per_token;
  uint64_t key_stats = 0;
  if (l0.quant) {
    const QuantizedKv& q = *l0.quant;
    std::printf("quant: int%d group=%d rotate=%s\n", q.bits, q.group, q.rotate ? "true" : "false");
    per_token = L * H * (2 * d * q.bits / 8 + 2 * 2 + 4);
    for (const MessageLayer& layer : msg.layers) {
      key_stats += 2 * (layer.quant->k.scale.size() + layer.quant->k.zero.size());
    }
  } else {
    std::printf("quant: none\n");
    per_token = L * H * (2 * d * DTypeSize(msg.dtype) + 4);
  }
  PrintPart("history", msg.n_history, per_token * msg.n_history);
  PrintPart("anchor", msg.n_anchor, per_token * msg.n_anchor);
  PrintPart("kept", msg.n_kept, per_token * msg.n_kept);
  PrintPart("gen", msg.n_gen, per_token * msg.n_gen);
  if (l0.quant) std::printf("key_stats_bytes: %" PRIu64 "\n", key_stats);
  std::printf("full_bytes: %" PRIu64 "\nsent_bytes: %" PRIu64 "\nratio: %s\nnext_pos: %" PRId64 "\n",
              msg.full_bytes, msg.sent_bytes, Ratio(msg.full_bytes, msg.sent_bytes).c_str(), msg.next_pos);
}

std::optional<Failure> Inspect(int argc, char** argv) {
  Flags flags("inspect", {}, {});
  if (auto f = flags.Parse(argc, argv)) return f;
  if (flags.positional().size() != 1) {
    return Usage(
        absl::StrCat("inspect: expected one FILE argument, got ", flags.positional().size()));
  }
  const std::string& path = flags.positional()[0];
  absl::StatusOr<SafetensorsReader> file = SafetensorsReader::ReadFile(path);
  if (!file.ok()) return Runtime(file.status());
  if (IsMessageFile(*file)) {
    absl::StatusOr<Message> msg = MessageFromSafetensors(*file);
    if (!msg.ok())
      return Runtime(absl::InvalidArgumentError(absl::StrCat(path, ": ", msg.status().message())));
    InspectMessage(path, *msg);
  } else {
    TurnFileOptions read;
    read.on_parent = true;  // a turn for a parent may carry history.score alone
    absl::StatusOr<Turn> turn = TurnFromSafetensors(*file, read);
    if (!turn.ok())
      return Runtime(absl::InvalidArgumentError(absl::StrCat(path, ": ", turn.status().message())));
    InspectTurn(path, *turn);
  }
  return std::nullopt;
}

// A synthetic turn's geometry as the flags gave it, checked before anything
// else happens: usage errors name the flags.
std::optional<Failure> CheckTurnFlags(const SyntheticTurnOptions& o) {
  if (o.score_heads != 0 && o.score_heads % o.kv_heads != 0) {
    return Usage(absl::StrCat("flag --score-heads: ", o.score_heads, ", expected a multiple of --kv-heads (",
                              o.kv_heads, ")"));
  }
  absl::Status s = CheckSyntheticTurnOptions(o);
  if (!s.ok()) {
    return Usage(absl::StrCat("flags --layers, --kv-heads, --score-heads, --head-dim, --history, --prompt, --gen: ",
                              s.message()));
  }
  return std::nullopt;
}

std::optional<Failure> MakeTurn(int argc, char** argv) {
  Flags flags("make-turn",
              {"out", "layers", "kv-heads", "score-heads", "head-dim", "prompt", "gen", "history",
               "dtype", "seed", "first-agent"},
              {"queries"});
  if (auto f = flags.Parse(argc, argv)) return f;
  if (auto f = NoPositional(flags, "make-turn")) return f;
  constexpr int64_t kMax = 1 << 24;
  SyntheticTurnOptions o;
  KVRELAYCTL_FLAG(const std::string out, flags.Required("out"));
  KVRELAYCTL_FLAG(o.layers, flags.Int("layers", o.layers, 1, kMaxLayers));
  KVRELAYCTL_FLAG(o.kv_heads, flags.Int("kv-heads", o.kv_heads, 1, kMaxKvHeads));
  KVRELAYCTL_FLAG(o.score_heads, flags.Int("score-heads", 0, 0, kMaxScoreHeads));
  KVRELAYCTL_FLAG(o.head_dim, flags.Int("head-dim", o.head_dim, 1, kMaxHeadDim));
  KVRELAYCTL_FLAG(o.n_prompt, flags.Int("prompt", o.n_prompt, 0, kMax));
  KVRELAYCTL_FLAG(o.n_gen, flags.Int("gen", o.n_gen, 0, kMax));
  KVRELAYCTL_FLAG(o.n_history, flags.Int("history", o.n_history, 0, kMax));
  KVRELAYCTL_FLAG(const int64_t seed, flags.Int("seed", 1, 0, INT64_MAX));
  o.seed = static_cast<uint64_t>(seed);
  if (auto v = flags.Get("dtype")) {
    std::optional<DType> dt = ParseDType(*v);
    if (!dt) return Usage(absl::StrCat("flag --dtype: \"", *v, "\", expected F32, F16 or BF16"));
    o.dtype = *dt;
  }
  o.first_agent = o.n_history == 0;
  if (auto v = flags.Get("first-agent")) {
    if (*v != "true" && *v != "false") {
      return Usage(absl::StrCat("flag --first-agent: \"", *v, "\", expected true or false"));
    }
    o.first_agent = *v == "true";
  }
  o.queries = flags.Has("queries");
  if (auto f = CheckTurnFlags(o)) return f;
  absl::StatusOr<Turn> turn = MakeSyntheticTurn(o);
  if (!turn.ok()) return Runtime(turn.status());
  absl::Status s = WriteTurnFile(*turn, out);
  if (!s.ok()) return Runtime(s);
  std::printf(
      "wrote %s: layers=%d kv_heads=%d score_heads=%d head_dim=%d history=%d prompt=%d "
      "gen=%d dtype=%s first_agent=%s seed=%" PRIu64 "%s\n",
      out.c_str(), o.layers, o.kv_heads, GeometryOf(*turn)->score_heads, o.head_dim, o.n_history,
      o.n_prompt, o.n_gen, std::string(DTypeName(o.dtype)).c_str(),
      o.first_agent ? "true" : "false", o.seed, o.queries ? " attention=gen.q" : "");
  return std::nullopt;
}

#ifdef KVRELAYCTL_WITH_RELAY
// ---- Relay verbs (a running kvrelay-server at --addr) ----

// A relay error: exit 1, the gRPC code name and the relay's message.
Failure RelayError(absl::string_view what, const absl::Status& s) {
  return {kRuntimeError,
          absl::StrCat(what, ": ", absl::StatusCodeToString(s.code()), ": ", s.message())};
}

// Seconds flag as a duration in [lo, hi] seconds, or `dflt`.
absl::StatusOr<std::chrono::milliseconds> Seconds(const Flags& flags, const std::string& name,
                                                  double dflt, double lo, double hi) {
  auto v = flags.Get(name);
  double x = dflt;
  if (v && (!absl::SimpleAtod(*v, &x) || !(x >= lo && x <= hi))) {
    return absl::InvalidArgumentError(absl::StrCat("flag --", name, ": \"", *v,
                                                   "\", expected seconds in [", lo, ", ", hi, "]"));
  }
  return std::chrono::milliseconds(static_cast<int64_t>(std::llround(x * 1000)));
}

// Progress on stderr when it is a terminal: at most 10 updates a second,
// the line cleared when the transfer is done.
class ProgressLine {
 public:
  explicit ProgressLine(std::string label) : label_(std::move(label)), tty_(isatty(STDERR_FILENO)) {}
  ~ProgressLine() { Clear(); }
  ProgressCallback Callback() {
    if (!tty_) return nullptr;
    return [this](const TransferProgress& p) {
      const auto now = std::chrono::steady_clock::now();
      if (p.bytes_done < p.bytes_total && now - last_ < std::chrono::milliseconds(100)) return;
      last_ = now;
      const double pct = p.bytes_total ? 100.0 * p.bytes_done / p.bytes_total : 100.0;
      std::fprintf(stderr, "\r%s %s %6.1f%% %.1f/%.1f MB ", label_.c_str(),
                   p.phase == TransferProgress::Phase::kUpload ? "upload" : "download", pct,
                   p.bytes_done / 1e6, p.bytes_total / 1e6);
      std::fflush(stderr);
      shown_ = true;
    };
  }
  void Clear() {
    if (!shown_) return;
    std::fprintf(stderr, "\r\033[K");
    std::fflush(stderr);
    shown_ = false;
  }

 private:
  std::string label_;
  bool tty_;
  bool shown_ = false;
  std::chrono::steady_clock::time_point last_{};
};

std::string AccountingLine(const Accounting& a) {
  return absl::StrFormat("policy=%s received_bytes=%d full_bytes=%d sent_bytes=%d ratio=%s "
                         "compress_ms=%.3f commit_ms=%.3f",
                         a.policy, a.received_bytes, a.full_bytes, a.sent_bytes,
                         Ratio(a.full_bytes, a.sent_bytes), a.compress_seconds * 1e3,
                         a.commit_seconds * 1e3);
}

// Writes a fetched message: the message file of docs/FORMAT.md, with the
// delivery in its metadata (message_id, session, from, role, parent_id,
// delivery_attempt and the accounting).
absl::Status WriteFetchedMessage(const FetchedMessage& m, const std::string& path) {
  std::string buf;
  KVRELAY_RETURN_IF_ERROR(WriteMessage(m.message, &buf));
  KVRELAY_ASSIGN_OR_RETURN(SafetensorsReader file, SafetensorsReader::ParseView(AsBytes(buf)));
  StMetadata meta = file.metadata();
  meta["message_id"] = m.message_id;
  meta["session"] = m.session_id;
  meta["from"] = m.sender;
  if (!m.role.empty()) meta["role"] = m.role;
  if (!m.parent_id.empty()) meta["parent_id"] = m.parent_id;
  meta["delivery_attempt"] = absl::StrCat(m.delivery_attempt);
  meta["received_bytes"] = absl::StrCat(m.accounting.received_bytes);
  meta["ratio"] = absl::StrFormat("%.6f", m.accounting.ratio);
  meta["compress_seconds"] = absl::StrFormat("%.6f", m.accounting.compress_seconds);
  meta["commit_seconds"] = absl::StrFormat("%.6f", m.accounting.commit_seconds);
  return WriteSafetensorsFile(path, file.tensors(), meta);
}

std::optional<Failure> Publish(int argc, char** argv) {
  Flags flags("publish",
              WithConnectFlags({"addr", "session", "from", "id", "policy", "role", "parent", "in", "timeout",
                                "retries"}),
              {}, {"to"});
  if (auto f = flags.Parse(argc, argv)) return f;
  if (auto f = NoPositional(flags, "publish")) return f;
  PublishOptions o;
  KVRELAYCTL_FLAG(const std::string addr, flags.Addr());
  KVRELAYCTL_FLAG(o.session, flags.Required("session"));
  KVRELAYCTL_FLAG(o.sender, flags.Required("from"));
  KVRELAYCTL_FLAG(const std::string in, flags.Required("in"));
  KVRELAYCTL_FLAG(o.deadline, Seconds(flags, "timeout", 120, 0.001, 86400));
  KVRELAYCTL_FLAG(o.retries, flags.Int("retries", 3, 0, 100));
  o.recipients = flags.GetAll("to");
  if (o.recipients.empty()) return Usage("publish: missing required flag --to");
  o.message_id = flags.Get("id").value_or("");
  o.policy = flags.Get("policy").value_or("");
  o.role = flags.Get("role").value_or("");
  o.parent_id = flags.Get("parent").value_or("");

  KVRELAYCTL_DIAL(client, flags, addr);
  TurnFileOptions read;
  read.on_parent = !o.parent_id.empty();
  absl::StatusOr<Turn> turn = ReadTurnFile(in, read);
  if (!turn.ok()) return Runtime(turn.status());
  ProgressLine line("publish");
  o.progress = line.Callback();
  // Shared, so the upload sends the tensors without copying them.
  absl::StatusOr<PublishResult> r = client->Publish(std::make_shared<const Turn>(*std::move(turn)), o);
  line.Clear();
  if (!r.ok()) return RelayError("publish", r.status());
  std::printf("message_id=%s duplicate=%s attempts=%d %s\n", r->message_id.c_str(),
              r->duplicate ? "true" : "false", r->attempts, AccountingLine(r->accounting).c_str());
  return std::nullopt;
}

std::optional<Failure> Fetch(int argc, char** argv) {
  Flags flags("fetch", WithConnectFlags({"addr", "session", "agent", "out", "wait"}), {"no-ack"});
  if (auto f = flags.Parse(argc, argv)) return f;
  if (auto f = NoPositional(flags, "fetch")) return f;
  FetchOptions o;
  KVRELAYCTL_FLAG(const std::string addr, flags.Addr());
  KVRELAYCTL_FLAG(o.session, flags.Required("session"));
  KVRELAYCTL_FLAG(o.agent, flags.Required("agent"));
  KVRELAYCTL_FLAG(const std::string out, flags.Required("out"));
  KVRELAYCTL_FLAG(o.wait, Seconds(flags, "wait", 30, 0.001, 86400));
  const bool ack = !flags.Has("no-ack");
  KVRELAYCTL_DIAL(client, flags, addr);
  ProgressLine line("fetch");
  o.progress = line.Callback();
  absl::StatusOr<FetchedMessage> m = client->Fetch(o);
  line.Clear();
  if (!m.ok() && m.status().code() == absl::StatusCode::kDeadlineExceeded) {
    return RelayError("fetch", absl::DeadlineExceededError(absl::StrCat(
                                   "no complete message for agent '", o.agent, "' in session '", o.session,
                                   "' within ", absl::FormatDuration(absl::Milliseconds(o.wait.count())),
                                   " (--wait bounds the transfer too; ", m.status().message(), ")")));
  }
  if (!m.ok()) return RelayError("fetch", m.status());
  // Acknowledge only once the message is safely on disk.
  absl::Status s = WriteFetchedMessage(*m, out);
  if (!s.ok()) return Runtime(s);
  if (ack) {
    s = client->Ack(o.session, o.agent, m->message_id);
    if (!s.ok()) return RelayError("ack", s);
  }
  const Message& msg = m->message;
  std::printf("message_id=%s from=%s parent=%s delivery_attempt=%u acked=%s layers=%zu "
              "history=%d anchor=%d kept=%d gen=%d next_pos=%" PRId64 " %s out=%s\n",
              m->message_id.c_str(), m->sender.c_str(),
              m->parent_id.empty() ? "-" : m->parent_id.c_str(), m->delivery_attempt,
              ack ? "true" : "false", msg.layers.size(), msg.n_history, msg.n_anchor, msg.n_kept,
              msg.n_gen, msg.next_pos, AccountingLine(m->accounting).c_str(), out.c_str());
  return std::nullopt;
}

std::optional<Failure> AckVerb(int argc, char** argv) {
  Flags flags("ack", WithConnectFlags({"addr", "session", "agent", "id"}), {});
  if (auto f = flags.Parse(argc, argv)) return f;
  if (auto f = NoPositional(flags, "ack")) return f;
  KVRELAYCTL_FLAG(const std::string addr, flags.Addr());
  KVRELAYCTL_FLAG(const std::string session, flags.Required("session"));
  KVRELAYCTL_FLAG(const std::string agent, flags.Required("agent"));
  KVRELAYCTL_FLAG(const std::string id, flags.Required("id"));
  KVRELAYCTL_DIAL(client, flags, addr);
  absl::Status s = client->Ack(session, agent, id);
  if (!s.ok()) return RelayError("ack", s);
  std::printf("acked message_id=%s\n", id.c_str());
  return std::nullopt;
}

std::optional<Failure> CloseVerb(int argc, char** argv) {
  Flags flags("close", WithConnectFlags({"addr", "session"}), {});
  if (auto f = flags.Parse(argc, argv)) return f;
  if (auto f = NoPositional(flags, "close")) return f;
  KVRELAYCTL_FLAG(const std::string addr, flags.Addr());
  KVRELAYCTL_FLAG(const std::string session, flags.Required("session"));
  KVRELAYCTL_DIAL(client, flags, addr);
  absl::StatusOr<uint32_t> n = client->CloseSession(session);
  if (!n.ok()) return RelayError("close", n.status());
  std::printf("closed session=%s messages_freed=%u\n", session.c_str(), *n);
  return std::nullopt;
}

std::optional<Failure> HealthVerb(int argc, char** argv) {
  Flags flags("health", WithConnectFlags({"addr", "service", "timeout"}), {});
  if (auto f = flags.Parse(argc, argv)) return f;
  if (auto f = NoPositional(flags, "health")) return f;
  KVRELAYCTL_FLAG(const std::string addr, flags.Addr());
  KVRELAYCTL_FLAG(const auto timeout, Seconds(flags, "timeout", 5, 0.001, 3600));
  KVRELAYCTL_DIAL(client, flags, addr);
  absl::StatusOr<HealthStatus> h = client->Health(flags.Get("service").value_or(""), timeout);
  if (!h.ok()) return RelayError("health", h.status());
  std::printf("%s\n", HealthStatusName(*h));
  if (*h != HealthStatus::kServing) {
    return Failure{kRuntimeError, absl::StrCat("health: ", HealthStatusName(*h))};
  }
  return std::nullopt;
}

std::optional<Failure> StatsVerb(int argc, char** argv) {
  Flags flags("stats", WithConnectFlags({"addr"}), {});
  if (auto f = flags.Parse(argc, argv)) return f;
  if (auto f = NoPositional(flags, "stats")) return f;
  KVRELAYCTL_FLAG(const std::string addr, flags.Addr());
  KVRELAYCTL_DIAL(client, flags, addr);
  absl::StatusOr<RelayStats> s = client->Stats();
  if (!s.ok()) return RelayError("stats", s.status());
  std::printf(
      "version: %s\nmessages_committed: %" PRIu64 "\nmessages_failed: %" PRIu64
      "\nmessages_delivered: %" PRIu64 "\nmessages_acked: %" PRIu64 "\nreceived_bytes: %" PRIu64
      "\nfull_bytes: %" PRIu64 "\nsent_bytes: %" PRIu64 "\nratio: %s\nsessions: %" PRIu64
      "\nmailbox_messages: %" PRIu64 "\nmailbox_bytes: %" PRIu64 "\ninflight_bytes: %" PRIu64
      "\nstore_bytes: %" PRIu64 "\n",
      s->version.c_str(), s->messages_committed, s->messages_failed, s->messages_delivered,
      s->messages_acked, s->received_bytes, s->full_bytes, s->sent_bytes,
      Ratio(s->full_bytes, s->sent_bytes).c_str(), s->sessions, s->mailbox_messages,
      s->mailbox_bytes, s->inflight_bytes, s->store_bytes);
  return std::nullopt;
}

// `s` in double quotes, with backslash, double quote, newline, carriage
// return and tab escaped by a backslash: one parseable token on one line.
std::string Quoted(absl::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default: out += c;
    }
  }
  return out + "\"";
}

std::optional<Failure> StatusVerb(int argc, char** argv) {
  Flags flags("status", WithConnectFlags({"addr", "session", "id", "timeout"}), {});
  if (auto f = flags.Parse(argc, argv)) return f;
  if (auto f = NoPositional(flags, "status")) return f;
  KVRELAYCTL_FLAG(const std::string addr, flags.Addr());
  KVRELAYCTL_FLAG(const std::string session, flags.Required("session"));
  KVRELAYCTL_FLAG(const std::string id, flags.Required("id"));
  KVRELAYCTL_FLAG(const auto timeout, Seconds(flags, "timeout", 10, 0.001, 3600));
  KVRELAYCTL_DIAL(client, flags, addr);
  absl::StatusOr<MessageStatusResult> m = client->MessageStatus(session, id, timeout);
  if (!m.ok()) return RelayError("status", m.status());
  if (m->forwarded_by.empty()) {
    std::printf("sender=%s\n", m->sender.c_str());
  } else {
    std::printf("sender=%s forwarded_by=%s\n", m->sender.c_str(), m->forwarded_by.c_str());
  }
  for (const RecipientStatus& r : m->recipients) {
    std::printf("agent=%s state=%s relay=%s attempts=%u reason=%s\n", r.agent.c_str(),
                RecipientStateName(r.state), r.relay.c_str(), r.attempts, Quoted(r.reason).c_str());
  }
  return std::nullopt;
}

constexpr int kDemoAgents = 4;
constexpr const char* kDemoAgentNames[kDemoAgents] = {"planner", "critic", "refiner", "judger"};

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
  if (addrs.size() != 1 && addrs.size() != kDemoAgents) {
    return absl::InvalidArgumentError(absl::StrCat(
        "flag ", flag, ": ", addrs.size(),
        " addresses, expected 1 (one relay for every agent) or 4 (one per agent: planner, critic, refiner, judger)"));
  }
  for (size_t i = 0; i < addrs.size(); ++i) {
    const std::string which =
        addrs.size() == 1 ? "" : absl::StrCat(" address ", i + 1, " (", kDemoAgentNames[i], ")");
    if (addrs[i].empty()) return absl::InvalidArgumentError(absl::StrCat("flag ", flag, which, ": empty value"));
    if (absl::Status s = CheckRelayAddress(addrs[i]); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("flag ", flag, which, ": ", s.message()));
    }
  }
  if (addrs.size() == 1) addrs.assign(kDemoAgents, addrs[0]);
  return addrs;
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

// The demo: planner -> critic -> refiner -> judger. Each agent "generates" a
// synthetic turn of Qwen3-14B geometry that continues the positions of what
// it received, and publishes it to the next agent with the message it
// fetched as parent, so the relay composes the history. One session per
// round, closed at the end of it. With one relay per agent, each agent
// publishes to, fetches from and acks at its own relay only; the relays
// forward between them as their routes say.
std::optional<Failure> Demo(int argc, char** argv) {
  Flags flags("demo",
              WithConnectFlags({"addrs", "rounds", "policy", "session", "layers", "kv-heads", "score-heads",
                                "head-dim", "prompt", "gen", "dtype", "seed"}),
              {"queries", "chain"}, {"addr"});
  if (auto f = flags.Parse(argc, argv)) return f;
  if (auto f = NoPositional(flags, "demo")) return f;
  const bool chain = flags.Has("chain");
  KVRELAYCTL_FLAG(const std::vector<std::string> addrs, DemoAddrs(flags));
  KVRELAYCTL_FLAG(const int64_t rounds, flags.Int("rounds", 1, 1, 1000));
  SyntheticTurnOptions o = Qwen3_14BTurn();
  const int group = o.score_heads / o.kv_heads;  // Qwen3-14B: 40 query heads over 8 KV heads
  KVRELAYCTL_FLAG(o.layers, flags.Int("layers", o.layers, 1, kMaxLayers));
  KVRELAYCTL_FLAG(o.kv_heads, flags.Int("kv-heads", o.kv_heads, 1, kMaxKvHeads));
  // Without --score-heads the query heads follow --kv-heads in Qwen3-14B's
  // ratio; 0 means as many as KV heads (as make-turn).
  KVRELAYCTL_FLAG(o.score_heads, flags.Int("score-heads", o.kv_heads * group, 0, kMaxScoreHeads));
  if (o.score_heads == 0) o.score_heads = o.kv_heads;
  KVRELAYCTL_FLAG(o.head_dim, flags.Int("head-dim", o.head_dim, 1, kMaxHeadDim));
  KVRELAYCTL_FLAG(o.n_prompt, flags.Int("prompt", o.n_prompt, 0, 1 << 24));
  KVRELAYCTL_FLAG(o.n_gen, flags.Int("gen", o.n_gen, 0, 1 << 24));
  KVRELAYCTL_FLAG(const int64_t seed, flags.Int("seed", 1, 0, INT64_MAX));
  if (auto v = flags.Get("dtype")) {
    std::optional<DType> dt = ParseDType(*v);
    if (!dt) return Usage(absl::StrCat("flag --dtype: \"", *v, "\", expected F32, F16 or BF16"));
    o.dtype = *dt;
  }
  o.queries = flags.Has("queries");
  if (auto f = CheckTurnFlags(o)) return f;
  // Empty --policy: the relay's default for each agent's role.
  const std::string policy = flags.Get("policy").value_or("h2o-head:k=32+obf:p=8,mode=fast");
  const std::string session_base =
      flags.Get("session").value_or(absl::StrCat("demo-", NewMessageId().value_or("m-00000000").substr(2, 8)));

  // One client per distinct relay, in chain order; agent i uses relay_of[i].
  std::vector<std::string> relays;
  std::vector<std::unique_ptr<RelayClient>> clients;
  RelayClient* relay_of[kDemoAgents];
  for (int i = 0; i < kDemoAgents; ++i) {
    auto it = std::find(relays.begin(), relays.end(), addrs[i]);
    if (it == relays.end()) {
      relays.push_back(addrs[i]);
      KVRELAYCTL_DIAL(client, flags, addrs[i]);
      clients.push_back(std::move(client));
      it = relays.end() - 1;
    }
    relay_of[i] = clients[it - relays.begin()].get();
  }
  const bool mesh = relays.size() > 1;
  std::vector<RelayStats> before;
  for (size_t i = 0; i < clients.size(); ++i) {
    absl::StatusOr<RelayStats> s = clients[i]->Stats();
    if (!s.ok()) return RelayError(mesh ? absl::StrCat("stats of ", relays[i]) : "stats", s.status());
    before.push_back(*std::move(s));
  }
  const char* const* agents = kDemoAgentNames;
  std::string where = addrs[0];
  if (mesh) {
    where.clear();
    for (int i = 0; i < kDemoAgents; ++i) absl::StrAppend(&where, i ? " " : "", agents[i], "=", addrs[i]);
  }
  std::printf("kvrelay demo: %s, %d layers, %d kv heads, %d score heads, head_dim %d, %s, "
              "%d prompt + %d generated tokens per turn, policy %s\n",
              where.c_str(), o.layers, o.kv_heads, o.score_heads, o.head_dim,
              std::string(DTypeName(o.dtype)).c_str(), o.n_prompt, o.n_gen,
              policy.empty() ? "(role default)" : policy.c_str());
  uint64_t tot_full = 0, tot_sent = 0, tot_saved = 0, tot_received = 0, tot_to_next = 0;
  double tot_compress_ms = 0, tot_hop_ms = 0;
  int hops = 0;
  // With --chain every round continues one session: the judger publishes
  // back to the planner, so the history keeps growing (or stays within
  // hist=); else each round is a session of its own.
  const int hops_per_round = chain ? kDemoAgents : kDemoAgents - 1;
  std::string parent;
  int64_t next_pos = 0;
  for (int64_t round = 0; round < rounds; ++round) {
    const std::string session =
        rounds == 1 || chain ? session_base : absl::StrCat(session_base, "-r", round + 1);
    // Closes the session at every relay of the chain (each relay passes a
    // close on as well; closing is idempotent).
    auto close_all = [&]() -> absl::Status {
      for (size_t i = 0; i < clients.size(); ++i) {
        absl::StatusOr<uint32_t> freed = clients[i]->CloseSession(session);
        if (!freed.ok()) return freed.status();
      }
      return absl::OkStatus();
    };
    std::printf("\nround %" PRId64 " session %s\n", round + 1, session.c_str());
    std::printf("%-3s %-19s %7s %13s %13s %8s %11s %13s%s\n", "hop", "from -> to", "tokens",
                "full_bytes", "sent_bytes", "ratio", "compress_ms", "hop_latency_ms",
                mesh ? "  to_next_relay" : "");
    if (!chain) {
      parent.clear();
      next_pos = 0;
    }
    for (int hop = 0; hop < hops_per_round; ++hop) {
      const int next = (hop + 1) % kDemoAgents;
      const std::string from = agents[hop], to = agents[next];
      RelayClient* const from_relay = relay_of[hop];
      RelayClient* const to_relay = relay_of[next];
      const bool crosses = from_relay != to_relay;
      SyntheticTurnOptions to_make = o;
      to_make.seed = static_cast<uint64_t>(seed) + round * 16 + hop;
      to_make.first_agent = parent.empty();
      absl::StatusOr<Turn> turn = MakeSyntheticTurn(to_make);
      if (!turn.ok()) return Runtime(turn.status());
      turn->prompt_pos0 = next_pos;  // continue after what the agent received
      PublishOptions p;
      p.session = session;
      p.sender = from;
      p.recipients = {to};
      p.role = from;
      p.policy = policy;
      p.parent_id = parent;
      ProgressLine line(absl::StrCat(from, " -> ", to));
      p.progress = line.Callback();

      // The recipient waits for the message (at its own relay) while the
      // sender publishes.
      absl::StatusOr<FetchedMessage> fetched = absl::UnknownError("not fetched");
      std::chrono::steady_clock::time_point fetched_at;
      std::atomic<bool> fetch_done{false};
      const auto start = std::chrono::steady_clock::now();
      std::thread recipient([&] {
        FetchOptions f;
        f.session = session;
        f.agent = to;
        f.wait = std::chrono::seconds(120);
        fetched = to_relay->Fetch(f);
        fetched_at = std::chrono::steady_clock::now();
        fetch_done = true;
      });
      absl::StatusOr<PublishResult> r = from_relay->Publish(std::make_shared<const Turn>(*std::move(turn)), p);
      if (!r.ok()) {
        // Unblock the recipient: closing the session ends its wait.
        (void)close_all();
        recipient.join();
        line.Clear();
        return RelayError(absl::StrCat("demo: publish ", from, " -> ", to), r.status());
      }
      // A forward the sender's relay gave up on never arrives: stop waiting.
      std::string dead_reason;
      if (crosses && WatchForDeadLetter(from_relay, session, r->message_id, to, fetch_done, &dead_reason)) {
        (void)close_all();
        recipient.join();
        line.Clear();
        return Failure{kRuntimeError,
                       absl::StrCat("demo: forward ", from, " -> ", to, " (", addrs[hop], " to ", addrs[next],
                                    "): message ", r->message_id, " dead-lettered: ", dead_reason)};
      }
      recipient.join();
      line.Clear();
      if (!fetched.ok()) {
        return RelayError(absl::StrCat("demo: fetch by ", to), fetched.status());
      }
      if (fetched->message_id != r->message_id) {
        return Failure{kRuntimeError,
                       absl::StrCat("demo: ", to, " fetched message ", fetched->message_id,
                                    ", expected ", r->message_id)};
      }
      absl::Status s = to_relay->Ack(session, to, fetched->message_id);
      if (!s.ok()) return RelayError(absl::StrCat("demo: ack by ", to), s);
      const double hop_ms = std::chrono::duration<double, std::milli>(fetched_at - start).count();
      const Accounting& a = r->accounting;
      const Message& m = fetched->message;
      // What a whole forward carries: the composed message.
      const uint64_t to_next = crosses ? a.sent_bytes : 0;
      std::printf("%-3d %-19s %7d %13" PRIu64 " %13" PRIu64 " %8s %11.2f %13.2f%s\n", chain ? hops + 1 : hop + 1,
                  absl::StrCat(from, " -> ", to).c_str(), m.layers.empty() ? 0 : m.layers[0].tokens(),
                  a.full_bytes, a.sent_bytes, Ratio(a.full_bytes, a.sent_bytes).c_str(),
                  a.compress_seconds * 1e3, hop_ms,
                  mesh ? absl::StrFormat(" %14d", to_next).c_str() : "");
      if (a.attention_error) {
        std::printf("    attention output error %.4f (the sender's own queries on the message vs the full cache)\n",
                    *a.attention_error);
      }
      std::fflush(stdout);
      tot_full += a.full_bytes;
      tot_sent += a.sent_bytes;
      tot_saved += a.full_bytes > a.sent_bytes ? a.full_bytes - a.sent_bytes : 0;  // as the relay counts it
      tot_received += a.received_bytes;
      tot_compress_ms += a.compress_seconds * 1e3;
      tot_hop_ms += hop_ms;
      tot_to_next += to_next;
      ++hops;
      parent = fetched->message_id;
      next_pos = m.next_pos;  // where the sender's turn ended
    }
    if (!chain || round == rounds - 1) {
      if (absl::Status s = close_all(); !s.ok()) return RelayError("demo: close", s);
    }
  }
  std::printf("\ntotals: hops=%d received_bytes=%" PRIu64 " full_bytes=%" PRIu64
              " sent_bytes=%" PRIu64 " ratio=%s saved_bytes=%" PRIu64
              " compress_ms=%.2f hop_latency_ms=%.2f%s\n",
              hops, tot_received, tot_full, tot_sent, Ratio(tot_full, tot_sent).c_str(),
              tot_saved, tot_compress_ms, tot_hop_ms,
              mesh ? absl::StrCat(" to_next_relay_bytes=", tot_to_next).c_str() : "");
  for (size_t i = 0; i < clients.size(); ++i) {
    absl::StatusOr<RelayStats> after = clients[i]->Stats();
    if (!after.ok()) continue;
    // With one relay: equal to the totals above when nothing else used the
    // relay meanwhile. With several: what each relay counted itself.
    std::printf("relay stats delta%s: committed=%" PRIu64 " received_bytes=%" PRIu64
                " full_bytes=%" PRIu64 " sent_bytes=%" PRIu64 "\n",
                mesh ? absl::StrCat(" at ", relays[i]).c_str() : "",
                after->messages_committed - before[i].messages_committed,
                after->received_bytes - before[i].received_bytes,
                after->full_bytes - before[i].full_bytes, after->sent_bytes - before[i].sent_bytes);
  }
  return std::nullopt;
}
#endif  // KVRELAYCTL_WITH_RELAY

std::optional<Failure> TokenVerb(int argc, char** argv) {
  if (argc < 1 || std::string(argv[0]) != "new") {
    return Usage(absl::StrCat("token: ", argc < 1 ? "missing verb," : absl::StrCat("unknown verb \"", argv[0], "\","),
                              " expected \"token new AGENT\""));
  }
  Flags flags("token new", {}, {});
  if (auto f = flags.Parse(argc - 1, argv + 1)) return f;
  if (flags.positional().size() != 1) {
    return Usage(absl::StrCat("token new: expected one AGENT argument, got ", flags.positional().size()));
  }
  absl::StatusOr<std::string> token = NewToken();
  if (!token.ok()) return Runtime(token.status());
  absl::StatusOr<std::string> line = TokensFileLine(flags.positional()[0], *token);
  if (!line.ok()) return Usage(absl::StrCat("token new: ", line.status().message()));
  std::printf("%s\n%s\n", token->c_str(), line->c_str());
  return std::nullopt;
}

int Main(int argc, char** argv) {
  if (argc < 2) {
    std::fputs(kUsage, stderr);
    std::fprintf(stderr, "kvrelayctl: missing verb\n");
    return kUsageError;
  }
  const std::string verb = argv[1];
  std::optional<Failure> failure;
  if (verb == "help" || verb == "--help" || verb == "-h") {
    std::fputs(kUsage, stdout);
    return 0;
  } else if (verb == "compress") {
    failure = Compress(argc - 2, argv + 2);
  } else if (verb == "inspect") {
    failure = Inspect(argc - 2, argv + 2);
  } else if (verb == "make-turn") {
    failure = MakeTurn(argc - 2, argv + 2);
  } else if (verb == "token") {
    failure = TokenVerb(argc - 2, argv + 2);
#ifdef KVRELAYCTL_WITH_RELAY
  } else if (verb == "publish") {
    failure = Publish(argc - 2, argv + 2);
  } else if (verb == "fetch") {
    failure = Fetch(argc - 2, argv + 2);
  } else if (verb == "ack") {
    failure = AckVerb(argc - 2, argv + 2);
  } else if (verb == "close") {
    failure = CloseVerb(argc - 2, argv + 2);
  } else if (verb == "health") {
    failure = HealthVerb(argc - 2, argv + 2);
  } else if (verb == "stats") {
    failure = StatsVerb(argc - 2, argv + 2);
  } else if (verb == "status") {
    failure = StatusVerb(argc - 2, argv + 2);
  } else if (verb == "demo") {
    failure = Demo(argc - 2, argv + 2);
#endif
  } else {
    failure = Usage(absl::StrCat("unknown verb \"", verb, "\" (try kvrelayctl help)"));
  }
  if (!failure) return 0;
  std::fprintf(stderr, "kvrelayctl: %s\n", failure->message.c_str());
  return failure->code;
}

}  // namespace
}  // namespace kvrelay

int main(int argc, char** argv) {
  // Turns are tens of MB: keep freed tensors for reuse (core/heap_retain.h).
  kvrelay::RetainFreedHeap(kvrelay::kDefaultHeapRetainBytes);
  try {
    return kvrelay::Main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvrelayctl: internal error: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "kvrelayctl: internal error\n");
  }
  return 1;
}
