// Engine profile parsing, validation and interpolation.
#include <catch2/catch.hpp>

#include <string>

#include "plan/engine_profile.h"
#include "plan/phase_cost.h"

using namespace pd::plan;

namespace {
const char* kProfile = R"({
  "format": "pd-engine-profile", "version": 1, "model": "m", "hardware": "h",
  "prefill": [{"tokens": 256, "seconds": 0.4}, {"tokens": 64, "seconds": 0.1}],
  "decode": [{"batch": 1, "context": 100, "seconds": 0.010}, {"batch": 1, "context": 300, "seconds": 0.014},
             {"batch": 4, "context": 100, "seconds": 0.020}, {"batch": 4, "context": 300, "seconds": 0.030}]
})";
}  // namespace

TEST_CASE("plan: engine profile interpolates prefill and decode", "[plan][profile]") {
  auto p = engine_profile_from_json(kProfile, "p.json");
  REQUIRE(p.is_ok());
  // Points are sorted: (64, 0.1), (256, 0.4).
  CHECK(p->prefill_time(64) == Approx(0.1));
  CHECK(p->prefill_time(160) == Approx(0.25));   // halfway
  CHECK(p->prefill_time(16) == Approx(0.1));     // below the first point: its time
  CHECK(p->prefill_time(512) == Approx(0.8));    // slope 0.3 / 192 continues: 0.4 + 256 x 0.3/192
  // Decode: bilinear on the (batch, context) grid.
  CHECK(p->decode_step_time(1, 100) == Approx(0.010));
  CHECK(p->decode_step_time(4, 300) == Approx(0.030));
  CHECK(p->decode_step_time(1, 200) == Approx(0.012));
  // batch 2.5 (halfway), context 200: rows 0.012 and 0.025 -> 0.0185.
  CHECK(p->decode_step_time(2.5, 200) == Approx(0.0185));
  // Beyond the grid: batch 7 continues batch's last slope at context 100: 0.020 + 3 x 0.010/3 = 0.030.
  CHECK(p->decode_step_time(7, 100) == Approx(0.030));
  // Round trip through the writer.
  auto again = engine_profile_from_json(engine_profile_to_json(*p), "round-trip");
  REQUIRE(again.is_ok());
  CHECK(again->decode_step_time(2.5, 200) == Approx(0.0185));
}

TEST_CASE("plan: shipped example engine profile loads", "[plan][profile]") {
  auto p = engine_profile_from_file(std::string(PD_TEST_DATA_DIR) + "/plan_engine_profile_example.json");
  REQUIRE(p.is_ok());
  CHECK(p->prefill_tokens.size() == 4);
  CHECK(p->decode_batches.size() == 3);
  CHECK(p->decode_contexts.size() == 2);
  CHECK(p->kv_transfer_bytes_per_second == Approx(9e9));
  // Step time grows with batch and with context.
  CHECK(p->decode_step_time(16, 512) > p->decode_step_time(8, 512));
  CHECK(p->decode_step_time(16, 1024) > p->decode_step_time(16, 512));
}

TEST_CASE("plan: bad engine profiles are errors naming the field", "[plan][profile]") {
  struct Case {
    const char* json;
    const char* needle;
  };
  const Case cases[] = {
      {R"({"format": "other", "version": 1})", "format"},
      {R"({"format": "pd-engine-profile", "version": 2})", "version"},
      {R"({"format": "pd-engine-profile", "version": 1, "decode": []})", "prefill"},
      {R"({"format": "pd-engine-profile", "version": 1, "prefill": [{"tokens": 0, "seconds": 1}],
           "decode": [{"batch": 1, "context": 1, "seconds": 1}]})", "tokens"},
      {R"({"format": "pd-engine-profile", "version": 1, "prefill": [{"tokens": 8}],
           "decode": [{"batch": 1, "context": 1, "seconds": 1}]})", "seconds"},
      {R"({"format": "pd-engine-profile", "version": 1, "prefill": [{"tokens": 8, "seconds": 1}]})", "decode"},
      {R"({"format": "pd-engine-profile", "version": 1, "prefill": [{"tokens": 8, "seconds": 1}],
           "decode": [{"batch": 1, "context": 1, "seconds": 1}, {"batch": 2, "context": 2, "seconds": 1}]})",
       "grid"},
      {R"({"format": "pd-engine-profile", "version": 1, "prefill": [{"tokens": 8, "seconds": 1}],
           "decode": [{"batch": -1, "context": 1, "seconds": 1}]})", "batch"},
      {R"({"format": "pd-engine-profile", "version": 1, "prefill": [{"tokens": 8, "seconds": 1},
           {"tokens": 8, "seconds": 2}], "decode": [{"batch": 1, "context": 1, "seconds": 1}]})", "tokens = 8"},
      {"[1, 2", "not valid JSON"},
  };
  for (const Case& c : cases) {
    INFO(c.json);
    auto p = engine_profile_from_json(c.json, "bad.json");
    REQUIRE_FALSE(p.is_ok());
    CHECK(p.status().message().find(c.needle) != std::string::npos);
    CHECK(p.status().message().find("bad.json") != std::string::npos);
  }
}

TEST_CASE("plan: a pass of several prompts is charged attention within each prompt only", "[plan][profile]") {
  // Single prompts of n tokens cost exactly a + b n + c n^2, measured at seven lengths.
  const double a = 0.01, b = 1e-3, c = 2e-6;
  auto t = [&](double n) { return a + b * n + c * n * n; };
  EngineProfile prof;
  for (double n : {64, 128, 256, 512, 1024, 2048, 4096}) {
    prof.prefill_tokens.push_back(n);
    prof.prefill_seconds.push_back(t(n));
  }
  prof.decode_batches = {1};
  prof.decode_contexts = {128};
  prof.decode_seconds = {0.01};
  ProfileCostModel cost(prof, 1000, 30, 1e9, 0);
  CHECK(cost.prefill_quadratic_coefficient() == Approx(c).epsilon(1e-6));
  // One prompt: the profile itself.
  CHECK(cost.prefill_seconds(1024, 1, 1024.0 * 1024) == Approx(t(1024)));
  // Four prompts of 256 in one pass: the linear part for 1,024 tokens, attention for four 256s
  // (not one 1,024-token prompt's, which costs 2.9x as much here).
  const double four = cost.prefill_seconds(1024, 4, 4 * 256.0 * 256);
  CHECK(four == Approx(a + b * 1024 + c * 4 * 256 * 256).epsilon(0.02));
  CHECK(four < t(1024));
  // Uneven prompts, 3,000 + 1,000 tokens: never below the longest prompt alone.
  const double uneven = cost.prefill_seconds(4000, 2, 3000.0 * 3000 + 1000.0 * 1000);
  CHECK(uneven == Approx(a + b * 4000 + c * (3000.0 * 3000 + 1000.0 * 1000)).epsilon(0.02));
  CHECK(uneven > t(3000));
  // Fewer than three points: no fitted term, the profile's total-token time as before.
  EngineProfile two = prof;
  two.prefill_tokens.resize(2);
  two.prefill_seconds.resize(2);
  ProfileCostModel flat(two, 1000, 30, 1e9, 0);
  CHECK(flat.prefill_quadratic_coefficient() == 0);
  CHECK(flat.prefill_seconds(1024, 4, 4 * 256.0 * 256) == Approx(two.prefill_time(1024)));
}
