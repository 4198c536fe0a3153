// Which instruction sets the kernels may use (internal to kvrelay_core).
#ifndef KVRELAY_CORE_INTERNAL_CPU_H_
#define KVRELAY_CORE_INTERNAL_CPU_H_

namespace kvrelay {
namespace internal {

// True when the CPU has AVX-512F and the environment variable
// KVRELAY_DISABLE_AVX512 is unset, empty or "0". Read once per process;
// thread-safe. Always false on other architectures.
bool Avx512Enabled();

// Avx512Enabled() and the CPU also has VPCLMULQDQ (carry-less multiplies
// on 512-bit registers).
bool Avx512ClmulEnabled();

}  // namespace internal
}  // namespace kvrelay

#endif  // KVRELAY_CORE_INTERNAL_CPU_H_
