// kvrelay-server configuration: flags, env fallbacks, config file, errors.
#include "server/config/config.h"

#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <vector>

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
  EXPECT_EQ(c->listen, std::vector<std::string>{"127.0.0.1:50051"});
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
  EXPECT_EQ(c->listen, std::vector<std::string>{"127.0.0.1:0"});
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

// The bound on one upload's compression work: flag, environment, file.
TEST(ConfigTest, MaxUploadWork) {
  auto c = Parse({});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->max_upload_work, kDefaultMaxUploadWork);
  c = Parse({"--max-upload-work=1e9"}, {{"KVRELAY_MAX_UPLOAD_WORK", "5e9"}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->max_upload_work, 1e9);
  c = Parse({}, {{"KVRELAY_MAX_UPLOAD_WORK", "5000000000"}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->max_upload_work, 5e9);
  const std::string path = ::testing::TempDir() + "/max_upload_work.json";
  std::ofstream(path) << R"({"max_upload_work": 2e10})";
  c = Parse({"--config", path.c_str()});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->max_upload_work, 2e10);
  std::remove(path.c_str());
  for (const char* bad : {"--max-upload-work=0", "--max-upload-work=-5", "--max-upload-work=lots",
                          "--max-upload-work=inf", "--max-upload-work=nan"}) {
    auto r = Parse({bad});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("--max-upload-work="), std::string::npos) << r.status();
  }
  const std::string usage(Parse({"--help"}).status().message());
  EXPECT_NE(usage.find("--max-upload-work"), std::string::npos);
  EXPECT_NE(usage.find("KVRELAY_MAX_UPLOAD_WORK"), std::string::npos);
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

TEST(ConfigTest, SpoolCompactBytes) {
  auto c = Parse({});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->spool_compact_bytes, 64ull << 20);
  c = Parse({"--spool-compact-bytes=8MiB"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->spool_compact_bytes, 8ull << 20);
  c = Parse({}, {{"KVRELAY_SPOOL_COMPACT_BYTES", "1MiB"}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->spool_compact_bytes, 1ull << 20);
  for (const char* v : {"1048575", "0", "-1", "lots"}) {
    auto bad = Parse({"--spool-compact-bytes", v});
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << v;
    EXPECT_NE(bad.status().message().find(std::string("--spool-compact-bytes=") + v), std::string::npos)
        << bad.status();
  }
  EXPECT_NE(Parse({"--spool-compact-bytes=1048575"}).status().message().find("at least 1MiB"), std::string::npos);
  const std::string usage(Parse({"--help"}).status().message());
  EXPECT_NE(usage.find("KVRELAY_SPOOL_COMPACT_BYTES"), std::string::npos);
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

TEST(ConfigTest, SpoolCompactBytesFromAConfigFile) {
  const std::string path = ConfigFile("kvrelay_compact.json", R"({"spool_compact_bytes": "16MiB"})");
  auto c = Parse({"--config", path.c_str()});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->spool_compact_bytes, 16ull << 20);
  std::remove(path.c_str());
}

// An empty environment variable is unset; KVRELAY_METRICS_LISTEN="" keeps
// meaning metrics off, as it always has and as --metrics-listen= does.
TEST(ConfigTest, EmptyEnvironmentVariablesAreUnset) {
  auto c = Parse({}, {{"KVRELAY_LISTEN", ""}, {"KVRELAY_LOG_JSON", ""}, {"KVRELAY_WORKER_THREADS", ""},
                      {"KVRELAY_DEFAULT_POLICY", ""}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen, std::vector<std::string>{"127.0.0.1:50051"});
  EXPECT_EQ(c->metrics_listen, "0.0.0.0:9464");
  EXPECT_FALSE(c->log_json);
  EXPECT_EQ(c->default_policy, "h2o-head:k=32+obf:p=8,mode=fast");
  for (const char* off : {"", "off"}) {
    c = Parse({}, {{"KVRELAY_METRICS_LISTEN", off}});
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->metrics_listen, "") << off;
  }
}

// --listen: repeatable, TCP and Unix sockets; each source replaces the list.
TEST(ConfigTest, ListenTakesSeveralAddressesAndUnixSockets) {
  auto c = Parse({"--listen", "127.0.0.1:0", "--listen=unix:/tmp/kvrelay.sock", "--listen", "unix:rel/r.sock"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen, (std::vector<std::string>{"127.0.0.1:0", "unix:/tmp/kvrelay.sock", "unix:rel/r.sock"}));
  c = Parse({"--listen=unix:/tmp/only.sock"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen, std::vector<std::string>{"unix:/tmp/only.sock"});
  c = Parse({}, {{"KVRELAY_LISTEN", "127.0.0.1:7, unix:/tmp/a.sock,"}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen, (std::vector<std::string>{"127.0.0.1:7", "unix:/tmp/a.sock"}));
  // Flags replace the variable's list; the variable replaces the file's.
  c = Parse({"--listen", "[::1]:0"}, {{"KVRELAY_LISTEN", "127.0.0.1:7,unix:/tmp/a.sock"}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen, std::vector<std::string>{"[::1]:0"});
  const std::string list = ConfigFile("kvrelay_listen_list.json", R"({"listen": ["127.0.0.1:1", "unix:/tmp/b.sock"]})");
  c = Parse({"--config", list.c_str()});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen, (std::vector<std::string>{"127.0.0.1:1", "unix:/tmp/b.sock"}));
  c = Parse({"--config", list.c_str()}, {{"KVRELAY_LISTEN", "unix:/tmp/c.sock"}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen, std::vector<std::string>{"unix:/tmp/c.sock"});
  std::remove(list.c_str());
  const std::string str = ConfigFile("kvrelay_listen_str.json", R"({"listen": "unix:/tmp/d.sock,127.0.0.1:2"})");
  c = Parse({"--config", str.c_str()});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen, (std::vector<std::string>{"unix:/tmp/d.sock", "127.0.0.1:2"}));
  std::remove(str.c_str());
}

TEST(ConfigTest, BadListenAddressesAreRefusedWhereTheyAreGiven) {
  const std::string long_path = "unix:/" + std::string(107, 'p');  // 108 bytes: no room for the NUL
  struct Case {
    std::vector<const char*> args;
    std::map<std::string, std::string> env;
    std::string needle;
  } cases[] = {
      {{"--listen", "unix:"}, {}, "--listen=unix:: expected unix:PATH"},
      {{"--listen", "unix:/tmp/a,b.sock"}, {}, "--listen=unix:/tmp/a,b.sock: expected unix:PATH"},
      {{"--listen", "unix:/tmp/a b.sock"}, {}, "--listen=unix:/tmp/a b.sock: expected unix:PATH"},
      {{"--listen", long_path.c_str()}, {}, "--listen=" + long_path + ": expected unix:PATH with a PATH of 1..107"},
      {{"--listen", "127.0.0.1:0,127.0.0.1:1"}, {}, "--listen=127.0.0.1:0,127.0.0.1:1: expected HOST:PORT"},
      {{"--listen", "127.0.0.1:65536"}, {}, "--listen=127.0.0.1:65536: expected HOST:PORT with PORT in 0..65535"},
      {{"--listen", ":50051"}, {}, "--listen=:50051: expected HOST:PORT"},
      {{"--listen", "/tmp/r.sock"}, {}, "--listen=/tmp/r.sock: expected HOST:PORT"},
      {{"--listen", "unix:/tmp/r.sock", "--listen", "unix:/tmp/r.sock"}, {}, "--listen=unix:/tmp/r.sock: given twice"},
      {{"--listen", "127.0.0.1:0", "--listen", "127.0.0.1:0"}, {}, "--listen=127.0.0.1:0: given twice"},
      {{}, {{"KVRELAY_LISTEN", "127.0.0.1:1,127.0.0.1:1"}}, "KVRELAY_LISTEN: --listen=127.0.0.1:1: given twice"},
      {{}, {{"KVRELAY_LISTEN", "127.0.0.1:1,nope"}}, "KVRELAY_LISTEN: --listen=nope: expected HOST:PORT"},
      {{}, {{"KVRELAY_LISTEN", " , "}}, "KVRELAY_LISTEN: --listen: expected at least one address"},
  };
  for (const auto& tc : cases) {
    auto c = Parse(tc.args, tc.env);
    ASSERT_FALSE(c.ok()) << tc.needle;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find(tc.needle), std::string::npos) << c.status();
  }
  auto ok = Parse({"--listen", ("unix:/" + std::string(106, 'p')).c_str()});  // 107 bytes
  EXPECT_TRUE(ok.ok()) << ok.status();
  struct FileCase {
    const char* text;
    const char* needle;
  } files[] = {
      {R"({"listen": []})", "--listen: expected at least one address"},
      {R"({"listen": 50051})", "listen: expected a string or a list of strings"},
      {R"({"listen": ["127.0.0.1:0", 1]})", "listen: expected a string or a list of strings"},
      {R"({"listen": ["unix:/tmp/x", "unix:/tmp/x"]})", "--listen=unix:/tmp/x: given twice"},
      {R"({"listen": "unix:"})", "--listen=unix:: expected unix:PATH"},
  };
  int i = 0;
  for (const auto& tc : files) {
    const std::string path = ConfigFile("kvrelay_bad_listen_" + std::to_string(i++) + ".json", tc.text);
    auto c = Parse({"--config", path.c_str()});
    ASSERT_FALSE(c.ok()) << tc.text;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find("--config=" + path + ": "), std::string::npos) << c.status();
    EXPECT_NE(c.status().message().find(tc.needle), std::string::npos) << c.status();
    std::remove(path.c_str());
  }
}

TEST(ConfigTest, MeshDefaults) {
  auto c = Parse({});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->routes.empty());
  EXPECT_EQ(c->route_file, "");
  EXPECT_EQ(c->route_template, "");
  EXPECT_EQ(c->advertise, "");
  EXPECT_EQ(c->forward_timeout_seconds, 300);
  EXPECT_EQ(c->forward_stall_seconds, 10);
  EXPECT_TRUE(c->wire_codec_rans);
  EXPECT_EQ(c->max_outbox_bytes, 4ull << 30);
  EXPECT_EQ(c->max_outbox_bytes_per_destination, 1ull << 30);
  const std::string usage(Parse({"--help"}).status().message());
  for (const char* s : {"--route AGENT=TARGET", "KVRELAY_ROUTE:", "--route-file", "KVRELAY_ROUTE_FILE", "--route-template",
                        "KVRELAY_ROUTE_TEMPLATE", "--advertise", "KVRELAY_ADVERTISE", "--forward-timeout-seconds",
                        "KVRELAY_FORWARD_TIMEOUT_SECONDS", "--forward-stall-seconds", "KVRELAY_FORWARD_STALL_SECONDS",
                        "--wire-codec rans|none", "KVRELAY_WIRE_CODEC",
                        "--max-outbox-bytes", "KVRELAY_MAX_OUTBOX_BYTES", "--max-outbox-bytes-per-destination",
                        "KVRELAY_MAX_OUTBOX_BYTES_PER_DESTINATION", "unix:PATH", "127.0.0.1:50051"}) {
    EXPECT_NE(usage.find(s), std::string::npos) << s;
  }
}

TEST(ConfigTest, MeshFlagsEnvAndFile) {
  const std::string path = ConfigFile("kvrelay_mesh.json", R"({"route": {"planner": "10.0.0.1:50051",
      "critic": "10.0.0.2:50051"}, "route_template": "dns:///{agent}.file:50051", "advertise": "10.0.0.9:50051",
      "forward_stall_seconds": 3, "max_outbox_bytes": "2GiB"})");
  auto c = Parse({"--config", path.c_str(), "--route", "critic=dns:///critic.agents:50051", "--route=judger=unix:/r.sock",
                  "--forward-timeout-seconds", "12.5", "--max-outbox-bytes-per-destination", "512MiB"},
                 {{"KVRELAY_ROUTE", "planner=ipv4:10.0.0.3:50051; refiner=[::1]:50051"},
                  {"KVRELAY_ROUTE_TEMPLATE", "{agent}.env:50051"}, {"KVRELAY_ROUTE_FILE", "/etc/kvrelay/routes.json"},
                  {"KVRELAY_FORWARD_STALL_SECONDS", "4"}, {"KVRELAY_WIRE_CODEC", "none"}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->wire_codec_rans);
  const std::map<std::string, std::string> want = {{"planner", "ipv4:10.0.0.3:50051"},
                                                   {"critic", "dns:///critic.agents:50051"},
                                                   {"refiner", "[::1]:50051"},
                                                   {"judger", "unix:/r.sock"}};
  EXPECT_EQ(c->routes, want);  // merged per agent: flag over env over file
  EXPECT_EQ(c->route_template, "{agent}.env:50051");
  EXPECT_EQ(c->route_file, "/etc/kvrelay/routes.json");
  EXPECT_EQ(c->advertise, "10.0.0.9:50051");
  EXPECT_EQ(c->forward_timeout_seconds, 12.5);
  EXPECT_EQ(c->forward_stall_seconds, 4);
  EXPECT_EQ(c->max_outbox_bytes, 2ull << 30);
  EXPECT_EQ(c->max_outbox_bytes_per_destination, 512ull << 20);
  std::remove(path.c_str());
  const std::string list = ConfigFile("kvrelay_mesh_list.json", R"({"routes": ["a=h:1", "b.x=dns:///b:2"]})");
  c = Parse({"--config", list.c_str()});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->routes, (std::map<std::string, std::string>{{"a", "h:1"}, {"b.x", "dns:///b:2"}}));
  std::remove(list.c_str());
  // Only the path is checked at start-up: the file may appear later.
  c = Parse({"--route-file", "/nonexistent/routes.json"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->route_file, "/nonexistent/routes.json");
  c = Parse({"--max-outbox-bytes=1GiB", "--max-outbox-bytes-per-destination=1GiB"});
  ASSERT_TRUE(c.ok()) << c.status();
}

TEST(ConfigTest, BadMeshFlagsNameTheFlag) {
  const std::string long_agent = std::string(129, 'a') + "=h:1";
  struct Case {
    std::vector<const char*> args;
    std::map<std::string, std::string> env;
    std::string needle;
  } cases[] = {
      {{"--route", "planner"}, {}, "--route=planner: expected AGENT=TARGET"},
      {{"--route", "planner="}, {}, "--route=planner=: expected AGENT=TARGET"},
      {{"--route", "=h:1"}, {}, "--route==h:1: expected AGENT=TARGET with AGENT of [A-Za-z0-9._:-]{1,128}"},
      {{"--route", "pl/anner=h:1"}, {}, "--route=pl/anner=h:1: expected AGENT=TARGET with AGENT"},
      {{"--route", long_agent.c_str()}, {}, "--route=" + long_agent + ": expected AGENT=TARGET with AGENT"},
      {{"--route", "planner=h:0"}, {}, "--route=planner=h:0: address 'h:0': expected HOST:PORT with PORT in 1..65535"},
      {{"--route", "planner=h:65536"}, {}, "--route=planner=h:65536: address 'h:65536'"},
      {{"--route", "planner=h"}, {}, "--route=planner=h: address 'h'"},
      {{"--route", "planner=http://h:1"}, {}, "--route=planner=http://h:1: address"},
      {{"--route", "planner=DNS:///h:1"}, {}, "--route=planner=DNS:///h:1: address"},
      {{"--route", "planner=dns:"}, {}, "--route=planner=dns:: address 'dns:'"},
      {{}, {{"KVRELAY_ROUTE", "a=h:1;b=h"}}, "KVRELAY_ROUTE: --route=b=h: address 'h'"},
      {{"--route-file="}, {}, "--route-file=: expected a file name"},
      {{"--route-template", "dns:///relay:50051"}, {}, "--route-template=dns:///relay:50051: expected a target with"},
      {{"--route-template", "{agent}.{agent}:1"}, {}, "--route-template={agent}.{agent}:1: expected a target with"},
      {{"--route-template", "{agent}"}, {}, "--route-template={agent}: expected a target once {agent} is substituted"},
      {{"--route-template", "{agent}:99999"}, {}, "--route-template={agent}:99999: expected a target once"},
      {{}, {{"KVRELAY_ROUTE_TEMPLATE", "x.svc:1"}}, "KVRELAY_ROUTE_TEMPLATE: --route-template=x.svc:1"},
      {{"--advertise", "relay"}, {}, "--advertise=relay: address 'relay'"},
      {{}, {{"KVRELAY_ADVERTISE", "a b:1"}}, "KVRELAY_ADVERTISE: --advertise=a b:1: address"},
      {{"--forward-timeout-seconds", "0"}, {}, "--forward-timeout-seconds=0: expected seconds in [0.01, 1e9]"},
      {{"--forward-timeout-seconds", "-1"}, {}, "--forward-timeout-seconds=-1"},
      {{"--forward-stall-seconds", "0"}, {}, "--forward-stall-seconds=0: expected seconds in [0.01, 1e9]"},
      {{}, {{"KVRELAY_FORWARD_STALL_SECONDS", "nan"}}, "KVRELAY_FORWARD_STALL_SECONDS: --forward-stall-seconds=nan"},
      {{"--wire-codec", "zstd"}, {}, "--wire-codec=zstd: expected rans or none"},
      {{}, {{"KVRELAY_WIRE_CODEC", "RANS"}}, "KVRELAY_WIRE_CODEC: --wire-codec=RANS: expected rans or none"},
      {{"--max-outbox-bytes", "0"}, {}, "--max-outbox-bytes=0: expected a positive byte count"},
      {{"--max-outbox-bytes-per-destination", "lots"}, {}, "--max-outbox-bytes-per-destination=lots"},
      {{"--max-outbox-bytes", "1073741823"}, {},
       "--max-outbox-bytes-per-destination=1073741824: expected at most --max-outbox-bytes=1073741823"},
      {{"--max-outbox-bytes-per-destination", "5GiB"}, {},
       "--max-outbox-bytes-per-destination=5368709120: expected at most --max-outbox-bytes=4294967296"},
  };
  for (const auto& tc : cases) {
    auto c = Parse(tc.args, tc.env);
    ASSERT_FALSE(c.ok()) << tc.needle;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find(tc.needle), std::string::npos) << c.status();
  }
  struct FileCase {
    const char* text;
    const char* needle;
  } files[] = {
      {R"({"route": "a=h:1"})", "route: expected an object {AGENT: TARGET} or a list"},
      {R"({"route": {"a": 1}})", "route.a: expected a TARGET string"},
      {R"({"route": {"a": "h"}})", "--route=a=h: address 'h'"},
      {R"({"route": ["a"]})", "--route=a: expected AGENT=TARGET"},
      {R"({"route_template": "no-placeholder:1"})", "--route-template=no-placeholder:1"},
      {R"({"max_outbox_bytes_per_destination": "8GiB"})", "--max-outbox-bytes-per-destination=8589934592"},
  };
  int i = 0;
  for (const auto& tc : files) {
    const std::string path = ConfigFile("kvrelay_bad_mesh_" + std::to_string(i++) + ".json", tc.text);
    auto c = Parse({"--config", path.c_str()});
    ASSERT_FALSE(c.ok()) << tc.text;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find(tc.needle), std::string::npos) << c.status();
    std::remove(path.c_str());
  }
}

}  // namespace
}  // namespace kvrelay
