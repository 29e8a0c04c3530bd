// The router's link loop: everything the link thread (the one thread that
// calls MPI) does. One iteration takes the inbox the HTTP front filled, the
// workers' messages, dispatches queued requests, and every 10 ms checks
// liveness (applying what membership reports), deadlines, and publishes the
// state the front reads (LinkStatus). A request's moves — dispatch, tokens in
// order, a worker's failure, a rank going down, its end — are in
// request_flow.cpp.
//
// It owns every request's state and deadline, the worker table and
// membership; it reaches the io threads only through the LinkStatus it
// publishes and the ResponseWriters of the requests it holds (writes are
// posted to the connection: a slow client never blocks it).
//
// Every request ends in exactly one final state — finished (stop/length),
// cancelled (client gone), or failed with a reason the client sees — and the
// workers are told to drop it whenever the router ends it first.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "config/cluster_config.h"
#include "protocol/control_channel.h"
#include "protocol/role_table.h"
#include "router/dispatch.h"
#include "router/front_link.h"
#include "router/membership.h"
#include "router/prompts.h"
#include "router/request_table.h"
#include "router/router_metrics.h"
#include "util/env.h"

namespace pd::router {

// Whether the startup deadline (timeouts.startup_ms) may still log that the
// workers are not ready: kWatching -> kWarned, once.
enum class StartupCheck { kWatching, kWarned };

// The most time between two of the link loop's iterations that counts
// against a rank's deadlines (LinkLoop::excuse_own_stall).
inline constexpr std::chrono::milliseconds kLoopGapCounted{100};
const char* state_name(StartupCheck s);
bool legal(StartupCheck from, StartupCheck to);

// What the link loop works with; every reference must outlive the loop.
struct LinkParts {
  const ClusterConfig& cfg;
  const RoleTable& roles;
  const ModelInfo& model;
  RouterMetrics& metrics;
  RequestIds& ids;
  LinkInbox& inbox;
  LinkStatus& status;
};

class LinkLoop {
 public:
  // `channel` carries the control messages to and from the workers.
  LinkLoop(LinkParts parts, std::unique_ptr<ControlChannel> channel);
  // Where the loop reads time (deadlines, heartbeats, latencies). Before start().
  void set_env(const Env* env);
  // The loop begins: the startup deadline counts from now.
  void start();
  // One iteration; never sleeps. `stop_asked`: SIGTERM/SIGINT or
  // Router::request_stop() was seen (the stop begins once). False once the
  // stop is over: every request ended, or timeouts.stop_grace_ms passed.
  bool run_once(bool stop_asked);
  // Fails what is left and tells every worker to shut down.
  void finish();
  RouterState state() const { return shown_.state; }
  bool colocated() const { return workers_.colocated(); }

 private:
  using Clock = std::chrono::steady_clock;
  enum class End { kFinished, kCancelled, kFailed };

  // link_loop.cpp
  // Takes what the io threads posted: new requests join the queue, a client
  // that left cancels its choices, a drain request is acted on and answered.
  void take_inbox();
  void handle_messages();
  void on_worker_message(int source, proto::Message& msg);
  // Applies what a membership check reported, in order.
  void apply(const std::vector<MembershipEvent>& events);
  void begin_stop();
  // Publishes the gauges and what the front reads.
  void update_health();

  // request_flow.cpp
  void dispatch_queued();
  void on_tokens(int source, const proto::TokenEvents& m);
  // Token `index` of `r` reached its turn. False once `r` ended.
  bool on_token(Request& r, int32_t index, const PendingToken& t);
  void on_failed(int source, const proto::RequestFailed& m);
  // router.warm_prefill: a finished request's prompt and answer go to an idle
  // prefill rank holding most of them, which computes the rest into its cache.
  void warm_prefill(const Request& r);
  // A warm-up ended on its rank (Warmed, or failed there): the rank's work is released.
  void end_warm(uint64_t id, const char* outcome);
  // What a rank just declared down held: re-run or failed.
  void on_rank_down(const RankDown& down);
  void check_deadlines();
  void excuse_own_stall();
  // Runs the request again under a new wire id, at the front of the queue;
  // false when it may not (the caller then fails it).
  bool rerun(Request& r, const std::string& why);
  // The request's ranks drop the attempt and the worker table stops counting it.
  void release_workers(const Request& r, bool tell_workers);
  void finalize(uint64_t wire_id, End how, const std::string& finish_reason, const ApiError& error = {},
                bool tell_workers = true);
  // A choice failed and answered with `error`: the other choices end here,
  // counted with the same outcome (pd_requests_total counts choices).
  void end_siblings(const Response& resp, const ApiError& error);

  LinkParts p_;
  std::unique_ptr<ControlChannel> channel_;
  const Env* env_ = &system_env();
  RequestTable requests_;
  WorkerTable workers_;
  Membership membership_;
  std::unordered_map<uint64_t, DispatchChoice> warm_;  // warm-ups in flight, by wire id
  LinkSnapshot shown_;  // what was last published to the front (the lifecycle state included)
  std::optional<Clock::time_point> stop_deadline_;
  Clock::time_point started_{}, last_housekeeping_{};
  std::optional<Clock::time_point> last_iteration_;  // excuse_own_stall
  StartupCheck startup_check_ = StartupCheck::kWatching;
};

}  // namespace pd::router
