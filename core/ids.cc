#include "core/ids.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace kvrelay {
namespace {

bool IsIdChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
         c == ':' || c == '-';
}

}  // namespace

bool IsId(absl::string_view v) {
  if (v.empty() || v.size() > 128) return false;
  for (char c : v) {
    if (!IsIdChar(c)) return false;
  }
  return true;
}

absl::Status CheckId(absl::string_view field, absl::string_view v) {
  if (v.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": empty, expected ", kIdPattern));
  if (v.size() > 128) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", v.size(), " bytes, expected ", kIdPattern));
  }
  if (!IsId(v)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": '", absl::CHexEscape(v), "', expected ", kIdPattern));
  }
  return absl::OkStatus();
}

}  // namespace kvrelay
