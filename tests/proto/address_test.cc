#include "proto/address.h"

#include <string>

#include "gtest/gtest.h"

namespace kvrelay {
namespace {

TEST(CheckGrpcTargetTest, TakesHostPortAndResolverTargets) {
  for (const char* ok : {"127.0.0.1:50051", "relay:1", "relay.agents.svc:65535", "[::1]:50051", "dns:///relay:50051",
                         "dns:relay:50051", "unix:/run/kvrelay/relay.sock", "unix:relay.sock", "unix:///tmp/r.sock",
                         "unix-abstract:kvrelay", "ipv4:10.0.0.1:50051,10.0.0.2:50051", "ipv6:[::1]:50051",
                         "vsock:3:50051", "xds:///relay", "google-c2p:///relay"}) {
    EXPECT_TRUE(CheckGrpcTarget(ok).ok()) << ok;
  }
}

TEST(CheckGrpcTargetTest, RefusesWhatGrpcWouldMisread) {
  // gRPC would dial port 1 (65537 modulo 65536), 443 for a missing port, and
  // look DNS:/// and http:// up as host names.
  for (const char* bad : {"", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:65537", ":50051", "::1:50051", "[::1]50051",
                          "[::1", "relay:port", "a b:1", "a,b:1", "http://relay:1", "DNS:///relay:1", "Unix:/r.sock",
                          "unix:", "dns:", "ipv4:", "/run/kvrelay/relay.sock"}) {
    const absl::Status st = CheckGrpcTarget(bad);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(st.message().find(std::string("address '") + bad + "': expected HOST:PORT with PORT in 1..65535"),
              std::string::npos)
        << st;
  }
}

TEST(AddressTest, SplitHostPortKeepsBracketsAndChecksThePort) {
  std::string host;
  int port = -1;
  ASSERT_TRUE(SplitHostPort("[::1]:0", &host, &port).ok());
  EXPECT_EQ(host, "[::1]");
  EXPECT_EQ(port, 0);
  ASSERT_TRUE(SplitHostPort("relay-b:50051", &host, &port).ok());
  EXPECT_EQ(host, "relay-b");
  EXPECT_EQ(port, 50051);
  EXPECT_FALSE(SplitHostPort("localhost", &host, &port).ok());
  EXPECT_FALSE(SplitHostPort("[::1]50051", &host, &port).ok());
  EXPECT_FALSE(SplitHostPort("a:65536", &host, &port).ok());
  EXPECT_FALSE(SplitHostPort("a:-1", &host, &port).ok());
}

TEST(AddressTest, LoopbackHosts) {
  for (const char* h : {"localhost", "::1", "[::1]", "127.0.0.1", "127.255.3.4"}) EXPECT_TRUE(IsLoopbackHost(h)) << h;
  for (const char* h : {"0.0.0.0", "[::]", "10.0.0.1", "127.0.0", "127.0.0.256", "127.a.0.1", "localhost.evil", ""}) {
    EXPECT_FALSE(IsLoopbackHost(h)) << h;
  }
}

TEST(AddressTest, TheFieldPrefixesTheError) {
  EXPECT_TRUE(CheckGrpcTarget("relay:1", "--route=a=relay:1").ok());
  const absl::Status s = CheckGrpcTarget("relay", "--route=a=relay");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message().substr(0, 27), "--route=a=relay: address 'r");
}

}  // namespace
}  // namespace kvrelay
