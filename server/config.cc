#include "server/config.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "core/heap_retain.h"
#include "core/ids.h"
#include "core/pipeline.h"
#include "core/status_macros.h"
#include "core/thread_pool.h"
#include "nlohmann/json.hpp"
#include "server/auth.h"
#include "server/routing.h"
#include "proto/address.h"

namespace kvrelay {
namespace {

absl::Status Bad(absl::string_view flag, absl::string_view value, absl::string_view expected) {
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, "=", value, ": expected ", expected));
}

absl::Status ParseBytes(absl::string_view flag, const std::string& v, uint64_t* out) {
  std::string s = absl::AsciiStrToLower(absl::StripAsciiWhitespace(v));
  uint64_t mult = 1;
  for (auto [suffix, m] : {std::pair<const char*, uint64_t>{"tib", 1ull << 40},
                           {"gib", 1ull << 30}, {"mib", 1ull << 20}, {"kib", 1ull << 10},
                           {"b", 1}}) {
    if (absl::EndsWith(s, suffix)) {
      mult = m;
      s.resize(s.size() - strlen(suffix));
      break;
    }
  }
  uint64_t n;
  if (!absl::SimpleAtoi(s, &n) || n == 0 || n > (UINT64_MAX / mult)) {
    return Bad(flag, v, "a positive byte count, e.g. 4294967296 or 4GiB");
  }
  *out = n * mult;
  return absl::OkStatus();
}

// The shortest positive timeout: below it a publish or a session could not
// outlive the watchdog's own scheduling.
constexpr double kMinTimeoutSeconds = 0.01;
// The least journal growth between compactions.
constexpr uint64_t kMinSpoolCompactBytes = 1ull << 20;
// The longest (~31 years): durations are kept in int64 nanoseconds, which
// end at ~292 years.
constexpr double kMaxTimeoutSeconds = 1e9;

absl::Status ParseSeconds(absl::string_view flag, const std::string& v, bool allow_zero, double* out) {
  double d;
  if (!absl::SimpleAtod(v, &d) || !std::isfinite(d) || d < 0 || (!allow_zero && d < kMinTimeoutSeconds) ||
      d > kMaxTimeoutSeconds) {
    return Bad(flag, v, allow_zero ? "seconds in [0, 1e9]" : "seconds in [0.01, 1e9]");
  }
  *out = d;
  return absl::OkStatus();
}

absl::Status ParseBool(absl::string_view flag, const std::string& v, bool* out) {
  const std::string s = absl::AsciiStrToLower(v);
  if (s == "1" || s == "true" || s == "yes" || s == "on" || s.empty()) {
    *out = true;
  } else if (s == "0" || s == "false" || s == "no" || s == "off") {
    *out = false;
  } else {
    return Bad(flag, v, "true or false");
  }
  return absl::OkStatus();
}

absl::Status ParseAddr(absl::string_view flag, const std::string& v, bool allow_off, std::string* out) {
  if (allow_off && (v.empty() || v == "off" || v == "none")) {
    out->clear();
    return absl::OkStatus();
  }
  std::string host;
  int port;
  // One address: the metrics server would take a comma as a list.
  if (!SplitHostPort(v, &host, &port).ok() || host.empty() ||
      host.find_first_of(", \t") != std::string::npos) {
    return Bad(flag, v, "HOST:PORT with PORT in 0..65535 (0 picks a free port)");
  }
  *out = v;
  return absl::OkStatus();
}

// A policy spec that Pipeline::Create takes; errors read "--FLAG=VALUE: ...".
absl::Status CheckPolicy(absl::string_view flag, absl::string_view value, const std::string& spec) {
  if (auto p = Pipeline::Create(spec); !p.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", value, ": ", p.status().message()));
  }
  return absl::OkStatus();
}

absl::Status ParseRolePolicy(absl::string_view flag, const std::string& v,
                             std::map<std::string, std::string>* out) {
  const size_t eq = v.find('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == v.size()) {
    return Bad(flag, v, "ROLE=SPEC, e.g. planner=h2o-head:k=64+obf");
  }
  std::string spec = v.substr(eq + 1);
  KVRELAY_RETURN_IF_ERROR(CheckPolicy(flag, v, spec));
  (*out)[v.substr(0, eq)] = std::move(spec);
  return absl::OkStatus();
}

// sockaddr_un's sun_path holds 108 bytes, the terminating NUL included.
constexpr size_t kMaxUnixPathBytes = 107;

// One --listen address: HOST:PORT (PORT 0..65535) or unix:PATH.
absl::Status CheckListenAddr(absl::string_view flag, const std::string& v) {
  if (absl::StartsWith(v, kUnixPrefix)) {
    const std::string path = v.substr(strlen(kUnixPrefix));
    // The ready line lists the addresses separated by ',' after a space.
    if (path.empty() || path.size() > kMaxUnixPathBytes || path.find_first_of(", \t\r\n") != std::string::npos) {
      return Bad(flag, v, "unix:PATH with a PATH of 1..107 bytes without ',' or whitespace");
    }
    return absl::OkStatus();
  }
  std::string host;
  int port;
  if (!SplitHostPort(v, &host, &port).ok() || host.empty() ||
      host.find_first_of(", \t") != std::string::npos) {
    return Bad(flag, v,
               "HOST:PORT with PORT in 0..65535 (0 picks a free port) or unix:PATH; one address each, "
               "repeat --listen for more");
  }
  return absl::OkStatus();
}

// The list flags: each source's list replaces the lower sources' as a whole.
std::vector<std::string>* ListField(const std::string& name, ServerConfig* c) {
  if (name == "listen") return &c->listen;
  if (name == "local-listen") return &c->local_listen;
  if (name == "peer-identity") return &c->peer_identities;
  return nullptr;
}

// Replaces list flag `name` of `c` with `values`, each checked; `origin`
// prefixes errors ("" for flags, "KVRELAY_LISTEN: ", "--config=FILE: ").
absl::Status SetList(const std::string& name, const std::vector<std::string>& values, absl::string_view origin,
                     ServerConfig* c) {
  if (values.empty() && name == "listen") {
    return absl::InvalidArgumentError(absl::StrCat(origin, "--listen: expected at least one address"));
  }
  std::set<std::string> seen;
  for (const std::string& v : values) {
    absl::Status st;
    if (name == "peer-identity") {
      st = CheckIdentityPattern(v);
      if (!st.ok()) st = absl::InvalidArgumentError(absl::StrCat("--peer-identity=", st.message()));
    } else {
      st = CheckListenAddr(name, v);
    }
    if (!st.ok()) return absl::InvalidArgumentError(absl::StrCat(origin, st.message()));
    if (!seen.insert(v).second) {
      return absl::InvalidArgumentError(absl::StrCat(origin, "--", name, "=", v, ": given twice"));
    }
  }
  *ListField(name, c) = values;
  return absl::OkStatus();
}

std::vector<std::string> SplitList(absl::string_view v, char sep) {
  std::vector<std::string> out;
  for (absl::string_view part : absl::StrSplit(v, sep, absl::SkipWhitespace())) {
    out.emplace_back(absl::StripAsciiWhitespace(part));
  }
  return out;
}

// A target a relay dials; errors read "--FLAG=VALUE: address '...': ...".
absl::Status CheckTarget(absl::string_view flag, absl::string_view value, absl::string_view target) {
  if (absl::Status st = CheckGrpcTarget(target); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", value, ": ", st.message()));
  }
  return absl::OkStatus();
}

absl::Status ParseRoute(absl::string_view flag, const std::string& v, std::map<std::string, std::string>* out) {
  const size_t eq = v.find('=');
  if (eq == std::string::npos || eq + 1 == v.size()) {
    return Bad(flag, v, "AGENT=TARGET, e.g. critic=10.0.0.7:50051 or critic=dns:///critic.agents:50051");
  }
  std::string agent = v.substr(0, eq), target = v.substr(eq + 1);
  if (!IsId(agent)) return Bad(flag, v, absl::StrCat("AGENT=TARGET with AGENT of ", kIdPattern));
  KVRELAY_RETURN_IF_ERROR(CheckTarget(flag, v, target));
  (*out)[std::move(agent)] = std::move(target);
  return absl::OkStatus();
}

absl::Status ParseRouteTemplate(absl::string_view flag, const std::string& v, std::string* out) {
  if (absl::Status st = CheckRouteTemplate(v); !st.ok()) return Bad(flag, v, st.message());
  *out = v;
  return absl::OkStatus();
}

// Applies one setting by flag name (without dashes).
absl::Status Apply(const std::string& name, const std::string& value, ServerConfig* c) {
  if (name == "metrics-listen") return ParseAddr(name, value, true, &c->metrics_listen);
  if (name == "worker-threads") {
    int n;
    if (!absl::SimpleAtoi(value, &n) || n < 1 || n > 4096) return Bad(name, value, "an integer in [1, 4096]");
    c->worker_threads = n;
    return absl::OkStatus();
  }
  if (name == "max-inflight-bytes") return ParseBytes(name, value, &c->max_inflight_bytes);
  if (name == "max-mailbox-bytes") return ParseBytes(name, value, &c->max_mailbox_bytes);
  if (name == "max-session-messages") {
    uint32_t n;
    if (!absl::SimpleAtoi(value, &n) || n < 1) return Bad(name, value, "a positive integer");
    c->max_session_messages = n;
    return absl::OkStatus();
  }
  if (name == "max-session-bytes") return ParseBytes(name, value, &c->max_session_bytes);
  if (name == "max-store-bytes") return ParseBytes(name, value, &c->max_store_bytes);
  if (name == "max-upload-work") {
    double w;
    if (!absl::SimpleAtod(value, &w) || !std::isfinite(w) || w < 1) {
      return Bad(name, value, "a positive count of multiply-adds, e.g. 4e12");
    }
    c->max_upload_work = w;
    return absl::OkStatus();
  }
  if (name == "upload-idle-timeout-seconds") {
    return ParseSeconds(name, value, false, &c->upload_idle_timeout_seconds);
  }
  if (name == "session-ttl-seconds") return ParseSeconds(name, value, false, &c->session_ttl_seconds);
  if (name == "shutdown-grace-seconds") return ParseSeconds(name, value, true, &c->shutdown_grace_seconds);
  if (name == "default-policy") {
    KVRELAY_RETURN_IF_ERROR(CheckPolicy(name, value, value));
    c->default_policy = value;
    return absl::OkStatus();
  }
  if (name == "role-policy") return ParseRolePolicy(name, value, &c->role_policies);
  if (name == "log-json") return ParseBool(name, value, &c->log_json);
  if (name == "route") return ParseRoute(name, value, &c->routes);
  if (name == "route-file") {
    if (value.empty()) return Bad(name, value, "a file name");
    c->route_file = value;
    return absl::OkStatus();
  }
  if (name == "route-template") return ParseRouteTemplate(name, value, &c->route_template);
  if (name == "advertise") {
    KVRELAY_RETURN_IF_ERROR(CheckTarget(name, value, value));
    c->advertise = value;
    return absl::OkStatus();
  }
  if (name == "forward-timeout-seconds") return ParseSeconds(name, value, false, &c->forward_timeout_seconds);
  if (name == "forward-stall-seconds") return ParseSeconds(name, value, false, &c->forward_stall_seconds);
  if (name == "wire-codec") {
    if (value != "rans" && value != "none") return Bad(name, value, "rans or none");
    c->wire_codec_rans = value == "rans";
    return absl::OkStatus();
  }
  if (name == "max-outbox-bytes") return ParseBytes(name, value, &c->max_outbox_bytes);
  if (name == "max-outbox-bytes-per-destination") {
    return ParseBytes(name, value, &c->max_outbox_bytes_per_destination);
  }
  if (name == "tls-cert" || name == "tls-key" || name == "tls-client-ca" || name == "tls-peer-ca" ||
      name == "tokens-file") {
    if (value.empty()) return Bad(name, value, "a file name");
    std::string* field = name == "tls-cert"        ? &c->tls_cert
                         : name == "tls-key"       ? &c->tls_key
                         : name == "tls-client-ca" ? &c->tls_client_ca
                         : name == "tls-peer-ca"   ? &c->tls_peer_ca
                                                   : &c->tokens_file;
    *field = value;
    return absl::OkStatus();
  }
  if (name == "local-auth") {
    if (value != "pod" && value != "token") return Bad(name, value, "pod or token");
    c->local_auth = value;
    return absl::OkStatus();
  }
  if (name == "insecure") return ParseBool(name, value, &c->insecure);
  if (name == "spool-dir") {
    if (value.empty()) return Bad(name, value, "a directory");
    c->spool_dir = value;
    return absl::OkStatus();
  }
  if (name == "fsync") {
    if (value != "always" && value != "never") return Bad(name, value, "always or never");
    c->fsync = value;
    return absl::OkStatus();
  }
  if (name == "max-spool-bytes") return ParseBytes(name, value, &c->max_spool_bytes);
  if (name == "spool-compact-bytes") {
    uint64_t n;
    KVRELAY_RETURN_IF_ERROR(ParseBytes(name, value, &n));
    // Below a MiB the journal would be rewritten whole every few records.
    if (n < kMinSpoolCompactBytes) return Bad(name, value, "a byte count of at least 1MiB");
    c->spool_compact_bytes = n;
    return absl::OkStatus();
  }
  if (name == "spool-salvage") return ParseBool(name, value, &c->spool_salvage);
  if (name == "health-listen") return ParseAddr(name, value, true, &c->health_listen);
  if (name == "heap-retain-bytes") {
    if (absl::StripAsciiWhitespace(value) == "0") {
      c->heap_retain_bytes = 0;
      return absl::OkStatus();
    }
    KVRELAY_RETURN_IF_ERROR(ParseBytes(name, value, &c->heap_retain_bytes));
    // glibc's thresholds are ints: more retains as much as 2GiB - 1.
    c->heap_retain_bytes = std::min(c->heap_retain_bytes, kMaxHeapRetainBytes);
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat("--", name, ": unknown flag (see --help)"));
}

bool IsBoolFlag(const std::string& name) {
  return name == "log-json" || name == "insecure" || name == "spool-salvage";
}

const char* const kEnv[][2] = {
    {"metrics-listen", "KVRELAY_METRICS_LISTEN"},
    {"worker-threads", "KVRELAY_WORKER_THREADS"},
    {"max-inflight-bytes", "KVRELAY_MAX_INFLIGHT_BYTES"},
    {"max-mailbox-bytes", "KVRELAY_MAX_MAILBOX_BYTES"},
    {"max-session-messages", "KVRELAY_MAX_SESSION_MESSAGES"},
    {"max-session-bytes", "KVRELAY_MAX_SESSION_BYTES"},
    {"max-store-bytes", "KVRELAY_MAX_STORE_BYTES"},
    {"max-upload-work", "KVRELAY_MAX_UPLOAD_WORK"},
    {"heap-retain-bytes", "KVRELAY_HEAP_RETAIN_BYTES"},
    {"upload-idle-timeout-seconds", "KVRELAY_UPLOAD_IDLE_TIMEOUT_SECONDS"},
    {"session-ttl-seconds", "KVRELAY_SESSION_TTL_SECONDS"},
    {"default-policy", "KVRELAY_DEFAULT_POLICY"},
    {"log-json", "KVRELAY_LOG_JSON"},
    {"shutdown-grace-seconds", "KVRELAY_SHUTDOWN_GRACE_SECONDS"},
    {"route-file", "KVRELAY_ROUTE_FILE"},
    {"route-template", "KVRELAY_ROUTE_TEMPLATE"},
    {"advertise", "KVRELAY_ADVERTISE"},
    {"forward-timeout-seconds", "KVRELAY_FORWARD_TIMEOUT_SECONDS"},
    {"forward-stall-seconds", "KVRELAY_FORWARD_STALL_SECONDS"},
    {"wire-codec", "KVRELAY_WIRE_CODEC"},
    {"max-outbox-bytes", "KVRELAY_MAX_OUTBOX_BYTES"},
    {"max-outbox-bytes-per-destination", "KVRELAY_MAX_OUTBOX_BYTES_PER_DESTINATION"},
    {"tls-cert", "KVRELAY_TLS_CERT"},
    {"tls-key", "KVRELAY_TLS_KEY"},
    {"tls-client-ca", "KVRELAY_TLS_CLIENT_CA"},
    {"tls-peer-ca", "KVRELAY_TLS_PEER_CA"},
    {"tokens-file", "KVRELAY_TOKENS_FILE"},
    {"local-auth", "KVRELAY_LOCAL_AUTH"},
    {"insecure", "KVRELAY_INSECURE"},
    {"health-listen", "KVRELAY_HEALTH_LISTEN"},
    {"spool-dir", "KVRELAY_SPOOL_DIR"},
    {"fsync", "KVRELAY_FSYNC"},
    {"max-spool-bytes", "KVRELAY_MAX_SPOOL_BYTES"},
    {"spool-compact-bytes", "KVRELAY_SPOOL_COMPACT_BYTES"},
    {"spool-salvage", "KVRELAY_SPOOL_SALVAGE"},
};

absl::Status ApplyConfigFile(const std::string& path, ServerConfig* c) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("--config=", path, ": cannot open the file"));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);  // one JSON value, nothing after it
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("--config=", path, ": invalid JSON: ", e.what()));
  }
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat("--config=", path, ": expected a JSON object"));
  for (auto it = j.begin(); it != j.end(); ++it) {
    std::string key = it.key();
    for (char& ch : key) if (ch == '_') ch = '-';
    const nlohmann::json& v = it.value();
    if (key == "role-policy" || key == "role-policies") {
      if (!v.is_object()) {
        return absl::InvalidArgumentError(absl::StrCat("--config=", path, ": ", it.key(),
                                                       ": expected an object {ROLE: SPEC}"));
      }
      for (auto r = v.begin(); r != v.end(); ++r) {
        if (!r.value().is_string() || r.key().empty() || r.key().find('=') != std::string::npos) {
          return absl::InvalidArgumentError(absl::StrCat("--config=", path, ": ", it.key(), ".", r.key(),
                                                         ": expected a non-empty ROLE without '=' and a SPEC string"));
        }
        absl::Status st = ParseRolePolicy("role-policy", absl::StrCat(r.key(), "=", r.value().get<std::string>()),
                                          &c->role_policies);
        if (!st.ok()) return absl::InvalidArgumentError(absl::StrCat("--config=", path, ": ", st.message()));
      }
      continue;
    }
    const std::string origin = absl::StrCat("--config=", path, ": ");
    if (key == "listen" || key == "local-listen" || key == "peer-identity") {
      std::vector<std::string> addrs;
      if (v.is_string()) {
        addrs = SplitList(v.get<std::string>(), ',');
      } else if (v.is_array() && std::all_of(v.begin(), v.end(), [](const auto& e) { return e.is_string(); })) {
        for (const auto& e : v) addrs.push_back(e.get<std::string>());
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat(origin, it.key(), ": expected a string or a list of strings"));
      }
      KVRELAY_RETURN_IF_ERROR(SetList(key, addrs, origin, c));
      continue;
    }
    if (key == "route" || key == "routes") {
      std::vector<std::string> routes;
      if (v.is_object()) {
        for (auto r = v.begin(); r != v.end(); ++r) {
          if (!r.value().is_string()) {
            return absl::InvalidArgumentError(
                absl::StrCat(origin, it.key(), ".", r.key(), ": expected a TARGET string"));
          }
          routes.push_back(absl::StrCat(r.key(), "=", r.value().get<std::string>()));
        }
      } else if (v.is_array() && std::all_of(v.begin(), v.end(), [](const auto& e) { return e.is_string(); })) {
        for (const auto& e : v) routes.push_back(e.get<std::string>());
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            origin, it.key(), ": expected an object {AGENT: TARGET} or a list of \"AGENT=TARGET\" strings"));
      }
      for (const std::string& r : routes) {
        absl::Status st = ParseRoute("route", r, &c->routes);
        if (!st.ok()) return absl::InvalidArgumentError(absl::StrCat(origin, st.message()));
      }
      continue;
    }
    std::string s;
    if (v.is_string()) s = v.get<std::string>();
    else if (v.is_boolean()) s = v.get<bool>() ? "true" : "false";
    else if (v.is_number_unsigned()) s = std::to_string(v.get<uint64_t>());
    else if (v.is_number_integer()) s = std::to_string(v.get<int64_t>());
    else if (v.is_number()) s = absl::StrFormat("%.17g", v.get<double>());  // 1e6 -> "1000000"
    else return absl::InvalidArgumentError(absl::StrCat("--config=", path, ": ", it.key(), ": expected a string or number"));
    absl::Status st = Apply(key, s, c);
    if (!st.ok()) return absl::InvalidArgumentError(absl::StrCat("--config=", path, ": ", st.message()));
  }
  return absl::OkStatus();
}

// Whether HOST (as SplitHostPort gives it) is a loopback address.
bool IsLoopbackHost(absl::string_view host) {
  if (absl::StartsWith(host, "[") && absl::EndsWith(host, "]")) host = host.substr(1, host.size() - 2);
  if (host == "localhost" || host == "::1") return true;
  if (!absl::StartsWith(host, "127.")) return false;
  int octets = 0;
  for (absl::string_view o : absl::StrSplit(host, '.')) {
    int v;
    if (!absl::SimpleAtoi(o, &v) || v < 0 || v > 255) return false;
    ++octets;
  }
  return octets == 4;
}

// The rules between the security flags, checked once every source is in.
absl::Status CheckSecurity(const ServerConfig& c) {
  if (c.tls_cert.empty() != c.tls_key.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(c.tls_cert.empty() ? "--tls-key" : "--tls-cert",
                                                   ": expected together with ",
                                                   c.tls_cert.empty() ? "--tls-cert" : "--tls-key"));
  }
  const bool tls = !c.tls_cert.empty();
  if (!tls) {
    for (const auto& [flag, set] : {std::pair<const char*, bool>{"--tls-client-ca", !c.tls_client_ca.empty()},
                                    {"--tls-peer-ca", !c.tls_peer_ca.empty()},
                                    {"--peer-identity", !c.peer_identities.empty()}}) {
      if (set) return absl::InvalidArgumentError(absl::StrCat(flag, ": needs --tls-cert FILE and --tls-key FILE"));
    }
  }
  if (!c.peer_identities.empty() && c.tls_client_ca.empty()) {
    return absl::InvalidArgumentError(
        "--peer-identity: needs --tls-client-ca FILE (relays prove who they are with a client certificate, which "
        "is requested only with a client CA)");
  }
  for (const std::string& a : c.local_listen) {
    if (absl::StartsWith(a, kUnixPrefix)) continue;
    std::string host;
    int port;
    if (!SplitHostPort(a, &host, &port).ok() || !IsLoopbackHost(host)) {
      return Bad("local-listen", a,
                 "a loopback HOST:PORT (127.0.0.1, ::1 or localhost) or unix:PATH: local listeners are plaintext "
                 "for the pod's own agents; use --listen for other addresses");
    }
  }
  for (const std::string& a : c.local_listen) {
    if (std::find(c.listen.begin(), c.listen.end(), a) != c.listen.end()) {
      return absl::InvalidArgumentError(absl::StrCat("--local-listen=", a, ": also given as --listen"));
    }
  }
  if (c.local_auth == "token" && c.tokens_file.empty()) {
    return absl::InvalidArgumentError("--local-auth=token: needs --tokens-file FILE");
  }
  const bool routes = !c.routes.empty() || !c.route_file.empty() || !c.route_template.empty();
  if (tls && routes && c.tls_peer_ca.empty() && c.tls_client_ca.empty()) {
    return absl::InvalidArgumentError(
        "--tls-cert with routes: forwards to other relays use mTLS, so the relay must verify them; add "
        "--tls-peer-ca FILE (or --tls-client-ca FILE, its default)");
  }
  if (!tls && !c.insecure) {
    for (const std::string& a : c.listen) {
      if (absl::StartsWith(a, kUnixPrefix)) continue;
      std::string host;
      int port;
      if (SplitHostPort(a, &host, &port).ok() && !IsLoopbackHost(host)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--listen=", a,
            ": plaintext on a non-loopback address; add --tls-cert FILE --tls-key FILE (and --tls-client-ca FILE "
            "for mTLS), or --insecure to serve plaintext anyway, or --local-listen for the pod's own agents"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

bool ServesPlaintextOffLoopback(const ServerConfig& c) {
  if (!c.tls_cert.empty()) return false;
  for (const std::string& a : c.listen) {
    std::string host;
    int port;
    if (!absl::StartsWith(a, kUnixPrefix) && SplitHostPort(a, &host, &port).ok() && !IsLoopbackHost(host)) {
      return true;
    }
  }
  return false;
}

const std::string& ServerConfig::PolicyForRole(const std::string& role) const {
  auto it = role_policies.find(role);
  return it == role_policies.end() ? default_policy : it->second;
}

absl::Status SplitHostPort(const std::string& addr, std::string* host, int* port) {
  size_t colon;
  if (!addr.empty() && addr[0] == '[') {
    const size_t close = addr.find(']');
    if (close == std::string::npos || close + 1 >= addr.size() || addr[close + 1] != ':') {
      return absl::InvalidArgumentError(absl::StrCat(addr, ": expected [V6]:PORT"));
    }
    colon = close + 1;
  } else {
    colon = addr.rfind(':');
    if (colon == std::string::npos) return absl::InvalidArgumentError(absl::StrCat(addr, ": expected HOST:PORT"));
  }
  *host = addr.substr(0, colon);
  int p;
  if (!absl::SimpleAtoi(addr.substr(colon + 1), &p) || p < 0 || p > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(addr, ": port expected in 0..65535"));
  }
  *port = p;
  return absl::OkStatus();
}

std::string ServerUsage() {
  return R"(usage: kvrelay-server [flags]
  --listen ADDR                  gRPC address, repeatable: HOST:PORT (port 0 = free port; a port in use is an
                                 error, not shared) or unix:PATH, a Unix domain socket (PATH of at most 107 bytes,
                                 no ',' or whitespace). The socket is made mode 0666, so the directory it is in
                                 decides who may connect; a stale socket left at PATH (one nobody accepts on) is
                                 removed first, a regular file or a socket in use is refused; it is removed on
                                 shutdown. (KVRELAY_LISTEN: ADDR,ADDR; default 127.0.0.1:50051: listen on the pod
                                 IP, e.g. 0.0.0.0:50051, where other relays or the kubelet must reach it)
  --metrics-listen HOST:PORT     Prometheus /metrics address, "off" for none (KVRELAY_METRICS_LISTEN; 0.0.0.0:9464;
                                 IPv4 only where the metrics HTTP server, civetweb, is built without IPv6)
  --worker-threads N             compression workers (KVRELAY_WORKER_THREADS; hardware threads)
  --max-inflight-bytes N         bytes of uploads in progress, all streams (KVRELAY_MAX_INFLIGHT_BYTES; 4GiB)
  --max-mailbox-bytes N          unacked bytes per (session, agent) (KVRELAY_MAX_MAILBOX_BYTES; 2GiB)
  --max-session-messages N       messages per session (KVRELAY_MAX_SESSION_MESSAGES; 1024)
  --max-session-bytes N          bytes of every message a session retains, acked ones included (they stay
                                 as potential parents until the session closes or expires)
                                 (KVRELAY_MAX_SESSION_BYTES; 8GiB)
  --max-store-bytes N            bytes of every retained message, all sessions (KVRELAY_MAX_STORE_BYTES; 16GiB)
  --max-upload-work N            multiply-adds one Publish or Compress may ask for, estimated from its header
                                 (scoring from gen.q, the fidelity figure, obf); past it RESOURCE_EXHAUSTED before
                                 any chunk is read (KVRELAY_MAX_UPLOAD_WORK; 4.5e12, four Qwen3-14B turns of
                                 4096 prompt tokens and 256 steps with gen.q)
  --upload-idle-timeout-seconds S  a Publish or Compress upload that sends nothing for S seconds fails with
                                 DEADLINE_EXCEEDED and frees its memory; a Fetch or Compress reply the client
                                 does not read for S seconds is cancelled (KVRELAY_UPLOAD_IDLE_TIMEOUT_SECONDS; 60;
                                 >= 0.01)
  --session-ttl-seconds S        idle time before a session expires; a Publish in progress or a Fetch waiting
                                 on it is activity (KVRELAY_SESSION_TTL_SECONDS; 3600; >= 0.01)
  --default-policy SPEC          policy when neither the publish nor its role names one
                                 (KVRELAY_DEFAULT_POLICY; h2o-head:k=32+obf:p=8,mode=fast)
  --role-policy ROLE=SPEC        per-role default policy, repeatable (KVRELAY_ROLE_POLICY: ROLE=SPEC;ROLE=SPEC)
  --route AGENT=TARGET           the relay that holds AGENT's mailbox, repeatable (KVRELAY_ROUTE:
                                 AGENT=TARGET;AGENT=TARGET). TARGET is HOST:PORT (port 1..65535) or a gRPC target
                                 with a resolver scheme: dns:///HOST:PORT, unix:PATH, ipv4:, ipv6:
  --route-file FILE              JSON object {AGENT: TARGET}, re-read when it changes (KVRELAY_ROUTE_FILE)
  --route-template TEMPLATE      TARGET for an agent no route names, with {agent} once, e.g.
                                 dns:///{agent}.kvrelay.agents.svc.cluster.local:50051 (KVRELAY_ROUTE_TEMPLATE).
                                 --route beats --route-file beats --route-template; no route: the agent is local
  --advertise TARGET             this relay as its peers reach it; a route to it is local (KVRELAY_ADVERTISE)
  --forward-timeout-seconds S    a forward is retried for S seconds, then dead-lettered
                                 (KVRELAY_FORWARD_TIMEOUT_SECONDS; 300; >= 0.01)
  --forward-stall-seconds S      a forward without progress for S seconds is cancelled and retried
                                 (KVRELAY_FORWARD_STALL_SECONDS; 10; >= 0.01)
  --wire-codec rans|none         how forwards sent from here and spool message files carry tensors: rans
                                 entropy-codes each layer losslessly (a peer that does not speak it gets none;
                                 earlier relays do not read coded spool files); none sends them as Fetch does
                                 and writes plain spool files (KVRELAY_WIRE_CODEC; rans)
  --max-outbox-bytes N           bytes of messages waiting to be forwarded, all destinations
                                 (KVRELAY_MAX_OUTBOX_BYTES; 4GiB)
  --max-outbox-bytes-per-destination N  the same per destination relay, at most --max-outbox-bytes
                                 (KVRELAY_MAX_OUTBOX_BYTES_PER_DESTINATION; 1GiB)
  --local-listen ADDR            plaintext address for the pod's own agents, repeatable: a loopback HOST:PORT
                                 (127.0.0.1, ::1, localhost) or unix:PATH; anything else is refused. A unix:PATH
                                 is local under --listen too (KVRELAY_LOCAL_LISTEN: ADDR,ADDR; none)
  --health-listen HOST:PORT      serves grpc.health.v1 alone, plaintext, for kubelet probes (KVRELAY_HEALTH_LISTEN;
                                 none)
  --tls-cert FILE --tls-key FILE this relay's certificate and key (PEM): every TCP --listen address serves TLS,
                                 loopback too. Re-read when the files change (atomic renames included): new
                                 connections get the new certificate, calls in progress go on
                                 (KVRELAY_TLS_CERT, KVRELAY_TLS_KEY)
  --tls-client-ca FILE           CA bundle (PEM): client certificates are requested and every one presented is
                                 verified; agents may still come with a token and none (KVRELAY_TLS_CLIENT_CA)
  --tls-peer-ca FILE             CA bundle that verifies the relays this one forwards to (over mTLS, presenting
                                 --tls-cert); default --tls-client-ca (KVRELAY_TLS_PEER_CA)
  --peer-identity PATTERN        a relay allowed to forward here: its certificate SAN, exact or "*." and a DNS
                                 suffix, repeatable (KVRELAY_PEER_IDENTITY: P,P; none)
  --tokens-file FILE             agents' tokens, one "AGENT sha256:HEX" per line ('#' comments; HEX = SHA-256 of
                                 the token; `kvrelayctl token new AGENT` makes one), re-read when it changes. With
                                 it, every call on --listen needs "authorization: Bearer TOKEN" (KVRELAY_TOKENS_FILE)
  --local-auth pod|token         local listeners: "pod" (a local caller may act as any agent) or "token" (tokens
                                 as on --listen) (KVRELAY_LOCAL_AUTH; pod)
  --insecure                     allow plaintext on a non-loopback --listen (otherwise refused at start-up); logged,
                                 and exported as kvrelay_insecure 1 (KVRELAY_INSECURE)
  --spool-dir DIR                keep messages, acks, closes and the outbox on disk in DIR (created, mode 0700),
                                 so that a restart (kill -9 included) loses nothing accepted; without it
                                 everything is in memory only (KVRELAY_SPOOL_DIR; none)
  --fsync always|never           with --spool-dir: "always" syncs before answering; "never" is for benchmarks
                                 only and loses data on a power loss or kernel crash (KVRELAY_FSYNC; always)
  --max-spool-bytes N            message files and journal in --spool-dir, at most; past it RESOURCE_EXHAUSTED
                                 (KVRELAY_MAX_SPOOL_BYTES; 0: up to the disk's free space)
  --spool-compact-bytes N        rewrite the journal whole (compaction) each time it has grown by N, at least
                                 1MiB; smaller bounds the journal tighter, at more rewrites
                                 (KVRELAY_SPOOL_COMPACT_BYTES; 64MiB)
  --spool-salvage                start on a journal damaged in the middle, with a damaged header, or missing
                                 beside message files (refused otherwise): keep its intact records, move every
                                 message file they do not name to DIR/quarantine/ (KVRELAY_SPOOL_SALVAGE)
  --log-json                     JSON log lines, the ready line too (its "msg" is the same text)
                                 (KVRELAY_LOG_JSON)
  --shutdown-grace-seconds S     drain time on SIGTERM/SIGINT (KVRELAY_SHUTDOWN_GRACE_SECONDS; 10)
  --heap-retain-bytes N          freed heap kept for reuse instead of returned to the kernel, so the next
                                 message does not fault its pages in again; per malloc arena (one per
                                 two workers, at least 1): count that many x N against the memory limit
                                 (KVRELAY_HEAP_RETAIN_BYTES; 128MiB; more than 2GiB - 1 acts as 2GiB - 1;
                                 0: glibc's defaults)
  --config FILE                  JSON object with the same keys, '-' or '_' (KVRELAY_CONFIG); "role_policy"
                                 is an object {ROLE: SPEC}, "route" an object {AGENT: TARGET} or a list of
                                 "AGENT=TARGET", "listen" a string or a list of addresses
A flag beats its environment variable, which beats the config file; role policies merge per role and
routes per agent, while the --listen flags (else KVRELAY_LISTEN, else the file's) replace the list. An
empty environment variable counts as unset (KVRELAY_METRICS_LISTEN: off). Seconds are at most 1e9.
Once serving, prints one line listing every gRPC address (--listen, then --local-listen; bound ports,
unix:PATH for sockets), the metrics address, and the health address when there is one:
  kvrelay-server ready grpc=127.0.0.1:50051,unix:/run/kvrelay/relay.sock metrics=0.0.0.0:9464 health=0.0.0.0:8081
(with --log-json, a JSON record whose "msg" is that text)

       kvrelay-server health [--addr HOST:PORT] [--timeout SECONDS]
  asks a running relay's grpc.health.v1 (default 127.0.0.1:50051, 2 s); exit 0 when SERVING
)";
}

absl::StatusOr<ServerConfig> ParseServerConfig(int argc, const char* const* argv, const EnvLookup& env) {
  // Collect flags first: --config must be applied before env and flags.
  std::vector<std::pair<std::string, std::string>> flags;
  std::map<std::string, std::vector<std::string>> list_flags;  // replace the other sources' lists as a whole
  std::string config_path;
  if (const char* e = env("KVRELAY_CONFIG")) config_path = e;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") return absl::CancelledError(ServerUsage());
    if (arg.rfind("--", 0) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(arg, ": unexpected argument, expected --flag (see --help)"));
    }
    std::string name = arg.substr(2), value;
    const size_t eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name.resize(eq);
    } else if (IsBoolFlag(name)) {
      value = "true";
    } else {
      if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat("--", name, ": missing value"));
      value = argv[++i];
    }
    if (name == "config") {
      config_path = value;
      continue;
    }
    if (name == "listen" || name == "local-listen" || name == "peer-identity") {
      list_flags[name].push_back(value);
      continue;
    }
    flags.emplace_back(name, value);
  }
  ServerConfig c;
  if (!config_path.empty()) KVRELAY_RETURN_IF_ERROR(ApplyConfigFile(config_path, &c));
  for (const auto& [name, var] : kEnv) {
    if (const char* e = env(var)) {
      // An empty variable is unset, as in most container runtimes'
      // templating; except the metrics address, where empty has always meant
      // off (as --metrics-listen= does).
      if (*e == '\0' && std::string(name) != "metrics-listen") continue;
      absl::Status s = Apply(name, e, &c);
      if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat(var, ": ", s.message()));
    }
  }
  if (const char* e = env("KVRELAY_ROLE_POLICY")) {
    for (absl::string_view part : absl::StrSplit(e, ';', absl::SkipWhitespace())) {
      absl::Status s = ParseRolePolicy("role-policy", std::string(part), &c.role_policies);
      if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("KVRELAY_ROLE_POLICY: ", s.message()));
    }
  }
  for (const auto& [name, var] : {std::pair<std::string, std::string>{"listen", "KVRELAY_LISTEN"},
                                   {"local-listen", "KVRELAY_LOCAL_LISTEN"},
                                   {"peer-identity", "KVRELAY_PEER_IDENTITY"}}) {
    if (const char* e = env(var.c_str()); e != nullptr && *e != '\0') {
      KVRELAY_RETURN_IF_ERROR(SetList(name, SplitList(e, ','), absl::StrCat(var, ": "), &c));
    }
  }
  if (const char* e = env("KVRELAY_ROUTE")) {
    for (const std::string& part : SplitList(e, ';')) {
      absl::Status s = ParseRoute("route", part, &c.routes);
      if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("KVRELAY_ROUTE: ", s.message()));
    }
  }
  for (const auto& [name, value] : flags) KVRELAY_RETURN_IF_ERROR(Apply(name, value, &c));
  for (const auto& [name, values] : list_flags) KVRELAY_RETURN_IF_ERROR(SetList(name, values, "", &c));
  KVRELAY_RETURN_IF_ERROR(CheckSecurity(c));
  if (c.max_outbox_bytes_per_destination > c.max_outbox_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-outbox-bytes-per-destination=", c.max_outbox_bytes_per_destination,
        ": expected at most --max-outbox-bytes=", c.max_outbox_bytes, " (bytes)"));
  }
  if (c.worker_threads <= 0) c.worker_threads = ThreadPool::HardwareThreads();
  return c;
}

}  // namespace kvrelay
