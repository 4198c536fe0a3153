// Compression pipelines built from spec strings (faiss index_factory style).
//
//   auto p = Pipeline::Create("h2o-head:k=32+obf:p=8,mode=fast+int4:group=32");
//   if (!p.ok()) ...;               // InvalidArgument naming the bad token
//   absl::StatusOr<Message> m = (*p)->Compress(turn, &pool);
//
// The grammar and every stage's parameters are documented in docs/FORMAT.md.
// A Pipeline is immutable after creation and thread-safe: Compress and
// CompressLayer may run concurrently.
#ifndef KVRELAY_CORE_PIPELINE_H_
#define KVRELAY_CORE_PIPELINE_H_

#include <atomic>
#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/budget.h"
#include "core/message.h"
#include "core/obf.h"
#include "core/quant.h"
#include "core/selection.h"
#include "core/thread_pool.h"
#include "core/turn.h"

namespace kvrelay {

// Parsed `name:key=value,...` token of a spec.
struct StageSpec {
  std::string name;
  std::vector<std::pair<std::string, std::string>> params;  // in spec order

  // Whether the token gives `key`.
  bool Has(absl::string_view key) const {
    for (const auto& kv : params) {
      if (kv.first == key) return true;
    }
    return false;
  }
};

// The longest spec accepted, in bytes (the relay quotes specs in error
// messages and logs; offline use and the relay accept the same specs).
inline constexpr size_t kMaxSpecBytes = 1024;

// Splits a spec into stage tokens. InvalidArgument for an empty or too long
// spec, bytes other than printable ASCII, empty stages, missing '=' or empty
// keys, duplicate keys.
absl::StatusOr<std::vector<StageSpec>> SplitSpec(absl::string_view spec);

// What the stages of one pipeline resolve to.
struct PipelineConfig {
  SelectorOptions select;
  std::optional<ObfOptions> obf;
  // demote:bits=B: the candidates the selector drops, kept at B bits
  // (docs/FORMAT.md, step 6a).
  std::optional<int> demote_bits;
  std::optional<QuantOptions> quant;
  // lloyd:layers=KV.KV...: per layer, the keys' and values' bits (a byte
  // budget's allocation); empty: quant's bits in every layer.
  std::vector<std::pair<int, int>> layer_bits;
  // auto:budget=F: the policy is chosen per turn from a grid (core/budget.h);
  // the other fields are unused.
  std::optional<double> budget;
  // auto:...,weight=: how its estimate weighs the prompt tokens.
  BudgetWeight budget_weight = BudgetWeight::kAttention;

  // The seed of the lloyd rotation of the message (its quantizer's, else
  // kDefaultLloydSeed): demoted tokens use it too.
  uint64_t LloydSeed() const;
};

// Maps stage names to functions that fold a stage's parameters into a
// PipelineConfig. Stage kinds: kSelector (exactly one, first), kTransform
// (obf or demote, after the selector), kQuantizer (at most one, last).
class Registry {
 public:
  enum class Kind { kSelector, kTransform, kQuantizer };
  using Apply = std::function<absl::Status(const StageSpec&, PipelineConfig*)>;

  // AlreadyExists if `name` is taken.
  absl::Status Register(std::string name, Kind kind, Apply apply);
  const std::pair<Kind, Apply>* Find(absl::string_view name) const;
  std::vector<std::string> Names() const;

  // The registry with every built-in stage (full, gen, h2o-layer, h2o-head,
  // h2o-auto, obf, demote, int8, int4, int2, lloyd, auto).
  static const Registry& Builtin();

 private:
  std::map<std::string, std::pair<Kind, Apply>, std::less<>> stages_;
};

// Adds the built-in stages to `registry`.
absl::Status RegisterBuiltins(Registry* registry);

// Per-turn values every layer needs.
struct LayerContext {
  int layer = 0;
  bool first_agent = true;
  int64_t prompt_pos0 = 0;
  // Logit scale for scores from queries (Turn::SoftmaxScale); 0 means
  // 1/sqrt(head_dim).
  double softmax_scale = 0;
  // When set and it becomes true, CompressLayer stops between heads and
  // between GEMM column blocks and returns CancelledError (null: never).
  const std::atomic<bool>* cancelled = nullptr;
};

class Pipeline {
 public:
  // Parses `spec` against `registry`. InvalidArgument naming the offending
  // token for unknown names, bad parameters, misplaced or contradictory stages.
  static absl::StatusOr<std::unique_ptr<Pipeline>> Create(
      absl::string_view spec, const Registry& registry = Registry::Builtin());

  // The canonical spec: every parameter spelled out in a fixed order, so that
  // equal pipelines have equal specs.
  const std::string& spec() const { return spec_; }
  const PipelineConfig& config() const { return config_; }

  // Compresses a whole turn, spreading layers and heads over `pool` (may be
  // null). The result is bit-identical for every pool size. Validates the
  // turn first (InvalidArgument naming the tensor), including a scan of every
  // K/V element for NaN/Inf.
  absl::StatusOr<Message> Compress(const Turn& turn, ThreadPool* pool = nullptr) const;

  // As Compress, but skips the K/V value scan (shapes, dtypes, scores and
  // positions are still checked). REQUIRES: ValidateTurn(turn).ok(), e.g. a
  // turn from ReadTurnFile.
  absl::StatusOr<Message> CompressValidated(const Turn& turn, ThreadPool* pool = nullptr) const;

  // Compresses one layer, spreading its heads over `pool` (may be null).
  // Checks shapes, scores and positions (InvalidArgument) but not the K/V
  // values: REQUIRES the caller to have checked those (ValidateTurnLayer).
  // A selector with `window` on a turn without queries is InvalidArgument.
  // CancelledError once *ctx.cancelled is true (checked between heads and
  // between GEMM column blocks, so a layer stops within about one block).
  // An auto:budget pipeline chooses from the whole turn: InvalidArgument
  // here (CheckLayerwise).
  absl::StatusOr<MessageLayer> CompressLayer(const TurnLayer& layer, const TurnGeometry& geo,
                                             const LayerContext& ctx,
                                             ThreadPool* pool = nullptr) const;

  // InvalidArgument when this pipeline cannot compress a turn of geometry
  // `geo` whatever its values: a selector with `window` on a turn without
  // queries. Compress and CompressLayer check it too; a relay checks it
  // before the upload's tensors arrive.
  absl::Status CheckWindow(const TurnGeometry& geo) const;

  // InvalidArgument for a pipeline that cannot compress layer by layer
  // (auto:budget, which chooses from every layer's scores), as a relay
  // does for Publish; OK otherwise.
  absl::Status CheckLayerwise() const;

  // InvalidArgument naming the stage when its quantizer or demotion cannot
  // apply to rows of `head_dim` channels (ValidateQuantOptions).
  absl::Status CheckHeadDim(int head_dim) const;

  // Token counts per head of every message layer this pipeline produces for
  // a turn of geometry `geo`.
  void CountTokens(const TurnGeometry& geo, bool first_agent, Message* msg) const;

  // The message of compressed `layers` (CompressLayer's, in order) of a turn
  // of geometry `geo` starting at `prompt_pos0`: policy, dtype, shape, token
  // counts, byte accounting, next_pos (the turn's end, prompt_pos0 +
  // n_prompt + n_gen, or past every id held if that is later) and, when
  // every layer has one, the mean fidelity figure.
  Message Compose(const TurnGeometry& geo, bool first_agent, int64_t prompt_pos0,
                  std::vector<MessageLayer> layers) const;

 private:
  struct LayerWork;

  Pipeline(std::string spec, PipelineConfig config)
      : spec_(std::move(spec)), config_(std::move(config)) {}

  absl::StatusOr<Message> CompressImpl(const Turn& turn, ThreadPool* pool, bool check_kv_values) const;
  struct RowPlan;
  // Scores the layer, selects its tokens and copies the rows it keeps into
  // w->out (the demoted ones aside), positions and acc with them.
  absl::Status SelectAndCopy(const TurnLayer& layer, const TurnGeometry& geo, const LayerContext& ctx,
                             LayerWork* w) const;
  // The attention mass on the layer's cache: the prompt's into w->scores
  // (the selection score), the history's and the generated tokens' into
  // *hist_mass and *gen_mass ([kv_heads, tokens]; zeros where none).
  absl::Status ScoreLayer(const TurnLayer& layer, const TurnGeometry& geo, const LayerContext& ctx, LayerWork* w,
                          std::vector<double>* hist_mass, std::vector<double>* gen_mass) const;
  // Head h's rows in the order `plan` gives, with their positions and acc.
  absl::Status CopyHead(const TurnLayer& layer, const TurnGeometry& geo, const LayerContext& ctx,
                        const RowPlan& plan, const std::vector<int>& kept_hist, const std::vector<float>& hist_acc,
                        const std::vector<double>& gen_mass, int h, LayerWork* w) const;
  void BackfillHead(const TurnLayer& layer, const TurnGeometry& geo, const LayerContext& ctx, int h,
                    LayerWork* w) const;
  absl::Status FinishLayer(const TurnGeometry& geo, int layer, LayerWork* w) const;
  // CheckLayerOutput of `out` against this pipeline's token counts.
  absl::Status CheckOutput(const TurnGeometry& geo, const LayerContext& ctx, const MessageLayer& out) const;
  // Sets out->attention_error for a turn with queries.
  absl::Status MeasureFidelity(const TurnLayer& layer, const TurnGeometry& geo, const LayerContext& ctx,
                               MessageLayer* out) const;

  std::string spec_;
  PipelineConfig config_;
};

// The invariants of one layer of a pipeline's output (docs/FORMAT.md,
// "Message"), whatever the input: K, V (or the quantized codes, scales and
// zeros), pos and acc have the geometry's heads, head_dim and dtype and
// exactly `n` = n_history + n_anchor + n_kept + n_gen tokens per head
// (`counts`, from CountTokens); every head holds its history at ids in
// [0, prompt_pos0), the anchors at prompt_pos0 + j, the kept prompt tokens
// at ascending ids in the rest of the prompt, and the generated tokens at
// prompt_pos0 + n_prompt + j; acc is finite and >= 0. Internal naming the
// layer and the invariant otherwise: a message that breaks one is never
// committed, stored, forwarded or written.
absl::Status CheckLayerOutput(const MessageLayer& out, const TurnGeometry& geo, const Message& counts,
                              int64_t prompt_pos0, int layer);

// Whether `s` is a broken invariant of the pipeline's output (the Internal
// errors of CheckLayerOutput and of the per-head counts), which a relay
// logs as an error and counts.
bool IsInvariantViolation(const absl::Status& s);

// The chain's anchors a message of a turn of geometry `geo` holds: the
// history's (geo.history_anchors) and the turn's own `n_anchor` from
// prompt_pos0 on, ascending.
std::vector<int32_t> AnchorPositions(const TurnGeometry& geo, int n_anchor, int64_t prompt_pos0);

// Bytes `full` sends for a layer of geometry `geo`: dense K and V of every
// history, prompt and generated token, plus 4 bytes per position id.
uint64_t FullLayerBytes(const TurnGeometry& geo);

// Which instruction sets the compression and checksum kernels use in this
// process, for logs: the OBF kernels ("avx512", "avx2" or "scalar"), then
// "bf16-dot" where the bfloat16 Gram uses AVX512_BF16, then the CRC32C
// path ("crc32c-vpclmulqdq", "crc32c-sse4.2" or "crc32c-table"), joined by
// "+", e.g. "avx512+bf16-dot+crc32c-vpclmulqdq". Results are bit-identical
// whichever is used. Thread-safe.
std::string KernelSummary();

}  // namespace kvrelay

#endif  // KVRELAY_CORE_PIPELINE_H_
