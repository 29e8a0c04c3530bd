// Discrete-event simulation of a disaggregated (prefill pool + decode pool) or
// colocated serving cluster, for pool sizing.
//
// What is modelled: Poisson (or evenly spaced) arrivals into one FIFO router
// queue; prefill ranks that pull batches from it under a token budget; KV
// handoff to the decode rank with the most free blocks, only when that rank has
// the blocks (pull, flow control) and over links of finite bandwidth, overlapped
// layer by layer with the prefill compute; decode ranks running continuous
// batching over a paged KV pool (admission with a 1% watermark, preemption of
// the newest sequence when a step cannot get its blocks, which then re-enters
// the router queue at the front for recompute). Colocated ranks do both phases,
// prefill first (a prefill pass stalls the rank's running decodes).
//
// Deterministic for a given seed: the workload (arrival times and lengths) is
// drawn up front from per-stream generators, independent of the cluster config,
// so two configs are compared on exactly the same requests.
//
// Cost: O(E log E) in events plus O(total output tokens) work; ~10^5 requests
// per second of wall time for typical workloads. Not thread-safe; no globals.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "plan/engine_profile.h"
#include "plan/hardware.h"
#include "plan/model_spec.h"
#include "plan/roofline.h"
#include "util/status.h"

namespace pd::plan {

// ---- Workload ------------------------------------------------------------------

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

struct Workload {
  double arrival_rate = 1;   // requests per second
  bool poisson = true;       // false: evenly spaced arrivals
  LengthDist prompt;
  LengthDist output;         // tokens generated per request, first token included
  int64_t num_requests = 10'000;
  uint64_t seed = 1;
};
Status validate_workload(const Workload& w);

// ---- Phase costs ---------------------------------------------------------------

// What the simulator asks of a rank. Implementations must be pure functions.
class PhaseCostModel {
 public:
  virtual ~PhaseCostModel() = default;
  // One prefill pass over `num_prompts` prompts, `total_tokens` tokens in all,
  // squared lengths summing to `sum_sq_tokens`.
  virtual double prefill_seconds(double total_tokens, double num_prompts, double sum_sq_tokens) const = 0;
  // One decode step of `batch` sequences at mean context `mean_context`.
  virtual double decode_step_seconds(double batch, double mean_context) const = 0;
  // Wire time of one sequence's KV cache of `tokens` tokens between two ranks.
  virtual double kv_transfer_seconds(double tokens) const = 0;
  virtual double kv_transfer_latency() const = 0;
  // Layers the KV is sent in (overlap granularity); >= 1.
  virtual int transfer_chunks() const = 0;
};

// Costs from the roofline model of `model` on `hw` (a rank = `cfg.tp` devices;
// the rank's KV link is `tp` NICs of hw.inter_node_bandwidth each).
class RooflineCostModel final : public PhaseCostModel {
 public:
  RooflineCostModel(ModelSpec model, HardwareSpec hw, RooflineConfig cfg);
  double prefill_seconds(double total_tokens, double num_prompts, double sum_sq_tokens) const override;
  double decode_step_seconds(double batch, double mean_context) const override;
  double kv_transfer_seconds(double tokens) const override;
  double kv_transfer_latency() const override { return hw_.link_latency; }
  int transfer_chunks() const override { return model_.n_layers; }

 private:
  ModelSpec model_;
  HardwareSpec hw_;
  RooflineConfig cfg_;
  double kv_bytes_per_token_ = 0;
};

// Costs from a measured engine profile; the KV link from the profile when it
// has one, else `link_bytes_per_second` / `link_latency`.
class ProfileCostModel final : public PhaseCostModel {
 public:
  ProfileCostModel(EngineProfile profile, double kv_bytes_per_token, int n_layers, double link_bytes_per_second,
                   double link_latency);
  double prefill_seconds(double total_tokens, double num_prompts, double sum_sq_tokens) const override;
  double decode_step_seconds(double batch, double mean_context) const override;
  double kv_transfer_seconds(double tokens) const override;
  double kv_transfer_latency() const override { return latency_; }
  int transfer_chunks() const override { return n_layers_; }

 private:
  EngineProfile profile_;
  double kv_bytes_per_token_;
  int n_layers_;
  double link_bw_;
  double latency_;
};

// Affine costs, for tests and what-ifs: prefill = p0 + p1 x tokens; decode step
// = d0 + d1 x batch + d2 x batch x context; transfer = tokens x bytes_per_token / bw.
struct LinearCosts {
  double prefill_fixed = 0, prefill_per_token = 0;
  double decode_fixed = 0, decode_per_seq = 0, decode_per_context_token = 0;
  double kv_bytes_per_token = 0, link_bytes_per_second = 1e12, link_latency = 0;
  int chunks = 1;
};
class LinearCostModel final : public PhaseCostModel {
 public:
  explicit LinearCostModel(LinearCosts c) : c_(c) {}
  double prefill_seconds(double total_tokens, double, double) const override {
    return c_.prefill_fixed + c_.prefill_per_token * total_tokens;
  }
  double decode_step_seconds(double batch, double mean_context) const override {
    return c_.decode_fixed + c_.decode_per_seq * batch + c_.decode_per_context_token * batch * mean_context;
  }
  double kv_transfer_seconds(double tokens) const override {
    return tokens * c_.kv_bytes_per_token / c_.link_bytes_per_second;
  }
  double kv_transfer_latency() const override { return c_.link_latency; }
  int transfer_chunks() const override { return c_.chunks; }

 private:
  LinearCosts c_;
};

// ---- Cluster -------------------------------------------------------------------

struct ClusterConfig {
  bool colocated = false;
  int prefill_ranks = 1;             // disaggregated
  int decode_ranks = 1;              // disaggregated; colocated: the rank count
  int64_t prefill_token_budget = 8192;  // tokens per prefill pass (a longer prompt runs alone)
  int max_prefill_batch = 256;       // prompts per prefill pass
  int max_decode_batch = 256;        // running sequences per decode (or colocated) rank
  int block_size = 16;               // tokens per KV block
  int64_t decode_kv_blocks = 0;      // KV pool of a decode (or colocated) rank, in blocks (> 0)
  int64_t prefill_kv_blocks = 0;     // KV a prefill rank can hold awaiting handoff; 0: unlimited
  bool overlap_transfer = true;      // send KV layer by layer during the prefill pass
  double warmup_fraction = 0.1;      // first requests left out of the statistics
  double cooldown_fraction = 0.05;   // last requests left out (the drain runs under less load)
};
Status validate_cluster(const ClusterConfig& c);

struct Slo {
  double ttft_seconds = 1.0;   // time to first token
  double tpot_seconds = 0.1;   // time per output token after the first
  double quantile = 0.9;       // both must hold at this quantile
};

struct LatencyStats {
  double mean = 0, p50 = 0, p90 = 0, p99 = 0, max = 0;
  double at_quantile = 0;  // at Slo::quantile
};

struct SimResult {
  int64_t requests = 0;         // simulated
  int64_t measured = 0;         // in the statistics window
  int64_t completed = 0;
  int64_t failed = 0;           // could never fit a rank's KV pool
  int64_t preemptions = 0;
  double makespan_seconds = 0;  // last completion
  LatencyStats ttft;            // seconds
  LatencyStats tpot;            // seconds per token, requests with >= 2 output tokens
  LatencyStats e2e;
  LatencyStats queue_wait;      // arrival -> first prefill pass starts
  double throughput_rps = 0;    // measured completions / measurement window
  double goodput_rps = 0;       // measured requests within both SLOs / window
  double slo_attainment = 0;    // fraction of measured requests within both SLOs
  bool meets_slo = false;       // ttft and tpot at Slo::quantile within the SLO
  double output_tokens_per_second = 0;
  double mean_decode_batch = 0;  // averaged over decode steps
  double prefill_utilization = 0;  // busy fraction of prefill work (colocated: of all work)
  double decode_utilization = 0;
  int64_t max_router_queue = 0;
};

// Runs one simulation. InvalidArgument naming the field for a bad workload or
// cluster config.
Result<SimResult> simulate(const Workload& w, const ClusterConfig& c, const PhaseCostModel& cost, const Slo& slo);

}  // namespace pd::plan
