// kvrelay-server: the relay binary. See server/config.h for the flags.
#include <malloc.h>
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "absl/strings/numbers.h"
#include "client/heap_retain.h"
#include "client/relay_client.h"
#include "server/config.h"
#include "server/server.h"
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
    const std::string a = argv[i];
    if ((a == "--addr" || a == "--timeout") && i + 1 < argc) {
      const std::string v = argv[++i];
      if (a == "--addr") {
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
      std::cerr << "kvrelay-server health: unknown or incomplete flag " << a
                << " (expected --addr HOST:PORT or --timeout SECONDS)\n";
      return 2;
    }
  }
  absl::StatusOr<kvrelay::HealthStatus> h =
      kvrelay::RelayClient::Connect(addr)->Health(
          "", std::chrono::milliseconds(static_cast<int64_t>(timeout * 1000)));
  if (!h.ok()) {
    std::cerr << "kvrelay-server health: " << addr << ": " << h.status().ToString() << "\n";
    return 1;
  }
  std::cout << kvrelay::HealthStatusName(*h) << "\n";
  return *h == kvrelay::HealthStatus::kServing ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
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
    spdlog::set_pattern(
        R"({"ts":"%Y-%m-%dT%H:%M:%S.%fZ","level":"%l","logger":"%n","thread":%t,"msg":"%v"})",
        spdlog::pattern_time_type::utc);
  } else {
    spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ %v");
  }
  spdlog::flush_on(spdlog::level::info);

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
    return 1;
  }
  std::cout << (*server)->ReadyLine() << std::endl;  // flushes: tests wait for this line

  int sig = 0;
  sigwait(&sigs, &sig);
  spdlog::info("received {}", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  (*server)->Shutdown();  // drained: nothing is left in flight
  // Skip the destructors: stopping the metrics HTTP server waits out its
  // poll interval (~1.5 s), which only delays a pod's termination.
  spdlog::shutdown();
  std::cout.flush();
  std::fflush(nullptr);
  std::_Exit(0);
}
