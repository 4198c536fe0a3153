// kvrelayctl: offline compression and inspection of kvrelay turns and
// messages (docs/FORMAT.md).
//
// Exit status: 0 on success, 1 for runtime errors (bad files, bad policies,
// I/O), 2 for usage errors (unknown verb or flag, missing or malformed flag
// value). Errors go to stderr as "kvrelayctl: <message>".
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
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "core/format/safetensors.h"
#include "core/format/synthetic.h"
#include "core/format/turn_file.h"
#include "core/message.h"
#include "core/pipeline.h"
#include "core/quant.h"
#include "core/status_macros.h"
#include "core/thread_pool.h"
#include "core/turn.h"

namespace kvrelay {
namespace {

constexpr int kRuntimeError = 1;
constexpr int kUsageError = 2;

constexpr char kUsage[] = R"(usage: kvrelayctl <verb> [flags]

verbs:
  compress --policy SPEC --in TURN.safetensors --out MSG.safetensors
           [--decode] [--threads N]
      Compresses a turn with a pipeline spec (docs/FORMAT.md, e.g.
      "h2o-head:k=32+obf:p=8+int4:group=32") and writes the message.
      --decode writes quantized K/V decoded back to the turn's dtype.
      --threads defaults to the number of hardware threads.
      Prints one summary line: tokens per part, full bytes, sent bytes,
      ratio and compression time.

  inspect FILE
      Describes a turn or a message (detected by metadata
      format=kvrelay.message.v1): tokens and bytes of each part, and for
      messages full/sent bytes and the ratio.

  make-turn --out FILE [--layers L] [--kv-heads H] [--score-heads S]
            [--head-dim D] [--prompt N] [--gen G] [--history M]
            [--dtype F32|F16|BF16] [--seed X] [--first-agent true|false]
      Writes a synthetic turn (heavy-tailed scores, low-rank-plus-noise
      values). Defaults: 4 layers, 2 kv heads, score heads = kv heads,
      head dim 64, 128 prompt, 16 generated, 0 history tokens, BF16,
      seed 1, first agent true when there is no history, else false.

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
  Flags(std::string verb, std::set<std::string> valued, std::set<std::string> booleans)
      : verb_(std::move(verb)), valued_(std::move(valued)), booleans_(std::move(booleans)) {}

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
      if (!valued_.count(name)) return Usage(absl::StrCat("unknown flag --", name, " for ", verb_));
      if (!has_value) {
        if (i + 1 >= argc) return Usage(absl::StrCat("flag --", name, " needs a value"));
        value = argv[++i];
      }
      if (!values_.emplace(name, value).second) {
        return Usage(absl::StrCat("flag --", name, " given twice"));
      }
    }
    return std::nullopt;
  }

  bool Has(const std::string& name) const { return values_.count(name) || bools_.count(name); }
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
  std::set<std::string> valued_, booleans_;
  std::map<std::string, std::string> values_;
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

std::optional<Failure> Compress(int argc, char** argv) {
  Flags flags("compress", {"policy", "in", "out", "threads"}, {"decode"});
  if (auto f = flags.Parse(argc, argv)) return f;
  if (auto f = NoPositional(flags, "compress")) return f;
  KVRELAYCTL_FLAG(const std::string policy, flags.Required("policy"));
  KVRELAYCTL_FLAG(const std::string in, flags.Required("in"));
  KVRELAYCTL_FLAG(const std::string out, flags.Required("out"));
  KVRELAYCTL_FLAG(const int64_t threads,
                  flags.Int("threads", ThreadPool::HardwareThreads(), 1, 4096));
  const bool decode = flags.Has("decode");

  absl::StatusOr<std::unique_ptr<Pipeline>> pipeline = Pipeline::Create(policy);
  if (!pipeline.ok()) return Runtime(pipeline.status());
  absl::StatusOr<Turn> turn = ReadTurnFile(in);
  if (!turn.ok()) return Runtime(turn.status());
  const DType dtype = turn->layers[0].prompt_k.dtype();

  std::unique_ptr<ThreadPool> pool;
  if (threads > 1) pool = std::make_unique<ThreadPool>(static_cast<int>(threads));
  const auto start = std::chrono::steady_clock::now();
  // ReadTurnFile validated every value already.
  absl::StatusOr<Message> msg = (*pipeline)->CompressValidated(*turn, pool.get());
  const auto stop = std::chrono::steady_clock::now();
  if (!msg.ok()) return Runtime(msg.status());
  const double ms = std::chrono::duration<double, std::milli>(stop - start).count();
  // What the relay sends; with --decode the file itself holds dense tensors
  // and its metadata describes those.
  const uint64_t sent_bytes = msg->sent_bytes;
  if (decode) {
    absl::Status s = DequantizeMessage(&*msg, dtype);
    if (!s.ok()) return Runtime(s);
  }
  absl::Status s = WriteMessageFile(*msg, out);
  if (!s.ok()) return Runtime(s);
  std::printf("policy=%s layers=%zu history=%d anchor=%d kept=%d gen=%d full_bytes=%" PRIu64
              " sent_bytes=%" PRIu64 " ratio=%s compress_ms=%.3f threads=%d%s\n",
              msg->policy.c_str(), msg->layers.size(), msg->n_history, msg->n_anchor, msg->n_kept,
              msg->n_gen, msg->full_bytes, sent_bytes,
              Ratio(msg->full_bytes, sent_bytes).c_str(), ms, static_cast<int>(threads),
              decode ? " decoded=true" : "");
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
  std::printf("full_bytes: %" PRIu64 "\nsent_bytes: %" PRIu64 "\nratio: %s\n", msg.full_bytes,
              msg.sent_bytes, Ratio(msg.full_bytes, msg.sent_bytes).c_str());
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
    absl::StatusOr<Turn> turn = TurnFromSafetensors(*file);
    if (!turn.ok())
      return Runtime(absl::InvalidArgumentError(absl::StrCat(path, ": ", turn.status().message())));
    InspectTurn(path, *turn);
  }
  return std::nullopt;
}

std::optional<Failure> MakeTurn(int argc, char** argv) {
  Flags flags("make-turn",
              {"out", "layers", "kv-heads", "score-heads", "head-dim", "prompt", "gen", "history",
               "dtype", "seed", "first-agent"},
              {});
  if (auto f = flags.Parse(argc, argv)) return f;
  if (auto f = NoPositional(flags, "make-turn")) return f;
  constexpr int64_t kMax = 1 << 24;
  SyntheticTurnOptions o;
  KVRELAYCTL_FLAG(const std::string out, flags.Required("out"));
  KVRELAYCTL_FLAG(o.layers, flags.Int("layers", o.layers, 1, 4096));
  KVRELAYCTL_FLAG(o.kv_heads, flags.Int("kv-heads", o.kv_heads, 1, 4096));
  KVRELAYCTL_FLAG(o.score_heads, flags.Int("score-heads", 0, 0, 65536));
  KVRELAYCTL_FLAG(o.head_dim, flags.Int("head-dim", o.head_dim, 1, 65536));
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
  absl::StatusOr<Turn> turn = MakeSyntheticTurn(o);
  if (!turn.ok()) return Usage(std::string(turn.status().message()));
  absl::Status s = WriteTurnFile(*turn, out);
  if (!s.ok()) return Runtime(s);
  std::printf(
      "wrote %s: layers=%d kv_heads=%d score_heads=%d head_dim=%d history=%d prompt=%d "
      "gen=%d dtype=%s first_agent=%s seed=%" PRIu64 "\n",
      out.c_str(), o.layers, o.kv_heads, turn->layers[0].scores.rows, o.head_dim, o.n_history,
      o.n_prompt, o.n_gen, std::string(DTypeName(o.dtype)).c_str(),
      o.first_agent ? "true" : "false", o.seed);
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
  try {
    return kvrelay::Main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvrelayctl: internal error: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "kvrelayctl: internal error\n");
  }
  return 1;
}
