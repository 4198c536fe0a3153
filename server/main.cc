// kvrelay-server: the relay binary. See server/config/config.h for the flags.
#include <malloc.h>
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <optional>
#include <string>

#include "absl/strings/numbers.h"
#include "core/heap_retain.h"
#include "google/protobuf/stubs/logging.h"
#include "grpc/support/log.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "proto/channel.h"
#include "server/config/config.h"
#include "server/server.h"
#include "spdlog/pattern_formatter.h"
#include "spdlog/sinks/stdout_sinks.h"
#include "spdlog/spdlog.h"

namespace {

// `kvrelay-server health [--addr HOST:PORT] [--timeout SECONDS]`: a probe for
// container HEALTHCHECKs. Asks grpc.health.v1 (default 127.0.0.1:50051, 2 s)
// and exits 0 only when the server answers SERVING; prints the status.
int HealthMain(int argc, char** argv) {
  std::string addr = "127.0.0.1:50051";
  double timeout = 2;
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    std::optional<std::string> inline_value;  // --flag=value
    if (const size_t eq = a.find('='); a.rfind("--", 0) == 0 && eq != std::string::npos) {
      inline_value = a.substr(eq + 1);
      a.resize(eq);
    }
    if ((a == "--addr" || a == "--timeout") && (inline_value || i + 1 < argc)) {
      const std::string v = inline_value ? *inline_value : argv[++i];
      if (a == "--addr") {
        if (absl::Status st = kvrelay::CheckRelayAddress(v); !st.ok()) {
          std::cerr << "kvrelay-server health: --addr: " << st.message() << "\n";
          return 2;
        }
        addr = v;
      } else if (!absl::SimpleAtod(v, &timeout) || !(timeout > 0) || timeout > 3600) {
        std::cerr << "kvrelay-server health: --timeout=" << v << ": expected seconds in (0, 3600]\n";
        return 2;
      }
    } else if (a == "--help" || a == "-h") {
      std::cout << "usage: kvrelay-server health [--addr HOST:PORT] [--timeout SECONDS]\n"
                   "  exits 0 when grpc.health.v1 answers SERVING (default 127.0.0.1:50051, 2 s)\n";
      return 0;
    } else {
      std::cerr << "kvrelay-server health: unknown or incomplete flag " << argv[i]
                << " (expected --addr HOST:PORT or --timeout SECONDS)\n";
      return 2;
    }
  }
  absl::StatusOr<kvrelay::HealthStatus> h =
      kvrelay::CheckHealth(grpc::CreateChannel(addr, grpc::InsecureChannelCredentials()), "",
                           std::chrono::milliseconds(static_cast<int64_t>(timeout * 1000)));
  if (!h.ok()) {
    std::cerr << "kvrelay-server health: " << addr << ": " << h.status().ToString() << "\n";
    return 1;
  }
  std::cout << kvrelay::HealthStatusName(*h) << "\n";
  return *h == kvrelay::HealthStatus::kServing ? 0 : 1;
}

// `%*` in the JSON log pattern: the message as the body of a JSON string.
// Messages can carry text a client sent (a policy, an id); quotes,
// backslashes and control bytes are escaped, and bytes that are not UTF-8
// become U+FFFD, so that every line parses.
class JsonEscapedMessage : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&, spdlog::memory_buf_t& dest) override {
    const auto* p = reinterpret_cast<const unsigned char*>(msg.payload.data());
    const size_t n = msg.payload.size();
    auto put = [&dest](const char* s, size_t len) { dest.append(s, s + len); };
    for (size_t i = 0; i < n;) {
      const unsigned char c = p[i];
      if (c == '"' || c == '\\') {
        const char esc[2] = {'\\', static_cast<char>(c)};
        put(esc, 2);
        ++i;
      } else if (c < 0x20 || c == 0x7f) {
        char esc[8];
        std::snprintf(esc, sizeof esc, "\\u%04x", c);
        put(esc, 6);
        ++i;
      } else if (c < 0x80) {
        dest.push_back(static_cast<char>(c));
        ++i;
      } else {
        const size_t len = Utf8Length(p + i, n - i);
        if (len == 0) {
          put("\\ufffd", 6);
          ++i;
        } else {
          put(reinterpret_cast<const char*>(p + i), len);
          i += len;
        }
      }
    }
  }
  std::unique_ptr<custom_flag_formatter> clone() const override { return std::make_unique<JsonEscapedMessage>(); }

 private:
  // Length of the well-formed UTF-8 sequence at p (RFC 3629: no overlong
  // forms, no surrogates, at most U+10FFFF), or 0.
  static size_t Utf8Length(const unsigned char* p, size_t n) {
    const unsigned char c = p[0];
    size_t len;
    uint32_t min;
    uint32_t cp;
    if (c >= 0xc2 && c <= 0xdf) {
      len = 2, min = 0x80, cp = c & 0x1f;
    } else if (c >= 0xe0 && c <= 0xef) {
      len = 3, min = 0x800, cp = c & 0x0f;
    } else if (c >= 0xf0 && c <= 0xf4) {
      len = 4, min = 0x10000, cp = c & 0x07;
    } else {
      return 0;
    }
    if (n < len) return 0;
    for (size_t k = 1; k < len; ++k) {
      if ((p[k] & 0xc0) != 0x80) return 0;
      cp = cp << 6 | (p[k] & 0x3f);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
    return len;
  }
};

// gRPC's and protobuf's own log lines (a bind error, a string field that is
// not UTF-8) go through the relay's logger, so that --log-json output stays
// one JSON record per line.
void GrpcLog(gpr_log_func_args* args) {
  // gRPC has already filtered by GRPC_VERBOSITY: what reaches here is shown
  // (its debug lines at info, which the logger prints).
  const spdlog::level::level_enum level =
      args->severity == GPR_LOG_SEVERITY_ERROR ? spdlog::level::err : spdlog::level::info;
  spdlog::log(level, "grpc: {} ({}:{})", args->message, args->file, args->line);
}

void ProtobufLog(google::protobuf::LogLevel level, const char* file, int line, const std::string& message) {
  const spdlog::level::level_enum l = level >= google::protobuf::LOGLEVEL_ERROR     ? spdlog::level::err
                                      : level == google::protobuf::LOGLEVEL_WARNING ? spdlog::level::warn
                                                                                    : spdlog::level::info;
  spdlog::log(l, "protobuf: {} ({}:{})", message, file, line);
}

}  // namespace

int main(int argc, char** argv) {
  // Logs go to stdout: a reader that goes away (a pipe to `head`, a log
  // shipper restarting) must not kill the relay and the messages it holds.
  signal(SIGPIPE, SIG_IGN);
  if (argc >= 2 && std::string(argv[1]) == "health") return HealthMain(argc, argv);
  absl::StatusOr<kvrelay::ServerConfig> config =
      kvrelay::ParseServerConfig(argc, argv, [](const char* name) { return std::getenv(name); });
  if (!config.ok()) {
    if (config.status().code() == absl::StatusCode::kCancelled) {
      std::cout << config.status().message();
      return 0;
    }
    std::cerr << "kvrelay-server: " << config.status().message() << "\n" << "run kvrelay-server --help for usage\n";
    return 2;
  }
  // glibc gives every thread that allocates its own arena (up to 8 per core);
  // with gRPC's threads and the workers handing megabyte buffers to each
  // other, freed memory then sits in many arenas and peak RSS grows by ~40%
  // of a turn more than it needs. MallocArenas() keeps it down at no measured
  // speed cost; MALLOC_ARENA_MAX, when set, wins.
  if (std::getenv("MALLOC_ARENA_MAX") == nullptr) mallopt(M_ARENA_MAX, kvrelay::MallocArenas(config->worker_threads));
  kvrelay::RetainFreedHeap(config->heap_retain_bytes);  // see client/heap_retain.h
  auto logger = spdlog::stdout_logger_mt("kvrelay");
  spdlog::set_default_logger(logger);
  if (config->log_json) {
    auto formatter = std::make_unique<spdlog::pattern_formatter>(spdlog::pattern_time_type::utc);
    formatter->add_flag<JsonEscapedMessage>('*').set_pattern(
        R"({"ts":"%Y-%m-%dT%H:%M:%S.%fZ","level":"%l","logger":"%n","thread":%t,"msg":"%*"})");
    spdlog::set_formatter(std::move(formatter));
  } else {
    spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ %v");
  }
  spdlog::flush_on(spdlog::level::info);
  gpr_set_log_function(GrpcLog);
  google::protobuf::SetLogHandler(ProtobufLog);

  // Block the shutdown signals in every thread; main waits for them.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);

  absl::StatusOr<std::unique_ptr<kvrelay::RelayServer>> server = kvrelay::RelayServer::Start(*config);
  if (!server.ok()) {
    spdlog::error("cannot start: {}", server.status().ToString());
    std::cerr << "kvrelay-server: " << server.status().message() << "\n";
    // A configuration the relay cannot serve (e.g. an IPv6 metrics address
    // without IPv6 support) is a usage error, as in ParseServerConfig.
    const bool usage = server.status().code() == absl::StatusCode::kInvalidArgument;
    if (usage) std::cerr << "run kvrelay-server --help for usage\n";
    // As at the end: no destructors while gRPC's threads may still log.
    spdlog::default_logger()->flush();
    std::cerr.flush();
    std::fflush(nullptr);
    std::_Exit(usage ? 2 : 1);
  }
  // Tests and scripts wait for this line. With --log-json it is a log record
  // like every other line (its msg is the same text).
  if (config->log_json) {
    spdlog::info("{}", (*server)->ReadyLine());
  } else {
    std::cout << (*server)->ReadyLine() << std::endl;  // flushes
  }

  int sig = 0;
  sigwait(&sigs, &sig);
  spdlog::info("received {}", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  (*server)->Shutdown();  // drained: nothing is left in flight
  // Skip the destructors: stopping the metrics HTTP server waits out its
  // poll interval (~1.5 s), which only delays a pod's termination. The
  // logger stays: gRPC's threads may still log through it (GrpcLog) until
  // the process ends.
  spdlog::default_logger()->flush();
  std::cout.flush();
  std::fflush(nullptr);
  std::_Exit(0);
}
