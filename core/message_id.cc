#include "core/message_id.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "core/token.h"

namespace kvrelay {

absl::StatusOr<std::string> NewMessageId() { return NewMessageId(RandomBytes); }

absl::StatusOr<std::string> NewMessageId(RandomFill fill) {
  char raw[kMessageIdRandomBytes];
  if (absl::Status s = fill(raw, sizeof(raw)); !s.ok()) {
    return absl::InternalError(absl::StrCat("header.message_id: empty, and no random id could be made for it (",
                                            s.message(), "); retry, or set a message id of your own"));
  }
  return absl::StrCat("m-", absl::BytesToHexString(absl::string_view(raw, sizeof(raw))));
}

}  // namespace kvrelay
