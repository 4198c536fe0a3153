// Instructions per byte of libc's memcpy on this machine, as callgrind counts
// them: bench/cost_bench.py --callgrind runs this under
// `valgrind --tool=callgrind` and reads the inclusive instruction count of
// each CopyMany<S> (S bytes per call), divided by the bytes it copied. The
// relay's memcpy/memmove instructions divided by these figures and by the
// message's bytes estimate how many times the relay copies each byte.
//
// glibc picks its memcpy at load time from the CPU valgrind reports, so the
// figure is for the variant a relay under callgrind runs, not necessarily
// the one it runs natively. Each size copies about kBytesPerSize bytes
// between two pre-touched buffers; plain main, no output but a summary line.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

constexpr size_t kBytesPerSize = size_t{256} << 20;

template <size_t S>
__attribute__((noinline)) size_t CopyMany(uint8_t* a, uint8_t* b, size_t cap) {
  size_t copied = 0, off = 0;
  size_t n = S;
  asm volatile("" : "+r"(n));  // a size the compiler cannot see: a real call, as in the relay
  for (size_t i = 0; i < kBytesPerSize / S; ++i) {
    if (off + S > cap) off = 0;
    // Alternate directions so neither buffer stays hot only one way.
    if (i & 1) {
      std::memcpy(a + off, b + off, n);
    } else {
      std::memcpy(b + off, a + off, n);
    }
    off += S;
    copied += S;
  }
  asm volatile("" : : "r"(a), "r"(b) : "memory");
  return copied;
}

}  // namespace

int main() {
  const size_t cap = size_t{64} << 20;
  std::vector<uint8_t> a(cap, 1), b(cap, 2);
  size_t total = 0;
  total += CopyMany<256>(a.data(), b.data(), cap);
  total += CopyMany<4096>(a.data(), b.data(), cap);
  total += CopyMany<16384>(a.data(), b.data(), cap);
  total += CopyMany<65536>(a.data(), b.data(), cap);
  total += CopyMany<1048576>(a.data(), b.data(), cap);
  total += CopyMany<16777216>(a.data(), b.data(), cap);
  std::printf("copy_calibration copied=%zu bytes_per_size=%zu\n", total, kBytesPerSize);
  return a[cap / 2] == 0;
}
