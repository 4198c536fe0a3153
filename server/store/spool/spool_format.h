// The spool's two file formats (docs/SPOOL.md has the byte layout):
//
//   message file  "KVRSPMSG" | u32 version | u32 meta bytes | u64 body bytes
//                 | MessageMeta | body | u32 CRC32C of everything before it
//                 version 1: the body is plain, a message file of
//                 docs/FORMAT.md written as kvrelay.message.v2 (v1 bodies
//                 read with acc 0); version 2: the body is coded, that same
//                 file with its tensors entropy-coded by proto/wire_codec.h
//                 (MessageBody::kCoded below)
//   journal       "KVRSPJNL" | u32 version | u32 0, then records:
//                 u32 payload bytes | u32 CRC32C of the payload | Record
//
// Integers are little-endian. Readers never trust a length before checking
// it against what is there, and never return part of a damaged file.
//
// All functions are thread-safe (no shared state).
#ifndef KVRELAY_SERVER_STORE_SPOOL_SPOOL_FORMAT_H_
#define KVRELAY_SERVER_STORE_SPOOL_SPOOL_FORMAT_H_

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/message.h"
#include "kvrelay/spool/v1/spool.pb.h"
#include "proto/wire_codec.h"

namespace kvrelay {

// The journal's format version, and that of a message file with a plain
// body: the one version of both that earlier relays read.
inline constexpr uint32_t kSpoolFormatVersion = 1;
// The format version of a message file with a coded body. A relay reads
// message files of both versions; earlier relays refuse to start on this one.
inline constexpr uint32_t kCodedMessageFileVersion = 2;
inline constexpr char kMessageFileMagic[] = "KVRSPMSG";
inline constexpr char kJournalMagic[] = "KVRSPJNL";
inline constexpr size_t kJournalHeaderBytes = 16;
inline constexpr size_t kRecordHeaderBytes = 8;
// A journal record longer than this is damage, not a record.
inline constexpr uint32_t kMaxRecordBytes = 1u << 20;

// ---- Message files ----

// How a message file carries the message's tensors.
//
// kPlain (version 1): the body is the message file WriteMessage writes.
// kCoded (version 2): the body is that file's safetensors header, then its
// tensors, layer by layer, each layer's as one wire blob (EncodeWireLayer,
// the coder of forwards, with WireEncodeOptionsOf the message):
//
//   u64 H                      bytes of the plain file's header (its length
//                              field, JSON and padding)
//   H bytes                    that header, byte for byte
//   u32 G                      groups: runs of tensors of one layer
//   G x u32                    the non-empty tensors of each group
//   per tensor (u32, u64)      its part (v1::Part) and bytes, in file order
//   G blobs                    each group's tensors as one wire blob
//
// Decoding rebuilds the plain file (the header, then every blob's tensors
// in order) and reads it as a plain body is read, so a coded body holds
// exactly the message its plain form holds. A part only picks the coder's
// transform of its tensor (every transform is lossless).
enum class MessageBody { kPlain, kCoded };

struct SpoolMessage {
  spool::v1::MessageMeta meta;
  Message msg;
  MessageBody body = MessageBody::kPlain;  // the form the file had
};

// Writes a message file piece by piece: the header and metadata, then the
// body tensor by tensor (layer by layer), then the CRC32C, computed on the
// way. A plain body is written from the message's own buffers: no copy of
// the message is made, so a large message costs no more memory to write
// than a small one. A coded body is coded by Make, which holds every
// layer's blob (at most the tensors' bytes, plus 16 bytes per layer and 29
// per tensor) until the writer is gone: the file's size goes first.
// Not thread-safe; REQUIRES: the message outlives the writer, unchanged.
class MessageFileWriter {
 public:
  using Sink = std::function<absl::Status(absl::string_view)>;

  // Move-only: the views of a coded body are of its own blobs.
  MessageFileWriter(MessageFileWriter&&) = default;
  MessageFileWriter& operator=(MessageFileWriter&&) = default;
  MessageFileWriter(const MessageFileWriter&) = delete;
  MessageFileWriter& operator=(const MessageFileWriter&) = delete;

  // InvalidArgument when `msg` cannot be written as a message file.
  static absl::StatusOr<MessageFileWriter> Make(const spool::v1::MessageMeta& meta, const Message& msg,
                                                MessageBody body = MessageBody::kPlain);

  // The file's size in bytes, known before anything is written.
  uint64_t size() const { return size_; }
  // Passes the file's bytes to `sink` in order: tensors of 256 KiB or more
  // as they are, smaller pieces gathered into calls of at most 256 KiB. The
  // first error `sink` returns stops the write and is returned.
  absl::Status WriteTo(const Sink& sink) const;

 private:
  MessageFileWriter() = default;
  std::string head_;  // the fixed header, the metadata and the body's header
  std::vector<absl::Span<const uint8_t>> tensors_;  // plain: the message's; coded: blobs_
  std::vector<WireBlob> blobs_;                     // a coded body's blobs
  uint64_t size_ = 0;
};

// The whole message file in `*out` (replacing it): MessageFileWriter into a
// string.
absl::Status EncodeMessageFile(const spool::v1::MessageMeta& meta, const Message& msg, std::string* out,
                               MessageBody body = MessageBody::kPlain);

// Parses a whole message file. FAILED_PRECONDITION for a version other than
// kSpoolFormatVersion and kCodedMessageFileVersion (the file is someone
// else's, not damaged); DATA_LOSS for anything else wrong (short, bad
// magic, lengths that do not add up, CRC mismatch, a body that does not
// parse or decode), naming what. With `check_crc` false the caller has
// checked MessageFileCrcOk already. A coded body whose tensors add up to
// more than `max_tensor_bytes` is DATA_LOSS before anything is allocated
// for them; decoding allocates nothing else by what the file declares.
absl::StatusOr<SpoolMessage> DecodeMessageFile(absl::string_view bytes, bool check_crc = true,
                                               uint64_t max_tensor_bytes = std::numeric_limits<uint64_t>::max());
// FAILED_PRECONDITION when `bytes` start like a message file of a format
// version this relay does not read (checked before anything else: such a
// file is refused, not judged by this version's checks); OK otherwise.
absl::Status CheckMessageFileVersion(absl::string_view bytes);
// Whether the file's last 4 bytes are the CRC32C of the rest (false for a
// file under 4 bytes).
bool MessageFileCrcOk(absl::string_view bytes);

// ---- The journal ----

// The 16 bytes every journal file starts with.
std::string JournalHeader();

// The journal record of a commit: message `id` of `session` is in file
// `seq`, with a mailbox entry for each of `agents`.
spool::v1::Record CommitRecord(const std::string& session, const std::string& id, uint64_t seq,
                               const std::vector<std::string>& agents);

// Appends `record`'s framing and payload to `*out`.
void AppendJournalRecord(const spool::v1::Record& record, std::string* out);

struct JournalScan {
  std::vector<spool::v1::Record> records;  // the intact prefix, in order
  uint64_t valid_bytes = 0;                // header + intact records
  // Bytes after the intact prefix (a torn or damaged tail), and why the
  // scan stopped there ("" when it did not).
  uint64_t torn_bytes = 0;
  std::string torn_why;
  // The tail is one record cut short by the end of the file (or a record
  // header shorter than 8 bytes): what a crash during an append leaves.
  bool cut_short = false;
  // Where the first intact record after the damaged spot starts (0: none).
  // Nonzero means damage in the middle, not a torn tail: records written
  // after the damaged one are still there.
  uint64_t intact_after = 0;
};

// Reads a journal file. FAILED_PRECONDITION for a version other than
// kSpoolFormatVersion; DATA_LOSS when the header itself is not a journal's.
// A record that is cut short, over kMaxRecordBytes, fails its CRC or does
// not parse ends the intact prefix: it and everything after it are the torn
// tail, which is then searched, byte by byte, for an intact record.
absl::StatusOr<JournalScan> ScanJournal(absl::string_view bytes);
// The records after the first kJournalHeaderBytes, as ScanJournal reads
// them, without looking at the header (to salvage a journal whose header is
// damaged). A file shorter than the header has no records and valid_bytes
// equal to its size.
JournalScan ScanJournalRecords(absl::string_view bytes);

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_STORE_SPOOL_SPOOL_FORMAT_H_
