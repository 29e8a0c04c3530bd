// The tests' Env (util/env.h): a clock that moves only when the test says so,
// and processes that end when the test says so. Its setters belong to the
// test's thread; now() and rank_gone() may be called from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>

#include "util/env.h"

namespace pd {

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
