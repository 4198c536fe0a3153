// kvrelay-server: the relay binary. See server/config.h for the flags.
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "server/config.h"
#include "server/server.h"
#include "spdlog/sinks/stdout_sinks.h"
#include "spdlog/spdlog.h"

int main(int argc, char** argv) {
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
  (*server)->Shutdown();
  server->reset();
  spdlog::shutdown();
  return 0;
}
