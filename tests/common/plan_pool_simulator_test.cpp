// The pool simulator against queueing theory, monotonicity and determinism.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <unistd.h>

#include "plan/pool_search.h"
#include "plan/pool_simulator.h"

#include "plan_test_presets.h"

using namespace pd::plan;
using pd::plan::test::fixed;
using pd::plan::test::run;

namespace {

// Prefill, decode and a link, each with a fixed and a per-unit part.
LinearCosts mixed_costs() {
  LinearCosts lc;
  lc.prefill_fixed = 0.002;
  lc.prefill_per_token = 1e-5;
  lc.decode_fixed = 0.005;
  lc.decode_per_seq = 2e-4;
  lc.decode_per_context_token = 1e-8;
  lc.kv_bytes_per_token = 1e5;
  lc.link_bytes_per_second = 1e10;
  return lc;
}


}  // namespace

TEST_CASE("plan: simulator reproduces M/D/1 waiting time (Pollaczek-Khinchine)", "[plan][sim]") {
  // One prefill rank, one prompt per pass, deterministic service 1/mu = 10 ms, Poisson
  // arrivals, one output token (no decode): the router queue is an M/D/1 queue.
  // Wq = rho / (2 mu (1 - rho)).
  const double service = 0.010;
  LinearCosts lc;
  lc.prefill_fixed = service;
  LinearCostModel cost(lc);
  ClusterConfig c;
  c.prefill_ranks = 1;
  c.decode_ranks = 1;
  c.max_prefill_batch = 1;
  c.decode_kv_blocks = 1000;
  for (double rho : {0.5, 0.8}) {
    Workload w;
    w.arrival_rate = rho / service;
    w.prompt = fixed(100);
    w.output = fixed(1);
    w.num_requests = 60'000;
    w.seed = 7;
    const SimResult r = run(w, c, cost);
    const double mu = 1.0 / service;
    const double wq = rho / (2 * mu * (1 - rho));  // rho 0.5: 5.0 ms; rho 0.8: 20.0 ms
    INFO("rho " << rho << " simulated Wq " << r.queue_wait.mean << " theory " << wq);
    CHECK(r.queue_wait.mean == Approx(wq).epsilon(0.04));
    CHECK(r.ttft.mean == Approx(wq + service).epsilon(0.03));
    CHECK(r.completed == w.num_requests);
  }
}

TEST_CASE("plan: simulator is deterministic for a seed", "[plan][sim]") {
  LinearCostModel cost(mixed_costs());
  Workload w;
  w.arrival_rate = 50;
  w.prompt = *parse_length_dist("uniform:64:1024", "prompt");
  w.output = *parse_length_dist("exp:64", "output");
  w.num_requests = 2000;
  ClusterConfig c;
  c.prefill_ranks = 2;
  c.decode_ranks = 2;
  c.decode_kv_blocks = 4000;
  const SimResult a = run(w, c, cost), b = run(w, c, cost);
  CHECK(a.ttft.p90 == b.ttft.p90);
  CHECK(a.tpot.p99 == b.tpot.p99);
  CHECK(a.makespan_seconds == b.makespan_seconds);
  w.seed = 2;
  const SimResult d = run(w, c, cost);
  CHECK(d.makespan_seconds != a.makespan_seconds);
}

TEST_CASE("plan: a trace file replays exactly the requests it lists", "[plan][sim]") {
  LinearCostModel cost(mixed_costs());
  Workload w;
  w.arrival_rate = 20;
  w.prompt = *parse_length_dist("uniform:64:1024", "prompt");
  w.output = *parse_length_dist("exp:64", "output");
  w.num_requests = 500;
  const std::vector<DrawnRequest> drawn = draw_workload(w);
  const std::string path =
      (std::filesystem::temp_directory_path() / ("pd_plan_trace_" + std::to_string(::getpid()) + ".jsonl")).string();
  {
    std::ofstream f(path);
    f.precision(17);
    for (const DrawnRequest& r : drawn) {
      f << "{\"timestamp\": " << r.arrival * 1000.0 << ", \"input_length\": " << r.prompt
        << ", \"output_length\": " << r.output << ", \"hash_ids\": []}\n";
    }
  }
  auto traced = trace_workload(path);
  REQUIRE(traced.is_ok());
  CHECK(traced->num_requests == 500);
  CHECK(std::abs(traced->arrival_rate - 20) < 3);  // the draw's own rate, sampled
  const std::vector<DrawnRequest> replay = draw_workload(*traced);
  REQUIRE(replay.size() == drawn.size());
  for (size_t i = 0; i < drawn.size(); ++i) {
    CHECK(replay[i].prompt == drawn[i].prompt);
    CHECK(replay[i].output == drawn[i].output);
    CHECK(std::abs(replay[i].arrival - drawn[i].arrival) < 1e-9);
  }
  ClusterConfig c;
  c.prefill_ranks = 1;
  c.decode_ranks = 1;
  c.decode_kv_blocks = 4000;
  const SimResult a = run(w, c, cost), b = run(*traced, c, cost);
  CHECK(std::abs(a.ttft.p90 - b.ttft.p90) < 1e-9);
  CHECK(std::abs(a.tpot.p90 - b.tpot.p90) < 1e-9);

  // Bad traces: the error names the file's line and the field.
  std::ofstream(path) << "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 5}\n"
                         "{\"timestamp\": 5, \"input_length\": 10}\n";
  auto missing = trace_workload(path);
  REQUIRE_FALSE(missing.is_ok());
  CHECK(missing.status().message().find(":2: field 'output_length'") != std::string::npos);
  std::ofstream(path) << "{\"timestamp\": 50, \"input_length\": 10, \"output_length\": 5}\n"
                         "{\"timestamp\": 5, \"input_length\": 10, \"output_length\": 5}\n";
  auto unsorted = trace_workload(path);
  REQUIRE_FALSE(unsorted.is_ok());
  CHECK(unsorted.status().message().find(":2: timestamp earlier") != std::string::npos);
  std::ofstream(path) << "not json\n";
  CHECK_FALSE(trace_workload(path).is_ok());
  std::ofstream(path) << "\n";
  CHECK_FALSE(trace_workload(path).is_ok());
  std::remove(path.c_str());
  CHECK_FALSE(trace_workload(path).is_ok());
}

TEST_CASE("plan: more decode ranks never worsen simulated TPOT", "[plan][sim]") {
  struct Config {
    double rate;
    const char* prompt;
    const char* output;
    int64_t blocks;
  };
  const Config configs[] = {
      {40, "uniform:128:512", "uniform:32:256", 3000},
      {80, "exp:256", "exp:128", 1500},     // tight KV: preemption on few ranks
      {20, "fixed:1024", "fixed:64", 20000},
  };
  LinearCosts lc;
  lc.prefill_fixed = 0.001;
  lc.prefill_per_token = 2e-5;
  lc.decode_fixed = 0.01;
  lc.decode_per_seq = 3e-4;
  lc.decode_per_context_token = 2e-8;
  lc.kv_bytes_per_token = 2e5;
  lc.link_bytes_per_second = 2.5e10;
  lc.chunks = 32;
  LinearCostModel cost(lc);
  for (const Config& cfg : configs) {
    Workload w;
    w.arrival_rate = cfg.rate;
    w.prompt = *parse_length_dist(cfg.prompt, "prompt");
    w.output = *parse_length_dist(cfg.output, "output");
    w.num_requests = 2000;
    w.seed = 11;
    ClusterConfig c;
    c.prefill_ranks = 4;
    c.decode_kv_blocks = cfg.blocks;
    double prev_p90 = INFINITY, prev_mean = INFINITY;
    for (int d : {1, 2, 3, 5, 8}) {
      c.decode_ranks = d;
      const SimResult r = run(w, c, cost);
      INFO("rate " << cfg.rate << " decode ranks " << d << " TPOT p90 " << r.tpot.p90 << " mean " << r.tpot.mean);
      CHECK(r.tpot.p90 <= prev_p90 * (1 + 1e-9));
      CHECK(r.tpot.mean <= prev_mean * (1 + 1e-9));
      prev_p90 = r.tpot.p90;
      prev_mean = r.tpot.mean;
    }
  }
}

TEST_CASE("plan: KV capacity limits the decode batch and forces preemption", "[plan][sim]") {
  LinearCosts lc;
  lc.prefill_fixed = 0.001;
  lc.decode_fixed = 0.01;
  LinearCostModel cost(lc);
  Workload w;
  w.arrival_rate = 200;
  w.prompt = fixed(256);
  w.output = fixed(256);
  w.num_requests = 2000;
  ClusterConfig c;
  c.prefill_ranks = 2;
  c.decode_ranks = 1;
  c.block_size = 16;
  c.decode_kv_blocks = 32 * 10;  // room for ~10 sequences at their full 512 tokens
  const SimResult r = run(w, c, cost);
  CHECK(r.completed == w.num_requests);
  CHECK(r.mean_decode_batch <= 20.0);  // 320 blocks / 16 blocks (prompt only) at most
  CHECK(r.preemptions > 0);
  // A request that can never fit is failed, not looped on.
  w.prompt = fixed(100'000);
  w.num_requests = 10;
  const SimResult f = run(w, c, cost);
  CHECK(f.failed == 10);
}

TEST_CASE("plan: colocated prefill stalls decode, disaggregation isolates TPOT", "[plan][sim]") {
  LinearCosts lc;
  lc.prefill_fixed = 0.002;
  lc.prefill_per_token = 1e-4;  // 2048-token prompt: ~0.2 s pass
  lc.decode_fixed = 0.02;
  lc.decode_per_seq = 1e-4;
  lc.kv_bytes_per_token = 1e5;
  lc.link_bytes_per_second = 5e10;
  LinearCostModel cost(lc);
  Workload w;
  w.arrival_rate = 6;
  w.prompt = fixed(2048);
  w.output = fixed(128);
  w.num_requests = 3000;
  ClusterConfig c;
  c.decode_kv_blocks = 100'000;
  c.prefill_ranks = 2;
  c.decode_ranks = 2;
  const SimResult dis = run(w, c, cost);
  c.colocated = true;
  c.decode_ranks = 4;
  const SimResult col = run(w, c, cost);
  // Disaggregated TPOT is the bare step time (~20 ms); colocated steps wait behind 0.2 s prefills.
  CHECK(dis.tpot.p90 < 0.03);
  CHECK(col.tpot.p90 > dis.tpot.p90 * 1.5);
}

TEST_CASE("plan: bad workload and cluster input is an error naming the field", "[plan][sim]") {
  LinearCostModel cost(LinearCosts{});
  Workload w;
  ClusterConfig c;
  c.decode_kv_blocks = 100;
  w.arrival_rate = 0;
  auto a = simulate(w, c, cost, Slo{});
  REQUIRE_FALSE(a.is_ok());
  CHECK(a.status().message().find("rate") != std::string::npos);
  w.arrival_rate = 1;
  c.decode_ranks = 0;
  auto b = simulate(w, c, cost, Slo{});
  REQUIRE_FALSE(b.is_ok());
  CHECK(b.status().message().find("decode_ranks") != std::string::npos);
  c.decode_ranks = 1;
  c.decode_kv_blocks = 0;
  auto k = simulate(w, c, cost, Slo{});
  REQUIRE_FALSE(k.is_ok());
  CHECK(k.status().message().find("decode_kv_blocks") != std::string::npos);

  for (const char* bad : {"", "uniform:5", "uniform:9:3", "exp:-1", "fixed:0", "gamma:3", "12x", "-4"}) {
    INFO(bad);
    auto d = parse_length_dist(bad, "--prompt-len");
    REQUIRE_FALSE(d.is_ok());
    CHECK(d.status().message().find("--prompt-len") != std::string::npos);
  }
  auto ok = parse_length_dist("lognormal:512:0.8", "--prompt-len");
  REQUIRE(ok.is_ok());
  CHECK(ok->mean() == 512);
  CHECK(parse_length_dist("300", "x")->a == 300);
}

TEST_CASE("plan: pool search finds the smallest pools meeting the SLOs", "[plan][sim]") {
  LinearCosts lc;
  lc.prefill_fixed = 0.01;   // one prompt per 10 ms pass...
  lc.decode_fixed = 0.02;    // ...decode steps of 20 ms + 1 ms per sequence
  lc.decode_per_seq = 1e-3;
  LinearCostModel cost(lc);
  Workload w;
  w.arrival_rate = 150;  // prefill load 150 x 10 ms = 1.5 ranks busy
  w.prompt = fixed(256);
  w.output = fixed(32);
  w.num_requests = 1500;
  ClusterConfig base;
  base.max_prefill_batch = 1;
  base.decode_kv_blocks = 100'000;
  Slo slo;
  slo.ttft_seconds = 0.05;
  slo.tpot_seconds = 0.035;  // 20 ms + 1 ms x batch: batch <= 15 per rank
  PoolSearchConfig search;
  search.max_ranks_per_pool = 16;
  auto plan = plan_pools(w, base, cost, slo, search);
  REQUIRE(plan.is_ok());
  REQUIRE(plan->feasible);
  CHECK(plan->disaggregated.meets_slo);
  CHECK(plan->prefill_ranks >= 2);  // load 1.5 needs at least 2 ranks
  // One fewer rank in either pool misses.
  ClusterConfig c = base;
  c.prefill_ranks = plan->prefill_ranks - 1;
  c.decode_ranks = plan->decode_ranks;
  CHECK_FALSE(run(w, c, cost, slo).meets_slo);
  if (plan->decode_ranks > 1) {
    c.prefill_ranks = plan->prefill_ranks;
    c.decode_ranks = plan->decode_ranks - 1;
    CHECK_FALSE(run(w, c, cost, slo).meets_slo);
  }
  // An SLO below a single request's cost is reported infeasible, with the reason.
  slo.tpot_seconds = 0.01;
  auto none = plan_pools(w, base, cost, slo, search);
  REQUIRE(none.is_ok());
  CHECK_FALSE(none->feasible);
  CHECK(none->reason.find("TPOT") != std::string::npos);
}
