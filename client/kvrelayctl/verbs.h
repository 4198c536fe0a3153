// The verbs of kvrelayctl, one group per file, as main.cc's dispatch table
// calls them. Each verb has a flag table (its *Spec function: Flags::Parse
// reads the arguments against it, `kvrelayctl VERB --help` prints it) and a
// handler that runs on the parsed flags.
//
// Exit status: 0 on success, 1 for runtime errors (bad files, bad policies,
// I/O, a relay's refusal), 2 for usage errors (unknown verb or flag, missing
// or malformed flag value). main.cc prints a Failure to stderr as
// "kvrelayctl: <message>".
#ifndef KVRELAY_CLIENT_KVRELAYCTL_VERBS_H_
#define KVRELAY_CLIENT_KVRELAYCTL_VERBS_H_

#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "client/kvrelayctl/flags.h"

namespace kvrelay::ctl {

inline constexpr int kRuntimeError = 1;
inline constexpr int kUsageError = 2;

// Why a verb failed: the exit status (kRuntimeError or kUsageError) and
// the message.
struct Failure {
  int code;
  std::string message;
};

// What a handler returns: nullopt on success.
using Outcome = std::optional<Failure>;

inline Failure Usage(std::string msg) { return {kUsageError, std::move(msg)}; }
inline Failure Runtime(const absl::Status& s) { return {kRuntimeError, std::string(s.message())}; }

// ---- offline verbs (offline_verbs.cc): files on this machine only ----
VerbSpec CompressSpec();  // compress (with --addr, at a relay in a relay build)
Outcome Compress(const Flags& flags);
VerbSpec InspectSpec();
Outcome Inspect(const Flags& flags);
VerbSpec MakeTurnSpec();
Outcome MakeTurn(const Flags& flags);
VerbSpec TokenSpec();  // token new AGENT
Outcome Token(const Flags& flags);

#ifdef KVRELAYCTL_WITH_RELAY
// ---- relay verbs (relay_verbs.cc): one call each to a running relay ----
VerbSpec PublishSpec();
Outcome Publish(const Flags& flags);
VerbSpec FetchSpec();
Outcome Fetch(const Flags& flags);
VerbSpec AckSpec();
Outcome Ack(const Flags& flags);
VerbSpec CloseSpec();
Outcome Close(const Flags& flags);
VerbSpec HealthSpec();
Outcome Health(const Flags& flags);
VerbSpec StatsSpec();
Outcome Stats(const Flags& flags);
VerbSpec StatusSpec();
Outcome Status(const Flags& flags);

// ---- demo (demo.cc): a chain of simulated agents over one or four relays ----
VerbSpec DemoSpec();
Outcome Demo(const Flags& flags);
#endif

}  // namespace kvrelay::ctl

#endif  // KVRELAY_CLIENT_KVRELAYCTL_VERBS_H_
