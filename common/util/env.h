// What a worker reads of the world outside its own state: the time, and
// whether another rank's process has ended. One seam (as LevelDB's Env), so
// that deadline and liveness logic is tested by stepping a fake clock and
// declaring processes gone, not by sleeping and killing.
//
// The cluster runs its workers on ClusterEnv (protocol/cluster_env.h: the
// steady clock, and a rank is gone when its pid on this host has ended); tests
// use FakeEnv (tests/fake_env.h).
//
// Threading: now() and rank_gone() may be called from any thread.
#pragma once

#include <chrono>

namespace pd {

class Env {
 public:
  using Clock = std::chrono::steady_clock;
  virtual ~Env() = default;
  virtual Clock::time_point now() const { return Clock::now(); }
  // Whether `rank`'s process is known to have ended: nothing it began can
  // still write anywhere. False when it cannot be known (default).
  virtual bool rank_gone(int rank) const {
    (void)rank;
    return false;
  }
};

// A span of the clock in seconds (the unit every reported timing uses).
inline double seconds(Env::Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// The steady clock, and no process ever known gone.
inline const Env& system_env() {
  static const Env env;
  return env;
}

}  // namespace pd
