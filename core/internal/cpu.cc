#include "core/internal/cpu.h"

#include <cstdlib>
#include <cstring>

namespace kvrelay {
namespace internal {

#if defined(__x86_64__)
bool Avx512Enabled() {
  static const bool use = [] {
    const char* off = std::getenv("KVRELAY_DISABLE_AVX512");
    if (off != nullptr && *off != '\0' && std::strcmp(off, "0") != 0) return false;
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return use;
}

bool Avx512ClmulEnabled() {
  static const bool use = Avx512Enabled() && __builtin_cpu_supports("vpclmulqdq") != 0;
  return use;
}
#else
bool Avx512Enabled() { return false; }
bool Avx512ClmulEnabled() { return false; }
#endif

}  // namespace internal
}  // namespace kvrelay
