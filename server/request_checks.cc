#include "server/request_checks.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "core/quant.h"

namespace kvrelay {

absl::Status CheckPolicyLength(const std::string& policy, const std::string& field) {
  if (policy.size() <= kMaxSpecBytes) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": ", policy.size(), " bytes, expected at most ", kMaxSpecBytes));
}

absl::Status CheckId(const std::string& field, const std::string& v) {
  if (v.empty() || v.size() > 128) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", v.size(), " bytes, expected [A-Za-z0-9._:-]{1,128}"));
  }
  for (char c : v) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                    c == '_' || c == ':' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": '", absl::CHexEscape(v), "', expected [A-Za-z0-9._:-]{1,128}"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckPolicyFor(const Pipeline& p, const TurnGeometry& geo, const std::string& field) {
  if (p.config().quant) {
    absl::Status s = ValidateQuantOptions(*p.config().quant, geo.head_dim);
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat(field, ": ", s.message()));
  }
  if (absl::Status s = p.CheckWindow(geo); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", s.message(),
                                                   " (header.geometry.query_dtype is unset)"));
  }
  return absl::OkStatus();
}

}  // namespace kvrelay
