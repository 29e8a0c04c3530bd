// The router's metrics: every series it exports (names and help in
// docs/METRICS.md), registered once in one place, and what a few observations
// mean — a handoff's transfer stats, the per-rank gauges copied from the worker
// table, the series a rank leaves behind when it is removed. Link thread,
// except the counters the io threads bump (rejected requests).
#pragma once

#include <cstdint>
#include <string>

#include "protocol/messages.h"
#include "router/dispatch.h"
#include "router/metrics.h"

namespace pd::router {

struct RouterMetrics {
  // Registers the series in `registry`, which must outlive this.
  RouterMetrics(Registry& registry, const std::string& kv_dtype, int64_t kv_bytes_per_token);

  // A KV handoff's stats, as its prefill rank reported them.
  void observe_transfer(const proto::TransferStats& m);
  // The per-rank gauges, from the worker table's last reports and states.
  void update_ranks(const WorkerTable& workers, int block_size);
  // A rank's load report `now` after `before`: what its prompt-token totals grew by.
  void count_prompt_tokens(const WorkerView& w, const proto::LoadReport& before, const proto::LoadReport& now);
  // A rank left: its series stay (a metric's children live as long as the
  // registry), as it left, holding nothing.
  void rank_left(const WorkerView& w);

  int64_t kv_bytes_per_token;
  Counter& requests_total;
  Histogram& ttft;
  Histogram& itl;
  Histogram& first_itl;  // token 1 -> token 2 (where a handoff shows)
  Histogram& max_itl;    // per finished request: its largest gap
  Histogram& e2e;
  Histogram& stage;
  Histogram& transfer_seconds;
  Histogram& transfer_gbps;
  Counter& transfer_bytes;
  Histogram& transfer_hidden;
  Counter& prompt_tokens_total;
  Counter& generation_tokens_total;
  Counter& rank_prompt_tokens_total;
  Gauge& running;
  Gauge& waiting;
  Gauge& free_blocks;
  Gauge& total_blocks;
  Gauge& kv_pool_bytes;
  Gauge& preemptions;
  Gauge& spec_drafted;   // a decode rank's, from its load reports
  Gauge& spec_accepted;
  Gauge& spec_steps;
  Gauge& router_queue;
  Gauge& in_flight;
  Gauge& rank_up;
  Counter& rank_down_total;
  Counter& retried_total;
  Counter& migrated_total;
  Gauge& quarantined_blocks;
  Gauge& kv_tags_retired;     // a decode rank's, from its load reports
  Gauge& kv_tags_reclaiming;  // likewise
  Gauge& refused_messages;  // a worker's, from its load reports
  Gauge& refused_links;     // the router's: joining links without a proof of the cluster secret
  Counter& rank_requests_total;
  Counter& routing_decisions_total;
  Counter& warm_prefills_total;
  Gauge& prefix_index_blocks;
  Counter& joined_total;
  Counter& left_total;
};

// "prefill" or "decode": the role label of a rank's series.
inline const char* role_label(const WorkerView& w) { return w.is_prefill ? "prefill" : "decode"; }

}  // namespace pd::router
