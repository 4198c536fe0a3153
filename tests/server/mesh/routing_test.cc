// Routing: DNS labels, the route file's format, the three sources'
// precedence, what counts as local, and the route file's reload (by
// ReloadNow and by the poller) after an atomic rename.
#include "server/mesh/routing.h"

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "tests/testlib/fake_time_source.h"

namespace kvrelay {
namespace {

using Resolved = absl::StatusOr<std::optional<std::string>>;

// Writes `content` to `path` the way ConfigMap volumes and certificate tools
// update a file: a temporary file next to it, renamed over it.
void WriteAtomically(const std::string& path, const std::string& content) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    ASSERT_TRUE(out) << tmp;
    out << content;
  }
  ASSERT_EQ(std::rename(tmp.c_str(), path.c_str()), 0) << tmp << " -> " << path;
}

std::string TempPath(const std::string& name) { return ::testing::TempDir() + "kvrelay_routing_" + name; }

void ExpectRemote(const RouteTable& t, const std::string& agent, const std::string& target) {
  Resolved r = t.Resolve(agent);
  ASSERT_TRUE(r.ok()) << agent << ": " << r.status();
  ASSERT_TRUE(r->has_value()) << agent << " resolved as local, expected " << target;
  EXPECT_EQ(**r, target) << agent;
}

void ExpectLocal(const RouteTable& t, const std::string& agent) {
  Resolved r = t.Resolve(agent);
  ASSERT_TRUE(r.ok()) << agent << ": " << r.status();
  EXPECT_FALSE(r->has_value()) << agent << " resolved to " << **r << ", expected local";
}

TEST(IsDnsLabelTest, LengthCharactersAndEnds) {
  EXPECT_TRUE(IsDnsLabel("a"));
  EXPECT_TRUE(IsDnsLabel("planner"));
  EXPECT_TRUE(IsDnsLabel("Agent-7"));
  EXPECT_TRUE(IsDnsLabel("7agent"));  // RFC 1123 allows a leading digit
  EXPECT_TRUE(IsDnsLabel("a-b-c"));
  EXPECT_TRUE(IsDnsLabel(std::string(63, 'x')));
  EXPECT_FALSE(IsDnsLabel(std::string(64, 'x')));
  EXPECT_TRUE(IsDnsLabel("a" + std::string(61, '-') + "b"));
  EXPECT_FALSE(IsDnsLabel(""));
  EXPECT_FALSE(IsDnsLabel("-a"));
  EXPECT_FALSE(IsDnsLabel("a-"));
  EXPECT_FALSE(IsDnsLabel("-"));
  EXPECT_FALSE(IsDnsLabel("a_b"));
  EXPECT_FALSE(IsDnsLabel("a.b"));
  EXPECT_FALSE(IsDnsLabel("a:b"));
  EXPECT_FALSE(IsDnsLabel("a b"));
}

TEST(ParseRouteFileTest, AcceptsAnObjectOfTargets) {
  auto r = ParseRouteFile(R"({"planner": "10.0.0.1:50051", "critic": "dns:///critic.svc:50051"})", "SRC");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->size(), 2u);
  EXPECT_EQ(r->at("planner"), "10.0.0.1:50051");
  EXPECT_EQ(r->at("critic"), "dns:///critic.svc:50051");
  // A key twice in a nested value is not a route key (and not refused as one).
  EXPECT_FALSE(ParseRouteFile(R"({"a": {"x": 1, "x": 2}})", "SRC").status().message().find("twice") !=
               absl::string_view::npos);
  auto empty = ParseRouteFile("{}", "SRC");
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_TRUE(empty->empty());
}

TEST(ParseRouteFileTest, RefusalsNameTheSourceAndTheKey) {
  struct Case {
    const char* content;
    const char* want;  // in the message, after "SRC: "
  };
  for (const Case& c : {
           Case{"[]", "not a JSON object"},
           Case{"\"a\"", "not a JSON object"},
           Case{"{not json", "not a JSON object"},
           Case{"", "not a JSON object"},
           Case{R"({"a": 5})", "key 'a': number, expected a target string"},
           Case{R"({"a": {"t": "h:1"}})", "key 'a': object, expected a target string"},
           Case{R"({"a": null})", "key 'a': null, expected a target string"},
           Case{R"({"ok": "h:1", "bad id": "h:1"})", "key 'bad id': 'bad id', expected [A-Za-z0-9._:-]{1,128}"},
           Case{R"({"": "h:1"})", "key '': empty, expected [A-Za-z0-9._:-]{1,128}"},
           Case{R"({"a": "nohostport"})", "key 'a': address 'nohostport': expected HOST:PORT"},
           Case{R"({"a": "h:0"})", "key 'a': address 'h:0': expected HOST:PORT with PORT in 1..65535"},
           Case{R"({"a": ""})", "key 'a': address '': expected HOST:PORT"},
           Case{R"({"a": "h:1", "b": "h:2", "a": "h:3"})", "key 'a': given twice, expected each agent once"},
       }) {
    auto r = ParseRouteFile(c.content, "SRC");
    ASSERT_FALSE(r.ok()) << c.content;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.content;
    EXPECT_TRUE(absl::StartsWith(r.status().message(), "SRC: ")) << c.content << " -> " << r.status();
    EXPECT_TRUE(absl::StrContains(r.status().message(), std::string("SRC: ") + c.want))
        << c.content << " -> " << r.status();
  }
}

TEST(RouteTableTest, NoSourceMeansEveryAgentIsLocal) {
  auto t = RouteTable::Create(RouteOptions{});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_FALSE((*t)->enabled());
  ExpectLocal(**t, "anyone");
  ExpectLocal(**t, "not_a_dns_label");  // no template: nothing to check
}

TEST(RouteTableTest, StaticRoutesBeatTheFileWhichBeatsTheTemplate) {
  const std::string path = TempPath("precedence.json");
  WriteAtomically(path, R"({"a": "file-host:2", "b": "file-host:2", "odd_name": "file-host:2"})");
  RouteOptions o;
  o.routes = {{"a", "static-host:1"}};
  o.route_file = path;
  o.route_template = "dns:///{agent}.agents.svc:3";
  o.poll_interval = std::chrono::hours(1);
  auto t = RouteTable::Create(o);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE((*t)->enabled());
  EXPECT_EQ((*t)->file_loads(), 1u);
  ExpectRemote(**t, "a", "static-host:1");
  ExpectRemote(**t, "b", "file-host:2");
  ExpectRemote(**t, "c", "dns:///c.agents.svc:3");
  // The template is not consulted for a name another source routes.
  ExpectRemote(**t, "odd_name", "file-host:2");
  std::remove(path.c_str());
}

TEST(RouteTableTest, ARouteToThisRelaysOwnTargetIsLocal) {
  RouteOptions o;
  o.routes = {{"self-static", "me:50051"}, {"other", "them:50051"}};
  o.route_template = "dns:///{agent}.svc:50051";
  o.advertise = "dns:///me.svc:50051";
  auto t = RouteTable::Create(o);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->advertise(), "dns:///me.svc:50051");
  ExpectLocal(**t, "me");  // the template names this relay
  ExpectRemote(**t, "other", "them:50051");
  ExpectRemote(**t, "you", "dns:///you.svc:50051");
  // Compared as strings: another spelling of the same address is remote.
  ExpectRemote(**t, "self-static", "me:50051");
  RouteOptions o2;
  o2.routes = {{"self-static", "me:50051"}};
  o2.advertise = "me:50051";
  auto t2 = RouteTable::Create(o2);
  ASSERT_TRUE(t2.ok()) << t2.status();
  ExpectLocal(**t2, "self-static");
}

TEST(RouteTableTest, AgentsWithoutARouteAreLocal) {
  RouteOptions o;
  o.routes = {{"far", "far-host:1"}};
  auto t = RouteTable::Create(o);
  ASSERT_TRUE(t.ok()) << t.status();
  ExpectRemote(**t, "far", "far-host:1");
  ExpectLocal(**t, "near");
  ExpectLocal(**t, "near_too");
}

TEST(RouteTableTest, TheTemplateRefusesANonDnsLabelNamingTheField) {
  RouteOptions o;
  o.route_template = "dns:///{agent}.svc:50051";
  auto t = RouteTable::Create(o);
  ASSERT_TRUE(t.ok()) << t.status();
  for (const std::string& agent : std::vector<std::string>{"a_b", "a.b", "-a", "a-", std::string(64, 'x')}) {
    Resolved r = (*t)->Resolve(agent, "header.recipients[2]");
    ASSERT_FALSE(r.ok()) << agent;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << agent;
    EXPECT_TRUE(absl::StartsWith(r.status().message(), "header.recipients[2]: '" + agent + "' is not a DNS label"))
        << r.status();
    EXPECT_TRUE(absl::StrContains(r.status().message(), "--route-template=dns:///{agent}.svc:50051")) << r.status();
  }
  Resolved dflt = (*t)->Resolve("a_b");
  EXPECT_TRUE(absl::StartsWith(dflt.status().message(), "recipient: ")) << dflt.status();
  ExpectRemote(**t, std::string(63, 'x'), "dns:///" + std::string(63, 'x') + ".svc:50051");
}

TEST(RouteTableTest, AMissingOrBadFileAtStartIsAnError) {
  RouteOptions o;
  o.route_file = TempPath("does_not_exist.json");
  std::remove(o.route_file.c_str());
  auto t = RouteTable::Create(o);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound) << t.status();
  EXPECT_TRUE(absl::StrContains(t.status().message(), "--route-file=" + o.route_file)) << t.status();

  o.route_file = TempPath("bad_at_start.json");
  WriteAtomically(o.route_file, R"({"a": 1})");
  t = RouteTable::Create(o);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
  EXPECT_TRUE(absl::StrContains(t.status().message(), "--route-file=" + o.route_file + ": key 'a'")) << t.status();
  std::remove(o.route_file.c_str());
}

// ReloadNow sees a file replaced by rename; a bad file keeps the last good
// table and ReloadNow returns why.
TEST(RouteTableTest, ReloadNowSeesARenamedFileAndKeepsTheLastGoodTable) {
  RouteOptions o;
  o.route_file = TempPath("reload.json");
  o.poll_interval = std::chrono::hours(1);  // only ReloadNow reads the file here
  WriteAtomically(o.route_file, R"({"a": "one:1"})");
  auto created = RouteTable::Create(o);
  ASSERT_TRUE(created.ok()) << created.status();
  RouteTable& t = **created;
  ExpectRemote(t, "a", "one:1");
  ExpectLocal(t, "b");
  EXPECT_TRUE(t.ReloadNow().ok());  // unchanged
  EXPECT_EQ(t.file_loads(), 1u);

  WriteAtomically(o.route_file, R"({"a": "two:2", "b": "two:2"})");
  ASSERT_TRUE(t.ReloadNow().ok());
  EXPECT_EQ(t.file_loads(), 2u);
  ExpectRemote(t, "a", "two:2");
  ExpectRemote(t, "b", "two:2");

  WriteAtomically(o.route_file, R"({"a": "three:3", "b": 7})");
  absl::Status bad = t.ReloadNow();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
  EXPECT_TRUE(absl::StrContains(bad.message(), "--route-file=" + o.route_file + ": key 'b': number")) << bad;
  EXPECT_EQ(t.file_loads(), 2u);
  ExpectRemote(t, "a", "two:2");  // the last good table, whole
  ExpectRemote(t, "b", "two:2");

  std::remove(o.route_file.c_str());
  absl::Status gone = t.ReloadNow();
  EXPECT_EQ(gone.code(), absl::StatusCode::kNotFound) << gone;
  ExpectRemote(t, "a", "two:2");

  WriteAtomically(o.route_file, R"({})");
  ASSERT_TRUE(t.ReloadNow().ok());
  EXPECT_EQ(t.file_loads(), 3u);
  ExpectLocal(t, "a");
  ExpectLocal(t, "b");
  std::remove(o.route_file.c_str());
}

// The poller picks up a renamed file by itself, and keeps serving the last
// good table through a bad one. Its time is a fake clock: each tick is one
// Advance, and the test waits until the poller has read the file and waits
// again, never for a fixed time.
TEST(RouteTableTest, ThePollerReloadsARenamedFile) {
  FakeTimeSource clock;
  RouteOptions o;
  o.route_file = TempPath("poll.json");
  o.poll_interval = std::chrono::milliseconds(20);
  o.time = &clock;
  WriteAtomically(o.route_file, R"({"a": "one:1"})");
  auto created = RouteTable::Create(o);
  ASSERT_TRUE(created.ok()) << created.status();
  RouteTable& t = **created;
  // One poll: the poller's tick fires, it reads the file and waits again.
  auto poll = [&] {
    const uint64_t before = t.file_polls();
    ASSERT_TRUE(clock.AwaitWaiters(1)) << "the poller is not waiting for its tick";
    clock.Advance(o.poll_interval);
    ASSERT_TRUE(clock.AwaitWaiters(1)) << "the poller did not come back to wait";
    ASSERT_EQ(t.file_polls(), before + 1);
  };
  ExpectRemote(t, "a", "one:1");
  // Less than an interval: no poll.
  ASSERT_TRUE(clock.AwaitWaiters(1));
  clock.Advance(o.poll_interval / 2);
  ASSERT_TRUE(clock.AwaitWaiters(1));
  EXPECT_EQ(t.file_polls(), 0u);

  WriteAtomically(o.route_file, R"({"a": "two:2"})");
  clock.Advance(o.poll_interval / 2);  // the rest of the first interval
  ASSERT_TRUE(clock.AwaitWaiters(1));
  ASSERT_EQ(t.file_polls(), 1u);
  ExpectRemote(t, "a", "two:2");
  EXPECT_EQ(t.file_loads(), 2u);

  WriteAtomically(o.route_file, "{broken");
  for (int i = 0; i < 10; ++i) poll();
  EXPECT_EQ(t.file_polls(), 11u);  // the ten polls ran, and none applied the bad file
  EXPECT_EQ(t.file_loads(), 2u);
  ExpectRemote(t, "a", "two:2");

  WriteAtomically(o.route_file, R"({"a": "three:3"})");
  poll();
  ExpectRemote(t, "a", "three:3");
  EXPECT_EQ(t.file_loads(), 3u);
  std::remove(o.route_file.c_str());
}

}  // namespace
}  // namespace kvrelay
