#include "server/spool/spool_format.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/crc32c.h"
#include "core/format/turn_file.h"

namespace kvrelay {

namespace {

constexpr size_t kMessageHeaderBytes = 24;  // magic, version, meta bytes, body bytes

void PutU32(uint32_t v, std::string* out) {
  char b[4];
  for (int i = 0; i < 4; ++i) b[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  out->append(b, 4);
}

void PutU64(uint64_t v, std::string* out) {
  PutU32(static_cast<uint32_t>(v), out);
  PutU32(static_cast<uint32_t>(v >> 32), out);
}

uint32_t GetU32(const char* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

uint64_t GetU64(const char* p) { return GetU32(p) | (static_cast<uint64_t>(GetU32(p + 4)) << 32); }

absl::Status CheckVersion(const char* what, uint32_t version) {
  if (version == kSpoolFormatVersion) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(what, ": spool format version ", version,
                                                    ", this relay reads version ", kSpoolFormatVersion, " only"));
}

}  // namespace

absl::StatusOr<MessageFileWriter> MessageFileWriter::Make(const spool::v1::MessageMeta& meta, const Message& msg) {
  absl::StatusOr<MessagePieces> body = SerializeMessagePieces(msg);
  if (!body.ok()) return body.status();
  std::string m;
  meta.SerializeToString(&m);
  MessageFileWriter w;
  w.head_.reserve(kMessageHeaderBytes + m.size() + body->header.size());
  w.head_.append(kMessageFileMagic, 8);
  PutU32(kSpoolFormatVersion, &w.head_);
  PutU32(static_cast<uint32_t>(m.size()), &w.head_);
  PutU64(body->size(), &w.head_);
  w.head_.append(m);
  w.head_.append(body->header);
  w.size_ = kMessageHeaderBytes + m.size() + body->size() + 4;
  w.tensors_ = std::move(body->tensors);
  return w;
}

absl::Status MessageFileWriter::WriteTo(const Sink& sink) const {
  // Small pieces (positions, scales, the header) are gathered into `staged`
  // so that the sink sees few calls; large tensors go through untouched.
  constexpr size_t kGather = 256 << 10;
  std::string staged = head_;
  uint32_t crc = Crc32c(head_.data(), head_.size());
  for (absl::Span<const uint8_t> t : tensors_) {
    if (t.empty()) continue;  // an empty tensor's data may be null
    const absl::string_view piece(reinterpret_cast<const char*>(t.data()), t.size());
    crc = Crc32cExtend(crc, piece.data(), piece.size());
    if (staged.size() + piece.size() <= kGather) {
      staged.append(piece.data(), piece.size());
      continue;
    }
    if (!staged.empty()) {
      if (absl::Status s = sink(staged); !s.ok()) return s;
      staged.clear();
    }
    if (piece.size() >= kGather) {
      if (absl::Status s = sink(piece); !s.ok()) return s;
    } else {
      staged.append(piece.data(), piece.size());
    }
  }
  PutU32(crc, &staged);
  return sink(staged);
}

absl::Status EncodeMessageFile(const spool::v1::MessageMeta& meta, const Message& msg, std::string* out) {
  absl::StatusOr<MessageFileWriter> w = MessageFileWriter::Make(meta, msg);
  if (!w.ok()) return w.status();
  out->clear();
  out->reserve(w->size());
  return w->WriteTo([out](absl::string_view piece) {
    out->append(piece.data(), piece.size());
    return absl::OkStatus();
  });
}

absl::Status CheckMessageFileVersion(absl::string_view bytes) {
  if (bytes.size() < 12 || std::memcmp(bytes.data(), kMessageFileMagic, 8) != 0) return absl::OkStatus();
  return CheckVersion("message file", GetU32(bytes.data() + 8));
}

bool MessageFileCrcOk(absl::string_view bytes) {
  if (bytes.size() < 4) return false;
  return Crc32c(bytes.data(), bytes.size() - 4) == GetU32(bytes.data() + bytes.size() - 4);
}

absl::StatusOr<SpoolMessage> DecodeMessageFile(absl::string_view bytes, bool check_crc) {
  if (bytes.size() < kMessageHeaderBytes + 4) {
    return absl::DataLossError(absl::StrCat("message file: ", bytes.size(), " bytes, expected at least ",
                                            kMessageHeaderBytes + 4));
  }
  if (std::memcmp(bytes.data(), kMessageFileMagic, 8) != 0) {
    return absl::DataLossError("message file: bad magic, expected KVRSPMSG");
  }
  if (absl::Status s = CheckVersion("message file", GetU32(bytes.data() + 8)); !s.ok()) return s;
  const uint64_t meta_bytes = GetU32(bytes.data() + 12);
  const uint64_t body_bytes = GetU64(bytes.data() + 16);
  const uint64_t want = kMessageHeaderBytes + meta_bytes + body_bytes + 4;
  if (body_bytes > bytes.size() || want != bytes.size()) {
    return absl::DataLossError(absl::StrCat("message file: ", bytes.size(), " bytes, the header says ",
                                            kMessageHeaderBytes, " + ", meta_bytes, " + ", body_bytes, " + 4"));
  }
  if (check_crc && !MessageFileCrcOk(bytes)) {
    return absl::DataLossError(absl::StrCat("message file: CRC32C ", Crc32c(bytes.data(), bytes.size() - 4),
                                            ", the file says ", GetU32(bytes.data() + bytes.size() - 4)));
  }
  SpoolMessage out;
  if (!out.meta.ParseFromArray(bytes.data() + kMessageHeaderBytes, static_cast<int>(meta_bytes))) {
    return absl::DataLossError("message file: metadata does not parse");
  }
  const auto* body = reinterpret_cast<const uint8_t*>(bytes.data() + kMessageHeaderBytes + meta_bytes);
  absl::StatusOr<Message> msg = ReadMessage(absl::MakeConstSpan(body, body_bytes));
  if (!msg.ok()) return absl::DataLossError(absl::StrCat("message file: body: ", msg.status().message()));
  out.msg = std::move(*msg);
  return out;
}

std::string JournalHeader() {
  std::string h(kJournalMagic, 8);
  PutU32(kSpoolFormatVersion, &h);
  PutU32(0, &h);
  return h;
}

spool::v1::Record CommitRecord(const std::string& session, const std::string& id, uint64_t seq,
                               const std::vector<std::string>& agents) {
  spool::v1::Record r;
  spool::v1::Commit* c = r.mutable_commit();
  c->set_session_id(session);
  c->set_message_id(id);
  c->set_seq(seq);
  for (const std::string& a : agents) c->add_agents(a);
  return r;
}

void AppendJournalRecord(const spool::v1::Record& record, std::string* out) {
  std::string payload;
  record.SerializeToString(&payload);
  PutU32(static_cast<uint32_t>(payload.size()), out);
  PutU32(Crc32c(payload.data(), payload.size()), out);
  out->append(payload);
}

namespace {

// Whether an intact record (as ScanJournalRecords accepts it) starts at `at`.
bool IntactRecordAt(absl::string_view bytes, size_t at) {
  if (bytes.size() - at < kRecordHeaderBytes) return false;
  const uint32_t len = GetU32(bytes.data() + at);
  if (len > kMaxRecordBytes || len > bytes.size() - at - kRecordHeaderBytes) return false;
  const char* payload = bytes.data() + at + kRecordHeaderBytes;
  if (Crc32c(payload, len) != GetU32(bytes.data() + at + 4)) return false;
  spool::v1::Record r;
  return r.ParseFromArray(payload, static_cast<int>(len)) && r.kind_case() != spool::v1::Record::KIND_NOT_SET;
}

}  // namespace

JournalScan ScanJournalRecords(absl::string_view bytes) {
  JournalScan scan;
  if (bytes.size() < kJournalHeaderBytes) {
    scan.valid_bytes = bytes.size();
    return scan;
  }
  size_t at = kJournalHeaderBytes;
  while (at < bytes.size()) {
    const size_t left = bytes.size() - at;
    if (left < kRecordHeaderBytes) {
      scan.torn_why = absl::StrCat("a record header cut short (", left, " bytes)");
      scan.cut_short = true;
      break;
    }
    const uint32_t len = GetU32(bytes.data() + at);
    const uint32_t crc = GetU32(bytes.data() + at + 4);
    if (len > kMaxRecordBytes) {
      scan.torn_why = absl::StrCat("a record of ", len, " bytes, expected at most ", kMaxRecordBytes);
      break;
    }
    if (len > left - kRecordHeaderBytes) {
      scan.torn_why = absl::StrCat("a record of ", len, " bytes cut short at ", left - kRecordHeaderBytes);
      scan.cut_short = true;
      break;
    }
    const char* payload = bytes.data() + at + kRecordHeaderBytes;
    if (Crc32c(payload, len) != crc) {
      scan.torn_why = absl::StrCat("a record whose CRC32C does not match at offset ", at);
      break;
    }
    spool::v1::Record r;
    if (!r.ParseFromArray(payload, static_cast<int>(len)) || r.kind_case() == spool::v1::Record::KIND_NOT_SET) {
      scan.torn_why = absl::StrCat("a record that does not parse at offset ", at);
      break;
    }
    scan.records.push_back(std::move(r));
    at += kRecordHeaderBytes + len;
  }
  scan.valid_bytes = at;
  scan.torn_bytes = bytes.size() - at;
  // A damaged length hides where the next record starts: look at every
  // offset. A CRC32C and a parse make a false find as good as impossible.
  for (size_t next = at + 1; scan.torn_bytes > 0 && next < bytes.size(); ++next) {
    if (IntactRecordAt(bytes, next)) {
      scan.intact_after = next;
      // A length that runs past the end is then damage too, not a cut.
      scan.cut_short = false;
      break;
    }
  }
  return scan;
}

absl::StatusOr<JournalScan> ScanJournal(absl::string_view bytes) {
  if (bytes.size() < kJournalHeaderBytes || std::memcmp(bytes.data(), kJournalMagic, 8) != 0) {
    return absl::DataLossError(absl::StrCat("journal: ", bytes.size(), " bytes without the journal header (KVRSPJNL)"));
  }
  if (absl::Status s = CheckVersion("journal", GetU32(bytes.data() + 8)); !s.ok()) return s;
  return ScanJournalRecords(bytes);
}

}  // namespace kvrelay
