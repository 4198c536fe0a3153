// Random turns for core tests.
#ifndef KVRELAY_TESTS_CORE_TEST_UTIL_H_
#define KVRELAY_TESTS_CORE_TEST_UTIL_H_

#include <cmath>
#include <random>
#include <vector>

#include "core/turn.h"

namespace kvrelay::testing {

struct TurnShape {
  int layers = 2, kv_heads = 2, group = 2, head_dim = 16;
  int n_prompt = 40, n_gen = 5, n_history = 0;
  DType dtype = DType::kF32;
  bool first_agent = true;
  // Carry gen.q [kv_heads * group, n_gen, head_dim] in this dtype instead
  // of prompt.score.
  bool queries = false;
  DType q_dtype = DType::kF32;
};

// Low-rank-plus-noise rows, heavy-tailed nonnegative scores.
inline void FillKv(KvTensor* t, std::mt19937_64& rng) {
  std::normal_distribution<float> n01(0.f, 1.f);
  const int rank = std::max(1, t->dim() / 4);
  std::vector<float> basis(static_cast<size_t>(rank) * t->dim());
  for (float& b : basis) b = n01(rng);
  std::vector<float> row(t->dim());
  for (int h = 0; h < t->heads(); ++h) {
    for (int j = 0; j < t->tokens(); ++j) {
      for (int c = 0; c < t->dim(); ++c) row[c] = 0.1f * n01(rng);
      for (int r = 0; r < rank; ++r) {
        const float a = n01(rng);
        for (int c = 0; c < t->dim(); ++c) row[c] += a * basis[static_cast<size_t>(r) * t->dim() + c];
      }
      t->WriteRow(h, j, row.data());
    }
  }
}

inline Turn RandomTurn(const TurnShape& s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::exponential_distribution<float> expo(1.f);
  Turn turn;
  turn.first_agent = s.first_agent;
  // History as a compressed upstream message: sparse, per-head positions
  // below the prompt's first position id.
  if (s.n_history > 0) turn.prompt_pos0 = 2 * s.n_history;
  for (int l = 0; l < s.layers; ++l) {
    TurnLayer layer;
    layer.prompt_k = KvTensor(s.dtype, s.kv_heads, s.n_prompt, s.head_dim);
    layer.prompt_v = KvTensor(s.dtype, s.kv_heads, s.n_prompt, s.head_dim);
    layer.gen_k = KvTensor(s.dtype, s.kv_heads, s.n_gen, s.head_dim);
    layer.gen_v = KvTensor(s.dtype, s.kv_heads, s.n_gen, s.head_dim);
    layer.history_k = KvTensor(s.dtype, s.kv_heads, s.n_history, s.head_dim);
    layer.history_v = KvTensor(s.dtype, s.kv_heads, s.n_history, s.head_dim);
    for (KvTensor* t : {&layer.prompt_k, &layer.prompt_v, &layer.gen_k, &layer.gen_v,
                        &layer.history_k, &layer.history_v}) {
      FillKv(t, rng);
    }
    layer.history_pos = PosTensor(s.kv_heads, s.n_history);
    for (int h = 0; h < s.kv_heads; ++h) {
      for (int j = 0; j < s.n_history; ++j) layer.history_pos.at(h, j) = 2 * j + (h % 2);
    }
    if (s.queries) {
      layer.gen_q = KvTensor(s.q_dtype, s.kv_heads * s.group, s.n_gen, s.head_dim);
      FillKv(&layer.gen_q, rng);
    } else {
      layer.scores = ScoreMatrix(s.kv_heads * s.group, s.n_prompt);
      for (float& x : layer.scores.data) {
        const float e = expo(rng);
        x = e * e * e;  // heavy tail
      }
    }
    turn.layers.push_back(std::move(layer));
  }
  return turn;
}

}  // namespace kvrelay::testing

#endif  // KVRELAY_TESTS_CORE_TEST_UTIL_H_
