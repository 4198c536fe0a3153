// The flags of kvrelay-server, in one table (ServerFlags). Each entry holds
// the flag's name, its value's form, its KVRELAY_* environment variable, its
// default, its help and its parser; the command line, the environment
// fallbacks, the --config file's keys, --help and the flag table of
// docs/OPERATING.md (ServerFlagsMarkdown, checked by a test) all come from it.
//
// Thread-safety: the table is immutable; every function may be called from
// any thread.
#ifndef KVRELAY_SERVER_CONFIG_FLAGS_H_
#define KVRELAY_SERVER_CONFIG_FLAGS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "server/config/config.h"

namespace kvrelay {

enum class FlagKind {
  kValue,   // --name VALUE; a later source overrides an earlier one
  kSwitch,  // --name alone means true; --name=false, 0, no, off
  kList,    // repeatable; each source's list replaces the lower sources' as a whole
  kMap,     // repeatable KEY=VALUE; the sources merge per key
  kConfig,  // --config FILE, read before the environment and the flags
};

struct FlagSpec {
  // kValue, kSwitch: parses `value` into `c`. kList: checks one item.
  // kMap: parses one KEY=VALUE item and sets it in `c`. Errors are
  // InvalidArgument "--FLAG=VALUE: expected ...".
  using Parse = absl::Status (*)(absl::string_view flag, const std::string& value, ServerConfig* c);

  std::string name;          // without the dashes, e.g. "max-inflight-bytes"
  std::string metavar;       // the value's form, e.g. "N"; "" for a switch
  FlagKind kind = FlagKind::kValue;
  std::string env;           // e.g. "KVRELAY_MAX_INFLIGHT_BYTES"
  char env_separator = 0;    // kList, kMap: between the variable's items
  std::string default_text;  // "" when there is none
  std::string help;          // one paragraph, without the variable and the default
  Parse parse = nullptr;
  // kList: the field it replaces.
  std::vector<std::string>* (*list)(ServerConfig* c) = nullptr;
  bool at_least_one = false;     // kList: an empty list is an error
  bool empty_env_is_set = false; // an empty variable is a value, not unset
};

// Every flag, in the order --help lists them.
const std::vector<FlagSpec>& ServerFlags();
// The flag named `name` (without dashes); nullptr when there is none.
const FlagSpec* FindServerFlag(absl::string_view name);

// InvalidArgument "--FLAG=VALUE: expected EXPECTED".
absl::Status FlagError(absl::string_view flag, absl::string_view value, absl::string_view expected);

// `kvrelay-server --help`.
std::string ServerUsage();
// The flag table in Markdown (flag, environment, default, what it does), as
// docs/OPERATING.md holds it; `kvrelay-server --help=markdown` prints it.
std::string ServerFlagsMarkdown();

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_CONFIG_FLAGS_H_
