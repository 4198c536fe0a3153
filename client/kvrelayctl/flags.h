// The one flag parser of kvrelayctl. Every verb declares its flags in a
// table (FlagSpec: name, kind, help, default); the parser reads the verb's
// arguments against that table, the typed getters fall back to the table's
// defaults, and `kvrelayctl VERB --help` is HelpText of the same table.
//
// Syntax, for every verb alike:
//   --name VALUE    the next argument is the value, whatever it starts with
//                   ("--seed -5" gives "-5"; "--out --in" gives "--in")
//   --name=VALUE    the value after the first '='
//   --name          a bool flag (kBool), which takes no value
//   --help, -h      asks for the verb's help, unless the verb declares it
//   anything else   a positional argument, except that an argument of two
//                   or more characters starting with '-' is an unknown flag
// A kValue or kBool flag may be given once; a kRepeated flag any number of
// times (GetAll keeps their order).
//
// Every error is an InvalidArgumentError (a usage error) whose message
// names the flag, e.g.
//   unknown flag --bogus for compress; its flags: --policy, --in, ...
//   flag --out needs a value (--out FILE)
//   flag --decode takes no value
//   flag --in given twice
#ifndef KVRELAY_CLIENT_KVRELAYCTL_FLAGS_H_
#define KVRELAY_CLIENT_KVRELAYCTL_FLAGS_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace kvrelay::ctl {

enum class FlagKind {
  kValue,     // --name VALUE, at most once
  kBool,      // --name, at most once; true when given
  kRepeated,  // --name VALUE, any number of times
};

// One row of a verb's flag table.
struct FlagSpec {
  std::string name;        // without the leading "--"
  FlagKind kind = FlagKind::kValue;
  std::string value_name;  // the value's placeholder in help ("FILE", "N"); unused for kBool
  std::string help;        // one or a few sentences
  // The value the typed getters use when the flag is absent, and what help
  // shows as "(default: ...)". Empty: no default (required, or a default
  // the verb computes and `help` describes).
  std::string default_value;
  bool required = false;   // shown in help; the verb checks it with Required()
};

// The rows of a flag table, by kind.
FlagSpec ValueFlag(std::string name, std::string value_name, std::string help, std::string default_value = "");
FlagSpec RequiredFlag(std::string name, std::string value_name, std::string help);
FlagSpec BoolFlag(std::string name, std::string help);
FlagSpec RepeatedFlag(std::string name, std::string value_name, std::string help, bool required = false);

// A verb's arguments: its positional synopsis and its flag table.
struct VerbSpec {
  std::string synopsis;  // positional arguments after the verb, e.g. "FILE" ("" when none)
  std::vector<FlagSpec> flags;
};

// `kvrelayctl VERB --help`: the usage line, `summary` and one entry per
// flag of `spec` with its help, default and whether it is required.
std::string HelpText(const std::string& verb, const std::string& summary, const VerbSpec& spec);

// The verb's one-line synopsis from its table, for `kvrelayctl help`:
// "VERB POSITIONAL --required VALUE [--optional VALUE] [--bool]
// --repeated VALUE [--repeated VALUE ...]", wrapped before `width` columns
// with continuation lines under the first flag, each line indented by
// `indent` spaces.
std::string Synopsis(const std::string& verb, const VerbSpec& spec, int indent = 2, int width = 80);

// The flags of one invocation of one verb, parsed against its table.
class Flags {
 public:
  // Parses `args` (the arguments after the verb) against `spec`; errors as
  // the file comment says. `verb` names the verb in error messages.
  static absl::StatusOr<Flags> Parse(std::string verb, const VerbSpec& spec,
                                     absl::Span<const std::string> args);

  const std::string& verb() const { return verb_; }
  // True when --help or -h was given: the verb's help is wanted, nothing else.
  bool help_requested() const { return help_requested_; }
  const std::vector<std::string>& positional() const { return positional_; }

  // Whether the flag was given (any kind).
  bool Has(const std::string& name) const;
  // The value given to a kValue flag, or nullopt (the default is not used).
  std::optional<std::string> Get(const std::string& name) const;
  // The value given to a kValue flag, else the table's default; nullopt
  // when neither (an absent flag with an empty default).
  std::optional<std::string> Value(const std::string& name) const;
  // Every value of a kRepeated flag, in order.
  std::vector<std::string> GetAll(const std::string& name) const;
  // The value given, non-empty; else "VERB: missing required flag --NAME"
  // or "flag --NAME: empty value".
  absl::StatusOr<std::string> Required(const std::string& name) const;
  // An integer in [lo, hi], given or the table's default (which is not
  // range-checked); an error names the flag, the value and the range.
  absl::StatusOr<int64_t> Int(const std::string& name, int64_t lo, int64_t hi) const;
  // As Int, with `fallback` for a flag whose default the verb computes.
  absl::StatusOr<int64_t> IntOr(const std::string& name, int64_t fallback, int64_t lo, int64_t hi) const;
  // A duration in seconds (fractions allowed) in [lo, hi], given or the
  // table's default, rounded to milliseconds.
  absl::StatusOr<std::chrono::milliseconds> Seconds(const std::string& name, double lo, double hi) const;

 private:
  Flags(std::string verb, VerbSpec spec) : verb_(std::move(verb)), spec_(std::move(spec)) {}
  const FlagSpec* Find(const std::string& name) const;
  absl::Status Accept(const std::string& arg, absl::Span<const std::string> args, size_t* i);

  std::string verb_;
  VerbSpec spec_;
  bool help_requested_ = false;
  std::map<std::string, std::string> values_;
  std::map<std::string, std::vector<std::string>> repeated_;
  std::set<std::string> bools_;
  std::vector<std::string> positional_;
};

}  // namespace kvrelay::ctl

#endif  // KVRELAY_CLIENT_KVRELAYCTL_FLAGS_H_
