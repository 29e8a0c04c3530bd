#include "router/router.h"

#include "router/auth.h"

#include <spdlog/spdlog.h>

#include <csignal>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

namespace pd::router {
namespace {

std::atomic<bool> g_stop{false};

double seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }
int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}
ApiError api_error(int status, std::string message, std::string param = "", std::string type = "") {
  ApiError e;
  e.status = status;
  e.message = std::move(message);
  e.param = std::move(param);
  if (!type.empty()) e.type = std::move(type);
  else if (status >= 500) e.type = status == 503 ? "service_unavailable" : "server_error";
  return e;
}
void respond_error(ResponseWriter& w, const ApiError& e,
                   std::vector<std::pair<std::string, std::string>> headers = {}) {
  w.respond(e.status, "application/json", error_body(e), std::move(headers));
}
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
      prompt_tokens_total_(metrics_.counter("pd_prompt_tokens_total", "Prompt tokens of dispatched requests")),
      generation_tokens_total_(metrics_.counter("pd_generation_tokens_total", "Tokens generated")),
      running_(metrics_.gauge("pd_running_sequences", "Sequences in a worker's batch (last report)", {"role", "rank"})),
      waiting_(metrics_.gauge("pd_waiting_requests", "Requests queued on a worker (last report)", {"role", "rank"})),
      free_blocks_(metrics_.gauge("pd_free_kv_blocks", "Free KV blocks of a worker (last report)", {"role", "rank"})),
      total_blocks_(metrics_.gauge("pd_kv_blocks", "KV blocks of a worker's pool", {"role", "rank"})),
      preemptions_(metrics_.gauge("pd_preemptions", "Preemptions on a decode rank since start", {"rank"})),
      router_queue_(metrics_.gauge("pd_router_queue_length", "Requests waiting in the router for a worker")),
      in_flight_(metrics_.gauge("pd_requests_in_flight", "Requests accepted and not yet finished")) {
  const Tokenizer& tok = *model_.tokenizer;
  if (tok.eos_id() >= 0) hidden_ids_.push_back(tok.eos_id());
  im_end_ = tok.find_token("<|im_end|>");
  if (im_end_ >= 0 && im_end_ != tok.eos_id()) hidden_ids_.push_back(im_end_);
}

Router::~Router() { http_.stop(); }

// ---------------------------------------------------------------- io threads

void Router::handle_http(HttpRequest http, std::shared_ptr<ResponseWriter> w) {
  const std::string& path = http.target;
  auto method_not_allowed = [&](const char* allow) {
    respond_error(*w, api_error(405, "method " + shown_text(http.method) + " is not allowed on " + shown_text(path) + " (use " + allow + ")"),
                  {{"Allow", allow}});
  };
  if (path == "/health") {
    if (http.method != "GET") return method_not_allowed("GET");
    if (ready_.load() && !draining_.load()) {
      w->respond(200, "application/json", R"({"status":"ok"})");
    } else {
      std::string why;
      {
        std::lock_guard lock(ready_mu_);
        why = draining_.load() ? "shutting down" : not_ready_reason_;
      }
      w->respond(503, "application/json", nlohmann::json{{"status", "unavailable"}, {"reason", why}}.dump());
    }
    return;
  }
  const bool v1 = path.rfind("/v1/", 0) == 0;
  const bool needs_key = v1 || (path == "/metrics" && cfg_.http.metrics_require_key);
  if (needs_key && !authorized(http.authorization, cfg_.http.api_key)) {
    ApiError e = api_error(401, "missing or incorrect API key (send 'Authorization: Bearer <key>')", "", "invalid_request_error");
    e.code = "invalid_api_key";
    return respond_error(*w, e, {{"WWW-Authenticate", "Bearer"}});
  }
  if (path == "/metrics") {
    if (http.method != "GET") return method_not_allowed("GET");
    w->respond(200, "text/plain; version=0.0.4; charset=utf-8", metrics_.render());
    return;
  }
  if (path == "/v1/models") {
    if (http.method != "GET") return method_not_allowed("GET");
    w->respond(200, "application/json", models_body(model_.name, unix_now()));
    return;
  }
  if (path == "/v1/completions" || path == "/v1/chat/completions") {
    if (http.method != "POST") return method_not_allowed("POST");
    handle_completion(path == "/v1/completions" ? Endpoint::kCompletions : Endpoint::kChatCompletions, http,
                      std::move(w));
    return;
  }
  ApiError e = api_error(404, "no route for " + shown_text(http.method) + " " + shown_text(path), "", "invalid_request_error");
  e.code = "not_found";
  respond_error(*w, e);
}

Result<std::vector<TokenId>> Router::encode_chat(const std::vector<ChatMessage>& messages) const {
  // Render the template with a marker in place of each message's content, then
  // encode template text with special tokens and the contents without, so a
  // user cannot inject control tokens by writing "<|im_end|>".
  auto marker = [](size_t i) {
    std::string m(1, '\x1e');
    m += std::to_string(i);
    m += '\x1f';
    return m;
  };
  std::vector<ChatMessage> marked = messages;
  for (size_t i = 0; i < marked.size(); ++i) marked[i].content = marker(i);
  PD_ASSIGN_OR_RETURN(std::string rendered, model_.chat_template.apply(marked, true));
  const Tokenizer& tok = *model_.tokenizer;
  std::vector<TokenId> ids;
  auto add = [&](const std::vector<TokenId>& v) { ids.insert(ids.end(), v.begin(), v.end()); };
  size_t pos = 0;
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string m = marker(i);
    const size_t at = rendered.find(m, pos);
    if (at == std::string::npos) return Status::internal("chat template dropped message " + std::to_string(i));
    add(tok.encode(std::string_view(rendered).substr(pos, at - pos), true));
    add(tok.encode(messages[i].content, false));
    pos = at + m.size();
  }
  add(tok.encode(std::string_view(rendered).substr(pos), true));
  return ids;
}

void Router::handle_completion(Endpoint ep, const HttpRequest& http, std::shared_ptr<ResponseWriter> w) {
  auto reject = [&](const ApiError& e, std::vector<std::pair<std::string, std::string>> headers = {}) {
    requests_total_.inc({"rejected"});
    respond_error(*w, e, std::move(headers));
  };
  ApiResult<ApiRequest> parsed = parse_request(ep, http.body);
  if (!parsed.is_ok()) return reject(parsed.error());
  ApiRequest api = std::move(parsed).value();
  if (!api.model.empty() && api.model != model_.name) {
    ApiError e = api_error(404, "the model '" + shown_text(api.model) + "' does not exist (this server serves '" + model_.name + "')",
                           "model", "invalid_request_error");
    e.code = "model_not_found";
    return reject(e);
  }
  const Tokenizer& tok = *model_.tokenizer;
  std::vector<TokenId> prompt;
  const char* prompt_field = ep == Endpoint::kCompletions ? "prompt" : "messages";
  if (ep == Endpoint::kCompletions) {
    prompt = tok.encode(api.prompt, false);
  } else {
    auto ids = encode_chat(api.messages);
    if (!ids.is_ok()) return reject(api_error(400, "messages: " + ids.status().message(), "messages"));
    prompt = std::move(ids).value();
  }
  if (tok.add_bos() && tok.bos_id() >= 0) prompt.insert(prompt.begin(), tok.bos_id());
  if (prompt.empty()) return reject(api_error(400, std::string(prompt_field) + " is empty", prompt_field));
  const int64_t n = static_cast<int64_t>(prompt.size());
  if (n >= model_.context)
    return reject(api_error(400, std::string(prompt_field) + " has " + std::to_string(n) +
                                     " tokens; the model's context is " + std::to_string(model_.context),
                            prompt_field));
  if (api.max_tokens_given) {
    if (n + api.sampling.max_tokens > model_.context)
      return reject(api_error(400, "max_tokens " + std::to_string(api.sampling.max_tokens) + " + " +
                                       std::to_string(n) + " prompt tokens exceeds the model's context of " +
                                       std::to_string(model_.context) + " tokens",
                              "max_tokens"));
  } else {
    // OpenAI's defaults: 16 for completions; chat runs to the end of the context.
    const int64_t left = model_.context - n;
    api.sampling.max_tokens = static_cast<int32_t>(ep == Endpoint::kCompletions ? std::min<int64_t>(16, left) : left);
  }
  if (ep == Endpoint::kChatCompletions && im_end_ >= 0 && im_end_ != tok.eos_id())
    api.sampling.stop_token_ids.push_back(im_end_);
  if (draining_.load())
    return reject(api_error(503, "the server is shutting down"), {{"Retry-After", std::to_string(cfg_.router.retry_after_s)}});
  if (queued_.load() >= cfg_.router.max_queued)
    return reject(api_error(503, "the router's queue is full (" + std::to_string(cfg_.router.max_queued) +
                                     " requests waiting); retry later"),
                  {{"Retry-After", std::to_string(cfg_.router.retry_after_s)}});

  auto req = std::make_unique<Request>();
  req->id = next_id_.fetch_add(1);
  req->response_id = make_response_id(ep, req->id);
  req->created = unix_now();
  req->arrived = Clock::now();
  req->prompt = std::move(prompt);
  req->text = std::make_unique<TextStream>(tok, api.stop, hidden_ids_);
  req->api = std::move(api);
  req->writer = w;
  const uint64_t id = req->id;
  // SSE headers go out before the link can send a chunk. The disconnect
  // callback is registered under the inbox lock, so its ClientGone (posted to
  // an io thread, never run inline) always lands after the NewRequest.
  if (req->api.stream) w->start_sse();
  ++queued_;
  std::lock_guard lock(inbox_mu_);
  w->on_disconnect([this, id] {
    std::lock_guard lock(inbox_mu_);
    inbox_.push_back(ClientGone{id});
  });
  inbox_.push_back(NewRequest{std::move(req)});
}

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

  PD_RETURN_IF_ERROR(http_.start([this](HttpRequest h, std::shared_ptr<ResponseWriter> w) {
    handle_http(std::move(h), std::move(w));
  }));
  if (!cfg_.http.port_file.empty()) PD_RETURN_IF_ERROR(write_port_file(cfg_.http.port_file, http_.port()));
  spdlog::info("router listening on http://{}:{} (model '{}', {} prefill + {} decode ranks{})", cfg_.http.host,
               http_.port(), model_.name, roles_.prefill.size(), roles_.decode.size(),
               workers_.colocated() ? ", colocated" : "");
  std::optional<Clock::time_point> drain_deadline;
  const auto started = Clock::now();
  bool startup_warned = false;
  auto last_housekeeping = Clock::now() - std::chrono::seconds(1);
  while (true) {
    drain_inbox();
    handle_messages();
    dispatch_queued();
    channel_->progress();
    // Deadlines and gauges are O(requests + ranks): every 10 ms is plenty.
    if (Clock::now() - last_housekeeping >= std::chrono::milliseconds(10)) {
      check_deadlines();
      update_gauges();
      last_housekeeping = Clock::now();
    }
    if (g_stop.load() && !drain_deadline) {
      spdlog::info("router: draining {} in-flight requests (up to {} ms)", requests_.size(), cfg_.timeouts.drain_ms);
      draining_.store(true);
      http_.stop_accepting();
      drain_deadline = Clock::now() + std::chrono::milliseconds(cfg_.timeouts.drain_ms);
    }
    if (drain_deadline && (requests_.empty() || Clock::now() > *drain_deadline)) break;
    if (!ready_.load() && !startup_warned && Clock::now() - started > std::chrono::milliseconds(cfg_.timeouts.startup_ms)) {
      std::lock_guard lock(ready_mu_);
      spdlog::error("router: workers not ready after {} ms: {}", cfg_.timeouts.startup_ms, not_ready_reason_);
      startup_warned = true;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(250));
  }
  // Whatever is left failed the drain deadline.
  std::vector<uint64_t> left;
  for (auto& [id, r] : requests_) left.push_back(id);
  for (uint64_t id : left)
    finalize(id, End::kFailed, "", api_error(503, "the server shut down before the request finished"));
  for (int r = 0; r < static_cast<int>(roles_.roles.size()); ++r)
    if (r != roles_.self) channel_->send(r, proto::Shutdown{});
  channel_->flush(std::chrono::milliseconds(5000));
  http_.stop();
  spdlog::info("router: shut down");
  return Status::ok();
}

void Router::drain_inbox() {
  std::deque<std::variant<NewRequest, ClientGone>> items;
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
    } else {
      const uint64_t id = std::get<ClientGone>(item).id;
      if (requests_.count(id)) finalize(id, End::kCancelled, "");
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
    r.where = *choice;
    r.dispatched = true;
    r.dispatched_at = Clock::now();
    workers_.on_dispatch(*choice, n, r.api.sampling.max_tokens);
    stage_.observe({"router_queue"}, seconds(r.dispatched_at - r.arrived));
    prompt_tokens_total_.inc(static_cast<double>(n));
    proto::PrefillRequest m{r.id, r.prompt, r.api.sampling, choice->decode_rank};
    channel_->send(workers_.colocated() ? choice->decode_rank : choice->prefill_rank, m);
  }
}

void Router::handle_messages() {
  channel_->drain(
      [&](int source, proto::Message& msg) {
        std::visit(
            [&](auto&& m) {
              using T = std::decay_t<decltype(m)>;
              if constexpr (std::is_same_v<T, proto::TokenEvents>) on_tokens(source, m);
              else if constexpr (std::is_same_v<T, proto::RequestFailed>) on_failed(source, m);
              else if constexpr (std::is_same_v<T, proto::LoadReport>) workers_.on_report(source, m);
              else if constexpr (std::is_same_v<T, proto::TransferStats>) {
                transfer_bytes_.inc(static_cast<double>(m.bytes));
                transfer_seconds_.observe(m.exposed_s);
                stage_.observe({"transfer"}, m.exposed_s);
                if (m.wire_s > 0) transfer_gbps_.observe(static_cast<double>(m.bytes) / m.wire_s / 1e9);
              } else spdlog::warn("router: unexpected {} from rank {}", proto::message_name(m), source);
            },
            msg);
      },
      256);
}

void Router::on_tokens(int source, const proto::TokenEvents& m) {
  for (const proto::TokenEvent& ev : m.events) {
    auto it = requests_.find(ev.id);
    if (it == requests_.end()) continue;  // already ended here (cancel, stop string, timeout)
    Request& r = *it->second;
    if (ev.first_index == 0 && !r.prefill_done) {
      r.prefill_done = true;
      if (!workers_.colocated()) workers_.on_prefill_done(source, static_cast<int64_t>(r.prompt.size()));
      stage_.observe({"prefill_queue"}, ev.queue_s);
      stage_.observe({"prefill"}, ev.prefill_s);
    }
    if (ev.first_index == 1 && !workers_.colocated()) stage_.observe({"decode_queue"}, ev.queue_s);
    for (size_t i = 0; i < ev.tokens.size(); ++i) {
      const bool last = i + 1 == ev.tokens.size();
      r.pending[ev.first_index + static_cast<int32_t>(i)] = {ev.tokens[i], last ? ev.finish : proto::Finish::kNone};
    }
    // Deliver in order; the prefill rank's token 1 and the decode rank's
    // later tokens come from different ranks and may arrive in either order.
    while (!r.pending.empty() && r.pending.begin()->first == r.next_index) {
      auto [token, finish] = r.pending.begin()->second;
      r.pending.erase(r.pending.begin());
      const auto now = Clock::now();
      if (r.next_index == 0) ttft_.observe(seconds(now - r.arrived));
      else itl_.observe(seconds(now - r.last_token_at));
      r.last_token_at = now;
      ++r.next_index;
      ++r.n_generated;
      generation_tokens_total_.inc();
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
  r.writer->send_event(stream_chunk(r.api.endpoint, r.response_id, model_.name, r.created, text, nullptr, first));
  r.first_chunk_sent = true;
}

void Router::on_failed(int source, const proto::RequestFailed& m) {
  if (!requests_.count(m.id)) return;
  spdlog::warn("router: request {} failed on rank {}: {}", m.id, source, m.reason);
  const int status = m.http_status >= 400 && m.http_status < 600 ? m.http_status : 500;
  finalize(m.id, End::kFailed, "", api_error(status, m.reason));
}

void Router::check_deadlines() {
  const auto now = Clock::now();
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
  in_flight_.add(-1);
  if (!r.dispatched) {
    --queued_;
  } else {
    // Tell both legs; a worker that already finished ignores an unknown id.
    if (tell_workers || how != End::kFinished) {
      if (r.where.prefill_rank >= 0 && !r.prefill_done) channel_->send(r.where.prefill_rank, proto::Cancel{id});
      channel_->send(r.where.decode_rank, proto::Cancel{id});
    }
    if (!r.prefill_done && r.where.prefill_rank >= 0)
      workers_.on_prefill_done(r.where.prefill_rank, static_cast<int64_t>(r.prompt.size()));
    workers_.on_request_done(r.where.decode_rank, static_cast<int64_t>(r.prompt.size()), r.api.sampling.max_tokens);
  }
  e2e_.observe(seconds(Clock::now() - r.arrived));
  const Usage usage{static_cast<int64_t>(r.prompt.size()), r.n_generated};
  ResponseWriter& w = *r.writer;
  switch (how) {
    case End::kFinished:
      requests_total_.inc({"finished"});
      if (!r.api.stream) {
        w.respond(200, "application/json",
                  completion_body(r.api.endpoint, r.response_id, model_.name, r.created, r.text_out, finish_reason,
                                  usage));
      } else {
        w.send_event(stream_chunk(r.api.endpoint, r.response_id, model_.name, r.created, "", &finish_reason,
                                  !r.first_chunk_sent));
        if (r.api.include_usage) w.send_event(usage_chunk(r.api.endpoint, r.response_id, model_.name, r.created, usage));
        w.send_event("[DONE]");
        w.finish();
      }
      break;
    case End::kCancelled:
      requests_total_.inc({"cancelled"});
      break;  // the client is gone
    case End::kFailed:
      requests_total_.inc({error.status == 504 ? "timeout" : "failed"});
      if (!r.api.stream) {
        respond_error(w, error);
      } else {
        w.send_event(error_body(error));
        w.send_event("[DONE]");
        w.finish();
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
      if (!wv.is_prefill) preemptions_.set({std::to_string(wv.rank)}, static_cast<double>(wv.load.preemptions));
    }
  }
  std::string why;
  const bool ok = workers_.ready(std::chrono::milliseconds(10000), &why);
  if (!ok) {
    std::lock_guard lock(ready_mu_);
    not_ready_reason_ = why;
  }
  ready_.store(ok);
}

}  // namespace pd::router
