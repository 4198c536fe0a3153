// One agent of the mesh benchmark (bench/mesh_bench.py): each mode is one
// side of one transfer, run as its own process, possibly inside a network
// namespace. Times are CLOCK_REALTIME in ns, which every network namespace
// of one kernel shares, so times printed by processes in different
// namespaces compare. CPU seconds are getrusage(RUSAGE_SELF), user + system,
// all threads, over the timed call only.
//
//   mesh_bench_agent publish --addr A --session S [--from a] [--to b] [--policy SPEC] [turn flags]
//       Builds the synthetic turn (before the clock starts), connects, then
//       publishes it without a copy. Prints
//       "publish start_ns= end_ns= message_id= full_bytes= sent_bytes= received_bytes= compress_s= cpu_s=".
//   mesh_bench_agent fetch --addr B --session S [--agent b] [--wait-seconds 120] [--no-ack]
//       Connects, prints "waiting", then fetches one message and acks it.
//       Prints "fetch done_ns= message_id= held_bytes= sent_bytes= full_bytes= cpu_s=";
//       done_ns is when the whole message is held (reassembled and verified).
//   mesh_bench_agent raw-recv --listen HOST:PORT [--bytes N] [--timeout-seconds 120]
//       Prints "listening port=P", accepts one connection, reads until EOF
//       (or N bytes) into a pre-touched buffer, prints "raw-recv done_ns= bytes= cpu_s=".
//   mesh_bench_agent raw-send --to HOST:PORT [--raw-content kv|turn] [turn flags]
//       Builds the turn, connects, then sends its bytes (kv: every K and V
//       tensor, the full KV a recipient needs; turn: the whole turn, scores
//       included, in upload order). Prints "raw-send start_ns= end_ns= bytes= cpu_s=".
//   mesh_bench_agent local-hop --addr unix:PATH [--reps 5] [--policy full] [turn flags]
//       The local hop: per rep, a raw TCP loopback send of the bytes a
//       publish uploads (the whole turn, in upload order, into a pre-touched
//       buffer read by a thread of this process), then a publish of the
//       same turn to --addr. Prints one "local-hop rep=" line per rep
//       (raw_ms, upload_ms: until the last chunk is handed to gRPC,
//       publish_ms: until Publish returns, i.e. the relay holds and
//       committed it) and a "local-hop median" line.
//   mesh_bench_agent close --addr A --session S
//       Closes a session (prints "close freed=N").
//
// Turn flags: --layers 40 --kv-heads 8 --score-heads 40 --head-dim 128
// --prompt 512 --gen 40 --seed 14 (BF16; the Qwen3-14B turn by default).
// Exit status: 0 ok, 1 a failed call (message on stderr), 2 usage error.
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/types/span.h"
#include "core/heap_retain.h"
#include "client/relay_client.h"
#include "core/format/synthetic.h"

namespace kvrelay {
namespace {

constexpr int kUsageError = 2;

constexpr char kUsage[] = R"(usage: mesh_bench_agent MODE [flags]
  publish   --addr A --session S [--from a] [--to b] [--policy SPEC] [turn flags]
  fetch     --addr B --session S [--agent b] [--wait-seconds 120] [--no-ack]
  raw-recv  --listen HOST:PORT [--bytes N] [--timeout-seconds 120]
  raw-send  --to HOST:PORT [--raw-content kv|turn] [turn flags]
  local-hop --addr unix:PATH [--reps 5] [--policy full] [turn flags]
  close     --addr A --session S
turn flags: --layers 40 --kv-heads 8 --score-heads 40 --head-dim 128 --prompt 512 --gen 40 --seed 14
)";

int64_t RealtimeNs() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

double CpuSeconds() {
  rusage u;
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_utime.tv_usec * 1e-6 + u.ru_stime.tv_sec + u.ru_stime.tv_usec * 1e-6;
}

double Ms(int64_t ns) { return ns / 1e6; }

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int Fail(const std::string& what) {
  std::fprintf(stderr, "mesh_bench_agent: %s\n", what.c_str());
  return 1;
}

// --flag value pairs (and bare switches listed in `switches`).
struct Flags {
  std::map<std::string, std::string> values;
  std::string error;

  std::string Get(const std::string& name, const std::string& dflt = "") const {
    auto it = values.find(name);
    return it == values.end() ? dflt : it->second;
  }
  bool Has(const std::string& name) const { return values.count(name) > 0; }
};

Flags ParseFlags(int argc, char** argv, int first, const std::vector<std::string>& switches) {
  Flags f;
  for (int i = first; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--", 0) != 0) {
      f.error = "unexpected argument " + a;
      return f;
    }
    const std::string name = a.substr(2);
    if (std::find(switches.begin(), switches.end(), name) != switches.end()) {
      f.values[name] = "true";
      continue;
    }
    if (i + 1 >= argc) {
      f.error = a + ": value expected";
      return f;
    }
    f.values[name] = argv[++i];
  }
  return f;
}

// Parses a positive integer flag; false (with `error` set) when it is not one.
bool IntFlag(const Flags& f, const std::string& name, int64_t dflt, int64_t* out, std::string* error) {
  const std::string v = f.Get(name);
  if (v.empty()) {
    *out = dflt;
    return true;
  }
  char* end = nullptr;
  const long long n = std::strtoll(v.c_str(), &end, 10);
  if (end == v.c_str() || *end != '\0' || n < 0) {
    *error = "--" + name + ": non-negative integer expected, found " + v;
    return false;
  }
  *out = n;
  return true;
}

absl::StatusOr<Turn> MakeTurn(const Flags& f) {
  SyntheticTurnOptions o = Qwen3_14BTurn();
  o.seed = 14;
  std::string err;
  int64_t v;
  const std::pair<const char*, int*> ints[] = {{"layers", &o.layers},     {"kv-heads", &o.kv_heads},
                                              {"score-heads", &o.score_heads}, {"head-dim", &o.head_dim},
                                              {"prompt", &o.n_prompt},    {"gen", &o.n_gen}};
  for (const auto& [name, field] : ints) {
    if (!IntFlag(f, name, *field, &v, &err)) return absl::InvalidArgumentError(err);
    *field = static_cast<int>(v);
  }
  if (!IntFlag(f, "seed", 14, &v, &err)) return absl::InvalidArgumentError(err);
  o.seed = static_cast<uint64_t>(v);
  return MakeSyntheticTurn(o);
}

// The turn's tensors in upload order (relay.proto): per layer prompt K/V,
// gen K/V, scores (f32), history K/V/pos when present.
std::vector<absl::Span<const uint8_t>> TurnBuffers(const Turn& turn, bool kv_only) {
  std::vector<absl::Span<const uint8_t>> out;
  for (const TurnLayer& l : turn.layers) {
    out.push_back(l.prompt_k.bytes());
    out.push_back(l.prompt_v.bytes());
    out.push_back(l.gen_k.bytes());
    out.push_back(l.gen_v.bytes());
    if (!kv_only) {
      out.push_back({reinterpret_cast<const uint8_t*>(l.scores.data.data()), l.scores.data.size() * sizeof(float)});
    }
    if (l.history_k.byte_size() > 0) {
      out.push_back(l.history_k.bytes());
      out.push_back(l.history_v.bytes());
      if (!kv_only) {
        out.push_back({reinterpret_cast<const uint8_t*>(l.history_pos.data.data()),
                       l.history_pos.data.size() * sizeof(int32_t)});
      }
    }
  }
  return out;
}

uint64_t TotalBytes(const std::vector<absl::Span<const uint8_t>>& bufs) {
  uint64_t n = 0;
  for (const auto& b : bufs) n += b.size();
  return n;
}

bool SendAll(int fd, const std::vector<absl::Span<const uint8_t>>& bufs) {
  for (const auto& b : bufs) {
    size_t off = 0;
    while (off < b.size()) {
      const ssize_t n = send(fd, b.data() + off, b.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return false;
      off += static_cast<size_t>(n);
    }
  }
  return true;
}

// HOST:PORT (IPv4 or a name) into a sockaddr; false when it is not one.
bool Resolve(const std::string& hostport, sockaddr_storage* ss, socklen_t* len) {
  const size_t colon = hostport.rfind(':');
  if (colon == std::string::npos) return false;
  const std::string host = hostport.substr(0, colon), port = hostport.substr(colon + 1);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | AI_PASSIVE;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &res) != 0 || res == nullptr) {
    return false;
  }
  std::memcpy(ss, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  freeaddrinfo(res);
  return true;
}

std::string Accounts(const Accounting& a) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "full_bytes=%llu sent_bytes=%llu received_bytes=%llu compress_s=%.6f",
                static_cast<unsigned long long>(a.full_bytes), static_cast<unsigned long long>(a.sent_bytes),
                static_cast<unsigned long long>(a.received_bytes), a.compress_seconds);
  return buf;
}

absl::StatusOr<std::unique_ptr<RelayClient>> ConnectRelay(const std::string& addr) {
  if (addr.empty()) return absl::InvalidArgumentError("--addr: relay address expected");
  if (absl::Status s = CheckRelayAddress(addr); !s.ok()) return s;
  auto client = RelayClient::Connect(addr);
  // Connect the channel before any clock starts (Health is tiny).
  absl::StatusOr<HealthStatus> h = client->Health("", std::chrono::seconds(20));
  if (!h.ok()) return h.status();
  return client;
}

// ------------------------------------------------------------------- modes

int Publish(const Flags& f) {
  absl::StatusOr<Turn> turn = MakeTurn(f);
  if (!turn.ok()) return Fail("turn: " + turn.status().ToString());
  auto shared = std::make_shared<const Turn>(*std::move(turn));
  auto client = ConnectRelay(f.Get("addr"));
  if (!client.ok()) return Fail("connect " + f.Get("addr") + ": " + client.status().ToString());
  PublishOptions p;
  p.session = f.Get("session");
  p.sender = f.Get("from", "a");
  p.recipients = {f.Get("to", "b")};
  p.policy = f.Get("policy", "full");
  p.retries = 0;
  const double cpu0 = CpuSeconds();
  const int64_t t0 = RealtimeNs();
  absl::StatusOr<PublishResult> r = (*client)->Publish(shared, p);
  const int64_t t1 = RealtimeNs();
  const double cpu = CpuSeconds() - cpu0;
  if (!r.ok()) return Fail("publish: " + r.status().ToString());
  std::printf("publish start_ns=%lld end_ns=%lld message_id=%s %s cpu_s=%.4f\n", static_cast<long long>(t0),
              static_cast<long long>(t1), r->message_id.c_str(), Accounts(r->accounting).c_str(), cpu);
  return 0;
}

int Fetch(const Flags& f) {
  int64_t wait_s;
  std::string err;
  if (!IntFlag(f, "wait-seconds", 120, &wait_s, &err)) return Fail(err);
  auto client = ConnectRelay(f.Get("addr"));
  if (!client.ok()) return Fail("connect " + f.Get("addr") + ": " + client.status().ToString());
  FetchOptions o;
  o.session = f.Get("session");
  o.agent = f.Get("agent", "b");
  o.wait = std::chrono::seconds(wait_s);
  std::printf("waiting\n");
  std::fflush(stdout);
  const double cpu0 = CpuSeconds();
  absl::StatusOr<FetchedMessage> m = (*client)->Fetch(o);
  const int64_t done = RealtimeNs();
  const double cpu = CpuSeconds() - cpu0;
  if (!m.ok()) return Fail("fetch: " + m.status().ToString());
  uint64_t held = 0;
  for (const MessageLayer& l : m->message.layers) held += l.SentBytes();
  if (!f.Has("no-ack")) {
    if (absl::Status s = (*client)->Ack(o.session, o.agent, m->message_id); !s.ok()) return Fail("ack: " + s.ToString());
  }
  std::printf("fetch done_ns=%lld message_id=%s held_bytes=%llu %s cpu_s=%.4f\n", static_cast<long long>(done),
              m->message_id.c_str(), static_cast<unsigned long long>(held), Accounts(m->accounting).c_str(), cpu);
  return 0;
}

int RawRecv(const Flags& f) {
  int64_t expect, timeout_s;
  std::string err;
  if (!IntFlag(f, "bytes", 0, &expect, &err) || !IntFlag(f, "timeout-seconds", 120, &timeout_s, &err)) {
    return Fail(err);
  }
  sockaddr_storage ss{};
  socklen_t len = 0;
  if (!Resolve(f.Get("listen"), &ss, &len)) return Fail("--listen: HOST:PORT expected, found " + f.Get("listen"));
  const int lfd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (lfd < 0 || bind(lfd, reinterpret_cast<sockaddr*>(&ss), len) != 0 || listen(lfd, 1) != 0) {
    return Fail("listen on " + f.Get("listen") + ": " + std::strerror(errno));
  }
  sockaddr_storage bound{};
  socklen_t blen = sizeof bound;
  getsockname(lfd, reinterpret_cast<sockaddr*>(&bound), &blen);
  const int port = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                      : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  // A buffer the size of what is coming, touched before the sender is told
  // to start: the receiver's page faults are not the link's.
  const size_t cap = expect > 0 ? static_cast<size_t>(expect) : size_t{256} << 20;
  std::vector<uint8_t> buf(cap, 1);
  std::printf("listening port=%d\n", port);
  std::fflush(stdout);
  pollfd p{lfd, POLLIN, 0};
  if (poll(&p, 1, static_cast<int>(timeout_s * 1000)) != 1) return Fail("no connection within --timeout-seconds");
  const int fd = accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd < 0) return Fail(std::string("accept: ") + std::strerror(errno));
  close(lfd);
  const double cpu0 = CpuSeconds();
  uint64_t got = 0;
  const int64_t deadline = RealtimeNs() + timeout_s * 1000000000;
  for (;;) {
    if (expect > 0 && got >= static_cast<uint64_t>(expect)) break;
    pollfd rp{fd, POLLIN, 0};
    const int left = static_cast<int>(std::max<int64_t>(0, (deadline - RealtimeNs()) / 1000000));
    if (left == 0 || poll(&rp, 1, left) != 1) return Fail("raw-recv: timed out after " + std::to_string(got) + " bytes");
    const ssize_t n = recv(fd, buf.data() + (got % cap), cap - (got % cap), 0);
    if (n < 0) return Fail(std::string("recv: ") + std::strerror(errno));
    if (n == 0) break;
    got += static_cast<uint64_t>(n);
  }
  const int64_t done = RealtimeNs();
  const double cpu = CpuSeconds() - cpu0;
  const uint8_t ack = 1;
  (void)send(fd, &ack, 1, MSG_NOSIGNAL);
  close(fd);
  std::printf("raw-recv done_ns=%lld bytes=%llu cpu_s=%.4f\n", static_cast<long long>(done),
              static_cast<unsigned long long>(got), cpu);
  return 0;
}

int RawSend(const Flags& f) {
  const std::string content = f.Get("raw-content", "kv");
  if (content != "kv" && content != "turn") return Fail("--raw-content: kv or turn expected, found " + content);
  absl::StatusOr<Turn> turn = MakeTurn(f);
  if (!turn.ok()) return Fail("turn: " + turn.status().ToString());
  const auto bufs = TurnBuffers(*turn, content == "kv");
  sockaddr_storage ss{};
  socklen_t len = 0;
  if (!Resolve(f.Get("to"), &ss, &len)) return Fail("--to: HOST:PORT expected, found " + f.Get("to"));
  const int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&ss), len) != 0) {
    return Fail("connect " + f.Get("to") + ": " + std::strerror(errno));
  }
  const double cpu0 = CpuSeconds();
  const int64_t t0 = RealtimeNs();
  if (!SendAll(fd, bufs)) return Fail(std::string("send: ") + std::strerror(errno));
  const int64_t t1 = RealtimeNs();
  const double cpu = CpuSeconds() - cpu0;
  shutdown(fd, SHUT_WR);
  uint8_t ack = 0;
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, 120000) != 1 || recv(fd, &ack, 1, 0) != 1) return Fail("raw-send: no reply from the receiver");
  close(fd);
  std::printf("raw-send start_ns=%lld end_ns=%lld bytes=%llu cpu_s=%.4f\n", static_cast<long long>(t0),
              static_cast<long long>(t1), static_cast<unsigned long long>(TotalBytes(bufs)), cpu);
  return 0;
}

// ms from the first send on a 127.0.0.1 socket pair until a receiver thread
// holds every byte in `dst`; negative on a socket error.
double LoopbackSend(const std::vector<absl::Span<const uint8_t>>& bufs, uint64_t total, uint8_t* dst) {
  const int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t alen = sizeof addr;
  if (lfd < 0 || bind(lfd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || listen(lfd, 1) != 0 ||
      getsockname(lfd, reinterpret_cast<sockaddr*>(&addr), &alen) != 0) {
    return -1;
  }
  const int cfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (cfd < 0 || connect(cfd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) return -1;
  const int sfd = accept(lfd, nullptr, nullptr);
  close(lfd);
  if (sfd < 0) return -1;
  std::atomic<bool> receiving{false};
  std::atomic<int64_t> done_at{-1};
  std::thread receiver([&] {
    receiving = true;
    uint64_t got = 0;
    while (got < total) {
      const ssize_t n = recv(sfd, dst + got, total - got, 0);
      if (n <= 0) return;
      got += static_cast<uint64_t>(n);
    }
    done_at = RealtimeNs();
  });
  while (!receiving) std::this_thread::yield();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // parked in recv
  const int64_t t0 = RealtimeNs();
  const bool sent = SendAll(cfd, bufs);
  if (!sent) shutdown(sfd, SHUT_RDWR);
  receiver.join();
  close(cfd);
  close(sfd);
  return sent && done_at >= 0 ? Ms(done_at - t0) : -1;
}

int LocalHop(const Flags& f) {
  int64_t reps;
  std::string err;
  if (!IntFlag(f, "reps", 5, &reps, &err)) return Fail(err);
  if (reps < 1 || reps > 100) return Fail("--reps: 1..100 expected, found " + std::to_string(reps));
  absl::StatusOr<Turn> turn = MakeTurn(f);
  if (!turn.ok()) return Fail("turn: " + turn.status().ToString());
  auto shared = std::make_shared<const Turn>(*std::move(turn));
  const auto bufs = TurnBuffers(*shared, /*kv_only=*/false);
  const uint64_t total = TotalBytes(bufs);
  std::vector<uint8_t> dst(total, 1);
  auto client = ConnectRelay(f.Get("addr"));
  if (!client.ok()) return Fail("connect " + f.Get("addr") + ": " + client.status().ToString());
  const std::string policy = f.Get("policy", "full");
  const std::string prefix = f.Get("session", "local-hop");
  std::vector<double> raw, up, pub, raw_cpu, pub_cpu;
  for (int64_t r = -1; r < reps; ++r) {  // rep -1 warms both paths up
    const double c0 = CpuSeconds();
    const double raw_ms = LoopbackSend(bufs, total, dst.data());
    const double c1 = CpuSeconds();
    if (raw_ms < 0) return Fail(std::string("raw TCP loopback send failed: ") + std::strerror(errno));
    PublishOptions p;
    p.session = prefix + "-" + std::to_string(r + 1);
    p.sender = "a";
    p.recipients = {"local"};
    p.policy = policy;
    p.retries = 0;
    int64_t uploaded = 0;
    p.progress = [&](const TransferProgress& tp) {
      if (tp.bytes_done == tp.bytes_total) uploaded = RealtimeNs();
    };
    const double c2 = CpuSeconds();
    const int64_t t0 = RealtimeNs();
    absl::StatusOr<PublishResult> res = (*client)->Publish(shared, p);
    const int64_t t1 = RealtimeNs();
    const double c3 = CpuSeconds();
    if (!res.ok()) return Fail("publish: " + res.status().ToString());
    if (auto c = (*client)->CloseSession(p.session); !c.ok()) return Fail("close: " + c.status().ToString());
    if (r < 0) continue;
    raw.push_back(raw_ms);
    up.push_back(Ms(uploaded - t0));
    pub.push_back(Ms(t1 - t0));
    raw_cpu.push_back(c1 - c0);
    pub_cpu.push_back(c3 - c2);
    std::printf("local-hop rep=%lld bytes=%llu raw_ms=%.3f upload_ms=%.3f publish_ms=%.3f raw_cpu_s=%.4f "
                "publish_cpu_s=%.4f %s\n",
                static_cast<long long>(r), static_cast<unsigned long long>(total), raw_ms, up.back(), pub.back(),
                raw_cpu.back(), pub_cpu.back(), Accounts(res->accounting).c_str());
    std::fflush(stdout);
  }
  std::printf("local-hop median addr=%s bytes=%llu raw_ms=%.3f upload_ms=%.3f publish_ms=%.3f raw_cpu_s=%.4f "
              "publish_cpu_s=%.4f\n",
              f.Get("addr").c_str(), static_cast<unsigned long long>(total), Median(raw), Median(up), Median(pub),
              Median(raw_cpu), Median(pub_cpu));
  return 0;
}

int Close(const Flags& f) {
  auto client = ConnectRelay(f.Get("addr"));
  if (!client.ok()) return Fail("connect " + f.Get("addr") + ": " + client.status().ToString());
  absl::StatusOr<uint32_t> n = (*client)->CloseSession(f.Get("session"));
  if (!n.ok()) return Fail("close: " + n.status().ToString());
  std::printf("close freed=%u\n", *n);
  return 0;
}

int Main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? kUsageError : 0;
  }
  const std::string mode = argv[1];
  const Flags f = ParseFlags(argc, argv, 2, {"no-ack"});
  if (!f.error.empty()) {
    std::fprintf(stderr, "mesh_bench_agent %s: %s\n%s", mode.c_str(), f.error.c_str(), kUsage);
    return kUsageError;
  }
  const std::map<std::string, std::vector<std::string>> required = {
      {"publish", {"addr", "session"}}, {"fetch", {"addr", "session"}}, {"raw-recv", {"listen"}},
      {"raw-send", {"to"}},             {"local-hop", {"addr"}},        {"close", {"addr", "session"}}};
  auto req = required.find(mode);
  if (req == required.end()) {
    std::fprintf(stderr, "mesh_bench_agent: unknown mode %s\n%s", mode.c_str(), kUsage);
    return kUsageError;
  }
  for (const std::string& name : req->second) {
    if (f.Get(name).empty()) {
      std::fprintf(stderr, "mesh_bench_agent %s: --%s is required\n%s", mode.c_str(), name.c_str(), kUsage);
      return kUsageError;
    }
  }
  if (mode == "publish") return Publish(f);
  if (mode == "fetch") return Fetch(f);
  if (mode == "raw-recv") return RawRecv(f);
  if (mode == "raw-send") return RawSend(f);
  if (mode == "local-hop") return LocalHop(f);
  return Close(f);
}

}  // namespace
}  // namespace kvrelay

int main(int argc, char** argv) {
  // Freed tensors are kept for reuse, as kvrelayctl and kvrelay-server do.
  kvrelay::RetainFreedHeap(kvrelay::kDefaultHeapRetainBytes);
  return kvrelay::Main(argc, argv);
}
