// kvrelay-server configuration: flags, env fallbacks, config file, errors.
#include "server/config.h"

#include <cstdio>
#include <fstream>
#include <map>

#include "gtest/gtest.h"

namespace kvrelay {
namespace {

absl::StatusOr<ServerConfig> Parse(std::vector<const char*> args, std::map<std::string, std::string> env = {}) {
  args.insert(args.begin(), "kvrelay-server");
  return ParseServerConfig(static_cast<int>(args.size()), args.data(), [env](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

TEST(ConfigTest, Defaults) {
  auto c = Parse({});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen, "0.0.0.0:50051");
  EXPECT_EQ(c->metrics_listen, "0.0.0.0:9464");
  EXPECT_GE(c->worker_threads, 1);
  EXPECT_EQ(c->max_inflight_bytes, 4ull << 30);
  EXPECT_EQ(c->max_mailbox_bytes, 2ull << 30);
  EXPECT_EQ(c->max_session_messages, 1024u);
  EXPECT_EQ(c->session_ttl_seconds, 3600);
  EXPECT_EQ(c->default_policy, "h2o-head:k=32+obf:p=8,mode=fast");
  EXPECT_FALSE(c->log_json);
  EXPECT_EQ(c->shutdown_grace_seconds, 10);
}

TEST(ConfigTest, FlagsBeatEnvBeatFile) {
  const std::string path = ::testing::TempDir() + "/kvrelay_config_test.json";
  {
    std::ofstream f(path);
    f << R"({"listen": "1.2.3.4:1", "max_session_messages": 7, "worker-threads": 3,
            "role_policy": {"judger": "gen"}, "log-json": true})";
  }
  auto c = Parse({"--config", path.c_str(), "--listen=127.0.0.1:0", "--role-policy", "planner=h2o-layer:k=64",
                  "--max-inflight-bytes", "1GiB"},
                 {{"KVRELAY_LISTEN", "5.6.7.8:2"}, {"KVRELAY_WORKER_THREADS", "5"},
                  {"KVRELAY_ROLE_POLICY", "critic=full;refiner=h2o-head:k=16"}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen, "127.0.0.1:0");
  EXPECT_EQ(c->worker_threads, 5);
  EXPECT_EQ(c->max_session_messages, 7u);
  EXPECT_TRUE(c->log_json);
  EXPECT_EQ(c->max_inflight_bytes, 1ull << 30);
  EXPECT_EQ(c->PolicyForRole("planner"), "h2o-layer:k=64");
  EXPECT_EQ(c->PolicyForRole("judger"), "gen");
  EXPECT_EQ(c->PolicyForRole("critic"), "full");
  EXPECT_EQ(c->PolicyForRole("refiner"), "h2o-head:k=16");
  EXPECT_EQ(c->PolicyForRole("other"), c->default_policy);
  std::remove(path.c_str());
}

TEST(ConfigTest, BadFlagsNameTheFlag) {
  struct Case {
    std::vector<const char*> args;
    const char* needle;
  } cases[] = {
      {{"--listen", "nope"}, "--listen=nope"},
      {{"--listen", "h:70000"}, "--listen"},
      {{"--worker-threads", "0"}, "--worker-threads=0"},
      {{"--max-inflight-bytes", "lots"}, "--max-inflight-bytes=lots"},
      {{"--session-ttl-seconds", "0"}, "--session-ttl-seconds=0"},
      {{"--default-policy", "h2o-head+bogus"}, "--default-policy"},
      {{"--role-policy", "planner"}, "--role-policy=planner"},
      {{"--role-policy", "planner=gen+obf"}, "--role-policy=planner"},
      {{"--frobnicate", "1"}, "--frobnicate"},
      {{"--listen"}, "missing value"},
      {{"stray"}, "stray"},
      {{"--config", "/nonexistent/kvrelay.json"}, "--config"},
  };
  for (const auto& tc : cases) {
    auto c = Parse(tc.args);
    ASSERT_FALSE(c.ok()) << tc.needle;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find(tc.needle), std::string::npos) << c.status();
  }
  auto env = Parse({}, {{"KVRELAY_MAX_SESSION_MESSAGES", "-3"}});
  ASSERT_FALSE(env.ok());
  EXPECT_NE(env.status().message().find("KVRELAY_MAX_SESSION_MESSAGES"), std::string::npos);
  EXPECT_EQ(Parse({"--help"}).status().code(), absl::StatusCode::kCancelled);
}

TEST(ConfigTest, SplitHostPort) {
  std::string host;
  int port;
  ASSERT_TRUE(SplitHostPort("[::1]:0", &host, &port).ok());
  EXPECT_EQ(host, "[::1]");
  EXPECT_EQ(port, 0);
  EXPECT_FALSE(SplitHostPort("localhost", &host, &port).ok());
}

// Review 2c/2e: the retained-bytes limits and the upload idle timeout.
TEST(ConfigTest, StoreByteLimitsAndUploadIdleTimeout) {
  auto c = Parse({});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->max_session_bytes, 8ull << 30);
  EXPECT_EQ(c->max_store_bytes, 16ull << 30);
  EXPECT_EQ(c->upload_idle_timeout_seconds, 60);
  c = Parse({"--max-session-bytes=1GiB", "--upload-idle-timeout-seconds", "2.5"},
            {{"KVRELAY_MAX_STORE_BYTES", "3GiB"}, {"KVRELAY_MAX_SESSION_BYTES", "5GiB"}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->max_session_bytes, 1ull << 30);
  EXPECT_EQ(c->max_store_bytes, 3ull << 30);
  EXPECT_EQ(c->upload_idle_timeout_seconds, 2.5);
  c = Parse({}, {{"KVRELAY_UPLOAD_IDLE_TIMEOUT_SECONDS", "7"}});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->upload_idle_timeout_seconds, 7);
  EXPECT_EQ(Parse({"--upload-idle-timeout-seconds=0"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Parse({"--max-store-bytes=lots"}).status().code(), absl::StatusCode::kInvalidArgument);
  const std::string usage(Parse({"--help"}).status().message());
  for (const char* s : {"--max-session-bytes", "KVRELAY_MAX_SESSION_BYTES", "--max-store-bytes",
                        "KVRELAY_MAX_STORE_BYTES", "--upload-idle-timeout-seconds"}) {
    EXPECT_NE(usage.find(s), std::string::npos) << s;
  }
}

TEST(ConfigTest, HeapRetainBytes) {
  auto c = Parse({});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->heap_retain_bytes, 128ull << 20);
  c = Parse({"--heap-retain-bytes=0"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->heap_retain_bytes, 0u);  // glibc's defaults
  c = Parse({}, {{"KVRELAY_HEAP_RETAIN_BYTES", "64MiB"}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->heap_retain_bytes, 64ull << 20);
  auto bad = Parse({"--heap-retain-bytes=-1"});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("--heap-retain-bytes"), std::string::npos) << bad.status();
  const std::string usage(Parse({"--help"}).status().message());
  EXPECT_NE(usage.find("KVRELAY_HEAP_RETAIN_BYTES"), std::string::npos);
  // The retained heap is per malloc arena: one per two workers, at least 1.
  for (auto [workers, arenas] : {std::pair{1, 1}, {2, 1}, {3, 1}, {4, 2}, {8, 4}, {4096, 2048}}) {
    EXPECT_EQ(MallocArenas(workers), arenas) << workers;
  }
}

// Writes `text` to a fresh file under the test's temp dir and returns its path.
std::string ConfigFile(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

// From a review of the configuration: each of these was accepted (or
// misreported) before.
TEST(ConfigTest, ValuesOutOfReachAreRefusedWhereTheyAreGiven) {
  struct Case {
    std::vector<const char*> args;
    std::map<std::string, std::string> env;
    const char* needle;
  } cases[] = {
      // int64 nanoseconds end at ~292 years: 1e10 s overflowed into ~0.
      {{"--upload-idle-timeout-seconds", "1e10"}, {}, "--upload-idle-timeout-seconds=1e10: expected seconds in"},
      {{"--session-ttl-seconds=1e300"}, {}, "--session-ttl-seconds=1e300"},
      {{"--shutdown-grace-seconds", "2e9"}, {}, "--shutdown-grace-seconds=2e9"},
      // A list of addresses for the metrics server: one address only.
      {{"--metrics-listen", "127.0.0.1:0,127.0.0.1:0"}, {}, "--metrics-listen=127.0.0.1:0,127.0.0.1:0"},
      // A bad policy is reported where it came from.
      {{}, {{"KVRELAY_DEFAULT_POLICY", "bogus"}}, "KVRELAY_DEFAULT_POLICY: --default-policy=bogus: "},
      {{}, {{"KVRELAY_ROLE_POLICY", "planner=bogus"}}, "KVRELAY_ROLE_POLICY: --role-policy=planner=bogus: "},
  };
  for (const auto& tc : cases) {
    auto c = Parse(tc.args, tc.env);
    ASSERT_FALSE(c.ok()) << tc.needle;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find(tc.needle), std::string::npos) << c.status();
  }
  auto c = Parse({"--upload-idle-timeout-seconds=1e9", "--heap-retain-bytes=4GiB"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->upload_idle_timeout_seconds, 1e9);
  EXPECT_EQ(c->heap_retain_bytes, 2147483647u);  // glibc's thresholds are ints
}

TEST(ConfigTest, ConfigFileIsOneObjectAndChecksRolePolicies) {
  struct Case {
    const char* text;
    const char* needle;
  } cases[] = {
      {"{\"metrics_listen\":\"127.0.0.1:0\"}\n{\"max_store_bytes\":\"1GiB\"}", "invalid JSON"},
      {"{\"listen\":\"127.0.0.1:0\"} trailing", "invalid JSON"},
      {"{\"role_policy\":{\"\":\"full\"}}", "role_policy.: expected a non-empty ROLE"},
      {"{\"role_policy\":{\"planner\":\"\"}}", "--role-policy=planner=: expected ROLE=SPEC"},
      {"{\"role_policy\":{\"planner\":\"bogus\"}}", "--role-policy=planner=bogus: "},
      {"{\"default_policy\":\"bogus\"}", "--default-policy=bogus: "},
  };
  int i = 0;
  for (const auto& tc : cases) {
    const std::string path = ConfigFile("kvrelay_bad_config_" + std::to_string(i++) + ".json", tc.text);
    auto c = Parse({"--config", path.c_str()});
    ASSERT_FALSE(c.ok()) << tc.text;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find("--config=" + path + ": "), std::string::npos) << c.status();
    EXPECT_NE(c.status().message().find(tc.needle), std::string::npos) << c.status();
    std::remove(path.c_str());
  }
  // Numbers keep every digit: 1e6 is 1000000, not "1e+06".
  const std::string path = ConfigFile("kvrelay_numbers.json",
                                      R"({"max_session_messages": 1e6, "session_ttl_seconds": 1234567.8})");
  auto c = Parse({"--config", path.c_str()});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->max_session_messages, 1000000u);
  EXPECT_EQ(c->session_ttl_seconds, 1234567.8);
  std::remove(path.c_str());
}

// An empty environment variable is unset; KVRELAY_METRICS_LISTEN="" keeps
// meaning metrics off, as it always has and as --metrics-listen= does.
TEST(ConfigTest, EmptyEnvironmentVariablesAreUnset) {
  auto c = Parse({}, {{"KVRELAY_LISTEN", ""}, {"KVRELAY_LOG_JSON", ""}, {"KVRELAY_WORKER_THREADS", ""},
                      {"KVRELAY_DEFAULT_POLICY", ""}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen, "0.0.0.0:50051");
  EXPECT_EQ(c->metrics_listen, "0.0.0.0:9464");
  EXPECT_FALSE(c->log_json);
  EXPECT_EQ(c->default_policy, "h2o-head:k=32+obf:p=8,mode=fast");
  for (const char* off : {"", "off"}) {
    c = Parse({}, {{"KVRELAY_METRICS_LISTEN", off}});
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->metrics_listen, "") << off;
  }
}

}  // namespace
}  // namespace kvrelay
