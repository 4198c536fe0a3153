#include "server/config/flags.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "core/heap_retain.h"
#include "core/ids.h"
#include "core/pipeline.h"
#include "core/status_macros.h"
#include "core/thread_pool.h"
#include "nlohmann/json.hpp"
#include "proto/address.h"
#include "server/config/identity_pattern.h"
#include "server/config/route_template.h"

namespace kvrelay {
namespace {

// The shortest positive timeout: below it a publish or a session could not
// outlive the watchdog's own scheduling.
constexpr double kMinTimeoutSeconds = 0.01;
// The least journal growth between compactions: below a MiB the journal
// would be rewritten whole every few records.
constexpr uint64_t kMinSpoolCompactBytes = 1ull << 20;
// The longest (~31 years): durations are kept in int64 nanoseconds, which
// end at ~292 years.
constexpr double kMaxTimeoutSeconds = 1e9;
// sockaddr_un's sun_path holds 108 bytes, the terminating NUL included.
constexpr size_t kMaxUnixPathBytes = 107;

// The value parsers. Each names the flag and what was expected.

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
    return FlagError(flag, v, "a positive byte count, e.g. 4294967296 or 4GiB");
  }
  *out = n * mult;
  return absl::OkStatus();
}

absl::Status ParseSeconds(absl::string_view flag, const std::string& v, bool allow_zero, double* out) {
  double d;
  if (!absl::SimpleAtod(v, &d) || !std::isfinite(d) || d < 0 || (!allow_zero && d < kMinTimeoutSeconds) ||
      d > kMaxTimeoutSeconds) {
    return FlagError(flag, v, allow_zero ? "seconds in [0, 1e9]" : "seconds in [0.01, 1e9]");
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
    return FlagError(flag, v, "true or false");
  }
  return absl::OkStatus();
}

// One HOST:PORT; "", "off" or "none" clear it.
absl::Status ParseOptionalAddr(absl::string_view flag, const std::string& v, std::string* out) {
  if (v.empty() || v == "off" || v == "none") {
    out->clear();
    return absl::OkStatus();
  }
  std::string host;
  int port;
  // One address: the metrics server would take a comma as a list.
  if (!SplitHostPort(v, &host, &port).ok() || host.empty() || host.find_first_of(", \t") != std::string::npos) {
    return FlagError(flag, v, "HOST:PORT with PORT in 0..65535 (0 picks a free port)");
  }
  *out = v;
  return absl::OkStatus();
}

absl::Status ParseFile(absl::string_view flag, const std::string& v, const char* what, std::string* out) {
  if (v.empty()) return FlagError(flag, v, what);
  *out = v;
  return absl::OkStatus();
}

// One of `choices`.
absl::Status ParseChoice(absl::string_view flag, const std::string& v, std::initializer_list<const char*> choices,
                         std::string* out) {
  for (const char* c : choices) {
    if (v == c) {
      *out = v;
      return absl::OkStatus();
    }
  }
  return FlagError(flag, v, absl::StrJoin(choices, " or "));
}

// A policy spec that Pipeline::Create takes; errors read "--FLAG=VALUE: ...".
absl::Status CheckPolicy(absl::string_view flag, absl::string_view value, const std::string& spec) {
  if (auto p = Pipeline::Create(spec); !p.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", value, ": ", p.status().message()));
  }
  return absl::OkStatus();
}

absl::Status ParseRolePolicy(absl::string_view flag, const std::string& v, ServerConfig* c) {
  const size_t eq = v.find('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == v.size()) {
    return FlagError(flag, v, "ROLE=SPEC, e.g. planner=h2o-head:k=64+obf");
  }
  std::string spec = v.substr(eq + 1);
  KVRELAY_RETURN_IF_ERROR(CheckPolicy(flag, v, spec));
  c->role_policies[v.substr(0, eq)] = std::move(spec);
  return absl::OkStatus();
}

absl::Status ParseRoute(absl::string_view flag, const std::string& v, ServerConfig* c) {
  const size_t eq = v.find('=');
  if (eq == std::string::npos || eq + 1 == v.size()) {
    return FlagError(flag, v, "AGENT=TARGET, e.g. critic=10.0.0.7:50051 or critic=dns:///critic.agents:50051");
  }
  std::string agent = v.substr(0, eq), target = v.substr(eq + 1);
  if (!IsId(agent)) return FlagError(flag, v, absl::StrCat("AGENT=TARGET with AGENT of ", kIdPattern));
  KVRELAY_RETURN_IF_ERROR(CheckGrpcTarget(target, absl::StrCat("--", flag, "=", v)));
  c->routes[std::move(agent)] = std::move(target);
  return absl::OkStatus();
}

// One --listen address: HOST:PORT (PORT 0..65535) or unix:PATH.
absl::Status CheckListenAddr(absl::string_view flag, const std::string& v, ServerConfig*) {
  if (absl::StartsWith(v, kUnixPrefix)) {
    const std::string path = v.substr(strlen(kUnixPrefix));
    // The ready line lists the addresses separated by ',' after a space.
    if (path.empty() || path.size() > kMaxUnixPathBytes || path.find_first_of(", \t\r\n") != std::string::npos) {
      return FlagError(flag, v, "unix:PATH with a PATH of 1..107 bytes without ',' or whitespace");
    }
    return absl::OkStatus();
  }
  std::string host;
  int port;
  if (!SplitHostPort(v, &host, &port).ok() || host.empty() || host.find_first_of(", \t") != std::string::npos) {
    return FlagError(flag, v,
                     "HOST:PORT with PORT in 0..65535 (0 picks a free port) or unix:PATH; one address each, "
                     "repeat --listen for more");
  }
  return absl::OkStatus();
}

absl::Status CheckPeerIdentity(absl::string_view flag, const std::string& v, ServerConfig*) {
  if (absl::Status st = CheckIdentityPattern(v); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", st.message()));
  }
  return absl::OkStatus();
}

// The table's entries, by kind.
FlagSpec Value(const char* name, const char* metavar, const char* env, const char* default_text, const char* help,
               FlagSpec::Parse parse) {
  FlagSpec f;
  f.name = name;
  f.metavar = metavar;
  f.env = env;
  f.default_text = default_text;
  f.help = help;
  f.parse = parse;
  return f;
}

FlagSpec Switch(const char* name, const char* env, const char* help, FlagSpec::Parse parse) {
  FlagSpec f = Value(name, "", env, "off", help, parse);
  f.kind = FlagKind::kSwitch;
  return f;
}

FlagSpec List(const char* name, const char* metavar, const char* env, const char* default_text, const char* help,
              FlagSpec::Parse check, std::vector<std::string>* (*list)(ServerConfig*)) {
  FlagSpec f = Value(name, metavar, env, default_text, help, check);
  f.kind = FlagKind::kList;
  f.env_separator = ',';
  f.list = list;
  return f;
}

FlagSpec Map(const char* name, const char* metavar, const char* env, const char* help, FlagSpec::Parse parse) {
  FlagSpec f = Value(name, metavar, env, "", help, parse);
  f.kind = FlagKind::kMap;
  f.env_separator = ';';
  return f;
}

std::vector<FlagSpec> MakeServerFlags() {
  using C = ServerConfig;
  using S = absl::string_view;
  using V = const std::string&;
  std::vector<FlagSpec> t;
  FlagSpec listen = List(
      "listen", "ADDR", "KVRELAY_LISTEN", "127.0.0.1:50051",
      "gRPC address, repeatable: HOST:PORT (port 0 = free port; a port in use is an error, not shared) or "
      "unix:PATH, a Unix domain socket (PATH of at most 107 bytes, no ',' or whitespace). The socket is made mode "
      "0666, so the directory it is in decides who may connect; a stale socket left at PATH (one nobody accepts "
      "on) is removed first, a regular file or a socket in use is refused; it is removed on shutdown. Listen on "
      "the pod IP (e.g. 0.0.0.0:50051) where other relays or the kubelet must reach it",
      CheckListenAddr, [](C* c) { return &c->listen; });
  listen.at_least_one = true;
  t.push_back(listen);
  FlagSpec metrics = Value(
      "metrics-listen", "HOST:PORT", "KVRELAY_METRICS_LISTEN", "0.0.0.0:9464",
      "Prometheus /metrics address, \"off\" (or an empty variable) for none; IPv4 only where the metrics HTTP "
      "server, civetweb, is built without IPv6",
      [](S f, V v, C* c) { return ParseOptionalAddr(f, v, &c->metrics_listen); });
  metrics.empty_env_is_set = true;
  t.push_back(metrics);
  t.push_back(Value("worker-threads", "N", "KVRELAY_WORKER_THREADS", "hardware threads",
                    "compression workers, 1 to 4096", [](S f, V v, C* c) {
                      int n;
                      if (!absl::SimpleAtoi(v, &n) || n < 1 || n > 4096) {
                        return FlagError(f, v, "an integer in [1, 4096]");
                      }
                      c->worker_threads = n;
                      return absl::OkStatus();
                    }));
  t.push_back(Value("max-inflight-bytes", "N", "KVRELAY_MAX_INFLIGHT_BYTES", "4GiB",
                    "bytes of uploads in progress, all streams",
                    [](S f, V v, C* c) { return ParseBytes(f, v, &c->max_inflight_bytes); }));
  t.push_back(Value("max-mailbox-bytes", "N", "KVRELAY_MAX_MAILBOX_BYTES", "2GiB",
                    "unacked bytes per (session, agent)",
                    [](S f, V v, C* c) { return ParseBytes(f, v, &c->max_mailbox_bytes); }));
  t.push_back(Value("max-session-messages", "N", "KVRELAY_MAX_SESSION_MESSAGES", "1024", "messages per session",
                    [](S f, V v, C* c) {
                      uint32_t n;
                      if (!absl::SimpleAtoi(v, &n) || n < 1) return FlagError(f, v, "a positive integer");
                      c->max_session_messages = n;
                      return absl::OkStatus();
                    }));
  t.push_back(Value("max-session-bytes", "N", "KVRELAY_MAX_SESSION_BYTES", "8GiB",
                    "bytes of every message a session retains, acked ones included (they stay as potential "
                    "parents until the session closes or expires)",
                    [](S f, V v, C* c) { return ParseBytes(f, v, &c->max_session_bytes); }));
  t.push_back(Value("max-store-bytes", "N", "KVRELAY_MAX_STORE_BYTES", "16GiB",
                    "bytes of every retained message, all sessions",
                    [](S f, V v, C* c) { return ParseBytes(f, v, &c->max_store_bytes); }));
  t.push_back(Value("max-upload-work", "N", "KVRELAY_MAX_UPLOAD_WORK",
                    "4.5e12, four Qwen3-14B turns of 4096 prompt tokens and 256 steps with gen.q",
                    "multiply-adds one Publish or Compress may ask for, estimated from its header (scoring from "
                    "gen.q, the fidelity figure, obf); past it RESOURCE_EXHAUSTED before any chunk is read",
                    [](S f, V v, C* c) {
                      double w;
                      if (!absl::SimpleAtod(v, &w) || !std::isfinite(w) || w < 1) {
                        return FlagError(f, v, "a positive count of multiply-adds, e.g. 4e12");
                      }
                      c->max_upload_work = w;
                      return absl::OkStatus();
                    }));
  t.push_back(Value("upload-idle-timeout-seconds", "S", "KVRELAY_UPLOAD_IDLE_TIMEOUT_SECONDS", "60",
                    "a Publish or Compress upload that sends nothing for S seconds fails with DEADLINE_EXCEEDED "
                    "and frees its memory; a Fetch or Compress reply the client does not read for S seconds is "
                    "cancelled; at least 0.01",
                    [](S f, V v, C* c) { return ParseSeconds(f, v, false, &c->upload_idle_timeout_seconds); }));
  t.push_back(Value("session-ttl-seconds", "S", "KVRELAY_SESSION_TTL_SECONDS", "3600",
                    "idle time before a session expires; a Publish in progress or a Fetch waiting on it is "
                    "activity; at least 0.01",
                    [](S f, V v, C* c) { return ParseSeconds(f, v, false, &c->session_ttl_seconds); }));
  t.push_back(Value("default-policy", "SPEC", "KVRELAY_DEFAULT_POLICY", "h2o-head:k=32+obf:p=8,mode=fast",
                    "policy when neither the publish nor its role names one (docs/POLICIES.md)",
                    [](S f, V v, C* c) {
                      KVRELAY_RETURN_IF_ERROR(CheckPolicy(f, v, v));
                      c->default_policy = v;
                      return absl::OkStatus();
                    }));
  t.push_back(Map("role-policy", "ROLE=SPEC", "KVRELAY_ROLE_POLICY", "per-role default policy, repeatable",
                  ParseRolePolicy));
  t.push_back(Map("route", "AGENT=TARGET", "KVRELAY_ROUTE",
                  "the relay that holds AGENT's mailbox, repeatable. TARGET is HOST:PORT (port 1..65535) or a gRPC "
                  "target with a resolver scheme: dns:///HOST:PORT, unix:PATH, ipv4:, ipv6:",
                  ParseRoute));
  t.push_back(Value("route-file", "FILE", "KVRELAY_ROUTE_FILE", "",
                    "JSON object {AGENT: TARGET}, re-read when it changes",
                    [](S f, V v, C* c) { return ParseFile(f, v, "a file name", &c->route_file); }));
  t.push_back(Value("route-template", "TEMPLATE", "KVRELAY_ROUTE_TEMPLATE", "",
                    "TARGET for an agent no route names, with {agent} once, e.g. "
                    "dns:///{agent}.kvrelay.agents.svc.cluster.local:50051. --route beats --route-file beats "
                    "--route-template; no route: the agent is local",
                    [](S f, V v, C* c) {
                      if (absl::Status st = CheckRouteTemplate(v); !st.ok()) return FlagError(f, v, st.message());
                      c->route_template = v;
                      return absl::OkStatus();
                    }));
  t.push_back(Value("advertise", "TARGET", "KVRELAY_ADVERTISE", "",
                    "this relay as its peers reach it; a route to it is local", [](S f, V v, C* c) {
                      KVRELAY_RETURN_IF_ERROR(CheckGrpcTarget(v, absl::StrCat("--", f, "=", v)));
                      c->advertise = v;
                      return absl::OkStatus();
                    }));
  t.push_back(Value("forward-timeout-seconds", "S", "KVRELAY_FORWARD_TIMEOUT_SECONDS", "300",
                    "a forward is retried for S seconds, then dead-lettered; at least 0.01",
                    [](S f, V v, C* c) { return ParseSeconds(f, v, false, &c->forward_timeout_seconds); }));
  t.push_back(Value("forward-stall-seconds", "S", "KVRELAY_FORWARD_STALL_SECONDS", "10",
                    "a forward without progress for S seconds is cancelled and retried; at least 0.01",
                    [](S f, V v, C* c) { return ParseSeconds(f, v, false, &c->forward_stall_seconds); }));
  t.push_back(Value("wire-codec", "rans|none", "KVRELAY_WIRE_CODEC", "rans",
                    "how forwards sent from here and spool message files carry tensors: rans entropy-codes each "
                    "layer losslessly (a peer that does not speak it gets none; earlier relays do not read coded "
                    "spool files); none sends them as Fetch does and writes plain spool files",
                    [](S f, V v, C* c) {
                      std::string codec;
                      KVRELAY_RETURN_IF_ERROR(ParseChoice(f, v, {"rans", "none"}, &codec));
                      c->wire_codec_rans = codec == "rans";
                      return absl::OkStatus();
                    }));
  t.push_back(Value("max-outbox-bytes", "N", "KVRELAY_MAX_OUTBOX_BYTES", "4GiB",
                    "bytes of messages waiting to be forwarded, all destinations",
                    [](S f, V v, C* c) { return ParseBytes(f, v, &c->max_outbox_bytes); }));
  t.push_back(Value("max-outbox-bytes-per-destination", "N", "KVRELAY_MAX_OUTBOX_BYTES_PER_DESTINATION", "1GiB",
                    "the same per destination relay, at most --max-outbox-bytes",
                    [](S f, V v, C* c) { return ParseBytes(f, v, &c->max_outbox_bytes_per_destination); }));
  t.push_back(List("local-listen", "ADDR", "KVRELAY_LOCAL_LISTEN", "",
                   "plaintext address for the pod's own agents, repeatable: a loopback HOST:PORT (127.0.0.1, ::1, "
                   "localhost) or unix:PATH; anything else is refused. A unix:PATH is local under --listen too",
                   CheckListenAddr, [](C* c) { return &c->local_listen; }));
  t.push_back(Value("health-listen", "HOST:PORT", "KVRELAY_HEALTH_LISTEN", "",
                    "serves grpc.health.v1 alone, plaintext, for kubelet probes",
                    [](S f, V v, C* c) { return ParseOptionalAddr(f, v, &c->health_listen); }));
  t.push_back(Value("tls-cert", "FILE", "KVRELAY_TLS_CERT", "",
                    "this relay's certificate (PEM), with --tls-key: every TCP --listen address serves TLS, "
                    "loopback too. Both are re-read when the files change (atomic renames included): new "
                    "connections get the new certificate, calls in progress go on",
                    [](S f, V v, C* c) { return ParseFile(f, v, "a file name", &c->tls_cert); }));
  t.push_back(Value("tls-key", "FILE", "KVRELAY_TLS_KEY", "", "the private key of --tls-cert (PEM)",
                    [](S f, V v, C* c) { return ParseFile(f, v, "a file name", &c->tls_key); }));
  t.push_back(Value("tls-client-ca", "FILE", "KVRELAY_TLS_CLIENT_CA", "",
                    "CA bundle (PEM): client certificates are requested and every one presented is verified; "
                    "agents may still come with a token and none",
                    [](S f, V v, C* c) { return ParseFile(f, v, "a file name", &c->tls_client_ca); }));
  t.push_back(Value("tls-peer-ca", "FILE", "KVRELAY_TLS_PEER_CA", "--tls-client-ca",
                    "CA bundle that verifies the relays this one forwards to (over mTLS, presenting --tls-cert)",
                    [](S f, V v, C* c) { return ParseFile(f, v, "a file name", &c->tls_peer_ca); }));
  t.push_back(List("peer-identity", "PATTERN", "KVRELAY_PEER_IDENTITY", "",
                   "a relay allowed to forward here: its certificate SAN, exact or \"*.\" and a DNS suffix, "
                   "repeatable",
                   CheckPeerIdentity, [](C* c) { return &c->peer_identities; }));
  t.push_back(Value("tokens-file", "FILE", "KVRELAY_TOKENS_FILE", "",
                    "agents' tokens, one \"AGENT sha256:HEX\" per line ('#' comments; HEX = SHA-256 of the token; "
                    "`kvrelayctl token new AGENT` makes one), re-read when it changes. With it, every call on "
                    "--listen needs \"authorization: Bearer TOKEN\"",
                    [](S f, V v, C* c) { return ParseFile(f, v, "a file name", &c->tokens_file); }));
  t.push_back(Value("local-auth", "pod|token", "KVRELAY_LOCAL_AUTH", "pod",
                    "local listeners: \"pod\" (a local caller may act as any agent) or \"token\" (tokens as on "
                    "--listen)",
                    [](S f, V v, C* c) { return ParseChoice(f, v, {"pod", "token"}, &c->local_auth); }));
  t.push_back(Switch("insecure", "KVRELAY_INSECURE",
                     "allow plaintext on a non-loopback --listen (otherwise refused at start-up); logged, and "
                     "exported as kvrelay_insecure 1",
                     [](S f, V v, C* c) { return ParseBool(f, v, &c->insecure); }));
  t.push_back(Value("spool-dir", "DIR", "KVRELAY_SPOOL_DIR", "in memory only",
                    "keep messages, acks, closes and the outbox on disk in DIR (created, mode 0700; one relay per "
                    "directory), so that a restart (kill -9 included) loses nothing accepted",
                    [](S f, V v, C* c) { return ParseFile(f, v, "a directory", &c->spool_dir); }));
  t.push_back(Value("fsync", "always|never", "KVRELAY_FSYNC", "always",
                    "with --spool-dir: \"always\" syncs before answering; \"never\" is for benchmarks only and "
                    "loses data on a power loss or kernel crash",
                    [](S f, V v, C* c) { return ParseChoice(f, v, {"always", "never"}, &c->fsync); }));
  t.push_back(Value("max-spool-bytes", "N", "KVRELAY_MAX_SPOOL_BYTES", "0: up to the disk's free space",
                    "message files and journal in --spool-dir, at most; past it RESOURCE_EXHAUSTED",
                    [](S f, V v, C* c) { return ParseBytes(f, v, &c->max_spool_bytes); }));
  t.push_back(Value("spool-compact-bytes", "N", "KVRELAY_SPOOL_COMPACT_BYTES", "64MiB",
                    "rewrite the journal whole (compaction) each time it has grown by N, at least 1MiB; smaller "
                    "bounds the journal tighter, at more rewrites",
                    [](S f, V v, C* c) {
                      uint64_t n;
                      KVRELAY_RETURN_IF_ERROR(ParseBytes(f, v, &n));
                      if (n < kMinSpoolCompactBytes) return FlagError(f, v, "a byte count of at least 1MiB");
                      c->spool_compact_bytes = n;
                      return absl::OkStatus();
                    }));
  t.push_back(Switch("spool-salvage", "KVRELAY_SPOOL_SALVAGE",
                     "start on a journal damaged in the middle, with a damaged header, or missing beside message "
                     "files (refused otherwise): keep its intact records, move every message file they do not "
                     "name to DIR/quarantine/",
                     [](S f, V v, C* c) { return ParseBool(f, v, &c->spool_salvage); }));
  t.push_back(Switch("log-json", "KVRELAY_LOG_JSON",
                     "JSON log lines, the ready line too (its \"msg\" is the same text)",
                     [](S f, V v, C* c) { return ParseBool(f, v, &c->log_json); }));
  t.push_back(Value("shutdown-grace-seconds", "S", "KVRELAY_SHUTDOWN_GRACE_SECONDS", "10",
                    "drain time on SIGTERM/SIGINT",
                    [](S f, V v, C* c) { return ParseSeconds(f, v, true, &c->shutdown_grace_seconds); }));
  t.push_back(Value("heap-retain-bytes", "N", "KVRELAY_HEAP_RETAIN_BYTES", "128MiB",
                    "freed heap kept for reuse instead of returned to the kernel, so the next message does not "
                    "fault its pages in again; per malloc arena (one per two workers, at least 1): count that many "
                    "x N against the memory limit. More than 2GiB - 1 acts as 2GiB - 1; 0: glibc's defaults",
                    [](S f, V v, C* c) {
                      if (absl::StripAsciiWhitespace(v) == "0") {
                        c->heap_retain_bytes = 0;
                        return absl::OkStatus();
                      }
                      KVRELAY_RETURN_IF_ERROR(ParseBytes(f, v, &c->heap_retain_bytes));
                      // glibc's thresholds are ints.
                      c->heap_retain_bytes = std::min(c->heap_retain_bytes, kMaxHeapRetainBytes);
                      return absl::OkStatus();
                    }));
  FlagSpec config = Value("config", "FILE", "KVRELAY_CONFIG", "",
                          "JSON object with the same keys, '-' or '_'; \"listen\", \"local_listen\" and "
                          "\"peer_identity\" take a string (','-separated) or a list of strings, \"role_policy\" "
                          "and \"route\" an object {ROLE: SPEC} / {AGENT: TARGET} or a list of \"KEY=VALUE\" "
                          "strings",
                          nullptr);
  config.kind = FlagKind::kConfig;
  t.push_back(config);
  return t;
}

// The keys that name the map flags in a config file besides their own.
const FlagSpec* FindConfigKey(const std::string& key) {
  if (key == "role-policies") return FindServerFlag("role-policy");
  if (key == "routes") return FindServerFlag("route");
  return FindServerFlag(key);
}

// Replaces list flag `f` of `c` with `values`, each checked; `origin`
// prefixes errors ("" for flags, "KVRELAY_LISTEN: ", "--config=FILE: ").
absl::Status SetList(const FlagSpec& f, const std::vector<std::string>& values, absl::string_view origin,
                     ServerConfig* c) {
  if (values.empty() && f.at_least_one) {
    return absl::InvalidArgumentError(absl::StrCat(origin, "--", f.name, ": expected at least one address"));
  }
  std::set<std::string> seen;
  for (const std::string& v : values) {
    if (absl::Status st = f.parse(f.name, v, c); !st.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(origin, st.message()));
    }
    if (!seen.insert(v).second) {
      return absl::InvalidArgumentError(absl::StrCat(origin, "--", f.name, "=", v, ": given twice"));
    }
  }
  *f.list(c) = values;
  return absl::OkStatus();
}

std::vector<std::string> SplitList(absl::string_view v, char sep) {
  std::vector<std::string> out;
  for (absl::string_view part : absl::StrSplit(v, sep, absl::SkipWhitespace())) {
    out.emplace_back(absl::StripAsciiWhitespace(part));
  }
  return out;
}

// Applies one value of flag `f` from any source: a single value, or one item
// of a map. `origin` prefixes errors.
absl::Status ApplyOne(const FlagSpec& f, const std::string& value, absl::string_view origin, ServerConfig* c) {
  absl::Status st = f.parse(f.name, value, c);
  if (st.ok() || origin.empty()) return st;
  return absl::InvalidArgumentError(absl::StrCat(origin, st.message()));
}

// A config file's map flag: an object {KEY: VALUE}, or a list of "KEY=VALUE".
absl::Status ApplyConfigMap(const FlagSpec& f, const std::string& key, const nlohmann::json& v,
                            const std::string& origin, ServerConfig* c) {
  const size_t eq = f.metavar.find('=');
  const std::string k = f.metavar.substr(0, eq), val = f.metavar.substr(eq + 1);
  std::vector<std::string> items;
  if (v.is_object()) {
    for (auto r = v.begin(); r != v.end(); ++r) {
      if (r.key().empty() || r.key().find('=') != std::string::npos) {
        return absl::InvalidArgumentError(
            absl::StrCat(origin, key, ".", r.key(), ": expected a non-empty ", k, " without '='"));
      }
      if (!r.value().is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(origin, key, ".", r.key(), ": expected a ", val, " string"));
      }
      items.push_back(absl::StrCat(r.key(), "=", r.value().get<std::string>()));
    }
  } else if (v.is_array() && std::all_of(v.begin(), v.end(), [](const auto& e) { return e.is_string(); })) {
    for (const auto& e : v) items.push_back(e.get<std::string>());
  } else {
    return absl::InvalidArgumentError(absl::StrCat(origin, key, ": expected an object {", k, ": ", val,
                                                   "} or a list of \"", f.metavar, "\" strings"));
  }
  for (const std::string& item : items) KVRELAY_RETURN_IF_ERROR(ApplyOne(f, item, origin, c));
  return absl::OkStatus();
}

absl::Status ApplyConfigFile(const std::string& path, ServerConfig* c) {
  const std::string origin = absl::StrCat("--config=", path, ": ");
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(origin, "cannot open the file"));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);  // one JSON value, nothing after it
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(origin, "invalid JSON: ", e.what()));
  }
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(origin, "expected a JSON object"));
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string key = absl::StrReplaceAll(it.key(), {{"_", "-"}});
    const nlohmann::json& v = it.value();
    const FlagSpec* f = FindConfigKey(key);
    if (f == nullptr || f->kind == FlagKind::kConfig) {
      return absl::InvalidArgumentError(absl::StrCat(origin, "--", key, ": unknown flag (see --help)"));
    }
    if (f->kind == FlagKind::kMap) {
      KVRELAY_RETURN_IF_ERROR(ApplyConfigMap(*f, it.key(), v, origin, c));
      continue;
    }
    if (f->kind == FlagKind::kList) {
      std::vector<std::string> items;
      if (v.is_string()) {
        items = SplitList(v.get<std::string>(), f->env_separator);
      } else if (v.is_array() && std::all_of(v.begin(), v.end(), [](const auto& e) { return e.is_string(); })) {
        for (const auto& e : v) items.push_back(e.get<std::string>());
      } else {
        return absl::InvalidArgumentError(absl::StrCat(origin, it.key(), ": expected a string or a list of strings"));
      }
      KVRELAY_RETURN_IF_ERROR(SetList(*f, items, origin, c));
      continue;
    }
    std::string s;
    if (v.is_string()) s = v.get<std::string>();
    else if (v.is_boolean()) s = v.get<bool>() ? "true" : "false";
    else if (v.is_number_unsigned()) s = std::to_string(v.get<uint64_t>());
    else if (v.is_number_integer()) s = std::to_string(v.get<int64_t>());
    else if (v.is_number()) s = absl::StrFormat("%.17g", v.get<double>());  // 1e6 -> "1000000"
    else return absl::InvalidArgumentError(absl::StrCat(origin, it.key(), ": expected a string or number"));
    KVRELAY_RETURN_IF_ERROR(ApplyOne(*f, s, origin, c));
  }
  return absl::OkStatus();
}

// The environment fallbacks, in the table's order.
absl::Status ApplyEnvironment(const EnvLookup& env, ServerConfig* c) {
  for (const FlagSpec& f : ServerFlags()) {
    if (f.kind == FlagKind::kConfig) continue;
    const char* e = env(f.env.c_str());
    // An empty variable is unset, as in most container runtimes' templating,
    // except where the table says empty is a value.
    if (e == nullptr || (*e == '\0' && !f.empty_env_is_set)) continue;
    const std::string origin = absl::StrCat(f.env, ": ");
    switch (f.kind) {
      case FlagKind::kList:
        KVRELAY_RETURN_IF_ERROR(SetList(f, SplitList(e, f.env_separator), origin, c));
        break;
      case FlagKind::kMap:
        for (const std::string& item : SplitList(e, f.env_separator)) {
          KVRELAY_RETURN_IF_ERROR(ApplyOne(f, item, origin, c));
        }
        break;
      default:
        KVRELAY_RETURN_IF_ERROR(ApplyOne(f, e, origin, c));
    }
  }
  return absl::OkStatus();
}

// Wraps `text` into lines of at most `width` characters (a longer word
// stays whole); the first line starts at `first_column`, the others are
// indented by `indent` spaces.
std::string Wrap(const std::string& text, size_t width, size_t indent, size_t first_column) {
  std::string out;
  size_t column = first_column;
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (out.empty()) {
      column += word.size();
    } else if (column + 1 + word.size() > width) {
      absl::StrAppend(&out, "\n", std::string(indent, ' '));
      column = indent + word.size();
    } else {
      out += ' ';
      column += 1 + word.size();
    }
    absl::StrAppend(&out, word);
  }
  return out;
}

// How the variable of `f` is written: "KVRELAY_LISTEN: ADDR,ADDR".
std::string EnvForm(const FlagSpec& f) {
  if (f.env_separator == 0) return f.env;
  return absl::StrCat(f.env, ": ", f.metavar, std::string(1, f.env_separator), f.metavar);
}

std::string FlagForm(const FlagSpec& f) {
  return f.metavar.empty() ? absl::StrCat("--", f.name) : absl::StrCat("--", f.name, " ", f.metavar);
}

}  // namespace

absl::Status FlagError(absl::string_view flag, absl::string_view value, absl::string_view expected) {
  return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", value, ": expected ", expected));
}

const std::vector<FlagSpec>& ServerFlags() {
  static const std::vector<FlagSpec>* const kFlags = new std::vector<FlagSpec>(MakeServerFlags());
  return *kFlags;
}

const FlagSpec* FindServerFlag(absl::string_view name) {
  for (const FlagSpec& f : ServerFlags()) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

std::string ServerUsage() {
  constexpr size_t kHelpColumn = 33, kWidth = 116;
  std::string out = "usage: kvrelay-server [flags]\n";
  for (const FlagSpec& f : ServerFlags()) {
    std::string head = absl::StrCat("  ", FlagForm(f));
    head += head.size() < kHelpColumn - 1 ? std::string(kHelpColumn - head.size(), ' ') : std::string("  ");
    std::string tail = EnvForm(f);
    if (!f.default_text.empty()) absl::StrAppend(&tail, "; ", f.default_text);
    absl::StrAppend(&out, head, Wrap(absl::StrCat(f.help, " (", tail, ")"), kWidth, kHelpColumn, head.size()),
                    "\n");
  }
  absl::StrAppend(&out, R"(A flag beats its environment variable, which beats the config file; role policies merge per role and
routes per agent, while the --listen flags (else KVRELAY_LISTEN, else the file's) replace the list. An
empty environment variable counts as unset (KVRELAY_METRICS_LISTEN: off). Byte counts take KiB, MiB, GiB
or TiB; seconds are at most 1e9. --help=markdown prints this table in Markdown.
Once serving, prints one line listing every gRPC address (--listen, then --local-listen; bound ports,
unix:PATH for sockets), the metrics address, and the health address when there is one:
  kvrelay-server ready grpc=127.0.0.1:50051,unix:/run/kvrelay/relay.sock metrics=0.0.0.0:9464 health=0.0.0.0:8081
(with --log-json, a JSON record whose "msg" is that text)

       kvrelay-server health [--addr HOST:PORT] [--timeout SECONDS]
  asks a running relay's grpc.health.v1 (default 127.0.0.1:50051, 2 s); exit 0 when SERVING
)");
  return out;
}

std::string ServerFlagsMarkdown() {
  auto cell = [](const std::string& s) { return absl::StrReplaceAll(s, {{"|", "\\|"}}); };
  std::string out = "| flag | environment | default | |\n|---|---|---|---|\n";
  for (const FlagSpec& f : ServerFlags()) {
    std::string flag = absl::StrCat("`", cell(FlagForm(f)), "`");
    if (f.kind == FlagKind::kList || f.kind == FlagKind::kMap) absl::StrAppend(&flag, " (repeatable)");
    std::string env = absl::StrCat("`", f.env, "`");
    if (f.env_separator != 0) {
      absl::StrAppend(&env, " (`", cell(f.metavar), std::string(1, f.env_separator), cell(f.metavar), "`)");
    }
    const std::string def = f.default_text.empty() ? "none" : cell(f.default_text);
    absl::StrAppend(&out, "| ", flag, " | ", env, " | ", def, " | ", cell(f.help), " |\n");
  }
  return out;
}

absl::StatusOr<ServerConfig> ParseServerConfig(int argc, const char* const* argv, const EnvLookup& env) {
  // Collect the flags first: the config file comes before the environment
  // and the flags.
  std::vector<std::pair<const FlagSpec*, std::string>> flags;
  std::map<const FlagSpec*, std::vector<std::string>> lists;  // replace the other sources' lists as a whole
  std::string config_path;
  if (const char* e = env(FindServerFlag("config")->env.c_str())) config_path = e;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") return absl::CancelledError(ServerUsage());
    if (arg == "--help=markdown") return absl::CancelledError(ServerFlagsMarkdown());
    if (arg.rfind("--", 0) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(arg, ": unexpected argument, expected --flag (see --help)"));
    }
    std::string name = arg.substr(2), value;
    const size_t eq = name.find('=');
    if (eq != std::string::npos) name.resize(eq);
    const FlagSpec* f = FindServerFlag(name);
    if (f == nullptr) return absl::InvalidArgumentError(absl::StrCat("--", name, ": unknown flag (see --help)"));
    if (eq != std::string::npos) {
      value = arg.substr(2 + eq + 1);
    } else if (f->kind == FlagKind::kSwitch) {
      value = "true";
    } else {
      if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat("--", name, ": missing value"));
      value = argv[++i];
    }
    if (f->kind == FlagKind::kConfig) {
      config_path = value;
    } else if (f->kind == FlagKind::kList) {
      lists[f].push_back(value);
    } else {
      flags.emplace_back(f, value);
    }
  }
  ServerConfig c;
  if (!config_path.empty()) KVRELAY_RETURN_IF_ERROR(ApplyConfigFile(config_path, &c));
  KVRELAY_RETURN_IF_ERROR(ApplyEnvironment(env, &c));
  for (const auto& [f, value] : flags) KVRELAY_RETURN_IF_ERROR(ApplyOne(*f, value, "", &c));
  for (const auto& [f, values] : lists) KVRELAY_RETURN_IF_ERROR(SetList(*f, values, "", &c));
  KVRELAY_RETURN_IF_ERROR(CheckServerConfig(c));
  if (c.worker_threads <= 0) c.worker_threads = ThreadPool::HardwareThreads();
  return c;
}

}  // namespace kvrelay
