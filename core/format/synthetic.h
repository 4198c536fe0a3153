// Synthetic agent turns for demos, tests and benchmarks.
//
// The generator imitates what a real model hands to the relay:
//   - values are low-rank plus noise: per (layer, head) a random basis of
//     `value_rank` directions shared by history, prompt and generated rows,
//     with decaying coefficients, plus small isotropic noise;
//   - keys have a per-channel bias and a few outlier channels (what makes
//     low-bit quantization of keys hard);
//   - scores are heavy-tailed (log-normal, with a shared per-token
//     importance across the heads of a layer, a few heavy hitters and large
//     mass on the first tokens, the attention sinks). Each score row sums to
//     half of n_gen: the generated steps put half of their attention on the
//     prompt;
//   - history (when n_history > 0) has per-head ascending positions drawn
//     from [0, 2*n_history), as a head-level selection upstream would leave
//     them, and prompt_pos0 = 2*n_history.
//
// The output depends only on the options (own PRNG, no std distributions),
// so a seed reproduces the same bytes on every platform. Thread-safe.
#ifndef KVRELAY_CORE_FORMAT_SYNTHETIC_H_
#define KVRELAY_CORE_FORMAT_SYNTHETIC_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "core/turn.h"

namespace kvrelay {

struct SyntheticTurnOptions {
  int layers = 4;       // >= 1
  int kv_heads = 2;     // >= 1
  int score_heads = 0;  // 0: kv_heads; else a positive multiple of kv_heads
  int head_dim = 64;    // >= 1
  int n_prompt = 128;   // >= 0
  int n_gen = 16;       // >= 0
  int n_history = 0;    // >= 0
  int value_rank = 8;   // >= 1 (capped at head_dim)
  DType dtype = DType::kBF16;
  uint64_t seed = 1;
  bool first_agent = true;
  // Carry the generated steps' queries (gen.q [score_heads, n_gen,
  // head_dim], in `dtype`) instead of prompt.score: each step's query leans
  // on a few heavy-hitter prompt keys of its KV head and on its own key, so
  // the relay's scores from them are concentrated like real attention.
  bool queries = false;
};

// The shape of one Qwen3-14B agent turn in the method's reference setting
// (BRIEF §6): 40 layers, 8 KV heads, 40 query heads, head_dim 128, BF16, 512
// prompt and 40 generated tokens. The demo and the benchmarks use it.
inline SyntheticTurnOptions Qwen3_14BTurn() {
  SyntheticTurnOptions o;
  o.layers = 40;
  o.kv_heads = 8;
  o.score_heads = 40;
  o.head_dim = 128;
  o.n_prompt = 512;
  o.n_gen = 40;
  o.dtype = DType::kBF16;
  return o;
}

// InvalidArgument naming the option when it is out of range, or when the
// turn would exceed 16 GiB; OK when MakeSyntheticTurn would make it.
absl::Status CheckSyntheticTurnOptions(const SyntheticTurnOptions& opts);

// The turn; CheckSyntheticTurnOptions' errors otherwise.
absl::StatusOr<Turn> MakeSyntheticTurn(const SyntheticTurnOptions& opts);

}  // namespace kvrelay

#endif  // KVRELAY_CORE_FORMAT_SYNTHETIC_H_
