// The byte budget `auto:budget=F` (docs/FORMAT.md, "Byte budget"): of a
// fixed grid of policies (selector k, demotion bits, lloyd bits), the one
// whose message fits F times the bytes of `full` and whose estimated
// attention error is smallest.
//
// Pure functions, thread-safe.
#ifndef KVRELAY_CORE_BUDGET_H_
#define KVRELAY_CORE_BUDGET_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "core/turn.h"

namespace kvrelay {

// How the estimate weighs a head's prompt tokens (docs/FORMAT.md, "Byte
// budget"): by the attention the turn measured (its scores, or with gen.q
// its generated steps' mass), or all alike (`weight=uniform`, for turns
// whose next agent may ask about any token).
enum class BudgetWeight { kAttention, kUniform };

// One setting of the grid.
struct BudgetCandidate {
  int k = -1;           // h2o-head's k; -1: full (every token)
  int demote_bits = 0;  // 0: evict what k drops
  // The lloyd bits of the kept tokens, per layer: keys', values'.
  std::vector<std::pair<int, int>> layer_bits;
  uint64_t bytes = 0;   // what the message sends (exact, from the geometry)
  double error = 0;     // the estimate, in [0, 1]

  // The spec of the setting: lloyd:bits=B when every layer has B bits for
  // keys and values, else lloyd:layers= ("h2o-head:k=16+demote:bits=1+lloyd:layers=43.32").
  std::string Spec() const;
};

// Every setting of the grid for a turn (first agent or not), with its bytes
// and estimated error from the turn's scores (or, with gen.q, the attention
// mass of its generated steps): per selector k and demotion bits, the bit
// allocations of a greedy walk from 1 bit everywhere, each step one more
// bit for the keys or the values of one layer, largest estimated gain first
// (docs/FORMAT.md, "Byte budget"). With gen.q, each layer's keys and values
// weigh as their QuantSensitivities. InvalidArgument as
// Pipeline::Compress for a turn that does not validate.
absl::StatusOr<std::vector<BudgetCandidate>> BudgetCandidates(const Turn& turn,
                                                              BudgetWeight weight = BudgetWeight::kAttention);

// How much a layer's attention output moves when its keys (k) or its
// values (v) are quantized by lloyd at B bits (index B, 1..4; 0 unused): the
// mean over score heads and up to kSensitivitySteps generated steps spread
// over the turn of |o' - o| / |o|, where every row moves by lloyd's relative
// error at B bits in a direction of fixed random signs (docs/FORMAT.md,
// "Byte budget"). Empty without gen.q.
inline constexpr int kSensitivitySteps = 4;
struct QuantSensitivity {
  double k[5] = {0, 0, 0, 0, 0};
  double v[5] = {0, 0, 0, 0, 0};
};
std::vector<QuantSensitivity> QuantSensitivities(const Turn& turn, const TurnGeometry& geo);

// The setting auto:budget=`budget` picks: smallest error among those whose
// bytes are at most budget * full_bytes (ties: fewer bytes, then the grid's
// order). InvalidArgument naming the smallest fraction any setting needs
// when none fits.
absl::StatusOr<BudgetCandidate> ChooseBudget(const std::vector<BudgetCandidate>& grid, uint64_t full_bytes,
                                             double budget);

}  // namespace kvrelay

#endif  // KVRELAY_CORE_BUDGET_H_
