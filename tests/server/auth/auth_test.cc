// The pure parts of server/auth/auth.h: tokens files, identity patterns, target
// hosts; and the security rules of the configuration. The live checks
// (handshakes, tokens on calls, authorization) are in test_security.py.
#include "server/auth/auth.h"

#include <string>
#include <vector>

#include "core/token.h"
#include "absl/strings/escaping.h"
#include "gtest/gtest.h"
#include "server/config/config.h"

namespace kvrelay {
namespace {

std::string Digest(const std::string& token) { return "sha256:" + Sha256Hex(token); }

TEST(TokensFileTest, ParsesLinesCommentsAndBlanks) {
  const std::string content = "# agents\n\nplanner " + Digest("p") + "   # the planner\n\tcritic\t" +
                              Digest("c") + "\r\n";
  absl::StatusOr<std::vector<TokenEntry>> t = ParseTokensFile(content, "--tokens-file=f");
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->size(), 2u);
  EXPECT_EQ((*t)[0].agent, "planner");
  EXPECT_EQ((*t)[1].agent, "critic");
  const std::string want = absl::HexStringToBytes(Sha256Hex("c"));
  EXPECT_EQ(std::string((*t)[1].digest.begin(), (*t)[1].digest.end()), want);
}

TEST(TokensFileTest, BadLinesNameTheLineAndWhatWasExpected) {
  const struct {
    std::string content, says;
  } cases[] = {
      {"planner\n", "line 1: 1 fields"},
      {"# x\nplanner sha256:ab cd\n", "line 2: 3 fields"},
      {"planner md5:" + std::string(64, 'a') + "\n", "does not start with 'sha256:'"},
      {"planner sha256:" + std::string(63, 'a') + "\n", "63 characters, not 64 hex digits"},
      {"planner sha256:" + std::string(63, 'a') + "g\n", "not 64 hex digits"},
      {"plan/ner " + Digest("x") + "\n", "the agent is not [A-Za-z0-9._:-]{1,128}"},
      {"planner " + Digest("x") + "\ncritic " + Digest("x") + "\n", "line 2: the digest is also agent 'planner''s"},
  };
  for (const auto& c : cases) {
    absl::StatusOr<std::vector<TokenEntry>> t = ParseTokensFile(c.content, "--tokens-file=f");
    ASSERT_FALSE(t.ok()) << c.content;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find(c.says), absl::string_view::npos) << t.status();
    EXPECT_NE(t.status().message().find("--tokens-file=f: "), absl::string_view::npos) << t.status();
    EXPECT_NE(t.status().message().find("expected 'AGENT sha256:HEX'"), absl::string_view::npos);
  }
}

TEST(IdentityTest, PatternsMatchExactlyOrOneMoreLabel) {
  EXPECT_TRUE(IdentityMatches("relay-0.kvrelay.svc", "relay-0.kvrelay.svc"));
  EXPECT_TRUE(IdentityMatches("relay-0.kvrelay.svc", "RELAY-0.Kvrelay.svc"));  // DNS: case-insensitive
  EXPECT_FALSE(IdentityMatches("relay-0.kvrelay.svc", "relay-1.kvrelay.svc"));
  EXPECT_TRUE(IdentityMatches("*.kvrelay.svc", "relay-1.kvrelay.svc"));
  EXPECT_FALSE(IdentityMatches("*.kvrelay.svc", "kvrelay.svc"));         // the label is required
  EXPECT_FALSE(IdentityMatches("*.kvrelay.svc", ".kvrelay.svc"));
  EXPECT_FALSE(IdentityMatches("*.kvrelay.svc", "a.relay-1.kvrelay.svc"));  // one label only
  EXPECT_FALSE(IdentityMatches("*.kvrelay.svc", "evil-kvrelay.svc"));
  EXPECT_TRUE(IdentityMatches("spiffe://td/ns/a/sa/kvrelay", "spiffe://td/ns/a/sa/kvrelay"));
  EXPECT_FALSE(IdentityMatches("spiffe://td/ns/a/sa/kvrelay", "spiffe://td/ns/a/sa/KVRELAY"));  // URIs: exact
  EXPECT_FALSE(IdentityMatches("*.td", "spiffe://td"));
}

TEST(IdentityTest, BadPatternsAreRefused) {
  for (const char* ok : {"relay.svc", "*.kvrelay.svc", "spiffe://td/ns/a", "10.0.0.7"}) {
    EXPECT_TRUE(CheckIdentityPattern(ok).ok()) << ok;
  }
  for (const char* bad : {"", "*", "*.", "a*.b", "*.*.b", "*..b", "x y", "*.b*"}) {
    absl::Status s = CheckIdentityPattern(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("expected a certificate SAN"), absl::string_view::npos) << s;
  }
}

TEST(IdentityTest, TargetHostIsWhatACertificateNames) {
  EXPECT_EQ(TargetHost("relay-0.kvrelay.svc:50051"), "relay-0.kvrelay.svc");
  EXPECT_EQ(TargetHost("dns:///relay-0.kvrelay.svc:50051"), "relay-0.kvrelay.svc");
  EXPECT_EQ(TargetHost("dns://8.8.8.8/relay-0.kvrelay.svc:50051"), "relay-0.kvrelay.svc");
  EXPECT_EQ(TargetHost("ipv4:10.0.0.7:50051"), "10.0.0.7");
  EXPECT_EQ(TargetHost("ipv4:10.0.0.7:50051,10.0.0.8:50051"), "10.0.0.7");
  EXPECT_EQ(TargetHost("[::1]:50051"), "::1");
  EXPECT_EQ(TargetHost("ipv6:[fd00::7]:50051"), "fd00::7");
  EXPECT_EQ(TargetHost("unix:/run/kvrelay.sock"), "");
  EXPECT_EQ(TargetHost("relay"), "relay");
  EXPECT_EQ(TargetHost("::1"), "::1");  // gRPC's verifier passes the bare host
  EXPECT_EQ(TargetHost("fd00::7"), "fd00::7");
}

TEST(CallerTest, WhoMayActAsWhom) {
  Caller any;
  EXPECT_TRUE(any.MayActAs("planner"));
  Caller agent;
  agent.kind = Caller::Kind::kAgent;
  agent.agent = "critic";
  EXPECT_TRUE(agent.MayActAs("critic"));
  EXPECT_FALSE(agent.MayActAs("planner"));
  EXPECT_EQ(agent.Describe(), "agent \"critic\"");
  Caller peer;
  peer.kind = Caller::Kind::kPeer;
  EXPECT_FALSE(peer.MayActAs("critic"));  // a relay is no agent
  EXPECT_TRUE(peer.PeerIsHost("anything"));  // no TLS: nothing to check against
  peer.identity = "relay-b.mesh";
  peer.dns = {"relay-b.mesh"};
  peer.ips = {"10.0.0.12", "fd00::7"};
  peer.uris = {"spiffe://td/relay-b"};
  peer.sans = {"relay-b.mesh", "10.0.0.12", "fd00::7", "spiffe://td/relay-b", "ops@relay-c.mesh"};
  EXPECT_TRUE(peer.PeerIsHost("relay-b.mesh"));
  EXPECT_TRUE(peer.PeerIsHost("10.0.0.12"));
  EXPECT_TRUE(peer.PeerIsHost("fd00:0:0::7"));  // the same address spelt another way
  EXPECT_FALSE(peer.PeerIsHost("relay-a.mesh"));
  EXPECT_FALSE(peer.PeerIsHost("relay-c.mesh"));  // an email SAN names no host
  EXPECT_FALSE(peer.PeerIsHost("spiffe://td/relay-b"));
  EXPECT_FALSE(peer.PeerIsHost(""));
  // Patterns match by SAN type.
  EXPECT_EQ(MatchingIdentity("*.mesh", peer), "relay-b.mesh");
  EXPECT_EQ(MatchingIdentity("fd00::0:7", peer), "fd00::7");
  EXPECT_EQ(MatchingIdentity("spiffe://td/relay-b", peer), "spiffe://td/relay-b");
  EXPECT_EQ(MatchingIdentity("*.relay-c.mesh", peer), "");  // not the email's domain
  Caller mail;
  mail.kind = Caller::Kind::kPeer;
  mail.sans = {"x@y.mesh"};
  EXPECT_EQ(MatchingIdentity("*.mesh", mail), "");
  EXPECT_EQ(peer.Describe(), "peer relay \"relay-b.mesh\"");
}

absl::StatusOr<ServerConfig> Parse(std::vector<const char*> args) {
  args.insert(args.begin(), "kvrelay-server");
  return ParseServerConfig(static_cast<int>(args.size()), args.data(), [](const char*) { return nullptr; });
}

TEST(SecurityConfigTest, TheRulesBetweenTheFlags) {
  const struct {
    std::vector<const char*> args;
    const char* says;
  } refused[] = {
      {{"--listen", "0.0.0.0:50051"}, "--listen=0.0.0.0:50051: plaintext on a non-loopback address"},
      {{"--listen", "10.1.2.3:1"}, "or --insecure"},
      {{"--local-listen", "0.0.0.0:1"}, "--local-listen=0.0.0.0:1: expected a loopback HOST:PORT"},
      {{"--local-listen", "127.0.0.1:1", "--listen", "127.0.0.1:1"}, "also given as --listen"},
      {{"--tls-cert", "c"}, "--tls-cert: expected together with --tls-key"},
      {{"--tls-key", "k"}, "--tls-key: expected together with --tls-cert"},
      {{"--tls-client-ca", "ca"}, "--tls-client-ca: needs --tls-cert FILE and --tls-key FILE"},
      {{"--peer-identity", "*.x"}, "--peer-identity: needs --tls-cert"},
      {{"--tls-cert", "c", "--tls-key", "k", "--route-template", "{agent}.x:1"}, "add --tls-peer-ca FILE"},
      {{"--local-auth", "token"}, "--local-auth=token: needs --tokens-file"},
      {{"--local-auth", "yes"}, "--local-auth=yes: expected pod or token"},
      {{"--peer-identity", "a*.x", "--tls-cert", "c", "--tls-key", "k"}, "--peer-identity='a*.x'"},
      {{"--peer-identity", "*.x", "--tls-cert", "c", "--tls-key", "k"}, "--peer-identity: needs --tls-client-ca"},
  };
  for (const auto& r : refused) {
    absl::StatusOr<ServerConfig> c = Parse(r.args);
    ASSERT_FALSE(c.ok()) << r.says;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find(r.says), absl::string_view::npos) << c.status();
  }
  for (const std::vector<const char*>& ok : std::vector<std::vector<const char*>>{
           {"--listen", "0.0.0.0:50051", "--insecure"},
           {"--listen", "localhost:1", "--listen", "[::1]:2", "--listen", "127.9.9.9:3"},
           {"--listen", "0.0.0.0:1", "--tls-cert", "c", "--tls-key", "k", "--route", "a=b:1", "--tls-peer-ca", "p"},
           {"--local-listen", "unix:/tmp/x.sock", "--local-listen", "[::1]:5", "--tokens-file", "t",
            "--local-auth", "token"},
       }) {
    absl::StatusOr<ServerConfig> c = Parse(ok);
    EXPECT_TRUE(c.ok()) << c.status();
  }
  absl::StatusOr<ServerConfig> c = Parse({"--listen", "0.0.0.0:1", "--insecure"});
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(ServesPlaintextOffLoopback(*c));
  c = Parse({"--listen", "0.0.0.0:1", "--tls-cert", "c", "--tls-key", "k"});
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(ServesPlaintextOffLoopback(*c));
  c = Parse({"--listen", "127.0.0.1:1", "--listen", "unix:/tmp/y.sock"});
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(ServesPlaintextOffLoopback(*c));
}

}  // namespace
}  // namespace kvrelay
