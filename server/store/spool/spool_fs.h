// The file operations the spool needs, behind a small interface so that
// tests can put a layer under the spool that models what survives a power
// loss (tests/server/store/spool/fault_fs.h) or fails on demand.
//
// Paths are plain strings; a directory is named without a trailing '/'.
// Errors: RESOURCE_EXHAUSTED when the file system is full (ENOSPC,
// EDQUOT), NOT_FOUND for a missing path, UNAVAILABLE for any other I/O
// error (EIO, ...); each message names the operation, the path and errno's
// text.
//
// Thread-safe: distinct SpoolFile objects may be used from different
// threads; one SpoolFile from one thread at a time.
#ifndef KVRELAY_SERVER_STORE_SPOOL_SPOOL_FS_H_
#define KVRELAY_SERVER_STORE_SPOOL_SPOOL_FS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvrelay {

// A file open for writing at its end.
class SpoolFile {
 public:
  virtual ~SpoolFile() = default;  // closes the file without syncing it
  // Writes all of `data` (a short write is continued, not returned).
  [[nodiscard]] virtual absl::Status Append(absl::string_view data) = 0;
  // Makes what was appended durable (fdatasync). Not retried after a
  // failure: what the kernel dropped is gone (the caller gives the file up).
  [[nodiscard]] virtual absl::Status Sync() = 0;
  [[nodiscard]] virtual absl::Status Close() = 0;
};

class SpoolFs {
 public:
  virtual ~SpoolFs() = default;

  // Creates `path` (truncating an existing file) with mode 0600.
  virtual absl::StatusOr<std::unique_ptr<SpoolFile>> NewFile(const std::string& path) = 0;
  // Opens `path` for appending; REQUIRES: it exists.
  virtual absl::StatusOr<std::unique_ptr<SpoolFile>> AppendFile(const std::string& path) = 0;
  virtual absl::StatusOr<std::string> ReadFile(const std::string& path) = 0;
  // Replaces `to` atomically (rename(2)); durable once the directory is synced.
  virtual absl::Status Rename(const std::string& from, const std::string& to) = 0;
  virtual absl::Status Remove(const std::string& path) = 0;
  virtual absl::Status Truncate(const std::string& path, uint64_t size) = 0;
  // Makes the directory's entries (creates, renames, removes) durable.
  virtual absl::Status SyncDir(const std::string& dir) = 0;
  // The names in `dir`, without "." and "..", in no particular order.
  virtual absl::StatusOr<std::vector<std::string>> List(const std::string& dir) = 0;
  // Creates `dir` with mode 0700 unless it exists; an existing one is made
  // 0700. Its parent must exist.
  virtual absl::Status CreateDir(const std::string& dir) = 0;
  virtual absl::StatusOr<uint64_t> FileSize(const std::string& path) = 0;
};

// The real file system (POSIX calls). Never destroyed.
SpoolFs* PosixSpoolFs();

// An errno as a status: "<op> <path>: <strerror>", coded as above.
absl::Status ErrnoStatus(absl::string_view op, const std::string& path, int err);

}  // namespace kvrelay

#endif  // KVRELAY_SERVER_STORE_SPOOL_SPOOL_FS_H_
