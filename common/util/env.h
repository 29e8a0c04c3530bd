// What a worker reads of the world outside its own state: the time, and
// whether another rank's process has ended. One seam (as LevelDB's Env), so
// that deadline and liveness logic is tested by stepping a fake clock and
// declaring processes gone, not by sleeping and killing.
//
// The cluster runs its workers on ClusterEnv (protocol/cluster_env.h: the
// steady clock, and a rank is gone when its pid on this host has ended); tests
// use FakeEnv.
//
// Threading: now() and rank_gone() may be called from any thread; FakeEnv's
// setters belong to the test's thread.
#pragma once

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>

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

// A clock that moves only when told to, and processes that end when told to.
class FakeEnv final : public Env {
 public:
  Clock::time_point now() const override { return Clock::time_point(Clock::duration(ticks_.load())); }
  void advance(Clock::duration d) { ticks_ += d.count(); }
  bool rank_gone(int rank) const override {
    std::lock_guard lock(mu_);
    return gone_.count(rank) > 0;
  }
  void set_gone(int rank) {
    std::lock_guard lock(mu_);
    gone_.insert(rank);
  }

 private:
  // Starts far from zero, so "long ago" (a default time_point) is in the past.
  std::atomic<Clock::rep> ticks_{std::chrono::duration_cast<Clock::duration>(std::chrono::hours(1)).count()};
  mutable std::mutex mu_;
  std::set<int> gone_;
};

}  // namespace pd
