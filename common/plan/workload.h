// The traffic a cluster serves: arrival rate and prompt/output length
// distributions, and a deterministic draw of the requests from a seed.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "util/status.h"

namespace pd::plan {

// A distribution of token counts. Draws are rounded and clamped to [min, max].
struct LengthDist {
  enum class Kind { kFixed, kUniform, kExponential, kLognormal };
  Kind kind = Kind::kFixed;
  double a = 1;  // fixed: the value; uniform: low; exponential, lognormal: the mean
  double b = 0;  // uniform: high; lognormal: sigma of the underlying normal
  int64_t min = 1;
  int64_t max = int64_t{1} << 24;
  double mean() const;  // before clamping
};
// "512" or "fixed:512", "uniform:128:2048", "exp:512", "lognormal:512:0.8".
// InvalidArgument naming `what` (e.g. "--prompt-len") on a bad spec.
Result<LengthDist> parse_length_dist(std::string_view text, std::string_view what);
std::string length_dist_to_string(const LengthDist& d);

// One request of a drawn workload.
struct DrawnRequest {
  double arrival = 0;  // seconds from the start
  int32_t prompt = 0;  // tokens
  int32_t output = 0;  // tokens generated, the first included
};

struct Workload {
  double arrival_rate = 1;   // requests per second
  bool poisson = true;       // false: evenly spaced arrivals
  LengthDist prompt;
  LengthDist output;         // tokens generated per request, first token included
  int64_t num_requests = 10'000;
  uint64_t seed = 1;
  // A recorded or pre-generated request stream (arrivals ascending). When
  // non-empty it is the workload: draw_workload returns it as it is, and the
  // fields above describe it (trace_workload sets them from it).
  std::vector<DrawnRequest> trace;
};
Status validate_workload(const Workload& w);

// A trace file as load generators replay it (the Mooncake trace format that
// AIPerf's --custom-dataset-type mooncake_trace reads): one JSON object per
// line, {"timestamp": ms, "input_length": tokens, "output_length": tokens};
// other fields are ignored, timestamps must not decrease. The workload's rate
// is requests over the span of arrivals, its lengths fixed at the trace's means
// (used only for the search's feasibility check). Errors name the file and line.
Result<Workload> trace_workload(const std::string& path);
// Draws `w.num_requests` requests: arrival gaps, prompt and output lengths each
// from its own stream seeded from `w.seed` (changing one distribution leaves the
// others' draws unchanged). Bit-identical for a seed on every platform (no
// std:: distributions). `w` must be valid.
std::vector<DrawnRequest> draw_workload(const Workload& w);

}  // namespace pd::plan
