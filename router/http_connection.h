// One accepted socket of the HTTP server: reading requests under their limits,
// handing each to the handler as an exchange, writing the answers, keeping a
// read outstanding meanwhile to notice a client leaving, and closing. Internal
// to the server (router/http_server.h); the states here are its parts that
// tests check alone.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "router/http_exchange.h"
#include "router/http_outgoing.h"
#include "router/http_server_core.h"

namespace pd::router::detail {

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
  kHandling,         // the request is with the handler: its answers go out as they
                     // come, a watch read stays outstanding (start_watch)
  kWriting,          // the exchange's final write is queued (the handler's final
                     // answer, or the server's own error answer); nothing more is accepted
  kCancellingWatch,  // the exchange ended with the watch read outstanding: it was
                     // cancelled, and its completion starts reading the next request
  kDiscarding,       // the last answer went out: the send side is shut, and what the
                     // client still sends is read and discarded until EOF or a short deadline
  kClosed,           // the socket is closed; final
};
const char* state_name(ConnPhase p);
bool legal(ConnPhase from, ConnPhase to);
// Between the request and the end of its answer (the server's own error answers included).
inline bool in_exchange(ConnPhase p) { return p == ConnPhase::kHandling || p == ConnPhase::kWriting; }

// What becomes of the connection after the request in hand: it only moves down
// the list (a verdict is never taken back), whatever the phase.
enum class ConnFate {
  kKeepAlive,         // the next request is read after this one's answer
  kLastRequest,       // lost its slot (evicted) outside an exchange: one more request
                      // at most, answered with Connection: close
  kCloseAfterAnswer,  // the exchange's answer is the last (the request, the handler's
                      // headers, an HTTP/1.0 stream, an eviction, a refusal): then
                      // discarding, then closed
  kDiscardAhead,      // as kCloseAfterAnswer, and the client sent more than
                      // kMaxPipelinedBytes ahead: the watch read discards what comes
};
const char* state_name(ConnFate f);
bool legal(ConnFate from, ConnFate to);

// Whether the watch read (or the read discarding input) is outstanding; it
// outlives the phase that began it (a watch read begun in kHandling completes
// in kCancellingWatch, kDiscarding or kClosed).
enum class WatchState { kNone, kPending };
const char* state_name(WatchState s);
bool legal(WatchState from, WatchState to);

// What a connection may read: a slot holder's limits (the config's) or an
// overflow connection's (see HttpServerConfig::max_connections).
struct ReadLimits {
  size_t header_bytes;
  size_t body_bytes;
  size_t request_bytes;
  std::chrono::milliseconds timeout;
};
ReadLimits read_limits_of(const ServerCore& core, Admission admission);

// The server's own answer to a request it will not serve.
struct Refusal {
  int status;
  std::string message;
  std::string type = "invalid_request_error";
  std::vector<std::pair<std::string, std::string>> headers = {};
};
// What a failed read is answered with (a limit passed, a malformed request), or
// nullopt when there is nobody to answer (the peer left, the deadline closed it).
std::optional<Refusal> refusal_of(beast::error_code ec, const ReadLimits& limits, size_t buffer_limit);
// An overflow connection's answer to anything but an always-served GET.
Refusal overflow_refusal(size_t max_connections);
// A GET of one of `paths` (the query string aside).
bool always_served(const http::request<http::string_body>& req, const std::vector<std::string>& paths);
// A request target's path as HttpRequest::target gives it (normalized).
std::string normalized_path(beast::string_view target);
// The answer to a request whose Transfer-Encoding is anything but "chunked"
// (its body's length is unknown, or coded in a way the server does not
// decode): 400 when chunked is not the last coding (RFC 9112 6.3: the framing
// is lost, so the connection closes), 501 for another coding before it;
// nullopt for none or "chunked".
std::optional<Refusal> transfer_coding_refusal(const http::request_header<>& h);
// 400 for an HTTP/1.1 request with no Host field or several (RFC 9112 3.2);
// nullopt otherwise (HTTP/1.0 needs none).
std::optional<Refusal> host_refusal(const http::request_header<>& h);
// The Access-Control-Allow-Origin value for a request from `origin` under
// `allowed` (HttpServerConfig::allowed_origins): "*" when any origin is
// allowed, the origin itself when it is listed, "" when it is not (or no
// Origin was sent).
std::string cors_allow_origin(const std::vector<std::string>& allowed, const std::string& origin);
// The server's answer to a CORS preflight: 204 with the Access-Control-Allow-*
// headers when `allow_origin` is set, else 403.
std::shared_ptr<Response> preflight_response(unsigned version, bool keep_alive, const std::string& origin,
                                             const std::string& allow_origin, const std::string& requested_headers);

// A deadline on the connection's strand: a timer and a generation number, so
// that an expiry of a deadline re-armed or disarmed since is told from a live one.
class Deadline {
 public:
  explicit Deadline(const Strand& strand) : timer_(strand) {}
  // Sets the expiry `after` from now; returns the generation its wait must match.
  uint64_t arm(std::chrono::milliseconds after) {
    timer_.expires_after(after);
    return ++gen_;
  }
  void disarm() {
    ++gen_;
    timer_.cancel();
  }
  bool live(uint64_t gen) const { return gen == gen_; }
  net::steady_timer& timer() { return timer_; }

 private:
  net::steady_timer timer_;
  uint64_t gen_ = 0;
};

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

// One accepted socket. Every member function runs on strand_ (the socket's
// executor); nothing here blocks. Its phase (ConnPhase) goes:
//   accepted -> idle -> reading-header -> reading-body [-> sending-continue -> reading-body]
//   -> handling (handler called; its answers come through the Exchange) -> writing (final write queued)
//   -> the next request (keep-alive: idle or reading-header, through
//      cancelling-watch when the watch read was outstanding)
//      or discarding -> closed.
// A request the server refuses (size limits, malformed, overflow) goes from
// reading straight to writing (its own error answer), then discarding.
// An overflow connection (admitted beyond max_connections) reads one request
// under small limits and then closes; see HttpServerConfig::max_connections.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(std::shared_ptr<ServerCore> core, tcp::socket socket, Strand strand, uint64_t id, Admission admission);
  ~Connection();

  const Strand& strand() const { return strand_; }
  void start();
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
  void evict(bool stalled);
  // Closes the socket; a pending exchange sees on_disconnect. Idempotent.
  void close();
  // The server stops: the answers the handler already gave start their writes
  // (their bytes reach the socket as each write starts), then it closes. An
  // answer given just before the stop is not lost behind its bell.
  void close_for_stop();

 private:
  void move_to(ConnPhase to);
  // Moves the fate to `at_least` unless it is there or further already.
  void settle(ConnFate at_least);
  // Arms `d`: when it expires, on_deadline(d).
  void arm(Deadline& d, std::chrono::milliseconds after);
  // A deadline expired: the read deadline of a request partly received
  // answers 408 (through on_read_some); any other closes the connection.
  void on_deadline(const Deadline& d);

  // ---- Reading a request.
  void start_read(bool after_exchange);
  void read_some();
  void on_read_some(beast::error_code ec, size_t n);
  bool on_header();
  void send_continue(unsigned version);
  void refuse(unsigned version, Refusal r);
  void dispatch();

  // ---- The exchange: the handler's answers, written in order.
  void serve_answers();
  // Applies the answers queued so far; false once the exchange no longer takes them.
  bool take_answers();
  void apply(Answer a);
  void push(Outgoing item);
  void pump();
  void on_write(beast::error_code ec);
  void end_exchange();
  void start_discarding();
  void discard_input();

  // ---- The watch read.
  void start_watch();
  void on_watch(beast::error_code ec, size_t n);

  // Constant after construction. core_ comes first so it is destroyed last:
  // the socket, timers and strand need its io_context.
  const std::shared_ptr<ServerCore> core_;
  const Strand strand_;
  tcp::socket socket_;
  Deadline read_deadline_;
  Deadline write_deadline_;
  const uint64_t id_;
  const Admission admission_;  // kOverflow: admitted beyond max_connections, one restricted request
  const ReadLimits limits_;

  // All below: used on strand_ only.
  ConnPhase phase_ = ConnPhase::kAccepted;  // changed by move_to() only
  ConnFate fate_ = ConnFate::kKeepAlive;    // changed by settle() only
  WatchState watch_ = WatchState::kNone;
  beast::flat_buffer buffer_;  // limited to core_->buffer_limit bytes
  std::optional<RequestParser> parser_;
  size_t request_bytes_ = 0;  // bytes of the current request the parser consumed
  bool read_timed_out_ = false;  // the read deadline passed mid-request: the read was cancelled, 408 follows
  std::string discard_buf_;
  std::chrono::steady_clock::time_point idle_since_{};  // since when idle: its accept, or its last exchange's end

  // The current exchange (kHandling, kWriting).
  unsigned version_ = 11;               // the request's HTTP version (11 = 1.1)
  bool head_ = false;                   // the request is a HEAD: its answers carry no body
  std::string allow_origin_;            // its Access-Control-Allow-Origin ("" = none: not a CORS request)
  std::shared_ptr<Exchange> exchange_;  // the handler's; null for the server's own answers
  OutQueue out_;
};

}  // namespace pd::router::detail
