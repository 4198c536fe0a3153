// Helpers of the verbs that talk to a relay (relay_verbs.cc, demo.cc and
// compress --addr); built only with the relay client (KVRELAYCTL_WITH_RELAY).
#ifndef KVRELAY_CLIENT_KVRELAYCTL_INTERNAL_RELAY_H_
#define KVRELAY_CLIENT_KVRELAYCTL_INTERNAL_RELAY_H_

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/kvrelayctl/flags.h"
#include "client/kvrelayctl/verbs.h"
#include "client/relay_client.h"

namespace kvrelay::ctl {

// A relay's refusal: exit 1, "WHAT: CODE_NAME: message".
Failure RelayError(absl::string_view what, const absl::Status& s);

// The relay address --addr (required), checked (CheckRelayAddress); errors
// name the flag.
absl::StatusOr<std::string> AddrFlag(const Flags& flags);

// A client of `addr` as --tls-ca, --tls-cert, --tls-key and --token-file
// say (no --token-file: KVRELAY_TOKEN, which RelayClient::Connect reads).
// On failure `*failure` names the flag: a usage failure for a flag
// combination, a runtime failure for a file that cannot be used.
std::unique_ptr<RelayClient> Dial(const Flags& flags, const std::string& addr, Outcome* failure);

// Declares std::unique_ptr<RelayClient> `var` dialled as Dial does, or
// returns Dial's failure from the calling verb.
#define KVRELAYCTL_DIAL(var, flags, addr)                                \
  Outcome var##_failure;                                                \
  std::unique_ptr<RelayClient> var = Dial(flags, addr, &var##_failure); \
  if (!var) return var##_failure

// Progress on stderr when it is a terminal: at most 10 updates a second,
// the line cleared when the transfer is done (Clear, or destruction).
class ProgressLine {
 public:
  explicit ProgressLine(std::string label);
  ~ProgressLine() { Clear(); }
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;

  // A callback for PublishOptions/FetchOptions::progress; null when stderr
  // is not a terminal. Valid while this lives.
  ProgressCallback Callback();
  void Clear();

 private:
  std::string label_;
  bool tty_;
  bool shown_ = false;
  std::chrono::steady_clock::time_point last_{};
};

}  // namespace kvrelay::ctl

#endif  // KVRELAY_CLIENT_KVRELAYCTL_INTERNAL_RELAY_H_
