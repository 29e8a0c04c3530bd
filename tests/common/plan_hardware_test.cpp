// The CPU probe: runs, returns plausible positive rates, rejects bad config.
#include <catch2/catch.hpp>

#include "plan/hardware.h"

using namespace pd::plan;

TEST_CASE("plan: CPU probe measures positive bandwidth and FLOP rate", "[plan][hardware]") {
  CpuProbeConfig cfg;
  cfg.threads = 1;
  cfg.triad_array_bytes = 8 << 20;  // small and quick; the CLI uses 64 MiB arrays
  cfg.repetitions = 2;
  cfg.fma_seconds = 0.02;
  auto r = measure_cpu(cfg);
  REQUIRE(r.is_ok());
  // Anything that runs this test moves more than 100 MB/s and 100 MFLOP/s, and less than 100 TB/s.
  CHECK(r->triad_bytes_per_second > 1e8);
  CHECK(r->triad_bytes_per_second < 1e14);
  CHECK(r->fma_flops_per_second > 1e8);
  const HardwareSpec h = hardware_from_probe(*r, *hardware_preset("cpu-2core"));
  CHECK(h.name == "measured-cpu");
  CHECK(h.ridge_intensity() > 0);
  CHECK(validate_hardware(h).is_ok());
}

TEST_CASE("plan: CPU probe rejects bad config naming the field", "[plan][hardware]") {
  CpuProbeConfig cfg;
  cfg.threads = 0;
  auto a = measure_cpu(cfg);
  REQUIRE_FALSE(a.is_ok());
  CHECK(a.status().message().find("threads") != std::string::npos);
  cfg.threads = 1;
  cfg.triad_array_bytes = 100;
  auto b = measure_cpu(cfg);
  REQUIRE_FALSE(b.is_ok());
  CHECK(b.status().message().find("triad_array_bytes") != std::string::npos);
}
