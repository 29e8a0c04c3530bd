// The router: the cluster's HTTP front end and its link to the workers.
//
// Threads: the HTTP server's io threads validate, template and tokenize each
// request and hand it to the link through a queue; the link (the thread that
// called run(), the only one that calls MPI) dispatches requests to a prefill
// and a decode rank, turns worker events into response chunks, and owns every
// request's state and deadline. A slow client never blocks the link (writes
// are posted to the connection), and the link never waits on a client.
//
// Every request ends in exactly one final state — finished (stop/length),
// cancelled (client gone), or failed with a reason the client sees — and the
// workers are told to drop it whenever the router ends it first.
//
// A request's lifecycle here (RequestState, checked): kQueued -> kDispatched
// (sent to a prefill/decode pair) -> kStreaming (a token reached the client)
// -> ended (erased). kDispatched -> kQueued is a re-run: a rank of its pair
// went down, or failed it with a retryable kind, before any token reached the
// client. Each dispatch attempt travels under a fresh wire id, so anything a
// worker still sends about an earlier attempt is unknown here and ignored.
//
// Elastic pools: a rank started later by its own mpirun joins (Join ->
// JoinAccepted, ranks linked through MPI ports) and is sent work once it
// reports ready; any rank can be drained out (POST /admin/drain, or a Leave
// from the rank): kDraining takes no new work, its queued prefills come back
// to be re-run elsewhere (FailureKind::kLeaving), the rest finishes; on
// Drained the others get PeerLeft and the rank gets Shutdown.
//
// Membership (WorkerTable): every message from a worker is its heartbeat; one
// silent for timeouts.heartbeat_ms is declared down — its requests re-run or
// fail, the other workers are told (PeerDown) — and re-admitted under a new
// epoch once it reports again after a Rejoin. Workers report what failed as a
// FailureKind; only the router turns a kind into an HTTP status.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "config/cluster_config.h"
#include "protocol/control_channel.h"
#include "protocol/role_table.h"
#include "router/dispatch.h"
#include "router/http_server.h"
#include "router/metrics.h"
#include "router/openai_api.h"
#include "router/text_stream.h"
#include "util/env.h"
#include "tokenizer/tokenizer.h"

namespace pd::router {

struct ModelInfo {
  std::unique_ptr<Tokenizer> tokenizer;
  ChatTemplate chat_template;
  int context = 0;
  std::string name;
  std::string kv_dtype = "f16";     // kv.dtype: the workers' KV cache elements
  int64_t kv_bytes_per_token = 0;   // of that cache (0: unknown, e.g. in tests)
};

class Router {
 public:
  // `channel` carries the control messages to and from the workers
  // (MpiControlChannel in the cluster); only the link thread uses it.
  Router(const ClusterConfig& cfg, const RoleTable& roles, ModelInfo model, std::unique_ptr<ControlChannel> channel);
  ~Router();
  // Serves until SIGTERM/SIGINT (or request_stop()), then drains: no new
  // requests, in-flight ones get timeouts.drain_ms to finish, workers are told
  // to shut down. Returns an error only if the HTTP server could not start.
  Status run();
  // Async-signal-safe: begins the drain.
  static void request_stop();

  // run() in steps, for tests (one thread calls all three): start() binds the
  // HTTP port; run_once() is one iteration of the link loop (never sleeps;
  // returns false once the drain is over); finish() fails what is left and
  // shuts the workers down.
  Status start();
  bool run_once();
  void finish();
  uint16_t port() const { return http_.port(); }
  // Where the router reads time (deadlines, heartbeats, latencies); default the
  // steady clock. Tests step a FakeEnv. Call before start(); `env` must outlive
  // the router.
  void set_env(const Env* env);

 private:
  using Clock = std::chrono::steady_clock;
  enum class RequestState { kQueued, kDispatched, kStreaming };
  friend const char* state_name(RequestState s);
  friend bool legal(RequestState from, RequestState to);
  // One HTTP answer: the choices of one API request (several prompts, n per
  // prompt), each generated as its own Request. Answered once every choice
  // finished; the first choice that fails answers it with the error and ends
  // the others (cancelled). Link thread only, once handed over.
  struct Response {
    std::shared_ptr<ResponseWriter> writer;
    Endpoint endpoint = Endpoint::kCompletions;
    bool stream = false, include_usage = false;
    std::string id;                 // "cmpl-..." / "chatcmpl-..."
    int64_t created = 0;
    std::vector<uint64_t> choices;  // first ids of its Requests
    size_t open = 0;                // choices not yet ended
    std::vector<ChoiceOut> done;    // non-streaming: the finished choices
    Usage usage;                    // summed over the finished choices
    bool ended = false;             // answered, failed, or the client left
  };
  struct PendingToken {  // a token that arrived before the ones preceding it
    TokenId token = 0;
    proto::Finish finish = proto::Finish::kNone;
    std::optional<LogprobEntry> logprob;
  };
  struct Request {  // one choice
    uint64_t id = 0;                // the current attempt's wire id
    uint64_t first_id = 0;          // the id the HTTP side knows (disconnects)
    RequestState state = RequestState::kQueued;
    int attempts = 0;
    ApiRequest api;                 // this choice's (its own seed and max_tokens; no prompts or messages)
    std::shared_ptr<Response> response;
    int32_t index = 0;              // the choice's index in the answer
    bool counts_prompt = true;      // usage: the first choice of each prompt counts its tokens
    std::vector<TokenId> prompt;
    std::string echo_text;          // completions echo: the prompt's text, leading the choice's
    std::unique_ptr<TextStream> text;
    std::string text_out;           // non-streaming: the whole answer
    std::vector<ShownToken> shown;  // logprobs of tokens not yet sent (streaming) or of all (not streaming)
    int64_t chars_shown = 0;        // characters of the logprob tokens already sent (text_offset)
    std::vector<LogprobEntry> prompt_logprobs;  // echo with logprobs, from token 0's event
    bool dispatched = false, prefill_done = false, first_chunk_sent = false;
    DispatchChoice where;
    int32_t next_index = 0;
    std::map<int32_t, PendingToken> pending;  // out-of-order tokens
    int64_t n_generated = 0;
    Clock::time_point arrived, dispatched_at, last_token_at;
  };
  struct NewRequest { std::unique_ptr<Request> req; };
  struct ClientGone { std::vector<uint64_t> ids; };  // first ids of the choices of the answer it was waiting for
  struct DrainRank {  // POST /admin/drain, answered by the link thread
    int rank;
    std::shared_ptr<ResponseWriter> writer;
  };

  // io threads
  void handle_http(HttpRequest http, std::shared_ptr<ResponseWriter> w);
  void handle_completion(Endpoint ep, const HttpRequest& http, std::shared_ptr<ResponseWriter> w);
  void handle_drain(const HttpRequest& http, std::shared_ptr<ResponseWriter> w);
  void handle_tokenize(const HttpRequest& http, ResponseWriter& w);
  void handle_detokenize(const HttpRequest& http, ResponseWriter& w);
  // 404 model_not_found unless `model` is empty or the served one.
  std::optional<ApiError> check_model(const std::string& model) const;
  Result<std::vector<TokenId>> encode_chat(const std::vector<ChatMessage>& messages,
                                           bool add_generation_prompt = true) const;

  // link thread
  void drain_inbox();
  void dispatch_queued();
  void handle_messages();
  void on_tokens(int source, const proto::TokenEvents& m);
  void on_failed(int source, const proto::RequestFailed& m);
  void check_deadlines();
  void check_liveness();
  // `rank` was declared down: its requests re-run or fail; the others are told.
  void on_rank_down(int rank, const std::string& why);
  void on_report(int source, const proto::LoadReport& m);
  // Elastic pools.
  void on_join(int source, const proto::Join& m);
  // Starts draining `rank` out of the cluster; the reason is empty when it can be.
  std::string begin_drain(int rank, const std::string& why);
  void on_drained(int rank);
  void check_drains();
  // Every worker in the table except `except` (broadcasts).
  std::vector<int> worker_ranks(int except = -1) const;
  // A request whose attempt failed before any token reached the client goes
  // back to the front of the queue under a new wire id. False when it has
  // used its attempts (the caller then fails it).
  bool retry(uint64_t id, const std::string& why);
  void set_state(Request& r, RequestState to);
  // Tells `rank` to drop wire id `id` (unless it is down: it dropped everything).
  void cancel_on(int rank, uint64_t id);
  // Sends (streaming) or keeps (not) `text` with the logprobs in r.shown.
  void deliver(Request& r, const std::string& text);
  // Echo: the prompt's text, and its tokens' logprobs when asked, lead the choice.
  void deliver_echo(Request& r);
  ShownToken shown_token(TokenId id, const LogprobEntry* logprob) const;
  // The choice as it ends (its text and logprobs not yet sent, when streaming).
  ChoiceOut choice_out(Request& r, const std::string& finish_reason);
  enum class End { kFinished, kCancelled, kFailed };
  void finalize(uint64_t id, End how, const std::string& finish_reason, const ApiError& error = {},
                bool tell_workers = true);
  void update_gauges();

  const ClusterConfig cfg_;
  RequestDefaults sampling_defaults_;  // cfg_.sampling, for fields a request omits
  const RoleTable roles_;
  ModelInfo model_;
  std::vector<TokenId> hidden_ids_;   // EOS (+ <|im_end|>): end generation, print nothing
  TokenId im_end_ = -1;
  HttpServer http_;
  Registry metrics_;

  // Shared between io threads and the link.
  std::recursive_mutex inbox_mu_;  // recursive: a disconnect callback may run inline while it is held
  std::deque<std::variant<NewRequest, ClientGone, DrainRank>> inbox_;  // guarded by inbox_mu_
  std::atomic<int> queued_{0};          // requests accepted, not yet dispatched
  std::atomic<bool> draining_{false};
  std::atomic<bool> ready_{false};
  std::mutex ready_mu_;
  std::string not_ready_reason_;        // guarded by ready_mu_
  std::string ranks_json_ = "[]";       // guarded by ready_mu_: /health's per-rank list
  std::atomic<bool> degraded_{false};
  std::atomic<uint64_t> next_id_{1};

  // Link thread only.
  std::unique_ptr<ControlChannel> channel_;
  const Env* env_ = &system_env();  // set_env()
  WorkerTable workers_;
  std::unordered_map<uint64_t, std::unique_ptr<Request>> requests_;
  std::deque<uint64_t> queue_;          // accepted, waiting for a worker
  std::unordered_map<uint64_t, uint64_t> renamed_;  // first id -> current wire id (re-run requests)
  std::optional<Clock::time_point> drain_deadline_;
  Clock::time_point started_{}, last_housekeeping_{};
  bool startup_warned_ = false;

  // Metrics (owned by metrics_).
  Counter& requests_total_;
  Histogram& ttft_;
  Histogram& itl_;
  Histogram& e2e_;
  Histogram& stage_;
  Histogram& transfer_seconds_;
  Histogram& transfer_gbps_;
  Counter& transfer_bytes_;
  Histogram& transfer_hidden_;
  Counter& prompt_tokens_total_;
  Counter& generation_tokens_total_;
  Gauge& running_;
  Gauge& waiting_;
  Gauge& free_blocks_;
  Gauge& total_blocks_;
  Gauge& kv_pool_bytes_;
  Gauge& preemptions_;
  Gauge& router_queue_;
  Gauge& in_flight_;
  Gauge& rank_up_;
  Counter& rank_down_total_;
  Counter& retried_total_;
  Gauge& quarantined_blocks_;
  Counter& rank_requests_total_;
  Counter& joined_total_;
  Counter& left_total_;
};

}  // namespace pd::router
