// Switches for the pipeline's two lines of defence against hostile numbers,
// so that tests can show each stops a bad turn on its own. Both are on in
// every build; nothing but tests turns one off.
//
//  - finite: every quantity computed from a turn (attention mass, the
//    fidelity figure, accumulated importance) is finite, or the layer is
//    InvalidArgument naming the tensor.
//  - invariants: the layer's output matches the message's geometry
//    (CheckLayerOutput); a violation is Internal. (The check that every
//    head keeps the same number of tokens before buffers are sized from
//    head 0 is never switched off.)
//
// Thread-safe (relaxed atomics).
#ifndef KVRELAY_CORE_INTERNAL_PIPELINE_CHECKS_H_
#define KVRELAY_CORE_INTERNAL_PIPELINE_CHECKS_H_

#include <atomic>

namespace kvrelay {
namespace internal {

struct PipelineChecks {
  std::atomic<bool> finite{true};
  std::atomic<bool> invariants{true};
};

inline PipelineChecks& PipelineChecksForTesting() {
  static PipelineChecks checks;
  return checks;
}

inline bool FiniteChecksOn() { return PipelineChecksForTesting().finite.load(std::memory_order_relaxed); }
inline bool InvariantChecksOn() { return PipelineChecksForTesting().invariants.load(std::memory_order_relaxed); }

}  // namespace internal
}  // namespace kvrelay

#endif  // KVRELAY_CORE_INTERNAL_PIPELINE_CHECKS_H_
