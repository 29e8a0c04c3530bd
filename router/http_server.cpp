#include "router/http_server.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <deque>
#include <exception>
#include <future>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string_view>
#include <unordered_map>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "router/connection_slots.h"
#include "router/openai_api.h"
#include "util/lifecycle.h"

namespace pd::router {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

namespace detail {

using Strand = net::strand<net::io_context::executor_type>;
class Connection;

// A watch read (see Connection::start_watch) reads at most this much at once.
constexpr size_t kWatchReadBytes = 4096;
// Bytes a client may send ahead (pipelining) while an answer is pending; past
// this they are discarded and the connection closes after the answer.
constexpr size_t kMaxPipelinedBytes = 64 * 1024;
// Added to max_body_bytes + max_header_bytes for the default max_request_bytes.
constexpr size_t kRequestOverheadBytes = 48 * 1024;
// Limits of an overflow connection (admitted beyond max_connections).
constexpr size_t kOverflowHeaderBytes = 4 * 1024;
constexpr size_t kOverflowBodyBytes = 1024;
constexpr size_t kOverflowRequestBytes = 8 * 1024;
constexpr std::chrono::milliseconds kOverflowReadTimeout{2000};
// Retry-After of the 503 that an overflow connection gets.
constexpr const char* kOverflowRetryAfter = "1";
// A stream's client is behind (HttpServerConfig::max_write_buffer_bytes) when
// more than the limit waits and the write in progress began this long ago: a
// burst of events that the socket takes at once is not a client behind.
constexpr std::chrono::milliseconds kBehindAfter{100};

size_t request_limit_of(const HttpServerConfig& c) {
  return c.max_request_bytes != 0 ? c.max_request_bytes
                                  : c.max_body_bytes + c.max_header_bytes + kRequestOverheadBytes;
}

// The most unparsed bytes a connection's read buffer holds: a header up to its
// limit (the parser reports header_limit before the buffer fills) or the bytes
// sent ahead during an exchange, plus one watch read.
size_t buffer_limit_of(const HttpServerConfig& c) {
  return std::max(c.max_header_bytes + 1, kMaxPipelinedBytes) + kWatchReadBytes;
}

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

  // Writers post onto connection strands only while !stopped, checked under a
  // shared lock, so nothing is queued after stop() has run the io_context dry.
  std::shared_mutex stop_mu;
  bool stopped = false;  // guarded by stop_mu

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
    return stopped;
  }
  // Posts `f` to `strand` unless the server stopped; false if it did.
  template <typename F>
  bool post_if_running(const Strand& strand, F&& f) {
    std::shared_lock lock(stop_mu);
    if (stopped) return false;
    net::post(strand, std::forward<F>(f));
    return true;
  }
};

// Runs a user callback on an io thread without letting it take the thread down.
void call_safely(const std::function<void()>& cb, const char* what) {
  try {
    cb();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pd::router::HttpServer: %s threw: %s\n", what, e.what());
  } catch (...) {
    std::fprintf(stderr, "pd::router::HttpServer: %s threw\n", what);
  }
}

std::string to_std(beast::string_view s) { return std::string(s.data(), s.size()); }

std::shared_ptr<http::response<http::string_body>> make_response(unsigned version, bool keep_alive, int status,
                                                                 const std::string& content_type, std::string body) {
  auto res = std::make_shared<http::response<http::string_body>>();
  res->version(version);
  // A final answer is 2xx..5xx; 204 and 304 carry no body (Beast would throw on one).
  res->result(status >= 200 && status <= 599 ? static_cast<unsigned>(status) : 500u);
  res->set(http::field::server, "pdcluster");
  if (!content_type.empty()) res->set(http::field::content_type, content_type);
  if (status != 204 && status != 304) res->body() = std::move(body);
  res->keep_alive(keep_alive);
  res->prepare_payload();
  return res;
}

std::shared_ptr<http::response<http::string_body>> make_error_response(unsigned version, int status,
                                                                       std::string message, std::string type) {
  ApiError e;
  e.status = status;
  e.message = std::move(message);
  e.type = std::move(type);
  return make_response(version, /*keep_alive=*/false, status, "application/json", error_body(e));
}

// Beast stores a field's name and value lengths in 16 bits and throws
// std::length_error, out of the read operation and the io thread, for a longer
// one. The header limit keeps header fields shorter by default, but trailer
// fields (chunked bodies) and a configured header limit above 64 KiB do not:
// this parser refuses such a field as header_limit (431) instead.
class RequestParser : public http::request_parser<http::string_body> {
 private:
  static constexpr size_t kMaxFieldPart = 65535 - 2;  // Beast's bound on a name or a value
  void on_field_impl(http::field name, beast::string_view name_string, beast::string_view value,
                     beast::error_code& ec) override {
    if (name_string.size() > kMaxFieldPart || value.size() > kMaxFieldPart) {
      ec = http::error::header_limit;
      return;
    }
    get().insert(name, name_string, value);
  }
};

class Writer;

// Where a connection is in its life. One phase at a time, changed only through
// Connection::move_to() (transition(), util/lifecycle.h), which checks it
// against legal() below.
enum class ConnPhase {
  kAccepted,         // constructed; start() has not run
  kIdle,             // waiting for a request (the first, or the next on keep-alive),
                     // nothing of it received yet; a slot holder is listed idle
  kReadingHeader,    // reading a request line and header fields  } a slot holder is
  kReadingBody,      // the header is in and looked at: reading    } listed reading
                     // the body (and trailers)
  kSendingContinue,  // writing "100 Continue"; the body read resumes after it
  kHandling,         // the request is with the handler: its writes go out as they
                     // come, a watch read stays outstanding (start_watch)
  kWriting,          // the exchange's final write is queued (the handler's final
                     // answer, or the server's own error answer); nothing more is accepted
  kCancellingWatch,  // the exchange ended with the watch read outstanding: it was
                     // cancelled, and its completion starts reading the next request
  kDiscarding,       // the last answer went out: the send side is shut, and what the
                     // client still sends is read and discarded until EOF or a short deadline
  kClosed,           // the socket is closed; final
};

const char* state_name(ConnPhase p) {
  switch (p) {
    case ConnPhase::kAccepted: return "accepted";
    case ConnPhase::kIdle: return "idle";
    case ConnPhase::kReadingHeader: return "reading-header";
    case ConnPhase::kReadingBody: return "reading-body";
    case ConnPhase::kSendingContinue: return "sending-continue";
    case ConnPhase::kHandling: return "handling";
    case ConnPhase::kWriting: return "writing";
    case ConnPhase::kCancellingWatch: return "cancelling-watch";
    case ConnPhase::kDiscarding: return "discarding";
    case ConnPhase::kClosed: return "closed";
  }
  return "?";
}

// Every phase but kClosed may close (the peer left, a deadline, the server
// stopping, an eviction of an idle or stalled connection).
bool legal(ConnPhase from, ConnPhase to) {
  using P = ConnPhase;
  if (to == P::kClosed) return from != P::kClosed;
  switch (from) {
    case P::kAccepted: return to == P::kIdle;
    case P::kIdle: return to == P::kReadingHeader;  // bytes arrived, or the read ended
    case P::kReadingHeader: return to == P::kReadingBody || to == P::kWriting;
    case P::kReadingBody:
      return to == P::kSendingContinue || to == P::kHandling || to == P::kWriting;
    case P::kSendingContinue: return to == P::kReadingBody;
    case P::kHandling: return to == P::kWriting;
    case P::kWriting:
      return to == P::kIdle || to == P::kReadingHeader || to == P::kCancellingWatch || to == P::kDiscarding;
    case P::kCancellingWatch: return to == P::kIdle || to == P::kReadingHeader;
    case P::kDiscarding:
    case P::kClosed: return false;
  }
  return false;
}

// One accepted socket. Every member function runs on strand_ (the socket's
// executor); nothing here blocks. Its phase (ConnPhase) goes:
//   accepted -> idle -> reading-header -> reading-body [-> sending-continue -> reading-body]
//   -> handling (handler called; writes queued by the Writer) -> writing (final write queued)
//   -> the next request (keep-alive: idle or reading-header, through
//      cancelling-watch when the watch read was outstanding)
//      or discarding -> closed.
// A request the server refuses (size limits, malformed, overflow) goes from
// reading straight to writing (its own error answer), then discarding.
// An overflow connection (admitted beyond max_connections) reads one request
// under small limits and then closes; see HttpServerConfig::max_connections.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(std::shared_ptr<ServerCore> core, tcp::socket socket, Strand strand, uint64_t id, bool overflow)
      : core_(std::move(core)),
        strand_(std::move(strand)),
        socket_(std::move(socket)),
        read_timer_(strand_),
        write_timer_(strand_),
        id_(id),
        overflow_(overflow),
        buffer_(core_->buffer_limit) {
    core_->open_connections.fetch_add(1);
  }
  ~Connection() {
    if (phase_ != ConnPhase::kClosed) mark_closed();  // close() did it otherwise
  }

  const Strand& strand() const { return strand_; }
  ServerCore& core() { return *core_; }

  void start() {
    if (core_->is_stopped()) return close();
    beast::error_code ec;
    socket_.set_option(tcp::no_delay(true), ec);  // SSE events go out as they are made
    start_read(/*after_exchange=*/false);
  }

  // Posted by the acceptor after it gave this connection's slot to a new one.
  // `stalled` false: it was listed idle; it closes now if still idle, and one
  // that meanwhile got (part of) a request serves that request, with
  // Connection: close, and then closes — unless it has been idle for
  // kStalledReadAfter and holds only part of a header: bytes of a header show
  // only once the header is whole, so such a connection is sending it slowly,
  // and closes. `stalled` true: it was listed reading and silent for
  // kStalledReadAfter; a request still being read is dropped unanswered (as
  // its read deadline would), one that reached the handler meanwhile is
  // answered with Connection: close.
  void evict(bool stalled) {
    if (phase_ == ConnPhase::kClosed) return;
    evicted_ = true;
    if (phase_ == ConnPhase::kIdle) {
      // (The parser may have consumed a request line while its header is incomplete.)
      const bool nothing = buffer_.size() == 0 && parser_ && !parser_->got_some();
      const std::string_view held(static_cast<const char*>(buffer_.data().data()), buffer_.size());
      const bool slow_header = std::chrono::steady_clock::now() - idle_since_ >= kStalledReadAfter &&
                               held.find("\r\n\r\n") == std::string_view::npos;
      if (nothing || stalled || slow_header) return close();
    }
    if (stalled && (phase_ == ConnPhase::kReadingHeader || phase_ == ConnPhase::kReadingBody)) return close();
    if (in_exchange()) close_after_ = true;
  }

  // Closes the socket; a pending exchange sees on_disconnect. Idempotent.
  void close() {
    if (phase_ == ConnPhase::kClosed) return;
    if (in_exchange()) client_gone();
    move_to(ConnPhase::kClosed);
    disarm_read_timer();
    disarm_write_timer();
    beast::error_code ec;
    socket_.shutdown(tcp::socket::shutdown_both, ec);
    socket_.close(ec);
    // out_ and sse_ stay until a pending write completes: it may still refer to them.
    if (!write_pending_) out_.clear();
    mark_closed();
  }

  // ---- Called by the Writer (posted onto the strand). Each ignores calls for
  // an exchange that is not the current one or already has its final write.

  void send_response(uint64_t exchange, std::shared_ptr<http::response<http::string_body>> res, bool close_after) {
    if (!accepts(exchange)) return;
    if (close_after) close_after_ = true;
    if (close_after_) res->keep_alive(false);  // the connection closes after it: say so
    push({Outgoing::kResponse, std::move(res), {}, /*final=*/true});
  }

  void start_sse(uint64_t exchange) {
    if (!accepts(exchange) || sse_) return;
    sse_chunked_ = version_ >= 11;
    if (!sse_chunked_) close_after_ = true;  // HTTP/1.0: the stream ends with the connection
    sse_ = std::make_unique<SseHead>();
    http::response<http::empty_body>& res = sse_->res;
    res.version(version_);
    res.result(http::status::ok);
    res.set(http::field::server, "pdcluster");
    res.set(http::field::content_type, "text/event-stream");
    res.set(http::field::cache_control, "no-cache");
    res.set("X-Accel-Buffering", "no");  // proxies must not buffer the stream
    res.keep_alive(keep_alive_ && !close_after_);
    if (sse_chunked_) res.chunked(true);
    sse_->sr.emplace(res);
    push({Outgoing::kSseHead, nullptr, {}, false});
  }

  void send_chunk(uint64_t exchange, std::string data) {
    if (!accepts(exchange) || !sse_) return;
    push({Outgoing::kChunk, nullptr, std::move(data), false});
  }

  void finish_sse(uint64_t exchange) {
    if (!accepts(exchange) || !sse_) return;
    push({Outgoing::kLastChunk, nullptr, {}, /*final=*/true});
  }

  // The writer was dropped without a final answer.
  void writer_dropped(uint64_t exchange, bool streaming) {
    if (!accepts(exchange)) return;
    if (streaming) {
      close();  // no final chunk: the client must not take a cut stream for a finished one
      return;
    }
    close_after_ = true;
    push({Outgoing::kResponse,
          make_error_response(version_, 500, "the server dropped the request without answering", "server_error"),
          {},
          true});
  }

 private:
  struct Outgoing {
    enum Kind { kResponse, kSseHead, kChunk, kLastChunk } kind;
    std::shared_ptr<http::response<http::string_body>> response;  // kResponse
    std::string data;                                             // kChunk
    bool final = false;  // the exchange's last write
  };
  struct SseHead {
    http::response<http::empty_body> res;
    std::optional<http::response_serializer<http::empty_body>> sr;  // over res, made once res is set
  };

  void move_to(ConnPhase to) { transition(phase_, to, id_, "http connection"); }

  // Between the request and the end of its answer (the server's own error
  // answers included).
  bool in_exchange() const { return phase_ == ConnPhase::kHandling || phase_ == ConnPhase::kWriting; }
  bool accepts(uint64_t exchange) const { return phase_ == ConnPhase::kHandling && exchange == exchange_; }

  // Gives back this connection's place (slot, idle listing) and count; once.
  void mark_closed() {
    core_->open_connections.fetch_sub(1);
    std::lock_guard lock(core_->conns_mu);
    core_->conns.erase(id_);
    core_->slots.remove(id_);
  }

  // Lists this connection as an eviction candidate (idle, or reading since
  // now) or unlists it (ConnectionSlots::list). Only a slot holder is listed;
  // a no-op when there is no connection limit.
  void list(Listing how) {
    if (core_->cfg.max_connections == 0) return;
    std::lock_guard lock(core_->conns_mu);
    core_->slots.list(id_, how);
  }

  // ---- Timers: a generation number tells a stale expiry from a live one.

  void arm_read_timer(std::chrono::milliseconds d) {
    const uint64_t gen = ++read_timer_gen_;
    read_timer_.expires_after(d);
    read_timer_.async_wait([self = shared_from_this(), gen](beast::error_code ec) {
      if (!ec && gen == self->read_timer_gen_) self->close();
    });
  }
  void disarm_read_timer() {
    ++read_timer_gen_;
    read_timer_.cancel();
  }
  void arm_write_timer() {
    const uint64_t gen = ++write_timer_gen_;
    write_timer_.expires_after(core_->cfg.write_timeout);
    write_timer_.async_wait([self = shared_from_this(), gen](beast::error_code ec) {
      if (!ec && gen == self->write_timer_gen_) self->close();  // the client stopped reading
    });
  }
  void disarm_write_timer() {
    ++write_timer_gen_;
    write_timer_.cancel();
  }

  // ---- Reading a request: async_read_some in a loop, so that every byte the
  // parser consumes is counted against request_limit; one element the parser
  // cannot consume yet (a header, a chunk-size line, the trailers) is bounded
  // by the header limit or by the buffer's own limit.

  // `after_exchange`: waiting for a keep-alive request, not the first one.
  void start_read(bool after_exchange) {
    if (phase_ == ConnPhase::kClosed) return;
    if (after_exchange && evicted_ && buffer_.size() == 0) return close();
    parser_.emplace();
    parser_->header_limit(static_cast<std::uint32_t>(
        std::min<size_t>(overflow_ ? kOverflowHeaderBytes : core_->cfg.max_header_bytes, UINT32_MAX)));
    body_limit_ = overflow_ ? kOverflowBodyBytes : core_->cfg.max_body_bytes;
    parser_->body_limit(body_limit_);
    request_bytes_ = 0;
    arm_read_timer(overflow_ ? std::min(core_->cfg.read_timeout, kOverflowReadTimeout) : core_->cfg.read_timeout);
    // Nothing of the request yet (a new connection, or nothing sent ahead): idle.
    const bool idle = buffer_.size() == 0;
    if (idle) idle_since_ = std::chrono::steady_clock::now();
    move_to(idle ? ConnPhase::kIdle : ConnPhase::kReadingHeader);
    list(idle ? Listing::kIdle : Listing::kReading);
    read_some();
  }

  void read_some() {
    http::async_read_some(socket_, buffer_, *parser_,
                          [self = shared_from_this()](beast::error_code ec, size_t n) { self->on_read_some(ec, n); });
  }

  size_t request_limit() const { return overflow_ ? kOverflowRequestBytes : core_->request_limit; }

  bool always_served(const http::request<http::string_body>& req) const {
    if (req.method() != http::verb::get) return false;
    const beast::string_view target = req.target();
    const beast::string_view path = target.substr(0, target.find('?'));
    const auto& paths = core_->cfg.always_served_paths;
    return std::any_of(paths.begin(), paths.end(), [&](const std::string& p) { return path == p; });
  }

  void on_read_some(beast::error_code ec, size_t n) {
    if (phase_ == ConnPhase::kIdle) {
      // (Part of) a request arrived, or the read ended.
      move_to(ConnPhase::kReadingHeader);
    }
    if (phase_ == ConnPhase::kClosed) return;
    request_bytes_ += n;
    if (ec) return on_read_error(ec);
    if (request_bytes_ > request_limit()) {
      return send_error(parser_->is_header_done() ? parser_->get().version() : 11, 413,
                        "request exceeds the limit of " + std::to_string(request_limit()) +
                            " bytes (header, chunk metadata, trailers and body together)");
    }
    if (phase_ == ConnPhase::kReadingHeader && parser_->is_header_done()) {
      move_to(ConnPhase::kReadingBody);
      if (!on_header()) return;
    }
    if (parser_->is_done()) {
      disarm_read_timer();
      list(Listing::kNone);
      return dispatch();
    }
    list(Listing::kReading);  // bytes just came: the time since the last ones starts again
    read_some();
  }

  // The request's header just came in; false when it took the connection
  // elsewhere (an answer, or "100 Continue") and reading must not go on here.
  bool on_header() {
    parser_->eager(true);  // from here, parse as much of the body as each read brings
    const auto& req = parser_->get();
    if (overflow_ && !always_served(req)) {
      send_error(req.version(), 503,
                 "the server is at its limit of " + std::to_string(core_->cfg.max_connections) +
                     " connections; retry later",
                 "service_unavailable", {{"Retry-After", kOverflowRetryAfter}});
      return false;
    }
    if (beast::iequals(req[http::field::expect], "100-continue") && !parser_->is_done()) {
      // The client waits for this before sending the body (curl does for > 1 KiB).
      send_continue(req.version());
      return false;
    }
    return true;
  }

  void send_continue(unsigned version) {
    move_to(ConnPhase::kSendingContinue);
    list(Listing::kNone);  // the client waits for this answer: not stalled
    auto res = std::make_shared<http::response<http::empty_body>>(http::status::continue_, version);
    write_pending_ = true;
    arm_write_timer();
    http::async_write(socket_, *res, [self = shared_from_this(), res](beast::error_code ec, size_t) {
      self->write_pending_ = false;
      self->disarm_write_timer();
      if (self->phase_ == ConnPhase::kClosed) return;
      if (ec) return self->close();
      self->move_to(ConnPhase::kReadingBody);
      self->list(Listing::kReading);
      self->read_some();
    });
  }

  void on_read_error(beast::error_code ec) {
    const unsigned version = parser_ && parser_->is_header_done() ? parser_->get().version() : 11;
    if (ec == http::error::body_limit) {
      return send_error(version, 413, "request body exceeds the limit of " + std::to_string(body_limit_) + " bytes");
    }
    if (ec == http::error::buffer_overflow) {
      // Only after the header (header_limit comes first): a chunk-size line with
      // its extensions, or the trailer section, did not fit in the buffer.
      return send_error(version, 413,
                        "a chunk-size line or the trailer section of the request exceeds the limit of " +
                            std::to_string(core_->buffer_limit) + " bytes");
    }
    if (ec == http::error::header_limit) {
      return send_error(version, 431,
                        "request header fields too large (limit " +
                            std::to_string(overflow_ ? kOverflowHeaderBytes : core_->cfg.max_header_bytes) +
                            " bytes)");
    }
    // The peer left (or the deadline closed the socket): nobody to answer.
    if (ec == http::error::end_of_stream || ec == http::error::partial_message ||
        ec.category() != http::make_error_code(http::error::bad_method).category()) {
      return close();
    }
    send_error(version, 400, "malformed HTTP request: " + ec.message());
  }

  // The server's own answer to a request it could not (or would not) read;
  // closes afterwards.
  void send_error(unsigned version, int status, std::string message, std::string type = "invalid_request_error",
                  std::vector<std::pair<std::string, std::string>> headers = {}) {
    disarm_read_timer();
    list(Listing::kNone);
    parser_.reset();
    ++exchange_;
    close_after_ = true;
    auto res = make_error_response(version, status, std::move(message), std::move(type));
    for (auto& [name, value] : headers) res->set(name, value);
    push({Outgoing::kResponse, std::move(res), {}, true});  // -> kWriting
  }

  void dispatch();  // below Writer

  // ---- The exchange: writes in order, one at a time.

  void push(Outgoing item) {
    if (item.final) move_to(ConnPhase::kWriting);
    if (item.kind == Outgoing::kChunk) waiting_bytes_ += item.data.size();
    out_.push_back(std::move(item));
    pump();
    if (waiting_bytes_ > core_->cfg.max_write_buffer_bytes && write_pending_ &&
        std::chrono::steady_clock::now() - write_began_ >= kBehindAfter) {
      // The client reads slower than its events come: cut it, as if it had
      // left (close() reports the departure to the exchange).
      close();
    }
  }

  void pump() {
    if (write_pending_ || out_.empty() || phase_ == ConnPhase::kClosed) return;
    write_pending_ = true;
    write_began_ = std::chrono::steady_clock::now();
    arm_write_timer();
    if (out_.front().kind == Outgoing::kChunk) gather_events();
    Outgoing& item = out_.front();
    auto done = [self = shared_from_this()](beast::error_code ec, size_t) { self->on_write(ec); };
    switch (item.kind) {
      case Outgoing::kResponse:
        http::async_write(socket_, *item.response, std::move(done));
        break;
      case Outgoing::kSseHead:
        http::async_write_header(socket_, *sse_->sr, std::move(done));
        break;
      case Outgoing::kChunk:  // framed by gather_events()
        net::async_write(socket_, net::buffer(item.data), std::move(done));
        break;
      case Outgoing::kLastChunk:
        if (sse_chunked_) {
          net::async_write(socket_, http::make_chunk_last(), std::move(done));
        } else {
          net::post(strand_, [done = std::move(done)]() mutable { done(beast::error_code(), 0); });
        }
        break;
    }
  }

  // Every SSE event waiting at the front of out_ (up to an item of another
  // kind) becomes the front item's bytes, for one write: each event still its
  // own HTTP chunk ("<size in hex>\r\n<event>\r\n"; HTTP/1.0: the bare event),
  // so a burst of events costs one write, and what waits behind a write is
  // only what came while it ran.
  void gather_events() {
    std::string wire;
    auto end = out_.begin();
    for (; end != out_.end() && end->kind == Outgoing::kChunk; ++end) {
      waiting_bytes_ -= end->data.size();  // no longer waiting: being written
      if (!sse_chunked_) {
        wire += end->data;
        continue;
      }
      char size[20];
      std::snprintf(size, sizeof size, "%zx\r\n", end->data.size());
      wire += size;
      wire += end->data;
      wire += "\r\n";
    }
    out_.erase(out_.begin() + 1, end);
    out_.front().data = std::move(wire);
  }

  void on_write(beast::error_code ec) {
    write_pending_ = false;
    disarm_write_timer();
    if (phase_ == ConnPhase::kClosed) {
      out_.clear();
      return;
    }
    if (ec) return close();  // close() reports the departure to a pending exchange
    const bool final = out_.front().final;
    out_.pop_front();
    if (final) return end_exchange();
    pump();
  }

  // The final write went out (phase kWriting).
  void end_exchange() {
    writer_.reset();
    sse_.reset();
    if (close_after_) return start_discarding();
    if (watch_pending_) {
      // Only the watch read is outstanding: cancel it; its handler starts the next read.
      move_to(ConnPhase::kCancellingWatch);
      beast::error_code ec;
      socket_.cancel(ec);
      return;
    }
    start_read(/*after_exchange=*/true);
  }

  // Closing after an answer: stop sending, then read and discard what the
  // client still sends (an oversized body, say) for a short while, so the
  // close does not turn into a reset that destroys the answer in flight.
  void start_discarding() {
    move_to(ConnPhase::kDiscarding);
    beast::error_code ec;
    socket_.shutdown(tcp::socket::shutdown_send, ec);
    if (ec) return close();
    arm_read_timer(std::min(core_->cfg.read_timeout, std::chrono::milliseconds(1000)));
    discard_input();
  }
  void discard_input() {
    if (watch_pending_) return;  // its handler comes back here
    discard_buf_.resize(kWatchReadBytes);
    socket_.async_read_some(net::buffer(discard_buf_), [self = shared_from_this()](beast::error_code ec, size_t) {
      if (self->phase_ == ConnPhase::kClosed) return;
      if (ec) return self->close();
      self->discard_input();
    });
  }

  // A read kept outstanding during an exchange: EOF or an error means the client
  // left; bytes it sends ahead are kept in buffer_ for the next request, up to
  // kMaxPipelinedBytes. Past that they are all discarded, and so is whatever
  // follows (read into discard_buf_), and the connection closes after the
  // answer: the read never stops, so a departure is still noticed.
  void start_watch() {
    if (watch_pending_ || phase_ == ConnPhase::kClosed) return;
    if (!discard_ahead_ && buffer_.size() >= kMaxPipelinedBytes) {
      discard_ahead_ = true;
      close_after_ = true;  // the requests sent ahead are not served
      buffer_.consume(buffer_.size());
    }
    watch_pending_ = true;
    if (discard_ahead_) {
      discard_buf_.resize(kWatchReadBytes);
      socket_.async_read_some(net::buffer(discard_buf_),
                              [self = shared_from_this()](beast::error_code ec, size_t) { self->on_watch(ec, 0); });
      return;
    }
    // size() < kMaxPipelinedBytes, so this stays within buffer_'s limit.
    socket_.async_read_some(buffer_.prepare(kWatchReadBytes),
                            [self = shared_from_this()](beast::error_code ec, size_t n) { self->on_watch(ec, n); });
  }

  // `n`: bytes read into buffer_ (0 when they went to discard_buf_).
  void on_watch(beast::error_code ec, size_t n) {
    watch_pending_ = false;
    if (n > 0) buffer_.commit(n);
    if (phase_ == ConnPhase::kClosed) return;
    if (in_exchange()) {
      if (ec) return close();  // EOF or error mid-answer: the client is gone
      return start_watch();
    }
    if (phase_ == ConnPhase::kDiscarding) {
      if (ec && ec != net::error::operation_aborted) return close();
      buffer_.consume(buffer_.size());
      return discard_input();
    }
    // kCancellingWatch: the exchange ended while this read was outstanding
    // (cancelled or not).
    if (ec && ec != net::error::operation_aborted) return close();
    start_read(/*after_exchange=*/true);
  }

  void client_gone();  // below Writer

  // Constant after construction. core_ comes first so it is destroyed last:
  // the socket, timers and strand need its io_context.
  const std::shared_ptr<ServerCore> core_;
  const Strand strand_;
  tcp::socket socket_;
  net::steady_timer read_timer_;
  net::steady_timer write_timer_;
  const uint64_t id_;
  const bool overflow_;  // admitted beyond max_connections: one restricted request

  // All below: used on strand_ only.
  ConnPhase phase_ = ConnPhase::kAccepted;  // changed by move_to() only
  beast::flat_buffer buffer_;  // limited to core_->buffer_limit bytes
  std::optional<RequestParser> parser_;
  size_t body_limit_ = 0;       // the current request's
  size_t request_bytes_ = 0;    // bytes of the current request the parser consumed
  std::string discard_buf_;
  uint64_t read_timer_gen_ = 0;
  uint64_t write_timer_gen_ = 0;
  // Flags beside the phase, each independent of it:
  //  - evicted_: lost its slot (evict()), which can happen in any phase; no
  //    request is read after the current one.
  //  - discard_ahead_: the client sent more than kMaxPipelinedBytes ahead
  //    (start_watch); set during an exchange, in kHandling or kWriting, and
  //    kept: every later read discards.
  //  - write_pending_, watch_pending_: an async write (response, event, "100
  //    Continue") or a watch read is outstanding. Such an operation outlives the
  //    phase that began it (a watch read begun in kHandling completes in
  //    kCancellingWatch, kDiscarding or kClosed; a write's buffers must stay
  //    until it completes, even after close()), so it is tracked apart.
  bool evicted_ = false;
  bool discard_ahead_ = false;
  bool write_pending_ = false;
  bool watch_pending_ = false;
  // Bytes of the SSE events in out_ whose write has not begun (bounded by
  // cfg.max_write_buffer_bytes: see push()).
  size_t waiting_bytes_ = 0;
  std::chrono::steady_clock::time_point write_began_{};  // of the write in progress
  std::chrono::steady_clock::time_point idle_since_{};  // when it last entered kIdle

  // The current exchange. close_after_ is the exchange's verdict on the
  // connection, gathered while it runs (the request, the handler's headers, an
  // HTTP/1.0 stream, an eviction, too much sent ahead) and acted on when it
  // ends (kWriting -> kDiscarding instead of the next request).
  uint64_t exchange_ = 0;
  bool close_after_ = false;  // close once it is answered
  unsigned version_ = 11;     // the request's HTTP version (11 = 1.1)
  bool keep_alive_ = true;    // what the request allows
  bool sse_chunked_ = true;   // HTTP/1.1: events as chunks; 1.0: raw, ended by the close
  std::unique_ptr<SseHead> sse_;
  std::weak_ptr<Writer> writer_;
  std::deque<Outgoing> out_;  // front: being written when write_pending_
};

// The handler's side of one exchange. Its state machine (idle -> streaming ->
// done, or idle -> done) is checked under mu_ together with the post, so posts
// reach the strand in the order of the state changes.
class Writer final : public ResponseWriter {
 public:
  Writer(std::shared_ptr<Connection> conn, uint64_t exchange, unsigned version, bool keep_alive)
      : conn_(std::move(conn)), exchange_(exchange), version_(version), keep_alive_(keep_alive) {}

  ~Writer() override {
    // No lock: nobody else holds this writer any more.
    if (gone_ || state_ == State::kDone) return;
    conn_->core().post_if_running(
        conn_->strand(), [conn = conn_, ex = exchange_, streaming = state_ == State::kStreaming] {
          conn->writer_dropped(ex, streaming);
        });
  }

  bool respond(int status, std::string content_type, std::string body,
               std::vector<std::pair<std::string, std::string>> headers) override {
    bool close_after = !keep_alive_;
    auto res = make_response(version_, keep_alive_, status, content_type, std::move(body));
    for (auto& [name, value] : headers) {
      // Framing headers are the server's; CR/LF would split the header.
      if (name.find_first_of("\r\n:") != std::string::npos || value.find_first_of("\r\n") != std::string::npos) {
        continue;
      }
      if (beast::iequals(name, "Connection")) {
        if (beast::iequals(value, "close")) close_after = true;
        continue;
      }
      if (beast::iequals(name, "Content-Length") || beast::iequals(name, "Transfer-Encoding")) continue;
      res->set(name, value);
    }
    res->keep_alive(!close_after);
    std::lock_guard lock(mu_);
    if (gone_ || state_ != State::kIdle) return false;
    const bool posted = conn_->core().post_if_running(
        conn_->strand(), [conn = conn_, ex = exchange_, res = std::move(res), close_after]() mutable {
          conn->send_response(ex, std::move(res), close_after);
        });
    if (posted) state_ = State::kDone;
    return posted;
  }

  bool start_sse() override {
    std::lock_guard lock(mu_);
    if (gone_ || state_ != State::kIdle) return false;
    const bool posted = conn_->core().post_if_running(
        conn_->strand(), [conn = conn_, ex = exchange_] { conn->start_sse(ex); });
    if (posted) state_ = State::kStreaming;
    return posted;
  }

  bool send_event(std::string data) override {
    std::string chunk;
    chunk.reserve(data.size() + 8);
    chunk += "data: ";
    chunk += data;
    chunk += "\n\n";
    std::lock_guard lock(mu_);
    if (gone_ || state_ != State::kStreaming) return false;
    return conn_->core().post_if_running(conn_->strand(),
                                         [conn = conn_, ex = exchange_, chunk = std::move(chunk)]() mutable {
                                           conn->send_chunk(ex, std::move(chunk));
                                         });
  }

  bool finish() override {
    std::lock_guard lock(mu_);
    if (gone_ || state_ != State::kStreaming) return false;
    const bool posted = conn_->core().post_if_running(
        conn_->strand(), [conn = conn_, ex = exchange_] { conn->finish_sse(ex); });
    if (posted) state_ = State::kDone;
    return posted;
  }

  void on_disconnect(std::function<void()> cb) override {
    {
      std::lock_guard lock(mu_);
      if (state_ == State::kDone) return;  // it can no longer fire
      if (!disconnect_due_) {
        on_disconnect_ = std::move(cb);
        return;
      }
      disconnect_due_ = false;  // the client left before the callback was set
    }
    if (!conn_->core().post_if_running(conn_->strand(), [cb] { call_safely(cb, "on_disconnect callback"); })) {
      call_safely(cb, "on_disconnect callback");
    }
  }

  // On the strand: the client went away (or the server is stopping).
  void client_gone() {
    std::function<void()> cb;
    {
      std::lock_guard lock(mu_);
      if (gone_) return;
      gone_ = true;
      if (state_ == State::kDone) return;  // answered: nothing to report
      if (on_disconnect_) {
        cb = std::move(on_disconnect_);
        on_disconnect_ = nullptr;
      } else {
        disconnect_due_ = true;
      }
    }
    if (cb) call_safely(cb, "on_disconnect callback");
  }

 private:
  enum class State { kIdle, kStreaming, kDone };

  // Constant after construction.
  const std::shared_ptr<Connection> conn_;
  const uint64_t exchange_;
  const unsigned version_;
  const bool keep_alive_;

  std::mutex mu_;
  State state_ = State::kIdle;          // guarded by mu_
  bool gone_ = false;                   // guarded by mu_
  bool disconnect_due_ = false;         // guarded by mu_: gone while no callback was set
  std::function<void()> on_disconnect_;  // guarded by mu_
};

void Connection::client_gone() {
  if (auto w = writer_.lock()) w->client_gone();
}

void Connection::dispatch() {
  http::request<http::string_body> req = parser_->release();
  parser_.reset();
  if (core_->is_stopped()) return close();
  HttpRequest r;
  r.method = to_std(req.method_string());
  const beast::string_view target = req.target();
  r.target = to_std(target.substr(0, target.find('?')));
  r.authorization = to_std(req[http::field::authorization]);
  r.content_type = to_std(req[http::field::content_type]);
  r.body = std::move(req.body());

  ++exchange_;
  version_ = req.version();
  // Without a slot, this is the connection's last request.
  keep_alive_ = req.keep_alive() && !overflow_ && !evicted_;
  close_after_ = !keep_alive_;
  move_to(ConnPhase::kHandling);
  auto writer = std::make_shared<Writer>(shared_from_this(), exchange_, version_, keep_alive_);
  writer_ = writer;
  start_watch();
  try {
    core_->handler(std::move(r), writer);
  } catch (const std::exception& e) {
    writer->respond(500, "application/json",
                    error_body(ApiError{500, std::string("internal error: ") + e.what(), "server_error", "", ""}), {});
  } catch (...) {
    writer->respond(500, "application/json", error_body(ApiError{500, "internal error", "server_error", "", ""}), {});
  }
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
                                          /*overflow=*/admitted.admission == Admission::kOverflow);
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
  if (started_) return Status::invalid_argument("HttpServer::start: already started");
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
  started_ = true;
  return Status::ok();
}

void HttpServer::stop_accepting() {
  if (!started_ || stopped_) return;
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
  if (!started_ || stopped_) return;
  stopped_ = true;
  detail::ServerCore* core = core_.get();
  {
    std::unique_lock lock(core->stop_mu);
    core->stopped = true;  // from here no Writer posts anything
  }
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
  for (auto& conn : open) net::post(conn->strand(), [conn] { conn->close(); });
  return !open.empty();
}

size_t HttpServer::open_connections() const { return core_ ? core_->open_connections.load() : 0; }

}  // namespace pd::router
