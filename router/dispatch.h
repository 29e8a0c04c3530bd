// The router's view of the workers and the dispatch policy. Owned by the
// cluster-link thread; counts what the router itself sent (exact, immediate)
// and what the workers last reported (queue lengths, free KV blocks).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "util/env.h"

#include "protocol/messages.h"
#include "router/prefix_index.h"

namespace pd::router {

// A rank's membership as the router sees it. kStarting until its first ready
// report; kUp while it is heard from within timeouts.heartbeat_ms; kDown when
// it is not (or never started within timeouts.startup_ms). A down rank is
// re-admitted (kUp under a new epoch) when it reports under the epoch the
// router gave it in a Rejoin. kDraining: being removed (it takes no new work,
// finishes what it has, then leaves the table); liveness still applies.
enum class RankState { kStarting, kUp, kDown, kDraining };
const char* rank_state_name(RankState s);

struct WorkerView {
  int rank = -1;
  bool is_prefill = false;
  RankState state = RankState::kStarting;
  proto::Epoch epoch = 0;          // current incarnation (kUp) / the one that went down (kDown)
  std::chrono::steady_clock::time_point last_heard{};  // any message from it
  std::chrono::steady_clock::time_point last_rejoin_sent{};
  int64_t times_down = 0;
  int outstanding = 0;             // requests the router sent it that are not finished there
  int64_t dispatched = 0;          // requests ever sent to it (ties go to the rank sent fewer)
  int64_t outstanding_tokens = 0;  // prompt tokens (prefill) / prompt + max_tokens (decode) of those
  // Decode ranks: prompt tokens of follow-ups sent back to it (decode reuse)
  // that it has still to compute (until each one's first token).
  int64_t reuse_tokens = 0;
  proto::LoadReport load;          // last report
  std::chrono::steady_clock::time_point last_report{};
  bool reported = false;
  // Elastic pools. Ranks of the launching job reach each other; a joined rank
  // reaches its own pool (same `pool`) and the ranks it linked to on joining.
  bool joined = false;
  std::string pool;                // a joined rank's pool (its mpirun)
  std::set<int> links;             // ranks linked to it after launch (either side)
  std::string port;                // where it accepts joining ranks (empty: not elastic)
  std::chrono::steady_clock::time_point added{};         // joined ranks: its startup deadline runs from here
  std::chrono::steady_clock::time_point drain_started{};  // kDraining since
};

// Why a request went where it did (pd_router_routing_decisions_total{reason}).
enum class RouteReason {
  kLeastWork,    // no rank's cache held any of the prompt (or the policy is least_work)
  kCacheAware,   // the chosen rank's prefix cache holds part of the prompt
  kBalance,      // a rank's cache held part of it, but that rank was over the imbalance bound
  kDecodeReuse,  // a decode rank holds all but a short suffix: it computes that itself
};
const char* route_reason_name(RouteReason r);

// Whether two ranks can exchange KV: both of the launching job, both of one
// joined pool, or linked after launch (see WorkerView's links).
bool ranks_linked(const WorkerView& a, const WorkerView& b);

// How the table picks ranks (router.* in cluster.json; docs/ROUTING.md).
struct RoutingPolicy {
  bool cache_aware = true;
  double queue_weight = 1.0;
  double balance_ratio = 1.5;
  int64_t balance_tokens = 1024;
  int64_t decode_reuse_tokens = 256;
  // The cost of a prompt token computed on a decode rank, in prefill-rank
  // tokens: a follow-up goes back to a decode rank only while
  // decode_reuse_weight x (its suffix + the reuse tokens that rank has still
  // to compute) is no more than the best prefill rank's expected cost.
  double decode_reuse_weight = 1.0;
  // A rank's cache counts only when it holds at least this fraction of the
  // prompt: a short common head (a chat template's default system prompt)
  // must not draw every prompt to the first rank that computed it.
  double min_cached_fraction = 0.3;
};

// A request to place: its prompt's length, the chained hashes of its full
// blocks (prompt_block_hashes; empty: the caches are not consulted) and its
// max_tokens.
struct DispatchRequest {
  int64_t prompt_tokens = 0;
  int64_t max_tokens = 0;
  std::span<const uint64_t> block_hashes;
};

struct DispatchChoice {
  int prefill_rank = -1;  // -1 in colocated mode, and for a decode-rank reuse
  int decode_rank = -1;
  int64_t cached_tokens = 0;  // of the prompt, in the computing rank's cache (as last reported)
  // Prompt tokens the computing rank (the prefill rank; a decode reuse's
  // decode rank) computes, counted against it until its first token.
  int64_t prefill_work = 0;
  RouteReason reason = RouteReason::kLeastWork;
};

class WorkerTable {
 public:
  WorkerTable(const std::vector<int>& prefill_ranks, const std::vector<int>& decode_ranks, int block_size);
  // Colocated: the launching job had decode ranks and no prefill rank. A router
  // started alone (its pools join later) runs disaggregated.
  bool colocated() const { return colocated_; }
  // Where time comes from (default: the steady clock); the startup deadline
  // counts from this call. The Env must outlive the table.
  void set_env(const Env* env);
  // Picks ranks for a request among those up, or nullopt when every candidate
  // is down or at max_inflight (the request waits in the router's queue).
  //  - decode-rank reuse (cache_aware, not colocated): a decode rank whose
  //    cache holds all but at most decode_reuse_tokens of the prompt, and more
  //    of it than any prefill rank, with room for the request and within the
  //    imbalance bound, gets it alone (it computes the rest) -- unless
  //    decode_reuse_weight x (the rest + the reuse tokens it has still to
  //    compute) exceeds the best prefill rank's expected cost below: a busy
  //    decode rank leaves the follow-up to an idle prefill rank;
  //  - prefill, cache_aware: the least (uncached prompt tokens + queue_weight x
  //    outstanding prompt tokens), a rank's cache counting only while its
  //    outstanding tokens are within balance_ratio x the least loaded rank's
  //    + balance_tokens and when it holds at least min_cached_fraction of the
  //    prompt; least_work: fewest outstanding prompt tokens; then fewest
  //    queued (reported), then the rank sent fewer requests, then the lower rank;
  //  - colocated, cache_aware: among decode ranks with room and within the
  //    bound, the one holding the most of the prompt, then as below;
  //  - decode: among ranks whose free KV blocks (reported, minus what the router
  //    sent since) hold the whole request, the fewest outstanding requests
  //    (then the one sent fewer);
  //    if none has room, the one with the most free blocks (it will queue the handoff);
  //  - the pair must be linked (ranks that joined later reach only some ranks):
  //    prefill ranks are tried in order of preference until one has a decode rank.
  std::optional<DispatchChoice> pick(const DispatchRequest& q, int max_inflight) const;
  // A warm-up of `n` tokens (a finished request's prompt and answer, whose
  // block hashes are `hashes`): the idle prefill rank (nothing outstanding)
  // whose cache holds most of it, when that leaves at most `max_compute`
  // tokens to compute; nullopt: none. Count it with on_dispatch (a choice
  // with no decode rank) and end it with on_prefill_done.
  std::optional<DispatchChoice> pick_warm(std::span<const uint64_t> hashes, int64_t n, int64_t max_compute) const;
  void set_policy(const RoutingPolicy& p) { policy_ = p; }
  const RoutingPolicy& policy() const { return policy_; }
  void on_dispatch(const DispatchChoice& c, int64_t prompt_tokens, int64_t max_tokens);
  // The prompt is computed (first token or failure) on `rank` -- the prefill
  // rank, or the decode rank of a decode reuse -- `prefill_work` as chosen / the
  // whole request is over.
  void on_prefill_done(int rank, int64_t prefill_work);
  void on_request_done(int rank, int64_t prompt_tokens, int64_t max_tokens);
  void on_report(int rank, const proto::LoadReport& r);
  // A rank's KV events: applied to the prefix index when they are of its
  // current epoch and it is not down (else dropped: a rejoining rank sends its
  // whole set again).
  void on_kv_events(int rank, const proto::KvEvents& e);
  const PrefixIndex& index() const { return index_; }
  // Any message from `rank` (its heartbeat, while it is up).
  void heard(int rank);
  // Up ranks silent for longer than `heartbeat`, and starting ranks not ready
  // after `startup`: marked down; returned.
  std::vector<int> expire(std::chrono::milliseconds heartbeat, std::chrono::milliseconds startup);
  // Time `d` the router itself did not run (its loop stalled): not counted
  // against any rank's heartbeat or startup deadline.
  void excuse(std::chrono::steady_clock::duration d);
  // Marks `rank` down (its current epoch is the one that ended); its prefix index entry is purged.
  void mark_down(int rank);
  // Marks a down rank up again under `epoch` (its cache is learnt anew from its events).
  void mark_up(int rank, proto::Epoch epoch);
  // A rank that joined the running cluster (kStarting until it reports ready).
  WorkerView& add(int rank, bool is_prefill, const std::string& pool);
  // Links two ranks (a joined rank connected to a worker's port).
  void link(int a, int b);
  // Starts removing `rank`: no new work goes to it. False unless it is up or starting.
  bool begin_drain(int rank);
  // The rank left: gone from the table (and from every rank's links).
  void remove(int rank);
  WorkerView* find(int rank);
  const WorkerView* find(int rank) const;
  // Ready: at least one prefill rank and one decode rank are up (colocated: one
  // decode rank), and every rank of the launching job has either reported or
  // been declared down (a rank joining later does not hold /health back).
  // Otherwise `why` says what is missing.
  bool ready(std::string* why) const;
  // Whether some rank is down (the cluster serves, degraded).
  bool degraded() const;
  // Whether a role's pool is empty because its ranks left (drained out or
  // removed), or every rank it has is draining out — unlike a pool that has
  // not joined yet, nothing will come back by itself. Until a rank of that
  // role joins again.
  bool pool_left() const;
  const std::vector<WorkerView>& prefill() const { return prefill_; }
  const std::vector<WorkerView>& decode() const { return decode_; }

 private:
  std::vector<WorkerView> prefill_, decode_;
  bool prefill_left_ = false, decode_left_ = false;  // the pool's last rank was removed (pool_left)
  bool colocated_ = false;
  int block_size_;
  RoutingPolicy policy_;
  PrefixIndex index_;
  const Env* env_ = &system_env();
  std::chrono::steady_clock::time_point start_ = env_->now();  // startup deadline from here
};

}  // namespace pd::router
