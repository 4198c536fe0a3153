// Recovery time of a spool: writes N messages of about M MB each into a
// fresh spool through SpoolStore (as publishes would, --fsync=always unless
// --no-fsync), closes it, drops the page cache when it may (root), and
// times SpoolStore::Open: the journal replay, reading every message file,
// its CRC32C check (eager, at start-up) and decoding. Prints the recovery
// time, how much of it is CRC32C, and the bytes read per second, and how
// far a commit raises the peak RSS above the message it writes. With
// --coded the message files have coded bodies (--wire-codec rans).
//
//   build/bin/spool_recovery_bench --dir /var/tmp/kvspool [--messages 1000] [--mb 10] [--no-fsync] [--coded] [--keep]
//
// Not part of the tests. Needs the disk space and the memory of the spool
// (a recovered relay holds every retained message in memory).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>

#include "server/store/spool_store.h"
#include "tests/testlib/stored_message.h"

namespace kvrelay {
namespace {

using Clock = std::chrono::steady_clock;

// Message i: 40 layers x [8 heads, tokens, 128] BF16, 64 messages a session.
std::shared_ptr<StoredMessage> MakeMessage(int i, int tokens, std::mt19937& rng) {
  return testing::StoredMessageOf(
      testing::DenseMessage({/*layers=*/40, /*kv_heads=*/8, /*head_dim=*/128, tokens}, rng),
      "bench-" + std::to_string(i / 64), "m" + std::to_string(i), "planner", {"critic"});
}

// A field of /proc/self/status in kB (0 when missing).
double StatusKb(const std::string& key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(key, 0) == 0) return std::atof(line.c_str() + key.size());
  }
  return 0;
}

// Resets VmHWM (the peak RSS) to the current RSS.
void ResetPeakRss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5\n";
}

int Main(int argc, char** argv) {
  std::string dir;
  int messages = 1000;
  double mb = 10;
  bool fsync = true, keep = false, coded = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--dir") {
      dir = value();
    } else if (a == "--messages") {
      messages = std::atoi(value().c_str());
    } else if (a == "--mb") {
      mb = std::atof(value().c_str());
    } else if (a == "--no-fsync") {
      fsync = false;
    } else if (a == "--keep") {
      keep = true;
    } else if (a == "--coded") {
      coded = true;
    } else {
      std::fprintf(stderr, "usage: spool_recovery_bench --dir DIR [--messages N] [--mb M] [--no-fsync] [--coded] [--keep]\n");
      return 2;
    }
  }
  if (dir.empty() || messages < 1 || mb <= 0) {
    std::fprintf(stderr, "spool_recovery_bench: --dir DIR is required; N >= 1, M > 0\n");
    return 2;
  }
  // 40 layers x 8 heads x 128 dims x 2 (K, V) x 2 bytes + 4 x 8 bytes of positions per token.
  const int tokens = std::max(1, static_cast<int>(mb * 1e6 / (40.0 * (8 * 128 * 2 * 2 + 8 * 4))));
  StoreLimits limits;
  limits.max_store_bytes = limits.max_session_bytes = 1ull << 40;
  limits.max_mailbox_bytes = 1ull << 40;
  SpoolOptions so;
  so.dir = dir;
  so.fsync = fsync;
  so.message_body = coded ? MessageBody::kCoded : MessageBody::kPlain;
  uint64_t bytes = 0;
  {
    absl::StatusOr<std::unique_ptr<SpoolStore>> s = SpoolStore::Open(limits, so, nullptr);
    if (!s.ok()) {
      std::fprintf(stderr, "open: %s\n", s.status().ToString().c_str());
      return 1;
    }
    std::mt19937 rng(1);
    const Clock::time_point t0 = Clock::now();
    double commit_peak = 0;  // the most a commit's peak RSS rose above the RSS before it
    for (int i = 0; i < messages; ++i) {
      auto m = MakeMessage(i, tokens, rng);
      bytes += m->msg.sent_bytes;
      ResetPeakRss();
      const double before = StatusKb("VmRSS:");
      const Store::PublishTicket t = (*s)->BeginPublish(m->session_id);
      absl::StatusOr<Store::CommitResult> r = (*s)->Commit(m, t);
      (*s)->EndPublish(t);
      commit_peak = std::max(commit_peak, StatusKb("VmHWM:") - before);
      if (!r.ok()) {
        std::fprintf(stderr, "commit %d: %s\n", i, r.status().ToString().c_str());
        return 1;
      }
    }
    std::printf("wrote %d messages of %.1f MB (%d tokens x 40 layers x 8 heads x 128, bf16): %.2f GB in %.1f s, "
                "fsync=%s, %s files\n",
                messages, bytes / 1e6 / messages, tokens, bytes / 1e9,
                std::chrono::duration<double>(Clock::now() - t0).count(), fsync ? "always" : "never",
                coded ? "coded" : "plain");
    std::printf("commit: peak RSS at most %.1f MB above the RSS before it (the message itself: %.1f MB)\n",
                commit_peak / 1e3, bytes / 1e6 / messages);
  }
  ::sync();
  const bool dropped = [] {
    std::ofstream f("/proc/sys/vm/drop_caches");
    if (!f) return false;
    f << "3\n";
    return static_cast<bool>(f);
  }();
  std::printf("page cache %s\n", dropped ? "dropped (a cold start)" : "not dropped (not root: a warm start)");
  const Clock::time_point t0 = Clock::now();
  absl::StatusOr<std::unique_ptr<SpoolStore>> s = SpoolStore::Open(limits, so, nullptr);
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  if (!s.ok()) {
    std::fprintf(stderr, "recovery: %s\n", s.status().ToString().c_str());
    return 1;
  }
  const SpoolRecovery& r = (*s)->recovery();
  std::printf("recovery: %.2f s for %llu messages, %.2f GB on disk (%.2f GB/s); CRC32C checks %.2f s (%.0f%%, eager "
              "at start-up), the rest reading and decoding the files and replaying the journal\n",
              secs, static_cast<unsigned long long>(r.messages), r.bytes / 1e9, r.bytes / 1e9 / secs, r.crc_seconds,
              100 * r.crc_seconds / secs);
  s->reset();
  if (!keep) {
    const std::string cmd = "rm -rf '" + dir + "'";
    if (std::system(cmd.c_str()) != 0) std::fprintf(stderr, "could not remove %s\n", dir.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace kvrelay

int main(int argc, char** argv) { return kvrelay::Main(argc, argv); }
