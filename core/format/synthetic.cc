#include "core/format/synthetic.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace kvrelay {
namespace {

// splitmix64: small, fast, and the same everywhere.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in (0, 1).
  double Uniform() { return (static_cast<double>(Next() >> 11) + 0.5) * 0x1.0p-53; }
  // Standard normal (Box-Muller, one value per call for simplicity).
  double Normal() {
    const double u1 = Uniform(), u2 = Uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  uint64_t state_;
};

uint64_t Mix(uint64_t seed, uint64_t a, uint64_t b) {
  Rng r(seed ^ (a * 0x9e3779b97f4a7c15ull) ^ (b * 0xc2b2ae3d27d4eb4full));
  return r.Next();
}

struct HeadModel {
  std::vector<float> basis;       // [rank, d] value basis
  std::vector<float> coef_scale;  // [rank]
  std::vector<float> k_bias;      // [d]
  std::vector<float> k_scale;     // [d]
};

HeadModel MakeHeadModel(Rng& rng, int d, int rank) {
  HeadModel m;
  m.basis.resize(static_cast<size_t>(rank) * d);
  for (float& x : m.basis) x = static_cast<float>(rng.Normal() / std::sqrt(static_cast<double>(d)));
  m.coef_scale.resize(rank);
  for (int i = 0; i < rank; ++i) m.coef_scale[i] = static_cast<float>(2.0 / (1.0 + i));
  m.k_bias.resize(d);
  m.k_scale.resize(d);
  for (int c = 0; c < d; ++c) {
    m.k_bias[c] = static_cast<float>(0.5 * rng.Normal());
    m.k_scale[c] = static_cast<float>(0.5 + rng.Uniform());
  }
  // A few outlier channels, as in real keys.
  const int outliers = std::max(1, d / 32);
  for (int i = 0; i < outliers; ++i) {
    const int c = static_cast<int>(rng.Next() % static_cast<uint64_t>(d));
    m.k_scale[c] *= 8.0f;
    m.k_bias[c] *= 4.0f;
  }
  return m;
}

// Fills `tokens` rows of head h of k and v.
void FillRows(Rng& rng, const HeadModel& m, int h, int tokens, int rank, KvTensor* k, KvTensor* v) {
  const int d = k->dim();
  std::vector<float> row(d), coef(rank);
  for (int t = 0; t < tokens; ++t) {
    for (int c = 0; c < d; ++c) {
      row[c] = static_cast<float>(m.k_bias[c] + m.k_scale[c] * rng.Normal());
    }
    k->WriteRow(h, t, row.data());
    for (int i = 0; i < rank; ++i) coef[i] = static_cast<float>(m.coef_scale[i] * rng.Normal());
    for (int c = 0; c < d; ++c) {
      float acc = static_cast<float>(0.05 * rng.Normal());
      for (int i = 0; i < rank; ++i) acc += coef[i] * m.basis[static_cast<size_t>(i) * d + c];
      row[c] = acc;
    }
    v->WriteRow(h, t, row.data());
  }
}

// The layer's tensors, zeroed, in the options' shapes (gen.q and the scores
// are made by FillQueries and FillScores).
void AllocateLayer(const SyntheticTurnOptions& opts, TurnLayer* layer) {
  const int H = opts.kv_heads, d = opts.head_dim, M = opts.n_history;
  layer->prompt_k = KvTensor(opts.dtype, H, opts.n_prompt, d);
  layer->prompt_v = KvTensor(opts.dtype, H, opts.n_prompt, d);
  layer->gen_k = KvTensor(opts.dtype, H, opts.n_gen, d);
  layer->gen_v = KvTensor(opts.dtype, H, opts.n_gen, d);
  layer->history_k = KvTensor(opts.dtype, H, M, d);
  layer->history_v = KvTensor(opts.dtype, H, M, d);
  layer->history_pos = PosTensor(H, M);
}

// Head h's history positions: an ascending M-subset of [0, 2M) (selection
// sampling).
void FillHistoryPositions(Rng& rng, int h, int M, PosTensor* pos) {
  int need = M;
  for (int p = 0, left = 2 * M; p < 2 * M && need > 0; ++p, --left) {
    if (rng.Uniform() * left < need) {
      pos->at(h, M - need) = p;
      --need;
    }
  }
}

// Every head's K and V rows (history, prompt, generated) from its own
// model, and its history positions; each head from its own PRNG stream.
void FillHeads(const SyntheticTurnOptions& opts, int l, TurnLayer* layer) {
  const int rank = std::min(opts.value_rank, opts.head_dim);
  for (int h = 0; h < opts.kv_heads; ++h) {
    Rng rng(Mix(opts.seed, static_cast<uint64_t>(l) + 1, static_cast<uint64_t>(h) + 1));
    const HeadModel model = MakeHeadModel(rng, opts.head_dim, rank);
    FillRows(rng, model, h, opts.n_history, rank, &layer->history_k, &layer->history_v);
    FillRows(rng, model, h, opts.n_prompt, rank, &layer->prompt_k, &layer->prompt_v);
    FillRows(rng, model, h, opts.n_gen, rank, &layer->gen_k, &layer->gen_v);
    FillHistoryPositions(rng, h, opts.n_history, &layer->history_pos);
  }
}

// Per prompt token, the importance the heads of a layer share: normal, plus
// a few heavy hitters.
std::vector<double> SharedImportance(Rng& rng, int n_prompt) {
  std::vector<double> shared(n_prompt);
  for (int j = 0; j < n_prompt; ++j) {
    shared[j] = 1.2 * rng.Normal();
    if (rng.Uniform() < 0.05) shared[j] += 2.5;  // heavy hitters
  }
  return shared;
}

// gen.q: each generated step's query is half its own key, plus half of two
// keys drawn from the 8 prompt tokens of largest shared importance, plus
// noise.
void FillQueries(const SyntheticTurnOptions& opts, int score_heads, const std::vector<double>& shared, Rng& rng,
                 TurnLayer* layer) {
  const int P = opts.n_prompt, d = opts.head_dim;
  std::vector<int> heavy(P);
  for (int j = 0; j < P; ++j) heavy[j] = j;
  std::sort(heavy.begin(), heavy.end(), [&](int a, int b) { return shared[a] > shared[b]; });
  heavy.resize(std::min(P, 8));
  layer->gen_q = KvTensor(opts.dtype, score_heads, opts.n_gen, d);
  std::vector<float> q(d), k(d);
  const int group = score_heads / opts.kv_heads;
  for (int qh = 0; qh < score_heads; ++qh) {
    for (int t = 0; t < opts.n_gen; ++t) {
      layer->gen_k.ReadRow(qh / group, t, q.data());
      for (float& x : q) x *= 0.5f;
      for (int m = 0; m < 2 && !heavy.empty(); ++m) {
        const int j = heavy[static_cast<size_t>(rng.Uniform() * heavy.size()) % heavy.size()];
        layer->prompt_k.ReadRow(qh / group, j, k.data());
        for (int c = 0; c < d; ++c) q[c] += 0.5f * k[c];
      }
      for (float& x : q) x += static_cast<float>(0.3 * rng.Normal());
      layer->gen_q.WriteRow(qh, t, q.data());
    }
  }
}

// prompt.score: log-normal around the shared importance, with attention
// sinks and mild recency; each row sums to half of n_gen.
void FillScores(const SyntheticTurnOptions& opts, int score_heads, const std::vector<double>& shared, Rng& rng,
                TurnLayer* layer) {
  const int P = opts.n_prompt;
  layer->scores = ScoreMatrix(score_heads, P);
  for (int q = 0; q < score_heads; ++q) {
    std::vector<double> row(P);
    double sum = 0;
    for (int j = 0; j < P; ++j) {
      double a = std::exp(shared[j] + 0.8 * rng.Normal());
      if (j < 4) a *= 30.0;                                      // attention sinks
      a *= 1.0 + 0.5 * static_cast<double>(j) / std::max(1, P);  // mild recency
      row[j] = a;
      sum += a;
    }
    const double total = 0.5 * opts.n_gen;
    for (int j = 0; j < P; ++j) {
      layer->scores.at(q, j) = sum > 0 ? static_cast<float>(row[j] * total / sum) : 0.0f;
    }
  }
}

}  // namespace

absl::Status CheckSyntheticTurnOptions(const SyntheticTurnOptions& opts) {
  auto bad = [](const char* name, int value, const char* expected) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", value, ", expected ", expected));
  };
  if (opts.layers < 1) return bad("layers", opts.layers, ">= 1");
  if (opts.kv_heads < 1) return bad("kv_heads", opts.kv_heads, ">= 1");
  if (opts.head_dim < 1) return bad("head_dim", opts.head_dim, ">= 1");
  if (opts.n_prompt < 0) return bad("prompt", opts.n_prompt, ">= 0");
  if (opts.n_gen < 0) return bad("gen", opts.n_gen, ">= 0");
  if (opts.n_history < 0) return bad("history", opts.n_history, ">= 0");
  if (opts.value_rank < 1) return bad("value_rank", opts.value_rank, ">= 1");
  const int score_heads = opts.score_heads == 0 ? opts.kv_heads : opts.score_heads;
  if (score_heads < opts.kv_heads || score_heads % opts.kv_heads != 0) {
    return bad("score_heads", opts.score_heads, "a positive multiple of kv_heads");
  }
  const double tokens = static_cast<double>(opts.n_prompt) + opts.n_gen + opts.n_history;
  const double bytes = static_cast<double>(opts.layers) * opts.kv_heads * opts.head_dim * tokens *
                           2 * DTypeSize(opts.dtype) +
                       static_cast<double>(opts.layers) * score_heads * opts.n_prompt * 4;
  if (bytes > 16.0 * (1ull << 30)) {
    return absl::InvalidArgumentError(
        absl::StrCat("turn of ", bytes, " bytes, expected at most 16 GiB"));
  }
  if (2.0 * opts.n_history + opts.n_prompt + opts.n_gen > 2147483647.0) {
    return absl::InvalidArgumentError("position ids would not fit in int32");
  }
  return absl::OkStatus();
}

absl::StatusOr<Turn> MakeSyntheticTurn(const SyntheticTurnOptions& opts) {
  KVRELAY_RETURN_IF_ERROR(CheckSyntheticTurnOptions(opts));
  const int score_heads = opts.score_heads == 0 ? opts.kv_heads : opts.score_heads;
  Turn turn;
  turn.first_agent = opts.first_agent;
  if (opts.n_history > 0) turn.prompt_pos0 = 2 * static_cast<int64_t>(opts.n_history);
  turn.layers.resize(opts.layers);
  for (int l = 0; l < opts.layers; ++l) {
    TurnLayer& layer = turn.layers[l];
    AllocateLayer(opts, &layer);
    FillHeads(opts, l, &layer);
    // The layer's own stream: the shared importance, then queries or scores.
    Rng rng(Mix(opts.seed, static_cast<uint64_t>(l) + 1, 0));
    const std::vector<double> shared = SharedImportance(rng, opts.n_prompt);
    if (opts.queries) {
      FillQueries(opts, score_heads, shared, rng, &layer);
    } else {
      FillScores(opts, score_heads, shared, rng, &layer);
    }
  }
  return turn;
}

}  // namespace kvrelay
