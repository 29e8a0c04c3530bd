// Preset lookups shared by the planner's tests; a missing preset fails the test.
#pragma once

#include <catch2/catch.hpp>

#include "plan/hardware.h"
#include "plan/model_spec.h"
#include "plan/pool_simulator.h"

namespace pd::plan::test {

inline ModelSpec preset(const char* name) {
  auto r = model_preset(name);
  REQUIRE(r.is_ok());
  return *r;
}

inline HardwareSpec hw(const char* name) {
  auto r = hardware_preset(name);
  REQUIRE(r.is_ok());
  return *r;
}

// Every request the same length.
inline LengthDist fixed(double n) {
  LengthDist d;
  d.kind = LengthDist::Kind::kFixed;
  d.a = n;
  return d;
}

// One simulation that must succeed.
inline SimResult run(const Workload& w, const ClusterConfig& c, const PhaseCostModel& cost, const Slo& slo = Slo{}) {
  auto r = simulate(w, c, cost, slo);
  REQUIRE(r.is_ok());
  return *r;
}

}  // namespace pd::plan::test
