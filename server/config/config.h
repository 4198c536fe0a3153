// Configuration of kvrelay-server: flags, environment fallbacks and an
// optional JSON config file.
//
// Precedence, highest first: command-line flags, KVRELAY_* environment
// variables, the --config FILE (JSON object whose keys are the flag names
// without the leading dashes, '-' or '_' alike), built-in defaults.
//
// Every flag, with its environment variable, default and help, is an entry
// of the table in flags.h (ServerFlags); `kvrelay-server --help` and the
// table of docs/OPERATING.md are made from it.
//
// Byte sizes accept a plain integer or a KiB/MiB/GiB/TiB suffix ("4GiB");
// seconds are at most 1e9. An empty environment variable counts as unset,
// except KVRELAY_METRICS_LISTEN, where empty means off as for the flag.
// Role policies merge per role across the three sources, and routes per
// agent; the lists --listen, --local-listen and --peer-identity do not
// merge: the flags, else the variable, else the file's key (a string or a
// list), replace the default as a whole.
//
// Security rules, checked once every source is in (InvalidArgument, exit
// 2): --tls-cert and --tls-key go together, and the CA and identity flags
// need them; a --local-listen address is loopback or unix:PATH; a
// non-loopback TCP --listen without TLS needs --insecure; TLS with routes
// needs a CA to verify peers (--tls-peer-ca or --tls-client-ca);
// --local-auth=token needs --tokens-file. Every policy, address and target is checked where
// it is given, so a bad one is a configuration error naming its source
// (flag, variable or file).
//
// A TARGET (--route, --advertise, a substituted --route-template) is what a
// relay dials: HOST:PORT with PORT in 1..65535, or a gRPC target with a
// resolver scheme (dns:///HOST:PORT, unix:PATH, ipv4:, ipv6:, ...); see
// CheckGrpcTarget in proto/address.h.
#ifndef KVRELAY_SERVER_CONFIG_CONFIG_H_
#define KVRELAY_SERVER_CONFIG_CONFIG_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/heap_retain.h"

namespace kvrelay {

// --max-upload-work's default: four turns of Qwen3-14B (40 layers, 40 query
// heads over 8 KV heads, head_dim 128) with a 4096-token prompt, 256
// generated steps and gen.q under the default policy (1.09e12 each by
// UploadWork), or one of 8192 + 512 (4.31e12); some 200 s of one core.
inline constexpr double kDefaultMaxUploadWork = 4.5e12;

struct ServerConfig {
  // gRPC addresses in the order given, no two alike: HOST:PORT (PORT 0..65535,
  // 0 picks a free port) or unix:PATH (a Unix domain socket; PATH of 1..107
  // bytes without ',' or whitespace).
  std::vector<std::string> listen = {"127.0.0.1:50051"};
  std::string metrics_listen = "0.0.0.0:9464";  // empty: no metrics endpoint
  int worker_threads = 0;                        // 0 before ParseServerConfig: hardware
  uint64_t max_inflight_bytes = 4ull << 30;
  uint64_t max_mailbox_bytes = 2ull << 30;
  uint32_t max_session_messages = 1024;
  uint64_t max_session_bytes = 8ull << 30;
  uint64_t max_store_bytes = 16ull << 30;
  // The multiply-adds one Publish or Compress may ask for, estimated from
  // its header (UploadWork in server/rpc/request_checks.h); past it the upload
  // is refused before any chunk is read.
  double max_upload_work = kDefaultMaxUploadWork;
  double upload_idle_timeout_seconds = 60;
  double session_ttl_seconds = 3600;
  std::string default_policy = "h2o-head:k=32+obf:p=8,mode=fast";
  std::map<std::string, std::string> role_policies;
  // Where each recipient's mailbox is when it is not local. routes beats
  // route_file beats route_template; a recipient none of them names is
  // local, and so is one whose target equals `advertise`.
  std::map<std::string, std::string> routes;  // AGENT -> TARGET
  std::string route_file;                      // JSON {AGENT: TARGET}; empty: none
  std::string route_template;                  // one "{agent}"; empty: none
  std::string advertise;                       // this relay's target as peers reach it; empty: none
  double forward_timeout_seconds = 300;        // retrying a forward, then dead-lettered
  double forward_stall_seconds = 10;           // a forward without progress that long is cancelled
  // Forwards sent from here and the spool's message files code each layer
  // with the wire codec (proto/wire_codec.h); false: tensors as Fetch sends
  // them (protocol 1), plain message files.
  bool wire_codec_rans = true;
  uint64_t max_outbox_bytes = 4ull << 30;      // messages waiting to be forwarded, all destinations
  uint64_t max_outbox_bytes_per_destination = 1ull << 30;  // <= max_outbox_bytes
  // Plaintext listeners for the pod's own agents: loopback HOST:PORT or
  // unix:PATH (a unix:PATH in `listen` is local too).
  std::vector<std::string> local_listen;
  std::string health_listen;  // HOST:PORT serving grpc.health.v1 only, plaintext; empty: none
  // TLS on every TCP `listen` address when tls_cert and tls_key are set
  // (PEM files, re-read when they change).
  std::string tls_cert, tls_key;
  std::string tls_client_ca;  // requests and verifies client certificates
  std::string tls_peer_ca;    // verifies the relays this one forwards to ("": tls_client_ca)
  std::vector<std::string> peer_identities;  // SAN patterns of relays allowed to forward here
  std::string tokens_file;                   // agents' token digests; "": no tokens
  std::string local_auth = "pod";            // "pod" or "token": local callers need a token
  bool insecure = false;                     // a non-loopback `listen` may be plaintext
  bool log_json = false;
  // A durable store (server/store/spool_store.h) in this directory; empty: the
  // in-memory store. fsync is "always" or "never" (benchmarks only).
  std::string spool_dir;
  std::string fsync = "always";
  uint64_t max_spool_bytes = 0;  // 0: no limit but the disk's
  // Journal growth that triggers a compaction (rewriting it whole).
  uint64_t spool_compact_bytes = 64ull << 20;
  // Start on a journal damaged beyond a torn tail, or missing beside message
  // files, by salvaging (SpoolOptions::salvage) instead of refusing.
  bool spool_salvage = false;
  double shutdown_grace_seconds = 10;
  // Freed heap memory kept for reuse rather than returned to the kernel
  // (glibc's trim threshold, per malloc arena: see MallocArenas; the mmap
  // threshold becomes min(N, 32MiB) so tensors come from the heap).
  // Re-faulting a turn's ~90 MB of fresh pages costs tens of ms per
  // message; 0 leaves glibc's defaults.
  uint64_t heap_retain_bytes = kDefaultHeapRetainBytes;

  // The policy spec for `role` (its role policy, else the default).
  const std::string& PolicyForRole(const std::string& role) const;
};

// Reads an environment variable; nullptr when unset. Tests pass their own.
using EnvLookup = std::function<const char*(const char*)>;

// Parses argv (argv[0] is skipped) with `env` fallbacks. InvalidArgument
// naming the flag and what was expected; the caller prints it and exits 2.
// `--help` yields a status with code kCancelled whose message is the usage.
absl::StatusOr<ServerConfig> ParseServerConfig(int argc, const char* const* argv,
                                               const EnvLookup& env);

// glibc malloc arenas kvrelay-server allows: one per two workers, at least
// one. Freed tensors are reused only within their arena, so fewer arenas
// keep the peak RSS of an upload lower (2 workers, H-OBF hop: 0.29-0.33 of
// the turn with one arena, 0.38-0.39 with two), and --heap-retain-bytes is
// kept per arena.
inline int MallocArenas(int worker_threads) { return worker_threads / 2 > 1 ? worker_threads / 2 : 1; }

// The rules between flags, once every source is in (ParseServerConfig
// applies them): the security rules above, and the outbox's per-destination
// bound at most its total. InvalidArgument naming the flags otherwise.
absl::Status CheckServerConfig(const ServerConfig& c);

// Whether a non-loopback TCP --listen address serves plaintext (--insecure):
// the kvrelay_insecure gauge.
bool ServesPlaintextOffLoopback(const ServerConfig& c);

// The prefix of a Unix domain socket address in --listen ("unix:PATH").
inline constexpr char kUnixPrefix[] = "unix:";

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_CONFIG_CONFIG_H_
