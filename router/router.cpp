#include "router/router.h"

#include "router/router_errors.h"
#include "util/lifecycle.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

namespace pd::router {
namespace {

std::atomic<bool> g_stop{false};

double seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }
std::vector<double> gbps_buckets() { return {0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64}; }

HttpServerConfig http_server_config(const ClusterConfig::Http& h) {
  HttpServerConfig c;
  c.host = h.host;
  c.port = static_cast<uint16_t>(h.port);
  c.threads = h.threads;
  c.max_body_bytes = static_cast<size_t>(h.max_body_bytes);
  c.read_timeout = c.write_timeout = std::chrono::milliseconds(h.read_timeout_ms);
  c.max_header_bytes = static_cast<size_t>(h.max_header_bytes);
  c.max_connections = static_cast<size_t>(h.max_connections);
  return c;
}

}  // namespace

void Router::request_stop() { g_stop.store(true); }

Router::Router(const ClusterConfig& cfg, const RoleTable& roles, ModelInfo model,
               std::unique_ptr<ControlChannel> channel)
    : cfg_(cfg),
      roles_(roles),
      model_(std::move(model)),
      http_(http_server_config(cfg.http)),
      channel_(std::move(channel)),
      workers_(roles.prefill, roles.decode, cfg.kv.block_size),
      requests_total_(metrics_.counter("pd_requests_total", "Requests by final outcome", {"outcome"})),
      ttft_(metrics_.histogram("pd_time_to_first_token_seconds", "Arrival at the router to the first token")),
      itl_(metrics_.histogram("pd_inter_token_seconds", "Time between consecutive tokens of a request")),
      e2e_(metrics_.histogram("pd_e2e_request_seconds", "Arrival to the final answer")),
      stage_(metrics_.histogram("pd_stage_seconds",
                                "Time in each stage: router_queue, prefill_queue, prefill, transfer, decode_queue",
                                default_latency_buckets(), {"stage"})),
      transfer_seconds_(metrics_.histogram("pd_kv_transfer_seconds",
                                           "KV handoff latency not hidden by compute: prefill done to last byte sent")),
      transfer_gbps_(metrics_.histogram("pd_kv_transfer_gbps", "KV handoff throughput per request: bytes / (first layer posted to last byte sent), GB/s",
                                        gbps_buckets())),
      transfer_bytes_(metrics_.counter("pd_kv_transfer_bytes_total", "KV bytes moved from prefill to decode ranks")),
      transfer_hidden_(metrics_.histogram("pd_kv_transfer_hidden_ratio",
                                          "Per handoff: fraction of its KV bytes sent before the prompt's last layer "
                                          "was computed (moved behind compute)",
                                          {0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0})),
      prompt_tokens_total_(metrics_.counter("pd_prompt_tokens_total", "Prompt tokens of dispatched requests")),
      generation_tokens_total_(metrics_.counter("pd_generation_tokens_total", "Tokens generated")),
      running_(metrics_.gauge("pd_running_sequences", "Sequences in a worker's batch (last report)", {"role", "rank"})),
      waiting_(metrics_.gauge("pd_waiting_requests", "Requests queued on a worker (last report)", {"role", "rank"})),
      free_blocks_(metrics_.gauge("pd_free_kv_blocks", "Free KV blocks of a worker (last report)", {"role", "rank"})),
      total_blocks_(metrics_.gauge("pd_kv_blocks", "KV blocks of a worker's pool", {"role", "rank"})),
      kv_pool_bytes_(metrics_.gauge("pd_kv_pool_bytes", "Bytes of a worker's KV pool (blocks x block_size x pd_kv_bytes_per_token)",
                                    {"role", "rank"})),
      preemptions_(metrics_.gauge("pd_preemptions", "Preemptions on a decode rank since start", {"rank"})),
      router_queue_(metrics_.gauge("pd_router_queue_length", "Requests waiting in the router for a worker")),
      in_flight_(metrics_.gauge("pd_requests_in_flight", "Requests accepted and not yet finished")),
      rank_up_(metrics_.gauge("pd_rank_up", "1 while the rank is up, 0 while starting or declared down", {"role", "rank"})),
      rank_down_total_(metrics_.counter("pd_rank_down_total", "Times the rank was declared down (silent for timeouts.heartbeat_ms)",
                                        {"role", "rank"})),
      retried_total_(metrics_.counter("pd_requests_retried_total",
                                      "Requests re-run on other ranks after a rank failure, before any token reached the client")),
      quarantined_blocks_(metrics_.gauge("pd_kv_blocks_quarantined",
                                         "KV blocks held back until MPI can no longer write into them (a sender that went down mid-transfer)",
                                         {"role", "rank"})),
      rank_requests_total_(metrics_.counter("pd_rank_requests_total",
                                            "Requests dispatched to the rank (each attempt counts)", {"role", "rank"})),
      joined_total_(metrics_.counter("pd_ranks_joined_total", "Ranks that joined the running cluster (elastic pools)",
                                     {"role"})),
      left_total_(metrics_.counter("pd_ranks_left_total", "Ranks drained out of the cluster and removed", {"role"})) {
  metrics_.gauge("pd_kv_bytes_per_token", "KV cache bytes per token (K and V, all layers) in the workers' kv.dtype",
                 {"dtype"})
      .set({model_.kv_dtype}, static_cast<double>(model_.kv_bytes_per_token));
  sampling_defaults_.temperature = static_cast<float>(cfg_.sampling.temperature);
  sampling_defaults_.top_p = static_cast<float>(cfg_.sampling.top_p);
  sampling_defaults_.top_k = cfg_.sampling.top_k;
  sampling_defaults_.min_p = static_cast<float>(cfg_.sampling.min_p);
  const Tokenizer& tok = *model_.tokenizer;
  if (tok.eos_id() >= 0) hidden_ids_.push_back(tok.eos_id());
  im_end_ = tok.find_token("<|im_end|>");
  if (im_end_ >= 0 && im_end_ != tok.eos_id()) hidden_ids_.push_back(im_end_);
}

void Router::set_env(const Env* env) {
  env_ = env;
  workers_.set_env(env);
  started_ = env_->now();
}

Router::~Router() { http_.stop(); }

// ---------------------------------------------------------------- link thread

namespace {

// Writes "<port>\n" to `path` atomically (a temporary file renamed over it), so
// a reader polling for the file never sees it half written.
Status write_port_file(const std::string& path, uint16_t port) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << port << "\n";
    if (!out.flush()) return Status::io_error("cannot write http.port_file '" + tmp + "'");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    return Status::io_error("cannot rename '" + tmp + "' to http.port_file '" + path + "'");
  return Status::ok();
}

}  // namespace

Status Router::run() {
  struct sigaction sa {};
  sa.sa_handler = [](int) { Router::request_stop(); };
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  std::signal(SIGPIPE, SIG_IGN);
  PD_RETURN_IF_ERROR(start());
  while (run_once()) std::this_thread::sleep_for(std::chrono::microseconds(250));
  finish();
  return Status::ok();
}

Status Router::start() {
  PD_RETURN_IF_ERROR(http_.start([this](HttpRequest h, std::shared_ptr<ResponseWriter> w) {
    handle_http(std::move(h), std::move(w));
  }));
  if (!cfg_.http.port_file.empty()) PD_RETURN_IF_ERROR(write_port_file(cfg_.http.port_file, http_.port()));
  spdlog::info("router listening on http://{}:{} (model '{}', {} prefill + {} decode ranks{})", cfg_.http.host,
               http_.port(), model_.name, roles_.prefill.size(), roles_.decode.size(),
               workers_.colocated() ? ", colocated" : "");
  started_ = env_->now();
  last_housekeeping_ = started_ - std::chrono::seconds(1);
  return Status::ok();
}

bool Router::run_once() {
  drain_inbox();
  handle_messages();
  dispatch_queued();
  channel_->progress();
  // Deadlines and gauges are O(requests + ranks): every 10 ms is plenty.
  if (env_->now() - last_housekeeping_ >= std::chrono::milliseconds(10)) {
    check_liveness();
    check_deadlines();
    dispatch_queued();  // re-run requests go out at once
    update_gauges();
    last_housekeeping_ = env_->now();
  }
  if (g_stop.load() && !drain_deadline_) {
    spdlog::info("router: draining {} in-flight requests (up to {} ms)", requests_.size(), cfg_.timeouts.drain_ms);
    draining_.store(true);
    http_.stop_accepting();
    drain_deadline_ = env_->now() + std::chrono::milliseconds(cfg_.timeouts.drain_ms);
  }
  if (drain_deadline_ && (requests_.empty() || env_->now() > *drain_deadline_)) return false;
  if (!ready_.load() && !startup_warned_ &&
      env_->now() - started_ > std::chrono::milliseconds(cfg_.timeouts.startup_ms)) {
    std::lock_guard lock(ready_mu_);
    spdlog::error("router: workers not ready after {} ms: {}", cfg_.timeouts.startup_ms, not_ready_reason_);
    startup_warned_ = true;
  }
  return true;
}

void Router::finish() {
  // Whatever is left failed the drain deadline.
  std::vector<uint64_t> left;
  for (auto& [id, r] : requests_) left.push_back(id);
  for (uint64_t id : left)
    finalize(id, End::kFailed, "", api_error(503, "the server shut down before the request finished"));
  // Down ranks too: one that is only stopped must exit when it resumes, or the
  // job would never end (to a dead one the small message completes unseen).
  for (int r : worker_ranks()) channel_->send(r, proto::Shutdown{});
  channel_->flush(std::chrono::milliseconds(5000));
  http_.stop();
  spdlog::info("router: shut down");
}

void Router::drain_inbox() {
  std::deque<std::variant<NewRequest, ClientGone, DrainRank>> items;
  {
    std::lock_guard lock(inbox_mu_);
    items.swap(inbox_);
  }
  for (auto& item : items) {
    if (auto* n = std::get_if<NewRequest>(&item)) {
      const uint64_t id = n->req->id;
      queue_.push_back(id);
      requests_.emplace(id, std::move(n->req));
      in_flight_.add(1);
    } else if (auto* d = std::get_if<DrainRank>(&item)) {
      const std::string err = begin_drain(d->rank, "POST /admin/drain");
      if (!err.empty()) {
        const int status = workers_.find(d->rank) == nullptr ? 404 : 409;
        respond_error(*d->writer, api_error(status, err, "rank", "invalid_request_error"));
      } else {
        d->writer->respond(200, "application/json",
                           nlohmann::json{{"rank", d->rank}, {"state", "draining"}}.dump());
      }
    } else {
      for (uint64_t id : std::get<ClientGone>(item).ids) {
        if (auto re = renamed_.find(id); re != renamed_.end()) id = re->second;
        if (requests_.count(id)) finalize(id, End::kCancelled, "");
      }
    }
  }
}

void Router::dispatch_queued() {
  while (!queue_.empty()) {
    auto it = requests_.find(queue_.front());
    if (it == requests_.end()) {  // finalized while queued
      queue_.pop_front();
      continue;
    }
    Request& r = *it->second;
    const int64_t n = static_cast<int64_t>(r.prompt.size());
    auto choice = workers_.pick(n, r.api.sampling.max_tokens, cfg_.router.max_inflight_per_worker);
    if (!choice) break;
    queue_.pop_front();
    --queued_;
    set_state(r, RequestState::kDispatched);
    ++r.attempts;
    r.where = *choice;
    r.dispatched = true;
    r.dispatched_at = env_->now();
    workers_.on_dispatch(*choice, n, r.api.sampling.max_tokens);
    if (r.attempts == 1) {
      stage_.observe({"router_queue"}, seconds(r.dispatched_at - r.arrived));
      prompt_tokens_total_.inc(static_cast<double>(n));
    }
    if (choice->prefill_rank >= 0) rank_requests_total_.inc({"prefill", std::to_string(choice->prefill_rank)});
    rank_requests_total_.inc({"decode", std::to_string(choice->decode_rank)});
    proto::PrefillRequest m{r.id, r.prompt, r.api.sampling, choice->decode_rank};
    channel_->send(workers_.colocated() ? choice->decode_rank : choice->prefill_rank, m);
  }
}

void Router::handle_messages() {
  channel_->drain(
      [&](int source, proto::Message& msg) {
        const WorkerView* w = workers_.find(source);
        if (auto* join = std::get_if<proto::Join>(&msg); join != nullptr && w == nullptr) return on_join(source, *join);
        if (w == nullptr) {
          if (std::holds_alternative<proto::LoadReport>(msg)) return;  // a rank that left, before its Shutdown
          spdlog::warn("router: {} from rank {}, which is not a worker", proto::message_name(msg), source);
          return;
        }
        if (auto* report = std::get_if<proto::LoadReport>(&msg)) return on_report(source, *report);
        // A rank declared down is fenced: until it rejoins, nothing it says counts.
        if (w->state == RankState::kDown) return;
        workers_.heard(source);
        std::visit(
            [&](auto&& m) {
              using T = std::decay_t<decltype(m)>;
              if constexpr (std::is_same_v<T, proto::TokenEvents>) on_tokens(source, m);
              else if constexpr (std::is_same_v<T, proto::RequestFailed>) on_failed(source, m);
              else if constexpr (std::is_same_v<T, proto::Listening>) workers_.find(source)->port = m.port;
              else if constexpr (std::is_same_v<T, proto::Leave>) begin_drain(source, "the rank asked to leave");
              else if constexpr (std::is_same_v<T, proto::Drained>) on_drained(source);
              else if constexpr (std::is_same_v<T, proto::TransferStats>) {
                transfer_bytes_.inc(static_cast<double>(m.bytes));
                transfer_seconds_.observe(m.exposed_s);
                stage_.observe({"transfer"}, m.exposed_s);
                if (m.wire_s > 0) transfer_gbps_.observe(static_cast<double>(m.bytes) / m.wire_s / 1e9);
                if (m.bytes > 0)
                  transfer_hidden_.observe(std::clamp(static_cast<double>(m.hidden_bytes) / static_cast<double>(m.bytes), 0.0, 1.0));
              } else spdlog::warn("router: unexpected {} from rank {}", proto::message_name(m), source);
            },
            msg);
      },
      256);
}

void Router::on_tokens(int source, const proto::TokenEvents& m) {
  for (const proto::TokenEvent& ev : m.events) {
    auto it = requests_.find(ev.id);
    if (it == requests_.end()) continue;  // already ended here (cancel, stop string, timeout) or an earlier attempt
    Request& r = *it->second;
    if (!r.dispatched || (source != r.where.decode_rank && source != r.where.prefill_rank)) continue;
    if (ev.first_index == 0 && !r.prefill_done) {
      r.prefill_done = true;
      if (!workers_.colocated()) workers_.on_prefill_done(source, static_cast<int64_t>(r.prompt.size()));
      stage_.observe({"prefill_queue"}, ev.queue_s);
      stage_.observe({"prefill"}, ev.prefill_s);
    }
    if (ev.first_index == 1 && !workers_.colocated()) stage_.observe({"decode_queue"}, ev.queue_s);
    if (ev.first_index == 0 && !ev.prompt_logprobs.empty()) r.prompt_logprobs = ev.prompt_logprobs;
    const bool with_logprobs = r.api.sampling.logprobs >= 0 && ev.logprobs.size() == ev.tokens.size();
    for (size_t i = 0; i < ev.tokens.size(); ++i) {
      const bool last = i + 1 == ev.tokens.size();
      PendingToken p{ev.tokens[i], last ? ev.finish : proto::Finish::kNone, std::nullopt};
      if (with_logprobs) p.logprob = ev.logprobs[i];
      r.pending[ev.first_index + static_cast<int32_t>(i)] = std::move(p);
    }
    // Deliver in order; the prefill rank's token 1 and the decode rank's
    // later tokens come from different ranks and may arrive in either order.
    while (!r.pending.empty() && r.pending.begin()->first == r.next_index) {
      const PendingToken p = std::move(r.pending.begin()->second);
      const TokenId token = p.token;
      const proto::Finish finish = p.finish;
      r.pending.erase(r.pending.begin());
      const auto now = env_->now();
      if (r.next_index == 0) ttft_.observe(seconds(now - r.arrived));
      else itl_.observe(seconds(now - r.last_token_at));
      r.last_token_at = now;
      if (r.next_index == 0) {
        set_state(r, RequestState::kStreaming);
        if (r.api.echo) deliver_echo(r);
      }
      ++r.next_index;
      generation_tokens_total_.inc();
      if (r.api.prompt_only) {  // max_tokens 0: the token sampled anyway is not part of the answer
        const uint64_t id = r.id;
        finalize(id, End::kFinished, "length", {}, finish == proto::Finish::kNone);
        break;
      }
      ++r.n_generated;
      if (r.api.sampling.logprobs >= 0) r.shown.push_back(shown_token(token, p.logprob ? &*p.logprob : nullptr));
      deliver(r, r.text->push(token));
      if (r.text->stopped()) {  // a stop string matched: end it here, tell the workers
        finalize(r.id, End::kFinished, "stop");
        break;
      }
      if (finish != proto::Finish::kNone) {
        deliver(r, r.text->finish());
        const uint64_t id = r.id;
        finalize(id, End::kFinished, finish == proto::Finish::kLength ? "length" : "stop", {}, false);
        break;
      }
    }
  }
}

void Router::deliver(Request& r, const std::string& text) {
  if (!r.api.stream) {
    r.text_out += text;
    return;
  }
  const bool first = !r.first_chunk_sent;
  if (text.empty() && !(first && r.api.endpoint == Endpoint::kChatCompletions)) return;
  ChoiceOut c;
  c.index = r.index;
  c.text = text;
  c.with_logprobs = r.api.sampling.logprobs >= 0;
  if (!text.empty()) {  // logprobs go with text (a chat's empty role chunk carries none)
    c.text_offset = r.chars_shown;
    for (const ShownToken& t : r.shown) r.chars_shown += text_chars(t.text);
    c.logprobs = std::move(r.shown);
    r.shown.clear();
  }
  const Response& resp = *r.response;
  resp.writer->send_event(stream_chunk(resp.endpoint, resp.id, model_.name, resp.created, c, first));
  r.first_chunk_sent = true;
}

void Router::deliver_echo(Request& r) {
  if (r.api.sampling.prompt_logprobs) {
    for (size_t i = 0; i < r.prompt.size(); ++i) {
      const bool have = i > 0 && i - 1 < r.prompt_logprobs.size();
      r.shown.push_back(shown_token(r.prompt[i], have ? &r.prompt_logprobs[i - 1] : nullptr));
      if (i == 0) r.shown.back().logprob.reset();  // nothing precedes the first token
    }
  }
  deliver(r, r.echo_text);
}

ShownToken Router::shown_token(TokenId id, const LogprobEntry* logprob) const {
  const Tokenizer& tok = *model_.tokenizer;
  ShownToken t;
  t.text = tok.token_to_bytes(id);
  if (logprob == nullptr) return t;
  t.logprob = logprob->logprob;
  for (const TokenLogprob& alt : logprob->top) t.top.emplace_back(tok.token_to_bytes(alt.id), alt.logprob);
  return t;
}

ChoiceOut Router::choice_out(Request& r, const std::string& finish_reason) {
  ChoiceOut c;
  c.index = r.index;
  c.finish_reason = finish_reason;
  c.with_logprobs = r.api.sampling.logprobs >= 0;
  c.text_offset = r.chars_shown;
  c.logprobs = std::move(r.shown);
  r.shown.clear();
  if (!r.api.stream) c.text = std::move(r.text_out);
  return c;
}

namespace {

// The HTTP status a worker's failure kind means to the client.
int http_status_of(proto::FailureKind k) {
  switch (k) {
    case proto::FailureKind::kInvalid: return 400;
    case proto::FailureKind::kOverloaded: return 503;
    case proto::FailureKind::kTimeout: return 504;
    case proto::FailureKind::kPeerDown: return 503;
    case proto::FailureKind::kTransfer: return 500;
    case proto::FailureKind::kInternal: return 500;
    case proto::FailureKind::kLeaving: return 503;
  }
  return 500;
}
// Kinds where another pair of ranks may well succeed.
bool retryable(proto::FailureKind k) {
  return k == proto::FailureKind::kPeerDown || k == proto::FailureKind::kTransfer ||
         k == proto::FailureKind::kLeaving;
}
constexpr int kMaxAttempts = 3;

}  // namespace

const char* state_name(Router::RequestState s) {
  switch (s) {
    case Router::RequestState::kQueued: return "queued";
    case Router::RequestState::kDispatched: return "dispatched";
    case Router::RequestState::kStreaming: return "streaming";
  }
  return "?";
}

bool legal(Router::RequestState from, Router::RequestState to) {
  using S = Router::RequestState;
  switch (from) {
    case S::kQueued: return to == S::kDispatched;
    case S::kDispatched: return to == S::kStreaming || to == S::kQueued;
    case S::kStreaming: return false;  // only ended from here
  }
  return false;
}

void Router::set_state(Request& r, RequestState to) { transition(r.state, to, r.first_id, "router"); }

void Router::on_failed(int source, const proto::RequestFailed& m) {
  auto it = requests_.find(m.id);
  if (it == requests_.end()) return;
  Request& r = *it->second;
  if (!r.dispatched || (source != r.where.decode_rank && source != r.where.prefill_rank)) return;
  spdlog::warn("router: request {} failed on rank {} ({}): {}", m.id, source, proto::failure_kind_name(m.kind),
               m.reason);
  if (retryable(m.kind) && r.state == RequestState::kDispatched && retry(m.id, m.reason)) return;
  finalize(m.id, End::kFailed, "", api_error(http_status_of(m.kind), m.reason));
}

void Router::on_report(int source, const proto::LoadReport& m) {
  WorkerView* w = workers_.find(source);
  if (w->state != RankState::kDown) {
    workers_.on_report(source, m);
    return;
  }
  const proto::Epoch next = w->epoch + 1;
  if (m.epoch == next) {
    // It dropped everything of its old incarnation (Rejoin): admit it again.
    workers_.mark_up(source, next);
    workers_.on_report(source, m);
    spdlog::info("router: {} rank {} is back (epoch {})", w->is_prefill ? "prefill" : "decode", source, next);
    for (int r : worker_ranks(source)) channel_->send(r, proto::PeerUp{source, next});
    return;
  }
  // A fenced rank that is running again and does not know it yet.
  const auto now = env_->now();
  if (now - w->last_rejoin_sent > std::chrono::milliseconds(500)) {
    w->last_rejoin_sent = now;
    channel_->send(source, proto::Rejoin{next});
  }
}

std::vector<int> Router::worker_ranks(int except) const {
  std::vector<int> out;
  for (const auto* pool : {&workers_.prefill(), &workers_.decode()})
    for (const WorkerView& w : *pool)
      if (w.rank != except) out.push_back(w.rank);
  return out;
}

void Router::on_join(int source, const proto::Join& m) {
  const bool prefill = m.role == static_cast<int32_t>(Role::kPrefill);
  std::string refused;
  if (m.role != static_cast<int32_t>(Role::kPrefill) && m.role != static_cast<int32_t>(Role::kDecode))
    refused = "role " + std::to_string(m.role) + " cannot join (only prefill and decode ranks)";
  else if (prefill && workers_.colocated())
    refused = "this cluster is colocated (no prefill pool): only decode ranks can join it";
  else if (m.block_size != cfg_.kv.block_size)
    refused = "kv.block_size " + std::to_string(m.block_size) + " differs from the cluster's " +
              std::to_string(cfg_.kv.block_size);
  else if (m.kv_dtype != model_.kv_dtype)
    refused = "kv.dtype " + m.kv_dtype + " differs from the cluster's " + model_.kv_dtype;
  else if (draining_.load())
    refused = "the cluster is shutting down";
  if (!refused.empty()) {
    spdlog::warn("router: refused a {} rank from {} (pid {}): {}", prefill ? "prefill" : "decode", m.host, m.pid,
                 refused);
    channel_->send(source, proto::JoinRefused{refused});
    channel_->forget(source);
    return;
  }
  proto::JoinAccepted a;
  a.rank = source;
  a.epoch = 0;
  a.colocated = workers_.colocated();
  std::vector<int> linked;
  for (const WorkerView& w : prefill ? workers_.decode() : workers_.prefill()) {
    if (w.state != RankState::kUp || w.port.empty()) continue;
    a.peers.push_back({w.rank, static_cast<int32_t>(w.is_prefill ? Role::kPrefill : Role::kDecode), w.port});
    linked.push_back(w.rank);
  }
  WorkerView& v = workers_.add(source, prefill, m.pool);
  v.port = m.port;
  v.last_heard = env_->now();
  for (int r : linked) workers_.link(source, r);
  joined_total_.inc({prefill ? "prefill" : "decode"});
  spdlog::info("router: {} rank {} joined from {} (pid {}, pool {}); linking it to {} ranks", prefill ? "prefill" : "decode",
               source, m.host, m.pid, m.pool, linked.size());
  channel_->send(source, a);
}

std::string Router::begin_drain(int rank, const std::string& why) {
  WorkerView* w = workers_.find(rank);
  if (w == nullptr) return "rank " + std::to_string(rank) + " is not a worker of this cluster (see /health)";
  if (w->state == RankState::kDraining) return "rank " + std::to_string(rank) + " is already draining";
  if (w->state == RankState::kDown) {
    // Down: the router already re-ran or failed what it had; removing it holds
    // nothing up (a pool that died is cleared from /health this way).
    spdlog::info("router: removing {} rank {}, which is down ({})", w->is_prefill ? "prefill" : "decode", rank, why);
    w->state = RankState::kDraining;
    on_drained(rank);
    return "";
  }
  if (!workers_.begin_drain(rank))
    return "rank " + std::to_string(rank) + " is " + rank_state_name(w->state) + "; only an up rank can be drained";
  spdlog::info("router: draining {} rank {} out of the cluster ({}; {} requests on it)",
               w->is_prefill ? "prefill" : "decode", rank, why, w->outstanding);
  channel_->send(rank, proto::Drain{});
  return "";
}

void Router::on_drained(int rank) {
  WorkerView* w = workers_.find(rank);
  if (w == nullptr || w->state != RankState::kDraining) return;
  const bool prefill = w->is_prefill;
  // It holds nothing; anything the router still counts on it (a request whose
  // last token is on its way from the other leg) is unaffected by its leaving.
  spdlog::info("router: {} rank {} drained; removing it", prefill ? "prefill" : "decode", rank);
  for (int r : worker_ranks(rank)) channel_->send(r, proto::PeerLeft{rank});
  channel_->send(rank, proto::Shutdown{});
  left_total_.inc({prefill ? "prefill" : "decode"});
  // Its series stay (a metric's children live as long as the registry): as it left, holding nothing.
  const std::vector<std::string> labels{prefill ? "prefill" : "decode", std::to_string(rank)};
  rank_up_.set(labels, 0);
  running_.set(labels, 0);
  waiting_.set(labels, 0);
  free_blocks_.set(labels, static_cast<double>(w->load.total_blocks));
  quarantined_blocks_.set(labels, 0);
  workers_.remove(rank);
  channel_->forget(rank);
}

void Router::check_drains() {
  const auto limit = std::chrono::milliseconds(cfg_.timeouts.drain_ms);
  std::vector<int> late;
  for (const auto* pool : {&workers_.prefill(), &workers_.decode()})
    for (const WorkerView& w : *pool)
      if (w.state == RankState::kDraining && env_->now() - w.drain_started > limit) late.push_back(w.rank);
  for (int rank : late) {
    // What it still holds ends as if it had gone down (re-run or failed); then it is removed.
    on_rank_down(rank, "did not finish draining within " + std::to_string(cfg_.timeouts.drain_ms) +
                           " ms (timeouts.drain_ms)");
    on_drained(rank);
  }
}

void Router::check_liveness() {
  check_drains();
  for (int rank : workers_.expire(std::chrono::milliseconds(cfg_.timeouts.heartbeat_ms),
                                  std::chrono::milliseconds(cfg_.timeouts.startup_ms)))
    on_rank_down(rank, "sent nothing for " + std::to_string(cfg_.timeouts.heartbeat_ms) + " ms (timeouts.heartbeat_ms)");
}

void Router::on_rank_down(int rank, const std::string& why) {
  const WorkerView* w = workers_.find(rank);
  const std::string name = std::string(w->is_prefill ? "prefill" : "decode") + " rank " + std::to_string(rank);
  spdlog::error("router: {} is down: {}", name, why);
  rank_down_total_.inc({w->is_prefill ? "prefill" : "decode", std::to_string(rank)});
  // Fence it: the other workers drop what they share with this incarnation.
  for (int r : worker_ranks(rank)) channel_->send(r, proto::PeerDown{rank, w->epoch});
  std::vector<uint64_t> hit;
  for (auto& [id, r] : requests_) {
    if (!r->dispatched) continue;
    if (r->where.decode_rank == rank || (r->where.prefill_rank == rank && !r->prefill_done)) hit.push_back(id);
  }
  for (uint64_t id : hit) {
    const Request& r = *requests_.at(id);
    if (r.state == RequestState::kDispatched && retry(id, name + " went down")) continue;
    finalize(id, End::kFailed, "", api_error(503, name + " went down while serving the request (" + why + ")"));
  }
  if (!hit.empty()) spdlog::warn("router: {} requests were on {}", hit.size(), name);
}

void Router::cancel_on(int rank, uint64_t id) {
  const WorkerView* w = workers_.find(rank);
  if (w != nullptr && w->state != RankState::kDown) channel_->send(rank, proto::Cancel{id});  // a down rank dropped it
}

bool Router::retry(uint64_t id, const std::string& why) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return false;
  Request& r = *it->second;
  if (r.attempts >= kMaxAttempts || draining_.load()) return false;
  // Release the old attempt: both legs drop it.
  if (r.where.prefill_rank >= 0 && !r.prefill_done) cancel_on(r.where.prefill_rank, id);
  cancel_on(r.where.decode_rank, id);
  if (!r.prefill_done && r.where.prefill_rank >= 0)
    workers_.on_prefill_done(r.where.prefill_rank, static_cast<int64_t>(r.prompt.size()));
  workers_.on_request_done(r.where.decode_rank, static_cast<int64_t>(r.prompt.size()), r.api.sampling.max_tokens);
  // The next attempt travels under a new wire id.
  std::unique_ptr<Request> owned = std::move(it->second);
  requests_.erase(it);
  owned->id = next_id_.fetch_add(1);
  owned->dispatched = owned->prefill_done = false;
  owned->where = {};
  owned->pending.clear();
  owned->prompt_logprobs.clear();
  set_state(*owned, RequestState::kQueued);
  renamed_[owned->first_id] = owned->id;
  spdlog::info("router: re-running request {} as {} (attempt {}): {}", id, owned->id, owned->attempts + 1, why);
  retried_total_.inc();
  queue_.push_front(owned->id);
  ++queued_;
  requests_.emplace(owned->id, std::move(owned));
  return true;
}

void Router::check_deadlines() {
  const auto now = env_->now();
  std::vector<std::pair<uint64_t, ApiError>> expired;
  for (auto& [id, r] : requests_) {
    if (!r->dispatched && now - r->arrived > std::chrono::milliseconds(cfg_.timeouts.queue_ms))
      expired.push_back({id, api_error(503, "no worker could take the request within " +
                                                std::to_string(cfg_.timeouts.queue_ms) + " ms")});
    else if (now - r->arrived > std::chrono::milliseconds(cfg_.timeouts.request_ms))
      expired.push_back({id, api_error(504, "the request did not finish within " +
                                                std::to_string(cfg_.timeouts.request_ms) + " ms")});
  }
  for (auto& [id, e] : expired) finalize(id, End::kFailed, "", e);
}

void Router::finalize(uint64_t id, End how, const std::string& finish_reason, const ApiError& error,
                      bool tell_workers) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  std::unique_ptr<Request> owned = std::move(it->second);
  requests_.erase(it);
  Request& r = *owned;
  if (r.first_id != r.id) renamed_.erase(r.first_id);
  in_flight_.add(-1);
  if (!r.dispatched) {
    --queued_;
  } else {
    // Tell both legs; a worker that already finished ignores an unknown id.
    if (tell_workers || how != End::kFinished) {
      if (r.where.prefill_rank >= 0 && !r.prefill_done) cancel_on(r.where.prefill_rank, id);
      cancel_on(r.where.decode_rank, id);
    }
    if (!r.prefill_done && r.where.prefill_rank >= 0)
      workers_.on_prefill_done(r.where.prefill_rank, static_cast<int64_t>(r.prompt.size()));
    workers_.on_request_done(r.where.decode_rank, static_cast<int64_t>(r.prompt.size()), r.api.sampling.max_tokens);
  }
  e2e_.observe(seconds(env_->now() - r.arrived));
  Response& resp = *r.response;
  --resp.open;
  ResponseWriter& w = *resp.writer;
  switch (how) {
    case End::kFinished: {
      requests_total_.inc({"finished"});
      if (resp.ended) break;
      if (r.counts_prompt) resp.usage.prompt_tokens += static_cast<int64_t>(r.prompt.size());
      resp.usage.completion_tokens += r.n_generated;
      ChoiceOut c = choice_out(r, finish_reason);
      if (!resp.stream) {
        resp.done.push_back(std::move(c));
      } else {
        w.send_event(stream_chunk(resp.endpoint, resp.id, model_.name, resp.created, c, !r.first_chunk_sent));
      }
      if (resp.open > 0) break;
      resp.ended = true;
      if (!resp.stream) {
        std::sort(resp.done.begin(), resp.done.end(),
                  [](const ChoiceOut& a, const ChoiceOut& b) { return a.index < b.index; });
        w.respond(200, "application/json",
                  completion_body(resp.endpoint, resp.id, model_.name, resp.created, resp.done, resp.usage));
      } else {
        if (resp.include_usage) w.send_event(usage_chunk(resp.endpoint, resp.id, model_.name, resp.created, resp.usage));
        w.send_event("[DONE]");
        w.finish();
      }
      break;
    }
    case End::kCancelled:
      requests_total_.inc({"cancelled"});
      resp.ended = true;  // the client is gone, or another choice failed and answered
      break;
    case End::kFailed:
      requests_total_.inc({error.status == 504 ? "timeout" : "failed"});
      if (resp.ended) break;
      resp.ended = true;
      if (!resp.stream) {
        respond_error(w, error);
      } else {
        w.send_event(error_body(error));
        w.send_event("[DONE]");
        w.finish();
      }
      // The answer is given: the other choices end here.
      for (uint64_t other : resp.choices) {
        if (auto re = renamed_.find(other); re != renamed_.end()) other = re->second;
        if (requests_.count(other)) finalize(other, End::kCancelled, "");
      }
      break;
  }
}

void Router::update_gauges() {
  router_queue_.set(static_cast<double>(queue_.size()));
  for (const auto* pool : {&workers_.prefill(), &workers_.decode()}) {
    for (const WorkerView& wv : *pool) {
      const std::vector<std::string> labels{wv.is_prefill ? "prefill" : "decode", std::to_string(wv.rank)};
      running_.set(labels, wv.load.running);
      waiting_.set(labels, wv.load.waiting);
      free_blocks_.set(labels, static_cast<double>(wv.load.free_blocks));
      total_blocks_.set(labels, static_cast<double>(wv.load.total_blocks));
      kv_pool_bytes_.set(labels, static_cast<double>(wv.load.total_blocks) * cfg_.kv.block_size *
                                     static_cast<double>(model_.kv_bytes_per_token));
      if (!wv.is_prefill) preemptions_.set({std::to_string(wv.rank)}, static_cast<double>(wv.load.preemptions));
      rank_up_.set(labels, wv.state == RankState::kUp ? 1 : 0);
      quarantined_blocks_.set(labels, static_cast<double>(wv.load.quarantined_blocks));
    }
  }
  std::string why;
  const bool ok = workers_.ready(&why);
  nlohmann::json ranks = nlohmann::json::array();
  for (const auto* pool : {&workers_.prefill(), &workers_.decode()})
    for (const WorkerView& wv : *pool)
      ranks.push_back({{"rank", wv.rank}, {"role", wv.is_prefill ? "prefill" : "decode"},
                       {"state", rank_state_name(wv.state)}});
  {
    std::lock_guard lock(ready_mu_);
    if (!ok) not_ready_reason_ = why;
    ranks_json_ = ranks.dump();
  }
  degraded_.store(workers_.degraded());
  ready_.store(ok);
}

}  // namespace pd::router
