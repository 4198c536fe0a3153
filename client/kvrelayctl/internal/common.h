// Helpers the verb groups of kvrelayctl share; nothing outside
// client/kvrelayctl/ includes this.
#ifndef KVRELAY_CLIENT_KVRELAYCTL_INTERNAL_COMMON_H_
#define KVRELAY_CLIENT_KVRELAYCTL_INTERNAL_COMMON_H_

#include <cstdint>
#include <string>
#include <vector>

#include "client/kvrelayctl/flags.h"
#include "client/kvrelayctl/verbs.h"
#include "core/format/synthetic.h"
#include "core/status_macros.h"

namespace kvrelay::ctl {

// Unwraps a flag-derived StatusOr into `lhs`, or returns its error from the
// calling verb as a usage failure (exit 2).
#define KVRELAYCTL_FLAG(lhs, expr)                                                          \
  auto KVRELAY_INTERNAL_CONCAT(flag_, __LINE__) = (expr);                                   \
  if (!KVRELAY_INTERNAL_CONCAT(flag_, __LINE__).ok())                                       \
    return Usage(std::string(KVRELAY_INTERNAL_CONCAT(flag_, __LINE__).status().message())); \
  lhs = *std::move(KVRELAY_INTERNAL_CONCAT(flag_, __LINE__))

// full/sent with three decimals, or "inf" when nothing was sent.
std::string Ratio(uint64_t full, uint64_t sent);

// A usage failure when the verb got a positional argument.
Outcome NoPositional(const Flags& flags);

// Appends `rows` to `flags`.
void AppendFlags(std::vector<FlagSpec>* flags, std::vector<FlagSpec> rows);

// The flag rows of every verb that dials a relay: --tls-ca, --tls-cert,
// --tls-key, --token-file.
std::vector<FlagSpec> ConnectFlagSpecs();

// The flag rows of a synthetic turn's geometry, `defaults` giving their
// defaults: --layers, --kv-heads, --head-dim, --prompt, --gen, --dtype,
// --seed, --queries (a verb adds --score-heads, whose default differs).
std::vector<FlagSpec> TurnGeometryFlagSpecs(const SyntheticTurnOptions& defaults);

// Reads the flags of TurnGeometryFlagSpecs into `o` (score_heads aside).
Outcome ReadTurnGeometry(const Flags& flags, SyntheticTurnOptions* o);

// `o` as the flags gave it, checked before anything else happens: usage
// errors name the flags.
Outcome CheckTurnFlags(const SyntheticTurnOptions& o);

}  // namespace kvrelay::ctl

#endif  // KVRELAY_CLIENT_KVRELAYCTL_INTERNAL_COMMON_H_
