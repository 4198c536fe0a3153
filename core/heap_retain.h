// Keeps freed heap memory for reuse instead of returning it to the kernel.
//
// A relay client or server allocates and frees a turn's worth of megabyte
// tensors per message. With glibc's defaults those come from mmap, or are
// trimmed off the heap once freed, and the next message faults every page
// in again: ~35 ms of CPU per 90 MB turn on a VM, as much as the transfer
// itself. RetainFreedHeap(n) sets glibc's trim threshold to n bytes and its
// mmap threshold to min(n, 32 MiB), so tensors come from the heap and up to
// n freed bytes stay mapped for the next message. Process-wide: call it
// once from main(), before the threads start. The MALLOC_TRIM_THRESHOLD_
// and MALLOC_MMAP_THRESHOLD_ environment variables, when set, win.
// n == 0 changes nothing. The library never calls it on its own.
#ifndef KVRELAY_CORE_HEAP_RETAIN_H_
#define KVRELAY_CORE_HEAP_RETAIN_H_

#include <malloc.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>

namespace kvrelay {

// What kvrelay-server (--heap-retain-bytes) and kvrelayctl retain.
inline constexpr uint64_t kDefaultHeapRetainBytes = uint64_t{128} << 20;
// The most RetainFreedHeap honours (glibc's thresholds are ints).
inline constexpr uint64_t kMaxHeapRetainBytes = INT_MAX;

inline void RetainFreedHeap(uint64_t bytes) {
  if (bytes == 0) return;
  constexpr uint64_t kMaxMmapThreshold = uint64_t{32} << 20;  // glibc's cap on 64-bit
  const uint64_t retain = std::min<uint64_t>(bytes, kMaxHeapRetainBytes);
  if (std::getenv("MALLOC_TRIM_THRESHOLD_") == nullptr) mallopt(M_TRIM_THRESHOLD, static_cast<int>(retain));
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") == nullptr) {
    mallopt(M_MMAP_THRESHOLD, static_cast<int>(std::min(retain, kMaxMmapThreshold)));
  }
}

}  // namespace kvrelay

#endif  // KVRELAY_CORE_HEAP_RETAIN_H_
