// Preset lookups shared by the planner's tests; a missing preset fails the test.
#pragma once

#include <catch2/catch.hpp>

#include "plan/hardware.h"
#include "plan/model_spec.h"

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

}  // namespace pd::plan::test
