// Chunked prefill in the pool simulator (the engine's rule for which prompts
// get how many tokens per pass), its costs, and pd-plan's layout answer.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "plan/phase_cost.h"
#include "plan/pool_search.h"
#include "plan/pool_simulator.h"
#include "plan/roofline.h"
#include "plan_test_presets.h"

using namespace pd::plan;
using pd::plan::test::fixed;
using pd::plan::test::run;

namespace {

// A workload of exactly these requests (arrival seconds, prompt, output).
Workload trace_of(const std::vector<DrawnRequest>& reqs) {
  Workload w;
  w.trace = reqs;
  w.num_requests = static_cast<int64_t>(reqs.size());
  w.arrival_rate = 1;
  w.prompt = fixed(reqs.front().prompt);
  w.output = fixed(reqs.front().output);
  return w;
}


}  // namespace

TEST_CASE("plan: chunk planning rule", "[plan][chunk]") {
  struct Case {
    const char* what;
    int64_t chunk, budget, max_prompts;
    std::vector<int64_t> remaining;
    std::vector<int64_t> expect;
  };
  const Case cases[] = {
      {"a lone long prompt gets C", 512, 2048, 16, {3000}, {512}},
      {"a lone long prompt gets at most the budget", 512, 300, 16, {3000}, {300}},
      {"long + shorts share the budget", 512, 2048, 16, {3000, 100, 200}, {512, 100, 200}},
      {"the long chunk leaves the shorts after it their room", 512, 1024, 16, {400, 3000, 300}, {400, 324, 300}},
      {"the second long waits, later shorts overtake it", 512, 2048, 16, {3000, 2500, 100}, {512, 0, 100}},
      {"shorts overtake every long after the first", 512, 2048, 16, {100, 3000, 2500, 4000, 50}, {100, 512, 0, 0, 50}},
      {"a short prompt is cut to the budget left", 512, 1024, 16, {300, 400, 500}, {300, 400, 324}},
      {"the first long is cut to the budget the shorts leave", 512, 600, 16, {500, 3000, 50}, {500, 50, 50}},
      {"a step of about one chunk: the long one gets what the shorts leave", 256, 253, 16, {4000, 65, 64}, {124, 65, 64}},
      {"shorts past the budget: the long one first still advances", 256, 100, 16, {4000, 90, 90}, {16, 84, 0}},
      {"r == C is short, several fit", 512, 2048, 16, {512, 512, 512, 512, 512}, {512, 512, 512, 512, 0}},
      {"a partly computed prompt of r <= C is short", 512, 2048, 16, {3000, 464, 2000}, {512, 464, 0}},
      {"max_batch prompts end the pass", 512, 2048, 2, {10, 20, 30}, {10, 20, 0}},
      {"a skipped long does not count toward max_batch", 512, 2048, 2, {3000, 2500, 100, 50}, {512, 0, 100, 0}},
      {"C = 0: whole prompts under the budget", 0, 2048, 16, {1000, 900, 100}, {1000, 900, 100}},
      {"C = 0: FIFO, the first that does not fit ends the pass", 0, 2048, 16, {1000, 900, 500, 10}, {1000, 900, 0, 0}},
      {"C = 0: a longer prompt runs alone", 0, 2048, 16, {5000, 10}, {5000, 0}},
      {"C = 0: ...but not before an earlier one", 0, 2048, 16, {10, 5000, 10}, {10, 0, 0}},
      {"C = 0: max_batch", 0, 2048, 2, {10, 20, 30}, {10, 20, 0}},
  };
  for (const Case& c : cases) {
    INFO(c.what);
    // The engine's planner, as the simulator offers prompts to it (positions 0, priced by tokens).
    std::vector<pd::PrefillCandidate> candidates;
    for (size_t i = 0; i < c.remaining.size(); ++i) candidates.push_back({i, c.remaining[i], 0});
    std::vector<int64_t> got(c.remaining.size(), 0);
    for (const pd::PrefillChunk& ch :
         pd::plan_prefill_chunks(candidates, pd::ChunkPolicy{c.budget, c.chunk, static_cast<int>(c.max_prompts), 0}))
      got[ch.id] = ch.tokens;
    CHECK(got == c.expect);
  }
}

TEST_CASE("plan: a colocated step's prompt budget is max(S - running, S/4)", "[plan][chunk]") {
  struct Case {
    int64_t step, running, expect;
  };
  const Case cases[] = {{512, 0, 512}, {512, 100, 412}, {512, 384, 128}, {512, 400, 128}, {512, 5000, 128}, {2048, 64, 1984}, {2, 10, 1}};
  for (const Case& c : cases) {
    INFO("S " << c.step << " running " << c.running);
    CHECK(pd::colocated_prompt_budget(c.step, c.running) == c.expect);
  }
}

TEST_CASE("plan: a chunk after p cached tokens pays attention over them", "[plan][chunk]") {
  // Roofline: the chunks of a prompt do, together, exactly its attention FLOPs,
  // and read the cached prefix's KV on top.
  const ModelSpec m = pd::plan::test::preset("llama-3.1-8b");
  const HardwareSpec h = pd::plan::test::hw("h100-sxm");
  RooflineConfig rc;
  const PhaseCost whole = prefill_cost(m, h, rc, 2048);
  double chunk_flops = 0, chunk_bytes = 0;
  for (double p : {0.0, 512.0, 1024.0, 1536.0}) {
    const PhaseCost part = prefill_cost(m, h, rc, 512, 1, 512.0 * 512, 512.0 * p, p);
    chunk_flops += part.attention.flops;
    chunk_bytes += part.attention.bytes;
  }
  CHECK(chunk_flops == Approx(whole.attention.flops).epsilon(1e-12));
  CHECK(chunk_bytes > whole.attention.bytes);
  RooflineCostModel roof(m, h, rc);
  PrefillPass late;
  late.add(512, 1536);
  PrefillPass first;
  first.add(512, 0);
  CHECK(roof.prefill_pass_seconds(late) > roof.prefill_pass_seconds(first));
  CHECK(roof.prefill_pass_seconds(first) == roof.prefill_seconds(512, 1, 512.0 * 512));

  // Profile: single prompts cost a + b n + c n^2; a 2,048-token prompt in four
  // 512-token chunks costs its single-pass time plus three more fixed costs a.
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
  double sum = 0;
  for (double p : {0.0, 512.0, 1024.0, 1536.0}) {
    PrefillPass pass;
    pass.add(512, p);
    sum += cost.prefill_pass_seconds(pass);
  }
  CHECK(sum == Approx(t(2048) + 3 * a).epsilon(1e-3));
  // Whole prompts: the pass costs what prefill_seconds says.
  PrefillPass two;
  two.add(300, 0);
  two.add(700, 0);
  CHECK(cost.prefill_pass_seconds(two) == cost.prefill_seconds(1000, 2, 300.0 * 300 + 700.0 * 700));
}

TEST_CASE("plan: a long prompt is prefilled in chunks, its KV handoff overlaps only the last chunk", "[plan][chunk]") {
  LinearCosts lc;
  lc.prefill_fixed = 0.01;
  lc.prefill_per_token = 1e-4;
  lc.decode_fixed = 0.02;
  lc.kv_bytes_per_token = 1e5;
  lc.link_bytes_per_second = 2e8;  // 2,000 tokens: 1 s on the wire
  lc.chunks = 100;
  LinearCostModel cost(lc);
  const Workload w = trace_of({{0.0, 2000, 2}});
  ClusterConfig c;
  c.decode_kv_blocks = 10'000;
  c.prefill_token_budget = 2048;
  c.record_requests = true;
  c.warmup_fraction = c.cooldown_fraction = 0;

  // C = 0: one pass of 0.21 s; 1 s of wire less that pass exposed; one decode step.
  const SimResult whole = run(w, c, cost);
  REQUIRE(whole.per_request.size() == 1);
  CHECK(whole.per_request[0].first_token == Approx(0.21));
  CHECK(whole.per_request[0].done == Approx(0.21 + (1.0 - 0.21) + 0.02));

  // C = 512: passes of 512, 512, 512 and 464 tokens (4 x 10 ms + 2,000 x 0.1 ms); the
  // wire overlaps only the last 56.4 ms pass.
  c.chunk_tokens = 512;
  const SimResult chunked = run(w, c, cost);
  const RequestTiming& r = chunked.per_request[0];
  CHECK(r.first_token == Approx(0.24));
  CHECK(r.done == Approx(0.24 + (1.0 - 0.0564) + 0.02));
  CHECK(r.worst_gap == Approx(1.0 - 0.0564 + 0.02));
}

TEST_CASE("plan: a second long prompt waits while later short ones overtake it", "[plan][chunk]") {
  LinearCosts lc;
  lc.prefill_fixed = 0.01;
  lc.prefill_per_token = 1e-4;
  lc.decode_fixed = 0.02;
  LinearCostModel cost(lc);
  // A and B long (2,000 tokens), S short, all waiting within the first pass.
  const Workload w = trace_of({{0.0, 2000, 2}, {0.001, 2000, 2}, {0.002, 100, 2}});
  ClusterConfig c;
  c.decode_kv_blocks = 10'000;
  c.prefill_token_budget = 2048;
  c.chunk_tokens = 512;
  c.record_requests = true;
  c.warmup_fraction = c.cooldown_fraction = 0;
  const SimResult res = run(w, c, cost);
  const RequestTiming &a = res.per_request[0], &b = res.per_request[1], &s = res.per_request[2];
  // Pass 1 (A 512): 61.2 ms. Pass 2 (A 512 + S 100; B skipped): 71.2 ms -> S's first token.
  CHECK(s.first_token == Approx(0.0612 + 0.0712));
  // Pass 3 (A 512; B skipped again); pass 4: A's last 464 tokens (short now) and B's first chunk.
  CHECK(b.prefill_start == Approx(0.0612 + 0.0712 + 0.0612));
  CHECK(s.first_token < b.prefill_start);
  CHECK(a.first_token == Approx(0.0612 + 0.0712 + 0.0612 + (0.01 + 976 * 1e-4)));
  CHECK(b.first_token > a.first_token);
  CHECK(res.completed == 3);
}

TEST_CASE("plan: colocated chunked prefill bounds the decodes' worst gap", "[plan][chunk]") {
  // One colocated rank; short requests generating 200 tokens arrive every 0.25 s, an
  // 8,000-token prompt every 5 s (a 0.8 s prefill when whole).
  LinearCosts lc;
  lc.prefill_fixed = 0.002;
  lc.prefill_per_token = 1e-4;
  lc.decode_fixed = 0.02;
  lc.decode_per_seq = 1e-4;
  LinearCostModel cost(lc);
  const double whole_prompt = lc.prefill_fixed + 8000 * lc.prefill_per_token;
  std::vector<DrawnRequest> reqs;
  for (int i = 0; i < 480; ++i) {
    const double t = 0.25 * i;
    if (i % 20 == 10) reqs.push_back({t, 8000, 4});
    reqs.push_back({t + 0.001, 50, 200});
  }
  const Workload w = trace_of(reqs);
  ClusterConfig c;
  c.colocated = true;
  c.decode_ranks = 1;
  c.decode_kv_blocks = 100'000;
  c.prefill_token_budget = 2048;
  c.max_prefill_batch = 16;
  c.max_decode_batch = 64;

  const SimResult stalled = run(w, c, cost);  // C = 0: prefill first, whole prompts
  c.chunk_tokens = 512;
  c.step_tokens = 512;
  const SimResult chunked = run(w, c, cost);
  INFO("worst gap max: whole prompts " << stalled.worst_gap.max << " s, chunked " << chunked.worst_gap.max
                                       << " s; TPOT max " << stalled.tpot.max << " vs " << chunked.tpot.max);
  CHECK(stalled.worst_gap.max >= whole_prompt);
  // A step is the decode step plus at most S tokens of chunks: ~0.08 s at most.
  CHECK(chunked.worst_gap.max < 0.15 * whole_prompt);
  CHECK(chunked.worst_gap.p90 < 0.15 * whole_prompt);
  CHECK(chunked.tpot.max < 0.15 * whole_prompt);
  CHECK(chunked.completed == static_cast<int64_t>(reqs.size()));
  // The long prompts still get through: 16 steps of chunks, not a stall of everything else.
  CHECK(chunked.ttft.max < 3.0);
}

TEST_CASE("plan: chunk_tokens 0 reproduces the unchunked simulator", "[plan][chunk]") {
  // Golden values from the simulator before chunked prefill existed (same workload,
  // config and costs): disaggregated with KV backpressure and preemption, and colocated.
  // 1e-9: builds with and without FMA contraction differ in the last digits only.
  LinearCosts lc;
  lc.prefill_fixed = 0.003;
  lc.prefill_per_token = 2e-5;
  lc.decode_fixed = 0.01;
  lc.decode_per_seq = 4e-4;
  lc.decode_per_context_token = 1e-8;
  lc.kv_bytes_per_token = 1e5;
  lc.link_bytes_per_second = 5e9;
  lc.link_latency = 1e-4;
  lc.chunks = 16;
  LinearCostModel cost(lc);
  struct Golden {
    double rate;
    bool colocated;
    double ttft_p90, ttft_mean, tpot_p90, tpot_mean, makespan;
    int64_t preemptions;
  };
  const Golden goldens[] = {
      {40, false, 145.99984797951595, 84.3383741870786, 0.40411638200000083, 0.23474283538335888, 258.31104441731753, 8},
      {40, true, 27.079587219728737, 15.020080484312322, 0.036935418888889161, 0.033542948088828385,
       114.76963363281021, 6},
      {12, false, 5.0253488095557373, 1.5271717320247769, 0.22915851576922491, 0.15077291062439108,
       263.19371873106036, 6},
      {12, true, 0.043655445313362407, 0.028186270160210029, 0.017068866153845893, 0.015063756082782388,
       245.78446110474079, 0},
  };
  for (const Golden& g : goldens) {
    Workload w;
    w.arrival_rate = g.rate;
    w.prompt = *parse_length_dist("uniform:64:2048", "p");
    w.output = *parse_length_dist("exp:128", "o");
    w.num_requests = 3000;
    w.seed = 5;
    ClusterConfig c;
    c.colocated = g.colocated;
    c.prefill_ranks = 2;
    c.decode_ranks = g.colocated ? 3 : 1;
    c.prefill_token_budget = 2048;
    c.max_prefill_batch = 16;
    c.max_decode_batch = 64;
    c.decode_kv_blocks = 3000;
    c.prefill_kv_blocks = 2000;
    c.chunk_tokens = 0;
    INFO("rate " << g.rate << (g.colocated ? " colocated" : " disaggregated"));
    const SimResult r = run(w, c, cost);
    CHECK(r.ttft.p90 == Approx(g.ttft_p90).epsilon(1e-9));
    CHECK(r.ttft.mean == Approx(g.ttft_mean).epsilon(1e-9));
    CHECK(r.tpot.p90 == Approx(g.tpot_p90).epsilon(1e-9));
    CHECK(r.tpot.mean == Approx(g.tpot_mean).epsilon(1e-9));
    CHECK(r.makespan_seconds == Approx(g.makespan).epsilon(1e-9));
    CHECK(r.preemptions == g.preemptions);
  }
}

TEST_CASE("plan: chunked runs are deterministic and settle under preemption", "[plan][chunk]") {
  LinearCosts lc;
  lc.prefill_fixed = 0.003;
  lc.prefill_per_token = 2e-5;
  lc.decode_fixed = 0.01;
  lc.decode_per_seq = 4e-4;
  lc.kv_bytes_per_token = 1e5;
  lc.link_bytes_per_second = 5e9;
  lc.chunks = 16;
  LinearCostModel cost(lc);
  Workload w;
  w.arrival_rate = 30;
  w.prompt = *parse_length_dist("lognormal:1024:1.0", "p");
  w.output = *parse_length_dist("exp:128", "o");
  w.num_requests = 3000;
  for (bool colocated : {false, true}) {
    INFO((colocated ? "colocated" : "disaggregated"));
    ClusterConfig c;
    c.colocated = colocated;
    c.prefill_ranks = 2;
    c.decode_ranks = colocated ? 3 : 1;
    c.prefill_token_budget = 2048;
    c.chunk_tokens = 512;
    c.step_tokens = 512;
    c.max_prefill_batch = 16;
    c.max_decode_batch = 64;
    c.decode_kv_blocks = 3000;  // tight: preemption and recompute
    c.prefill_kv_blocks = 2000;
    const SimResult a = run(w, c, cost), b = run(w, c, cost);
    CHECK(a.completed + a.failed == w.num_requests);
    CHECK(a.preemptions > 0);
    CHECK(a.ttft.p90 == b.ttft.p90);
    CHECK(a.tpot.p99 == b.tpot.p99);
    CHECK(a.makespan_seconds == b.makespan_seconds);
  }
}

TEST_CASE("plan: bad chunking settings are errors naming the field", "[plan][chunk]") {
  LinearCostModel cost(LinearCosts{});
  Workload w;
  ClusterConfig c;
  c.decode_kv_blocks = 100;
  c.chunk_tokens = -1;
  auto a = simulate(w, c, cost, Slo{});
  REQUIRE_FALSE(a.is_ok());
  CHECK(a.status().message().find("chunk_tokens") != std::string::npos);
  c.chunk_tokens = 512;
  c.step_tokens = 0;
  auto b = simulate(w, c, cost, Slo{});
  REQUIRE_FALSE(b.is_ok());
  CHECK(b.status().message().find("step_tokens") != std::string::npos);
  c.step_tokens = 512;
  auto l = compare_layouts(w, c, cost, Slo{}, 0);
  REQUIRE_FALSE(l.is_ok());
  CHECK(l.status().message().find("ranks") != std::string::npos);
}

TEST_CASE("plan: layout recommendation: highest goodput, ties to the lower TTFT p90", "[plan][layout]") {
  auto layout = [](const char* name, double goodput, double ttft_p90) {
    LayoutResult l;
    l.name = name;
    l.result.goodput_rps = goodput;
    l.result.ttft.p90 = ttft_p90;
    return l;
  };
  CHECK(recommend_layout({}) == -1);
  CHECK(recommend_layout({layout("colocated x2", 0.5, 1.0), layout("1P+1D", 0.9, 3.0)}) == 1);
  CHECK(recommend_layout({layout("colocated x2", 0.9, 1.0), layout("1P+1D", 0.5, 0.1)}) == 0);
  CHECK(recommend_layout({layout("colocated x3", 0.9, 2.0), layout("1P+2D", 0.9, 1.0), layout("2P+1D", 0.9, 1.5)}) ==
        1);
  CHECK(recommend_layout({layout("colocated x2", 0.9, 1.0), layout("1P+1D", 0.9, 1.0)}) == 0);
}

// The engine's chunking (token-priced) as the layout tests run it, on a large KV pool.
static ClusterConfig layout_base() {
  ClusterConfig base;
  base.chunk_tokens = 512;
  base.prefill_token_budget = 2048;
  base.step_tokens = 512;
  base.max_prefill_batch = 16;
  base.max_decode_batch = 64;
  base.decode_kv_blocks = 100'000;
  return base;
}

TEST_CASE("plan: layout answer: long prompts under a tight TPOT SLO go disaggregated", "[plan][layout]") {
  // 4,000-token prompts (0.4 s of prefill) at 1 req/s, 64 output tokens, two ranks.
  // Colocated, a decode step shares its rank with 512-token chunks (+51 ms) whenever a
  // prompt is being prefilled; 1P+1D keeps decode steps at ~20 ms.
  LinearCosts lc;
  lc.prefill_fixed = 0.002;
  lc.prefill_per_token = 1e-4;
  lc.decode_fixed = 0.02;
  lc.decode_per_seq = 1e-4;
  lc.kv_bytes_per_token = 1e5;
  lc.link_bytes_per_second = 5e10;
  lc.chunks = 32;
  LinearCostModel cost(lc);
  Workload w;
  w.arrival_rate = 1;
  w.prompt = fixed(4000);
  w.output = fixed(64);
  w.num_requests = 2000;
  const ClusterConfig base = layout_base();
  Slo slo;
  slo.ttft_seconds = 2.0;
  slo.tpot_seconds = 0.025;
  auto ans = compare_layouts(w, base, cost, slo, 2);
  REQUIRE(ans.is_ok());
  REQUIRE(ans->layouts.size() == 2);
  CHECK(ans->layouts[0].name == "colocated x2");
  CHECK(ans->layouts[1].name == "1P+1D");
  const SimResult& col = ans->layouts[0].result;
  const SimResult& dis = ans->layouts[1].result;
  INFO("colocated TPOT p90 " << col.tpot.p90 << " goodput " << col.goodput_rps << "; 1P+1D TPOT p90 " << dis.tpot.p90
                             << " goodput " << dis.goodput_rps);
  CHECK(ans->layouts[static_cast<size_t>(ans->recommended)].name == "1P+1D");
  CHECK(dis.meets_slo);
  CHECK_FALSE(col.meets_slo);
  CHECK(dis.goodput_rps > 1.5 * col.goodput_rps);
  CHECK(ans->reason.empty());
  // A TTFT target below one prompt's prefill (0.402 s): no layout can, and the answer says why.
  slo.ttft_seconds = 0.3;
  auto none = compare_layouts(w, base, cost, slo, 2);
  REQUIRE(none.is_ok());
  CHECK(none->reason.find("TTFT") != std::string::npos);
  CHECK_FALSE(none->layouts[0].result.meets_slo);
  CHECK_FALSE(none->layouts[1].result.meets_slo);
}

TEST_CASE("plan: layout answer: short prompts whose decodes need both ranks go colocated", "[plan][layout]") {
  // 64-token prompts (a few ms of prefill) at 5 req/s, 64 output tokens: ~8 sequences
  // decoding at once. A decode step costs 10 ms + 2 ms per sequence: one decode rank
  // (1P+1D, its prefill rank mostly idle) runs all of them at ~28 ms a step; two
  // colocated ranks split them at ~18 ms plus the odd short chunk.
  LinearCosts lc;
  lc.prefill_fixed = 0.001;
  lc.prefill_per_token = 1e-5;
  lc.decode_fixed = 0.01;
  lc.decode_per_seq = 2e-3;
  lc.kv_bytes_per_token = 1e5;
  lc.link_bytes_per_second = 5e10;
  LinearCostModel cost(lc);
  Workload w;
  w.arrival_rate = 5;
  w.prompt = fixed(64);
  w.output = fixed(64);
  w.num_requests = 3000;
  const ClusterConfig base = layout_base();
  Slo slo;
  slo.ttft_seconds = 0.5;
  slo.tpot_seconds = 0.025;
  auto ans = compare_layouts(w, base, cost, slo, 2);
  REQUIRE(ans.is_ok());
  const SimResult& col = ans->layouts[0].result;
  const SimResult& dis = ans->layouts[1].result;
  INFO("colocated TPOT p90 " << col.tpot.p90 << " goodput " << col.goodput_rps << "; 1P+1D TPOT p90 " << dis.tpot.p90
                             << " goodput " << dis.goodput_rps);
  CHECK(ans->layouts[static_cast<size_t>(ans->recommended)].name == "colocated x2");
  CHECK(col.meets_slo);
  CHECK_FALSE(dis.meets_slo);
  CHECK(col.goodput_rps > 1.5 * dis.goodput_rps);
}
