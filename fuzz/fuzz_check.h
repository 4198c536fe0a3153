// FUZZ_CHECK(cond): a property every input must keep. On failure prints the
// condition and aborts, which libFuzzer reports as a crash with the input.
#ifndef KVRELAY_FUZZ_FUZZ_CHECK_H_
#define KVRELAY_FUZZ_FUZZ_CHECK_H_

#include <cstdio>
#include <cstdlib>

#define FUZZ_CHECK(cond)                                                              \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      std::fprintf(stderr, "%s:%d: FUZZ_CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                   \
    }                                                                                 \
  } while (0)

#endif  // KVRELAY_FUZZ_FUZZ_CHECK_H_
