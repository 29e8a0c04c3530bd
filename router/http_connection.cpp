// One accepted socket of the HTTP server (see http_connection.h).
#include "router/http_connection.h"

#include <algorithm>
#include <cctype>
#include <exception>
#include <string_view>

#include "router/openai_api.h"
#include "util/lifecycle.h"

namespace pd::router::detail {
namespace {

// Limits of an overflow connection (admitted beyond max_connections).
constexpr size_t kOverflowHeaderBytes = 4 * 1024;
constexpr size_t kOverflowBodyBytes = 1024;
constexpr size_t kOverflowRequestBytes = 8 * 1024;
constexpr std::chrono::milliseconds kOverflowReadTimeout{2000};
// Retry-After of the 503 that an overflow connection gets.
constexpr const char* kOverflowRetryAfter = "1";

std::string to_std(beast::string_view s) { return std::string(s.data(), s.size()); }

HttpRequest to_http_request(http::request<http::string_body>& req) {
  HttpRequest r;
  r.method = to_std(req.method_string());
  r.target = normalized_path(req.target());
  r.authorization = to_std(req[http::field::authorization]);
  r.content_type = to_std(req[http::field::content_type]);
  r.content_encoding = to_std(req[http::field::content_encoding]);
  r.origin = to_std(req[http::field::origin]);
  r.body = std::move(req.body());
  return r;
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// RFC 3986's unreserved characters: a percent-escape of one means the character.
bool unreserved(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' || c == '_' || c == '~';
}

// RFC 3986 5.2.4 on a path whose '//' are already collapsed: "." segments
// dropped, ".." removing the one before (never above the root).
std::string without_dot_segments(const std::string& path) {
  if (path.empty() || path[0] != '/' || path.find("/.") == std::string::npos) return path;
  std::vector<std::string_view> kept;
  bool trailing = false;  // "/a/." and "/a/.." name a directory: "/a/" and "/"
  for (size_t start = 1; start <= path.size();) {
    const size_t slash = std::min(path.find('/', start), path.size());
    const std::string_view seg(path.data() + start, slash - start);
    trailing = seg == "." || seg == "..";
    if (seg == "..") {
      if (!kept.empty()) kept.pop_back();
    } else if (seg != ".") {
      kept.push_back(seg);
    }
    start = slash + 1;
  }
  std::string out;
  for (const std::string_view seg : kept) (out += '/') += seg;
  if (out.empty() || trailing) out += '/';
  return out;
}

}  // namespace

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

const char* state_name(ConnFate f) {
  switch (f) {
    case ConnFate::kKeepAlive: return "keep-alive";
    case ConnFate::kLastRequest: return "last-request";
    case ConnFate::kCloseAfterAnswer: return "close-after-answer";
    case ConnFate::kDiscardAhead: return "discard-ahead";
  }
  return "?";
}

bool legal(ConnFate from, ConnFate to) { return to > from; }

const char* state_name(WatchState s) { return s == WatchState::kNone ? "none" : "pending"; }

bool legal(WatchState from, WatchState to) { return from != to; }

ReadLimits read_limits_of(const ServerCore& core, Admission admission) {
  const HttpServerConfig& c = core.cfg;
  if (admission == Admission::kOverflow) {
    return {kOverflowHeaderBytes, kOverflowBodyBytes, kOverflowRequestBytes,
            std::min(c.read_timeout, kOverflowReadTimeout)};
  }
  return {c.max_header_bytes, c.max_body_bytes, core.request_limit, c.read_timeout};
}

std::optional<Refusal> refusal_of(beast::error_code ec, const ReadLimits& limits, size_t buffer_limit) {
  if (ec == http::error::body_limit) {
    return Refusal{413, "request body exceeds the limit of " + std::to_string(limits.body_bytes) + " bytes"};
  }
  if (ec == http::error::buffer_overflow) {
    // Only after the header (header_limit comes first): a chunk-size line with
    // its extensions, or the trailer section, did not fit in the buffer.
    return Refusal{413, "a chunk-size line or the trailer section of the request exceeds the limit of " +
                            std::to_string(buffer_limit) + " bytes"};
  }
  if (ec == http::error::header_limit) {
    return Refusal{431, "request header fields too large (limit " + std::to_string(limits.header_bytes) + " bytes)"};
  }
  // The peer left (or the deadline closed the socket): nobody to answer.
  // Input ended mid-request (a Content-Length longer than the body, then a
  // half-close): a client still reading learns why.
  if (ec == http::error::partial_message)
    return Refusal{400, "the request ended before it was complete (input closed before the whole header or body came)"};
  if (ec == http::error::end_of_stream || ec.category() != http::make_error_code(http::error::bad_method).category()) {
    return std::nullopt;
  }
  return Refusal{400, "malformed HTTP request: " + ec.message()};
}

Refusal overflow_refusal(size_t max_connections) {
  return Refusal{503, "the server is at its limit of " + std::to_string(max_connections) + " connections; retry later",
                 "service_unavailable", {{"Retry-After", kOverflowRetryAfter}}};
}

bool always_served(const http::request<http::string_body>& req, const std::vector<std::string>& paths) {
  if (req.method() != http::verb::get) return false;
  const std::string path = normalized_path(req.target());
  return std::any_of(paths.begin(), paths.end(), [&](const std::string& p) { return path == p; });
}

std::string normalized_path(beast::string_view target) {
  std::string_view t(target.data(), target.size());
  t = t.substr(0, t.find('?'));
  // The absolute form (RFC 9112 3.2.2: a server must accept it): the path after the authority.
  for (const std::string_view scheme : {std::string_view("http://"), std::string_view("https://")}) {
    if (t.size() >= scheme.size() && beast::iequals(beast::string_view(t.data(), scheme.size()), beast::string_view(scheme.data(), scheme.size()))) {
      const size_t slash = t.find('/', scheme.size());
      t = slash == std::string_view::npos ? std::string_view("/") : t.substr(slash);
      break;
    }
  }
  std::string out;
  out.reserve(t.size());
  for (size_t i = 0; i < t.size(); ++i) {
    char c = t[i];
    if (c == '%' && i + 2 < t.size() && hex_digit(t[i + 1]) >= 0 && hex_digit(t[i + 2]) >= 0) {
      const char decoded = static_cast<char>(hex_digit(t[i + 1]) * 16 + hex_digit(t[i + 2]));
      if (unreserved(decoded)) {
        c = decoded;
        i += 2;
      }
    }
    if (c == '/' && !out.empty() && out.back() == '/') continue;
    out += c;
  }
  out = without_dot_segments(out);
  if (out.size() > 1 && out.back() == '/') out.pop_back();
  return out;
}

std::optional<Refusal> host_refusal(const http::request_header<>& h) {
  // RFC 9112 3.2: an HTTP/1.1 request without Host, or with more than one, is a 400.
  if (h.version() < 11) return std::nullopt;
  const auto hosts = h.equal_range(http::field::host);
  const auto n = std::distance(hosts.first, hosts.second);
  if (n == 1) return std::nullopt;
  return Refusal{400, n == 0 ? "an HTTP/1.1 request needs a Host header field"
                             : "the request has " + std::to_string(n) + " Host header fields; it must have one"};
}

std::optional<Refusal> transfer_coding_refusal(const http::request_header<>& h) {
  std::string sent;
  std::vector<std::string> codings;
  for (const auto& f : h) {
    if (f.name() != http::field::transfer_encoding) continue;
    const std::string_view v(f.value().data(), f.value().size());
    sent += (sent.empty() ? "" : ", ") + std::string(v);
    for (size_t start = 0; start <= v.size();) {
      const size_t comma = std::min(v.find(',', start), v.size());
      std::string coding(v.substr(start, comma - start));
      coding.erase(0, coding.find_first_not_of(" \t"));
      coding.erase(coding.find_last_not_of(" \t") + 1);
      for (char& c : coding) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      if (!coding.empty()) codings.push_back(std::move(coding));
      start = comma + 1;
    }
  }
  if (sent.empty() && h.find(http::field::transfer_encoding) == h.end()) return std::nullopt;
  if (codings.size() == 1 && codings[0] == "chunked") return std::nullopt;
  if (!codings.empty() && codings.back() == "chunked") {
    return Refusal{501, "Transfer-Encoding '" + shown_text(sent) +
                            "' is not supported: a request body may be sent chunked, and coded no other way",
                   "invalid_request_error"};
  }
  return Refusal{400, "Transfer-Encoding '" + shown_text(sent) +
                          "' does not end in 'chunked': the request body's length cannot be known"};
}

std::string cors_allow_origin(const std::vector<std::string>& allowed, const std::string& origin) {
  if (origin.empty()) return "";
  for (const std::string& a : allowed) {
    if (a == "*") return "*";
    if (a == origin) return origin;
  }
  return "";
}

std::shared_ptr<Response> preflight_response(unsigned version, bool keep_alive, const std::string& origin,
                                             const std::string& allow_origin, const std::string& requested_headers) {
  if (allow_origin.empty()) {
    ApiError e;
    e.status = 403;
    e.message = "cross-origin requests from '" + shown_text(origin) +
                "' are not allowed by this server (http.allowed_origins)";
    e.type = "invalid_request_error";
    e.code = "origin_not_allowed";
    return make_response(version, keep_alive, 403, "application/json", error_body(e));
  }
  auto res = make_response(version, keep_alive, 204, "", "");
  set_cors(*res, allow_origin);
  res->set(http::field::access_control_allow_methods, "GET, HEAD, POST, OPTIONS");
  // The headers the page asked for (a browser lists them: token names and commas), or the API's own.
  const bool listed = !requested_headers.empty() &&
                      std::all_of(requested_headers.begin(), requested_headers.end(), [](char c) {
                        return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == ',' || c == ' ';
                      });
  res->set(http::field::access_control_allow_headers, listed ? requested_headers : "Authorization, Content-Type");
  res->set(http::field::access_control_max_age, "600");
  return res;
}

// ---- Connection: its life.

Connection::Connection(std::shared_ptr<ServerCore> core, tcp::socket socket, Strand strand, uint64_t id,
                       Admission admission)
    : core_(std::move(core)),
      strand_(std::move(strand)),
      socket_(std::move(socket)),
      read_deadline_(strand_),
      write_deadline_(strand_),
      id_(id),
      admission_(admission),
      limits_(read_limits_of(*core_, admission)),
      buffer_(core_->buffer_limit),
      out_(id, core_->cfg.max_write_buffer_bytes) {
  core_->open_connections.fetch_add(1);
  idle_since_ = std::chrono::steady_clock::now();  // accepted: idle, and listed so (ConnectionSlots::admit)
}

Connection::~Connection() {
  if (phase_ != ConnPhase::kClosed) core_->forget(id_);  // close() did it otherwise
}

void Connection::start() {
  if (core_->is_stopped()) return close();
  beast::error_code ec;
  socket_.set_option(tcp::no_delay(true), ec);  // SSE events go out as they are made
  start_read(/*after_exchange=*/false);
}

void Connection::evict(bool stalled) {
  if (phase_ == ConnPhase::kClosed) return;
  if (phase_ == ConnPhase::kAccepted) return close();  // evicted before it started: nothing read
  if (phase_ == ConnPhase::kIdle) {
    // (The parser may have consumed a request line while its header is incomplete.)
    const bool nothing = buffer_.size() == 0 && parser_ && !parser_->got_some();
    const std::string_view held(static_cast<const char*>(buffer_.data().data()), buffer_.size());
    const bool slow_header = std::chrono::steady_clock::now() - idle_since_ >= kStalledReadAfter &&
                             held.find("\r\n\r\n") == std::string_view::npos;
    if (nothing || stalled || slow_header) return close();
  }
  if (stalled && (phase_ == ConnPhase::kReadingHeader || phase_ == ConnPhase::kReadingBody)) return close();
  // In an exchange it closes after the answer; otherwise after the next one.
  settle(in_exchange(phase_) ? ConnFate::kCloseAfterAnswer : ConnFate::kLastRequest);
}

void Connection::close() {
  if (phase_ == ConnPhase::kClosed) return;
  if (exchange_) {
    if (in_exchange(phase_)) exchange_->client_gone();
    exchange_->bell().cancel();  // its wait holds this connection
  }
  move_to(ConnPhase::kClosed);
  read_deadline_.disarm();
  write_deadline_.disarm();
  beast::error_code ec;
  socket_.shutdown(tcp::socket::shutdown_both, ec);
  socket_.close(ec);
  out_.clear();  // a write in flight keeps its item until it completes: it may still refer to it
  core_->forget(id_);
}

void Connection::move_to(ConnPhase to) { transition(phase_, to, id_, "http connection"); }

void Connection::settle(ConnFate at_least) {
  if (fate_ < at_least) transition(fate_, at_least, id_, "http connection fate");
}

void Connection::arm(Deadline& d, std::chrono::milliseconds after) {
  const uint64_t gen = d.arm(after);
  d.timer().async_wait([self = shared_from_this(), &d, gen](beast::error_code ec) {
    if (!ec && d.live(gen)) self->on_deadline(d);
  });
}

void Connection::on_deadline(const Deadline& d) {
  // (Part of a header shows only in buffer_: the phase moves on once it is whole.)
  const bool mid_request = phase_ == ConnPhase::kReadingHeader || phase_ == ConnPhase::kReadingBody ||
                           (phase_ == ConnPhase::kIdle && buffer_.size() > 0);
  // No request in time on an idle connection, the client stopped reading, or
  // discarding ended: close.
  if (&d != &read_deadline_ || !mid_request) return close();
  // Part of a request came, not all of it: the read in progress is cancelled
  // and its completion answers 408, so a slow client learns why it was cut.
  read_timed_out_ = true;
  beast::error_code ec;
  socket_.cancel(ec);
}

// ---- Reading a request: async_read_some in a loop, so that every byte the
// parser consumes is counted against the request limit; one element the parser
// cannot consume yet (a header, a chunk-size line, the trailers) is bounded
// by the header limit or by the buffer's own limit.

// `after_exchange`: waiting for a keep-alive request, not the first one.
void Connection::start_read(bool after_exchange) {
  if (phase_ == ConnPhase::kClosed) return;
  if (after_exchange && fate_ == ConnFate::kLastRequest && buffer_.size() == 0) return close();
  parser_.emplace();
  head_ = false;
  parser_->header_limit(static_cast<std::uint32_t>(std::min<size_t>(limits_.header_bytes, UINT32_MAX)));
  parser_->body_limit(limits_.body_bytes);
  request_bytes_ = 0;
  arm(read_deadline_, limits_.timeout);
  // Nothing of the request yet (a new connection, or nothing sent ahead): idle
  // (a new connection since its accept).
  const bool idle = buffer_.size() == 0;
  if (idle && after_exchange) idle_since_ = std::chrono::steady_clock::now();
  move_to(idle ? ConnPhase::kIdle : ConnPhase::kReadingHeader);
  core_->list(id_, idle ? Listing::kIdle : Listing::kReading);
  read_some();
}

void Connection::read_some() {
  http::async_read_some(socket_, buffer_, *parser_,
                        [self = shared_from_this()](beast::error_code ec, size_t n) { self->on_read_some(ec, n); });
}

void Connection::on_read_some(beast::error_code ec, size_t n) {
  if (phase_ == ConnPhase::kIdle) move_to(ConnPhase::kReadingHeader);  // (part of) a request arrived, or the read ended
  if (phase_ == ConnPhase::kClosed) return;
  request_bytes_ += n;
  const unsigned version = parser_->is_header_done() ? parser_->get().version() : 11;
  if (read_timed_out_) {
    read_timed_out_ = false;
    return refuse(version, Refusal{408, "the request did not arrive within " +
                                            std::to_string(limits_.timeout.count()) +
                                            " ms (its header and body together; http.read_timeout_ms)"});
  }
  if (ec) {
    if (auto refusal = refusal_of(ec, limits_, core_->buffer_limit)) return refuse(version, std::move(*refusal));
    return close();
  }
  if (request_bytes_ > limits_.request_bytes) {
    return refuse(version, Refusal{413, "request exceeds the limit of " + std::to_string(limits_.request_bytes) +
                                            " bytes (header, chunk metadata, trailers and body together)"});
  }
  if (phase_ == ConnPhase::kReadingHeader && parser_->is_header_done()) {
    move_to(ConnPhase::kReadingBody);
    if (!on_header()) return;
  }
  if (parser_->is_done()) {
    read_deadline_.disarm();
    core_->list(id_, Listing::kNone);
    return dispatch();
  }
  core_->list(id_, Listing::kReading);  // bytes just came: the time since the last ones starts again
  read_some();
}

// The request's header just came in; false when it took the connection
// elsewhere (an answer, or "100 Continue") and reading must not go on here.
bool Connection::on_header() {
  parser_->eager(true);  // from here, parse as much of the body as each read brings
  const auto& req = parser_->get();
  head_ = req.method() == http::verb::head;
  if (admission_ == Admission::kOverflow && !always_served(req, core_->cfg.always_served_paths)) {
    refuse(req.version(), overflow_refusal(core_->cfg.max_connections));
    return false;
  }
  if (auto refusal = transfer_coding_refusal(req)) {
    refuse(req.version(), std::move(*refusal));
    return false;
  }
  if (auto refusal = host_refusal(req)) {
    refuse(req.version(), std::move(*refusal));
    return false;
  }
  // The client waits for this before sending the body (curl does for > 1 KiB).
  // An HTTP/1.0 client gets no 1xx answer: its expectation is ignored (RFC 9110 10.1.1).
  if (req.version() >= 11 && beast::iequals(req[http::field::expect], "100-continue") && !parser_->is_done()) {
    send_continue(req.version());
    return false;
  }
  return true;
}

void Connection::send_continue(unsigned version) {
  move_to(ConnPhase::kSendingContinue);
  core_->list(id_, Listing::kNone);  // the client waits for this answer: not stalled
  auto res = std::make_shared<http::response<http::empty_body>>(http::status::continue_, version);
  arm(write_deadline_, core_->cfg.write_timeout);
  http::async_write(socket_, *res, [self = shared_from_this(), res](beast::error_code ec, size_t) {
    self->write_deadline_.disarm();
    if (self->phase_ == ConnPhase::kClosed) return;
    if (ec) return self->close();
    self->move_to(ConnPhase::kReadingBody);
    self->core_->list(self->id_, Listing::kReading);
    self->read_some();
  });
}

// The server's own answer to a request it could not (or would not) read;
// closes afterwards.
void Connection::refuse(unsigned version, Refusal r) {
  read_deadline_.disarm();
  core_->list(id_, Listing::kNone);
  parser_.reset();
  settle(ConnFate::kCloseAfterAnswer);
  auto res = make_error_response(version, r.status, std::move(r.message), std::move(r.type));
  for (auto& [name, value] : r.headers) res->set(name, value);
  push({Outgoing::kResponse, std::move(res), nullptr, {}, /*final=*/true});  // -> kWriting
}

void Connection::dispatch() {
  http::request<http::string_body> req = parser_->release();
  parser_.reset();
  if (core_->is_stopped()) return close();
  HttpRequest r = to_http_request(req);
  version_ = req.version();
  // Without a slot, this is the connection's last request.
  const bool keep_alive = req.keep_alive() && admission_ != Admission::kOverflow && fate_ == ConnFate::kKeepAlive;
  if (!keep_alive) settle(ConnFate::kCloseAfterAnswer);
  allow_origin_ = cors_allow_origin(core_->cfg.allowed_origins, r.origin);
  if (req.method() == http::verb::options && !r.origin.empty() &&
      req.find(http::field::access_control_request_method) != req.end()) {
    // A browser's CORS preflight: the server's own answer, the handler never sees it.
    auto res = preflight_response(version_, keep_alive, r.origin, allow_origin_,
                                  to_std(req[http::field::access_control_request_headers]));
    allow_origin_.clear();  // set already (or refused)
    return push({Outgoing::kResponse, std::move(res), nullptr, {}, /*final=*/true});
  }
  move_to(ConnPhase::kHandling);
  exchange_ = std::make_shared<Exchange>(core_, strand_, id_);
  auto writer = std::make_shared<Writer>(exchange_, shared_from_this(), version_, keep_alive);
  serve_answers();  // waits for the handler's answers
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

// ---- The exchange: the handler's answers in the order given, written one at a time.

// Applies the answers queued, then, while the exchange still takes answers
// (kHandling), waits for the bell that says more came.
void Connection::serve_answers() {
  if (!take_answers()) return;
  exchange_->bell().async_wait([self = shared_from_this(), ex = exchange_](beast::error_code) {
    if (self->exchange_ == ex && self->phase_ == ConnPhase::kHandling) self->serve_answers();
  });
}

bool Connection::take_answers() {
  for (Answer& a : exchange_->take()) {
    if (phase_ != ConnPhase::kHandling) return false;  // the final answer went first, or the client left
    apply(std::move(a));
  }
  return phase_ == ConnPhase::kHandling;
}

void Connection::close_for_stop() {
  if (exchange_ && phase_ == ConnPhase::kHandling) take_answers();
  close();
}

void Connection::apply(Answer a) {
  switch (a.kind) {
    case Answer::Kind::kRespond:
      if (!allow_origin_.empty()) set_cors(*a.response, allow_origin_);
      if (a.close_after) settle(ConnFate::kCloseAfterAnswer);
      if (fate_ >= ConnFate::kCloseAfterAnswer) a.response->keep_alive(false);  // it closes after it: say so
      return push({Outgoing::kResponse, std::move(a.response), nullptr, {}, /*final=*/true});
    case Answer::Kind::kStartSse:
      if (version_ < 11) settle(ConnFate::kCloseAfterAnswer);  // HTTP/1.0: the stream ends with the connection
      return push({Outgoing::kSseHead, nullptr,
                   make_sse_head(version_, fate_ < ConnFate::kCloseAfterAnswer, allow_origin_)});
    case Answer::Kind::kEvent: return push({Outgoing::kChunk, nullptr, nullptr, std::move(a.data)});
    case Answer::Kind::kFinish: return push({Outgoing::kLastChunk, nullptr, nullptr, {}, /*final=*/true});
    case Answer::Kind::kDroppedMidStream:
      return close();  // no final chunk: the client must not take a cut stream for a finished one
    case Answer::Kind::kDroppedUnanswered:
      settle(ConnFate::kCloseAfterAnswer);
      return push({Outgoing::kResponse,
                   make_error_response(version_, 500, "the server dropped the request without answering",
                                       "server_error"),
                   nullptr, {}, /*final=*/true});
  }
}

void Connection::push(Outgoing item) {
  if (item.final) move_to(ConnPhase::kWriting);
  if (head_ && item.kind == Outgoing::kResponse) {
    // A HEAD request's answer: the header GET's would have (its Content-Length
    // too), no body — a body here would be read as the next answer's start.
    item.response->body().clear();
  }
  out_.push(std::move(item));
  pump();
  // The client reads slower than its events come: cut it, as if it had left
  // (close() reports the departure to the exchange).
  if (out_.behind(std::chrono::steady_clock::now())) close();
}

void Connection::pump() {
  if (phase_ == ConnPhase::kClosed || out_.in_flight() || out_.empty()) return;
  arm(write_deadline_, core_->cfg.write_timeout);
  Outgoing& item = *out_.begin_write(std::chrono::steady_clock::now(), /*chunked=*/version_ >= 11);
  auto done = [self = shared_from_this()](beast::error_code ec, size_t) { self->on_write(ec); };
  switch (item.kind) {
    case Outgoing::kResponse: http::async_write(socket_, *item.response, std::move(done)); break;
    case Outgoing::kSseHead: http::async_write_header(socket_, *item.head->sr, std::move(done)); break;
    case Outgoing::kChunk: net::async_write(socket_, net::buffer(item.data), std::move(done)); break;  // gathered
    case Outgoing::kLastChunk:
      if (version_ >= 11) {
        net::async_write(socket_, http::make_chunk_last(), std::move(done));
      } else {
        net::post(strand_, [done = std::move(done)]() mutable { done(beast::error_code(), 0); });
      }
      break;
  }
}

void Connection::on_write(beast::error_code ec) {
  write_deadline_.disarm();
  const bool final = out_.end_write();
  if (phase_ == ConnPhase::kClosed) return out_.clear();
  if (ec) return close();  // close() reports the departure to a pending exchange
  if (final) return end_exchange();
  pump();
}

// The final write went out (phase kWriting).
void Connection::end_exchange() {
  if (exchange_) exchange_->bell().cancel();
  exchange_.reset();
  if (fate_ >= ConnFate::kCloseAfterAnswer) return start_discarding();
  if (watch_ == WatchState::kPending) {
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
void Connection::start_discarding() {
  move_to(ConnPhase::kDiscarding);
  beast::error_code ec;
  socket_.shutdown(tcp::socket::shutdown_send, ec);
  if (ec) return close();
  arm(read_deadline_, std::min(core_->cfg.read_timeout, std::chrono::milliseconds(1000)));
  discard_input();
}

void Connection::discard_input() {
  if (watch_ == WatchState::kPending) return;  // its handler comes back here
  discard_buf_.resize(kWatchReadBytes);
  socket_.async_read_some(net::buffer(discard_buf_), [self = shared_from_this()](beast::error_code ec, size_t) {
    if (self->phase_ == ConnPhase::kClosed) return;
    if (ec) return self->close();
    self->discard_input();
  });
}

// ---- The watch read: kept outstanding during an exchange: EOF or an error
// means the client left; bytes it sends ahead are kept in buffer_ for the next
// request, up to kMaxPipelinedBytes. Past that they are all discarded, and so
// is whatever follows (read into discard_buf_), and the connection closes
// after the answer: the read never stops, so a departure is still noticed.

void Connection::start_watch() {
  if (watch_ == WatchState::kPending || phase_ == ConnPhase::kClosed) return;
  if (fate_ != ConnFate::kDiscardAhead && buffer_.size() >= kMaxPipelinedBytes) {
    settle(ConnFate::kDiscardAhead);  // the requests sent ahead are not served
    buffer_.consume(buffer_.size());
  }
  transition(watch_, WatchState::kPending, id_, "http watch read");
  if (fate_ == ConnFate::kDiscardAhead) {
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
void Connection::on_watch(beast::error_code ec, size_t n) {
  transition(watch_, WatchState::kNone, id_, "http watch read");
  if (n > 0) buffer_.commit(n);
  if (phase_ == ConnPhase::kClosed) return;
  if (in_exchange(phase_)) {
    // EOF: the client closed its sending side, or the whole socket; the two
    // look alike. Answers the handler has already given (health, models,
    // errors: those made at once) still go out — a client that half-closes
    // after its request (`nc -N`, some probes) gets them — and the connection
    // closes after them. An answer still being made is abandoned and its
    // request cancelled: the client is taken to be gone, as vLLM and nginx
    // take it.
    if (ec == net::error::eof && phase_ == ConnPhase::kHandling && exchange_) take_answers();
    if (ec == net::error::eof && phase_ == ConnPhase::kWriting) return settle(ConnFate::kCloseAfterAnswer);
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

}  // namespace pd::router::detail
