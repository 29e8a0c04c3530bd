// The router: the cluster's HTTP front end and its link to the workers. It
// owns the parts and wires them together; each decision lives in the file
// named for it:
//   http_front.h       the io threads' side (HttpFront): routes, completions intake, /health
//     http_routes.cpp    which handler a path reaches, the API and admin keys, /health
//     completions.cpp    a completion request: parsed, tokenized, admitted, fanned out into its choices
//   front_link.h       the seam between the two sides: the inbox (io -> link), the status (link -> io)
//   link_loop.h        the link thread's side (LinkLoop): inbox, worker messages, membership events, the stop
//     request_flow.cpp   a request's moves on the link thread: dispatch, tokens, failures, its end
//   prompts.h          the tokens a prompt becomes
//   admission.h        whether a request is accepted (context, queue bounds, cluster state)
//   request_table.h    requests by id, the queue, re-runs, deadlines, the lifecycle states
//   dispatch.h         which prefill/decode pair takes a request (WorkerTable::pick)
//   membership.h       joins, drains, liveness (ranks down, fenced, back), reported as events
//   choice_stream.h    a choice's tokens in order, its text and logprobs
//   answer.h           what the client sees at the end: bodies, usage, failure kind -> HTTP status
//   router_metrics.h   the series the router exports
//
// Threads: the HTTP server's io threads (or a test, through submit()) run the
// front: they validate, template and tokenize each request and post it to the
// link's inbox. The link (the thread that called run(), the only one that calls
// MPI) runs the link loop: it dispatches requests to a prefill and a decode
// rank, turns worker events into response chunks, owns every request's state
// and deadline, and publishes what the front reads (readiness, /health's ranks,
// the lifecycle). The two share nothing but those two queues (front_link.h). A
// slow client never blocks the link (writes are posted to the connection), and
// the link never waits on a client.
//
// Stopping (SIGTERM/SIGINT or request_stop()) is the router's own shutdown
// (RouterState: serving -> stopping -> stopped): no new requests, in-flight
// ones get timeouts.stop_grace_ms to finish. "Drain" is a rank leaving the pool
// (membership.h; its deadline is timeouts.rank_drain_ms).
#pragma once

#include <memory>

#include "config/cluster_config.h"
#include "protocol/control_channel.h"
#include "protocol/role_table.h"
#include "router/front_link.h"
#include "router/http_front.h"
#include "router/http_server.h"
#include "router/link_loop.h"
#include "router/metrics.h"
#include "router/prompts.h"
#include "router/router_metrics.h"
#include "util/env.h"

namespace pd::router {

class Router {
 public:
  // `channel` carries the control messages to and from the workers
  // (MpiControlChannel in the cluster); only the link thread uses it.
  Router(const ClusterConfig& cfg, const RoleTable& roles, ModelInfo model, std::unique_ptr<ControlChannel> channel);
  ~Router();
  // Serves until SIGTERM/SIGINT (or request_stop()), then stops: no new
  // requests, in-flight ones get timeouts.stop_grace_ms to finish, workers are
  // told to shut down. Returns an error only if the HTTP server could not start.
  Status run();
  // Async-signal-safe: begins the stop.
  static void request_stop();

  // run() in steps, for tests (one thread calls all three): start() binds the
  // HTTP port (unless `serve_http` is false: requests then come only through
  // submit()); run_once() is one iteration of the link loop (never sleeps;
  // returns false once the stop is over); finish() fails what is left and
  // shuts the workers down.
  Status start(bool serve_http = true);
  bool run_once();
  void finish();
  uint16_t port() const { return http_.port(); }
  // Where the router reads time (deadlines, heartbeats, latencies); default the
  // steady clock. Tests step a FakeEnv. Call before start(); `env` must outlive
  // the router.
  void set_env(const Env* env);

  // One HTTP request, already received (the HTTP server's handler; tests call
  // it directly with a fake writer). Answers through `w`, now or later from the
  // link thread. Any thread; never blocks on the link.
  void submit(HttpRequest http, std::shared_ptr<ResponseWriter> w) { front_.submit(std::move(http), std::move(w)); }

 private:
  // Constant after construction.
  const ClusterConfig cfg_;
  const RoleTable roles_;
  const ModelInfo model_;
  HttpServer http_;
  Registry registry_;
  RouterMetrics metrics_;
  // The seam: any thread.
  RequestIds ids_;
  LinkInbox inbox_;
  LinkStatus status_;
  // The two sides.
  HttpFront front_;  // io threads
  LinkLoop link_;    // the link thread
};

}  // namespace pd::router
