// The byte budget `auto:budget=F` (docs/FORMAT.md, "Byte budget"): of a
// fixed grid of policies (selector k, demotion bits, lloyd bits), the one
// whose message fits F times the bytes of `full` and whose estimated
// attention error is smallest.
//
// Pure functions, thread-safe.
#ifndef KVRELAY_CORE_BUDGET_H_
#define KVRELAY_CORE_BUDGET_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/turn.h"

namespace kvrelay {

// One setting of the grid.
struct BudgetCandidate {
  int k = -1;           // h2o-head's k; -1: full (every token)
  int demote_bits = 0;  // 0: evict what k drops
  int bits = 4;         // lloyd bits of the kept tokens
  uint64_t bytes = 0;   // what the message sends (exact, from the geometry)
  double error = 0;     // the estimate, in [0, 1]

  // The canonical-order spec of the setting ("h2o-head:k=16+demote:bits=1+lloyd:bits=3").
  std::string Spec() const;
};

// Every setting of the grid for a turn of geometry `geo` (first agent or
// not), with its bytes and estimated error from the turn's scores (or, with
// gen.q, the attention mass of its generated steps). InvalidArgument as
// Pipeline::Compress for a turn that does not validate.
absl::StatusOr<std::vector<BudgetCandidate>> BudgetCandidates(const Turn& turn);

// The setting auto:budget=`budget` picks: smallest error among those whose
// bytes are at most budget * full_bytes (ties: fewer bytes, then the grid's
// order). InvalidArgument naming the smallest fraction any setting needs
// when none fits.
absl::StatusOr<BudgetCandidate> ChooseBudget(const std::vector<BudgetCandidate>& grid, uint64_t full_bytes,
                                             double budget);

}  // namespace kvrelay

#endif  // KVRELAY_CORE_BUDGET_H_
