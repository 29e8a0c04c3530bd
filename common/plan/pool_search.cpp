#include "plan/pool_search.h"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace pd::plan {
namespace {

class Searcher {
 public:
  Searcher(const Workload& w, const ClusterConfig& base, const PhaseCostModel& cost, const Slo& slo, int cap)
      : w_(w), base_(base), cost_(cost), slo_(slo), cap_(cap) {}

  Result<SimResult> run(bool colocated, int prefill, int decode) {
    ClusterConfig c = base_;
    c.colocated = colocated;
    c.prefill_ranks = colocated ? 1 : prefill;
    c.decode_ranks = decode;
    ++simulations;
    return simulate(w_, c, cost_, slo_);
  }

  // Smallest x in [lo, cap] for which ok(x) holds, assuming ok is monotone in x
  // (doubling, then bisection); 0 when even cap fails.
  template <typename Ok>
  Result<int> smallest(int lo, Ok ok) {
    int x = std::max(1, lo);
    int last_fail = x - 1;
    while (true) {
      PD_ASSIGN_OR_RETURN(bool good, ok(x));
      if (good) break;
      last_fail = x;
      if (x >= cap_) return 0;
      x = std::min(cap_, x * 2);
    }
    int a = last_fail, b = x;
    while (b - a > 1) {
      const int m = a + (b - a) / 2;
      PD_ASSIGN_OR_RETURN(bool good, ok(m));
      if (good) {
        b = m;
      } else {
        a = m;
      }
    }
    return b;
  }

  int cap() const { return cap_; }
  int simulations = 0;

 private:
  const Workload& w_;
  const ClusterConfig& base_;
  const PhaseCostModel& cost_;
  const Slo& slo_;
  int cap_;
};

std::string fmt(double v) {
  std::ostringstream s;
  s.precision(4);
  s << v;
  return s.str();
}

}  // namespace

std::string lone_request_miss(const Workload& w, const PhaseCostModel& cost, const Slo& slo) {
  const double p = w.prompt.mean();
  const double one_prefill = cost.prefill_seconds(p, 1, p * p);
  if (one_prefill > slo.ttft_seconds) {
    return "one prompt of " + fmt(p) + " tokens alone takes " + fmt(one_prefill) +
           " s to prefill, above the TTFT SLO of " + fmt(slo.ttft_seconds) + " s";
  }
  const double ctx = p + w.output.mean() / 2;
  const double one_step = cost.decode_step_seconds(1, ctx);
  if (one_step > slo.tpot_seconds) {
    return "one decode step of a single sequence at context " + fmt(ctx) + " takes " + fmt(one_step) +
           " s, above the TPOT SLO of " + fmt(slo.tpot_seconds) + " s";
  }
  return "";
}

Result<PoolPlan> plan_pools(const Workload& w, const ClusterConfig& base, const PhaseCostModel& cost,
                            const Slo& slo, const PoolSearchConfig& search) {
  PD_RETURN_IF_ERROR(validate_workload(w));
  {
    ClusterConfig probe = base;
    probe.prefill_ranks = probe.decode_ranks = 1;
    PD_RETURN_IF_ERROR(validate_cluster(probe));
  }
  if (search.max_ranks_per_pool <= 0) {
    return Status::invalid_argument("max_ranks: must be positive, got " + std::to_string(search.max_ranks_per_pool));
  }
  PoolPlan plan;
  plan.reason = lone_request_miss(w, cost, slo);
  if (!plan.reason.empty()) return plan;

  Searcher s(w, base, cost, slo, search.max_ranks_per_pool);
  const int big = s.cap();
  // 1. Prefill pool for TTFT, with a decode pool that does not hold it back.
  PD_ASSIGN_OR_RETURN(int prefill, s.smallest(1, [&](int x) -> Result<bool> {
    PD_ASSIGN_OR_RETURN(SimResult r, s.run(false, x, big));
    return r.failed == 0 && r.ttft.at_quantile <= slo.ttft_seconds;
  }));
  if (prefill == 0) {
    plan.reason = "TTFT SLO not met with " + std::to_string(big) + " prefill ranks";
    plan.simulations = s.simulations;
    return plan;
  }
  // 2. Decode pool for TPOT with that prefill pool.
  PD_ASSIGN_OR_RETURN(int decode, s.smallest(1, [&](int x) -> Result<bool> {
    PD_ASSIGN_OR_RETURN(SimResult r, s.run(false, prefill, x));
    return r.failed == 0 && r.tpot.at_quantile <= slo.tpot_seconds;
  }));
  if (decode == 0) {
    plan.reason = "TPOT SLO not met with " + std::to_string(big) + " decode ranks";
    plan.simulations = s.simulations;
    return plan;
  }
  // 3. Both together; grow whichever pool misses (they interact through KV backpressure).
  SimResult joint;
  for (int tries = 0;; ++tries) {
    PD_ASSIGN_OR_RETURN(joint, s.run(false, prefill, decode));
    if (joint.meets_slo) break;
    if (tries >= 16 || prefill >= big || decode >= big) {
      plan.reason = "no pool sizes near (" + std::to_string(prefill) + ", " + std::to_string(decode) +
                    ") meet both SLOs together";
      plan.simulations = s.simulations;
      return plan;
    }
    if (joint.ttft.at_quantile > slo.ttft_seconds) ++prefill;
    if (joint.tpot.at_quantile > slo.tpot_seconds || joint.failed > 0) ++decode;
  }
  plan.feasible = true;
  plan.prefill_ranks = prefill;
  plan.decode_ranks = decode;
  plan.disaggregated = joint;

  // Colocated baseline: the same number of ranks, and the smallest that meets the SLOs.
  PD_ASSIGN_OR_RETURN(plan.colocated_same_total, s.run(true, 0, prefill + decode));
  PD_ASSIGN_OR_RETURN(plan.colocated_min_ranks, s.smallest(1, [&](int x) -> Result<bool> {
    PD_ASSIGN_OR_RETURN(SimResult r, s.run(true, 0, x));
    return r.meets_slo;
  }));
  if (plan.colocated_min_ranks > 0) {
    PD_ASSIGN_OR_RETURN(plan.colocated_min, s.run(true, 0, plan.colocated_min_ranks));
  }
  plan.simulations = s.simulations;
  return plan;
}

int recommend_layout(const std::vector<LayoutResult>& layouts) {
  int best = -1;
  for (int i = 0; i < static_cast<int>(layouts.size()); ++i) {
    if (best < 0) {
      best = i;
      continue;
    }
    const SimResult& a = layouts[i].result;
    const SimResult& b = layouts[best].result;
    const double tol = 1e-9 * std::max(std::abs(a.goodput_rps), std::abs(b.goodput_rps));
    if (a.goodput_rps > b.goodput_rps + tol ||
        (std::abs(a.goodput_rps - b.goodput_rps) <= tol && a.ttft.p90 < b.ttft.p90)) {
      best = i;
    }
  }
  return best;
}

Result<LayoutAnswer> compare_layouts(const Workload& w, const ClusterConfig& base, const PhaseCostModel& cost,
                                     const Slo& slo, int ranks) {
  if (ranks < 1 || ranks > 1024) {
    return Status::invalid_argument("ranks: must be in [1, 1024], got " + std::to_string(ranks));
  }
  LayoutAnswer ans;
  ans.ranks = ranks;
  auto add = [&](bool colocated, int prefill, int decode) -> Status {
    ClusterConfig c = base;
    c.colocated = colocated;
    c.prefill_ranks = colocated ? 1 : prefill;
    c.decode_ranks = decode;
    PD_ASSIGN_OR_RETURN(SimResult r, simulate(w, c, cost, slo));
    LayoutResult l;
    l.name = colocated ? "colocated x" + std::to_string(decode)
                       : std::to_string(prefill) + "P+" + std::to_string(decode) + "D";
    l.colocated = colocated;
    l.prefill_ranks = colocated ? 0 : prefill;
    l.decode_ranks = decode;
    l.result = r;
    ans.layouts.push_back(std::move(l));
    return Status::ok();
  };
  PD_RETURN_IF_ERROR(add(true, 0, ranks));
  for (int x = 1; x < ranks; ++x) PD_RETURN_IF_ERROR(add(false, x, ranks - x));
  ans.recommended = recommend_layout(ans.layouts);
  ans.reason = lone_request_miss(w, cost, slo);
  return ans;
}

}  // namespace pd::plan
