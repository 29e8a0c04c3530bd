// What the HTTP server (router/http_server.h) shares with its io threads, its
// connections and their exchanges: the config and the limits derived from it,
// the io_context, the open connections and their slots, and whether the server
// still runs. Internal to the server's files (http_server.cpp,
// http_connection.cpp, http_exchange.cpp) and their tests.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <utility>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "router/connection_slots.h"
#include "router/http_server.h"

namespace pd::router::detail {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using Strand = net::strand<net::io_context::executor_type>;

class Connection;

// A watch read (see Connection::start_watch) reads at most this much at once.
inline constexpr size_t kWatchReadBytes = 4096;
// Bytes a client may send ahead (pipelining) while an answer is pending; past
// this they are discarded and the connection closes after the answer.
inline constexpr size_t kMaxPipelinedBytes = 64 * 1024;
// Added to max_body_bytes + max_header_bytes for the default max_request_bytes.
inline constexpr size_t kRequestOverheadBytes = 48 * 1024;

inline size_t request_limit_of(const HttpServerConfig& c) {
  return c.max_request_bytes != 0 ? c.max_request_bytes
                                  : c.max_body_bytes + c.max_header_bytes + kRequestOverheadBytes;
}

// The most unparsed bytes a connection's read buffer holds: a header up to its
// limit (the parser reports header_limit before the buffer fills) or the bytes
// sent ahead during an exchange, plus one watch read.
inline size_t buffer_limit_of(const HttpServerConfig& c) {
  return std::max(c.max_header_bytes + 1, kMaxPipelinedBytes) + kWatchReadBytes;
}

// Runs a user callback on an io thread without letting it take the thread down.
void call_safely(const std::function<void()>& cb, const char* what);

// State shared by the server object, its io threads and every connection. A
// connection holds a shared_ptr to it, so the io_context outlives every socket
// and strand that uses it, even when a ResponseWriter outlives the server.
struct ServerCore : std::enable_shared_from_this<ServerCore> {
  explicit ServerCore(HttpServerConfig c)
      : cfg(std::move(c)),
        request_limit(request_limit_of(cfg)),
        buffer_limit(buffer_limit_of(cfg)),
        ioc(std::max(1, cfg.threads)),
        work(net::make_work_guard(ioc)),
        slots(cfg.max_connections, cfg.max_overflow_connections, kStalledReadAfter),
        accept_strand(net::make_strand(ioc)),
        acceptor(accept_strand),
        accept_retry(accept_strand) {}

  // Constant after start().
  const HttpServerConfig cfg;
  const size_t request_limit;  // cfg.max_request_bytes, or its default when 0
  const size_t buffer_limit;   // buffer_limit_of(cfg)
  HttpHandler handler;

  net::io_context ioc;
  net::executor_work_guard<net::io_context::executor_type> work;  // keeps run() going between requests

  // Exchanges post onto connection strands only while serving, checked under a
  // shared lock, so nothing is queued after stop() has run the io_context dry.
  std::shared_mutex stop_mu;
  HttpServerState state = HttpServerState::kServing;  // guarded by stop_mu; -> kStopped by mark_stopped()

  std::atomic<size_t> open_connections{0};
  std::mutex conns_mu;
  // One per open connection (from accept until close), by id. Guarded by conns_mu.
  std::unordered_map<uint64_t, std::weak_ptr<Connection>> conns;
  // Which of them hold a slot and which are idle or reading (eviction
  // candidates); it hands out the connection ids. Guarded by conns_mu.
  ConnectionSlots slots;

  // Used on accept_strand only.
  Strand accept_strand;
  tcp::acceptor acceptor;
  net::steady_timer accept_retry;

  bool is_stopped() {
    std::shared_lock lock(stop_mu);
    return state == HttpServerState::kStopped;
  }
  // From here nothing is posted (post_if_running() fails).
  void mark_stopped();
  // Posts `f` to `strand` unless the server stopped; false if it did.
  template <typename F>
  bool post_if_running(const Strand& strand, F&& f) {
    std::shared_lock lock(stop_mu);
    if (state == HttpServerState::kStopped) return false;
    net::post(strand, std::forward<F>(f));
    return true;
  }
  // Lists connection `id` as an eviction candidate (idle, or reading since
  // now) or unlists it (ConnectionSlots::list). Only a slot holder is listed;
  // a no-op when there is no connection limit.
  void list(uint64_t id, Listing how);
  // Gives back a closed connection's place (slot, listing) and count; once per connection.
  void forget(uint64_t id);
};

}  // namespace pd::router::detail
