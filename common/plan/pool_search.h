// Pool sizing: the smallest prefill and decode pools that meet latency SLOs
// for a workload, found by repeated simulation, and the colocated baseline.
#pragma once

#include <string>
#include <vector>

#include "plan/pool_simulator.h"
#include "util/status.h"

namespace pd::plan {

struct PoolSearchConfig {
  int max_ranks_per_pool = 256;  // give up beyond this many ranks in one pool
};

struct PoolPlan {
  bool feasible = false;
  std::string reason;  // why not, when not feasible
  int prefill_ranks = 0;
  int decode_ranks = 0;
  SimResult disaggregated;          // at (prefill_ranks, decode_ranks)
  SimResult colocated_same_total;   // colocated pool of prefill_ranks + decode_ranks ranks
  int colocated_min_ranks = 0;      // smallest colocated pool meeting the SLOs; 0 if none within the cap
  SimResult colocated_min;
  int simulations = 0;              // runs it took
};

// Finds the smallest prefill pool P meeting the TTFT SLO (with a decode pool
// large enough not to interfere), then the smallest decode pool D meeting the
// TPOT SLO with P, then checks (P, D) together (growing whichever pool misses).
// Each one-dimensional search doubles, then bisects, assuming more ranks never
// hurt. `base` supplies everything but the pool sizes. Infeasible (feasible =
// false, with a reason) when a single request alone misses an SLO or a pool
// would exceed the cap; errors only for invalid input.
Result<PoolPlan> plan_pools(const Workload& w, const ClusterConfig& base, const PhaseCostModel& cost,
                            const Slo& slo, const PoolSearchConfig& search);

// Why no cluster can meet the SLOs when one typical request alone misses one
// (a prefill of the mean prompt above the TTFT target, or a batch-1 decode
// step at its mean context above the TPOT target); empty otherwise.
std::string lone_request_miss(const Workload& w, const PhaseCostModel& cost, const Slo& slo);

// ---- Which layout for N ranks: colocated xN or xP+yD ---------------------------

struct LayoutResult {
  std::string name;  // "colocated x2", "1P+1D"
  bool colocated = false;
  int prefill_ranks = 0;  // 0 when colocated
  int decode_ranks = 0;   // colocated: all N
  SimResult result;
};

struct LayoutAnswer {
  int ranks = 0;
  std::vector<LayoutResult> layouts;  // colocated xN, then 1P+(N-1)D ... (N-1)P+1D
  int recommended = 0;                // index into layouts
  std::string reason;                 // lone_request_miss: why no layout can meet the SLOs, if it says
};

// Simulates colocated xN and every xP+yD with x + y = N on the same requests;
// `base` supplies everything but the pool sizes (chunking, budgets, KV pools).
// InvalidArgument for bad input (ranks < 1 or above 1,024, a bad workload or config).
Result<LayoutAnswer> compare_layouts(const Workload& w, const ClusterConfig& base, const PhaseCostModel& cost,
                                     const Slo& slo, int ranks);
// The rule: the highest goodput; on a tie (equal within 1e-9 relative) the
// lower TTFT p90, then the earlier layout. -1 when `layouts` is empty.
int recommend_layout(const std::vector<LayoutResult>& layouts);

}  // namespace pd::plan
