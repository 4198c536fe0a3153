#include "client/kvrelayctl/internal/relay.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace kvrelay::ctl {
namespace {

// The token of --token-file: its first line, whitespace trimmed.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || (!std::getline(in, line) && in.bad())) {
    return absl::InvalidArgumentError(
        absl::StrCat("flag --token-file: cannot read \"", path, "\": ", std::strerror(errno)));
  }
  const absl::string_view token = absl::StripAsciiWhitespace(line);
  if (token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("flag --token-file: \"", path, "\": first line is empty, expected the token"));
  }
  return std::string(token);
}

// ConnectOptions from the connection flags.
Outcome ConnectFlags(const Flags& flags, ConnectOptions* o) {
  for (const char* name : {"tls-ca", "tls-cert", "tls-key", "token-file"}) {
    if (flags.Get(name) && flags.Get(name)->empty()) return Usage(absl::StrCat("flag --", name, ": empty value"));
  }
  o->tls_ca_file = flags.Get("tls-ca").value_or("");
  o->tls_cert_file = flags.Get("tls-cert").value_or("");
  o->tls_key_file = flags.Get("tls-key").value_or("");
  if (o->tls_cert_file.empty() != o->tls_key_file.empty()) {
    return Usage(o->tls_cert_file.empty() ? "flag --tls-key: given without --tls-cert, expected both or neither"
                                          : "flag --tls-cert: given without --tls-key, expected both or neither");
  }
  if (!o->tls_cert_file.empty() && o->tls_ca_file.empty()) {
    return Usage("flag --tls-cert: given without --tls-ca, expected --tls-ca FILE too (it turns TLS on)");
  }
  if (std::optional<std::string> path = flags.Get("token-file")) {
    absl::StatusOr<std::string> token = ReadTokenFile(*path);
    if (!token.ok()) return Runtime(token.status());
    o->token = *std::move(token);
  }
  return std::nullopt;
}

}  // namespace

Failure RelayError(absl::string_view what, const absl::Status& s) {
  return {kRuntimeError, absl::StrCat(what, ": ", absl::StatusCodeToString(s.code()), ": ", s.message())};
}

absl::StatusOr<std::string> AddrFlag(const Flags& flags) {
  KVRELAY_ASSIGN_OR_RETURN(std::string addr, flags.Required("addr"));
  if (absl::Status s = CheckRelayAddress(addr); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("flag --addr: ", s.message()));
  }
  return addr;
}

std::unique_ptr<RelayClient> Dial(const Flags& flags, const std::string& addr, Outcome* failure) {
  ConnectOptions o;
  if ((*failure = ConnectFlags(flags, &o))) return nullptr;
  absl::StatusOr<std::unique_ptr<RelayClient>> client = RelayClient::Connect(addr, o);
  if (client.ok()) return *std::move(client);
  // RelayClient::Connect names the option; the user gave a flag.
  static constexpr std::pair<absl::string_view, absl::string_view> kFlagOf[] = {
      {"tls_ca_file:", "flag --tls-ca:"},
      {"tls_cert_file:", "flag --tls-cert:"},
      {"tls_key_file:", "flag --tls-key:"},
      {"token:", "flag --token-file:"}};
  std::string msg(client.status().message());
  for (const auto& [option, flag] : kFlagOf) {
    if (absl::StartsWith(msg, option)) {
      msg = absl::StrCat(flag, msg.substr(option.size()));
      break;
    }
  }
  *failure = Failure{kRuntimeError, msg};
  return nullptr;
}

ProgressLine::ProgressLine(std::string label) : label_(std::move(label)), tty_(isatty(STDERR_FILENO)) {}

ProgressCallback ProgressLine::Callback() {
  if (!tty_) return nullptr;
  return [this](const TransferProgress& p) {
    const auto now = std::chrono::steady_clock::now();
    if (p.bytes_done < p.bytes_total && now - last_ < std::chrono::milliseconds(100)) return;
    last_ = now;
    const double pct = p.bytes_total ? 100.0 * p.bytes_done / p.bytes_total : 100.0;
    std::fprintf(stderr, "\r%s %s %6.1f%% %.1f/%.1f MB ", label_.c_str(),
                 p.phase == TransferProgress::Phase::kUpload ? "upload" : "download", pct, p.bytes_done / 1e6,
                 p.bytes_total / 1e6);
    std::fflush(stderr);
    shown_ = true;
  };
}

void ProgressLine::Clear() {
  if (!shown_) return;
  std::fprintf(stderr, "\r\033[K");
  std::fflush(stderr);
  shown_ = false;
}

}  // namespace kvrelay::ctl
