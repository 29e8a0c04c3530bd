// The router's HTTP/1.1 server (Boost.Beast over Asio): keep-alive, request
// size and time limits, a connection limit that keeps health checks answered,
// plain responses and Server-Sent Events, and prompt detection of clients that
// go away mid-response.
//
// Threading: `threads` io threads run one io_context; each connection is
// serialized on its own strand, and no connection ever blocks an io thread.
// The handler runs on an io thread and must not block: it validates, hands the
// request to the rest of the router, and answers later (from any thread) through
// the ResponseWriter it was given.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "util/status.h"

namespace pd::router {

// A slot holder reading a request that has received nothing for this long is
// an eviction candidate when every slot is taken (HttpServerConfig::max_connections).
inline constexpr std::chrono::milliseconds kStalledReadAfter{2000};

struct HttpServerConfig {
  std::string host = "127.0.0.1";
  uint16_t port = 8000;           // 0 = pick a free port (tests)
  int threads = 2;                // io_context threads (>= 1)
  size_t max_body_bytes = 1 << 20;  // larger bodies are answered 413 by the server itself
  // Deadline for reading one request (header and body), counted from the
  // moment the server starts waiting for it, so it also closes idle keep-alive
  // connections. A request that misses it is dropped without an answer.
  std::chrono::milliseconds read_timeout{30000};
  // A single write (a response, one SSE event) that makes no progress for this
  // long means the client stopped reading: the connection is closed and the
  // exchange's on_disconnect fires.
  std::chrono::milliseconds write_timeout{30000};
  // SSE events waiting behind the write in progress, in bytes (what the
  // socket took is not counted: each write takes every event waiting): a
  // client that reads slower than its events come makes them pile up here.
  // When an event takes them past this while the write in progress began
  // 100 ms ago or more (the socket took nothing since: not a mere burst of
  // events), the client is cut: the connection is closed (the stream ends
  // without its last chunk) and the exchange's on_disconnect fires, as when a
  // client leaves. A plain response is one write, never cut.
  size_t max_write_buffer_bytes = 4 << 20;

  // ---- Request size limits. Every byte of a request the parser consumes
  // counts: request line and header fields, chunk-size lines with their chunk
  // extensions, chunk data, trailers, Content-Length body.
  //
  // The request line and header fields together; past this the server answers
  // 431 and closes. The read buffer holds at most max(max_header_bytes, 64 KiB)
  // + 4 KiB unparsed bytes, so a single chunk-size line (with extensions) or a
  // trailer section longer than that is answered 413 as soon as the buffer is
  // full, however long the client keeps sending. Must be > 0.
  size_t max_header_bytes = 16 * 1024;
  // All the bytes of one request; past this the server answers 413 and closes.
  // 0 = max_body_bytes + max_header_bytes + 48 KiB (with the defaults:
  // max_body_bytes + 64 KiB). The check runs as the parser consumes, so memory
  // stays bounded by max_body_bytes plus the read buffer.
  size_t max_request_bytes = 0;

  // ---- Connection limits.
  //
  // A connection is admitted into one of max_connections slots (0 = unlimited:
  // no slots, no overflow, no ceiling). When every slot is taken:
  //  - If some slot holder is idle — nothing of a request has arrived on it:
  //    a connection that has not sent a byte yet, or a keep-alive connection
  //    between requests — or is reading a request and has received nothing
  //    for kStalledReadAfter (2 s), the one idle longest (since its last byte,
  //    its last answer, or its accept) is evicted and the new connection takes
  //    its slot. An idle one is closed at once (as its read deadline would),
  //    or, if bytes of a request reached it meanwhile, it answers that request
  //    with Connection: close and closes; part of a header does not count as
  //    arrived until the header is whole, so one idle for kStalledReadAfter
  //    with part of a header is closed at once. A stalled one is closed at
  //    once, its partial request dropped unanswered (as its read deadline would). A
  //    connection whose request is with the handler or being answered is never
  //    evicted (it closes after its answer if it loses its slot meanwhile).
  //  - Otherwise the new connection is an overflow connection, up to
  //    max_overflow_connections of them: it gets one request, read under a
  //    4 KiB header limit, an 8 KiB request limit and a 2 s deadline
  //    (min(read_timeout, 2 s)). A GET of a path in always_served_paths goes to
  //    the handler and is answered with Connection: close; anything else is
  //    answered by the server itself, right after the header: 503, JSON error
  //    body (type "service_unavailable"), Retry-After: 1, Connection: close.
  //    An overflow connection never gets a slot, even when one frees up.
  //  - Beyond max_connections + max_overflow_connections open connections, a
  //    newly accepted socket is closed at once, without an answer.
  size_t max_connections = 1024;
  size_t max_overflow_connections = 64;
  // Paths (without the query string) that a GET on an overflow connection may
  // still reach the handler with, so health checks work under connection floods.
  std::vector<std::string> always_served_paths = {"/health"};

  // ---- Cross-origin requests from browsers (CORS). Origins whose pages may
  // read this server's answers: each exactly as a browser sends it in Origin
  // ("https://app.example.com"), or "*" for any. Empty: none. A preflight
  // (OPTIONS with Origin and Access-Control-Request-Method) is answered by
  // the server itself: 204 with the Access-Control-Allow-* headers for an
  // allowed origin, 403 otherwise; every answer to a request from an allowed
  // origin carries Access-Control-Allow-Origin.
  std::vector<std::string> allowed_origins;
};

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  // The path, without the query string, normalized: the scheme and authority
  // of an absolute-form target dropped, percent-encoded unreserved characters
  // decoded, runs of '/' made one, a trailing '/' dropped ("/v1//models/" is
  // "/v1/models"). Other percent-escapes stay as sent.
  std::string target;
  std::string body;
  std::string authorization;  // raw Authorization header value ("" if none)
  std::string content_type;
  std::string content_encoding;  // "" if none
  std::string origin;            // the Origin header a browser sends ("" if none)
};

// One exchange's response side. Every method may be called from any thread
// (each posts onto the connection's strand, so calls made from one thread reach
// the client in the order they were made). Exactly one of respond() or
// start_sse() ... finish() is used per request. A method returns false, and
// does nothing, when it is out of turn (respond() or start_sse() after an
// answer began, send_event() or finish() without start_sse()), after the
// client went away, or after the server stopped.
//
// Lifetime: the writer keeps its connection alive. Dropping the last reference
// without answering answers 500 (or, mid-stream, closes the connection so the
// client sees an incomplete stream rather than a finished one).
class ResponseWriter {
 public:
  virtual ~ResponseWriter() = default;
  // A complete response with Content-Length. `status` is 200..599 (anything
  // else is sent as 500; 204 and 304 drop the body). `headers` are added as
  // given, except the framing ones (Content-Length, Transfer-Encoding) and any
  // with CR/LF; a "Connection: close" among them closes the connection after
  // the response.
  virtual bool respond(int status, std::string content_type, std::string body,
                       std::vector<std::pair<std::string, std::string>> headers = {}) = 0;
  // 200, Content-Type: text/event-stream, Cache-Control: no-cache, chunked.
  virtual bool start_sse() = 0;
  // Writes "data: " + data + "\n\n" as one chunk (events that wait for the
  // socket go out together, each its own chunk).
  virtual bool send_event(std::string data) = 0;
  // The final chunk; the connection is then reused if keep-alive allows.
  virtual bool finish() = 0;
  // `cb` is called at most once, on an io thread, if the client disconnects
  // (read EOF or error, a failed or timed-out write, or the server stopping)
  // before the handler gave its final answer (respond() or finish()). If the
  // client is already gone when cb is set, cb is posted at once. Set it before
  // start_sse(). During HttpServer::stop() it runs on the thread calling stop().
  virtual void on_disconnect(std::function<void()> cb) = 0;
};

using HttpHandler = std::function<void(HttpRequest, std::shared_ptr<ResponseWriter>)>;

namespace detail {
struct ServerCore;
}

// The server's life: created -> serving (start() succeeded) -> stopped (stop()).
// A stopped server does not start again; stop() before start() does nothing.
enum class HttpServerState { kCreated, kServing, kStopped };
const char* state_name(HttpServerState s);
bool legal(HttpServerState from, HttpServerState to);

// Pipelining: while an answer is pending, the server keeps reading so that it
// notices a client leaving. A client may send up to 64 KiB ahead; those
// requests are served in order after the pending one. Once more than that has
// arrived, everything sent ahead is discarded unread (complete requests among
// it are not served either), the pending answer carries Connection: close and
// the connection closes after it; the read goes on, discarding, so a client
// that leaves is still noticed (on_disconnect fires).
class HttpServer {
 public:
  explicit HttpServer(HttpServerConfig cfg);
  ~HttpServer();  // stop()s
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds, listens and starts the io threads; the handler is called for every
  // complete request within the limits. IoError naming host:port if the
  // address cannot be resolved or bound; InvalidArgument if already started.
  Status start(HttpHandler handler);
  // The bound port (the chosen one when the config said 0); 0 before start().
  uint16_t port() const { return port_; }
  // Closes the listening socket (a graceful stop): existing connections and
  // their exchanges continue. Returns once the socket is closed (or, called
  // from an io thread, once the close is queued).
  void stop_accepting();
  // Closes every connection (pending exchanges see on_disconnect), stops and
  // joins the io threads. Idempotent. Must not be called from an io thread
  // (that is, not from the handler or a disconnect callback).
  void stop();
  // Connections accepted and not yet closed (slot holders and overflow
  // connections; never more than max_connections + max_overflow_connections
  // when max_connections != 0).
  size_t open_connections() const;

 private:
  // Posts a close to every open connection; false if there was none.
  bool close_all_connections();

  HttpServerConfig cfg_;
  std::shared_ptr<detail::ServerCore> core_;  // shared with every connection; outlives them
  std::vector<std::thread> threads_;
  uint16_t port_ = 0;
  HttpServerState state_ = HttpServerState::kCreated;  // changed through transition() only
};

}  // namespace pd::router
