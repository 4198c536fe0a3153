// Shared by the spool fuzzers (spool_journal_fuzzer.cc,
// spool_message_file_fuzzer.cc) and make_corpus.cc: a spool in memory
// (tests/server/store/spool/fault_fs.h) written by SpoolStore itself, so that the
// seeds and the fuzzers' fixed message file are what a relay writes.
#ifndef KVRELAY_FUZZ_SPOOL_FUZZ_H_
#define KVRELAY_FUZZ_SPOOL_FUZZ_H_

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "server/store/spool/spool_format.h"
#include "server/store/spool_store.h"
#include "tests/server/store/spool/fault_fs.h"
#include "tests/server/store/spool/spool_test_util.h"

namespace kvrelay::fuzz {

inline constexpr char kSpoolDir[] = "/spool";
inline constexpr char kSpoolJournal[] = "/spool/journal";
// The message every seed journal commits first (seq 1), and whose file the
// journal fuzzer puts in place.
inline constexpr char kSeedSession[] = "s";
inline constexpr char kSeedMessage[] = "m";

inline std::string SpoolMsgPath(uint64_t seq, const char* dir = "/spool/msg") {
  char b[64];
  std::snprintf(b, sizeof(b), "%s/%016llx.kvm", dir, static_cast<unsigned long long>(seq));
  return b;
}

inline SpoolOptions SpoolOpts(testing::FaultFs* fs) {
  SpoolOptions o;
  o.dir = kSpoolDir;
  o.fs = fs;
  return o;
}

// A small real message (1 layer of [2 heads, 3 tokens, 8] BF16).
inline std::shared_ptr<StoredMessage> SmallMsg(const std::string& session, const std::string& id, uint32_t seed) {
  return testing::RealMsg(session, id, {"b"}, seed, /*tokens=*/3, /*layers=*/1);
}

inline std::shared_ptr<StoredMessage> SeedMessage() { return SmallMsg(kSeedSession, kSeedMessage, 1); }

// A whole publish: begin, commit, end.
inline absl::Status CommitTo(Store& s, std::shared_ptr<StoredMessage> m) {
  const Store::PublishTicket t = s.BeginPublish(m->session_id);
  absl::StatusOr<Store::CommitResult> r = s.Commit(std::move(m), t);
  s.EndPublish(t);
  return r.status();
}

}  // namespace kvrelay::fuzz

#endif  // KVRELAY_FUZZ_SPOOL_FUZZ_H_
