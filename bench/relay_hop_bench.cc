// One relay hop on loopback against the real kvrelay-server (issue 3, "Speed
// and memory"): publish start until the recipient holds the whole message,
// next to a raw TCP loopback send of the same uncompressed bytes measured in
// the same run, and the relay's peak RSS growth while relaying the turn.
//
// The input is a Qwen3-14B turn (40 layers, 8 KV heads, 40 score heads,
// head_dim 128, bf16, 512 prompt + 40 generated tokens, ~90 MB). For every
// policy the bench starts a fresh server on 127.0.0.1:0 (a child process; the
// ready line gives its ports), then:
//   1. memory: VmRSS of the server right after its ready line, one hop, then
//      VmHWM (monotonic, hence the fresh server); growth = VmHWM - VmRSS;
//   2. time: --reps more hops; each starts a Fetch in another thread, waits
//      until it is parked on the relay, then times from the start of Publish
//      until that Fetch returns the reassembled message. Median reported.
//      Each hop follows a raw TCP send of its own (below), and the ratio
//      reported is the median of the per-pair ratios: a busy or quiet spell
//      of a shared machine then moves both sides of a ratio alike.
// The raw TCP baseline sends the turn's tensors, in upload order, over a
// connected 127.0.0.1 socket pair to a receiver thread that reads everything
// into one buffer (pre-touched: the wire floor; and freshly allocated, which
// pays the page faults a real receiver pays too).
//
//   build/bin/relay_hop_bench [--server build/bin/kvrelay-server] [--reps 5]
//       [--policy SPEC]... [--worker-threads N] [--spool DIR [--fsync always|never]]
//
// With --spool DIR every policy also runs against a second server with
// --spool-dir (a fresh folder under DIR) and the --fsync given (default
// always); its hops alternate with the in-memory server's, and the ratio
// reported is the median of the per-pair ratios (spool / memory).
//
// Not part of the tests. Run it on an otherwise idle machine: it prints the
// load average before and after.
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/types/span.h"
#include "core/heap_retain.h"
#include "client/relay_client.h"
#include "core/format/synthetic.h"

namespace kvrelay {
namespace {

using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "relay_hop_bench: %s\n", what.c_str());
  std::exit(1);
}

std::string LoadAvg() {
  std::ifstream f("/proc/loadavg");
  std::string a, b, c;
  f >> a >> b >> c;
  return a + " " + b + " " + c;
}

// ---------------------------------------------------------------- the turn

Turn Qwen14BTurn() {
  SyntheticTurnOptions o = Qwen3_14BTurn();
  o.seed = 14;
  auto t = MakeSyntheticTurn(o);
  if (!t.ok()) Die(t.status().ToString());
  return *std::move(t);
}

// The turn's tensors in upload order (relay.proto): per layer prompt K/V,
// gen K/V, scores (f32), history K/V/pos when present.
std::vector<absl::Span<const uint8_t>> TurnBuffers(const Turn& turn) {
  std::vector<absl::Span<const uint8_t>> out;
  for (const TurnLayer& l : turn.layers) {
    out.push_back(l.prompt_k.bytes());
    out.push_back(l.prompt_v.bytes());
    out.push_back(l.gen_k.bytes());
    out.push_back(l.gen_v.bytes());
    out.push_back({reinterpret_cast<const uint8_t*>(l.scores.data.data()), l.scores.data.size() * sizeof(float)});
    if (l.history_k.byte_size() > 0) {
      out.push_back(l.history_k.bytes());
      out.push_back(l.history_v.bytes());
      out.push_back({reinterpret_cast<const uint8_t*>(l.history_pos.data.data()),
                     l.history_pos.data.size() * sizeof(int32_t)});
    }
  }
  return out;
}

uint64_t TotalBytes(const std::vector<absl::Span<const uint8_t>>& bufs) {
  uint64_t n = 0;
  for (const auto& b : bufs) n += b.size();
  return n;
}

// ------------------------------------------------------- the server process

struct ProcMem {
  uint64_t rss_kb = 0, hwm_kb = 0;
};

ProcMem ReadProcMem(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  ProcMem m;
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) m.rss_kb = std::strtoull(line.c_str() + 6, nullptr, 10);
    if (line.rfind("VmHWM:", 0) == 0) m.hwm_kb = std::strtoull(line.c_str() + 6, nullptr, 10);
  }
  if (m.rss_kb == 0) Die("cannot read /proc/" + std::to_string(pid) + "/status");
  return m;
}

class ServerProcess {
 public:
  ServerProcess(const std::string& binary, const std::vector<std::string>& extra_args) {
    std::vector<std::string> args = {binary, "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                                     "--shutdown-grace-seconds", "1", "--log-json=false"};  // the plain ready line
    args.insert(args.end(), extra_args.begin(), extra_args.end());
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) Die("pipe2 failed");
    const pid_t parent = getpid();
    pid_ = fork();
    if (pid_ < 0) Die("fork failed");
    if (pid_ == 0) {  // child: async-signal-safe calls only
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);
      dup2(fds[1], STDOUT_FILENO);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(fds[1]);
    out_fd_ = fds[0];
    // Wait for "kvrelay-server ready grpc=ADDR[,ADDR...] metrics=HOST:PORT".
    std::string buf;
    const auto deadline = Clock::now() + std::chrono::seconds(30);
    for (;;) {
      const size_t nl = buf.find('\n');
      if (nl != std::string::npos) {
        const std::string line = buf.substr(0, nl);
        buf.erase(0, nl + 1);
        if (line.rfind("kvrelay-server ready ", 0) == 0) {
          ready_line_ = line;
          break;
        }
        continue;
      }
      const int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count());
      if (left <= 0) Die("server printed no ready line within 30 s");
      pollfd p{out_fd_, POLLIN, 0};
      if (poll(&p, 1, left) <= 0) continue;
      char tmp[4096];
      const ssize_t n = read(out_fd_, tmp, sizeof tmp);
      if (n <= 0) Die("server exited before its ready line (" + binary + ")");
      buf.append(tmp, static_cast<size_t>(n));
    }
    std::istringstream ss(ready_line_);
    std::string tok;
    while (ss >> tok) {
      if (tok.rfind("grpc=", 0) == 0) grpc_addr_ = tok.substr(5, tok.find(',') - 5);  // the first address
      if (tok.rfind("metrics=", 0) == 0) metrics_addr_ = tok.substr(8);
    }
    if (grpc_addr_.empty()) Die("no grpc= in the ready line: " + ready_line_);
    // Keep draining the server's log so it never blocks on a full pipe.
    drain_ = std::thread([fd = out_fd_] {
      char tmp[4096];
      while (read(fd, tmp, sizeof tmp) > 0) {
      }
    });
  }

  ~ServerProcess() {
    kill(pid_, SIGTERM);
    int st = 0;
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while (waitpid(pid_, &st, WNOHANG) == 0) {
      if (Clock::now() > deadline) {
        kill(pid_, SIGKILL);
        waitpid(pid_, &st, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    drain_.join();
    close(out_fd_);
  }

  pid_t pid() const { return pid_; }
  const std::string& grpc_addr() const { return grpc_addr_; }
  const std::string& metrics_addr() const { return metrics_addr_; }
  const std::string& ready_line() const { return ready_line_; }

 private:
  pid_t pid_ = -1;
  int out_fd_ = -1;
  std::string ready_line_, grpc_addr_, metrics_addr_;
  std::thread drain_;
};

// ------------------------------------------------------------ one relay hop

bool g_copy_upload = false;  // --copy-upload

struct HopResult {
  double hop_ms = 0;      // publish start -> fetch returned the message
  double upload_ms = 0;   // publish start -> the last chunk handed to gRPC
  double publish_ms = 0;  // publish start -> publish returned (upload, compress, commit)
  double compress_ms = 0; // the relay's accounting
  uint64_t full_bytes = 0, sent_bytes = 0;
};

HopResult OneHop(RelayClient& sender, RelayClient& recipient, const std::shared_ptr<const Turn>& turn,
                 const std::string& policy,
                 const std::string& session) {
  std::mutex mu;
  std::condition_variable cv;
  bool fetch_started = false;
  Clock::time_point fetched_at;
  std::optional<absl::StatusOr<FetchedMessage>> fetched;
  std::thread fetcher([&] {
    FetchOptions f;
    f.session = session;
    f.agent = "critic";
    f.wait = std::chrono::seconds(120);
    {
      std::lock_guard<std::mutex> l(mu);
      fetch_started = true;
    }
    cv.notify_all();
    absl::StatusOr<FetchedMessage> m = recipient.Fetch(f);
    const Clock::time_point t = Clock::now();
    std::lock_guard<std::mutex> l(mu);
    fetched_at = t;
    fetched.emplace(std::move(m));
  });
  {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return fetch_started; });
  }
  // Let the Fetch reach the relay and park there before the publish starts.
  std::this_thread::sleep_for(std::chrono::milliseconds(150));

  PublishOptions p;
  p.session = session;
  p.sender = "planner";
  p.recipients = {"critic"};
  p.policy = policy;
  Clock::time_point uploaded;
  p.progress = [&](const TransferProgress& tp) {
    if (tp.bytes_done == tp.bytes_total) uploaded = Clock::now();
  };
  const Clock::time_point t0 = Clock::now();
  absl::StatusOr<PublishResult> pub = g_copy_upload ? sender.Publish(*turn, p) : sender.Publish(turn, p);
  const Clock::time_point t_pub = Clock::now();
  fetcher.join();
  if (!pub.ok()) Die("publish (" + policy + "): " + pub.status().ToString());
  if (!fetched->ok()) Die("fetch (" + policy + "): " + fetched->status().ToString());
  FetchedMessage& m = **fetched;
  if (m.message_id != pub->message_id) Die("fetched " + m.message_id + ", published " + pub->message_id);

  HopResult r;
  r.hop_ms = Ms(fetched_at - t0);
  r.upload_ms = Ms(uploaded - t0);
  r.publish_ms = Ms(t_pub - t0);
  r.compress_ms = pub->accounting.compress_seconds * 1e3;
  r.full_bytes = pub->accounting.full_bytes;
  r.sent_bytes = pub->accounting.sent_bytes;
  if (absl::Status s = recipient.Ack(session, "critic", m.message_id); !s.ok()) Die("ack: " + s.ToString());
  if (auto c = sender.CloseSession(session); !c.ok()) Die("close: " + c.status().ToString());
  return r;
}

// ------------------------------------------------------------ raw TCP send

// Sends `bufs` over a connected loopback socket pair; a receiver thread
// reads everything into `dst` (or a fresh allocation when dst is null).
// Returns ms from the first send until the receiver holds every byte.
double RawTcpSend(const std::vector<absl::Span<const uint8_t>>& bufs, uint64_t total, uint8_t* dst) {
  const int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t alen = sizeof addr;
  if (lfd < 0 || bind(lfd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || listen(lfd, 1) != 0 ||
      getsockname(lfd, reinterpret_cast<sockaddr*>(&addr), &alen) != 0) {
    Die("raw TCP: cannot listen on 127.0.0.1");
  }
  const int cfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (cfd < 0 || connect(cfd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) Die("raw TCP: connect failed");
  const int sfd = accept(lfd, nullptr, nullptr);
  if (sfd < 0) Die("raw TCP: accept failed");
  close(lfd);

  std::unique_ptr<uint8_t[]> fresh;
  if (dst == nullptr) {
    fresh.reset(new uint8_t[total]);  // untouched: the receiver pays the page faults
    dst = fresh.get();
  }
  std::atomic<bool> receiving{false};
  Clock::time_point done_at;
  std::thread receiver([&] {
    receiving = true;
    uint64_t got = 0;
    while (got < total) {
      const ssize_t n = recv(sfd, dst + got, total - got, 0);
      if (n <= 0) Die("raw TCP: recv failed");
      got += static_cast<uint64_t>(n);
    }
    done_at = Clock::now();
  });
  while (!receiving) std::this_thread::yield();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // parked in recv

  const Clock::time_point t0 = Clock::now();
  for (const auto& b : bufs) {
    size_t off = 0;
    while (off < b.size()) {
      const ssize_t n = send(cfd, b.data() + off, b.size() - off, MSG_NOSIGNAL);
      if (n <= 0) Die("raw TCP: send failed");
      off += static_cast<size_t>(n);
    }
  }
  receiver.join();
  close(cfd);
  close(sfd);
  return Ms(done_at - t0);
}

// ------------------------------------------------------------------- main

std::string SelfDir() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return ".";
  std::string p(buf, static_cast<size_t>(n));
  const size_t slash = p.rfind('/');
  return slash == std::string::npos ? "." : p.substr(0, slash);
}

void Usage() {
  std::printf(
      "usage: relay_hop_bench [--server PATH] [--reps N] [--policy SPEC]... [--worker-threads N]\n"
      "                       [--copy-upload]\n"
      "  --server PATH        kvrelay-server binary (default: next to this binary)\n"
      "  --reps N             timed hops per policy (default 5; plus one memory hop)\n"
      "  --policy SPEC        policy to relay (repeatable; default: H-OBF exact, H-OBF fast,\n"
      "                       h2o-head, full)\n"
      "  --worker-threads N   passed to the server (default: the server's own default)\n"
      "  --copy-upload        publish with Publish(const Turn&), which copies each chunk once,\n"
      "                       instead of the shared turn sent without a copy\n"
      "  --spool DIR          also time a server with --spool-dir under DIR, hop by hop against\n"
      "                       the in-memory one\n"
      "  --fsync MODE         the spool's --fsync (always or never; default always)\n");
}

struct PolicyRow {
  std::string name, spec;
  HopResult mem_hop;
  double rss_ready_mb = 0, hwm_after_mb = 0, rss_after_mb = 0;
  std::vector<HopResult> hops;
  std::vector<double> raw_ms;  // the raw TCP send timed just before each hop
  std::vector<HopResult> spool_hops;  // --spool: the spooled server's hop paired with each hop
  double server_cpu_ms = 0, client_cpu_ms = 0;  // per timed hop, mean
};

// CPU time (user + system) of process `pid` so far, in ms.
double ProcessCpuMs(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  // Fields after the ")" that closes the command name: state is field 3;
  // utime and stime are fields 14 and 15.
  std::istringstream rest(stat.substr(stat.rfind(')') + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {
    if (i >= 14) ticks += std::strtod(field.c_str(), nullptr);
  }
  return ticks * 1000.0 / sysconf(_SC_CLK_TCK);
}

int Main(int argc, char** argv) {
  std::string server = SelfDir() + "/kvrelay-server";
  int reps = 5;
  std::vector<std::string> policies;
  std::vector<std::string> server_args;
  std::string spool_dir, fsync = "always";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        Usage();
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--server") {
      server = value();
    } else if (a == "--reps") {
      reps = std::atoi(value().c_str());
      if (reps < 1) {
        Usage();
        return 2;
      }
    } else if (a == "--policy") {
      policies.push_back(value());
    } else if (a == "--worker-threads") {
      server_args = {"--worker-threads", value()};
    } else if (a == "--spool") {
      spool_dir = value();
    } else if (a == "--fsync") {
      fsync = value();
    } else if (a == "--copy-upload") {
      g_copy_upload = true;
    } else if (a == "--help" || a == "-h") {
      Usage();
      return 0;
    } else {
      Usage();
      return 2;
    }
  }
  if (access(server.c_str(), X_OK) != 0) Die("no executable server at " + server + " (use --server)");
  if (policies.empty()) {
    policies = {"h2o-head:k=32+obf:p=8", "h2o-head:k=32+obf:p=8,mode=fast", "h2o-head:k=32", "full"};
  }

  std::printf("relay_hop_bench: load average %s, %u hardware threads\n", LoadAvg().c_str(),
              std::thread::hardware_concurrency());
  std::printf("server: %s %s\n", server.c_str(),
              server_args.empty() ? "" : (server_args[0] + " " + server_args[1]).c_str());
  // Shared: Publish sends its tensors without copying them, as kvrelayctl does.
  const auto shared_turn = std::make_shared<const Turn>(Qwen14BTurn());
  const Turn& turn = *shared_turn;
  const std::vector<absl::Span<const uint8_t>> bufs = TurnBuffers(turn);
  const uint64_t turn_bytes = TotalBytes(bufs);
  const double turn_mb = turn_bytes / 1e6;
  std::printf("turn: Qwen3-14B, 40 layers x 8 kv heads (40 score heads), head_dim 128, bf16, 512 prompt + 40 gen: "
              "%llu bytes (%.1f MB), %zu tensors\n",
              static_cast<unsigned long long>(turn_bytes), turn_mb, bufs.size());

  // Raw TCP loopback baseline.
  std::vector<double> raw_warm, raw_fresh;
  double raw_cpu_ms = 0;  // sender + receiver, per send into the touched buffer
  std::vector<uint8_t> dst(turn_bytes, 0);  // touched once; also for the paired sends below
  {
    RawTcpSend(bufs, turn_bytes, dst.data());  // warm-up
    const double cpu0 = ProcessCpuMs(getpid());
    for (int r = 0; r < reps; ++r) raw_warm.push_back(RawTcpSend(bufs, turn_bytes, dst.data()));
    raw_cpu_ms = (ProcessCpuMs(getpid()) - cpu0) / reps;
    for (int r = 0; r < reps; ++r) raw_fresh.push_back(RawTcpSend(bufs, turn_bytes, nullptr));
  }

  std::vector<PolicyRow> rows;
  int session_no = 0;
  for (const std::string& spec : policies) {
    PolicyRow row;
    row.spec = spec;
    ServerProcess proc(server, server_args);
    std::unique_ptr<ServerProcess> spooled;
    std::unique_ptr<RelayClient> spool_sender, spool_recipient;
    if (!spool_dir.empty()) {
      std::vector<std::string> args = server_args;
      const std::string dir = spool_dir + "/hop-" + std::to_string(rows.size()) + "-" + std::to_string(getpid());
      args.insert(args.end(), {"--spool-dir", dir, "--fsync", fsync});
      spooled = std::make_unique<ServerProcess>(server, args);
      spool_sender = RelayClient::Connect(spooled->grpc_addr());
      spool_recipient = RelayClient::Connect(spooled->grpc_addr());
      OneHop(*spool_sender, *spool_recipient, shared_turn, spec, "warm-" + std::to_string(session_no++));
    }
    {
      auto sender = RelayClient::Connect(proc.grpc_addr());
      auto recipient = RelayClient::Connect(proc.grpc_addr());
      // Connect both channels before the baseline RSS (Health is tiny).
      if (auto h = sender->Health(); !h.ok()) Die("health: " + h.status().ToString());
      if (auto h = recipient->Health(); !h.ok()) Die("health: " + h.status().ToString());
      const ProcMem before = ReadProcMem(proc.pid());
      row.mem_hop = OneHop(*sender, *recipient, shared_turn, spec, "bench-" + std::to_string(session_no++));
      const ProcMem after = ReadProcMem(proc.pid());
      row.rss_ready_mb = before.rss_kb * 1024 / 1e6;
      row.hwm_after_mb = after.hwm_kb * 1024 / 1e6;
      row.rss_after_mb = after.rss_kb * 1024 / 1e6;
      // Each hop is paired with a raw TCP send just before it, so that a
      // slower or faster spell of a shared machine moves both alike.
      for (int r = 0; r < reps; ++r) {
        row.raw_ms.push_back(RawTcpSend(bufs, turn_bytes, dst.data()));
        const double server_cpu0 = ProcessCpuMs(proc.pid()), client_cpu0 = ProcessCpuMs(getpid());
        row.hops.push_back(OneHop(*sender, *recipient, shared_turn, spec, "bench-" + std::to_string(session_no++)));
        row.server_cpu_ms += (ProcessCpuMs(proc.pid()) - server_cpu0) / reps;
        row.client_cpu_ms += (ProcessCpuMs(getpid()) - client_cpu0) / reps;
        if (spooled) {
          row.spool_hops.push_back(
              OneHop(*spool_sender, *spool_recipient, shared_turn, spec, "spool-" + std::to_string(session_no++)));
        }
      }
    }
    std::printf("  %-34s hops ms:", spec.c_str());
    for (const HopResult& h : row.hops) std::printf(" %.0f", h.hop_ms);
    std::printf("  (first hop %.0f; %s)\n", row.mem_hop.hop_ms, proc.ready_line().c_str());
    std::printf("  %-34s paired raw TCP ms:", "");
    for (double ms : row.raw_ms) std::printf(" %.0f", ms);
    std::printf("\n");
    std::fflush(stdout);
    rows.push_back(std::move(row));
  }

  const double raw_ms = Median(raw_warm), raw_fresh_ms = Median(raw_fresh);
  std::printf("\nraw TCP loopback, %.1f MB, median of %d: %.1f ms into a touched buffer (%.2f GB/s; "
              "CPU %.0f ms per send, sender + receiver), %.1f ms into a fresh one\n",
              turn_mb, reps, raw_ms, turn_bytes / raw_ms / 1e6, raw_cpu_ms, raw_fresh_ms);
  std::printf("\n%-34s %9s %8s %7s %8s %8s %9s %8s %8s %9s %9s %11s\n", "policy", "sent MB", "hop ms", "up ms",
              "pub ms", "comp ms", "deliv ms", "raw ms", "hop/raw", "hop/rawF", "RSS +MB", "+RSS/turn");
  for (const PolicyRow& row : rows) {
    std::vector<double> hop, up, pub, comp, deliv, ratio;
    for (size_t r = 0; r < row.hops.size(); ++r) {
      const HopResult& h = row.hops[r];
      hop.push_back(h.hop_ms);
      up.push_back(h.upload_ms);
      pub.push_back(h.publish_ms);
      comp.push_back(h.compress_ms);
      deliv.push_back(h.hop_ms - h.publish_ms);
      ratio.push_back(h.hop_ms / row.raw_ms[r]);
    }
    const double growth = row.hwm_after_mb - row.rss_ready_mb;
    const double hop_ms = Median(hop);
    std::printf("%-34s %9.1f %8.1f %7.1f %8.1f %8.1f %9.1f %8.1f %7.2fx %8.2fx %9.1f %10.2f%s\n", row.spec.c_str(),
                row.mem_hop.sent_bytes / 1e6, hop_ms, Median(up), Median(pub), Median(comp), Median(deliv),
                Median(row.raw_ms), Median(ratio), hop_ms / raw_fresh_ms, growth, growth / turn_mb, "");
  }
  std::printf("\ntargets: hop/raw <= 2x; +RSS/turn <= 0.5 (peak RSS growth of a fresh server over one hop:\n"
              "VmHWM after the hop - VmRSS after ready). up ms = publish start until the last chunk is handed\n"
              "to gRPC; pub ms = publish start to publish return (upload, compression, commit); deliv ms =\n"
              "hop - pub; comp ms = the relay's compress_seconds. raw ms = median of the raw TCP sends (into\n"
              "the touched buffer) paired with the hops, each just before its hop; hop/raw = median of the\n"
              "per-pair ratios; hop/rawF = hop ms / the fresh-buffer baseline above.\n");
  for (const PolicyRow& row : rows) {
    std::printf("  %-34s server RSS: %.1f MB ready, %.1f MB peak, %.1f MB after the first hop\n", row.spec.c_str(),
                row.rss_ready_mb, row.hwm_after_mb, row.rss_after_mb);
  }
  // Both processes share the machine's hardware threads, so a hop cannot
  // take less than their CPU time spread over all of them.
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  std::printf("CPU time per hop (user + system, mean of the timed hops; the client includes both agents),\n"
              "and the floor it puts on a hop with %u hardware threads, (server + client) / %u:\n",
              threads, threads);
  for (const PolicyRow& row : rows) {
    const double floor_ms = (row.server_cpu_ms + row.client_cpu_ms) / threads;
    std::printf("  %-34s server %.0f ms, client %.0f ms; floor %.0f ms = %.2fx raw TCP\n", row.spec.c_str(),
                row.server_cpu_ms, row.client_cpu_ms, floor_ms, floor_ms / Median(row.raw_ms));
  }
  if (!spool_dir.empty()) {
    std::printf("\nwith --spool-dir and --fsync=%s, hop by hop against the in-memory server (median of the\n"
                "per-pair ratios; each spooled hop right after its in-memory hop):\n", fsync.c_str());
    for (const PolicyRow& row : rows) {
      std::vector<double> mem, spool, ratio, pub_mem, pub_spool;
      for (size_t r = 0; r < row.spool_hops.size(); ++r) {
        mem.push_back(row.hops[r].hop_ms);
        spool.push_back(row.spool_hops[r].hop_ms);
        ratio.push_back(row.spool_hops[r].hop_ms / row.hops[r].hop_ms);
        pub_mem.push_back(row.hops[r].publish_ms);
        pub_spool.push_back(row.spool_hops[r].publish_ms);
      }
      std::printf("  %-34s hop ms memory %.1f, spool %.1f: spool/memory %.2fx (publish ms %.1f vs %.1f)\n",
                  row.spec.c_str(), Median(mem), Median(spool), Median(ratio), Median(pub_mem), Median(pub_spool));
    }
  }
  std::printf("load average after: %s\n", LoadAvg().c_str());
  return 0;
}

}  // namespace
}  // namespace kvrelay

int main(int argc, char** argv) {
  // The sending and receiving agent keep freed tensors for reuse, as
  // kvrelayctl and kvrelay-server do (core/heap_retain.h).
  kvrelay::RetainFreedHeap(kvrelay::kDefaultHeapRetainBytes);
  return kvrelay::Main(argc, argv);
}
