#include "core/pipeline.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <tuple>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/history.h"
#include "core/internal/cpu.h"
#include "core/internal/gather.h"
#include "core/internal/gram.h"
#include "core/internal/pipeline_checks.h"
#include "core/budget.h"
#include "core/lloyd.h"
#include "core/query_scores.h"
#include "core/status_macros.h"

namespace kvrelay {
namespace {

absl::Status BadStage(const StageSpec& st, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("policy stage '", st.name, "': ", what));
}

// Reads the parameters of one stage, rejecting unknown keys.
class Params {
 public:
  explicit Params(const StageSpec& st) : st_(st) {}

  absl::Status Int(absl::string_view key, int lo, int hi, int* out) {
    const std::string* v = Find(key);
    if (v == nullptr) return absl::OkStatus();
    int x;
    if (!absl::SimpleAtoi(*v, &x) || x < lo || x > hi) {
      return BadStage(st_, absl::StrCat(key, "=", *v, ": expected an integer in [", lo, ", ", hi, "]"));
    }
    *out = x;
    return absl::OkStatus();
  }

  // As Int, for an odd value in [lo, hi] (lo and hi odd).
  absl::Status OddInt(absl::string_view key, int lo, int hi, int* out) {
    const std::string* v = Find(key);
    if (v == nullptr) return absl::OkStatus();
    int x;
    if (!absl::SimpleAtoi(*v, &x) || x < lo || x > hi || x % 2 == 0) {
      return BadStage(st_, absl::StrCat(key, "=", *v, ": expected an odd integer in [", lo, ", ", hi, "]"));
    }
    *out = x;
    return absl::OkStatus();
  }

  // A decimal uint64.
  absl::Status Uint64(absl::string_view key, uint64_t* out) {
    const std::string* v = Find(key);
    if (v == nullptr) return absl::OkStatus();
    uint64_t x;
    if (!absl::SimpleAtoi(*v, &x) || v->empty() || (*v)[0] == '+' || (*v)[0] == '-') {
      return BadStage(st_, absl::StrCat(key, "=", *v, ": expected an integer in [0, 18446744073709551615]"));
    }
    *out = x;
    return absl::OkStatus();
  }

  // A finite decimal number in [lo, hi].
  absl::Status Double(absl::string_view key, double lo, double hi, double* out) {
    const std::string* v = Find(key);
    if (v == nullptr) return absl::OkStatus();
    double x;
    if (!absl::SimpleAtod(*v, &x) || !std::isfinite(x) || x < lo || x > hi) {
      return BadStage(st_, absl::StrCat(key, "=", *v, ": expected a decimal number in [", lo, ", ", hi, "]"));
    }
    *out = x;
    return absl::OkStatus();
  }

  template <typename E>
  absl::Status Enum(absl::string_view key, std::initializer_list<std::pair<const char*, E>> values,
                    E* out) {
    const std::string* v = Find(key);
    if (v == nullptr) return absl::OkStatus();
    std::vector<std::string> names;
    for (const auto& [name, e] : values) {
      if (*v == name) {
        *out = e;
        return absl::OkStatus();
      }
      names.push_back(name);
    }
    return BadStage(st_, absl::StrCat(key, "=", *v, ": expected one of ", absl::StrJoin(names, ", ")));
  }

  // The value as given (empty when absent).
  std::string String(absl::string_view key) {
    const std::string* v = Find(key);
    return v == nullptr ? std::string() : *v;
  }

  // Call after reading every known key.
  absl::Status Done() const {
    for (const auto& [k, v] : st_.params) {
      if (std::find(used_.begin(), used_.end(), k) == used_.end()) {
        return BadStage(st_, absl::StrCat("unknown parameter '", k, "'",
                                          used_.empty() ? " (this stage takes none)"
                                                        : absl::StrCat(" (known: ", absl::StrJoin(used_, ", "), ")")));
      }
    }
    return absl::OkStatus();
  }

 private:
  const std::string* Find(absl::string_view key) {
    used_.emplace_back(key);
    for (const auto& [k, v] : st_.params) {
      if (k == key) return &v;
    }
    return nullptr;
  }

  const StageSpec& st_;
  std::vector<std::string> used_;
};

constexpr int kMaxTokens = 1 << 24;

// Whether the layer's caller has gone (LayerContext::cancelled).
bool IsCancelled(const LayerContext& ctx) {
  return ctx.cancelled != nullptr && ctx.cancelled->load(std::memory_order_relaxed);
}

absl::Status CheckCancelled(const LayerContext& ctx) {
  if (!IsCancelled(ctx)) return absl::OkStatus();
  return absl::CancelledError(absl::StrCat("layer ", ctx.layer, ": cancelled"));
}

// The logit scale for scores from queries: the context's, or 1/sqrt(d).
double SoftmaxScaleOf(const LayerContext& ctx, int head_dim) {
  return ctx.softmax_scale > 0 ? ctx.softmax_scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
}

constexpr char kInvariantPayload[] = "type.kvrelay.dev/pipeline-invariant";

// Internal with `message`, marked as a broken invariant.
absl::Status Broken(std::string message) {
  absl::Status s = absl::InternalError(message);
  s.SetPayload(kInvariantPayload, absl::Cord("1"));
  return s;
}

// Broken: "layer.L: pipeline invariant violated: " and `what`.
template <typename... Args>
absl::Status Violation(int layer, const Args&... what) {
  return Broken(absl::StrCat("layer.", layer, ": pipeline invariant violated: ", what...));
}

// `s` with "layer.<layer>." before its message (the core's functions name
// tensors of one layer).
absl::Status PrefixLayer(const absl::Status& s, int layer) {
  return absl::Status(s.code(), absl::StrCat("layer.", layer, ".", s.message()));
}

// InvalidArgument naming the scores a non-finite accumulated importance
// came from: tokens [0, hist_end) of each head are the history's (its
// history.acc plus history.score, or plus the mass from gen.q),
// [hist_end, prompt_end) the prompt's (prompt.score summed over a group's
// score heads, or gen.q), the rest the generated tokens' (gen.q). A float32
// sum of finite scores can still overflow.
absl::Status CheckAccFinite(const std::vector<float>& acc, int n, int hist_end, int prompt_end, int layer,
                            bool queries) {
  if (!internal::FiniteChecksOn() || AllFiniteNonNegative(acc.data(), acc.size())) return absl::OkStatus();
  for (size_t i = 0; i < acc.size(); ++i) {
    if (std::isfinite(acc[i]) && acc[i] >= 0) continue;
    const int h = static_cast<int>(i / n), t = static_cast<int>(i % n);
    const char* part = queries ? "gen.q" : "prompt.score";
    if (t < hist_end) part = queries ? "history.acc" : "history.acc + history.score";
    return absl::InvalidArgumentError(absl::StrCat(
        "layer.", layer, ".", part, ": the accumulated importance of token ", t, " of KV head ", h, " is ", acc[i],
        " in float32 (the sum over the group's score heads overflows), expected scores whose sums stay below 3.4e38"));
  }
  return absl::OkStatus();
}

bool IsH2o(SelectorKind k) {
  return k == SelectorKind::kH2oHead || k == SelectorKind::kH2oLayer || k == SelectorKind::kH2oAuto;
}

// The shortest decimal that reads back as `x`.
std::string ShortestDecimal(double x) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, x);
  return std::string(buf, r.ptr);
}

absl::Status ApplySelector(SelectorKind kind, const StageSpec& st, PipelineConfig* cfg) {
  SelectorOptions o;
  o.kind = kind;
  Params p(st);
  if (kind == SelectorKind::kGen || IsH2o(kind)) {
    KVRELAY_RETURN_IF_ERROR(p.Int("sinks", 0, kMaxTokens, &o.sinks));
  }
  if (IsH2o(kind)) {
    KVRELAY_RETURN_IF_ERROR(p.Int("k", 0, kMaxTokens, &o.k));
    KVRELAY_RETURN_IF_ERROR(p.Int("recent", 0, kMaxTokens, &o.recent));
    // Any width past 2 * kMaxTokens - 1 pools over the whole top-k range.
    KVRELAY_RETURN_IF_ERROR(p.OddInt("pool", 1, 2 * kMaxTokens + 1, &o.pool));
    KVRELAY_RETURN_IF_ERROR(p.Int("window", 1, kMaxTokens, &o.window));
    KVRELAY_RETURN_IF_ERROR(p.Int("hist", 0, kMaxTokens, &o.hist));
  }
  if (kind == SelectorKind::kH2oAuto) KVRELAY_RETURN_IF_ERROR(p.Double("tau", 0, 1, &o.tau));
  KVRELAY_RETURN_IF_ERROR(p.Done());
  cfg->select = o;
  return absl::OkStatus();
}

absl::Status ApplyObf(const StageSpec& st, PipelineConfig* cfg) {
  ObfOptions o;
  Params p(st);
  KVRELAY_RETURN_IF_ERROR(p.Int("p", 1, 4096, &o.p));
  KVRELAY_RETURN_IF_ERROR(p.Enum("mode", {{"exact", ObfMode::kExact}, {"fast", ObfMode::kFast}}, &o.mode));
  KVRELAY_RETURN_IF_ERROR(
      p.Enum("inject", {{"uniform", InjectMode::kUniform}, {"attn", InjectMode::kAttn}}, &o.inject));
  KVRELAY_RETURN_IF_ERROR(p.Enum("scale",
                                 {{"ad_over_as", ScaleMode::kAdOverAs},
                                  {"ad_frac", ScaleMode::kAdFrac},
                                  {"ad", ScaleMode::kAd},
                                  {"none", ScaleMode::kNone}},
                                 &o.scale));
  KVRELAY_RETURN_IF_ERROR(p.Int("iters", 1, 1000, &o.iters));
  KVRELAY_RETURN_IF_ERROR(p.Int("oversample", 0, 4096, &o.oversample));
  KVRELAY_RETURN_IF_ERROR(p.Done());
  if (o.mode == ObfMode::kExact) {
    for (const char* fast_only : {"iters", "oversample"}) {
      const auto& ps = st.params;
      if (std::any_of(ps.begin(), ps.end(), [fast_only](const auto& kv) { return kv.first == fast_only; })) {
        return BadStage(st, absl::StrCat(fast_only, ": applies to mode=fast only, expected mode=fast or no ",
                                         fast_only));
      }
    }
  }
  cfg->obf = o;
  return absl::OkStatus();
}

absl::Status ApplyDemote(const StageSpec& st, PipelineConfig* cfg) {
  int bits = 2;
  Params p(st);
  KVRELAY_RETURN_IF_ERROR(p.Int("bits", 1, 4, &bits));
  KVRELAY_RETURN_IF_ERROR(p.Done());
  cfg->demote_bits = bits;
  return absl::OkStatus();
}

absl::Status ApplyLloyd(const StageSpec& st, PipelineConfig* cfg) {
  QuantOptions o;
  o.scheme = QuantScheme::kLloyd;
  o.bits = 4;
  o.seed = kDefaultLloydSeed;
  Params p(st);
  KVRELAY_RETURN_IF_ERROR(p.Int("bits", 1, 4, &o.bits));
  KVRELAY_RETURN_IF_ERROR(p.Enum("keys", {{"row", false}, {"channel", true}}, &o.keys_channel));
  const bool has_group = st.Has("group");
  KVRELAY_RETURN_IF_ERROR(p.Int("group", 1, kMaxTokens, &o.group));
  KVRELAY_RETURN_IF_ERROR(p.Uint64("seed", &o.seed));
  const std::string layers = p.String("layers");
  KVRELAY_RETURN_IF_ERROR(p.Done());
  if (has_group && !o.keys_channel) return BadStage(st, "group: applies to keys=channel only, expected keys=channel or no group");
  const bool has_layers = st.Has("layers");
  if (has_layers && st.Has("bits")) {
    return BadStage(st, "bits: given with layers=, expected one of them (layers= gives every layer its bits)");
  }
  if (has_layers) {
    absl::StatusOr<std::vector<std::pair<int, int>>> bits = ParseLayerBits(layers);
    if (!bits.ok()) return BadStage(st, absl::StrCat("layers=", layers, ": ", bits.status().message()));
    cfg->layer_bits = *std::move(bits);
  }
  cfg->quant = o;
  return absl::OkStatus();
}

absl::Status ApplyAuto(const StageSpec& st, PipelineConfig* cfg) {
  double budget = 0;
  Params p(st);
  const bool given = st.Has("budget");
  KVRELAY_RETURN_IF_ERROR(p.Double("budget", 1e-6, 1, &budget));
  KVRELAY_RETURN_IF_ERROR(
      p.Enum("weight", {{"attention", BudgetWeight::kAttention}, {"uniform", BudgetWeight::kUniform}},
             &cfg->budget_weight));
  KVRELAY_RETURN_IF_ERROR(p.Done());
  if (!given) return BadStage(st, "budget: missing, expected budget=F with F in [1e-06, 1], e.g. auto:budget=0.1");
  cfg->budget = budget;
  return absl::OkStatus();
}

absl::Status ApplyQuant(int bits, const StageSpec& st, PipelineConfig* cfg) {
  QuantOptions o;
  o.bits = bits;
  Params p(st);
  KVRELAY_RETURN_IF_ERROR(p.Int("group", 1, kMaxTokens, &o.group));
  KVRELAY_RETURN_IF_ERROR(p.Enum("rotate", {{"none", false}, {"hadamard", true}}, &o.rotate));
  KVRELAY_RETURN_IF_ERROR(p.Done());
  if (o.rotate && bits == 8) {
    return BadStage(st, "rotate=hadamard applies to int4 and int2 only");
  }
  cfg->quant = o;
  return absl::OkStatus();
}

const char* SelectorName(SelectorKind k) {
  switch (k) {
    case SelectorKind::kFull: return "full";
    case SelectorKind::kGen: return "gen";
    case SelectorKind::kH2oLayer: return "h2o-layer";
    case SelectorKind::kH2oHead: return "h2o-head";
    case SelectorKind::kH2oAuto: return "h2o-auto";
  }
  return "?";
}

std::string CanonicalSpec(const PipelineConfig& c) {
  if (c.budget) {
    return absl::StrCat("auto:budget=", ShortestDecimal(*c.budget),
                        c.budget_weight == BudgetWeight::kUniform ? ",weight=uniform" : "");
  }
  const SelectorOptions& s = c.select;
  std::string out = SelectorName(s.kind);
  if (s.kind == SelectorKind::kGen) absl::StrAppend(&out, ":sinks=", s.sinks);
  if (IsH2o(s.kind)) {
    absl::StrAppend(&out, ":k=", s.k, ",sinks=", s.sinks, ",recent=", s.recent);
    if (s.kind == SelectorKind::kH2oAuto) absl::StrAppend(&out, ",tau=", ShortestDecimal(s.tau));
    // pool=1 (no pooling) is left out, so specs from before pool existed
    // keep their canonical form.
    if (s.pool != 1) absl::StrAppend(&out, ",pool=", s.pool);
    if (s.window != 0) absl::StrAppend(&out, ",window=", s.window);
    if (s.hist >= 0) absl::StrAppend(&out, ",hist=", s.hist);
  }
  if (c.obf) {
    const ObfOptions& o = *c.obf;
    static const char* kInject[] = {"uniform", "attn"};
    static const char* kScale[] = {"ad_over_as", "ad_frac", "ad", "none"};
    absl::StrAppend(&out, "+obf:p=", o.p, ",mode=", o.mode == ObfMode::kExact ? "exact" : "fast",
                    ",inject=", kInject[static_cast<int>(o.inject)], ",scale=",
                    kScale[static_cast<int>(o.scale)]);
    if (o.mode == ObfMode::kFast) absl::StrAppend(&out, ",iters=", o.iters, ",oversample=", o.oversample);
  }
  if (c.demote_bits) absl::StrAppend(&out, "+demote:bits=", *c.demote_bits);
  if (c.quant && c.quant->scheme == QuantScheme::kLloyd) {
    absl::StrAppend(&out, "+lloyd:");
    if (c.layer_bits.empty()) absl::StrAppend(&out, "bits=", c.quant->bits, ",");
    absl::StrAppend(&out, "keys=", c.quant->keys_channel ? "channel" : "row");
    if (c.quant->keys_channel) absl::StrAppend(&out, ",group=", c.quant->group);
    absl::StrAppend(&out, ",seed=", c.quant->seed);
    if (!c.layer_bits.empty()) {
      absl::StrAppend(&out, ",layers=", FormatLayerBits(c.layer_bits));
    }
  } else if (c.quant) {
    absl::StrAppend(&out, "+int", c.quant->bits, ":group=", c.quant->group,
                    ",rotate=", c.quant->rotate ? "hadamard" : "none");
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<StageSpec>> SplitSpec(absl::string_view spec) {
  std::vector<StageSpec> stages;
  if (spec.empty()) return absl::InvalidArgumentError("policy: empty spec, expected e.g. 'h2o-head:k=32'");
  if (spec.size() > kMaxSpecBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy: ", spec.size(), " bytes, expected at most ", kMaxSpecBytes));
  }
  for (size_t i = 0; i < spec.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(spec[i]);
    if (c <= ' ' || c >= 0x7f) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "policy: byte %d is %s (0x%02x), expected printable ASCII without spaces, e.g. 'h2o-head:k=32+obf:p=8'", i,
          c == ' ' ? "a space" : "not printable ASCII", c));
    }
  }
  int index = 0;
  for (absl::string_view token : absl::StrSplit(spec, '+')) {
    ++index;
    if (token.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("policy '", spec, "': stage ", index, " is empty, expected name[:key=value,...]"));
    }
    StageSpec st;
    const size_t colon = token.find(':');
    st.name = std::string(token.substr(0, colon));
    if (st.name.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("policy stage '", token, "': missing stage name"));
    }
    if (colon != absl::string_view::npos) {
      for (absl::string_view kv : absl::StrSplit(token.substr(colon + 1), ',')) {
        const size_t eq = kv.find('=');
        if (eq == absl::string_view::npos || eq == 0) {
          return absl::InvalidArgumentError(absl::StrCat("policy stage '", token, "': parameter '", kv,
                                                         "', expected key=value"));
        }
        std::string key(kv.substr(0, eq));
        for (const auto& [k, v] : st.params) {
          if (k == key) {
            return absl::InvalidArgumentError(
                absl::StrCat("policy stage '", token, "': parameter '", key, "' given twice"));
          }
        }
        st.params.emplace_back(std::move(key), std::string(kv.substr(eq + 1)));
      }
    }
    stages.push_back(std::move(st));
  }
  return stages;
}

absl::Status Registry::Register(std::string name, Kind kind, Apply apply) {
  if (stages_.count(name)) return absl::AlreadyExistsError(absl::StrCat("stage '", name, "' already registered"));
  stages_.emplace(std::move(name), std::make_pair(kind, std::move(apply)));
  return absl::OkStatus();
}

const std::pair<Registry::Kind, Registry::Apply>* Registry::Find(absl::string_view name) const {
  auto it = stages_.find(name);
  return it == stages_.end() ? nullptr : &it->second;
}

std::vector<std::string> Registry::Names() const {
  std::vector<std::string> names;
  for (const auto& [name, unused] : stages_) names.push_back(name);
  return names;
}

const Registry& Registry::Builtin() {
  static const Registry* registry = [] {
    auto* r = new Registry;
    absl::Status s = RegisterBuiltins(r);
    (void)s;  // Only fails on duplicate names, impossible for a fresh registry.
    return r;
  }();
  return *registry;
}

absl::Status RegisterBuiltins(Registry* r) {
  using K = Registry::Kind;
  for (auto [name, kind] : {std::pair<const char*, SelectorKind>{"full", SelectorKind::kFull},
                            {"gen", SelectorKind::kGen},
                            {"h2o-layer", SelectorKind::kH2oLayer},
                            {"h2o-head", SelectorKind::kH2oHead},
                            {"h2o-auto", SelectorKind::kH2oAuto}}) {
    KVRELAY_RETURN_IF_ERROR(r->Register(name, K::kSelector, [kind = kind](const StageSpec& st, PipelineConfig* c) {
      return ApplySelector(kind, st, c);
    }));
  }
  KVRELAY_RETURN_IF_ERROR(r->Register("obf", K::kTransform, ApplyObf));
  KVRELAY_RETURN_IF_ERROR(r->Register("demote", K::kTransform, ApplyDemote));
  KVRELAY_RETURN_IF_ERROR(r->Register("lloyd", K::kQuantizer, ApplyLloyd));
  KVRELAY_RETURN_IF_ERROR(r->Register("auto", K::kSelector, ApplyAuto));
  for (int bits : {8, 4, 2}) {
    KVRELAY_RETURN_IF_ERROR(r->Register(absl::StrCat("int", bits), K::kQuantizer,
                                        [bits](const StageSpec& st, PipelineConfig* c) {
                                          return ApplyQuant(bits, st, c);
                                        }));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Pipeline>> Pipeline::Create(absl::string_view spec,
                                                           const Registry& registry) {
  KVRELAY_ASSIGN_OR_RETURN(std::vector<StageSpec> stages, SplitSpec(spec));
  PipelineConfig cfg;
  bool have_selector = false;
  for (size_t i = 0; i < stages.size(); ++i) {
    const StageSpec& st = stages[i];
    const auto* entry = registry.Find(st.name);
    if (entry == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("policy stage '", st.name, "': unknown stage, expected one of ",
                                                     absl::StrJoin(registry.Names(), ", ")));
    }
    const Registry::Kind kind = entry->first;
    if (kind == Registry::Kind::kSelector) {
      if (have_selector) return BadStage(st, "a second selector; a policy has exactly one, first");
      if (i != 0) return BadStage(st, "the selector must be the first stage");
      have_selector = true;
    } else if (!have_selector) {
      return BadStage(st, "must follow a selector (full, gen, h2o-layer, h2o-head, h2o-auto)");
    } else if (cfg.budget) {
      return BadStage(st, "after auto, which chooses the whole policy: give auto:budget=F alone");
    }
    if (kind == Registry::Kind::kTransform) {
      if (cfg.obf || cfg.demote_bits) {
        const bool same = st.name == (cfg.obf ? "obf" : "demote");
        if (same) return BadStage(st, "given twice");
        return BadStage(st, "obf and demote exclude each other: obf backfills what the selector evicts, demote "
                            "evicts nothing (keep one)");
      }
      if (cfg.quant) return BadStage(st, "must come before the quantizer");
      if (!IsH2o(cfg.select.kind)) {
        return BadStage(st, st.name == "obf"
                                ? "needs h2o-layer, h2o-head or h2o-auto before it (full and gen delete no "
                                  "candidate to backfill)"
                                : "needs h2o-layer, h2o-head or h2o-auto before it (full and gen select no "
                                  "candidates to demote)");
      }
    }
    if (kind == Registry::Kind::kQuantizer && cfg.quant) {
      return BadStage(st, "a second quantizer; at most one is allowed");
    }
    KVRELAY_RETURN_IF_ERROR(entry->second(st, &cfg));
  }
  std::string canonical = CanonicalSpec(cfg);
  return std::unique_ptr<Pipeline>(new Pipeline(std::move(canonical), std::move(cfg)));
}

uint64_t PipelineConfig::LloydSeed() const {
  return quant && quant->scheme == QuantScheme::kLloyd ? quant->seed : kDefaultLloydSeed;
}

std::vector<int32_t> AnchorPositions(const TurnGeometry& geo, int n_anchor, int64_t prompt_pos0) {
  std::vector<int32_t> out = geo.history_anchors;  // all below prompt_pos0
  for (int j = 0; j < n_anchor; ++j) out.push_back(static_cast<int32_t>(prompt_pos0 + j));
  return out;
}

uint64_t FullLayerBytes(const TurnGeometry& geo) {
  const uint64_t tokens = static_cast<uint64_t>(geo.n_history) + geo.n_prompt + geo.n_gen;
  return tokens * geo.kv_heads * (2ull * geo.head_dim * DTypeSize(geo.dtype) + 4);
}

void Pipeline::CountTokens(const TurnGeometry& geo, bool first_agent, Message* msg) const {
  const SelectorOptions& s = config_.select;
  msg->n_history = geo.n_history;
  if (IsH2o(s.kind) && s.hist >= 0) {
    msg->n_history = static_cast<int>(
        std::min<int64_t>(geo.n_history, static_cast<int64_t>(geo.history_anchors.size()) + s.hist));
  }
  msg->n_gen = geo.n_gen;
  msg->n_anchor = first_agent ? std::min(s.sinks, geo.n_prompt) : 0;
  const int n_cand = geo.n_prompt - msg->n_anchor;
  switch (s.kind) {
    case SelectorKind::kFull: msg->n_kept = n_cand; break;
    case SelectorKind::kGen: msg->n_kept = 0; break;
    default: {
      const int recent = std::min(s.recent, n_cand);
      msg->n_kept = std::min(s.k, n_cand - recent) + recent;
    }
  }
  msg->n_demoted = config_.demote_bits ? n_cand - msg->n_kept : 0;
  msg->demote_bits = msg->n_demoted > 0 ? *config_.demote_bits : 0;
}

// One layer in flight: what selection decided, and the output being built.
struct Pipeline::LayerWork {
  std::vector<double> scores;  // [kv_heads, n_prompt]
  Selection sel;
  int kept_begin = 0;          // token index of the first kept candidate in `out`
  MessageLayer out;
  KvTensor demoted_k, demoted_v;  // the demoted candidates' rows, dense, until FinishLayer
  std::vector<absl::Status> head_status;
};

absl::Status Pipeline::ScoreLayer(const TurnLayer& layer, const TurnGeometry& geo, const LayerContext& ctx,
                                  LayerWork* w, std::vector<double>* hist_mass, std::vector<double>* gen_mass) const {
  const int heads = geo.kv_heads, d = geo.head_dim, n_prompt = geo.n_prompt;
  const int n_hist = geo.n_history, n_gen = geo.n_gen;
  hist_mass->assign(static_cast<size_t>(heads) * n_hist, 0.0);
  gen_mass->assign(static_cast<size_t>(heads) * n_gen, 0.0);
  if (!geo.queries) {
    w->scores = ReduceScores(layer.scores, heads);
    if (geo.history_score) *hist_mass = ReduceScores(layer.history_score, heads);
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<double>> all =
      QueryMass(layer, geo, SoftmaxScaleOf(ctx, d), config_.select.window, ctx.cancelled);
  if (!all.ok()) return PrefixLayer(all.status(), ctx.layer);
  const std::vector<double>& mass = *all;
  const size_t m = static_cast<size_t>(n_hist) + n_prompt + n_gen;
  w->scores.resize(static_cast<size_t>(heads) * n_prompt);
  for (int h = 0; h < heads; ++h) {
    auto row = mass.begin() + h * m;
    std::copy_n(row, n_hist, hist_mass->begin() + static_cast<size_t>(h) * n_hist);
    std::copy_n(row + n_hist, n_prompt, w->scores.begin() + static_cast<size_t>(h) * n_prompt);
    std::copy_n(row + n_hist + n_prompt, n_gen, gen_mass->begin() + static_cast<size_t>(h) * n_gen);
  }
  return absl::OkStatus();
}

namespace {

// The history's acc after this turn (its acc so far plus this turn's mass
// on it), into *hist_acc, and per head the history rows that `opts`' budget
// keeps (every row without one), anchors always.
std::vector<std::vector<int>> KeptHistory(const TurnLayer& layer, const TurnGeometry& geo,
                                          const SelectorOptions& opts, const std::vector<double>& hist_mass,
                                          std::vector<float>* hist_acc) {
  hist_acc->resize(hist_mass.size());
  for (size_t i = 0; i < hist_acc->size(); ++i) {
    const double before = geo.history_acc ? layer.history_acc.data[i] : 0.0;
    (*hist_acc)[i] = static_cast<float>(before + hist_mass[i]);
  }
  // The anchors are almost always one run of positions: then a range test
  // per token, else a search.
  const std::vector<int32_t>& anchors = geo.history_anchors;
  std::vector<uint8_t> is_anchor(hist_acc->size(), 0);
  const int32_t* pos = layer.history_pos.data.data();
  if (!anchors.empty() &&
      int64_t{anchors.back()} - anchors.front() + 1 == static_cast<int64_t>(anchors.size())) {
    const int32_t lo = anchors.front(), hi = anchors.back();
    for (size_t i = 0; i < is_anchor.size(); ++i) is_anchor[i] = (pos[i] >= lo) & (pos[i] <= hi);
  } else if (!anchors.empty()) {
    for (size_t i = 0; i < is_anchor.size(); ++i) {
      is_anchor[i] = std::binary_search(anchors.begin(), anchors.end(), pos[i]);
    }
  }
  return SelectHistory(*hist_acc, is_anchor, geo.kv_heads, geo.n_history, IsH2o(opts.kind) ? opts.hist : -1,
                       opts.kind == SelectorKind::kH2oHead);
}

}  // namespace

// Where one layer's rows go: history kept, anchors, prompt kept, generated
// (n_out, in out.k/v), then the demoted candidates (n_dem, in demoted_k/v).
struct Pipeline::RowPlan {
  int n_hist_out = 0, n_anchor = 0, n_out = 0, n_dem = 0, n_total = 0;
  int32_t pos0 = 0;
};

absl::Status Pipeline::SelectAndCopy(const TurnLayer& layer, const TurnGeometry& geo, const LayerContext& ctx,
                                     LayerWork* w) const {
  const int heads = geo.kv_heads, d = geo.head_dim, n_prompt = geo.n_prompt;
  // The attention mass on every token of the cache: the prompt's is the
  // selection score; the history's and the generated tokens' feed acc.
  std::vector<double> hist_mass, gen_mass;
  KVRELAY_RETURN_IF_ERROR(ScoreLayer(layer, geo, ctx, w, &hist_mass, &gen_mass));
  SelectorOptions opts = config_.select;
  if (opts.kind == SelectorKind::kH2oAuto) {
    const int n_anchor = ctx.first_agent ? std::min(opts.sinks, n_prompt) : 0;
    const bool per_head = AutoPicksHead(w->scores, heads, n_prompt, n_anchor, opts.tau);
    opts.kind = per_head ? SelectorKind::kH2oHead : SelectorKind::kH2oLayer;
    w->out.granularity = per_head ? Granularity::kHead : Granularity::kLayer;
  }
  w->sel = Select(opts, w->scores, heads, n_prompt, ctx.first_agent);
  std::vector<float> hist_acc;
  const std::vector<std::vector<int>> kept_hist = KeptHistory(layer, geo, opts, hist_mass, &hist_acc);

  // Every buffer below is sized from head 0: every head must keep as many.
  // Never switched off: this is what keeps the copy inside the buffers.
  for (int h = 1; h < heads; ++h) {
    if (w->sel.kept[h].size() != w->sel.kept[0].size() || kept_hist[h].size() != kept_hist[0].size()) {
      return Violation(ctx.layer, "head ", h, " keeps ", w->sel.kept[h].size(), " prompt and ", kept_hist[h].size(),
                       " history tokens, head 0 keeps ", w->sel.kept[0].size(), " and ", kept_hist[0].size(),
                       "; expected the same count in every head");
    }
  }
  RowPlan plan;
  plan.n_anchor = w->sel.n_anchor;
  plan.n_hist_out = static_cast<int>(kept_hist[0].size());
  plan.n_out = plan.n_hist_out + plan.n_anchor + static_cast<int>(w->sel.kept[0].size()) + geo.n_gen;
  // Demotion keeps the candidates the selection drops: the same count in
  // every head, since every head keeps as many.
  plan.n_dem = config_.demote_bits ? n_prompt - plan.n_anchor - static_cast<int>(w->sel.kept[0].size()) : 0;
  plan.n_total = plan.n_out + plan.n_dem;
  plan.pos0 = static_cast<int32_t>(ctx.prompt_pos0);
  w->kept_begin = plan.n_hist_out + plan.n_anchor;
  w->head_status.assign(heads, absl::OkStatus());
  MessageLayer& out = w->out;
  out.k = KvTensor::Uninitialized(geo.dtype, heads, plan.n_out, d);
  out.v = KvTensor::Uninitialized(geo.dtype, heads, plan.n_out, d);
  out.pos = PosTensor(heads, plan.n_total);
  out.acc.resize(static_cast<size_t>(heads) * plan.n_total);
  if (plan.n_dem > 0) {
    w->demoted_k = KvTensor::Uninitialized(geo.dtype, heads, plan.n_dem, d);
    w->demoted_v = KvTensor::Uninitialized(geo.dtype, heads, plan.n_dem, d);
  }
  for (int h = 0; h < heads; ++h) {
    KVRELAY_RETURN_IF_ERROR(CopyHead(layer, geo, ctx, plan, kept_hist[h], hist_acc, gen_mass, h, w));
  }
  return CheckAccFinite(out.acc, plan.n_total, plan.n_hist_out, w->kept_begin + static_cast<int>(w->sel.kept[0].size()),
                        ctx.layer, geo.queries);
}

absl::Status Pipeline::CopyHead(const TurnLayer& layer, const TurnGeometry& geo, const LayerContext& ctx,
                                const RowPlan& plan, const std::vector<int>& kept_hist,
                                const std::vector<float>& hist_acc, const std::vector<double>& gen_mass, int h,
                                LayerWork* w) const {
  const int n_prompt = geo.n_prompt, n_hist = geo.n_history, n_gen = geo.n_gen;
  const int n_anchor = plan.n_anchor, n_total = plan.n_total;
  const int32_t pos0 = plan.pos0;
  MessageLayer& out = w->out;
  // The rows to gather in output order, then copied.
  thread_local std::vector<internal::RowSource> src;
  using KvPair = std::pair<const KvTensor*, const KvTensor*>;
  src.clear();
  int32_t* pos = out.pos.data.data() + static_cast<size_t>(h) * n_total;
  float* acc = out.acc.data() + static_cast<size_t>(h) * n_total;
  int t = 0;
  auto add = [&](const KvPair& kv, int row, int32_t p, float a) {
    src.push_back({kv.first, kv.second, row});
    pos[t] = p;
    acc[t] = a;
    ++t;
  };
  const KvPair hist{&layer.history_k, &layer.history_v}, prompt{&layer.prompt_k, &layer.prompt_v},
      gen{&layer.gen_k, &layer.gen_v};
  const double* a = w->scores.data() + static_cast<size_t>(h) * n_prompt;
  for (int j : kept_hist) add(hist, j, layer.history_pos.at(h, j), hist_acc[static_cast<size_t>(h) * n_hist + j]);
  for (int j = 0; j < n_anchor; ++j) add(prompt, j, pos0 + j, static_cast<float>(a[j]));
  for (int j : w->sel.kept[h]) add(prompt, j, pos0 + j, static_cast<float>(a[j]));
  for (int j = 0; j < n_gen; ++j) {
    add(gen, j, pos0 + n_prompt + j, static_cast<float>(gen_mass[static_cast<size_t>(h) * n_gen + j]));
  }
  internal::GatherHeadRows(src, h, &out.k, &out.v);
  if (plan.n_dem == 0) return absl::OkStatus();
  src.clear();
  const std::vector<int>& kept = w->sel.kept[h];
  size_t next_kept = 0;
  for (int j = n_anchor; j < n_prompt; ++j) {
    if (next_kept < kept.size() && kept[next_kept] == j) {
      ++next_kept;
      continue;
    }
    add(prompt, j, pos0 + j, static_cast<float>(a[j]));
  }
  if (t != n_total) {
    return Violation(ctx.layer, "head ", h, " demotes ", t - plan.n_out, " tokens, expected ", plan.n_dem);
  }
  internal::GatherHeadRows(src, h, &w->demoted_k, &w->demoted_v);
  return absl::OkStatus();
}

void Pipeline::BackfillHead(const TurnLayer& layer, const TurnGeometry& geo, const LayerContext& ctx,
                            int h, LayerWork* w) const {
  const int d = geo.head_dim, n_prompt = geo.n_prompt;
  const int n_anchor = w->sel.n_anchor;
  const std::vector<int>& kept = w->sel.kept[h];
  const int n_kept = static_cast<int>(kept.size());
  if (!config_.obf || n_kept == 0) return;
  const int n_cand = n_prompt - n_anchor;
  // Per-thread: a fresh buffer this size per head costs page faults.
  thread_local std::vector<float> v;
  v.resize(static_cast<size_t>(n_cand) * d);
  layer.prompt_v.ReadRows(h, n_anchor, n_cand, v.data());
  std::vector<int> kept_local(kept);
  for (int& j : kept_local) j -= n_anchor;
  const ObfHead obf = ComputeObf(
      *config_.obf, v, n_cand, d,
      absl::MakeConstSpan(w->scores).subspan(static_cast<size_t>(h) * n_prompt + n_anchor, n_cand),
      kept_local);
  if (!obf.applied) return;
  std::vector<float> row(d), check(d);
  for (int i = 0; i < n_kept; ++i) {
    const float* src = v.data() + static_cast<size_t>(kept_local[i]) * d;
    for (int c = 0; c < d; ++c) {
      row[c] = static_cast<float>(static_cast<double>(src[c]) + obf.weights[i] * obf.delta[c]);
    }
    const int t = w->kept_begin + i;
    w->out.v.WriteRow(h, t, row.data());
    w->out.v.ReadRow(h, t, check.data());
    for (int c = 0; c < d; ++c) {
      if (!std::isfinite(check[c])) {
        w->head_status[h] = absl::InvalidArgumentError(absl::StrCat(
            "layer.", ctx.layer, ".prompt.v: obf backfill overflows ", DTypeName(geo.dtype),
            " at head ", h, " position ", ctx.prompt_pos0 + kept[i], " (value ", row[c],
            "); the scale factor A_del/A_keep explodes when the kept tokens have almost no "
            "attention, use obf:scale=ad_frac or a wider dtype"));
        return;
      }
    }
  }
}

absl::Status Pipeline::FinishLayer(const TurnGeometry& geo, int layer, LayerWork* w) const {
  for (const absl::Status& s : w->head_status) KVRELAY_RETURN_IF_ERROR(s);
  if (config_.quant) {
    QuantOptions opts = *config_.quant;
    if (!config_.layer_bits.empty()) std::tie(opts.bits, opts.v_bits) = config_.layer_bits[layer];
    absl::StatusOr<QuantizedKv> quantized = QuantizeKv(w->out.k, w->out.v, opts);
    if (!quantized.ok()) {
      return absl::Status(quantized.status().code(),
                          absl::StrCat("layer.", layer, ": ", quantized.status().message()));
    }
    QuantizedKv q = *std::move(quantized);
    q.dtype = geo.dtype;
    w->out.quant = std::move(q);
    w->out.k = KvTensor(geo.dtype, 0, 0, geo.head_dim);
    w->out.v = KvTensor(geo.dtype, 0, 0, geo.head_dim);
  }
  if (w->demoted_k.tokens() > 0) {
    QuantOptions o;
    o.scheme = QuantScheme::kLloyd;
    o.bits = *config_.demote_bits;
    o.seed = config_.LloydSeed();
    absl::StatusOr<QuantizedKv> quantized = QuantizeKv(w->demoted_k, w->demoted_v, o);
    if (!quantized.ok()) {
      return absl::Status(quantized.status().code(),
                          absl::StrCat("layer.", layer, ".demoted: ", quantized.status().message()));
    }
    w->out.demoted = *std::move(quantized);
    w->out.demoted->dtype = geo.dtype;
    w->demoted_k = KvTensor();
    w->demoted_v = KvTensor();
  }
  return absl::OkStatus();
}

namespace {

// The layer's tensors against `counts`: positions, dense or quantized K/V,
// demoted rows and acc, in shape; acc finite and >= 0.
absl::Status CheckLayerShapes(const MessageLayer& out, const TurnGeometry& geo, const Message& counts, int layer) {
  const int heads = geo.kv_heads, d = geo.head_dim;
  const int n = counts.n_history + counts.n_anchor + counts.n_kept + counts.n_gen;
  const int nd = counts.n_demoted, total = n + nd;
  if (out.pos.heads != heads || out.pos.tokens != total ||
      out.pos.data.size() != static_cast<size_t>(heads) * total) {
    return Violation(layer, "pos holds [", out.pos.heads, ", ", out.pos.tokens, "] (", out.pos.data.size(),
                     " ids), expected [", heads, ", ", total, "] (n_history ", counts.n_history, " + n_anchor ",
                     counts.n_anchor, " + n_kept ", counts.n_kept, " + n_gen ", counts.n_gen, " + n_demoted ", nd, ")");
  }
  for (const auto& [name, t] : {std::pair<const char*, const KvTensor*>{"k", &out.k}, {"v", &out.v}}) {
    if (out.quant ? t->tokens() != 0
                  : t->dtype() != geo.dtype || t->heads() != heads || t->tokens() != n || t->dim() != d) {
      return Violation(layer, name, " is ", DTypeName(t->dtype()), " [", t->heads(), ", ", t->tokens(), ", ",
                       t->dim(), "], expected ", out.quant ? "no dense rows (the layer is quantized)" : "",
                       out.quant ? "" : absl::StrCat(DTypeName(geo.dtype), " [", heads, ", ", n, ", ", d, "]"));
    }
  }
  if (out.quant) {
    if (absl::Status s = CheckQuantizedShape(*out.quant, heads, n, d); !s.ok()) {
      return Violation(layer, "the quantized layer: ", s.message());
    }
  }
  if (out.demoted.has_value() != (nd > 0)) {
    return Violation(layer, out.demoted ? "demoted tokens present" : "no demoted tokens", ", expected n_demoted ", nd);
  }
  if (out.demoted) {
    const QuantizedKv& q = *out.demoted;
    if (q.scheme != QuantScheme::kLloyd || q.bits != counts.demote_bits || q.keys_channel) {
      return Violation(layer, "the demoted tokens are not lloyd rows of ", counts.demote_bits, " bits");
    }
    if (absl::Status s = CheckQuantizedShape(q, heads, nd, d); !s.ok()) {
      return Violation(layer, "the demoted tokens: ", s.message());
    }
  }
  if (!out.acc.empty()) {
    if (out.acc.size() != static_cast<size_t>(heads) * total) {
      return Violation(layer, "acc holds ", out.acc.size(), " values, expected ", static_cast<size_t>(heads) * total);
    }
    if (!AllFiniteNonNegative(out.acc.data(), out.acc.size())) {
      return Violation(layer, "acc holds a value that is not finite and >= 0");
    }
  }
  return absl::OkStatus();
}

// Head h's position ids `p` against `counts`: history ids below
// prompt_pos0, anchors and generated tokens at their own ids, kept prompt
// ids ascending between them, demoted ones ascending and none of them kept.
absl::Status CheckHeadPositions(const int32_t* p, const Message& counts, int64_t prompt_pos0, int64_t gen0, int h,
                                int layer) {
  int t = 0;
  for (; t < counts.n_history; ++t) {
    if (p[t] < 0 || p[t] >= prompt_pos0) {
      return Violation(layer, "head ", h, " holds history token ", t, " at id ", p[t], ", expected an id in [0, ",
                       prompt_pos0, ")");
    }
  }
  for (int j = 0; j < counts.n_anchor; ++j, ++t) {
    if (p[t] != prompt_pos0 + j) {
      return Violation(layer, "head ", h, " holds anchor ", j, " at id ", p[t], ", expected ", prompt_pos0 + j);
    }
  }
  int64_t last = prompt_pos0 + counts.n_anchor - 1;
  for (int j = 0; j < counts.n_kept; ++j, ++t) {
    if (p[t] <= last || p[t] >= gen0) {
      return Violation(layer, "head ", h, " holds kept prompt token ", j, " at id ", p[t],
                       ", expected ascending ids in (", last, ", ", gen0, ")");
    }
    last = p[t];
  }
  for (int j = 0; j < counts.n_gen; ++j, ++t) {
    if (p[t] != gen0 + j) {
      return Violation(layer, "head ", h, " holds generated token ", j, " at id ", p[t], ", expected ", gen0 + j);
    }
  }
  const int32_t* kept = p + counts.n_history + counts.n_anchor;
  int next_kept = 0;
  last = prompt_pos0 + counts.n_anchor - 1;
  for (int j = 0; j < counts.n_demoted; ++j, ++t) {
    while (next_kept < counts.n_kept && kept[next_kept] < p[t]) ++next_kept;
    if (p[t] <= last || p[t] >= gen0 || (next_kept < counts.n_kept && kept[next_kept] == p[t])) {
      return Violation(layer, "head ", h, " holds demoted token ", j, " at id ", p[t], ", expected ascending ids in (",
                       last, ", ", gen0, ") that no kept token holds");
    }
    last = p[t];
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckLayerOutput(const MessageLayer& out, const TurnGeometry& geo, const Message& counts,
                              int64_t prompt_pos0, int layer) {
  KVRELAY_RETURN_IF_ERROR(CheckLayerShapes(out, geo, counts, layer));
  if (out.attention_error && !std::isfinite(*out.attention_error)) {
    return Violation(layer, "the fidelity figure is ", *out.attention_error, ", expected a finite number");
  }
  const int total = counts.n_history + counts.n_anchor + counts.n_kept + counts.n_gen + counts.n_demoted;
  const int64_t gen0 = prompt_pos0 + geo.n_prompt;
  for (int h = 0; h < geo.kv_heads; ++h) {
    KVRELAY_RETURN_IF_ERROR(
        CheckHeadPositions(out.pos.data.data() + static_cast<size_t>(h) * total, counts, prompt_pos0, gen0, h, layer));
  }
  return absl::OkStatus();
}

bool IsInvariantViolation(const absl::Status& s) {
  return s.code() == absl::StatusCode::kInternal && s.GetPayload(kInvariantPayload).has_value();
}

absl::Status Pipeline::CheckOutput(const TurnGeometry& geo, const LayerContext& ctx, const MessageLayer& out) const {
  if (!internal::InvariantChecksOn()) return absl::OkStatus();
  Message counts;
  CountTokens(geo, ctx.first_agent, &counts);
  return CheckLayerOutput(out, geo, counts, ctx.prompt_pos0, ctx.layer);
}

absl::Status Pipeline::CheckWindow(const TurnGeometry& geo) const {
  if (config_.select.window == 0 || geo.queries) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "policy stage '", SelectorName(config_.select.kind), "': window=", config_.select.window,
      " scores from the generated steps' queries: expected layer.0.gen.q, the turn carries layer.0.prompt.score"));
}

absl::Status Pipeline::CheckHeadDim(int head_dim) const {
  if (config_.quant) KVRELAY_RETURN_IF_ERROR(ValidateQuantOptions(*config_.quant, head_dim));
  for (size_t l = 0; l < config_.layer_bits.size(); ++l) {
    QuantOptions o = *config_.quant;
    std::tie(o.bits, o.v_bits) = config_.layer_bits[l];
    if (absl::Status s = ValidateQuantOptions(o, head_dim); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("lloyd: layers: layer ", l, ": ", s.message()));
    }
  }
  if (config_.demote_bits) {
    QuantOptions o;
    o.scheme = QuantScheme::kLloyd;
    o.bits = *config_.demote_bits;
    if (absl::Status s = ValidateQuantOptions(o, head_dim); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("demote: ", s.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status Pipeline::CheckLayerwise() const {
  if (!config_.layer_bits.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy '", spec_, "': lloyd:layers= gives each layer its own bits, which a relay's messages cannot "
        "carry (one quant_bits per message); compress it offline (kvrelayctl compress), or publish "
        "lloyd:bits=B without layers"));
  }
  if (!config_.budget) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "policy '", spec_, "': auto chooses its setting from every layer's scores, so it compresses whole turns only "
      "(kvrelayctl compress, Pipeline::Compress); a relay compresses layer by layer as they arrive: publish the "
      "policy auto chooses (the policy of kvrelayctl compress's message)"));
}

absl::StatusOr<MessageLayer> Pipeline::CompressLayer(const TurnLayer& layer, const TurnGeometry& geo,
                                                     const LayerContext& ctx, ThreadPool* pool) const {
  KVRELAY_RETURN_IF_ERROR(CheckLayerwise());
  KVRELAY_RETURN_IF_ERROR(CheckHeadDim(geo.head_dim));
  KVRELAY_RETURN_IF_ERROR(CheckWindow(geo));
  KVRELAY_RETURN_IF_ERROR(ValidateTurnLayer(layer, ctx.layer, geo, ctx.prompt_pos0, /*check_kv_values=*/false));
  LayerWork w;
  KVRELAY_RETURN_IF_ERROR(SelectAndCopy(layer, geo, ctx, &w));
  KVRELAY_RETURN_IF_ERROR(CheckCancelled(ctx));
  ParallelFor(pool, config_.obf ? geo.kv_heads : 0, [&](size_t h) {
    if (!IsCancelled(ctx)) BackfillHead(layer, geo, ctx, static_cast<int>(h), &w);
  });
  KVRELAY_RETURN_IF_ERROR(CheckCancelled(ctx));
  KVRELAY_RETURN_IF_ERROR(FinishLayer(geo, ctx.layer, &w));
  KVRELAY_RETURN_IF_ERROR(MeasureFidelity(layer, geo, ctx, &w.out));
  KVRELAY_RETURN_IF_ERROR(CheckOutput(geo, ctx, w.out));
  return std::move(w.out);
}

absl::Status Pipeline::MeasureFidelity(const TurnLayer& layer, const TurnGeometry& geo, const LayerContext& ctx,
                                       MessageLayer* out) const {
  if (!geo.queries) return absl::OkStatus();
  // The recipient's view: demoted tokens decoded among the kept ones.
  MessageLayer merged;
  const MessageLayer* view = out;
  if (out->demoted) {
    Message counts;
    CountTokens(geo, ctx.first_agent, &counts);
    counts.head_dim = geo.head_dim;
    KVRELAY_RETURN_IF_ERROR(DecodeLayer(*out, ctx.layer, counts, geo.dtype, &merged));
    view = &merged;
  }
  absl::StatusOr<double> e =
      AttentionOutputError(layer, geo, *view, SoftmaxScaleOf(ctx, geo.head_dim), ctx.cancelled);
  if (!e.ok()) return PrefixLayer(e.status(), ctx.layer);
  out->attention_error = *e;
  return absl::OkStatus();
}

absl::StatusOr<Message> Pipeline::Compress(const Turn& turn, ThreadPool* pool) const {
  return CompressImpl(turn, pool, /*check_kv_values=*/true);
}

absl::StatusOr<Message> Pipeline::CompressValidated(const Turn& turn, ThreadPool* pool) const {
  return CompressImpl(turn, pool, /*check_kv_values=*/false);
}

absl::StatusOr<Message> Pipeline::CompressImpl(const Turn& turn, ThreadPool* pool,
                                               bool check_kv_values) const {
  KVRELAY_ASSIGN_OR_RETURN(const TurnGeometry geo, GeometryOf(turn));
  if (config_.budget) {
    KVRELAY_ASSIGN_OR_RETURN(std::vector<BudgetCandidate> grid, BudgetCandidates(turn, config_.budget_weight));
    KVRELAY_ASSIGN_OR_RETURN(BudgetCandidate best,
                             ChooseBudget(grid, FullLayerBytes(geo) * turn.layers.size(), *config_.budget));
    KVRELAY_ASSIGN_OR_RETURN(std::unique_ptr<Pipeline> chosen, Create(best.Spec()));
    return chosen->CompressImpl(turn, pool, check_kv_values);
  }
  KVRELAY_RETURN_IF_ERROR(CheckHeadDim(geo.head_dim));
  KVRELAY_RETURN_IF_ERROR(CheckWindow(geo));
  const size_t n_layers = turn.layers.size();
  if (!config_.layer_bits.empty() && config_.layer_bits.size() != n_layers) {
    return absl::InvalidArgumentError(absl::StrCat("policy '", spec_, "': lloyd:layers= gives ",
                                                   config_.layer_bits.size(), " layers, expected one per layer of "
                                                   "the turn (", n_layers, ")"));
  }
  const int heads = geo.kv_heads;
  std::vector<LayerContext> ctx(n_layers);
  for (size_t l = 0; l < n_layers; ++l) {
    ctx[l].layer = static_cast<int>(l);
    ctx[l].first_agent = turn.first_agent;
    ctx[l].prompt_pos0 = turn.PromptPos0();
    ctx[l].softmax_scale = turn.SoftmaxScale(geo.head_dim);
  }
  // Three phases, each spread over the pool: validate, select and copy per
  // layer; backfill per (layer, head); quantize per layer. Every task writes
  // only its own slot, so the result does not depend on the pool size.
  std::vector<LayerWork> work(n_layers);
  std::vector<absl::Status> status(n_layers);
  ParallelFor(pool, n_layers, [&](size_t l) {
    status[l] = ValidateTurnLayer(turn.layers[l], ctx[l].layer, geo, ctx[l].prompt_pos0, check_kv_values);
    if (status[l].ok()) status[l] = SelectAndCopy(turn.layers[l], geo, ctx[l], &work[l]);
  });
  for (const absl::Status& s : status) KVRELAY_RETURN_IF_ERROR(s);
  if (config_.obf) {
    ParallelFor(pool, n_layers * heads, [&](size_t i) {
      const size_t l = i / heads;
      BackfillHead(turn.layers[l], geo, ctx[l], static_cast<int>(i % heads), &work[l]);
    });
  }
  ParallelFor(pool, n_layers, [&](size_t l) {
    status[l] = FinishLayer(geo, static_cast<int>(l), &work[l]);
    if (status[l].ok()) status[l] = MeasureFidelity(turn.layers[l], geo, ctx[l], &work[l].out);
    if (status[l].ok()) status[l] = CheckOutput(geo, ctx[l], work[l].out);
  });
  for (const absl::Status& s : status) KVRELAY_RETURN_IF_ERROR(s);

  std::vector<MessageLayer> layers;
  layers.reserve(n_layers);
  for (LayerWork& w : work) layers.push_back(std::move(w.out));
  return Compose(geo, turn.first_agent, turn.PromptPos0(), std::move(layers));
}

Message Pipeline::Compose(const TurnGeometry& geo, bool first_agent, int64_t prompt_pos0,
                          std::vector<MessageLayer> layers) const {
  Message msg;
  msg.policy = spec_;
  msg.dtype = geo.dtype;
  msg.kv_heads = geo.kv_heads;
  msg.head_dim = geo.head_dim;
  CountTokens(geo, first_agent, &msg);
  msg.full_bytes = FullLayerBytes(geo) * layers.size();
  for (const MessageLayer& l : layers) msg.sent_bytes += l.SentBytes();
  if (!layers.empty() && std::all_of(layers.begin(), layers.end(),
                                     [](const MessageLayer& l) { return l.attention_error.has_value(); })) {
    double sum = 0;
    for (const MessageLayer& l : layers) sum += *l.attention_error;
    msg.attention_error = sum / static_cast<double>(layers.size());
  }
  msg.anchor_pos = AnchorPositions(geo, msg.n_anchor, prompt_pos0);
  msg.layers = std::move(layers);
  msg.next_pos = prompt_pos0 + geo.n_prompt + geo.n_gen;
  msg.next_pos = NextPosition(msg);  // never before an id held
  return msg;
}

std::string KernelSummary() {
#if defined(__AVX2__) && defined(__FMA__)
  std::string out = internal::Avx512Enabled() ? "avx512" : "avx2";
#else
  std::string out = "scalar";
#endif
  if (internal::NativeBf16GramEnabled()) out += "+bf16-dot";
#if defined(__SSE4_2__)
  out += internal::Avx512ClmulEnabled() ? "+crc32c-vpclmulqdq" : "+crc32c-sse4.2";
#else
  out += "+crc32c-table";
#endif
  return out;
}

}  // namespace kvrelay
