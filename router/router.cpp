// The router as the owner of its parts, and the link loop: one iteration takes
// the inbox, the workers' messages, dispatches, and (every 10 ms) checks
// liveness, deadlines and the health it reports.
#include "router/router.h"

#include <spdlog/spdlog.h>

#include <csignal>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <thread>

#include "util/files.h"

namespace pd::router {
namespace {

std::atomic<bool> g_stop{false};

HttpServerConfig http_server_config(const ClusterConfig::Http& h) {
  HttpServerConfig c;
  c.host = h.host;
  c.port = static_cast<uint16_t>(h.port);
  c.threads = h.threads;
  c.max_body_bytes = static_cast<size_t>(h.max_body_bytes);
  c.read_timeout = c.write_timeout = std::chrono::milliseconds(h.read_timeout_ms);
  c.max_header_bytes = static_cast<size_t>(h.max_header_bytes);
  c.max_connections = static_cast<size_t>(h.max_connections);
  c.max_write_buffer_bytes = static_cast<size_t>(h.max_write_buffer_bytes);
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
      metrics_(registry_, model_.kv_dtype, model_.kv_bytes_per_token),
      channel_(std::move(channel)),
      workers_(roles.prefill, roles.decode, cfg.kv.block_size),
      membership_(cfg_, model_.kv_dtype, workers_, *channel_, metrics_, stopping_,
                  [this](int rank, const std::string& name, const std::string& why) { on_rank_down(rank, name, why); }) {
  workers_.set_policy(RoutingPolicy{cfg_.router.policy == "cache_aware", cfg_.router.queue_weight,
                                    cfg_.router.balance_ratio, cfg_.router.balance_tokens,
                                    cfg_.router.decode_reuse_tokens, cfg_.router.decode_reuse_weight,
                                    cfg_.router.min_cached_fraction});
  sampling_defaults_.temperature = static_cast<float>(cfg_.sampling.temperature);
  sampling_defaults_.top_p = static_cast<float>(cfg_.sampling.top_p);
  sampling_defaults_.top_k = cfg_.sampling.top_k;
  sampling_defaults_.min_p = static_cast<float>(cfg_.sampling.min_p);
  const Tokenizer& tok = *model_.tokenizer;
  if (tok.eos_id() >= 0) hidden_ids_.push_back(tok.eos_id());
  chat_stop_ids_ = chat_stop_ids(model_);
  hidden_ids_.insert(hidden_ids_.end(), chat_stop_ids_.begin(), chat_stop_ids_.end());
}

void Router::set_env(const Env* env) {
  env_ = env;
  workers_.set_env(env);
  membership_.set_env(env);
  started_ = env_->now();
}

Router::~Router() { http_.stop(); }

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

Status Router::start(bool serve_http) {
  if (serve_http) {
    PD_RETURN_IF_ERROR(http_.start([this](HttpRequest h, std::shared_ptr<ResponseWriter> w) {
      submit(std::move(h), std::move(w));
    }));
    if (!cfg_.http.port_file.empty()) PD_RETURN_IF_ERROR(
        write_file_atomically(cfg_.http.port_file, std::to_string(http_.port()) + "\n", "http.port_file", 0644));
    spdlog::info("router listening on http://{}:{} (model '{}', {} prefill + {} decode ranks{})", cfg_.http.host,
                 http_.port(), model_.name, roles_.prefill.size(), roles_.decode.size(),
                 workers_.colocated() ? ", colocated" : "");
  }
  started_ = env_->now();
  last_housekeeping_ = started_ - std::chrono::seconds(1);
  return Status::ok();
}

bool Router::run_once() {
  take_inbox();
  handle_messages();
  dispatch_queued();
  channel_->progress();
  // Deadlines and gauges are O(requests + ranks): every 10 ms is plenty.
  if (env_->now() - last_housekeeping_ >= std::chrono::milliseconds(10)) {
    membership_.check_liveness();
    check_deadlines();
    dispatch_queued();  // re-run requests go out at once
    update_health();
    last_housekeeping_ = env_->now();
  }
  if (g_stop.load() && !stop_deadline_) begin_stop();
  if (stop_deadline_ && (requests_.empty() || env_->now() > *stop_deadline_)) return false;
  if (!ready_.load() && !startup_warned_ &&
      env_->now() - started_ > std::chrono::milliseconds(cfg_.timeouts.startup_ms)) {
    std::lock_guard lock(ready_mu_);
    spdlog::error("router: workers not ready after {} ms: {}", cfg_.timeouts.startup_ms, not_ready_reason_);
    startup_warned_ = true;
  }
  return true;
}

void Router::begin_stop() {
  spdlog::info("router: stopping; {} in-flight requests get up to {} ms (timeouts.drain_ms)", requests_.size(),
               cfg_.timeouts.drain_ms);
  stopping_.store(true);
  http_.stop_accepting();
  stop_deadline_ = env_->now() + std::chrono::milliseconds(cfg_.timeouts.drain_ms);
}

void Router::finish() {
  // Whatever is left failed the stop deadline.
  for (uint64_t id : requests_.wire_ids())
    finalize(id, End::kFailed, "", api_error(503, "the server shut down before the request finished"));
  // Down ranks too: one that is only stopped must exit when it resumes, or the
  // job would never end (to a dead one the small message completes unseen).
  for (int r : membership_.worker_ranks()) channel_->send(r, proto::Shutdown{});
  channel_->flush(std::chrono::milliseconds(5000));
  http_.stop();
  spdlog::info("router: shut down");
}

void Router::take_inbox() {
  std::deque<InboxItem> items;
  {
    std::lock_guard lock(inbox_mu_);
    items.swap(inbox_);
  }
  for (auto& item : items) {
    if (auto* n = std::get_if<NewRequest>(&item)) {
      requests_.add(std::move(n->req));
      metrics_.in_flight.add(1);
    } else if (auto* d = std::get_if<DrainRank>(&item)) {
      const std::string refusal = membership_.begin_drain(d->rank, "POST /admin/drain");
      respond_drain(*d->writer, d->rank, refusal, workers_.find(d->rank) != nullptr);
    } else {
      for (uint64_t http_id : std::get<ClientGone>(item).http_ids)
        if (Request* r = requests_.find_by_http_id(http_id)) finalize(r->wire_id, End::kCancelled, "");
    }
  }
}

void Router::handle_messages() {
  channel_->receive(
      [&](int source, proto::Message& msg) {
        const WorkerView* w = workers_.find(source);
        if (auto* join = std::get_if<proto::Join>(&msg); join != nullptr && w == nullptr)
          return membership_.on_join(source, *join);
        if (w == nullptr) {
          // A rank that left, before its Shutdown: its last reports mean nothing now.
          if (std::holds_alternative<proto::LoadReport>(msg) || std::holds_alternative<proto::KvEvents>(msg)) return;
          spdlog::warn("router: {} from rank {}, which is not a worker", proto::message_name(msg), source);
          return;
        }
        if (auto* report = std::get_if<proto::LoadReport>(&msg)) return membership_.on_report(source, *report);
        // A rank declared down is fenced: until it rejoins, nothing it says counts.
        if (w->state == RankState::kDown) return;
        workers_.heard(source);
        std::visit(
            [&](auto&& m) {
              using T = std::decay_t<decltype(m)>;
              if constexpr (std::is_same_v<T, proto::TokenEvents>) on_tokens(source, m);
              else if constexpr (std::is_same_v<T, proto::RequestFailed>) on_failed(source, m);
              else if constexpr (std::is_same_v<T, proto::Listening>) workers_.find(source)->port = m.port;
              else if constexpr (std::is_same_v<T, proto::Leave>) membership_.begin_drain(source, "the rank asked to leave");
              else if constexpr (std::is_same_v<T, proto::Drained>) membership_.on_drained(source);
              else if constexpr (std::is_same_v<T, proto::TransferStats>) metrics_.observe_transfer(m);
              else if constexpr (std::is_same_v<T, proto::Warmed>) end_warm(m.id, "done");
              else if constexpr (std::is_same_v<T, proto::KvEvents>) workers_.on_kv_events(source, m);
              else spdlog::warn("router: unexpected {} from rank {}", proto::message_name(m), source);
            },
            msg);
      },
      256);
}

void Router::update_health() {
  metrics_.router_queue.set(static_cast<double>(requests_.queue_length()));
  metrics_.update_ranks(workers_, cfg_.kv.block_size);
  metrics_.refused_links.set(static_cast<double>(channel_->refused_links()));
  std::string why;
  const bool ok = workers_.ready(&why);
  nlohmann::json ranks = nlohmann::json::array();
  for (const auto* pool : {&workers_.prefill(), &workers_.decode()})
    for (const WorkerView& wv : *pool)
      ranks.push_back({{"rank", wv.rank}, {"role", role_label(wv)}, {"state", rank_state_name(wv.state)}});
  {
    std::lock_guard lock(ready_mu_);
    if (!ok) not_ready_reason_ = why;
    ranks_json_ = ranks.dump();
  }
  degraded_.store(workers_.degraded());
  ready_.store(ok);
}

}  // namespace pd::router
