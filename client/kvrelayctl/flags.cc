#include "client/kvrelayctl/flags.h"

#include <cmath>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"

namespace kvrelay::ctl {

FlagSpec ValueFlag(std::string name, std::string value_name, std::string help, std::string default_value) {
  return {std::move(name), FlagKind::kValue, std::move(value_name), std::move(help), std::move(default_value), false};
}

FlagSpec RequiredFlag(std::string name, std::string value_name, std::string help) {
  return {std::move(name), FlagKind::kValue, std::move(value_name), std::move(help), "", true};
}

FlagSpec BoolFlag(std::string name, std::string help) {
  return {std::move(name), FlagKind::kBool, "", std::move(help), "", false};
}

FlagSpec RepeatedFlag(std::string name, std::string value_name, std::string help, bool required) {
  return {std::move(name), FlagKind::kRepeated, std::move(value_name), std::move(help), "", required};
}

std::string HelpText(const std::string& verb, const std::string& summary, const VerbSpec& spec) {
  std::string out = absl::StrCat("usage: kvrelayctl ", verb);
  if (!spec.synopsis.empty()) absl::StrAppend(&out, " ", spec.synopsis);
  if (!spec.flags.empty()) absl::StrAppend(&out, " [flags]");
  absl::StrAppend(&out, "\n", summary, "\n");
  if (spec.flags.empty()) return absl::StrCat(out, "\nno flags.\n");
  absl::StrAppend(&out, "\nflags:\n");
  for (const FlagSpec& f : spec.flags) {
    absl::StrAppend(&out, "  --", f.name);
    if (f.kind != FlagKind::kBool) absl::StrAppend(&out, " ", f.value_name);
    absl::StrAppend(&out, "\n      ", f.help);
    if (f.required) absl::StrAppend(&out, " (required)");
    if (f.kind == FlagKind::kRepeated) absl::StrAppend(&out, " (repeatable)");
    if (!f.default_value.empty()) absl::StrAppend(&out, " (default: ", f.default_value, ")");
    absl::StrAppend(&out, "\n");
  }
  return out;
}

std::string Synopsis(const std::string& verb, const VerbSpec& spec, int indent, int width) {
  std::vector<std::string> words;
  if (!spec.synopsis.empty()) words.push_back(spec.synopsis);
  for (const FlagSpec& f : spec.flags) {
    std::string w = absl::StrCat("--", f.name);
    if (f.kind != FlagKind::kBool) absl::StrAppend(&w, " ", f.value_name);
    if (f.kind == FlagKind::kRepeated) absl::StrAppend(&w, f.required ? absl::StrCat(" [", w, " ...]") : " ...");
    words.push_back(f.required ? w : absl::StrCat("[", w, "]"));
  }
  const std::string first(indent, ' '), next(indent + verb.size() + 1, ' ');
  std::string out = absl::StrCat(first, verb), line = out;
  for (const std::string& w : words) {
    if (line.size() + 1 + w.size() > static_cast<size_t>(width) && line.size() > next.size()) {
      absl::StrAppend(&out, "\n", next, w);
      line = next + w;
    } else {
      absl::StrAppend(&out, " ", w);
      absl::StrAppend(&line, " ", w);
    }
  }
  return absl::StrCat(out, "\n");
}

absl::StatusOr<Flags> Flags::Parse(std::string verb, const VerbSpec& spec, absl::Span<const std::string> args) {
  Flags flags(std::move(verb), spec);
  for (size_t i = 0; i < args.size() && !flags.help_requested_; ++i) {
    KVRELAY_RETURN_IF_ERROR(flags.Accept(args[i], args, &i));
  }
  return flags;
}

const FlagSpec* Flags::Find(const std::string& name) const {
  for (const FlagSpec& f : spec_.flags) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

// Takes args[*i] (and its value, advancing *i, for "--name VALUE").
absl::Status Flags::Accept(const std::string& arg, absl::Span<const std::string> args, size_t* i) {
  auto unknown = [this](const std::string& flag) {
    std::vector<std::string> names;
    for (const FlagSpec& f : spec_.flags) names.push_back(absl::StrCat("--", f.name));
    const std::string listed =
        names.empty() ? "; it takes no flags" : absl::StrCat("; its flags: ", absl::StrJoin(names, ", "));
    return absl::InvalidArgumentError(absl::StrCat("unknown flag ", flag, " for ", verb_, listed));
  };
  if (arg.size() < 3 || arg.compare(0, 2, "--") != 0) {
    if (arg == "-h") {
      help_requested_ = true;
    } else if (arg.size() > 1 && arg[0] == '-') {
      return unknown(arg);
    } else {
      positional_.push_back(arg);
    }
    return absl::OkStatus();
  }
  std::string name = arg.substr(2), value;
  const size_t eq = name.find('=');
  const bool has_value = eq != std::string::npos;
  if (has_value) {
    value = name.substr(eq + 1);
    name.resize(eq);
  }
  const FlagSpec* spec = Find(name);
  if (spec == nullptr) {
    if (name == "help" && !has_value) {
      help_requested_ = true;
      return absl::OkStatus();
    }
    return unknown(absl::StrCat("--", name));
  }
  auto twice = [&name] { return absl::InvalidArgumentError(absl::StrCat("flag --", name, " given twice")); };
  if (spec->kind == FlagKind::kBool) {
    if (has_value) return absl::InvalidArgumentError(absl::StrCat("flag --", name, " takes no value"));
    return bools_.insert(name).second ? absl::OkStatus() : twice();
  }
  if (!has_value) {
    if (*i + 1 >= args.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("flag --", name, " needs a value (--", name, " ", spec->value_name, ")"));
    }
    value = args[++*i];
  }
  if (spec->kind == FlagKind::kRepeated) {
    repeated_[name].push_back(std::move(value));
    return absl::OkStatus();
  }
  return values_.emplace(name, std::move(value)).second ? absl::OkStatus() : twice();
}

bool Flags::Has(const std::string& name) const {
  return values_.count(name) || bools_.count(name) || repeated_.count(name);
}

std::optional<std::string> Flags::Get(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

std::optional<std::string> Flags::Value(const std::string& name) const {
  if (std::optional<std::string> v = Get(name)) return v;
  const FlagSpec* spec = Find(name);
  if (spec == nullptr || spec->default_value.empty()) return std::nullopt;
  return spec->default_value;
}

std::vector<std::string> Flags::GetAll(const std::string& name) const {
  auto it = repeated_.find(name);
  return it == repeated_.end() ? std::vector<std::string>() : it->second;
}

absl::StatusOr<std::string> Flags::Required(const std::string& name) const {
  std::optional<std::string> v = Get(name);
  if (!v) return absl::InvalidArgumentError(absl::StrCat(verb_, ": missing required flag --", name));
  if (v->empty()) return absl::InvalidArgumentError(absl::StrCat("flag --", name, ": empty value"));
  return *v;
}

absl::StatusOr<int64_t> Flags::Int(const std::string& name, int64_t lo, int64_t hi) const {
  const FlagSpec* spec = Find(name);
  int64_t fallback = 0;
  if (spec == nullptr || !absl::SimpleAtoi(spec->default_value, &fallback)) {
    return absl::InternalError(absl::StrCat("flag --", name, ": no integer default in the table of ", verb_));
  }
  return IntOr(name, fallback, lo, hi);
}

absl::StatusOr<int64_t> Flags::IntOr(const std::string& name, int64_t fallback, int64_t lo, int64_t hi) const {
  std::optional<std::string> v = Get(name);
  if (!v) return fallback;
  int64_t x;
  if (!absl::SimpleAtoi(*v, &x) || x < lo || x > hi) {
    return absl::InvalidArgumentError(
        absl::StrCat("flag --", name, ": \"", *v, "\", expected an integer in [", lo, ", ", hi, "]"));
  }
  return x;
}

absl::StatusOr<std::chrono::milliseconds> Flags::Seconds(const std::string& name, double lo, double hi) const {
  std::optional<std::string> v = Value(name);
  double x = 0;
  if (!v || !absl::SimpleAtod(*v, &x) || !(x >= lo && x <= hi)) {
    if (!Get(name)) {
      return absl::InternalError(absl::StrCat("flag --", name, ": no seconds default in the table of ", verb_));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("flag --", name, ": \"", *v, "\", expected seconds in [", lo, ", ", hi, "]"));
  }
  return std::chrono::milliseconds(static_cast<int64_t>(std::llround(x * 1000)));
}

}  // namespace kvrelay::ctl
