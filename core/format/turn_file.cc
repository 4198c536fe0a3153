#include "core/format/turn_file.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/lloyd.h"
#include "core/quant.h"
#include "core/status_macros.h"

// Tensor data is copied to and from the host representation byte for byte.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "kvrelay's safetensors I/O assumes a little-endian host");

namespace kvrelay {
namespace {

// Layer names parsed at all; turns and messages check kMaxLayers after.
constexpr int kMaxLayerIndex = 1 << 16;

absl::Status Invalid(absl::string_view name, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(name, ": ", what));
}

std::string LayerName(int layer, absl::string_view part) {
  return absl::StrCat("layer.", layer, ".", part);
}

// Parses "layer.{l}.{part}" with a canonical decimal l (no sign, no leading
// zeros). nullopt when `name` has another form.
std::optional<std::pair<int, absl::string_view>> SplitLayerName(absl::string_view name) {
  constexpr absl::string_view kPrefix = "layer.";
  if (name.substr(0, kPrefix.size()) != kPrefix) return std::nullopt;
  name.remove_prefix(kPrefix.size());
  size_t digits = 0;
  while (digits < name.size() && name[digits] >= '0' && name[digits] <= '9') ++digits;
  if (digits == 0 || digits > 9 || (digits > 1 && name[0] == '0')) return std::nullopt;
  if (digits + 1 >= name.size() || name[digits] != '.') return std::nullopt;
  int layer = 0;
  for (size_t i = 0; i < digits; ++i) layer = layer * 10 + (name[i] - '0');
  return std::make_pair(layer, name.substr(digits + 1));
}

// A decimal integer in [0, max]: digits only, no sign, no spaces.
std::optional<uint64_t> ParseDecimal(absl::string_view s, uint64_t max) {
  if (s.empty() || s.size() > 20) return std::nullopt;
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    const uint64_t d = static_cast<uint64_t>(c - '0');
    if (v > (max - d) / 10) return std::nullopt;
    v = v * 10 + d;
  }
  return v;
}

std::string Quote(absl::string_view s) {
  std::string out = "\"";
  for (char c : s.substr(0, 60)) out += (static_cast<unsigned char>(c) < 0x20 ? '?' : c);
  if (s.size() > 60) out += "...";
  return out + "\"";
}

std::optional<DType> KvDType(StDType d) {
  switch (d) {
    case StDType::kF32:
      return DType::kF32;
    case StDType::kF16:
      return DType::kF16;
    case StDType::kBF16:
      return DType::kBF16;
    default:
      return std::nullopt;
  }
}

StDType ToStDType(DType d) {
  switch (d) {
    case DType::kF32:
      return StDType::kF32;
    case DType::kF16:
      return StDType::kF16;
    case DType::kBF16:
      return StDType::kBF16;
  }
  return StDType::kF32;
}

// Checks the rank and that every dimension fits an int.
absl::Status CheckRank(const StTensor& t, size_t rank, absl::string_view layout) {
  if (t.shape.size() != rank) {
    return Invalid(t.name, absl::StrCat("shape ", ShapeString(t.shape), ", expected rank ", rank,
                                        " ", layout));
  }
  for (int64_t d : t.shape) {
    if (d > std::numeric_limits<int>::max()) {
      return Invalid(
          t.name, absl::StrCat("shape ", ShapeString(t.shape), ", expected dimensions below 2^31"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckShape(const StTensor& t, std::vector<int64_t> expected, absl::string_view why) {
  if (t.shape != expected) {
    return Invalid(
        t.name, absl::StrCat("shape ", ShapeString(t.shape), ", expected ", ShapeString(expected),
                             why.empty() ? "" : " (", why, why.empty() ? "" : ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckDType(const StTensor& t, StDType expected, absl::string_view why = "") {
  if (t.dtype != expected) {
    return Invalid(
        t.name, absl::StrCat("dtype ", StDTypeName(t.dtype), ", expected ", StDTypeName(expected),
                             why.empty() ? "" : " (", why, why.empty() ? "" : ")"));
  }
  return absl::OkStatus();
}

KvTensor KvFrom(const StTensor& t, DType dtype) {
  // Every byte is overwritten below, so skip the zero fill.
  KvTensor out =
      KvTensor::Uninitialized(dtype, static_cast<int>(t.shape[0]), static_cast<int>(t.shape[1]),
                              static_cast<int>(t.shape[2]));
  if (!t.data.empty()) std::memcpy(out.mutable_bytes().data(), t.data.data(), t.data.size());
  return out;
}

PosTensor PosFrom(const StTensor& t) {
  PosTensor out(static_cast<int>(t.shape[0]), static_cast<int>(t.shape[1]));
  if (!t.data.empty()) std::memcpy(out.data.data(), t.data.data(), t.data.size());
  return out;
}

ScoreMatrix ScoreFrom(const StTensor& t) {
  ScoreMatrix out(static_cast<int>(t.shape[0]), static_cast<int>(t.shape[1]));
  if (!t.data.empty()) std::memcpy(out.data.data(), t.data.data(), t.data.size());
  return out;
}

template <typename T>
std::vector<T> VectorFrom(const StTensor& t) {
  std::vector<T> out(t.data.size() / sizeof(T));
  if (!t.data.empty()) std::memcpy(out.data(), t.data.data(), t.data.size());
  return out;
}

template <typename T>
absl::Span<const uint8_t> BytesOf(const std::vector<T>& v) {
  return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(v.data()),
                                   v.size() * sizeof(T));
}

StTensor View(std::string name, StDType dtype, std::vector<int64_t> shape,
              absl::Span<const uint8_t> data) {
  StTensor t;
  t.name = std::move(name);
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.data = data;
  return t;
}

StTensor KvView(std::string name, const KvTensor& t) {
  return View(std::move(name), ToStDType(t.dtype()), {t.heads(), t.tokens(), t.dim()}, t.bytes());
}

StTensor PosView(std::string name, const PosTensor& p) {
  return View(std::move(name), StDType::kI32, {p.heads, p.tokens}, BytesOf(p.data));
}

absl::Status PrefixPath(const std::string& path, const absl::Status& s) {
  if (s.ok() || s.code() != absl::StatusCode::kInvalidArgument) return s;
  if (absl::string_view(s.message()).substr(0, path.size() + 2) == absl::StrCat(path, ": ")) {
    return s;
  }
  return absl::Status(s.code(), absl::StrCat(path, ": ", s.message()));
}

// ---- Turn ----

constexpr absl::string_view kTurnParts[] = {"prompt.k",  "prompt.v",    "gen.k",       "gen.v",
                                            "gen.q",     "prompt.score", "history.k",  "history.v",
                                            "history.pos", "history.acc", "history.score"};
constexpr absl::string_view kRequiredTurnParts[] = {"prompt.k", "prompt.v", "gen.k", "gen.v"};
constexpr absl::string_view kHistoryParts[] = {"history.k", "history.v", "history.pos"};

bool IsTurnPart(absl::string_view part) {
  return std::find(std::begin(kTurnParts), std::end(kTurnParts), part) != std::end(kTurnParts);
}

bool IsKvPart(absl::string_view part) {
  return part == "prompt.k" || part == "prompt.v" || part == "gen.k" || part == "gen.v" ||
         part == "history.k" || part == "history.v";
}

using PartMap = std::map<absl::string_view, const StTensor*>;

// Groups tensors by layer. `is_part` says which suffixes are known;
// `expected` describes them for the error message.
absl::StatusOr<std::vector<PartMap>> GroupByLayer(const SafetensorsReader& file,
                                                  bool (*is_part)(absl::string_view),
                                                  absl::string_view expected) {
  std::vector<PartMap> layers;
  for (const StTensor& t : file.tensors()) {
    auto split = SplitLayerName(t.name);
    if (!split || !is_part(split->second)) {
      return Invalid(t.name, absl::StrCat("unknown tensor name, expected ", expected));
    }
    if (split->first >= kMaxLayerIndex) {
      return Invalid(t.name,
                     absl::StrCat("layer index ", split->first, ", expected below ", kMaxLayerIndex));
    }
    if (static_cast<size_t>(split->first) >= layers.size()) layers.resize(split->first + 1);
    layers[split->first][split->second] = &t;
  }
  if (layers.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("no layer tensors (expected layer.0.* through layer.{L-1}.*, L >= 1)"));
  }
  const int num_layers = static_cast<int>(layers.size());
  for (int l = 0; l < num_layers; ++l) {
    if (layers[l].empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer.", l, ": no tensors, but layer.", num_layers - 1,
                       " exists; layers must run 0..L-1 without gaps"));
    }
  }
  return layers;
}

absl::StatusOr<bool> ParseBool(const SafetensorsReader& file, absl::string_view key,
                               std::optional<bool> dflt) {
  std::optional<absl::string_view> v = file.GetMetadata(key);
  if (!v) {
    if (dflt) return *dflt;
    return absl::InvalidArgumentError(
        absl::StrCat("metadata ", key, ": missing, expected \"true\" or \"false\""));
  }
  if (*v == "true") return true;
  if (*v == "false") return false;
  return absl::InvalidArgumentError(
      absl::StrCat("metadata ", key, ": ", Quote(*v), ", expected \"true\" or \"false\""));
}

// Comma-separated decimal position ids (int32, >= 0); "" is none.
absl::StatusOr<std::vector<int32_t>> ParsePositionList(absl::string_view key, absl::string_view v) {
  std::vector<int32_t> out;
  if (v.empty()) return out;
  for (absl::string_view item : absl::StrSplit(v, ',')) {
    std::optional<uint64_t> n = ParseDecimal(item, std::numeric_limits<int32_t>::max());
    if (!n) {
      return absl::InvalidArgumentError(absl::StrCat("metadata ", key, ": item ", Quote(item), " of ", out.size(),
                                                     ", expected comma-separated position ids (decimal, 0..2^31-1)"));
    }
    out.push_back(static_cast<int32_t>(*n));
  }
  return out;
}

absl::StatusOr<uint64_t> ParseCount(const SafetensorsReader& file, absl::string_view key,
                                    uint64_t max, absl::string_view expected) {
  std::optional<absl::string_view> v = file.GetMetadata(key);
  if (!v)
    return absl::InvalidArgumentError(
        absl::StrCat("metadata ", key, ": missing, expected ", expected));
  std::optional<uint64_t> n = ParseDecimal(*v, max);
  if (!n) {
    return absl::InvalidArgumentError(
        absl::StrCat("metadata ", key, ": ", Quote(*v), ", expected ", expected));
  }
  return *n;
}

// Required tensors and the attention input (prompt.score or gen.q, one of
// them) in every layer, then history in every layer or none. Returns the
// first layer with a history tensor, -1 when none has.
absl::StatusOr<int> CheckTurnParts(const std::vector<PartMap>& layers) {
  const int num_layers = static_cast<int>(layers.size());
  int history_layer = -1;
  for (int l = 0; l < num_layers; ++l) {
    for (absl::string_view part : kRequiredTurnParts) {
      if (!layers[l].count(part)) {
        return Invalid(LayerName(l, part), "missing, required in every layer");
      }
    }
    const bool score = layers[l].count("prompt.score") > 0, queries = layers[l].count("gen.q") > 0;
    if (score && queries) {
      return Invalid(LayerName(l, "gen.q"),
                     absl::StrCat("given together with ", LayerName(l, "prompt.score"), ", expected exactly one of the two"));
    }
    if (!score && !queries) {
      return Invalid(LayerName(l, "prompt.score"),
                     absl::StrCat("missing, expected it or ", LayerName(l, "gen.q"), " (the queries) in every layer"));
    }
    for (absl::string_view part : kHistoryParts) {
      if (layers[l].count(part) && history_layer < 0) history_layer = l;
    }
  }
  if (history_layer < 0) return history_layer;
  for (int l = 0; l < num_layers; ++l) {
    absl::string_view present;
    for (absl::string_view part : kHistoryParts) {
      if (layers[l].count(part)) present = part;
    }
    for (absl::string_view part : kHistoryParts) {
      if (layers[l].count(part)) continue;
      if (!present.empty()) {
        return Invalid(LayerName(l, part), absl::StrCat("missing, required with history (",
                                                        LayerName(l, present), " is present)"));
      }
      return Invalid(LayerName(l, part),
                     absl::StrCat("missing, but layer.", history_layer,
                                  " has history (history must be in every layer or none)"));
    }
  }
  return history_layer;
}

// The dtype and rank of every tensor of a turn. Returns the K/V dtype,
// that of layer.0.prompt.k.
absl::StatusOr<DType> CheckTurnDTypes(const std::vector<PartMap>& layers) {
  const StTensor& ref = *layers[0].at("prompt.k");
  std::optional<DType> dtype = KvDType(ref.dtype);
  if (!dtype) {
    return Invalid(ref.name,
                   absl::StrCat("dtype ", StDTypeName(ref.dtype), ", expected F32, F16 or BF16"));
  }
  for (const PartMap& parts : layers) {
    for (const auto& [part, t] : parts) {
      if (IsKvPart(part)) {
        KVRELAY_RETURN_IF_ERROR(CheckDType(*t, ref.dtype, "dtype of layer.0.prompt.k"));
        KVRELAY_RETURN_IF_ERROR(CheckRank(*t, 3, "[kv_heads, tokens, head_dim]"));
      } else if (part == "prompt.score") {
        KVRELAY_RETURN_IF_ERROR(CheckDType(*t, StDType::kF32));
        KVRELAY_RETURN_IF_ERROR(CheckRank(*t, 2, "[score_heads, n_prompt]"));
      } else if (part == "gen.q") {
        if (t->dtype != StDType::kF32 && t->dtype != ref.dtype) {
          return Invalid(t->name, absl::StrCat("dtype ", StDTypeName(t->dtype), ", expected F32 or ",
                                               StDTypeName(ref.dtype), " (the K/V dtype)"));
        }
        KVRELAY_RETURN_IF_ERROR(CheckRank(*t, 3, "[score_heads, n_gen, head_dim]"));
      } else if (part == "history.acc") {
        KVRELAY_RETURN_IF_ERROR(CheckDType(*t, StDType::kF32));
        KVRELAY_RETURN_IF_ERROR(CheckRank(*t, 2, "[kv_heads, n_history]"));
      } else if (part == "history.score") {
        KVRELAY_RETURN_IF_ERROR(CheckDType(*t, StDType::kF32));
        KVRELAY_RETURN_IF_ERROR(CheckRank(*t, 2, "[score_heads, n_history]"));
      } else {  // history.pos
        KVRELAY_RETURN_IF_ERROR(CheckDType(*t, StDType::kI32));
        KVRELAY_RETURN_IF_ERROR(CheckRank(*t, 2, "[kv_heads, n_history]"));
      }
    }
  }
  return *dtype;
}

// The turn's metadata: first_agent, prompt_pos0, softmax_scale and
// history_anchors.
absl::Status ReadTurnMetadata(const SafetensorsReader& file, Turn* turn) {
  KVRELAY_ASSIGN_OR_RETURN(turn->first_agent, ParseBool(file, "first_agent", true));
  if (file.GetMetadata("prompt_pos0")) {
    KVRELAY_ASSIGN_OR_RETURN(
        uint64_t pos0, ParseCount(file, "prompt_pos0", std::numeric_limits<int64_t>::max() / 2,
                                  "a decimal integer >= 0"));
    turn->prompt_pos0 = static_cast<int64_t>(pos0);
  }
  if (std::optional<absl::string_view> v = file.GetMetadata("softmax_scale")) {
    double scale;
    if (!absl::SimpleAtod(*v, &scale) || !CheckSoftmaxScale(scale, "").ok()) {
      return absl::InvalidArgumentError(absl::StrFormat("metadata softmax_scale: %s, expected a finite decimal number in [%g, %g]",
                                                        Quote(*v), kMinSoftmaxScale, kMaxSoftmaxScale));
    }
    turn->softmax_scale = scale;
  }
  if (std::optional<absl::string_view> v = file.GetMetadata("history_anchors")) {
    KVRELAY_ASSIGN_OR_RETURN(turn->history_anchors, ParsePositionList("history_anchors", *v));
  }
  return absl::OkStatus();
}

// Copies layer `l`'s checked tensors into `*out`. Without history, the
// layer gets empty history tensors; history.acc is then an error, and so
// is history.score unless the turn is for a parent.
absl::Status ReadTurnLayer(const PartMap& parts, int l, DType dtype, bool history,
                           const TurnFileOptions& options, TurnLayer* out) {
  out->prompt_k = KvFrom(*parts.at("prompt.k"), dtype);
  out->prompt_v = KvFrom(*parts.at("prompt.v"), dtype);
  out->gen_k = KvFrom(*parts.at("gen.k"), dtype);
  out->gen_v = KvFrom(*parts.at("gen.v"), dtype);
  if (parts.count("gen.q")) {
    const StTensor& q = *parts.at("gen.q");
    out->gen_q = KvFrom(q, *KvDType(q.dtype));
  } else {
    out->scores = ScoreFrom(*parts.at("prompt.score"));
  }
  if (history) {
    out->history_k = KvFrom(*parts.at("history.k"), dtype);
    out->history_v = KvFrom(*parts.at("history.v"), dtype);
    out->history_pos = PosFrom(*parts.at("history.pos"));
    if (parts.count("history.acc")) out->history_acc = ScoreFrom(*parts.at("history.acc"));
    if (parts.count("history.score")) out->history_score = ScoreFrom(*parts.at("history.score"));
    return absl::OkStatus();
  }
  if (parts.count("history.acc")) return Invalid(LayerName(l, "history.acc"), "given without history, expected none");
  if (parts.count("history.score")) {
    if (!options.on_parent) {
      return Invalid(LayerName(l, "history.score"),
                     "given without history, expected none (or a parent to compose on: kvrelayctl compress "
                     "--parent, or publish --parent)");
    }
    out->history_score = ScoreFrom(*parts.at("history.score"));
  }
  out->history_k = KvTensor(dtype, out->prompt_k.heads(), 0, out->prompt_k.dim());
  out->history_v = KvTensor(dtype, out->prompt_k.heads(), 0, out->prompt_k.dim());
  out->history_pos = PosTensor(out->prompt_k.heads(), 0);
  return absl::OkStatus();
}

// ValidateTurn, except that the history.score of a turn for a parent
// without history of its own covers the parent's tokens: its shape is
// checked when composed.
absl::Status ValidateReadTurn(bool history, const TurnFileOptions& options, Turn* turn) {
  if (history || !options.on_parent) return ValidateTurn(*turn);
  std::vector<ScoreMatrix> scores(turn->layers.size());
  for (size_t l = 0; l < turn->layers.size(); ++l) std::swap(scores[l], turn->layers[l].history_score);
  KVRELAY_RETURN_IF_ERROR(ValidateTurn(*turn));
  for (size_t l = 0; l < turn->layers.size(); ++l) std::swap(scores[l], turn->layers[l].history_score);
  return absl::OkStatus();
}

}  // namespace

bool IsMessageFile(const SafetensorsReader& file) {
  std::optional<absl::string_view> f = file.GetMetadata("format");
  return f && (*f == kMessageFormat || *f == kMessageFormatV1);
}

absl::StatusOr<Turn> TurnFromSafetensors(const SafetensorsReader& file, const TurnFileOptions& options) {
  if (IsMessageFile(file)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "file is a kvrelay message (metadata format=", *file.GetMetadata("format"), "), expected a turn"));
  }
  KVRELAY_ASSIGN_OR_RETURN(
      const std::vector<PartMap> layers,
      GroupByLayer(file, &IsTurnPart,
                   "layer.{l}.{prompt.k,prompt.v,gen.k,gen.v,prompt.score,gen.q,history.k,"
                   "history.v,history.pos,history.acc,history.score}"));
  KVRELAY_ASSIGN_OR_RETURN(const int history_layer, CheckTurnParts(layers));
  KVRELAY_ASSIGN_OR_RETURN(const DType dtype, CheckTurnDTypes(layers));
  Turn turn;
  KVRELAY_RETURN_IF_ERROR(ReadTurnMetadata(file, &turn));
  const bool history = history_layer >= 0;
  turn.layers.resize(layers.size());
  for (size_t l = 0; l < layers.size(); ++l) {
    KVRELAY_RETURN_IF_ERROR(ReadTurnLayer(layers[l], static_cast<int>(l), dtype, history, options, &turn.layers[l]));
  }
  KVRELAY_RETURN_IF_ERROR(ValidateReadTurn(history, options, &turn));
  return turn;
}

absl::StatusOr<Turn> ReadTurn(absl::Span<const uint8_t> bytes, const TurnFileOptions& options) {
  KVRELAY_ASSIGN_OR_RETURN(SafetensorsReader file, SafetensorsReader::ParseView(bytes));
  return TurnFromSafetensors(file, options);
}

absl::StatusOr<Turn> ReadTurnFile(const std::string& path, const TurnFileOptions& options) {
  KVRELAY_ASSIGN_OR_RETURN(SafetensorsReader file, SafetensorsReader::ReadFile(path));
  absl::StatusOr<Turn> turn = TurnFromSafetensors(file, options);
  if (!turn.ok()) return PrefixPath(path, turn.status());
  return turn;
}

namespace {

absl::StatusOr<std::pair<std::vector<StTensor>, StMetadata>> TurnTensors(const Turn& turn) {
  KVRELAY_RETURN_IF_ERROR(ValidateTurn(turn));
  const bool history = turn.layers[0].history_k.tokens() > 0;
  std::vector<StTensor> tensors;
  for (size_t i = 0; i < turn.layers.size(); ++i) {
    const int l = static_cast<int>(i);
    const TurnLayer& layer = turn.layers[i];
    tensors.push_back(KvView(LayerName(l, "prompt.k"), layer.prompt_k));
    tensors.push_back(KvView(LayerName(l, "prompt.v"), layer.prompt_v));
    tensors.push_back(KvView(LayerName(l, "gen.k"), layer.gen_k));
    tensors.push_back(KvView(LayerName(l, "gen.v"), layer.gen_v));
    if (layer.has_queries()) {
      tensors.push_back(KvView(LayerName(l, "gen.q"), layer.gen_q));
    } else {
      tensors.push_back(View(LayerName(l, "prompt.score"), StDType::kF32,
                             {layer.scores.rows, layer.scores.cols}, BytesOf(layer.scores.data)));
    }
    if (history) {
      tensors.push_back(KvView(LayerName(l, "history.k"), layer.history_k));
      tensors.push_back(KvView(LayerName(l, "history.v"), layer.history_v));
      tensors.push_back(PosView(LayerName(l, "history.pos"), layer.history_pos));
      for (auto [name, sc] : {std::pair<const char*, const ScoreMatrix*>{"history.acc", &layer.history_acc},
                              {"history.score", &layer.history_score}}) {
        if (sc->rows == 0 && sc->data.empty()) continue;
        tensors.push_back(View(LayerName(l, name), StDType::kF32, {sc->rows, sc->cols}, BytesOf(sc->data)));
      }
    }
  }
  StMetadata meta;
  meta["first_agent"] = turn.first_agent ? "true" : "false";
  if (!turn.history_anchors.empty()) meta["history_anchors"] = absl::StrJoin(turn.history_anchors, ",");
  if (turn.prompt_pos0) meta["prompt_pos0"] = absl::StrCat(*turn.prompt_pos0);
  // %.17g: the double reads back exactly.
  if (turn.softmax_scale) meta["softmax_scale"] = absl::StrFormat("%.17g", *turn.softmax_scale);
  return std::make_pair(std::move(tensors), std::move(meta));
}

}  // namespace

absl::Status WriteTurn(const Turn& turn, std::string* out) {
  KVRELAY_ASSIGN_OR_RETURN(auto tm, TurnTensors(turn));
  KVRELAY_ASSIGN_OR_RETURN(*out, SerializeSafetensors(tm.first, tm.second));
  return absl::OkStatus();
}

absl::Status WriteTurnFile(const Turn& turn, const std::string& path) {
  KVRELAY_ASSIGN_OR_RETURN(auto tm, TurnTensors(turn));
  return WriteSafetensorsFile(path, tm.first, tm.second);
}

// ---- Message ----

namespace {

constexpr absl::string_view kDenseParts[] = {"k", "v", "pos"};
constexpr absl::string_view kQuantParts[] = {"k.codes", "k.scale", "k.zero", "v.codes",
                                             "v.scale", "v.zero",  "pos"};
// lloyd: no zeros, except k.zero with keys=channel.
constexpr absl::string_view kLloydParts[] = {"k.codes", "k.scale", "v.codes", "v.scale", "pos"};
constexpr absl::string_view kLloydChannelParts[] = {"k.codes", "k.scale", "k.zero", "v.codes", "v.scale", "pos"};
constexpr absl::string_view kDemotedParts[] = {"demoted.k.codes", "demoted.k.norm", "demoted.v.codes",
                                               "demoted.v.norm"};

bool IsMessagePart(absl::string_view part) {
  return part == "acc" || std::find(std::begin(kDenseParts), std::end(kDenseParts), part) != std::end(kDenseParts) ||
         std::find(std::begin(kQuantParts), std::end(kQuantParts), part) != std::end(kQuantParts) ||
         std::find(std::begin(kDemotedParts), std::end(kDemotedParts), part) != std::end(kDemotedParts);
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Why a message tensor has the shape it has, for the reader's errors.
constexpr absl::string_view kGeometryWhy =
    "n = n_history + n_anchor + n_kept + n_gen; kv_heads and head_dim from layer.0";
constexpr absl::string_view kCodesWhy =
    "n = n_history + n_anchor + n_kept + n_gen; kv_heads and head_dim from layer.0; "
    "head_dim*quant_bits/8 bytes per row";
constexpr absl::string_view kGroupsWhy =
    "groups = ceil(n / quant_group); n = n_history + n_anchor + n_kept + n_gen; kv_heads and "
    "head_dim from layer.0";

// The buffer of a QuantizedTensor that a packed tensor holds.
enum class PackedField { kCodes, kScale, kZero };

// One tensor of a quantized K/V pair as a message file holds it.
struct PackedPart {
  absl::string_view part;  // after "layer.{l}.", e.g. "k.codes", "demoted.v.norm"
  bool key;                // of K, else of V
  PackedField field;
  StDType dtype;
  std::vector<int64_t> shape;
  absl::string_view why;  // the rule behind the shape
};

// The packed tensors of a quantized layer of n tokens per head, in file
// order, K's then V's: codes [H, n, head_dim*bits/8] U8, then scale F16
// and, for int and for lloyd keys=channel's keys, zero F16 of the scale's
// shape. Statistics are per row, [H, n], except the keys' of int and lloyd
// keys=channel: per group of quant_group tokens and channel, [H, ceil(n /
// quant_group), head_dim].
std::vector<PackedPart> QuantizedParts(QuantScheme scheme, bool keys_channel, int group, int k_bits,
                                       int v_bits, int64_t heads, int64_t n, int64_t dim) {
  const bool lloyd = scheme == QuantScheme::kLloyd;
  std::vector<PackedPart> parts;
  for (const bool key : {true, false}) {
    const bool grouped = key && (!lloyd || keys_channel);
    const std::vector<int64_t> stats =
        grouped ? std::vector<int64_t>{heads, CeilDiv(n, group), dim} : std::vector<int64_t>{heads, n};
    const absl::string_view stats_why = grouped ? kGroupsWhy : kGeometryWhy;
    const int64_t row = dim * (key ? k_bits : v_bits) / 8;
    parts.push_back({key ? "k.codes" : "v.codes", key, PackedField::kCodes, StDType::kU8, {heads, n, row}, kCodesWhy});
    parts.push_back({key ? "k.scale" : "v.scale", key, PackedField::kScale, StDType::kF16, stats, stats_why});
    if (!lloyd || (key && keys_channel)) {
      parts.push_back({key ? "k.zero" : "v.zero", key, PackedField::kZero, StDType::kF16, stats, stats_why});
    }
  }
  return parts;
}

// The demoted rows of a layer, nd per head, in file order: per K then V,
// codes [H, nd, head_dim*bits/8] U8 and norms [H, nd] F16.
std::vector<PackedPart> DemotedParts(int bits, int64_t heads, int64_t nd, int64_t dim) {
  const int64_t row = dim * bits / 8;
  std::vector<PackedPart> parts;
  for (const bool key : {true, false}) {
    parts.push_back({key ? "demoted.k.codes" : "demoted.v.codes", key, PackedField::kCodes, StDType::kU8,
                     {heads, nd, row}, "n_demoted; head_dim*demote_bits/8 bytes per row"});
    parts.push_back({key ? "demoted.k.norm" : "demoted.v.norm", key, PackedField::kScale, StDType::kF16,
                     {heads, nd}, "n_demoted"});
  }
  return parts;
}

absl::Span<const uint8_t> PackedBytes(const QuantizedKv& q, const PackedPart& p) {
  const QuantizedTensor& t = p.key ? q.k : q.v;
  switch (p.field) {
    case PackedField::kCodes:
      return t.codes;
    case PackedField::kScale:
      return BytesOf(t.scale);
    case PackedField::kZero:
      return BytesOf(t.zero);
  }
  return {};
}

// Views of layer `l`'s packed tensors `parts` of `q`.
void AppendPacked(int l, const QuantizedKv& q, const std::vector<PackedPart>& parts,
                  std::vector<StTensor>* tensors) {
  for (const PackedPart& p : parts) {
    tensors->push_back(View(LayerName(l, p.part), p.dtype, p.shape, PackedBytes(q, p)));
  }
}

// Checks the dtype and shape of each packed tensor of `parts`, in order,
// and copies them into `*q`.
absl::Status ReadPacked(const PartMap& parts, const std::vector<PackedPart>& specs, QuantizedKv* q) {
  for (const PackedPart& p : specs) {
    const StTensor& t = *parts.at(p.part);
    KVRELAY_RETURN_IF_ERROR(CheckDType(t, p.dtype));
    KVRELAY_RETURN_IF_ERROR(CheckShape(t, p.shape, p.why));
    QuantizedTensor& qt = p.key ? q->k : q->v;
    switch (p.field) {
      case PackedField::kCodes:
        qt.codes.assign(t.data.begin(), t.data.end());
        break;
      case PackedField::kScale:
        qt.scale = VectorFrom<uint16_t>(t);
        break;
      case PackedField::kZero:
        qt.zero = VectorFrom<uint16_t>(t);
        break;
    }
  }
  return absl::OkStatus();
}

// Sets the geometry of both tensors of `q`: `v_bits` for V, q->bits for K.
void SetPackedGeometry(int v_bits, int64_t heads, int64_t tokens, int64_t dim, QuantizedKv* q) {
  for (QuantizedTensor* qt : {&q->k, &q->v}) {
    qt->bits = qt == &q->k ? q->bits : v_bits;
    qt->heads = static_cast<int>(heads);
    qt->tokens = static_cast<int>(tokens);
    qt->dim = static_cast<int>(dim);
  }
}

// The geometry every layer of a message shares: kv heads, head_dim, and
// tokens per head, n (history, anchors, kept, generated) and nd (demoted).
struct MessageGeometry {
  int64_t heads = 0, dim = 0, n = 0, nd = 0;
  int64_t total() const { return n + nd; }
};

// The writer's message-wide checks: layers, token counts, layer 0's
// quantization options, n_demoted with demote_bits. Returns the geometry,
// from layer 0.
absl::StatusOr<MessageGeometry> CheckMessageToWrite(const Message& msg) {
  if (msg.layers.empty())
    return absl::InvalidArgumentError("message: no layers, expected at least 1");
  const int64_t counts[] = {msg.n_history, msg.n_anchor, msg.n_kept, msg.n_gen};
  for (int64_t c : counts) {
    if (c < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("message: token counts ", absl::StrJoin(counts, "/"),
                       " (history/anchor/kept/gen), expected non-negative"));
    }
  }
  const MessageLayer& l0 = msg.layers[0];
  MessageGeometry geo;
  geo.n = msg.n_history + msg.n_anchor + msg.n_kept + msg.n_gen;
  geo.nd = msg.n_demoted;
  geo.heads = l0.pos.heads;
  geo.dim = l0.quant ? l0.quant->k.dim : l0.k.dim();
  if (l0.quant) {
    if (absl::Status s = ValidateQuantOptions(OptionsOf(*l0.quant), static_cast<int>(geo.dim)); !s.ok()) {
      return Invalid("layer.0.k", s.message());
    }
  }
  if (geo.nd < 0 || (geo.nd > 0) != (msg.demote_bits != 0)) {
    return absl::InvalidArgumentError(absl::StrCat("message: n_demoted ", geo.nd, " with demote_bits ", msg.demote_bits,
                                                   ", expected both 0 or n_demoted >= 1 with bits 1..4"));
  }
  return geo;
}

// Layer l's demoted rows: lloyd rows of demote_bits bits, with layer 0's
// seed when its K/V are lloyd.
absl::Status AppendDemoted(const Message& msg, const MessageGeometry& geo, int l,
                           std::vector<StTensor>* tensors) {
  const MessageLayer& layer = msg.layers[l];
  const MessageLayer& l0 = msg.layers[0];
  const bool quant = l0.quant.has_value();
  const QuantizedKv& q = *layer.demoted;
  if (q.scheme != QuantScheme::kLloyd || q.keys_channel || q.bits != msg.demote_bits ||
      q.seed != (quant && l0.quant->scheme == QuantScheme::kLloyd ? l0.quant->seed : q.seed)) {
    return Invalid(LayerName(l, "demoted.k.codes"),
                   absl::StrCat("expected lloyd rows of demote_bits ", msg.demote_bits, " bits"));
  }
  if (absl::Status s = CheckQuantizedShape(q, static_cast<int>(geo.heads), static_cast<int>(geo.nd),
                                           static_cast<int>(geo.dim));
      !s.ok()) {
    return Invalid(LayerName(l, "demoted"), s.message());
  }
  AppendPacked(l, q, DemotedParts(q.bits, geo.heads, geo.nd, geo.dim), tensors);
  return absl::OkStatus();
}

// Layer l's quantized K/V: layer 0's options (lloyd layers may differ in
// bits, nothing else).
absl::Status AppendQuantized(const Message& msg, const MessageGeometry& geo, int l,
                             std::vector<StTensor>* tensors) {
  const QuantizedKv& q = *msg.layers[l].quant;
  const QuantizedKv& q0 = *msg.layers[0].quant;
  const bool lloyd = q0.scheme == QuantScheme::kLloyd;
  if (q.scheme != q0.scheme || (!lloyd && q.bits != q0.bits) || q.group != q0.group || q.rotate != q0.rotate ||
      q.keys_channel != q0.keys_channel || q.seed != q0.seed) {
    return Invalid(LayerName(l, "k"),
                   absl::StrCat("quantization bits=", q.bits, " group=", q.group,
                                " rotate=", q.rotate, ", expected bits=", q0.bits,
                                " group=", q0.group, " rotate=", q0.rotate, " like layer.0"));
  }
  if (absl::Status s = CheckQuantizedShape(q, static_cast<int>(geo.heads), static_cast<int>(geo.n),
                                           static_cast<int>(geo.dim));
      !s.ok()) {
    return Invalid(LayerName(l, "k"), s.message());
  }
  AppendPacked(l, q, QuantizedParts(q0.scheme, q0.keys_channel, q0.group, q.bits, q.VBits(), geo.heads, geo.n, geo.dim),
               tensors);
  return absl::OkStatus();
}

// Layer l's dense K/V, in the message dtype.
absl::Status AppendDense(const Message& msg, const MessageGeometry& geo, int l, std::vector<StTensor>* tensors) {
  const MessageLayer& layer = msg.layers[l];
  for (const auto& [t, part] : {std::pair<const KvTensor*, const char*>{&layer.k, "k"}, {&layer.v, "v"}}) {
    if (t->dtype() != msg.dtype) {
      return Invalid(LayerName(l, part),
                     absl::StrCat("dtype ", DTypeName(t->dtype()), ", expected ",
                                  DTypeName(msg.dtype), " (message dtype)"));
    }
    if (t->heads() != geo.heads || t->tokens() != geo.n || t->dim() != geo.dim) {
      return Invalid(LayerName(l, part),
                     absl::StrCat("shape [", t->heads(), ",", t->tokens(), ",", t->dim(),
                                  "], expected [", geo.heads, ",", geo.n, ",", geo.dim, "]"));
    }
  }
  tensors->push_back(KvView(LayerName(l, "k"), layer.k));
  tensors->push_back(KvView(LayerName(l, "v"), layer.v));
  return absl::OkStatus();
}

// Layer l's tensors in file order: demoted rows, K/V (packed or dense),
// positions, acc (in every layer or none).
absl::Status AppendMessageLayer(const Message& msg, const MessageGeometry& geo, int l,
                                std::vector<StTensor>* tensors) {
  const MessageLayer& layer = msg.layers[l];
  const MessageLayer& l0 = msg.layers[0];
  const bool quant = l0.quant.has_value();
  const int64_t heads = geo.heads, total = geo.total();
  if (layer.quant.has_value() != quant) {
    return Invalid(LayerName(l, "k"),
                   absl::StrCat(layer.quant ? "quantized" : "dense", ", expected ",
                                quant ? "quantized" : "dense", " like layer.0"));
  }
  if (layer.pos.heads != heads || layer.pos.tokens != total ||
      layer.pos.data.size() != static_cast<size_t>(heads) * total) {
    return Invalid(
        LayerName(l, "pos"),
        absl::StrCat("shape [", layer.pos.heads, ",", layer.pos.tokens, "], expected [", heads,
                     ",", total, "] (n_history + n_anchor + n_kept + n_gen + n_demoted)"));
  }
  if (layer.demoted_tokens() != geo.nd) {
    return Invalid(LayerName(l, "demoted.k.codes"),
                   absl::StrCat(layer.demoted_tokens(), " demoted tokens, expected n_demoted ", geo.nd));
  }
  if (layer.demoted) KVRELAY_RETURN_IF_ERROR(AppendDemoted(msg, geo, l, tensors));
  KVRELAY_RETURN_IF_ERROR(quant ? AppendQuantized(msg, geo, l, tensors) : AppendDense(msg, geo, l, tensors));
  tensors->push_back(PosView(LayerName(l, "pos"), layer.pos));
  if (!layer.acc.empty() || !l0.acc.empty() || total == 0) {  // no tokens: an empty acc is an acc
    if (layer.acc.size() != static_cast<size_t>(heads) * total) {
      return Invalid(LayerName(l, "acc"), absl::StrCat(layer.acc.size(), " values, expected ", heads * total,
                                                       " ([kv_heads, n + n_demoted], in every layer or none)"));
    }
    tensors->push_back(View(LayerName(l, "acc"), StDType::kF32, {heads, total}, BytesOf(layer.acc)));
  }
  return absl::OkStatus();
}

StMetadata MessageMetadata(const Message& msg) {
  const MessageLayer& l0 = msg.layers[0];
  StMetadata meta;
  meta["format"] = kMessageFormat;
  meta["policy"] = msg.policy;
  meta["dtype"] = std::string(DTypeName(msg.dtype));
  meta["n_history"] = absl::StrCat(msg.n_history);
  meta["n_anchor"] = absl::StrCat(msg.n_anchor);
  meta["n_kept"] = absl::StrCat(msg.n_kept);
  meta["n_gen"] = absl::StrCat(msg.n_gen);
  meta["full_bytes"] = absl::StrCat(msg.full_bytes);
  meta["sent_bytes"] = absl::StrCat(msg.sent_bytes);
  meta["next_pos"] = absl::StrCat(NextPosition(msg));
  // %.17g: the double reads back exactly.
  if (msg.attention_error) meta["attention_error"] = absl::StrFormat("%.17g", *msg.attention_error);
  meta["anchor_pos"] = absl::StrJoin(msg.anchor_pos, ",");
  if (l0.granularity != Granularity::kNone) {
    std::vector<std::string> g;
    for (const MessageLayer& layer : msg.layers) g.push_back(GranularityName(layer.granularity));
    meta["granularity"] = absl::StrJoin(g, ",");
  }
  if (l0.quant) {
    meta["quant_bits"] = absl::StrCat(l0.quant->bits);
    meta["quant_group"] = absl::StrCat(l0.quant->group);
    meta["quant_rotate"] = l0.quant->rotate ? "true" : "false";
    if (l0.quant->scheme == QuantScheme::kLloyd) {
      meta["quant_scheme"] = "lloyd";
      meta["quant_seed"] = absl::StrCat(l0.quant->seed);
      meta["quant_keys"] = l0.quant->keys_channel ? "channel" : "row";
      std::vector<std::pair<int, int>> layer_bits;
      bool uniform = true;
      for (const MessageLayer& layer : msg.layers) {
        layer_bits.emplace_back(layer.quant->bits, layer.quant->VBits());
        uniform = uniform && layer_bits.back() == std::make_pair(l0.quant->bits, l0.quant->bits);
      }
      if (!uniform) meta["quant_layer_bits"] = FormatLayerBits(layer_bits);
    }
  }
  if (msg.n_demoted > 0) {
    meta["n_demoted"] = absl::StrCat(msg.n_demoted);
    meta["demote_bits"] = absl::StrCat(msg.demote_bits);
  }
  return meta;
}

absl::StatusOr<std::pair<std::vector<StTensor>, StMetadata>> MessageTensors(const Message& msg) {
  KVRELAY_ASSIGN_OR_RETURN(const MessageGeometry geo, CheckMessageToWrite(msg));
  std::vector<StTensor> tensors;
  uint64_t sent = 0;
  for (size_t l = 0; l < msg.layers.size(); ++l) {
    KVRELAY_RETURN_IF_ERROR(AppendMessageLayer(msg, geo, static_cast<int>(l), &tensors));
    sent += msg.layers[l].SentBytes();
  }
  if (sent != msg.sent_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("message: sent_bytes ", msg.sent_bytes, ", expected ", sent,
                     " (the bytes of the message's K/V and positions)"));
  }
  return std::make_pair(std::move(tensors), MessageMetadata(msg));
}

}  // namespace

absl::Status WriteMessage(const Message& msg, std::string* out) {
  KVRELAY_ASSIGN_OR_RETURN(auto tm, MessageTensors(msg));
  KVRELAY_ASSIGN_OR_RETURN(*out, SerializeSafetensors(tm.first, tm.second));
  return absl::OkStatus();
}

uint64_t MessagePieces::size() const {
  uint64_t n = header.size();
  for (absl::Span<const uint8_t> t : tensors) n += t.size();
  return n;
}

absl::StatusOr<MessagePieces> SerializeMessagePieces(const Message& msg) {
  KVRELAY_ASSIGN_OR_RETURN(auto tm, MessageTensors(msg));
  MessagePieces out;
  KVRELAY_ASSIGN_OR_RETURN(out.header, SafetensorsHeader(tm.first, tm.second));
  out.tensors.reserve(tm.first.size());
  for (const StTensor& t : tm.first) out.tensors.push_back(t.data);
  return out;
}

absl::Status WriteMessageFile(const Message& msg, const std::string& path) {
  KVRELAY_ASSIGN_OR_RETURN(auto tm, MessageTensors(msg));
  return WriteSafetensorsFile(path, tm.first, tm.second);
}

namespace {

// anchor_pos and granularity. A v1 file has no anchor_pos: its own anchor
// part's ids, when every head of every layer holds them once (else none).
absl::Status ReadAnchorsAndGranularity(const SafetensorsReader& file, bool v1, Message* msg) {
  const MessageLayer& l0 = msg->layers[0];
  if (v1) {
    for (int j = 0; j < msg->n_anchor; ++j) msg->anchor_pos.push_back(l0.pos.at(0, msg->n_history + j));
    if (!CheckMessageAnchors(*msg, "").ok()) msg->anchor_pos.clear();
    return absl::OkStatus();
  }
  std::optional<absl::string_view> a = file.GetMetadata("anchor_pos");
  if (!a) return absl::InvalidArgumentError("metadata anchor_pos: missing, expected comma-separated position ids");
  KVRELAY_ASSIGN_OR_RETURN(msg->anchor_pos, ParsePositionList("anchor_pos", *a));
  KVRELAY_RETURN_IF_ERROR(CheckMessageAnchors(*msg, "metadata anchor_pos"));
  if (std::optional<absl::string_view> g = file.GetMetadata("granularity")) {
    std::vector<absl::string_view> items = absl::StrSplit(*g, ',');
    if (items.size() != msg->layers.size()) {
      return absl::InvalidArgumentError(absl::StrCat("metadata granularity: ", items.size(), " items, expected ",
                                                     msg->layers.size(), " (one per layer)"));
    }
    for (size_t l = 0; l < items.size(); ++l) {
      if (items[l] == "head") {
        msg->layers[l].granularity = Granularity::kHead;
      } else if (items[l] == "layer") {
        msg->layers[l].granularity = Granularity::kLayer;
      } else {
        return absl::InvalidArgumentError(absl::StrCat("metadata granularity: item ", l, " is ", Quote(items[l]),
                                                       ", expected head or layer"));
      }
    }
  }
  return absl::OkStatus();
}


// The metadata every message has: format, policy, dtype, token counts,
// attention_error, full_bytes and sent_bytes. Returns whether the file is
// a version 1 file.
absl::StatusOr<bool> ReadMessageBasics(const SafetensorsReader& file, Message* msg) {
  std::optional<absl::string_view> format = file.GetMetadata("format");
  if (!format) {
    return absl::InvalidArgumentError(absl::StrCat("metadata format: missing, expected \"",
                                                   kMessageFormat, "\" (is this a turn?)"));
  }
  if (*format != kMessageFormat && *format != kMessageFormatV1) {
    return absl::InvalidArgumentError(absl::StrCat("metadata format: ", Quote(*format), ", expected \"",
                                                   kMessageFormat, "\" or \"", kMessageFormatV1, "\""));
  }
  std::optional<absl::string_view> policy = file.GetMetadata("policy");
  if (!policy)
    return absl::InvalidArgumentError("metadata policy: missing, expected a pipeline spec");
  msg->policy = std::string(*policy);
  std::optional<absl::string_view> dt = file.GetMetadata("dtype");
  if (!dt) return absl::InvalidArgumentError("metadata dtype: missing, expected F32, F16 or BF16");
  std::optional<DType> dtype = ParseDType(*dt);
  if (!dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat("metadata dtype: ", Quote(*dt), ", expected F32, F16 or BF16"));
  }
  msg->dtype = *dtype;
  const uint64_t kMaxInt = std::numeric_limits<int>::max();
  const std::string count = "a decimal integer >= 0";
  KVRELAY_ASSIGN_OR_RETURN(uint64_t nh, ParseCount(file, "n_history", kMaxInt, count));
  KVRELAY_ASSIGN_OR_RETURN(uint64_t na, ParseCount(file, "n_anchor", kMaxInt, count));
  KVRELAY_ASSIGN_OR_RETURN(uint64_t nk, ParseCount(file, "n_kept", kMaxInt, count));
  KVRELAY_ASSIGN_OR_RETURN(uint64_t ng, ParseCount(file, "n_gen", kMaxInt, count));
  msg->n_history = static_cast<int>(nh);
  msg->n_anchor = static_cast<int>(na);
  msg->n_kept = static_cast<int>(nk);
  msg->n_gen = static_cast<int>(ng);
  const uint64_t kMaxU64 = std::numeric_limits<uint64_t>::max();
  if (std::optional<absl::string_view> e = file.GetMetadata("attention_error")) {
    double v;
    if (!absl::SimpleAtod(*e, &v) || !std::isfinite(v) || v < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("metadata attention_error: ", Quote(*e), ", expected a finite decimal number >= 0"));
    }
    msg->attention_error = v;
  }
  KVRELAY_ASSIGN_OR_RETURN(msg->full_bytes, ParseCount(file, "full_bytes", kMaxU64, count));
  KVRELAY_ASSIGN_OR_RETURN(msg->sent_bytes, ParseCount(file, "sent_bytes", kMaxU64, count));
  const int64_t n = static_cast<int64_t>(nh + na + nk + ng);
  if (n > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("metadata n_*: ", n, " tokens in all, expected below 2^31"));
  }
  return *format == kMessageFormatV1;
}

// A message's quantization metadata (quant_* keys).
struct QuantMetadata {
  bool quant = false;  // quant_bits, quant_group, quant_rotate: all or none
  QuantScheme scheme = QuantScheme::kInt;
  int bits = 0, group = 0;
  bool rotate = false;
  bool keys_channel = false;
  uint64_t seed = kDefaultLloydSeed;
  bool lloyd() const { return scheme == QuantScheme::kLloyd; }
};

absl::StatusOr<QuantMetadata> ReadQuantMetadata(const SafetensorsReader& file) {
  QuantMetadata qm;
  qm.quant = file.GetMetadata("quant_bits") || file.GetMetadata("quant_group") ||
             file.GetMetadata("quant_rotate");
  if (std::optional<absl::string_view> v = file.GetMetadata("quant_scheme")) {
    if (*v == "lloyd") {
      qm.scheme = QuantScheme::kLloyd;
    } else if (*v != "int") {
      return absl::InvalidArgumentError(absl::StrCat("metadata quant_scheme: ", Quote(*v), ", expected int or lloyd"));
    }
    if (!qm.quant) return absl::InvalidArgumentError("metadata quant_scheme: given without quant_bits");
  }
  if (!qm.quant) return qm;
  const bool lloyd = qm.lloyd();
  KVRELAY_ASSIGN_OR_RETURN(uint64_t b, ParseCount(file, "quant_bits", 64, lloyd ? "1..4" : "2, 4 or 8"));
  if (lloyd ? (b < 1 || b > 4) : (b != 2 && b != 4 && b != 8)) {
    return absl::InvalidArgumentError(
        absl::StrCat("metadata quant_bits: \"", b, "\", expected ", lloyd ? "1..4 (lloyd)" : "2, 4 or 8"));
  }
  KVRELAY_ASSIGN_OR_RETURN(qm.rotate, ParseBool(file, "quant_rotate", std::nullopt));
  if (lloyd) {
    std::optional<absl::string_view> keys = file.GetMetadata("quant_keys");
    if (!keys || (*keys != "row" && *keys != "channel")) {
      return absl::InvalidArgumentError(absl::StrCat("metadata quant_keys: ", keys ? Quote(*keys) : "missing",
                                                     ", expected row or channel (quant_scheme lloyd)"));
    }
    qm.keys_channel = *keys == "channel";
    KVRELAY_ASSIGN_OR_RETURN(qm.seed, ParseCount(file, "quant_seed", std::numeric_limits<uint64_t>::max(),
                                                 "a decimal uint64 (quant_scheme lloyd)"));
  }
  KVRELAY_ASSIGN_OR_RETURN(uint64_t g, ParseCount(file, "quant_group", std::numeric_limits<int>::max(),
                                                  "a decimal integer >= 1"));
  if (g < 1 && (!lloyd || qm.keys_channel)) {
    return absl::InvalidArgumentError(
        "metadata quant_group: \"0\", expected a decimal integer >= 1");
  }
  qm.bits = static_cast<int>(b);
  qm.group = static_cast<int>(g);
  return qm;
}

// n_demoted and demote_bits (both or neither), and the tokens in all
// (n = n_history + n_anchor + n_kept + n_gen, plus n_demoted) below 2^31.
absl::Status ReadDemoteMetadata(const SafetensorsReader& file, int64_t n, Message* msg) {
  int64_t nd = 0;
  int demote_bits = 0;
  if (file.GetMetadata("n_demoted") || file.GetMetadata("demote_bits")) {
    KVRELAY_ASSIGN_OR_RETURN(uint64_t c, ParseCount(file, "n_demoted", std::numeric_limits<int>::max(),
                                                    "a decimal integer >= 1"));
    KVRELAY_ASSIGN_OR_RETURN(uint64_t b, ParseCount(file, "demote_bits", 4, "1..4"));
    if (c < 1 || b < 1) {
      return absl::InvalidArgumentError(absl::StrCat("metadata n_demoted/demote_bits: ", c, "/", b,
                                                     ", expected >= 1 and 1..4 (or neither key)"));
    }
    nd = static_cast<int64_t>(c);
    demote_bits = static_cast<int>(b);
  }
  if (n + nd > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("metadata n_*: ", n + nd, " tokens in all, expected below 2^31"));
  }
  msg->n_demoted = static_cast<int>(nd);
  msg->demote_bits = demote_bits;
  return absl::OkStatus();
}

// The tensors each layer holds, by the quant_* and n_demoted metadata, in
// every layer and nothing else; acc in every layer or none (none in v1).
absl::Status CheckMessageParts(const std::vector<PartMap>& layers, const QuantMetadata& qm, bool demoted,
                               bool v1) {
  std::vector<absl::string_view> expected_parts;
  if (!qm.quant) {
    expected_parts.assign(std::begin(kDenseParts), std::end(kDenseParts));
  } else if (!qm.lloyd()) {
    expected_parts.assign(std::begin(kQuantParts), std::end(kQuantParts));
  } else if (qm.keys_channel) {
    expected_parts.assign(std::begin(kLloydChannelParts), std::end(kLloydChannelParts));
  } else {
    expected_parts.assign(std::begin(kLloydParts), std::end(kLloydParts));
  }
  if (demoted) expected_parts.insert(expected_parts.end(), std::begin(kDemotedParts), std::end(kDemotedParts));
  const absl::string_view* parts_begin = expected_parts.data();
  const absl::string_view* parts_end = expected_parts.data() + expected_parts.size();
  for (int l = 0; l < static_cast<int>(layers.size()); ++l) {
    for (const auto& [part, t] : layers[l]) {
      if (part != "acc" && std::find(parts_begin, parts_end, part) == parts_end) {
        return Invalid(t->name, absl::StrCat("unexpected in this message (by its quant_* and n_demoted "
                                             "metadata), expected ", absl::StrJoin(expected_parts, ", ")));
      }
    }
    for (const absl::string_view* p = parts_begin; p != parts_end; ++p) {
      if (!layers[l].count(*p)) {
        return Invalid(LayerName(l, *p), "missing, required in every layer");
      }
    }
    if (layers[l].count("acc") != layers[0].count("acc")) {
      return Invalid(LayerName(l, "acc"), layers[0].count("acc") ? "missing, expected in every layer like layer.0"
                                                                 : "given, expected in no layer like layer.0");
    }
    if (v1 && layers[l].count("acc")) {
      return Invalid(LayerName(l, "acc"), absl::StrCat("unexpected in a ", kMessageFormatV1, " file"));
    }
  }
  return absl::OkStatus();
}

// lloyd: per layer, the keys' and values' bits (quant_layer_bits, else
// quant_bits).
absl::StatusOr<std::vector<std::pair<int, int>>> ReadLayerBits(const SafetensorsReader& file,
                                                               const QuantMetadata& qm, int num_layers) {
  std::optional<absl::string_view> v = file.GetMetadata("quant_layer_bits");
  if (!v) return std::vector<std::pair<int, int>>(num_layers, {qm.bits, qm.bits});
  if (!qm.lloyd()) return absl::InvalidArgumentError("metadata quant_layer_bits: given, expected it only with quant_scheme lloyd");
  absl::StatusOr<std::vector<std::pair<int, int>>> parsed = ParseLayerBits(*v);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("metadata quant_layer_bits: ", parsed.status().message()));
  }
  if (parsed->size() != static_cast<size_t>(num_layers)) {
    return absl::InvalidArgumentError(absl::StrCat("metadata quant_layer_bits: ", parsed->size(),
                                                   " layers, expected one per layer (", num_layers, ")"));
  }
  return parsed;
}

// kv_heads from layer.0.pos; the layer count; head_dim from k.scale (int,
// lloyd keys=channel), k.codes' row bytes (lloyd rows) or k.
absl::Status ReadMessageGeometry(const std::vector<PartMap>& layers, const QuantMetadata& qm,
                                 int first_key_bits, Message* msg) {
  const StTensor& pos0 = *layers[0].at("pos");
  KVRELAY_RETURN_IF_ERROR(CheckDType(pos0, StDType::kI32));
  KVRELAY_RETURN_IF_ERROR(CheckRank(pos0, 2, "[kv_heads, n]"));
  const int64_t heads = pos0.shape[0];
  if (heads < 1 || heads > kMaxKvHeads)
    return Invalid(pos0.name, absl::StrCat("shape ", ShapeString(pos0.shape), ", expected 1..",
                                           kMaxKvHeads, " kv heads"));
  const int num_layers = static_cast<int>(layers.size());
  if (num_layers > kMaxLayers) {
    return Invalid(LayerName(num_layers - 1, "pos"),
                   absl::StrCat(num_layers, " layers, expected at most ", kMaxLayers));
  }
  const bool dim_from_codes = qm.lloyd() && !qm.keys_channel;
  const StTensor& dim_ref = *layers[0].at(dim_from_codes ? "k.codes" : qm.quant ? "k.scale" : "k");
  KVRELAY_RETURN_IF_ERROR(CheckRank(dim_ref, 3,
                                    dim_from_codes ? "[kv_heads, n, head_dim*quant_bits/8]"
                                    : qm.quant     ? "[kv_heads, groups, head_dim]"
                                                   : "[kv_heads, n, head_dim]"));
  const int64_t dim = dim_from_codes ? dim_ref.shape[2] * 8 / first_key_bits : dim_ref.shape[2];
  if (dim < 1 || dim > kMaxHeadDim || (qm.quant && (dim * qm.bits) % 8 != 0)) {
    return Invalid(dim_ref.name,
                   absl::StrCat("shape ", ShapeString(dim_ref.shape), ", expected head_dim in 1..",
                                kMaxHeadDim,
                                qm.quant ? " with head_dim*quant_bits a multiple of 8" : ""));
  }
  msg->kv_heads = static_cast<int>(heads);
  msg->head_dim = static_cast<int>(dim);
  return absl::OkStatus();
}

// Something can decode the K/V and the demoted rows at head_dim `dim`
// (e.g. not rotate with 8 bits or an odd head_dim).
absl::Status CheckDecodable(const QuantMetadata& qm, const std::vector<std::pair<int, int>>& layer_bits,
                            int demote_bits, int dim) {
  if (qm.quant) {
    QuantOptions qo;
    qo.scheme = qm.scheme;
    qo.bits = qm.bits;
    qo.group = qm.group;
    qo.rotate = qm.rotate;
    qo.keys_channel = qm.keys_channel;
    for (const auto& [kb, vb] : layer_bits) {
      qo.bits = kb;
      qo.v_bits = vb == kb ? 0 : vb;
      if (absl::Status s = ValidateQuantOptions(qo, dim); !s.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("metadata quant_*: ", s.message()));
      }
    }
  }
  if (demote_bits > 0) {
    QuantOptions qo;
    qo.scheme = QuantScheme::kLloyd;
    qo.bits = demote_bits;
    if (absl::Status s = ValidateQuantOptions(qo, dim); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("metadata demote_bits: ", s.message()));
    }
  }
  return absl::OkStatus();
}

// Layer l's positions and, when present, its attention masses (finite,
// >= 0), both [kv_heads, n + n_demoted].
absl::Status ReadPosAndAcc(const PartMap& parts, const MessageGeometry& geo, MessageLayer* out) {
  const int64_t total = geo.total();
  const StTensor& pos = *parts.at("pos");
  KVRELAY_RETURN_IF_ERROR(CheckDType(pos, StDType::kI32));
  KVRELAY_RETURN_IF_ERROR(CheckShape(pos, {geo.heads, total}, kGeometryWhy));
  out->pos = PosFrom(pos);
  if (!parts.count("acc")) return absl::OkStatus();
  const StTensor& acc = *parts.at("acc");
  KVRELAY_RETURN_IF_ERROR(CheckDType(acc, StDType::kF32));
  KVRELAY_RETURN_IF_ERROR(CheckShape(acc, {geo.heads, total}, kGeometryWhy));
  out->acc = VectorFrom<float>(acc);
  for (size_t i = 0; i < out->acc.size(); ++i) {
    if (!std::isfinite(out->acc[i]) || out->acc[i] < 0) {
      return Invalid(acc.name, absl::StrFormat("value %g at [%d,%d], expected a finite mass >= 0", out->acc[i],
                                               static_cast<int>(i / total), static_cast<int>(i % total)));
    }
  }
  return absl::OkStatus();
}

// Layer l of a message file, checked: positions, acc, demoted rows, then
// the K/V, packed by `qm` with `bits` (keys', values') or dense.
absl::Status ReadMessageLayer(const PartMap& parts, const Message& msg, const MessageGeometry& geo,
                              const QuantMetadata& qm, std::pair<int, int> bits, MessageLayer* out) {
  KVRELAY_RETURN_IF_ERROR(ReadPosAndAcc(parts, geo, out));
  if (geo.nd > 0) {
    QuantizedKv q;
    q.scheme = QuantScheme::kLloyd;
    q.bits = msg.demote_bits;
    q.seed = qm.seed;
    q.dtype = msg.dtype;
    KVRELAY_RETURN_IF_ERROR(ReadPacked(parts, DemotedParts(msg.demote_bits, geo.heads, geo.nd, geo.dim), &q));
    SetPackedGeometry(msg.demote_bits, geo.heads, geo.nd, geo.dim, &q);
    out->demoted = std::move(q);
  }
  if (qm.quant) {
    const auto [k_bits, v_bits] = bits;
    QuantizedKv q;
    q.scheme = qm.scheme;
    q.bits = k_bits;
    q.v_bits = v_bits == k_bits ? 0 : v_bits;
    q.group = qm.group;
    q.rotate = qm.rotate;
    q.keys_channel = qm.keys_channel;
    q.seed = qm.lloyd() ? qm.seed : 0;
    q.dtype = msg.dtype;
    KVRELAY_RETURN_IF_ERROR(ReadPacked(
        parts, QuantizedParts(qm.scheme, qm.keys_channel, qm.group, k_bits, v_bits, geo.heads, geo.n, geo.dim), &q));
    SetPackedGeometry(v_bits, geo.heads, geo.n, geo.dim, &q);
    out->quant = std::move(q);
    return absl::OkStatus();
  }
  for (const char* part : {"k", "v"}) {
    const StTensor& t = *parts.at(part);
    KVRELAY_RETURN_IF_ERROR(CheckDType(t, ToStDType(msg.dtype), "metadata dtype"));
    KVRELAY_RETURN_IF_ERROR(CheckShape(t, {geo.heads, geo.n, geo.dim}, kGeometryWhy));
  }
  out->k = KvFrom(*parts.at("k"), msg.dtype);
  out->v = KvFrom(*parts.at("v"), msg.dtype);
  return absl::OkStatus();
}

// next_pos, optional (files before the key read as 1 + the largest
// position id held): at least that.
absl::Status ReadNextPos(const SafetensorsReader& file, Message* msg) {
  const int64_t held_end = HeldEnd(*msg);
  msg->next_pos = held_end;
  if (!file.GetMetadata("next_pos")) return absl::OkStatus();
  const std::string expected =
      absl::StrCat("a decimal integer ", held_end, "..2^31 (1 + the largest position id held, or more)");
  KVRELAY_ASSIGN_OR_RETURN(uint64_t next, ParseCount(file, "next_pos", uint64_t{1} << 31, expected));
  if (static_cast<int64_t>(next) < held_end) {
    return absl::InvalidArgumentError(absl::StrCat("metadata next_pos: \"", next, "\", expected ", expected));
  }
  msg->next_pos = static_cast<int64_t>(next);
  return absl::OkStatus();
}
}  // namespace

absl::StatusOr<Message> MessageFromSafetensors(const SafetensorsReader& file) {
  Message msg;
  KVRELAY_ASSIGN_OR_RETURN(const bool v1, ReadMessageBasics(file, &msg));
  KVRELAY_ASSIGN_OR_RETURN(const QuantMetadata qm, ReadQuantMetadata(file));
  MessageGeometry geo;
  geo.n = int64_t{msg.n_history} + msg.n_anchor + msg.n_kept + msg.n_gen;
  KVRELAY_RETURN_IF_ERROR(ReadDemoteMetadata(file, geo.n, &msg));
  geo.nd = msg.n_demoted;

  KVRELAY_ASSIGN_OR_RETURN(
      const std::vector<PartMap> layers,
      GroupByLayer(file, &IsMessagePart,
                   "layer.{l}.{k,v,pos} or layer.{l}.{k.codes,k.scale,k.zero,v.codes,v.scale,"
                   "v.zero,pos}"));
  KVRELAY_RETURN_IF_ERROR(CheckMessageParts(layers, qm, geo.nd > 0, v1));
  const int num_layers = static_cast<int>(layers.size());
  KVRELAY_ASSIGN_OR_RETURN(const auto layer_bits, ReadLayerBits(file, qm, num_layers));
  KVRELAY_RETURN_IF_ERROR(ReadMessageGeometry(layers, qm, layer_bits[0].first, &msg));
  geo.heads = msg.kv_heads;
  geo.dim = msg.head_dim;
  KVRELAY_RETURN_IF_ERROR(CheckDecodable(qm, layer_bits, msg.demote_bits, msg.head_dim));

  msg.layers.resize(num_layers);
  uint64_t sent = 0;
  for (int l = 0; l < num_layers; ++l) {
    KVRELAY_RETURN_IF_ERROR(ReadMessageLayer(layers[l], msg, geo, qm, layer_bits[l], &msg.layers[l]));
    sent += msg.layers[l].SentBytes();
  }
  if (sent != msg.sent_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("metadata sent_bytes: \"", msg.sent_bytes, "\", expected \"", sent,
                     "\" (the bytes of the message's K/V and positions)"));
  }
  KVRELAY_RETURN_IF_ERROR(ReadNextPos(file, &msg));
  KVRELAY_RETURN_IF_ERROR(ReadAnchorsAndGranularity(file, v1, &msg));
  return msg;
}

absl::StatusOr<Message> ReadMessage(absl::Span<const uint8_t> bytes) {
  KVRELAY_ASSIGN_OR_RETURN(SafetensorsReader file, SafetensorsReader::ParseView(bytes));
  return MessageFromSafetensors(file);
}

absl::StatusOr<Message> ReadMessageFile(const std::string& path) {
  KVRELAY_ASSIGN_OR_RETURN(SafetensorsReader file, SafetensorsReader::ReadFile(path));
  absl::StatusOr<Message> msg = MessageFromSafetensors(file);
  if (!msg.ok()) return PrefixPath(path, msg.status());
  return msg;
}

}  // namespace kvrelay
