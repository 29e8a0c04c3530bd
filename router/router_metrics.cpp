// The series the router exports, registered once (see router_metrics.h).
#include "router/router_metrics.h"

#include <algorithm>
#include <vector>

namespace pd::router {
namespace {

// A series' name and help (docs/METRICS.md lists them), grouped below by what
// they describe; RouterMetrics' constructor registers them, with their labels,
// in the order of its members (the order of /metrics).
struct Series {
  const char* name;
  const char* help;
};

// ---- A request's life in the router: its outcome, its latencies, its tokens.
constexpr Series kRequests{"pd_requests_total", "Requests by final outcome"};
constexpr Series kTtft{"pd_time_to_first_token_seconds", "Arrival at the router to the first token"};
constexpr Series kItl{"pd_inter_token_seconds", "Time between consecutive tokens of a request"};
constexpr Series kFirstItl{"pd_first_inter_token_seconds",
                           "Token 1 to token 2 of a request: where the KV handoff shows (token 1 comes from "
                           "the prefill rank, token 2 from the decode rank once the KV has landed and a step ran)"};
constexpr Series kMaxItl{"pd_request_max_inter_token_seconds",
                         "Per finished request of 2 or more tokens: its largest gap between consecutive tokens"};
constexpr Series kE2e{"pd_e2e_request_seconds", "Arrival to the final answer"};
constexpr Series kStage{"pd_stage_seconds",
                        "Time in each stage: router_queue, prefill_queue, prefill, transfer, decode_queue"};
constexpr Series kPromptTokens{"pd_prompt_tokens_total", "Prompt tokens of dispatched requests"};
constexpr Series kGenerationTokens{"pd_generation_tokens_total", "Tokens generated"};
constexpr Series kRouterQueue{"pd_router_queue_length", "Requests waiting in the router for a worker"};
constexpr Series kInFlight{"pd_requests_in_flight", "Requests accepted and not yet finished"};
constexpr Series kRetried{"pd_requests_retried_total",
                          "Requests re-run on other ranks after a rank failure, before any token reached the client"};
constexpr Series kMigrated{
    "pd_requests_migrated_total",
    "Requests moved to other ranks after a rank failure, after tokens reached the client (the stream goes on)"};

// ---- KV handoffs, as their prefill ranks report them.
constexpr Series kTransferSeconds{"pd_kv_transfer_seconds",
                                  "KV handoff latency not hidden by compute: prefill done to last byte sent"};
constexpr Series kTransferGbps{
    "pd_kv_transfer_gbps",
    "KV handoff throughput per request: bytes / (first layer posted to last byte sent), GB/s"};
constexpr Series kTransferBytes{"pd_kv_transfer_bytes_total", "KV bytes moved from prefill to decode ranks"};
constexpr Series kTransferHidden{"pd_kv_transfer_hidden_ratio",
                                 "Per handoff: fraction of its KV bytes sent before the prompt's last layer "
                                 "was computed (moved behind compute)"};

// ---- Per rank (labels role, rank): its last load report, its KV pool, its state.
constexpr Series kRankPromptTokens{
    "pd_rank_prompt_tokens_total",
    "Prompt tokens whose KV the rank built, by source: cache (its prefix cache held them) or computed"};
constexpr Series kRunning{"pd_running_sequences", "Sequences in a worker's batch (last report)"};
constexpr Series kWaiting{"pd_waiting_requests", "Requests queued on a worker (last report)"};
constexpr Series kFreeBlocks{"pd_free_kv_blocks", "Free KV blocks of a worker (last report)"};
constexpr Series kTotalBlocks{"pd_kv_blocks", "KV blocks of a worker's pool"};
constexpr Series kKvPoolBytes{"pd_kv_pool_bytes",
                              "Bytes of a worker's KV pool (blocks x block_size x pd_kv_bytes_per_token)"};
constexpr Series kPreemptions{"pd_preemptions", "Preemptions on a decode rank since start"};
constexpr Series kSpecDrafted{"pd_spec_draft_tokens", "Tokens a decode rank drafted (speculative decoding) since start"};
constexpr Series kSpecAccepted{"pd_spec_accepted_tokens",
                               "Drafted tokens a decode rank's verification accepted since start"};
constexpr Series kSpecSteps{"pd_spec_steps",
                            "Sequence steps a decode rank ran with drafted tokens since start (tokens per such step: "
                            "1 + accepted / steps)"};
constexpr Series kRankUp{"pd_rank_up", "1 while the rank is up, 0 while starting or declared down"};
constexpr Series kQuarantined{
    "pd_kv_blocks_quarantined",
    "KV blocks held back until MPI can no longer write into them (a sender that went down mid-transfer)"};
constexpr Series kTagsRetired{"pd_kv_tags_retired",
                              "KV transfer tags a decode rank will not give out again until the prefill "
                              "rank leaves (a handoff ended early while it was down, or on a device path)"};
constexpr Series kTagsReclaiming{"pd_kv_tags_reclaiming",
                                 "KV transfer tags of handoffs that ended early, held until what the prefill "
                                 "rank sent under them is swept up to its seal"};
constexpr Series kRefusedMessages{"pd_refused_messages",
                                  "Control messages the rank ignored since it started because their sender may "
                                  "not send them (docs/SECURITY.md)"};
constexpr Series kPrefixIndexBlocks{"pd_router_prefix_index_blocks",
                                    "Prefix blocks the router's index holds for the rank (from its KV events)"};

// ---- Membership and routing: ranks coming and going, where requests went.
constexpr Series kRankDown{"pd_rank_down_total", "Times the rank was declared down (silent for timeouts.heartbeat_ms)"};
constexpr Series kRefusedLinks{"pd_refused_links",
                               "Joining links the router freed since it started because they did not prove the "
                               "cluster secret (docs/SECURITY.md)"};
constexpr Series kRankRequests{"pd_rank_requests_total", "Requests dispatched to the rank (each attempt counts)"};
constexpr Series kRoutingDecisions{
    "pd_router_routing_decisions_total",
    "Dispatch decisions by reason: least_work (no cache held any of the prompt), cache_aware (the chosen "
    "rank's prefix cache held part of it), balance (a cache held part, its rank was over the imbalance "
    "bound), decode_reuse (a decode rank held all but a short suffix and computed it)"};
constexpr Series kWarmPrefills{"pd_router_warm_prefills_total",
                               "Warm-ups (router.warm_prefill): a finished request's prompt and answer computed into "
                               "an idle prefill rank's cache, by outcome: sent, done, failed"};
constexpr Series kJoined{"pd_ranks_joined_total", "Ranks that joined the running cluster (elastic pools)"};
constexpr Series kLeft{"pd_ranks_left_total", "Ranks drained out of the cluster and removed"};
constexpr Series kKvBytesPerToken{"pd_kv_bytes_per_token",
                                  "KV cache bytes per token (K and V, all layers) in the workers' kv.dtype"};

using Labels = std::vector<std::string>;
const Labels kRankLabels{"role", "rank"};

Counter& counter(Registry& r, const Series& s, Labels labels = {}) { return r.counter(s.name, s.help, std::move(labels)); }
Gauge& gauge(Registry& r, const Series& s, Labels labels = {}) { return r.gauge(s.name, s.help, std::move(labels)); }
// A latency histogram (default_latency_buckets) unless other buckets are given.
Histogram& histogram(Registry& r, const Series& s, Labels labels = {},
                     std::vector<double> buckets = default_latency_buckets()) {
  return r.histogram(s.name, s.help, std::move(buckets), std::move(labels));
}

std::vector<double> gbps_buckets() { return {0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64}; }
std::vector<double> hidden_ratio_buckets() { return {0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0}; }

}  // namespace

RouterMetrics::RouterMetrics(Registry& r, const std::string& kv_dtype, int64_t kv_bytes)
    : kv_bytes_per_token(kv_bytes),
      requests_total(counter(r, kRequests, {"outcome"})),
      ttft(histogram(r, kTtft)),
      itl(histogram(r, kItl)),
      first_itl(histogram(r, kFirstItl)),
      max_itl(histogram(r, kMaxItl)),
      e2e(histogram(r, kE2e)),
      stage(histogram(r, kStage, {"stage"})),
      transfer_seconds(histogram(r, kTransferSeconds)),
      transfer_gbps(histogram(r, kTransferGbps, {}, gbps_buckets())),
      transfer_bytes(counter(r, kTransferBytes)),
      transfer_hidden(histogram(r, kTransferHidden, {}, hidden_ratio_buckets())),
      prompt_tokens_total(counter(r, kPromptTokens)),
      generation_tokens_total(counter(r, kGenerationTokens)),
      rank_prompt_tokens_total(counter(r, kRankPromptTokens, {"role", "rank", "source"})),
      running(gauge(r, kRunning, kRankLabels)),
      waiting(gauge(r, kWaiting, kRankLabels)),
      free_blocks(gauge(r, kFreeBlocks, kRankLabels)),
      total_blocks(gauge(r, kTotalBlocks, kRankLabels)),
      kv_pool_bytes(gauge(r, kKvPoolBytes, kRankLabels)),
      preemptions(gauge(r, kPreemptions, {"rank"})),
      spec_drafted(gauge(r, kSpecDrafted, {"rank"})),
      spec_accepted(gauge(r, kSpecAccepted, {"rank"})),
      spec_steps(gauge(r, kSpecSteps, {"rank"})),
      router_queue(gauge(r, kRouterQueue)),
      in_flight(gauge(r, kInFlight)),
      rank_up(gauge(r, kRankUp, kRankLabels)),
      rank_down_total(counter(r, kRankDown, kRankLabels)),
      retried_total(counter(r, kRetried)),
      migrated_total(counter(r, kMigrated)),
      quarantined_blocks(gauge(r, kQuarantined, kRankLabels)),
      kv_tags_retired(gauge(r, kTagsRetired, kRankLabels)),
      kv_tags_reclaiming(gauge(r, kTagsReclaiming, kRankLabels)),
      refused_messages(gauge(r, kRefusedMessages, kRankLabels)),
      refused_links(gauge(r, kRefusedLinks)),
      rank_requests_total(counter(r, kRankRequests, kRankLabels)),
      routing_decisions_total(counter(r, kRoutingDecisions, {"reason"})),
      warm_prefills_total(counter(r, kWarmPrefills, {"outcome"})),
      prefix_index_blocks(gauge(r, kPrefixIndexBlocks, kRankLabels)),
      joined_total(counter(r, kJoined, {"role"})),
      left_total(counter(r, kLeft, {"role"})) {
  gauge(r, kKvBytesPerToken, {"dtype"}).set({kv_dtype}, static_cast<double>(kv_bytes));
}

void RouterMetrics::observe_transfer(const proto::TransferStats& m) {
  transfer_bytes.inc(static_cast<double>(m.bytes));
  transfer_seconds.observe(m.exposed_s);
  stage.observe({"transfer"}, m.exposed_s);
  if (m.wire_s > 0) transfer_gbps.observe(static_cast<double>(m.bytes) / m.wire_s / 1e9);
  if (m.bytes > 0)
    transfer_hidden.observe(std::clamp(static_cast<double>(m.hidden_bytes) / static_cast<double>(m.bytes), 0.0, 1.0));
}

void RouterMetrics::update_ranks(const WorkerTable& workers, int block_size) {
  for (const auto* pool : {&workers.prefill(), &workers.decode()}) {
    for (const WorkerView& wv : *pool) {
      const std::vector<std::string> labels{role_label(wv), std::to_string(wv.rank)};
      // A rank declared down holds none of the cluster's work (its requests
      // re-ran or migrated): its last report's counts would be counted twice
      // in a sum over ranks. Its KV pool figures stay as last reported.
      const bool down = wv.state == RankState::kDown;
      running.set(labels, down ? 0 : wv.load.running);
      waiting.set(labels, down ? 0 : wv.load.waiting);
      free_blocks.set(labels, static_cast<double>(wv.load.free_blocks));
      total_blocks.set(labels, static_cast<double>(wv.load.total_blocks));
      kv_pool_bytes.set(labels, static_cast<double>(wv.load.total_blocks) * block_size *
                                    static_cast<double>(kv_bytes_per_token));
      if (!wv.is_prefill) {
        const std::vector<std::string> rank{std::to_string(wv.rank)};
        preemptions.set(rank, static_cast<double>(wv.load.preemptions));
        spec_drafted.set(rank, static_cast<double>(wv.load.spec_drafted));
        spec_accepted.set(rank, static_cast<double>(wv.load.spec_accepted));
        spec_steps.set(rank, static_cast<double>(wv.load.spec_steps));
      }
      rank_up.set(labels, wv.state == RankState::kUp ? 1 : 0);
      quarantined_blocks.set(labels, static_cast<double>(wv.load.quarantined_blocks));
      kv_tags_retired.set(labels, static_cast<double>(wv.load.kv_tags_retired));
      kv_tags_reclaiming.set(labels, static_cast<double>(wv.load.kv_tags_reclaiming));
      refused_messages.set(labels, static_cast<double>(wv.load.refused_messages));
      prefix_index_blocks.set(labels, static_cast<double>(workers.index().blocks(wv.rank)));
    }
  }
}

void RouterMetrics::count_prompt_tokens(const WorkerView& w, const proto::LoadReport& before,
                                        const proto::LoadReport& now) {
  // Totals since the rank started (they only grow): most reports add nothing.
  const int64_t cached = now.prompt_tokens_cached - before.prompt_tokens_cached;
  const int64_t computed = now.prompt_tokens_computed - before.prompt_tokens_computed;
  if (cached <= 0 && computed <= 0) return;
  const std::string role = role_label(w), rank = std::to_string(w.rank);
  rank_prompt_tokens_total.inc({role, rank, "cache"}, static_cast<double>(cached));  // both series from the first prompt
  rank_prompt_tokens_total.inc({role, rank, "computed"}, static_cast<double>(computed));
}

void RouterMetrics::rank_left(const WorkerView& w) {
  const std::vector<std::string> labels{role_label(w), std::to_string(w.rank)};
  left_total.inc({role_label(w)});
  rank_up.set(labels, 0);
  running.set(labels, 0);
  waiting.set(labels, 0);
  free_blocks.set(labels, static_cast<double>(w.load.total_blocks));
  quarantined_blocks.set(labels, 0);
  kv_tags_retired.set(labels, 0);
  kv_tags_reclaiming.set(labels, 0);
  prefix_index_blocks.set(labels, 0);
}

}  // namespace pd::router
