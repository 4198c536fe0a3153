#include "client/kvrelayctl/internal/common.h"

#include <cstdint>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/dtype.h"
#include "core/turn.h"

namespace kvrelay::ctl {

// The largest token count of any part a synthetic turn's flags accept.
constexpr int64_t kMaxTokens = 1 << 24;

std::string Ratio(uint64_t full, uint64_t sent) {
  return sent ? absl::StrFormat("%.3f", static_cast<double>(full) / sent) : "inf";
}

Outcome NoPositional(const Flags& flags) {
  if (!flags.positional().empty()) {
    return Usage(absl::StrCat(flags.verb(), ": unexpected argument \"", flags.positional()[0], "\""));
  }
  return std::nullopt;
}

void AppendFlags(std::vector<FlagSpec>* flags, std::vector<FlagSpec> rows) {
  for (FlagSpec& f : rows) flags->push_back(std::move(f));
}

std::vector<FlagSpec> ConnectFlagSpecs() {
  return {
      ValueFlag("tls-ca", "FILE",
                "turns TLS on: the relay's certificate must chain to the CA(s) in FILE (PEM) and name the "
                "address's host"),
      ValueFlag("tls-cert", "FILE", "a client certificate (PEM) for mTLS; needs --tls-key and --tls-ca"),
      ValueFlag("tls-key", "FILE", "the client certificate's key (PEM); needs --tls-cert"),
      ValueFlag("token-file", "FILE",
                "the agent's bearer token: the first line of FILE, whitespace trimmed (without it: "
                "$KVRELAY_TOKEN)"),
  };
}

std::vector<FlagSpec> TurnGeometryFlagSpecs(const SyntheticTurnOptions& d) {
  return {
      ValueFlag("layers", "L", "layers", absl::StrCat(d.layers)),
      ValueFlag("kv-heads", "H", "KV heads", absl::StrCat(d.kv_heads)),
      ValueFlag("head-dim", "D", "head dimension", absl::StrCat(d.head_dim)),
      ValueFlag("prompt", "N", "prompt tokens per turn", absl::StrCat(d.n_prompt)),
      ValueFlag("gen", "G", "generated tokens per turn", absl::StrCat(d.n_gen)),
      ValueFlag("dtype", "F32|F16|BF16", "K/V element type", std::string(DTypeName(d.dtype))),
      ValueFlag("seed", "X", "random seed", absl::StrCat(d.seed)),
      BoolFlag("queries", "the turn carries the generated steps' queries (gen.q) instead of attention scores"),
  };
}

Outcome ReadTurnGeometry(const Flags& flags, SyntheticTurnOptions* o) {
  KVRELAYCTL_FLAG(o->layers, flags.Int("layers", 1, kMaxLayers));
  KVRELAYCTL_FLAG(o->kv_heads, flags.Int("kv-heads", 1, kMaxKvHeads));
  KVRELAYCTL_FLAG(o->head_dim, flags.Int("head-dim", 1, kMaxHeadDim));
  KVRELAYCTL_FLAG(o->n_prompt, flags.Int("prompt", 0, kMaxTokens));
  KVRELAYCTL_FLAG(o->n_gen, flags.Int("gen", 0, kMaxTokens));
  KVRELAYCTL_FLAG(const int64_t seed, flags.Int("seed", 0, INT64_MAX));
  o->seed = static_cast<uint64_t>(seed);
  const std::string dtype = flags.Value("dtype").value_or("");
  std::optional<DType> dt = ParseDType(dtype);
  if (!dt) return Usage(absl::StrCat("flag --dtype: \"", dtype, "\", expected F32, F16 or BF16"));
  o->dtype = *dt;
  o->queries = flags.Has("queries");
  return std::nullopt;
}

Outcome CheckTurnFlags(const SyntheticTurnOptions& o) {
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

}  // namespace kvrelay::ctl
