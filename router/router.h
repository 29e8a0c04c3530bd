// The router: the cluster's HTTP front end and its link to the workers. It
// owns the parts and wires them together; each decision lives in the file
// named for it:
//   http_routes.cpp    which handler a path reaches, the API and admin keys, /health
//   completions.cpp    a completion request: parsed, tokenized, admitted, fanned out into its choices
//   prompts.h          the tokens a prompt becomes
//   admission.h        whether a request is accepted (context, queue bounds, cluster state)
//   request_table.h    requests by id, the queue, re-runs, deadlines, the lifecycle states
//   request_flow.cpp   a request's moves on the link thread: dispatch, tokens, failures, its end
//   dispatch.h         which prefill/decode pair takes a request (WorkerTable::pick)
//   membership.h       joins, drains, liveness (ranks down, fenced, back)
//   choice_stream.h    a choice's tokens in order, its text and logprobs
//   answer.h           what the client sees at the end: bodies, usage, failure kind -> HTTP status
//   router_metrics.h   the series the router exports
//
// Threads: the HTTP server's io threads (or a test, through submit()) validate,
// template and tokenize each request and hand it to the link through the inbox;
// the link (the thread that called run(), the only one that calls MPI)
// dispatches requests to a prefill and a decode rank, turns worker events into
// response chunks, and owns every request's state and deadline. A slow client
// never blocks the link (writes are posted to the connection), and the link
// never waits on a client.
//
// Every request ends in exactly one final state — finished (stop/length),
// cancelled (client gone), or failed with a reason the client sees — and the
// workers are told to drop it whenever the router ends it first.
//
// Stopping (SIGTERM/SIGINT or request_stop()) is the router's own shutdown: no
// new requests, in-flight ones get timeouts.drain_ms to finish. "Drain" is a
// rank leaving the pool (membership.h).
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <variant>

#include "config/cluster_config.h"
#include "protocol/control_channel.h"
#include "protocol/role_table.h"
#include "router/admission.h"
#include "router/dispatch.h"
#include "router/http_server.h"
#include "router/membership.h"
#include "router/metrics.h"
#include "router/prompts.h"
#include "router/request_table.h"
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
  // requests, in-flight ones get timeouts.drain_ms to finish, workers are told
  // to shut down. Returns an error only if the HTTP server could not start.
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
  void submit(HttpRequest http, std::shared_ptr<ResponseWriter> w);

 private:
  using Clock = std::chrono::steady_clock;
  enum class End { kFinished, kCancelled, kFailed };
  // What the io threads hand the link.
  struct NewRequest { std::unique_ptr<Request> req; };
  struct ClientGone { std::vector<uint64_t> http_ids; };  // the choices of the answer it was waiting for
  struct DrainRank {  // POST /admin/drain, answered by the link thread
    int rank;
    std::shared_ptr<ResponseWriter> writer;
  };
  using InboxItem = std::variant<NewRequest, ClientGone, DrainRank>;

  // io threads (http_routes.cpp, completions.cpp)
  void respond_health(ResponseWriter& w);
  void handle_drain(const HttpRequest& http, std::shared_ptr<ResponseWriter> w);
  void handle_tokenize(const HttpRequest& http, ResponseWriter& w);
  void handle_detokenize(const HttpRequest& http, ResponseWriter& w);
  // 404 model_not_found unless `model` is empty or the served one.
  std::optional<ApiError> check_model(const std::string& model) const;
  void handle_completion(Endpoint ep, const HttpRequest& http, std::shared_ptr<ResponseWriter> w);
  ClusterState cluster_state() const;
  // One Request per choice of `api`'s prompts, answering through `response`.
  std::vector<std::unique_ptr<Request>> make_choices(const ApiRequest& api, std::vector<Prompt>& prompts,
                                                     const std::vector<int32_t>& max_tokens,
                                                     const std::shared_ptr<Response>& response);
  // Hands the choices to the link and hooks the client's disconnect.
  void post_choices(std::vector<std::unique_ptr<Request>> reqs, const Response& response);

  // link thread (router.cpp)
  // Takes what the io threads posted: new requests join the queue, a client
  // that left cancels its choices, a drain request is acted on and answered.
  void take_inbox();
  void handle_messages();
  void begin_stop();
  void update_health();
  // link thread (request_flow.cpp)
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
  // What `rank`, just declared down, held: re-run or failed.
  void on_rank_down(int rank, const std::string& name, const std::string& why);
  void check_deadlines();
  // Whether `source` serves the current attempt of `r`.
  static bool serves(const Request& r, int source);
  // Runs the request again under a new wire id, at the front of the queue;
  // false when it may not (the caller then fails it).
  bool rerun(Request& r, const std::string& why);
  // The request's ranks drop the attempt and the worker table stops counting it.
  void release_workers(const Request& r, bool tell_workers);
  void finalize(uint64_t wire_id, End how, const std::string& finish_reason, const ApiError& error = {},
                bool tell_workers = true);
  // The answer is given: its other choices end here (cancelled).
  void cancel_siblings(const Response& resp);

  const ClusterConfig cfg_;
  RequestDefaults sampling_defaults_;  // cfg_.sampling, for fields a request omits
  const RoleTable roles_;
  ModelInfo model_;
  std::vector<TokenId> hidden_ids_;   // EOS + chat_stop_ids_: end generation, print nothing
  std::vector<TokenId> chat_stop_ids_;  // the chat template's end-of-turn tokens (e.g. <|im_end|>, <end_of_turn>)
  HttpServer http_;
  Registry registry_;
  RouterMetrics metrics_;

  // Shared between io threads and the link.
  std::recursive_mutex inbox_mu_;  // recursive: a disconnect callback may run inline while it is held
  std::deque<InboxItem> inbox_;    // guarded by inbox_mu_
  std::atomic<int> queued_{0};     // requests accepted, not yet dispatched
  std::atomic<bool> stopping_{false};
  std::atomic<bool> ready_{false};
  mutable std::mutex ready_mu_;
  std::string not_ready_reason_;   // guarded by ready_mu_
  std::string ranks_json_ = "[]";  // guarded by ready_mu_: /health's per-rank list
  std::atomic<bool> degraded_{false};
  RequestTable requests_;          // new_id(): any thread; the rest: link thread only

  // Link thread only.
  std::unique_ptr<ControlChannel> channel_;
  const Env* env_ = &system_env();  // set_env()
  WorkerTable workers_;
  Membership membership_;
  std::unordered_map<uint64_t, DispatchChoice> warm_;  // warm-ups in flight, by wire id
  std::optional<Clock::time_point> stop_deadline_;
  Clock::time_point started_{}, last_housekeeping_{};
  bool startup_warned_ = false;
};

}  // namespace pd::router
