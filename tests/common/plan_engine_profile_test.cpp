// Engine profile parsing, validation and interpolation.
#include <catch2/catch.hpp>

#include <string>

#include "plan/engine_profile.h"

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
