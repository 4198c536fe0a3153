// The wire codec (proto/wire_codec.h) on one layer of a Qwen3-14B turn
// (40 layers, 8 KV heads, head_dim 128, bf16, 512 prompt + 40 generated
// tokens; core/format/synthetic.h), next to a memcpy of the same bytes
// measured in the same run:
//
//   BM_DecodeCodes/<policy>   rANS decode of layer 0's K and V codes
//   BM_MemcpyCodes/<policy>   memcpy of those code bytes
//   BM_EncodeLayer/<policy>   EncodeWireLayer of layer 0 (every tensor, acc too)
//   BM_DecodeLayer/<policy>   DecodeWireLayer of it
//   BM_MemcpyLayer/<policy>   memcpy of the layer's bytes
//
// Counters: raw and coded bytes, coded/raw. Medians over repetitions:
//
//   build/bin/wire_codec_bench --benchmark_repetitions=5
//       --benchmark_report_aggregates_only=true
#include <cstring>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "core/format/synthetic.h"
#include "core/pipeline.h"
#include "proto/stream_codec.h"
#include "proto/wire_codec.h"

namespace kvrelay {
namespace {

const char* const kPolicies[] = {"h2o-head:k=32+int4", "h2o-head:k=32+int2", "full+int8", "h2o-head:k=32", "full"};

struct Layer {
  Message msg;
  std::vector<TensorRef> all;    // layer 0 in delivery order, acc included
  std::vector<TensorRef> codes;  // its K and V codes
};

const Layer& LayerOf(int policy) {
  static std::vector<Layer*> cache(std::size(kPolicies), nullptr);
  if (cache[policy]) return *cache[policy];
  SyntheticTurnOptions o = Qwen3_14BTurn();
  o.seed = 14;
  auto turn = MakeSyntheticTurn(o);
  if (!turn.ok()) std::abort();
  auto p = Pipeline::Create(kPolicies[policy]);
  if (!p.ok()) std::abort();
  auto m = (*p)->Compress(*turn);
  if (!m.ok()) std::abort();
  auto* l = new Layer{*std::move(m), {}, {}};
  MessageLayer& ml = l->msg.layers[0];
  ml.acc.resize(static_cast<size_t>(l->msg.kv_heads) * ml.tokens());
  for (size_t i = 0; i < ml.acc.size(); ++i) ml.acc[i] = 0.25f * static_cast<float>(i % 17);
  l->all = LayerDeliveryOrder(ml, 0, /*with_acc=*/true);
  for (const TensorRef& t : l->all) {
    if (t.part == v1::PART_K_CODES || t.part == v1::PART_V_CODES) l->codes.push_back(t);
  }
  if (l->codes.empty()) l->codes = {l->all[0], l->all[1]};  // dense: K and V
  cache[policy] = l;
  return *l;
}

std::vector<WireTensor> Expected(const std::vector<TensorRef>& ts) {
  std::vector<WireTensor> out;
  for (const TensorRef& t : ts) {
    if (!t.data.empty()) out.push_back({t.part, t.data.size()});
  }
  return out;
}

void Decode(benchmark::State& state, bool codes_only) {
  const Layer& l = LayerOf(static_cast<int>(state.range(0)));
  const std::vector<TensorRef>& ts = codes_only ? l.codes : l.all;
  const WireBlob blob = EncodeWireLayer(ts, {l.msg.kv_heads, 2});
  const std::vector<WireTensor> expected = Expected(ts);
  for (auto _ : state) {
    auto out = DecodeWireLayer(blob, expected);
    if (!out.ok()) state.SkipWithError("decode failed");
    benchmark::DoNotOptimize(out);
  }
  const double raw = static_cast<double>(TotalBytes(ts));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * raw));
  state.counters["raw_bytes"] = raw;
  state.counters["coded_bytes"] = static_cast<double>(blob.size());
  state.counters["coded_over_raw"] = static_cast<double>(blob.size()) / raw;
  state.SetLabel(kPolicies[state.range(0)]);
}

void Memcpy(benchmark::State& state, bool codes_only) {
  const Layer& l = LayerOf(static_cast<int>(state.range(0)));
  const std::vector<TensorRef>& ts = codes_only ? l.codes : l.all;
  std::vector<std::vector<uint8_t>> out(ts.size());
  for (auto _ : state) {
    for (size_t i = 0; i < ts.size(); ++i) {  // allocating, as the decoder does
      out[i] = std::vector<uint8_t>(ts[i].data.size());
      std::memcpy(out[i].data(), ts[i].data.data(), ts[i].data.size());
    }
    benchmark::DoNotOptimize(out);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * TotalBytes(ts)));
  state.SetLabel(kPolicies[state.range(0)]);
}

void BM_DecodeCodes(benchmark::State& s) { Decode(s, true); }
void BM_MemcpyCodes(benchmark::State& s) { Memcpy(s, true); }
void BM_DecodeLayer(benchmark::State& s) { Decode(s, false); }
void BM_MemcpyLayer(benchmark::State& s) { Memcpy(s, false); }
void BM_EncodeLayer(benchmark::State& state) {
  const Layer& l = LayerOf(static_cast<int>(state.range(0)));
  for (auto _ : state) benchmark::DoNotOptimize(EncodeWireLayer(l.all, {l.msg.kv_heads, 2}));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * TotalBytes(l.all)));
  state.SetLabel(kPolicies[state.range(0)]);
}

#define KVRELAY_POLICIES DenseRange(0, static_cast<int>(std::size(kPolicies)) - 1)
BENCHMARK(BM_DecodeCodes)->KVRELAY_POLICIES;
BENCHMARK(BM_MemcpyCodes)->KVRELAY_POLICIES;
BENCHMARK(BM_EncodeLayer)->KVRELAY_POLICIES;
BENCHMARK(BM_DecodeLayer)->KVRELAY_POLICIES;
BENCHMARK(BM_MemcpyLayer)->KVRELAY_POLICIES;

}  // namespace
}  // namespace kvrelay

BENCHMARK_MAIN();
