// Time per message of every compressor on a Qwen3-14B turn (40 layers, 8 KV
// heads, 40 query heads, head_dim 128, bf16, 512 prompt + 40 generated
// tokens, k=32, p=8), on one thread and on all threads, next to a memcpy of
// the same input bytes measured in the same run.
//
//   build/bin/compress_bench --benchmark_repetitions=5
//       --benchmark_report_aggregates_only=true
//
// The process keeps freed heap for reuse like kvrelay-server does
// (--heap-retain-bytes); see main().
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "benchmark/benchmark.h"
#include "core/heap_retain.h"
#include "core/format/synthetic.h"
#include "core/internal/gather.h"
#include "core/internal/gram.h"
#include <random>

#include "core/pipeline.h"
#include "core/query_scores.h"
#include "core/selection.h"
#include "core/thread_pool.h"

namespace kvrelay {
namespace {

const Turn& Qwen14BTurn() {
  static const Turn* turn = [] {
    SyntheticTurnOptions o = Qwen3_14BTurn();
    o.seed = 14;
    auto t = MakeSyntheticTurn(o);
    if (!t.ok()) std::abort();
    return new Turn(*std::move(t));
  }();
  return *turn;
}

uint64_t InputBytes(const Turn& t) {
  uint64_t b = 0;
  for (const TurnLayer& l : t.layers) {
    b += l.prompt_k.byte_size() + l.prompt_v.byte_size() + l.gen_k.byte_size() + l.gen_v.byte_size() +
         l.history_k.byte_size() + l.history_v.byte_size() + 4 * l.scores.data.size();
  }
  return b;
}

void BM_Memcpy(benchmark::State& state) {
  const uint64_t n = InputBytes(Qwen14BTurn());
  std::vector<char> src(n, 1), dst(n);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), n);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * n);
}
BENCHMARK(BM_Memcpy)->Unit(benchmark::kMillisecond)->UseRealTime();

void Run(benchmark::State& state, const char* spec, bool validated) {
  const Turn& turn = Qwen14BTurn();
  auto pipeline = Pipeline::Create(spec);
  if (!pipeline.ok()) {
    state.SkipWithError(std::string(pipeline.status().message()).c_str());
    return;
  }
  const int threads = static_cast<int>(state.range(0));
  std::unique_ptr<ThreadPool> pool;
  if (threads > 1) pool = std::make_unique<ThreadPool>(threads);
  double ratio = 0;
  for (auto _ : state) {
    auto msg = validated ? (*pipeline)->CompressValidated(turn, pool.get())
                         : (*pipeline)->Compress(turn, pool.get());
    if (!msg.ok()) {
      state.SkipWithError(std::string(msg.status().message()).c_str());
      return;
    }
    ratio = msg->Ratio();
    benchmark::DoNotOptimize(msg->layers.data());
  }
  state.SetBytesProcessed(state.iterations() * InputBytes(turn));
  state.counters["ratio"] = ratio;
}

// Compress: validates every K/V value, then compresses.
void BM_Compress(benchmark::State& state, const char* spec) { Run(state, spec, false); }
// CompressValidated: the values were checked before (file reader, relay).
void BM_CompressValidated(benchmark::State& state, const char* spec) { Run(state, spec, true); }

void Threads(benchmark::internal::Benchmark* b) {
  b->Arg(1);
  if (ThreadPool::HardwareThreads() > 1) b->Arg(ThreadPool::HardwareThreads());
  b->ArgName("threads")->Unit(benchmark::kMillisecond)->UseRealTime();
}

BENCHMARK_CAPTURE(BM_Compress, full, "full")->Apply(Threads);
BENCHMARK_CAPTURE(BM_Compress, gen, "gen")->Apply(Threads);
BENCHMARK_CAPTURE(BM_Compress, h2o_layer, "h2o-layer:k=32")->Apply(Threads);
BENCHMARK_CAPTURE(BM_Compress, h2o_head, "h2o-head:k=32")->Apply(Threads);
BENCHMARK_CAPTURE(BM_CompressValidated, gen, "gen")->Apply(Threads);
BENCHMARK_CAPTURE(BM_CompressValidated, h2o_layer, "h2o-layer:k=32")->Apply(Threads);
BENCHMARK_CAPTURE(BM_CompressValidated, h2o_head, "h2o-head:k=32")->Apply(Threads);
BENCHMARK_CAPTURE(BM_Compress, l_obf_exact, "h2o-layer:k=32+obf:p=8")->Apply(Threads);
BENCHMARK_CAPTURE(BM_Compress, h_obf_exact, "h2o-head:k=32+obf:p=8")->Apply(Threads);
BENCHMARK_CAPTURE(BM_Compress, h_obf_fast, "h2o-head:k=32+obf:p=8,mode=fast")->Apply(Threads);
BENCHMARK_CAPTURE(BM_Compress, h_int4, "h2o-head:k=32+int4")->Apply(Threads);
BENCHMARK_CAPTURE(BM_Compress, h_obf_fast_int4, "h2o-head:k=32+obf:p=8,mode=fast+int4:rotate=hadamard")->Apply(Threads);

// One head of OBF at the same shape: 508 candidates, d=128, k=32, p=8.
void BM_ObfHead(benchmark::State& state) {
  const Turn& turn = Qwen14BTurn();
  const TurnLayer& layer = turn.layers[7];
  const int n = 512, d = 128, anchors = 4;
  std::vector<float> v(static_cast<size_t>(n - anchors) * d);
  for (int j = anchors; j < n; ++j) layer.prompt_v.ReadRow(3, j, v.data() + static_cast<size_t>(j - anchors) * d);
  const std::vector<double> all = ReduceScores(layer.scores, 8);
  std::vector<double> scores(all.begin() + 3 * n + anchors, all.begin() + 4 * n);
  const std::vector<int> kept = TopK(scores, 0, n - anchors, 32);
  ObfOptions o;
  o.mode = state.range(0) ? ObfMode::kFast : ObfMode::kExact;
  for (auto _ : state) {
    ObfHead h = ComputeObf(o, v, n - anchors, d, scores, kept);
    benchmark::DoNotOptimize(h.delta.data());
  }
}
BENCHMARK(BM_ObfHead)->Arg(0)->Arg(1)->ArgName("fast")->Unit(benchmark::kMicrosecond);

// The fast path's Gram of one head's deleted rows (476 x 128, as above) on
// each code path: float (GramLower) and bfloat16 pairs (GramLowerBf16).
// isa: 0 best (VDPBF16PS for bf16 where the CPU has it), 1 AVX-512F, 2 AVX2.
void BM_Gram(benchmark::State& state) {
  const int n = 476, d = 128, ld = internal::GramStride(d), pairs = (n + 1) / 2;
  const internal::GramIsa isa = state.range(1) == 0   ? internal::GramIsa::kBest
                                : state.range(1) == 1 ? internal::GramIsa::kAvx512
                                                      : internal::GramIsa::kAvx2;
  std::vector<float> rows(static_cast<size_t>(n) * ld, 0.0f), g(static_cast<size_t>(ld) * ld);
  std::vector<uint32_t> packed(static_cast<size_t>(pairs) * ld, 0);
  uint32_t x = 12345;
  for (int t = 0; t < n; ++t) {
    for (int j = 0; j < d; ++j) {
      x = x * 1664525u + 1013904223u;
      const uint32_t bf16 = (x >> 16 & 0x8000u) | ((118u + (x >> 8) % 8u) << 7) | (x & 0x7fu);
      const uint32_t bits = bf16 << 16;
      std::memcpy(&rows[static_cast<size_t>(t) * ld + j], &bits, sizeof(bits));
      packed[static_cast<size_t>(t / 2) * ld + j] |= t % 2 ? bits : bf16;
    }
  }
  for (auto _ : state) {
    if (state.range(0)) {
      internal::GramLowerBf16(packed.data(), pairs, d, g.data(), isa);
    } else {
      internal::GramLower(rows.data(), n, d, g.data(), isa);
    }
    benchmark::DoNotOptimize(g.data());
  }
}
BENCHMARK(BM_Gram)->ArgsProduct({{0, 1}, {0, 1, 2}})->ArgNames({"bf16", "isa"})->Unit(benchmark::kMicrosecond);

// The history budget: h2o-head:k=32,hist=64 on the Qwen3-14B turn with 512
// inherited history tokens (their acc random, no history.score) against the
// same policy on the turn without history, one thread, values checked
// before (CompressValidated). Target: history512:1 / its copy floor
// (BM_HistoryBudgetCopyFloor/history512:1) <= 1.2. The message with history
// holds 64 + 32 + 40 = 136 tokens per head against 76 (4 anchors, 32, 40)
// without, and copying kept rows is most of the time.
const Turn& Qwen14BHistoryTurn() {
  static const Turn* turn = [] {
    SyntheticTurnOptions o = Qwen3_14BTurn();
    o.seed = 14;
    o.n_history = 512;
    o.first_agent = false;
    auto t = MakeSyntheticTurn(o);
    if (!t.ok()) std::abort();
    std::mt19937 rng(5);
    std::exponential_distribution<float> expo(1.f);
    for (TurnLayer& l : t->layers) {
      l.history_acc = ScoreMatrix(o.kv_heads, o.n_history);
      for (float& x : l.history_acc.data) x = expo(rng);
    }
    return new Turn(*std::move(t));
  }();
  return *turn;
}

// Arg 0: no history; 1: 512 history tokens, hist=64; 2: 512 history
// tokens passed whole (h2o-head:k=32, no budget), for comparison.
void BM_HistoryBudget(benchmark::State& state) {
  const Turn& turn = state.range(0) ? Qwen14BHistoryTurn() : Qwen14BTurn();
  auto pipeline = Pipeline::Create(state.range(0) == 2 ? "h2o-head:k=32" : "h2o-head:k=32,hist=64");
  if (!pipeline.ok()) std::abort();
  uint64_t sent = 0;
  for (auto _ : state) {
    auto msg = (*pipeline)->CompressValidated(turn);
    if (!msg.ok()) {
      state.SkipWithError(std::string(msg.status().message()).c_str());
      return;
    }
    sent = msg->sent_bytes;
    benchmark::DoNotOptimize(msg->layers.data());
  }
  state.counters["sent_bytes"] = static_cast<double>(sent);
}
BENCHMARK(BM_HistoryBudget)->Arg(0)->Arg(1)->Arg(2)->ArgName("history512")->Unit(benchmark::kMillisecond)->UseRealTime();

// The floor under BM_HistoryBudget: only allocating each layer's output and
// gathering the rows the message of the same argument holds (found once,
// before the loop) with the pipeline's own GatherHeadRows; no scoring, no
// selection.
// Its ratio history512:1 / history512:0 is the least the budget's ratio can
// be while copying the kept rows is what the time is spent on.
void BM_HistoryBudgetCopyFloor(benchmark::State& state) {
  const Turn& turn = state.range(0) ? Qwen14BHistoryTurn() : Qwen14BTurn();
  auto pipeline = Pipeline::Create("h2o-head:k=32,hist=64");
  if (!pipeline.ok()) std::abort();
  auto msg = (*pipeline)->CompressValidated(turn);
  if (!msg.ok()) std::abort();
  const TurnLayer& l0 = turn.layers[0];
  const int heads = l0.prompt_k.heads(), d = l0.prompt_k.dim();
  const int n_hist = l0.history_k.tokens(), n_prompt = l0.prompt_k.tokens();
  const int64_t pos0 = turn.prompt_pos0.value_or(n_hist);
  // Per layer and head, the source rows of the message's tokens in order.
  using internal::RowSource;
  std::vector<std::vector<std::vector<RowSource>>> src(turn.layers.size());
  for (size_t l = 0; l < turn.layers.size(); ++l) {
    const TurnLayer& tl = turn.layers[l];
    const MessageLayer& ml = msg->layers[l];
    src[l].resize(heads);
    for (int h = 0; h < heads; ++h) {
      for (int t = 0; t < ml.pos.tokens; ++t) {
        const int64_t p = ml.pos.at(h, t);
        if (p >= pos0 + n_prompt) {
          src[l][h].push_back({&tl.gen_k, &tl.gen_v, static_cast<int>(p - pos0 - n_prompt)});
        } else if (p >= pos0) {
          src[l][h].push_back({&tl.prompt_k, &tl.prompt_v, static_cast<int>(p - pos0)});
        } else {
          int j = 0;
          while (tl.history_pos.at(h, j) != p) ++j;
          src[l][h].push_back({&tl.history_k, &tl.history_v, j});
        }
      }
    }
  }
  const int n_out = msg->layers[0].pos.tokens;
  for (auto _ : state) {
    std::vector<std::pair<KvTensor, KvTensor>> out;
    out.reserve(turn.layers.size());
    for (size_t l = 0; l < turn.layers.size(); ++l) {
      auto& [k, v] = out.emplace_back(KvTensor::Uninitialized(l0.prompt_k.dtype(), heads, n_out, d),
                                      KvTensor::Uninitialized(l0.prompt_k.dtype(), heads, n_out, d));
      for (int h = 0; h < heads; ++h) internal::GatherHeadRows(src[l][h], h, &k, &v);
    }
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["tokens_per_head"] = n_out;
}
BENCHMARK(BM_HistoryBudgetCopyFloor)->Arg(0)->Arg(1)->ArgName("history512")->Unit(benchmark::kMillisecond)->UseRealTime();

// One head's top-k as selection runs it on the Qwen3-14B turn: k=32 of 508
// heavy-tailed candidate scores (a fresh row each time, from 64 cycled).
void BM_TopK(benchmark::State& state) {
  std::mt19937 rng(3);
  std::lognormal_distribution<double> tail(0.0, 2.0);
  std::vector<std::vector<double>> rows(64, std::vector<double>(508));
  for (auto& r : rows) {
    for (double& x : r) x = tail(rng);
  }
  size_t i = 0;
  for (auto _ : state) {
    std::vector<int> kept = TopK(rows[i++ % rows.size()], 0, 508, static_cast<int>(state.range(0)));
    benchmark::DoNotOptimize(kept.data());
  }
}
BENCHMARK(BM_TopK)->Arg(32)->Arg(64)->Unit(benchmark::kMicrosecond);

// Ordered rows, the quickselect's hard case: ascending (a recency ramp) or
// descending, with k from a few to most of the row.
void BM_TopKOrdered(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0)), k = static_cast<int>(state.range(1));
  std::vector<double> row(n);
  for (int j = 0; j < n; ++j) row[j] = state.range(2) ? n - j : j;
  for (auto _ : state) {
    std::vector<int> kept = TopK(row, 0, n, k);
    benchmark::DoNotOptimize(kept.data());
  }
}
BENCHMARK(BM_TopKOrdered)
    ->ArgsProduct({{508}, {32, 254, 381, 500}, {0, 1}})
    ->Args({4096, 3072, 0})
    ->ArgNames({"n", "k", "descending"})
    ->Unit(benchmark::kMicrosecond);

// Scores from queries (gen.q, bf16) on the Qwen3-14B turn, one thread:
// every layer's QueryScores. Counters: multiply-adds per second of the
// logits (sum over layers, query heads and steps of keys seen x head_dim)
// and that rate over one core's FMA peak measured by BM_FmaPeak.
// The Qwen3-14B turn carrying gen.q (bf16, 40 query heads) instead of scores.
const Turn& Qwen14BQueryTurn() {
  static const Turn* q = [] {
    const Turn& turn = Qwen14BTurn();
    auto* out = new Turn(turn);
    uint32_t x = 99;
    for (size_t l = 0; l < turn.layers.size(); ++l) {
      // Queries of the keys' own scale: a random mix of the layer's keys.
      const TurnLayer& layer = turn.layers[l];
      KvTensor t(DType::kBF16, 40, layer.gen_k.tokens(), layer.gen_k.dim());
      std::vector<float> row(t.dim()), k(t.dim());
      for (int h = 0; h < t.heads(); ++h) {
        for (int s = 0; s < t.tokens(); ++s) {
          std::fill(row.begin(), row.end(), 0.f);
          for (int m = 0; m < 4; ++m) {
            x = x * 1664525u + 1013904223u;
            layer.prompt_k.ReadRow(h / 5, static_cast<int>(x >> 8) % layer.prompt_k.tokens(), k.data());
            for (int c = 0; c < t.dim(); ++c) row[c] += 0.5f * k[c];
          }
          t.WriteRow(h, s, row.data());
        }
      }
      out->layers[l].scores = ScoreMatrix();
      out->layers[l].gen_q = std::move(t);
    }
    return out;
  }();
  return *q;
}

double QueryScoreMacs(const TurnGeometry& g, int layers) {
  double per_head = 0;
  for (int t = 0; t < g.n_gen; ++t) per_head += static_cast<double>(g.n_history + g.n_prompt + t + 1) * g.head_dim;
  return per_head * g.score_heads * layers;
}


// One core's float32 FMA peak with the instructions the build uses for
// QueryScores' logits (AVX2 FMA at -march=x86-64-v3): 12 independent
// accumulators of 8 lanes, so the loop is bound by FMA throughput.
void BM_FmaPeak(benchmark::State& state) {
  constexpr int kAcc = 12, kLanes = 8, kIters = 1 << 20;
  float acc[kAcc][kLanes] = {};
  float a[kLanes], b[kLanes];
  for (int i = 0; i < kLanes; ++i) a[i] = 1.0f + 1e-7f * i, b[i] = 1e-7f;
  for (auto _ : state) {
    for (int it = 0; it < kIters; ++it) {
      for (int j = 0; j < kAcc; ++j) {
        for (int i = 0; i < kLanes; ++i) acc[j][i] = acc[j][i] * a[i] + b[i];
      }
    }
    benchmark::DoNotOptimize(acc);
  }
  const double macs = static_cast<double>(state.iterations()) * kIters * kAcc * kLanes;
  state.counters["mac_per_s"] = benchmark::Counter(macs, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_FmaPeak)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_QueryScores(benchmark::State& state) {
  const Turn& turn = Qwen14BQueryTurn();
  const TurnGeometry geo = *GeometryOf(turn);
  const double scale = 1.0 / std::sqrt(128.0);
  for (auto _ : state) {
    for (const TurnLayer& layer : turn.layers) benchmark::DoNotOptimize(QueryScores(layer, geo, scale, 0).value());
  }
  state.counters["mac_per_s"] = benchmark::Counter(QueryScoreMacs(geo, static_cast<int>(turn.layers.size())) *
                                                       static_cast<double>(state.iterations()),
                                                   benchmark::Counter::kIsRate);
}
BENCHMARK(BM_QueryScores)->Unit(benchmark::kMillisecond)->UseRealTime();

// Quantizer encode + decode of every layer of the turn's dense prompt and
// generated rows, one thread: lloyd:bits=B against int4 on the same rows.
void BM_QuantRoundTrip(benchmark::State& state, const char* spec) {
  const Turn& turn = Qwen14BTurn();
  const QuantOptions opts = *(*Pipeline::Create(spec))->config().quant;
  std::vector<std::pair<KvTensor, KvTensor>> rows;
  for (const TurnLayer& l : turn.layers) rows.emplace_back(l.prompt_k, l.prompt_v);
  KvTensor k, v;
  uint64_t bytes = 0;
  for (auto _ : state) {
    for (const auto& [pk, pv] : rows) {
      absl::StatusOr<QuantizedKv> q = QuantizeKv(pk, pv, opts);
      if (!q.ok() || !DequantizeKv(*q, pk.dtype(), &k, &v).ok()) {
        state.SkipWithError("quantize");
        return;
      }
      bytes = q->k.ByteSize() + q->v.ByteSize();
      benchmark::DoNotOptimize(k.bytes().data());
    }
  }
  state.counters["layer_bytes"] = static_cast<double>(bytes);
}
BENCHMARK_CAPTURE(BM_QuantRoundTrip, int4, "full+int4")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_QuantRoundTrip, int4_hadamard, "full+int4:rotate=hadamard")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_QuantRoundTrip, lloyd4, "full+lloyd:bits=4")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_QuantRoundTrip, lloyd3, "full+lloyd:bits=3")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_QuantRoundTrip, lloyd2, "full+lloyd:bits=2")->Unit(benchmark::kMillisecond)->UseRealTime();

// auto:budget=0.1 chooses from every layer's query masses, then compresses:
// against h2o-head:k=32+int4 on the same turn with gen.q, one thread.
void BM_CompressQueries(benchmark::State& state, const char* spec) {
  const Turn& turn = Qwen14BQueryTurn();
  std::unique_ptr<Pipeline> p = *Pipeline::Create(spec);
  std::string chosen;
  for (auto _ : state) {
    absl::StatusOr<Message> m = p->Compress(turn);
    if (!m.ok()) {
      state.SkipWithError(std::string(m.status().message()).c_str());
      return;
    }
    chosen = m->policy;
    benchmark::DoNotOptimize(m->layers.data());
  }
  state.SetLabel(chosen);
}
BENCHMARK_CAPTURE(BM_CompressQueries, h_int4, "h2o-head:k=32+int4")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_CompressQueries, auto_budget_0_1, "auto:budget=0.1")->Unit(benchmark::kMillisecond)->UseRealTime();

// The fidelity figure of an H-OBF fast message of the same turn, one
// thread: every layer's AttentionOutputError (the full cache's logits and
// outputs, the message's). Counter: multiply-adds per second of the logits
// and outputs of the full cache and of the message.
void BM_AttentionOutputError(benchmark::State& state) {
  const Turn& turn = Qwen14BQueryTurn();
  const TurnGeometry geo = *GeometryOf(turn);
  auto pipeline = Pipeline::Create("h2o-head:k=32+obf:p=8,mode=fast");
  absl::StatusOr<Message> msg = (*pipeline)->Compress(turn);
  if (!msg.ok()) {
    state.SkipWithError(std::string(msg.status().message()).c_str());
    return;
  }
  const double scale = 1.0 / std::sqrt(128.0);
  for (auto _ : state) {
    for (size_t l = 0; l < turn.layers.size(); ++l) {
      benchmark::DoNotOptimize(AttentionOutputError(turn.layers[l], geo, msg->layers[l], scale));
    }
  }
  // The definition's work: logits and outputs (two d-long products) for
  // every key a step sees, in the full cache and in the message.
  const int before_gen = msg->layers[0].tokens() - geo.n_gen;
  double seen = 0;
  for (int t = 0; t < geo.n_gen; ++t) seen += (geo.n_history + geo.n_prompt + t + 1) + (before_gen + t + 1);
  const double macs = 2.0 * seen * geo.head_dim * geo.score_heads * turn.layers.size();
  state.counters["mac_per_s"] =
      benchmark::Counter(macs * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_AttentionOutputError)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace kvrelay

int main(int argc, char** argv) {
  // As kvrelay-server and kvrelayctl run: freed tensors stay mapped for the
  // next message (core/heap_retain.h). MALLOC_TRIM_THRESHOLD_=131072
  // MALLOC_MMAP_THRESHOLD_=131072 measures glibc's defaults instead.
  kvrelay::RetainFreedHeap(kvrelay::kDefaultHeapRetainBytes);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
