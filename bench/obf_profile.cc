// A small driver for instruction counts of H-OBF fast under callgrind: the
// Qwen3-14B turn's shape (8 KV heads, 40 query heads, head_dim 128, bf16,
// 512 prompt + 40 generated tokens, k=32, p=8) with fewer layers, so that the
// turn is made quickly under valgrind. Each measured region is one function
// of its own, for --toggle-collect:
//
//   valgrind --tool=callgrind --collect-atstart=no
//       --toggle-collect='kvrelay_profile_*' build/bin/obf_profile [layers]
//       (one command line)
//   callgrind_annotate --inclusive=yes callgrind.out.PID | grep kvrelay_profile_
//
//   kvrelay_profile_selection: one message of `h2o-head:k=32` (no OBF)
//   kvrelay_profile_obf_fast:  one message of `h2o-head:k=32+obf:p=8,mode=fast`
//   kvrelay_profile_gram:      one bf16 Gram of 476 x 128 per KV head of the
//                              turn (compress_bench's BM_Gram/bf16:1)
//
// OBF per head = (obf_fast - selection) / heads; the Gram floor per head =
// gram / heads. Every region runs once unmeasured first, so that per-thread
// buffers exist. valgrind hides AVX-512 from the CPU check, so these are the
// AVX2 kernels' counts.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/format/synthetic.h"
#include "core/internal/gram.h"
#include "core/pipeline.h"

namespace {

using kvrelay::Pipeline;
using kvrelay::Turn;

std::unique_ptr<Pipeline> MakePipeline(const char* spec) {
  auto p = Pipeline::Create(spec);
  if (!p.ok()) {
    std::fprintf(stderr, "%s: %s\n", spec, std::string(p.status().message()).c_str());
    std::exit(1);
  }
  return *std::move(p);
}

void Compress(const Pipeline& pipeline, const Turn& turn) {
  auto msg = pipeline.Compress(turn, nullptr);
  if (!msg.ok()) {
    std::fprintf(stderr, "%s\n", std::string(msg.status().message()).c_str());
    std::exit(1);
  }
}

// BM_Gram's operand: 476 rows of random bfloat16 values, packed in pairs.
struct GramOperand {
  static constexpr int kRows = 476, kD = 128;
  GramOperand() : ld(kvrelay::internal::GramStride(kD)), pairs((kRows + 1) / 2) {
    packed.assign(static_cast<size_t>(pairs) * ld, 0);
    g.resize(static_cast<size_t>(ld) * ld);
    uint32_t x = 12345;
    for (int t = 0; t < kRows; ++t) {
      for (int j = 0; j < kD; ++j) {
        x = x * 1664525u + 1013904223u;
        const uint32_t bf16 = (x >> 16 & 0x8000u) | ((118u + (x >> 8) % 8u) << 7) | (x & 0x7fu);
        packed[static_cast<size_t>(t / 2) * ld + j] |= t % 2 ? bf16 << 16 : bf16;
      }
    }
  }
  int ld, pairs;
  std::vector<uint32_t> packed;
  std::vector<float> g;
};

}  // namespace

extern "C" {
__attribute__((noinline)) void kvrelay_profile_selection(const Pipeline* p, const Turn* t) { Compress(*p, *t); }
__attribute__((noinline)) void kvrelay_profile_obf_fast(const Pipeline* p, const Turn* t) { Compress(*p, *t); }
__attribute__((noinline)) void kvrelay_profile_gram(GramOperand* o, int heads) {
  for (int h = 0; h < heads; ++h) {
    kvrelay::internal::GramLowerBf16(o->packed.data(), o->pairs, GramOperand::kD, o->g.data());
  }
  asm volatile("" : : "r"(o->g.data()) : "memory");
}
}

int main(int argc, char** argv) {
  kvrelay::SyntheticTurnOptions o = kvrelay::Qwen3_14BTurn();
  o.seed = 14;
  o.layers = argc > 1 ? std::atoi(argv[1]) : 4;
  auto turn = kvrelay::MakeSyntheticTurn(o);
  if (!turn.ok()) {
    std::fprintf(stderr, "%s\n", std::string(turn.status().message()).c_str());
    return 1;
  }
  const int heads = o.layers * o.kv_heads;
  const auto selection = MakePipeline("h2o-head:k=32");
  const auto obf_fast = MakePipeline("h2o-head:k=32+obf:p=8,mode=fast");
  GramOperand gram;
  Compress(*selection, *turn);
  Compress(*obf_fast, *turn);
  kvrelay::internal::GramLowerBf16(gram.packed.data(), gram.pairs, GramOperand::kD, gram.g.data());
  kvrelay_profile_selection(selection.get(), &*turn);
  kvrelay_profile_obf_fast(obf_fast.get(), &*turn);
  kvrelay_profile_gram(&gram, heads);
  std::printf("layers %d, KV heads %d\n", o.layers, heads);
  return 0;
}
