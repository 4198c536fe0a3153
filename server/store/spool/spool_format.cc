#include "server/store/spool/spool_format.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>

#include "absl/strings/str_cat.h"
#include "core/crc32c.h"
#include "core/format/turn_file.h"
#include "proto/stream_codec.h"
#include "proto/wire.h"
#include "proto/wire_codec.h"

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

absl::Status CheckMessageVersion(uint32_t version) {
  if (version == kSpoolFormatVersion || version == kCodedMessageFileVersion) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("message file: spool format version ", version,
                                                    ", this relay reads versions ", kSpoolFormatVersion, " and ",
                                                    kCodedMessageFileVersion, " only"));
}

// ---- Coded bodies (MessageBody::kCoded) ----

constexpr size_t kGroupTensorBytes = 12;  // part u32, bytes u64

// The plain body's non-empty tensors in file order, in runs of one layer
// (the groups), each with its part. The part of a tensor is the one the
// message's delivery order (MessageDeliveryOrder, acc included: every part
// a message holds) gives the same view of the same buffer; a tensor it does
// not name would be coded as PART_UNSPECIFIED, that is stored.
std::vector<std::vector<TensorRef>> CodedGroups(const Message& msg, absl::Span<const absl::Span<const uint8_t>> file) {
  std::map<const uint8_t*, TensorRef> known;
  for (const TensorRef& t : MessageDeliveryOrder(msg, /*with_acc=*/true)) {
    if (!t.data.empty()) known.emplace(t.data.data(), t);
  }
  std::vector<std::vector<TensorRef>> groups;
  for (absl::Span<const uint8_t> t : file) {
    if (t.empty()) continue;
    TensorRef ref{groups.empty() ? 0 : groups.back().back().layer, v1::PART_UNSPECIFIED, t};
    if (auto it = known.find(t.data()); it != known.end() && it->second.data.size() == t.size()) {
      ref.layer = it->second.layer;
      ref.part = it->second.part;
    }
    if (groups.empty() || groups.back().back().layer != ref.layer) groups.emplace_back();
    groups.back().push_back(ref);
  }
  return groups;
}

// The coded body's bytes before its blobs: the plain header and the groups.
std::string CodedBodyHead(const std::string& plain_header, const std::vector<std::vector<TensorRef>>& groups) {
  std::string out;
  PutU64(plain_header.size(), &out);
  out.append(plain_header);
  PutU32(static_cast<uint32_t>(groups.size()), &out);
  for (const std::vector<TensorRef>& g : groups) PutU32(static_cast<uint32_t>(g.size()), &out);
  for (const std::vector<TensorRef>& g : groups) {
    for (const TensorRef& t : g) {
      PutU32(static_cast<uint32_t>(t.part), &out);
      PutU64(t.data.size(), &out);
    }
  }
  return out;
}

// Reads `n` bytes at `*at` of `body`, advancing; false when fewer are left.
bool Take(absl::string_view body, size_t n, size_t* at, absl::string_view* out) {
  if (body.size() - *at < n) return false;
  *out = body.substr(*at, n);
  *at += n;
  return true;
}

absl::Status BadBody(absl::string_view what) { return absl::DataLossError(absl::StrCat("coded body: ", what)); }

// The group table at `*at` of `body` (advancing past it): each group's
// tensors, at most `max_tensor_bytes` in all, with their sum in `*bytes`.
absl::StatusOr<std::vector<std::vector<WireTensor>>> ReadGroups(absl::string_view body, size_t* at,
                                                                uint64_t max_tensor_bytes, uint64_t* bytes) {
  absl::string_view field;
  if (!Take(body, 4, at, &field)) return BadBody("the group count cut short");
  const uint32_t group_count = GetU32(field.data());
  if (uint64_t{group_count} * 4 > body.size() - *at) {
    return BadBody(absl::StrCat(group_count, " groups, ", body.size() - *at, " bytes left"));
  }
  std::vector<uint32_t> counts(group_count);
  uint64_t tensor_count = 0;
  for (uint32_t& n : counts) {
    (void)Take(body, 4, at, &field);  // within the bytes checked above
    n = GetU32(field.data());
    tensor_count += n;
  }
  if (tensor_count > (body.size() - *at) / kGroupTensorBytes) {
    return BadBody(absl::StrCat(tensor_count, " tensors, ", body.size() - *at, " bytes left"));
  }
  std::vector<std::vector<WireTensor>> groups(group_count);
  *bytes = 0;
  for (uint32_t g = 0; g < group_count; ++g) {
    for (uint32_t i = 0; i < counts[g]; ++i) {
      (void)Take(body, kGroupTensorBytes, at, &field);  // within the bytes checked above
      const WireTensor t{static_cast<v1::Part>(GetU32(field.data())), GetU64(field.data() + 4)};
      if (t.size == 0 || t.size > max_tensor_bytes - *bytes) {
        return BadBody(absl::StrCat("group ", g, " tensor ", i, ": ", t.size, " bytes, expected 1..",
                                    max_tensor_bytes - *bytes, " (at most ", max_tensor_bytes, " in all)"));
      }
      *bytes += t.size;
      groups[g].push_back(t);
    }
  }
  return groups;
}

// The plain body a coded one holds. Every length is checked against what is
// there, and every blob's records against its group, before anything is
// allocated for the tensors. DATA_LOSS naming the field otherwise.
absl::StatusOr<std::string> DecodeCodedBody(absl::string_view body, uint64_t max_tensor_bytes) {
  size_t at = 0;
  absl::string_view field, header;
  if (!Take(body, 8, &at, &field)) return BadBody(absl::StrCat(body.size(), " bytes, expected at least 8"));
  const uint64_t header_bytes = GetU64(field.data());
  if (header_bytes > kMaxSafetensorsHeaderBytes + 8 || !Take(body, header_bytes, &at, &header)) {
    return BadBody(absl::StrCat("a header of ", header_bytes, " bytes, ", body.size() - at, " left"));
  }
  uint64_t tensor_bytes = 0;
  absl::StatusOr<std::vector<std::vector<WireTensor>>> groups = ReadGroups(body, &at, max_tensor_bytes, &tensor_bytes);
  if (!groups.ok()) return groups.status();
  std::vector<absl::string_view> blobs(groups->size());
  for (size_t g = 0; g < groups->size(); ++g) {
    const uint64_t max_blob = std::min<uint64_t>(MaxWireLayerBytes((*groups)[g]), body.size() - at);
    absl::StatusOr<uint64_t> blob_bytes = WireLayerBlobBytes(AsBytes(body.substr(at)), max_blob);
    if (!blob_bytes.ok()) return BadBody(absl::StrCat("group ", g, ": ", blob_bytes.status().message()));
    blobs[g] = body.substr(at, *blob_bytes);
    at += *blob_bytes;
    if (absl::Status s = CheckWireLayer(AsBytes(blobs[g]), (*groups)[g]); !s.ok()) {
      return BadBody(absl::StrCat("group ", g, ": ", s.message()));
    }
  }
  if (at != body.size()) return BadBody(absl::StrCat(body.size() - at, " bytes after the last group"));
  std::string plain;
  plain.reserve(header.size() + tensor_bytes);
  plain.append(header.data(), header.size());
  for (size_t g = 0; g < groups->size(); ++g) {
    absl::StatusOr<std::vector<std::vector<uint8_t>>> tensors = DecodeWireLayer(AsBytes(blobs[g]), (*groups)[g]);
    if (!tensors.ok()) return BadBody(absl::StrCat("group ", g, ": ", tensors.status().message()));
    for (const std::vector<uint8_t>& t : *tensors) plain.append(reinterpret_cast<const char*>(t.data()), t.size());
  }
  return plain;
}

}  // namespace

absl::StatusOr<MessageFileWriter> MessageFileWriter::Make(const spool::v1::MessageMeta& meta, const Message& msg,
                                                          MessageBody form) {
  absl::StatusOr<MessagePieces> body = SerializeMessagePieces(msg);
  if (!body.ok()) return body.status();
  MessageFileWriter w;
  std::string body_head;
  uint64_t body_bytes = body->size();
  if (form == MessageBody::kCoded) {
    const std::vector<std::vector<TensorRef>> groups = CodedGroups(msg, body->tensors);
    body_head = CodedBodyHead(body->header, groups);
    body_bytes = body_head.size();
    const WireEncodeOptions opts = WireEncodeOptionsOf(msg.kv_heads, ToProtoDType(msg.dtype));
    w.blobs_.reserve(groups.size());
    for (const std::vector<TensorRef>& g : groups) {
      w.blobs_.push_back(EncodeWireLayer(g, opts));
      w.tensors_.push_back(w.blobs_.back());
      body_bytes += w.blobs_.back().size();
    }
  } else {
    body_head = std::move(body->header);
    w.tensors_ = std::move(body->tensors);
  }
  std::string m;
  meta.SerializeToString(&m);
  w.head_.reserve(kMessageHeaderBytes + m.size() + body_head.size());
  w.head_.append(kMessageFileMagic, 8);
  PutU32(form == MessageBody::kCoded ? kCodedMessageFileVersion : kSpoolFormatVersion, &w.head_);
  PutU32(static_cast<uint32_t>(m.size()), &w.head_);
  PutU64(body_bytes, &w.head_);
  w.head_.append(m);
  w.head_.append(body_head);
  w.size_ = kMessageHeaderBytes + m.size() + body_bytes + 4;
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

absl::Status EncodeMessageFile(const spool::v1::MessageMeta& meta, const Message& msg, std::string* out,
                               MessageBody body) {
  absl::StatusOr<MessageFileWriter> w = MessageFileWriter::Make(meta, msg, body);
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
  return CheckMessageVersion(GetU32(bytes.data() + 8));
}

bool MessageFileCrcOk(absl::string_view bytes) {
  if (bytes.size() < 4) return false;
  return Crc32c(bytes.data(), bytes.size() - 4) == GetU32(bytes.data() + bytes.size() - 4);
}

absl::StatusOr<SpoolMessage> DecodeMessageFile(absl::string_view bytes, bool check_crc, uint64_t max_tensor_bytes) {
  if (bytes.size() < kMessageHeaderBytes + 4) {
    return absl::DataLossError(absl::StrCat("message file: ", bytes.size(), " bytes, expected at least ",
                                            kMessageHeaderBytes + 4));
  }
  if (std::memcmp(bytes.data(), kMessageFileMagic, 8) != 0) {
    return absl::DataLossError("message file: bad magic, expected KVRSPMSG");
  }
  const uint32_t version = GetU32(bytes.data() + 8);
  if (absl::Status s = CheckMessageVersion(version); !s.ok()) return s;
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
  absl::string_view body = bytes.substr(kMessageHeaderBytes + meta_bytes, body_bytes);
  std::string plain;
  if (version == kCodedMessageFileVersion) {
    absl::StatusOr<std::string> decoded = DecodeCodedBody(body, max_tensor_bytes);
    if (!decoded.ok()) return absl::DataLossError(absl::StrCat("message file: ", decoded.status().message()));
    plain = std::move(*decoded);
    body = plain;
    out.body = MessageBody::kCoded;
  }
  absl::StatusOr<Message> msg = ReadMessage(AsBytes(body));
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
