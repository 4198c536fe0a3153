#include "server/config/route_template.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "proto/address.h"

namespace kvrelay {
namespace {

constexpr char kPlaceholder[] = "{agent}";

}  // namespace

absl::Status CheckRouteTemplate(const std::string& tmpl) {
  const size_t at = tmpl.find(kPlaceholder);
  if (at == std::string::npos || tmpl.find(kPlaceholder, at + 1) != std::string::npos) {
    return absl::InvalidArgumentError(
        "a target with the placeholder {agent} exactly once, e.g. dns:///{agent}.agents:50051");
  }
  // Any DNS label must make a target.
  if (absl::Status st = CheckGrpcTarget(ExpandRouteTemplate(tmpl, "x")); !st.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("a target once {agent} is substituted (with 'x': ", st.message(), ")"));
  }
  return absl::OkStatus();
}

std::string ExpandRouteTemplate(const std::string& tmpl, const std::string& agent) {
  return absl::StrReplaceAll(tmpl, {{kPlaceholder, agent}});
}

bool IsDnsLabel(const std::string& name) {
  if (name.empty() || name.size() > 63) return false;
  auto alnum = [](char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'); };
  for (char c : name) {
    if (!alnum(c) && c != '-') return false;
  }
  return alnum(name.front()) && alnum(name.back());
}

}  // namespace kvrelay
