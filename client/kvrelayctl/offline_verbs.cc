// The offline verbs: compress, inspect, make-turn and token. They read and
// write files on this machine only, except compress --addr, which has a
// relay compress (its stateless Compress call) in a relay build.
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "client/kvrelayctl/flags.h"
#include "client/kvrelayctl/internal/common.h"
#include "client/kvrelayctl/verbs.h"
#include "core/format/safetensors.h"
#include "core/format/synthetic.h"
#include "core/format/turn_file.h"
#include "core/history.h"
#include "core/message.h"
#include "core/pipeline.h"
#include "core/quant.h"
#include "core/thread_pool.h"
#include "core/token.h"
#include "core/turn.h"
#ifdef KVRELAYCTL_WITH_RELAY
#include "client/kvrelayctl/internal/relay.h"
#include "proto/stream_codec.h"
#include "proto/wire_codec.h"
#endif

namespace kvrelay::ctl {
namespace {

// ---- compress ----

// The usage errors of compress's flag combinations: --threads and --parent
// are for compressing here, the connection flags for the relay, and --addr
// is checked (and needs a relay build).
Outcome CheckCompressFlags(const Flags& flags) {
  const bool addr = flags.Has("addr");
  if (addr && flags.Has("threads")) {
    return Usage("compress: --threads is for compressing here; with --addr the relay compresses");
  }
  for (const char* name : {"tls-ca", "tls-cert", "tls-key", "token-file"}) {
    if (!addr && flags.Has(name)) {
      return Usage(absl::StrCat("compress: --", name, " is for the relay; it needs --addr"));
    }
  }
  if (!addr) return std::nullopt;
#ifdef KVRELAYCTL_WITH_RELAY
  if (absl::StatusOr<std::string> checked = AddrFlag(flags); !checked.ok()) {
    return Usage(std::string(checked.status().message()));
  }
#endif
  if (flags.Has("parent")) {
    return Usage("compress: --parent is for compressing here; a relay composes on a parent by publish");
  }
#ifndef KVRELAYCTL_WITH_RELAY
  return Usage("compress: --addr needs a build with the relay (KVRELAY_BUILD_SERVICE)");
#endif
  return std::nullopt;
}

// The turn of --in, composed on the message file --parent when given (its
// decoded history, acc and anchors, as a relay composes a publish with
// parent_id).
absl::StatusOr<Turn> ReadCompressInput(const std::string& in, const std::optional<std::string>& parent_path) {
  TurnFileOptions read;
  read.on_parent = parent_path.has_value();
  absl::StatusOr<Turn> turn = ReadTurnFile(in, read);
  if (!turn.ok() || !parent_path) return turn;
  absl::StatusOr<Message> parent = ReadMessageFile(*parent_path);
  if (!parent.ok()) return parent.status();
  if (absl::Status s = ComposeOnParent(*parent, &*turn); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(in, " on parent ", *parent_path, ": ", s.message()));
  }
  return turn;
}

// A compressed message and how long compressing took (here, or the relay's
// own time).
struct Compressed {
  Message message;
  double ms = 0;
};

// Compresses with `threads` workers of this process. `validated`: every
// value of `turn` was checked already (ReadTurnFile does; a parent's
// decoded history is not).
absl::StatusOr<Compressed> CompressHere(const Pipeline& pipeline, const Turn& turn, bool validated, int64_t threads) {
  std::unique_ptr<ThreadPool> pool;
  if (threads > 1) pool = std::make_unique<ThreadPool>(static_cast<int>(threads));
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<Message> msg =
      validated ? pipeline.CompressValidated(turn, pool.get()) : pipeline.Compress(turn, pool.get());
  const auto stop = std::chrono::steady_clock::now();
  if (!msg.ok()) return msg.status();
  return Compressed{*std::move(msg), std::chrono::duration<double, std::milli>(stop - start).count()};
}

// " wire_bytes=N": what a forward with --wire-codec rans puts on the
// network for the message's tensors (its acc, relay-side state, aside);
// empty without the relay's codec in this build.
std::string WireBytesField(const Message& msg) {
#ifdef KVRELAYCTL_WITH_RELAY
  uint64_t wire_bytes = 0;
  const WireEncodeOptions wo = WireEncodeOptionsOf(msg.kv_heads, ToProtoDType(msg.dtype));
  for (size_t l = 0; l < msg.layers.size(); ++l) {
    wire_bytes += EncodeWireLayer(LayerDeliveryOrder(msg.layers[l], static_cast<uint32_t>(l)), wo).size();
  }
  return absl::StrCat(" wire_bytes=", wire_bytes);
#else
  (void)msg;
  return "";
#endif
}

// ---- inspect ----

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
  std::printf("layers: %" PRIu64 "\ndtype: %s\nkv_heads: %" PRIu64 "\nhead_dim: %" PRIu64 "\nscore_heads: %d\n", L,
              std::string(DTypeName(l0.prompt_k.dtype())).c_str(), H, d, l0.scores.rows);
  std::printf("first_agent: %s\nprompt_pos0: %" PRId64 "\n", turn.first_agent ? "true" : "false", turn.PromptPos0());
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
  std::printf("full_bytes: %" PRIu64 "\nsent_bytes: %" PRIu64 "\nratio: %s\nnext_pos: %" PRId64 "\n", msg.full_bytes,
              msg.sent_bytes, Ratio(msg.full_bytes, msg.sent_bytes).c_str(), msg.next_pos);
}

}  // namespace

VerbSpec CompressSpec() {
  std::vector<FlagSpec> flags = {
      RequiredFlag("policy", "SPEC", "pipeline spec (docs/FORMAT.md), e.g. h2o-head:k=32+obf:p=8+int4:group=32"),
      RequiredFlag("in", "TURN.safetensors", "the turn to compress"),
      RequiredFlag("out", "MSG.safetensors", "where the message goes"),
      ValueFlag("parent", "MSG.safetensors",
                "composes on a message file as a relay composes a publish with parent_id; prompt_pos0 defaults "
                "to where it ended"),
      BoolFlag("decode", "writes quantized K/V decoded back to the turn's dtype"),
      ValueFlag("threads", "N", "worker threads; defaults to the number of hardware threads"),
      ValueFlag("addr", "HOST:PORT", "the relay compresses (its stateless Compress call) instead"),
  };
  AppendFlags(&flags, ConnectFlagSpecs());
  return {"", std::move(flags)};
}

Outcome Compress(const Flags& flags) {
  if (Outcome f = NoPositional(flags)) return f;
  KVRELAYCTL_FLAG(const std::string policy, flags.Required("policy"));
  KVRELAYCTL_FLAG(const std::string in, flags.Required("in"));
  KVRELAYCTL_FLAG(const std::string out, flags.Required("out"));
  KVRELAYCTL_FLAG(const int64_t threads, flags.IntOr("threads", ThreadPool::HardwareThreads(), 1, 4096));
  if (Outcome f = CheckCompressFlags(flags)) return f;
  const bool decode = flags.Has("decode");
  const std::optional<std::string> addr = flags.Get("addr");
  const std::optional<std::string> parent_path = flags.Get("parent");

  absl::StatusOr<std::unique_ptr<Pipeline>> pipeline = Pipeline::Create(policy);
  if (!pipeline.ok() && !addr) return Runtime(pipeline.status());
  absl::StatusOr<Turn> turn = ReadCompressInput(in, parent_path);
  if (!turn.ok()) return Runtime(turn.status());
  const DType dtype = turn->layers[0].prompt_k.dtype();

  absl::StatusOr<Compressed> c;
#ifdef KVRELAYCTL_WITH_RELAY
  if (addr) {
    KVRELAYCTL_DIAL(client, flags, *addr);
    absl::StatusOr<CompressedMessage> r = client->Compress(*turn, policy);
    if (!r.ok()) return RelayError("compress", r.status());
    c = Compressed{std::move(r->message), r->accounting.compress_seconds * 1e3};
  }
#endif
  if (!addr) c = CompressHere(**pipeline, *turn, !parent_path, threads);
  if (!c.ok()) return Runtime(c.status());
  Message& msg = c->message;
  // What the relay sends; with --decode the file itself holds dense tensors
  // and its metadata describes those.
  const uint64_t sent_bytes = msg.sent_bytes;
  const std::string wire = WireBytesField(msg);
  if (decode) {
    if (absl::Status s = DequantizeMessage(&msg, dtype); !s.ok()) return Runtime(s);
  }
  if (absl::Status s = WriteMessageFile(msg, out); !s.ok()) return Runtime(s);
  // threads: this process's workers; a relay's are its own.
  std::printf("policy=%s layers=%zu history=%d anchor=%d kept=%d gen=%d full_bytes=%" PRIu64 " sent_bytes=%" PRIu64
              "%s ratio=%s compress_ms=%.3f %s%s\n",
              msg.policy.c_str(), msg.layers.size(), msg.n_history, msg.n_anchor, msg.n_kept, msg.n_gen,
              msg.full_bytes, sent_bytes, wire.c_str(), Ratio(msg.full_bytes, sent_bytes).c_str(), c->ms,
              addr ? "relay=true" : absl::StrCat("threads=", threads).c_str(), decode ? " decoded=true" : "");
  return std::nullopt;
}

VerbSpec InspectSpec() { return {"FILE", {}}; }

Outcome Inspect(const Flags& flags) {
  if (flags.positional().size() != 1) {
    return Usage(absl::StrCat("inspect: expected one FILE argument, got ", flags.positional().size()));
  }
  const std::string& path = flags.positional()[0];
  absl::StatusOr<SafetensorsReader> file = SafetensorsReader::ReadFile(path);
  if (!file.ok()) return Runtime(file.status());
  if (IsMessageFile(*file)) {
    absl::StatusOr<Message> msg = MessageFromSafetensors(*file);
    if (!msg.ok()) return Runtime(absl::InvalidArgumentError(absl::StrCat(path, ": ", msg.status().message())));
    InspectMessage(path, *msg);
  } else {
    TurnFileOptions read;
    read.on_parent = true;  // a turn for a parent may carry history.score alone
    absl::StatusOr<Turn> turn = TurnFromSafetensors(*file, read);
    if (!turn.ok()) return Runtime(absl::InvalidArgumentError(absl::StrCat(path, ": ", turn.status().message())));
    InspectTurn(path, *turn);
  }
  return std::nullopt;
}

VerbSpec MakeTurnSpec() {
  std::vector<FlagSpec> flags = {RequiredFlag("out", "FILE", "where the turn goes")};
  AppendFlags(&flags, TurnGeometryFlagSpecs(SyntheticTurnOptions()));
  flags.push_back(ValueFlag("score-heads", "S", "query heads with attention scores; 0: as many as --kv-heads", "0"));
  flags.push_back(ValueFlag("history", "M", "history tokens", "0"));
  flags.push_back(ValueFlag("first-agent", "true|false",
                            "whether the turn is the first agent's; defaults to true when there is no history, "
                            "else false"));
  return {"", std::move(flags)};
}

Outcome MakeTurn(const Flags& flags) {
  if (Outcome f = NoPositional(flags)) return f;
  SyntheticTurnOptions o;
  KVRELAYCTL_FLAG(const std::string out, flags.Required("out"));
  if (Outcome f = ReadTurnGeometry(flags, &o)) return f;
  KVRELAYCTL_FLAG(o.score_heads, flags.Int("score-heads", 0, kMaxScoreHeads));
  KVRELAYCTL_FLAG(o.n_history, flags.Int("history", 0, 1 << 24));
  o.first_agent = o.n_history == 0;
  if (std::optional<std::string> v = flags.Get("first-agent")) {
    if (*v != "true" && *v != "false") {
      return Usage(absl::StrCat("flag --first-agent: \"", *v, "\", expected true or false"));
    }
    o.first_agent = *v == "true";
  }
  if (Outcome f = CheckTurnFlags(o)) return f;
  absl::StatusOr<Turn> turn = MakeSyntheticTurn(o);
  if (!turn.ok()) return Runtime(turn.status());
  if (absl::Status s = WriteTurnFile(*turn, out); !s.ok()) return Runtime(s);
  std::printf(
      "wrote %s: layers=%d kv_heads=%d score_heads=%d head_dim=%d history=%d prompt=%d "
      "gen=%d dtype=%s first_agent=%s seed=%" PRIu64 "%s\n",
      out.c_str(), o.layers, o.kv_heads, GeometryOf(*turn)->score_heads, o.head_dim, o.n_history, o.n_prompt,
      o.n_gen, std::string(DTypeName(o.dtype)).c_str(), o.first_agent ? "true" : "false", o.seed,
      o.queries ? " attention=gen.q" : "");
  return std::nullopt;
}

VerbSpec TokenSpec() { return {"new AGENT", {}}; }

Outcome Token(const Flags& flags) {
  const std::vector<std::string>& args = flags.positional();
  if (args.empty() || args[0] != "new") {
    const std::string got = args.empty() ? "missing verb," : absl::StrCat("unknown verb \"", args[0], "\",");
    return Usage(absl::StrCat("token: ", got, " expected \"token new AGENT\""));
  }
  if (args.size() != 2) {
    return Usage(absl::StrCat("token new: expected one AGENT argument, got ", args.size() - 1));
  }
  absl::StatusOr<std::string> token = NewToken();
  if (!token.ok()) return Runtime(token.status());
  absl::StatusOr<std::string> line = TokensFileLine(args[1], *token);
  if (!line.ok()) return Usage(absl::StrCat("token new: ", line.status().message()));
  std::printf("%s\n%s\n", token->c_str(), line->c_str());
  return std::nullopt;
}

}  // namespace kvrelay::ctl
