#include "server/store/spool/crash_point.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

namespace kvrelay {

namespace {

struct Armed {
  std::string name;
  long after = 1;  // crash on this hit
  std::atomic<long> hits{0};
};

Armed* Arm() {
  const char* v = std::getenv("KVRELAY_CRASH_POINT");
  if (!v || !*v) return nullptr;
  auto* a = new Armed();
  a->name = v;
  if (auto colon = a->name.find(':'); colon != std::string::npos) {
    a->after = std::max(1L, std::strtol(a->name.c_str() + colon + 1, nullptr, 10));
    a->name.resize(colon);
  }
  return a;
}

}  // namespace

void CrashPoint(const char* name) {
  static Armed* const armed = Arm();
  if (!armed || armed->name != name) return;
  if (armed->hits.fetch_add(1) + 1 < armed->after) return;
  static const char kMsg[] = "kvrelay: KVRELAY_CRASH_POINT reached, killing the process\n";
  (void)!::write(2, kMsg, sizeof(kMsg) - 1);
  ::kill(::getpid(), SIGKILL);
  ::pause();
}

}  // namespace kvrelay
