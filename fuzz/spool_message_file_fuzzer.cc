// A spool message file on arbitrary bytes: DecodeMessageFile, then the
// recovery of a spool whose journal commits it (seq 1) and whose msg/
// holds the input as 0000000000000001.kvm.
//
// Decode: OK, DATA_LOSS, or FAILED_PRECONDITION exactly for a file of
// another format version; OK only with a matching CRC32C. What it accepts
// is written again (EncodeMessageFile, in the body form it had) to a file
// that decodes to the same metadata and message, and of which every one of
// up to 64 single-bit flips (positions taken from the input) is refused. A
// coded body may decode to kMaxTensorBytes, here and in the recovery.
// The input with its CRC32C made right decodes the same way (OK, DATA_LOSS
// or FAILED_PRECONDITION), so that the body decoders see mutated bodies.
//
// Recovery: refuses to start (FAILED_PRECONDITION) exactly for a file of
// another format version; otherwise serves the message exactly when the
// file decodes, and then the decoded message; a file that does not decode
// is moved, unchanged, to quarantine/.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/crc32c.h"
#include "core/format/turn_file.h"
#include "fuzz/fuzz_check.h"
#include "fuzz/spool_fuzz.h"
#include "google/protobuf/util/message_differencer.h"
#include "spdlog/spdlog.h"

namespace {

constexpr uint64_t kMaxTensorBytes = uint64_t{64} << 20;

std::string Body(const kvrelay::Message& m) {
  std::string out;
  FUZZ_CHECK(kvrelay::WriteMessage(m, &out).ok());
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvrelay;
  using google::protobuf::util::MessageDifferencer;
  const std::string input(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<SpoolMessage> sm = DecodeMessageFile(input, /*check_crc=*/true, kMaxTensorBytes);
  const bool other_version = !CheckMessageFileVersion(input).ok();
  if (size >= 4) {
    std::string fixed = input;
    const uint32_t crc = Crc32c(fixed.data(), fixed.size() - 4);
    for (int b = 0; b < 4; ++b) fixed[fixed.size() - 4 + b] = static_cast<char>((crc >> (8 * b)) & 0xff);
    absl::StatusOr<SpoolMessage> f = DecodeMessageFile(fixed, /*check_crc=*/true, kMaxTensorBytes);
    FUZZ_CHECK(f.ok() || f.status().code() == absl::StatusCode::kDataLoss ||
               f.status().code() == absl::StatusCode::kFailedPrecondition);
  }
  if (!sm.ok()) {
    const absl::StatusCode code = sm.status().code();
    FUZZ_CHECK(code == absl::StatusCode::kDataLoss || code == absl::StatusCode::kFailedPrecondition);
    // Another version is named as such once the file is long enough to be
    // judged at all.
    if (code == absl::StatusCode::kFailedPrecondition) FUZZ_CHECK(other_version);
    if (other_version && size >= 28) FUZZ_CHECK(code == absl::StatusCode::kFailedPrecondition);
  } else {
    FUZZ_CHECK(!other_version);
    FUZZ_CHECK(MessageFileCrcOk(input));
    // Without the CRC check (the caller did it): the same result.
    absl::StatusOr<SpoolMessage> unchecked = DecodeMessageFile(input, /*check_crc=*/false, kMaxTensorBytes);
    FUZZ_CHECK(unchecked.ok() && MessageDifferencer::Equals(unchecked->meta, sm->meta));

    std::string again;
    FUZZ_CHECK(EncodeMessageFile(sm->meta, sm->msg, &again, sm->body).ok());
    absl::StatusOr<SpoolMessage> back = DecodeMessageFile(again);
    FUZZ_CHECK(back.ok() && back->body == sm->body);
    FUZZ_CHECK(MessageDifferencer::Equals(back->meta, sm->meta));
    const std::string body = Body(sm->msg);
    FUZZ_CHECK(Body(back->msg) == body);

    // Single-bit flips of the valid file: every one is refused.
    const uint64_t bits = uint64_t{again.size()} * 8;
    uint32_t h = Crc32c(input.data(), input.size());
    for (int i = 0; i < 64; ++i) {
      h = h * 1664525u + 1013904223u;
      const uint64_t bit = i < 8 ? (i < 4 ? i : bits - 1 - (i - 4)) : h % bits;  // the ends, then spread
      std::string flipped = again;
      flipped[bit / 8] = static_cast<char>(flipped[bit / 8] ^ (1u << (bit % 8)));
      FUZZ_CHECK(!DecodeMessageFile(flipped).ok());
    }
  }

  // Recovery with the input as the file of seq 1, committed by the journal
  // under the ids the file names (s/m when it does not decode).
  const std::string session = sm.ok() ? sm->meta.session_id() : fuzz::kSeedSession;
  const std::string id = sm.ok() ? sm->meta.message_id() : fuzz::kSeedMessage;
  testing::FaultFs fs;
  {
    std::string journal = JournalHeader();
    AppendJournalRecord(CommitRecord(session, id, 1, {"b"}), &journal);
    auto j = fs.NewFile(fuzz::kSpoolJournal);
    FUZZ_CHECK(j.ok() && (*j)->Append(journal).ok() && (*j)->Sync().ok());
    auto m = fs.NewFile(fuzz::SpoolMsgPath(1));
    FUZZ_CHECK(m.ok() && (*m)->Append(input).ok() && (*m)->Sync().ok());
    FUZZ_CHECK(fs.SyncDir("/spool").ok() && fs.SyncDir("/spool/msg").ok());
  }
  StoreLimits limits;
  limits.max_store_bytes = kMaxTensorBytes;
  absl::StatusOr<std::unique_ptr<SpoolStore>> store = SpoolStore::Open(limits, fuzz::SpoolOpts(&fs), nullptr);
  if (other_version) {
    FUZZ_CHECK(!store.ok() && store.status().code() == absl::StatusCode::kFailedPrecondition);
    FUZZ_CHECK(fs.Peek(fuzz::SpoolMsgPath(1)) == input);  // left where it was
    return 0;
  }
  FUZZ_CHECK(store.ok());
  SpoolStore& s = **store;
  MessagePtr served = s.Find(session, id);
  FUZZ_CHECK((served != nullptr) == sm.ok());
  FUZZ_CHECK(s.recovery().messages == (sm.ok() ? 1u : 0u));
  if (served) {
    FUZZ_CHECK(served->session_id == session && served->message_id == id && served->spool_seq == 1);
    FUZZ_CHECK(served->sender == sm->meta.sender() && served->parent_id == sm->meta.parent_id());
    FUZZ_CHECK(served->forwarded == sm->meta.forwarded() && served->origin == sm->meta.origin());
    FUZZ_CHECK(static_cast<int>(served->recipients.size()) == sm->meta.recipients_size());
    FUZZ_CHECK(Body(served->msg) == Body(sm->msg));
    FUZZ_CHECK(fs.Peek(fuzz::SpoolMsgPath(1)) == input);
  } else {
    FUZZ_CHECK(s.recovery().quarantined == 1);
    FUZZ_CHECK(fs.Peek(fuzz::SpoolMsgPath(1, "/spool/quarantine")) == input);
    FUZZ_CHECK(fs.List("/spool/msg")->empty());
  }
  return 0;
}
