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
// Chunked prefill (ClusterConfig::chunk_tokens > 0), the engine's policy: a
// pass computes prompt chunks chosen by ChunkPlanner (below); a prompt is
// computed over several passes of the rank that started it, and its first
// token (and its KV handoff, overlapped with its last chunk's pass only) comes
// at the end of the pass computing its last chunk. A colocated rank then runs
// mixed steps: every running decode (one token each) plus prompt chunks under
// a prompt budget of max(step_tokens - running, step_tokens / 4), costing the
// decode step plus the chunks' pass; a prompt whose last chunk ran joins the
// running decodes (running + partly computed prompts <= max_decode_batch).
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

#include "plan/phase_cost.h"
#include "plan/workload.h"
#include "serving/prefill_chunks.h"
#include "util/status.h"

namespace pd::plan {

// ---- Cluster -------------------------------------------------------------------

struct ClusterConfig {
  bool colocated = false;
  int prefill_ranks = 1;             // disaggregated
  int decode_ranks = 1;              // disaggregated; colocated: the rank count
  int64_t prefill_token_budget = 8192;  // prompt tokens per prefill pass (unchunked: a longer prompt runs alone)
  int64_t chunk_tokens = 0;          // chunked prefill: at most this many tokens of a longer prompt per pass; 0 = off
  int64_t step_tokens = 256;         // colocated, chunked: cost per step (decodes 1 each, prompts the rest)
  int64_t context_cost_tokens = 0;   // chunked: a token at context position p costs 1 + p / this (0: 1)
  int max_prefill_batch = 256;       // prompts per prefill pass
  int max_decode_batch = 256;        // running sequences per decode (or colocated) rank
  int block_size = 16;               // tokens per KV block
  int64_t decode_kv_blocks = 0;      // KV pool of a decode (or colocated) rank, in blocks (> 0)
  int64_t prefill_kv_blocks = 0;     // KV a prefill rank can hold awaiting handoff; 0: unlimited
  bool overlap_transfer = true;      // send KV layer by layer during the prefill pass
  double warmup_fraction = 0.1;      // first requests left out of the statistics
  double cooldown_fraction = 0.05;   // last requests left out (the tail of the run is under less load)
  bool record_requests = false;      // fill SimResult::per_request
};
Status validate_cluster(const ClusterConfig& c);

// ---- Chunked prefill ----------------------------------------------------------------
// A pass (a prefill rank's, or the prompt share of a colocated step) is built
// by the engine's own rule, pd::ChunkPlanner (serving/prefill_chunks.h): the
// same code the workers run, fed the simulated prompts in arrival order.

struct Slo {
  double ttft_seconds = 1.0;   // time to first token
  double tpot_seconds = 0.1;   // time per output token after the first
  double quantile = 0.9;       // both must hold at this quantile
};

struct LatencyStats {
  double mean = 0, p50 = 0, p90 = 0, p99 = 0, max = 0;
  double at_quantile = 0;  // at Slo::quantile
};

// One request's simulated times (seconds from the start of the workload).
struct RequestTiming {
  double arrival = 0;
  double prefill_start = -1;  // its first prefill pass began
  double first_token = -1;
  double done = -1;
  double worst_gap = 0;       // its longest gap between two tokens
  int32_t prompt = 0;
  int32_t output = 0;
  bool failed = false;
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
  LatencyStats worst_gap;       // per request (>= 2 output tokens): its longest gap between two tokens
  double throughput_rps = 0;    // measured completions / measurement window
  double goodput_rps = 0;       // measured requests within both SLOs / window
  double slo_attainment = 0;    // fraction of measured requests within both SLOs
  bool meets_slo = false;       // ttft and tpot at Slo::quantile within the SLO
  double output_tokens_per_second = 0;
  double mean_decode_batch = 0;  // averaged over decode steps
  double prefill_utilization = 0;  // busy fraction of prefill work (colocated: of all work)
  double decode_utilization = 0;
  int64_t max_router_queue = 0;
  std::vector<RequestTiming> per_request;  // every request in arrival order, with ClusterConfig::record_requests
};

// Runs one simulation. InvalidArgument naming the field for a bad workload or
// cluster config.
Result<SimResult> simulate(const Workload& w, const ClusterConfig& c, const PhaseCostModel& cost, const Slo& slo);

}  // namespace pd::plan
