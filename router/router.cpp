// The router as the owner of its parts: the HTTP server, the front its io
// threads run, the link loop, and the queues between them; run() and its
// steps (see router.h).
#include "router/router.h"

#include <spdlog/spdlog.h>

#include <atomic>
#include <csignal>
#include <cstdio>
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
  c.allowed_origins = h.allowed_origins;
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
      front_(FrontParts{cfg_, model_, registry_, metrics_, ids_, inbox_, status_}),
      link_(LinkParts{cfg_, roles_, model_, metrics_, ids_, inbox_, status_}, std::move(channel)) {}

void Router::set_env(const Env* env) {
  front_.set_env(env);
  link_.set_env(env);
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
    PD_RETURN_IF_ERROR(http_.start([&front = front_](HttpRequest h, std::shared_ptr<ResponseWriter> w) {
      front.submit(std::move(h), std::move(w));
    }));
    if (!cfg_.http.port_file.empty()) PD_RETURN_IF_ERROR(
        write_file_atomically(cfg_.http.port_file, std::to_string(http_.port()) + "\n", "http.port_file", 0644));
    spdlog::info("router listening on http://{}:{} (model '{}', {} prefill + {} decode ranks{})", cfg_.http.host,
                 http_.port(), model_.name, roles_.prefill.size(), roles_.decode.size(),
                 link_.colocated() ? ", colocated" : "");
  }
  link_.start();
  return Status::ok();
}

bool Router::run_once() {
  const RouterState before = link_.state();
  const bool more = link_.run_once(g_stop.load());
  // The stop began: the listening socket closes (connections open go on).
  if (before == RouterState::kServing && link_.state() != RouterState::kServing) http_.stop_accepting();
  return more;
}

void Router::finish() {
  link_.finish();
  http_.stop();
  spdlog::info("router: shut down");
}

}  // namespace pd::router
