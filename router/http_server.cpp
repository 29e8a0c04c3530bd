// The HTTP server: its life (start, stop), the accept loop and the admission
// of connections into slots (see http_server.h). A connection's own work is
// in http_connection.cpp, an exchange's in http_exchange.cpp.
#include "router/http_server.h"

#include <cstdio>
#include <exception>
#include <future>

#include "router/http_connection.h"
#include "router/http_server_core.h"
#include "util/lifecycle.h"

namespace pd::router {

namespace beast = boost::beast;
namespace net = boost::asio;
using tcp = net::ip::tcp;

const char* state_name(HttpServerState s) {
  switch (s) {
    case HttpServerState::kCreated: return "created";
    case HttpServerState::kServing: return "serving";
    case HttpServerState::kStopped: return "stopped";
  }
  return "?";
}

bool legal(HttpServerState from, HttpServerState to) {
  return (from == HttpServerState::kCreated && to == HttpServerState::kServing) ||
         (from == HttpServerState::kServing && to == HttpServerState::kStopped);
}

namespace detail {

void call_safely(const std::function<void()>& cb, const char* what) {
  try {
    cb();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pd::router::HttpServer: %s threw: %s\n", what, e.what());
  } catch (...) {
    std::fprintf(stderr, "pd::router::HttpServer: %s threw\n", what);
  }
}

void ServerCore::mark_stopped() {
  std::unique_lock lock(stop_mu);
  transition(state, HttpServerState::kStopped, 0, "http server core");
}

void ServerCore::list(uint64_t id, Listing how) {
  if (cfg.max_connections == 0) return;
  std::lock_guard lock(conns_mu);
  slots.list(id, how);
}

void ServerCore::forget(uint64_t id) {
  open_connections.fetch_sub(1);
  std::lock_guard lock(conns_mu);
  conns.erase(id);
  slots.remove(id);
}

// ---- Accepting.

void do_accept(ServerCore* core);

void on_accept(ServerCore* core, Strand strand, beast::error_code ec, tcp::socket socket) {
  if (!core->acceptor.is_open() || core->is_stopped()) return;  // stop_accepting() or stop()
  if (ec) {
    // Out of descriptors, say: wait a little instead of spinning.
    core->accept_retry.expires_after(std::chrono::milliseconds(50));
    core->accept_retry.async_wait([core](beast::error_code tec) {
      if (!tec) do_accept(core);
    });
    return;
  }
  // Admission (see HttpServerConfig::max_connections).
  std::shared_ptr<Connection> conn;
  std::weak_ptr<Connection> victim;
  bool victim_stalled = false;
  {
    std::lock_guard lock(core->conns_mu);
    const AdmitResult admitted = core->slots.admit();
    if (admitted.admission != Admission::kRefused) {
      if (admitted.evicted) {
        if (auto it = core->conns.find(*admitted.evicted); it != core->conns.end()) victim = it->second;
        victim_stalled = admitted.evicted_reading;
      }
      conn = std::make_shared<Connection>(core->shared_from_this(), std::move(socket), strand, admitted.id,
                                          admitted.admission);
      core->conns.emplace(admitted.id, conn);
    }
  }
  if (conn) {
    net::post(conn->strand(), [conn] { conn->start(); });
  } else {
    beast::error_code cec;
    socket.close(cec);  // beyond the ceiling: not even an answer
  }
  // Locked outside conns_mu: dropping the last reference takes it.
  if (auto v = victim.lock()) net::post(v->strand(), [v, victim_stalled] { v->evict(victim_stalled); });
  do_accept(core);
}

// The accept loop runs on accept_strand; handlers hold a raw pointer, which
// stays valid because stop() runs them all before the server drops the core.
void do_accept(ServerCore* core) {
  Strand strand = net::make_strand(core->ioc);
  core->acceptor.async_accept(strand, [core, strand](beast::error_code ec, tcp::socket socket) {
    on_accept(core, strand, ec, std::move(socket));
  });
}

void close_acceptor(ServerCore* core) {
  beast::error_code ec;
  core->acceptor.close(ec);
  core->accept_retry.cancel();
}

}  // namespace detail

HttpServer::HttpServer(HttpServerConfig cfg) : cfg_(std::move(cfg)) {}

HttpServer::~HttpServer() { stop(); }

Status HttpServer::start(HttpHandler handler) {
  if (state_ != HttpServerState::kCreated) return Status::invalid_argument("HttpServer::start: already started");
  if (!handler) return Status::invalid_argument("HttpServer::start: no handler");
  const std::string where = cfg_.host + ":" + std::to_string(cfg_.port);
  auto core = std::make_shared<detail::ServerCore>(cfg_);
  core->handler = std::move(handler);

  beast::error_code ec;
  tcp::endpoint endpoint;
  const net::ip::address addr = net::ip::make_address(cfg_.host, ec);
  if (!ec) {
    endpoint = tcp::endpoint(addr, cfg_.port);
  } else {
    tcp::resolver resolver(core->ioc);
    auto results = resolver.resolve(cfg_.host, std::to_string(cfg_.port), ec);
    if (ec || results.empty()) {
      return Status::io_error("cannot resolve " + where + ": " + (ec ? ec.message() : "no address"));
    }
    endpoint = results.begin()->endpoint();
  }
  tcp::acceptor& acc = core->acceptor;
  if (acc.open(endpoint.protocol(), ec); ec) return Status::io_error("cannot listen on " + where + ": " + ec.message());
  if (acc.set_option(net::socket_base::reuse_address(true), ec); ec) {
    return Status::io_error("cannot listen on " + where + ": " + ec.message());
  }
  if (acc.bind(endpoint, ec); ec) return Status::io_error("cannot bind " + where + ": " + ec.message());
  if (acc.listen(net::socket_base::max_listen_connections, ec); ec) {
    return Status::io_error("cannot listen on " + where + ": " + ec.message());
  }
  port_ = acc.local_endpoint(ec).port();

  core_ = std::move(core);
  net::post(core_->accept_strand, [core = core_.get()] { detail::do_accept(core); });
  const int n = std::max(1, cfg_.threads);
  threads_.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    threads_.emplace_back([core = core_.get()] {
      // An exception out of a completion handler must not end the process:
      // the operation that threw is dropped (its connection closes when the
      // last reference goes) and the thread goes back to serving.
      for (;;) {
        try {
          core->ioc.run();
          return;
        } catch (const std::exception& e) {
          std::fprintf(stderr, "pd::router::HttpServer: io thread caught: %s\n", e.what());
        } catch (...) {
          std::fprintf(stderr, "pd::router::HttpServer: io thread caught an unknown exception\n");
        }
      }
    });
  }
  transition(state_, HttpServerState::kServing, 0, "http server");
  return Status::ok();
}

void HttpServer::stop_accepting() {
  if (state_ != HttpServerState::kServing) return;
  detail::ServerCore* core = core_.get();
  if (core->ioc.get_executor().running_in_this_thread()) {
    net::post(core->accept_strand, [core] { detail::close_acceptor(core); });
    return;
  }
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> closed = done->get_future();
  net::post(core->accept_strand, [core, done] {
    detail::close_acceptor(core);
    done->set_value();
  });
  closed.wait_for(std::chrono::seconds(5));  // bounded: the io threads never block
}

void HttpServer::stop() {
  if (state_ != HttpServerState::kServing) return;
  transition(state_, HttpServerState::kStopped, 0, "http server");
  detail::ServerCore* core = core_.get();
  core->mark_stopped();  // from here no exchange posts anything
  net::post(core->accept_strand, [core] { detail::close_acceptor(core); });
  close_all_connections();
  // Stop the io threads now, then run what is left (the closes above and the
  // aborted operations they complete) on this thread until nothing is queued,
  // so no handler holding a connection is left behind in the io_context. A
  // connection accepted meanwhile is closed by the next round.
  core->ioc.stop();
  for (std::thread& t : threads_) t.join();
  threads_.clear();
  core->work.reset();
  for (int round = 0; round < 100; ++round) {
    core->ioc.restart();
    for (int i = 0; i < 10000 && core->ioc.poll() > 0; ++i) {
    }
    if (!close_all_connections()) break;
  }
}

bool HttpServer::close_all_connections() {
  // Collected first: the last reference to a connection may drop here, and its
  // destructor takes conns_mu.
  std::vector<std::shared_ptr<detail::Connection>> open;
  {
    std::lock_guard lock(core_->conns_mu);
    for (auto& [id, weak] : core_->conns) {
      if (auto conn = weak.lock()) open.push_back(std::move(conn));
    }
  }
  for (auto& conn : open) net::post(conn->strand(), [conn] { conn->close_for_stop(); });
  return !open.empty();
}

size_t HttpServer::open_connections() const { return core_ ? core_->open_connections.load() : 0; }

}  // namespace pd::router
