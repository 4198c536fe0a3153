// The spool's journal on arbitrary bytes: ScanJournal, then the recovery of
// a whole spool (SpoolStore::Open on an in-memory FaultFs) whose journal is
// the input and whose msg/ holds one valid message file, the seed message
// s/m as seq 1 (what the seed journals commit first).
//
// ScanJournal: OK or DATA_LOSS (not a journal) / FAILED_PRECONDITION (another
// format version); valid_bytes + torn_bytes == size, a reason exactly when
// something was cut; the intact prefix alone scans to the same records with
// nothing cut, and the records written again (JournalHeader() +
// AppendJournalRecord) scan back to the same records.
//
// Open: refuses (FAILED_PRECONDITION, the journal and the message file
// untouched) exactly when ScanJournal fails or finds an intact record after
// the damaged one (damage in the middle); otherwise it cuts the same torn
// bytes, leaves the journal's intact prefix in place, and serves exactly
// what the journal's replay says: s/m (intact, equal to the seed) when the
// replayed state gives seq 1 to s/m, and no other message the journal
// commits (their files are missing). After any cut tail (a record cut
// short by the end of the file included: a rotten length reads the same),
// a seq 1 that no intact commit names is moved to quarantine/ unchanged,
// not removed.
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "fuzz/fuzz_check.h"
#include "fuzz/spool_fuzz.h"
#include "spdlog/spdlog.h"

namespace {

using kvrelay::fuzz::kSeedMessage;
using kvrelay::fuzz::kSeedSession;
using Record = kvrelay::spool::v1::Record;

std::string* g_file = nullptr;  // the seed message's file (seq 1)
uint32_t g_print = 0;           // its Fingerprint

// Which (session, id) recovery gives the file of seq 1: the journal replayed
// as SpoolStore::Recover does (a message keeps the seq of its first commit
// while its session lives; a close or expiry forgets the session), and of
// the messages then holding seq 1 the last in (session, id) order.
std::optional<std::pair<std::string, std::string>> HolderOfSeq1(const std::vector<Record>& records) {
  std::map<std::string, std::map<std::string, uint64_t>> model;
  for (const Record& r : records) {
    switch (r.kind_case()) {
      case Record::kCommit: {
        uint64_t& seq = model[r.commit().session_id()][r.commit().message_id()];
        if (seq == 0) seq = r.commit().seq();
        break;
      }
      case Record::kClosed:
        model.erase(r.closed().session_id());
        break;
      case Record::kExpired:
        model.erase(r.expired().session_id());
        break;
      default:
        break;
    }
  }
  std::optional<std::pair<std::string, std::string>> holder;
  for (const auto& [session, ids] : model) {
    for (const auto& [id, seq] : ids) {
      if (seq == 1) holder.emplace(session, id);
    }
  }
  return holder;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  using namespace kvrelay;
  spdlog::set_level(spdlog::level::off);
  testing::FaultFs fs;
  {
    absl::StatusOr<std::unique_ptr<SpoolStore>> s = SpoolStore::Open({}, fuzz::SpoolOpts(&fs), nullptr);
    FUZZ_CHECK(s.ok());
    FUZZ_CHECK(fuzz::CommitTo(**s, fuzz::SeedMessage()).ok());
  }
  g_file = new std::string(fs.Peek(fuzz::SpoolMsgPath(1)));
  FUZZ_CHECK(DecodeMessageFile(*g_file).ok());
  g_print = testing::Fingerprint(*fuzz::SeedMessage());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvrelay;
  const std::string input(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<JournalScan> scan = ScanJournal(input);

  // Recovery of a spool with this journal.
  testing::FaultFs fs;
  {
    auto j = fs.NewFile(fuzz::kSpoolJournal);
    FUZZ_CHECK(j.ok() && (*j)->Append(input).ok() && (*j)->Sync().ok());
    auto m = fs.NewFile(fuzz::SpoolMsgPath(1));
    FUZZ_CHECK(m.ok() && (*m)->Append(*g_file).ok() && (*m)->Sync().ok());
    FUZZ_CHECK(fs.SyncDir("/spool").ok() && fs.SyncDir("/spool/msg").ok());
  }
  absl::StatusOr<std::unique_ptr<SpoolStore>> store = SpoolStore::Open({}, fuzz::SpoolOpts(&fs), nullptr);

  if (!scan.ok()) {
    const absl::StatusCode code = scan.status().code();
    FUZZ_CHECK(code == absl::StatusCode::kDataLoss || code == absl::StatusCode::kFailedPrecondition);
    FUZZ_CHECK((code == absl::StatusCode::kDataLoss) ==
               (size < kJournalHeaderBytes || input.compare(0, 8, kJournalMagic) != 0));
  }
  if (!scan.ok() || scan->intact_after > 0) {
    // Open refuses the spool and leaves the journal and the file alone.
    FUZZ_CHECK(!store.ok());
    FUZZ_CHECK(store.status().code() == absl::StatusCode::kFailedPrecondition);
    FUZZ_CHECK(fs.Peek(fuzz::kSpoolJournal) == input);
    FUZZ_CHECK(fs.Peek(fuzz::SpoolMsgPath(1)) == *g_file);
    return 0;
  }

  FUZZ_CHECK(scan->valid_bytes >= kJournalHeaderBytes);
  FUZZ_CHECK(scan->valid_bytes + scan->torn_bytes == size);
  FUZZ_CHECK(scan->torn_why.empty() == (scan->torn_bytes == 0));
  for (const Record& r : scan->records) FUZZ_CHECK(r.kind_case() != Record::KIND_NOT_SET);

  // The intact prefix alone: the same records, nothing cut.
  absl::StatusOr<JournalScan> prefix = ScanJournal(absl::string_view(input).substr(0, scan->valid_bytes));
  FUZZ_CHECK(prefix.ok() && prefix->torn_bytes == 0 && prefix->valid_bytes == scan->valid_bytes);
  FUZZ_CHECK(prefix->records.size() == scan->records.size());

  // Written again: scans back to the same records. (Not byte for byte: a
  // record may be a non-canonical protobuf encoding, and the header's last
  // 4 bytes are not checked.)
  std::string again = JournalHeader();
  for (const Record& r : scan->records) AppendJournalRecord(r, &again);
  absl::StatusOr<JournalScan> rescan = ScanJournal(again);
  FUZZ_CHECK(rescan.ok() && rescan->torn_bytes == 0 && rescan->valid_bytes == again.size());
  FUZZ_CHECK(rescan->records.size() == scan->records.size());
  for (size_t i = 0; i < scan->records.size(); ++i) {
    const std::string a = scan->records[i].SerializeAsString();
    FUZZ_CHECK(rescan->records[i].SerializeAsString() == a);
    FUZZ_CHECK(prefix->records[i].SerializeAsString() == a);
  }

  // Open recovers: the same cut, the intact prefix kept.
  FUZZ_CHECK(store.ok());
  SpoolStore& s = **store;
  FUZZ_CHECK(s.recovery().torn_bytes == scan->torn_bytes);
  const std::string kept = fs.Peek(fuzz::kSpoolJournal);
  FUZZ_CHECK(kept.size() >= scan->valid_bytes && kept.compare(0, scan->valid_bytes, input, 0, scan->valid_bytes) == 0);

  // What it serves: s/m exactly when the replay gives it seq 1, and then
  // the seed message intact; no other committed message (no file).
  const auto holder = HolderOfSeq1(scan->records);
  const bool seed_served = holder && holder->first == kSeedSession && holder->second == kSeedMessage;
  uint64_t served = 0;
  for (const Record& r : scan->records) {
    if (r.kind_case() != Record::kCommit) continue;
    const std::string& session = r.commit().session_id();
    const std::string& id = r.commit().message_id();
    MessagePtr m = s.Find(session, id);
    const bool is_seed = session == kSeedSession && id == kSeedMessage;
    if (!is_seed) {
      FUZZ_CHECK(m == nullptr);
      continue;
    }
    FUZZ_CHECK((m != nullptr) == seed_served);
    if (m) {
      FUZZ_CHECK(m->session_id == session && m->message_id == id && m->spool_seq == 1);
      FUZZ_CHECK(testing::Fingerprint(*m) == g_print);
      served = 1;
    }
  }
  FUZZ_CHECK(s.recovery().messages == served);
  // Another message given seq 1 finds the seed's file: it names s/m, so it
  // is quarantined, never served; with no holder the file is an orphan.
  FUZZ_CHECK(s.recovery().quarantined == (holder && !seed_served ? 1u : 0u));
  FUZZ_CHECK(fs.Peek(fuzz::SpoolMsgPath(1)).empty() == !seed_served);
  bool named = false;
  for (const Record& r : scan->records) named |= r.kind_case() == Record::kCommit && r.commit().seq() == 1;
  const bool unproven = scan->torn_bytes > 0 && !named;
  FUZZ_CHECK(s.recovery().unproven == (unproven ? 1u : 0u));
  FUZZ_CHECK(fs.Peek(fuzz::SpoolMsgPath(1, "/spool/quarantine")) == (unproven ? *g_file : std::string()) ||
             s.recovery().quarantined == 1);
  return 0;
}
