#include "server/store/spool/spool_fs.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvrelay {

absl::Status ErrnoStatus(absl::string_view op, const std::string& path, int err) {
  std::string msg = absl::StrCat(op, " ", path, ": ", std::strerror(err));
  switch (err) {
    case ENOSPC:
    case EDQUOT:
      return absl::ResourceExhaustedError(std::move(msg));
    case ENOENT:
      return absl::NotFoundError(std::move(msg));
    default:
      return absl::UnavailableError(std::move(msg));
  }
}

namespace {

class PosixFile final : public SpoolFile {
 public:
  PosixFile(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  ~PosixFile() override {
    if (fd_ >= 0) ::close(fd_);
  }

  absl::Status Append(absl::string_view data) override {
    const char* p = data.data();
    size_t left = data.size();
    while (left > 0) {
      const ssize_t n = ::write(fd_, p, left);
      if (n < 0) {
        if (errno == EINTR) continue;
        return ErrnoStatus("write", path_, errno);
      }
      if (n == 0) return ErrnoStatus("write", path_, EIO);
      p += n;
      left -= static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }

  absl::Status Sync() override {
    if (::fdatasync(fd_) != 0) return ErrnoStatus("fdatasync", path_, errno);
    return absl::OkStatus();
  }

  absl::Status Close() override {
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) return ErrnoStatus("close", path_, errno);
    return absl::OkStatus();
  }

 private:
  int fd_;
  const std::string path_;
};

class PosixFs final : public SpoolFs {
 public:
  absl::StatusOr<std::unique_ptr<SpoolFile>> NewFile(const std::string& path) override {
    return Open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC);
  }

  absl::StatusOr<std::unique_ptr<SpoolFile>> AppendFile(const std::string& path) override {
    return Open(path, O_WRONLY | O_APPEND | O_CLOEXEC);
  }

  absl::StatusOr<std::string> ReadFile(const std::string& path) override {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus("open", path, errno);
    std::string out;
    struct stat st;
    if (::fstat(fd, &st) == 0 && st.st_size > 0) out.reserve(static_cast<size_t>(st.st_size));
    char buf[1 << 16];
    for (;;) {
      const ssize_t n = ::read(fd, buf, sizeof(buf));
      if (n < 0) {
        if (errno == EINTR) continue;
        const int err = errno;
        ::close(fd);
        return ErrnoStatus("read", path, err);
      }
      if (n == 0) break;
      out.append(buf, static_cast<size_t>(n));
    }
    ::close(fd);
    return out;
  }

  absl::Status Rename(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0) return ErrnoStatus("rename", from + " -> " + to, errno);
    return absl::OkStatus();
  }

  absl::Status Remove(const std::string& path) override {
    if (::unlink(path.c_str()) != 0) return ErrnoStatus("unlink", path, errno);
    return absl::OkStatus();
  }

  absl::Status Truncate(const std::string& path, uint64_t size) override {
    if (::truncate(path.c_str(), static_cast<off_t>(size)) != 0) return ErrnoStatus("truncate", path, errno);
    return absl::OkStatus();
  }

  absl::Status SyncDir(const std::string& dir) override {
    const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus("open", dir, errno);
    const int rc = ::fsync(fd);
    const int err = errno;
    ::close(fd);
    if (rc != 0) return ErrnoStatus("fsync", dir, err);
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<std::string>> List(const std::string& dir) override {
    DIR* d = ::opendir(dir.c_str());
    if (!d) return ErrnoStatus("opendir", dir, errno);
    std::vector<std::string> names;
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") names.push_back(name);
    }
    ::closedir(d);
    return names;
  }

  absl::Status CreateDir(const std::string& dir) override {
    if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) return ErrnoStatus("mkdir", dir, errno);
    struct stat st;
    if (::stat(dir.c_str(), &st) != 0) return ErrnoStatus("stat", dir, errno);
    if (!S_ISDIR(st.st_mode)) return absl::FailedPreconditionError(absl::StrCat(dir, ": not a directory"));
    if ((st.st_mode & 07777) != 0700 && ::chmod(dir.c_str(), 0700) != 0) return ErrnoStatus("chmod", dir, errno);
    return absl::OkStatus();
  }

  absl::StatusOr<uint64_t> FileSize(const std::string& path) override {
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) return ErrnoStatus("stat", path, errno);
    return static_cast<uint64_t>(st.st_size);
  }

 private:
  static absl::StatusOr<std::unique_ptr<SpoolFile>> Open(const std::string& path, int flags) {
    const int fd = ::open(path.c_str(), flags, 0600);
    if (fd < 0) return ErrnoStatus("open", path, errno);
    return std::unique_ptr<SpoolFile>(new PosixFile(fd, path));
  }
};

}  // namespace

SpoolFs* PosixSpoolFs() {
  static PosixFs* fs = new PosixFs();
  return fs;
}

}  // namespace kvrelay
