// An LD_PRELOAD library that counts the bytes a process passes to libc's
// memcpy and memmove (and their _chk and mempcpy forms), bucketed by the size
// of each call. bench/cost_bench.py preloads it into a relay to count how
// many times each byte of a message is copied inside the relay, socket to
// socket, without touching the relay's code.
//
// The counters live in a file (KVRELAY_COPYCOUNT_FILE, created and sized by
// the library) mapped MAP_SHARED, so a driver reads them at any moment, before
// and after a transfer, from outside: kCounters little-endian uint64 at
// offset 0, laid out as [family][bucket][calls, bytes] (see the constants).
// Without the variable the counters stay in this process's memory.
//
// What it sees: every call that reaches the dynamic symbol (calls from the
// executable and every shared library go through the PLT). What it misses:
// copies the compiler inlined (small constant sizes), copies inside glibc
// itself, element-wise copy loops, and the kernel's copies in and out of the
// socket buffers (the "socket" ends of socket to socket). So its figure is a
// lower bound of user-space copying, exact for the calls it sees.
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>

namespace {

constexpr int kFamilies = 2;  // 0: memcpy (and mempcpy), 1: memmove
constexpr int kBuckets = 6;   // < 256 B, < 4 KiB, < 64 KiB, < 1 MiB, < 16 MiB, >= 16 MiB
constexpr int kCounters = kFamilies * kBuckets * 2;

using CopyFn = void* (*)(void*, const void*, size_t);

uint64_t g_local[kCounters];
uint64_t* g_counters = g_local;
CopyFn g_real[kFamilies];
bool g_resolving = false;

int Bucket(size_t n) {
  if (n < 256) return 0;
  if (n < 4096) return 1;
  if (n < 65536) return 2;
  if (n < (size_t{1} << 20)) return 3;
  if (n < (size_t{16} << 20)) return 4;
  return 5;
}

// A copy that needs no libc: used only while dlsym resolves the real ones.
void* ByteCopy(void* dst, const void* src, size_t n) {
  auto* d = static_cast<volatile unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  if (d < s) {
    for (size_t i = 0; i < n; ++i) d[i] = s[i];
  } else {
    for (size_t i = n; i > 0; --i) d[i - 1] = s[i - 1];
  }
  return dst;
}

CopyFn Real(int family) {
  CopyFn f = __atomic_load_n(&g_real[family], __ATOMIC_ACQUIRE);
  if (f != nullptr) return f;
  if (g_resolving) return ByteCopy;
  g_resolving = true;
  f = reinterpret_cast<CopyFn>(dlsym(RTLD_NEXT, family == 0 ? "memcpy" : "memmove"));
  g_resolving = false;
  if (f == nullptr) return ByteCopy;
  __atomic_store_n(&g_real[family], f, __ATOMIC_RELEASE);
  return f;
}

void Count(int family, size_t n) {
  uint64_t* c = g_counters + (family * kBuckets + Bucket(n)) * 2;
  __atomic_fetch_add(&c[0], 1, __ATOMIC_RELAXED);
  __atomic_fetch_add(&c[1], n, __ATOMIC_RELAXED);
}

__attribute__((constructor)) void MapCounters() {
  Real(0);
  Real(1);
  const char* path = std::getenv("KVRELAY_COPYCOUNT_FILE");
  if (path == nullptr || *path == '\0') return;
  const int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return;
  if (ftruncate(fd, sizeof g_local) == 0) {
    void* p = mmap(nullptr, sizeof g_local, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p != MAP_FAILED) {
      auto* shared = static_cast<uint64_t*>(p);
      for (int i = 0; i < kCounters; ++i) shared[i] = __atomic_load_n(&g_local[i], __ATOMIC_RELAXED);
      __atomic_store_n(&g_counters, shared, __ATOMIC_RELEASE);
    }
  }
  close(fd);
}

}  // namespace

extern "C" {

void* memcpy(void* dst, const void* src, size_t n) {
  Count(0, n);
  return Real(0)(dst, src, n);
}

void* memmove(void* dst, const void* src, size_t n) {
  Count(1, n);
  return Real(1)(dst, src, n);
}

void* mempcpy(void* dst, const void* src, size_t n) {
  Count(0, n);
  return static_cast<char*>(Real(0)(dst, src, n)) + n;
}

void* __memcpy_chk(void* dst, const void* src, size_t n, size_t /*dstlen*/) {
  Count(0, n);
  return Real(0)(dst, src, n);
}

void* __memmove_chk(void* dst, const void* src, size_t n, size_t /*dstlen*/) {
  Count(1, n);
  return Real(1)(dst, src, n);
}

}  // extern "C"
