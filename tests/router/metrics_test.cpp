// Tests of the Prometheus metrics (a facade over prometheus-cpp): exact render
// output of counters, gauges and histograms (cumulative buckets, +Inf, _sum,
// _count), labels in declared order, children in order of their label values,
// escaping, value formatting, and concurrent updates.
#include "router/metrics.h"

#include <catch2/catch.hpp>

#include <limits>
#include <string>
#include <thread>
#include <vector>

namespace pd::router {
namespace {

TEST_CASE("metrics: unlabelled counter and gauge render", "[metrics]") {
  Registry r;
  Counter& c = r.counter("pd_requests_total", "Requests received.");
  Gauge& g = r.gauge("pd_queue_depth", "Requests waiting.");
  CHECK(r.render() ==
        "# HELP pd_requests_total Requests received.\n"
        "# TYPE pd_requests_total counter\n"
        "pd_requests_total 0\n"
        "# HELP pd_queue_depth Requests waiting.\n"
        "# TYPE pd_queue_depth gauge\n"
        "pd_queue_depth 0\n");
  c.inc();
  c.inc(2.5);
  c.inc(-1.0);  // dropped: counters never decrease
  g.set(7);
  g.add(-2);
  CHECK(c.value() == 3.5);
  CHECK(g.value() == 5.0);
  CHECK(r.render() ==
        "# HELP pd_requests_total Requests received.\n"
        "# TYPE pd_requests_total counter\n"
        "pd_requests_total 3.5\n"
        "# HELP pd_queue_depth Requests waiting.\n"
        "# TYPE pd_queue_depth gauge\n"
        "pd_queue_depth 5\n");
}

TEST_CASE("metrics: labelled counter and gauge, children sorted by label values", "[metrics]") {
  Registry r;
  Counter& c = r.counter("pd_requests_finished_total", "Requests by outcome.", {"outcome"});
  c.inc({"finished"});
  c.inc({"cancelled"}, 2);
  c.inc({"finished"});
  Gauge& g = r.gauge("pd_decode_running", "Running sequences per rank.", {"rank", "pool"});
  g.set({"3", "decode"}, 12.0);
  g.with({"1", "decode"}).set(0.25);
  CHECK(c.value({"finished"}) == 2.0);
  CHECK(r.render() ==
        "# HELP pd_requests_finished_total Requests by outcome.\n"
        "# TYPE pd_requests_finished_total counter\n"
        "pd_requests_finished_total{outcome=\"cancelled\"} 2\n"
        "pd_requests_finished_total{outcome=\"finished\"} 2\n"
        "# HELP pd_decode_running Running sequences per rank.\n"
        "# TYPE pd_decode_running gauge\n"
        "pd_decode_running{rank=\"1\",pool=\"decode\"} 0.25\n"
        "pd_decode_running{rank=\"3\",pool=\"decode\"} 12\n");
}

TEST_CASE("metrics: histogram buckets are cumulative with +Inf, sum and count", "[metrics]") {
  Registry r;
  Histogram& h = r.histogram("pd_ttft_seconds", "Time to first token.", {0.125, 0.5, 1});
  h.observe(0.0625);
  h.observe(0.125);  // on a bound: counted in that bucket (le = less or equal)
  h.observe(0.25);
  h.observe(7.0);  // above every bound: only +Inf
  CHECK(r.render() ==
        "# HELP pd_ttft_seconds Time to first token.\n"
        "# TYPE pd_ttft_seconds histogram\n"
        "pd_ttft_seconds_count 4\n"
        "pd_ttft_seconds_sum 7.4375\n"
        "pd_ttft_seconds_bucket{le=\"0.125\"} 2\n"
        "pd_ttft_seconds_bucket{le=\"0.5\"} 3\n"
        "pd_ttft_seconds_bucket{le=\"1\"} 3\n"
        "pd_ttft_seconds_bucket{le=\"+Inf\"} 4\n");
}

TEST_CASE("metrics: labelled histogram and the default buckets", "[metrics]") {
  Registry r;
  Histogram& h = r.histogram("pd_e2e_seconds", "End to end.", default_latency_buckets(), {"endpoint"});
  h.observe({"chat"}, 0.2);
  const std::string out = r.render();
  CHECK_THAT(out, Catch::Matchers::Contains("pd_e2e_seconds_bucket{endpoint=\"chat\",le=\"0.005\"} 0\n"));
  CHECK_THAT(out, Catch::Matchers::Contains("pd_e2e_seconds_bucket{endpoint=\"chat\",le=\"0.25\"} 1\n"));
  CHECK_THAT(out, Catch::Matchers::Contains("pd_e2e_seconds_bucket{endpoint=\"chat\",le=\"60\"} 1\n"));
  CHECK_THAT(out, Catch::Matchers::Contains("pd_e2e_seconds_bucket{endpoint=\"chat\",le=\"+Inf\"} 1\n"));
  CHECK_THAT(out, Catch::Matchers::Contains("pd_e2e_seconds_sum{endpoint=\"chat\"} 0.2\n"));
  CHECK_THAT(out, Catch::Matchers::Contains("pd_e2e_seconds_count{endpoint=\"chat\"} 1\n"));
  const std::vector<double>& b = default_latency_buckets();
  CHECK(b.front() == 0.005);
  CHECK(b.back() == 60.0);
  for (size_t i = 1; i < b.size(); ++i) CHECK(b[i - 1] < b[i]);
  Histogram::Child& child = h.with({"chat"});
  CHECK(child.count() == 1);
  CHECK(child.sum() == 0.2);
}

TEST_CASE("metrics: label values and help text are escaped", "[metrics]") {
  Registry r;
  Counter& c = r.counter("pd_errors_total", "Errors\\by \"reason\"\nsecond line.", {"reason"});
  c.inc({"bad \"quote\" \\ back\nslash"});
  CHECK(r.render() ==
        "# HELP pd_errors_total Errors\\\\by \"reason\"\\nsecond line.\n"
        "# TYPE pd_errors_total counter\n"
        "pd_errors_total{reason=\"bad \\\"quote\\\" \\\\ back\\nslash\"} 1\n");
  CHECK(escape_help("a\\b\"c\nd") == "a\\\\b\"c\\nd");
}

TEST_CASE("metrics: value formatting", "[metrics]") {
  Registry r;
  Gauge& g = r.gauge("pd_value", "A value.", {"case"});
  g.set({"zero"}, 0);
  g.set({"integer"}, 12);
  g.set({"fraction"}, 0.005);
  g.set({"negative"}, -2.5);
  g.set({"large"}, 1e21);
  g.set({"small"}, 1e-7);
  g.set({"inf"}, std::numeric_limits<double>::infinity());
  g.set({"minus_inf"}, -std::numeric_limits<double>::infinity());
  const std::string out = r.render();
  CHECK_THAT(out, Catch::Matchers::Contains("pd_value{case=\"zero\"} 0\n"));
  CHECK_THAT(out, Catch::Matchers::Contains("pd_value{case=\"integer\"} 12\n"));
  CHECK_THAT(out, Catch::Matchers::Contains("pd_value{case=\"fraction\"} 0.005\n"));
  CHECK_THAT(out, Catch::Matchers::Contains("pd_value{case=\"negative\"} -2.5\n"));
  CHECK_THAT(out, Catch::Matchers::Contains("pd_value{case=\"large\"} 1e+21\n"));
  CHECK_THAT(out, Catch::Matchers::Contains("pd_value{case=\"small\"} 1e-07\n"));
  CHECK_THAT(out, Catch::Matchers::Contains("pd_value{case=\"inf\"} +Inf\n"));
  CHECK_THAT(out, Catch::Matchers::Contains("pd_value{case=\"minus_inf\"} -Inf\n"));
}

TEST_CASE("metrics: a labelled metric without children shows HELP and TYPE alone", "[metrics]") {
  Registry r;
  r.counter("pd_rank_down_total", "Times down.", {"role", "rank"});
  CHECK(r.render() ==
        "# HELP pd_rank_down_total Times down.\n"
        "# TYPE pd_rank_down_total counter\n");
}

TEST_CASE("metrics: labels keep their declared order, not the alphabet's", "[metrics]") {
  Registry r;
  Gauge& g = r.gauge("pd_rank_up", "Up.", {"role", "rank"});
  g.set({"prefill", "2"}, 1);
  g.set({"decode", "10"}, 0);
  CHECK(r.render() ==
        "# HELP pd_rank_up Up.\n"
        "# TYPE pd_rank_up gauge\n"
        "pd_rank_up{role=\"decode\",rank=\"10\"} 0\n"
        "pd_rank_up{role=\"prefill\",rank=\"2\"} 1\n");
}

TEST_CASE("metrics: a NaN observation counts in the +Inf bucket only", "[metrics]") {
  Registry r;
  Histogram& h = r.histogram("pd_ratio", "A ratio.", {0.5, 1});
  h.observe(std::numeric_limits<double>::quiet_NaN());
  h.observe(0.25);
  Histogram::Child& child = h.with({});
  CHECK(child.count() == 2);
  CHECK(child.cumulative_counts() == std::vector<uint64_t>{1, 1, 2});
}

TEST_CASE("metrics: registering a name twice returns the same metric", "[metrics]") {
  Registry r;
  Counter& a = r.counter("pd_x_total", "x", {"k"});
  Counter& b = r.counter("pd_x_total", "x", {"k"});
  CHECK(&a == &b);
  a.inc({"v"});
  CHECK(b.value({"v"}) == 1.0);
}

TEST_CASE("metrics: concurrent updates are all counted", "[metrics]") {
  Registry r;
  Counter& c = r.counter("pd_tokens_total", "Tokens.", {"pool"});
  Histogram& h = r.histogram("pd_itl_seconds", "Inter-token latency.", {0.01, 0.1});
  constexpr int kThreads = 4;
  constexpr int kPerThread = 5000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        c.inc({t % 2 == 0 ? "even" : "odd"});
        h.observe(i % 2 == 0 ? 0.005 : 0.05);
        if (i % 500 == 0) (void)r.render();  // rendering concurrently with updates is safe
      }
    });
  }
  for (std::thread& t : threads) t.join();
  CHECK(c.value({"even"}) == 2.0 * kPerThread);
  CHECK(c.value({"odd"}) == 2.0 * kPerThread);
  const std::string out = r.render();
  CHECK_THAT(out, Catch::Matchers::Contains("pd_itl_seconds_bucket{le=\"0.01\"} 10000\n"));
  CHECK_THAT(out, Catch::Matchers::Contains("pd_itl_seconds_bucket{le=\"0.1\"} 20000\n"));
  CHECK_THAT(out, Catch::Matchers::Contains("pd_itl_seconds_bucket{le=\"+Inf\"} 20000\n"));
  CHECK_THAT(out, Catch::Matchers::Contains("pd_itl_seconds_count 20000\n"));
}

}  // namespace
}  // namespace pd::router
