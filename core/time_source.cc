#include "core/time_source.h"

namespace kvrelay {
namespace {

class RealTimeSource final : public TimeSource {
 public:
  TimePoint Now() override { return std::chrono::steady_clock::now(); }
  bool WaitUntil(CondVar* cv, Mutex* mu, TimePoint deadline) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return cv->WaitUntil(mu, deadline);
  }
};

}  // namespace

TimeSource* TimeSource::Real() {
  static RealTimeSource* const real = new RealTimeSource;
  return real;
}

}  // namespace kvrelay
