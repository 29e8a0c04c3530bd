// Tests of the HTTP server against a real client on loopback (Beast's
// synchronous client): plain responses, the body limit, SSE chunking,
// keep-alive, disconnect detection, malformed requests, time and size limits,
// connection limits and shutdown. Every wait is bounded: a blocked client read is cut by a watchdog
// that shuts the socket down, and every handshake with the handler has a
// timeout.
#include "router/http_server.h"

#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <future>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>

namespace pd::router {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using namespace std::chrono_literals;

constexpr auto kWait = 5s;

HttpServerConfig config_on(std::string host, uint16_t port) {
  HttpServerConfig cfg;
  cfg.host = std::move(host);
  cfg.port = port;
  return cfg;
}  // upper bound of any single wait (normally milliseconds)

// Requests the server handed to the handler, for the test thread to answer.
class Mailbox {
 public:
  void put(HttpRequest req, std::shared_ptr<ResponseWriter> w) {
    std::lock_guard lock(mu_);
    items_.emplace_back(std::move(req), std::move(w));
    cv_.notify_all();
  }
  std::optional<std::pair<HttpRequest, std::shared_ptr<ResponseWriter>>> take(std::chrono::milliseconds timeout = kWait) {
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return !items_.empty(); })) return std::nullopt;
    auto item = std::move(items_.front());
    items_.pop_front();
    return item;
  }
  size_t size() {
    std::lock_guard lock(mu_);
    return items_.size();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<HttpRequest, std::shared_ptr<ResponseWriter>>> items_;
};

// Shuts `sock` down (waking a blocked read with EOF) if not released within `limit`.
class Watchdog {
 public:
  Watchdog(tcp::socket& sock, std::chrono::milliseconds limit) {
    const int fd = sock.native_handle();
    thread_ = std::thread([this, fd, limit] {
      std::unique_lock lock(mu_);
      if (!cv_.wait_for(lock, limit, [&] { return done_; })) {
        fired_ = true;
        ::shutdown(fd, SHUT_RDWR);
      }
    });
  }
  ~Watchdog() {
    {
      std::lock_guard lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
    CHECK_FALSE(fired_);  // a read that needed the watchdog is a failure
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  bool fired_ = false;
  std::thread thread_;
};

class Client {
 public:
  explicit Client(uint16_t port) : sock_(ioc_) { sock_.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), port)); }

  void send_raw(const std::string& bytes) { net::write(sock_, net::buffer(bytes)); }
  void send(http::request<http::string_body> req) {
    req.set(http::field::host, "127.0.0.1");
    req.prepare_payload();
    http::write(sock_, req);
  }
  void post(const std::string& target, const std::string& body, bool keep_alive = true) {
    http::request<http::string_body> req{http::verb::post, target, 11};
    req.set(http::field::content_type, "application/json");
    req.body() = body;
    req.keep_alive(keep_alive);
    send(std::move(req));
  }
  http::response<http::string_body> read() {
    Watchdog dog(sock_, kWait);
    http::response<http::string_body> res;
    http::read(sock_, buf_, res);
    return res;
  }
  // True once the server closed the connection (EOF or reset) with nothing more to read.
  bool closed_by_server() {
    Watchdog dog(sock_, kWait);
    char c;
    beast::error_code ec;
    if (buf_.size() > 0) return false;
    sock_.read_some(net::buffer(&c, 1), ec);
    return ec == net::error::eof || ec == net::error::connection_reset;
  }
  tcp::socket& socket() { return sock_; }
  beast::flat_buffer& buffer() { return buf_; }
  void close() {
    beast::error_code ec;
    sock_.shutdown(tcp::socket::shutdown_both, ec);
    sock_.close(ec);
  }

 private:
  net::io_context ioc_;
  tcp::socket sock_;
  beast::flat_buffer buf_;
};

// A started server whose handler puts every request in `mailbox`.
struct Fixture {
  explicit Fixture(HttpServerConfig cfg = {}) : server(with_port0(std::move(cfg))) {
    const Status st = server.start([this](HttpRequest req, std::shared_ptr<ResponseWriter> w) {
      calls.fetch_add(1);
      mailbox.put(std::move(req), std::move(w));
    });
    REQUIRE(st.is_ok());
    REQUIRE(server.port() != 0);
  }
  ~Fixture() { server.stop(); }  // before the mailbox the handler writes to goes away
  static HttpServerConfig with_port0(HttpServerConfig cfg) {
    cfg.port = 0;
    return cfg;
  }
  // Waits (bounded) until the server counts `n` open connections.
  bool wait_open_connections(size_t n) {
    const auto until = std::chrono::steady_clock::now() + kWait;
    while (server.open_connections() != n) {
      if (std::chrono::steady_clock::now() > until) return false;
      std::this_thread::sleep_for(2ms);
    }
    return true;
  }
  HttpServer server;
  Mailbox mailbox;
  std::atomic<int> calls{0};
};

nlohmann::json error_of(const http::response<http::string_body>& res) {
  const nlohmann::json j = nlohmann::json::parse(res.body());
  REQUIRE(j.contains("error"));
  return j["error"];
}

// Sends `prefix`, then up to `total` bytes of `fill` in 16 KiB pieces, and
// stops as soon as the server answers (or resets the connection). Returns the
// bytes sent by then; nullopt if it never answered within `give_up` bytes.
std::optional<size_t> send_until_answered(Client& c, const std::string& prefix, char fill, size_t total,
                                          size_t give_up) {
  c.send_raw(prefix);
  const int fd = c.socket().native_handle();
  const std::string piece(16 * 1024, fill);
  size_t sent = prefix.size();
  for (size_t filled = 0; filled < total && sent < give_up;) {
    const ssize_t k = ::send(fd, piece.data(), std::min(piece.size(), total - filled), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return sent;  // reset
    if (k > 0) {
      sent += static_cast<size_t>(k);
      filled += static_cast<size_t>(k);
    }
    pollfd pfd{fd, POLLIN, 0};
    if (::poll(&pfd, 1, 20) > 0) return sent;
  }
  return std::nullopt;
}

TEST_CASE("http_server: a plain response from the handler", "[http_server]") {
  Fixture f;
  Client c(f.server.port());
  http::request<http::string_body> req{http::verb::post, "/v1/completions?debug=1", 11};
  req.set(http::field::authorization, "Bearer sk-test");
  req.set(http::field::content_type, "application/json");
  req.body() = R"({"prompt":"hi"})";
  c.send(req);

  auto got = f.mailbox.take();
  REQUIRE(got);
  auto& [r, w] = *got;
  CHECK(r.method == "POST");
  CHECK(r.target == "/v1/completions");  // without the query string
  CHECK(r.body == R"({"prompt":"hi"})");
  CHECK(r.authorization == "Bearer sk-test");
  CHECK(r.content_type == "application/json");
  CHECK(w->respond(201, "application/json", R"({"ok":true})", {{"X-Request-Id", "cmpl-1"}}));
  CHECK_FALSE(w->respond(200, "text/plain", "again"));  // only one answer per request
  CHECK_FALSE(w->start_sse());

  const auto res = c.read();
  CHECK(res.result_int() == 201);
  CHECK(res.body() == R"({"ok":true})");
  CHECK(res[http::field::content_type] == "application/json");
  CHECK(res[http::field::server] == "pdcluster");
  CHECK(res["X-Request-Id"] == "cmpl-1");
  CHECK(res[http::field::content_length] == "11");
  CHECK(res.keep_alive());
}

TEST_CASE("http_server: keep-alive serves several requests on one connection", "[http_server]") {
  Fixture f;
  Client c(f.server.port());
  for (int i = 0; i < 3; ++i) {
    http::request<http::string_body> req{http::verb::get, "/health/" + std::to_string(i), 11};
    c.send(req);
    auto got = f.mailbox.take();
    REQUIRE(got);
    CHECK(got->first.target == "/health/" + std::to_string(i));
    CHECK(got->first.method == "GET");
    got->second->respond(200, "text/plain", "ok " + std::to_string(i));
    const auto res = c.read();
    CHECK(res.result_int() == 200);
    CHECK(res.body() == "ok " + std::to_string(i));
  }
  CHECK(f.server.open_connections() == 1);

  // Pipelined: two requests sent before any answer, answered in order.
  c.send_raw("GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n");
  auto a = f.mailbox.take();
  REQUIRE(a);
  CHECK(a->first.target == "/a");
  a->second->respond(200, "text/plain", "A");
  auto b = f.mailbox.take();
  REQUIRE(b);
  CHECK(b->first.target == "/b");
  b->second->respond(200, "text/plain", "B");
  CHECK(c.read().body() == "A");
  CHECK(c.read().body() == "B");

  // Connection: close is honoured: answered, then closed.
  c.post("/last", "{}", /*keep_alive=*/false);
  auto last = f.mailbox.take();
  REQUIRE(last);
  last->second->respond(200, "text/plain", "bye");
  const auto res = c.read();
  CHECK(res.body() == "bye");
  CHECK_FALSE(res.keep_alive());
  CHECK(c.closed_by_server());
  c.close();
  CHECK(f.wait_open_connections(0));
}

TEST_CASE("http_server: an oversized body is answered 413 without calling the handler", "[http_server]") {
  HttpServerConfig cfg;
  cfg.max_body_bytes = 1024;
  Fixture f(cfg);
  {
    // The whole body is sent before the client reads.
    Client c(f.server.port());
    c.post("/v1/completions", std::string(64 * 1024, 'x'));
    const auto res = c.read();
    CHECK(res.result_int() == 413);
    CHECK(res[http::field::content_type] == "application/json");
    const auto err = error_of(res);
    CHECK(err["type"] == "invalid_request_error");
    CHECK(err["param"].is_null());
    CHECK(err["code"].is_null());
    CHECK_THAT(err["message"].get<std::string>(), Catch::Matchers::Contains("1024"));
    CHECK(c.closed_by_server());
  }
  {
    // A chunked body that grows past the limit.
    Client c(f.server.port());
    std::string chunk(800, 'y');
    c.send_raw("POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n");
    c.send_raw("320\r\n" + chunk + "\r\n320\r\n" + chunk + "\r\n0\r\n\r\n");
    CHECK(c.read().result_int() == 413);
  }
  {
    // Expect: 100-continue with a too-large Content-Length: refused before the body is sent.
    Client c(f.server.port());
    c.send_raw("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n");
    CHECK(c.read().result_int() == 413);
  }
  CHECK(f.calls.load() == 0);
  CHECK(f.mailbox.size() == 0);

  // A body at the limit is fine.
  Client ok(f.server.port());
  ok.post("/v1/completions", std::string(1024, 'z'));
  auto got = f.mailbox.take();
  REQUIRE(got);
  CHECK(got->first.body.size() == 1024);
  got->second->respond(200, "text/plain", "ok");
  CHECK(ok.read().result_int() == 200);
}

TEST_CASE("http_server: Expect 100-continue gets an interim answer, then the body is read", "[http_server]") {
  Fixture f;
  Client c(f.server.port());
  c.send_raw("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n");
  const auto interim = c.read();
  CHECK(interim.result_int() == 100);
  c.send_raw("hello");
  auto got = f.mailbox.take();
  REQUIRE(got);
  CHECK(got->first.body == "hello");
  got->second->respond(200, "text/plain", "done");
  CHECK(c.read().body() == "done");
}

TEST_CASE("http_server: SSE events arrive as chunks, then the connection is reused", "[http_server]") {
  Fixture f;
  Client c(f.server.port());
  c.post("/v1/chat/completions", R"({"stream":true})");
  auto got = f.mailbox.take();
  REQUIRE(got);
  std::shared_ptr<ResponseWriter> w = got->second;
  CHECK_FALSE(w->send_event("too early"));  // no stream started yet
  CHECK_FALSE(w->finish());

  // Answered from another thread, as the router's link does.
  std::thread producer([w] {
    CHECK(w->start_sse());
    CHECK(w->send_event(R"({"n":1})"));
    CHECK(w->send_event(R"({"n":2})"));
    CHECK(w->send_event("[DONE]"));
    CHECK(w->finish());
    CHECK_FALSE(w->send_event("after finish"));
    CHECK_FALSE(w->finish());
  });
  producer.join();

  http::response_parser<http::string_body> p;
  std::vector<uint64_t> chunk_sizes;
  auto on_chunk = [&](uint64_t size, beast::string_view, beast::error_code&) { chunk_sizes.push_back(size); };
  p.on_chunk_header(on_chunk);
  {
    Watchdog dog(c.socket(), kWait);
    http::read(c.socket(), c.buffer(), p);
  }
  const auto& res = p.get();
  CHECK(res.result_int() == 200);
  CHECK(res[http::field::content_type] == "text/event-stream; charset=utf-8");
  CHECK(res[http::field::cache_control] == "no-cache");
  CHECK(res[http::field::server] == "pdcluster");
  CHECK(res.chunked());
  CHECK(res.body() == "data: {\"n\":1}\n\ndata: {\"n\":2}\n\ndata: [DONE]\n\n");
  // One chunk per event, then the last (empty) chunk.
  CHECK(chunk_sizes == std::vector<uint64_t>{15, 15, 14, 0});

  // Keep-alive after a stream.
  c.send(http::request<http::string_body>{http::verb::get, "/v1/models", 11});
  auto next = f.mailbox.take();
  REQUIRE(next);
  next->second->respond(200, "application/json", "{}");
  CHECK(c.read().body() == "{}");
  CHECK(f.server.open_connections() == 1);
}

TEST_CASE("http_server: a client closing mid-stream fires on_disconnect within a second", "[http_server]") {
  Fixture f;
  Client c(f.server.port());
  c.post("/v1/completions", R"({"stream":true})");
  auto got = f.mailbox.take();
  REQUIRE(got);
  std::shared_ptr<ResponseWriter> w = got->second;
  std::promise<void> fired;
  std::atomic<int> times{0};
  w->on_disconnect([&] {
    if (times.fetch_add(1) == 0) fired.set_value();
  });
  REQUIRE(w->start_sse());
  REQUIRE(w->send_event("first"));
  {
    // The stream is running: read its header, then leave without a word.
    http::response_parser<http::string_body> p;
    Watchdog dog(c.socket(), kWait);
    http::read_header(c.socket(), c.buffer(), p);
    CHECK(p.get().result_int() == 200);
  }
  const auto t0 = std::chrono::steady_clock::now();
  c.close();  // nothing is being written now: the server must notice by reading
  REQUIRE(fired.get_future().wait_for(1s) == std::future_status::ready);
  INFO("noticed after " << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() << " s");
  CHECK_FALSE(w->send_event("nobody listens"));
  CHECK_FALSE(w->finish());
  CHECK(f.wait_open_connections(0));
  CHECK(times.load() == 1);
}

TEST_CASE("http_server: a client leaving before any answer fires on_disconnect, even if set late",
          "[http_server]") {
  Fixture f;
  std::shared_ptr<ResponseWriter> w;
  {
    Client c(f.server.port());
    c.post("/v1/completions", "{}");
    auto got = f.mailbox.take();
    REQUIRE(got);
    w = got->second;
    c.close();
  }
  REQUIRE(f.wait_open_connections(0));  // the departure was seen
  std::promise<void> fired;
  w->on_disconnect([&] { fired.set_value(); });  // set after the client left: still reported
  CHECK(fired.get_future().wait_for(1s) == std::future_status::ready);
  CHECK_FALSE(w->respond(200, "text/plain", "late"));
}

TEST_CASE("http_server: no on_disconnect once the answer was given", "[http_server]") {
  Fixture f;
  Client c(f.server.port());
  c.post("/v1/completions", "{}");
  auto got = f.mailbox.take();
  REQUIRE(got);
  std::atomic<bool> fired{false};
  got->second->on_disconnect([&] { fired = true; });
  got->second->respond(200, "text/plain", "ok");
  CHECK(c.read().body() == "ok");
  c.close();
  CHECK(f.wait_open_connections(0));
  CHECK_FALSE(fired.load());
}

// A server whose handler answers a GET of /now at once ("now") and hands every
// other request to the mailbox, for the test to answer later (or never).
struct MixedFixture {
  MixedFixture() : server(Fixture::with_port0({})) {
    REQUIRE(server
                .start([this](HttpRequest req, std::shared_ptr<ResponseWriter> w) {
                  if (req.target == "/now") {
                    w->respond(200, "text/plain", "now");
                    return;
                  }
                  mailbox.put(std::move(req), std::move(w));
                })
                .is_ok());
  }
  ~MixedFixture() { server.stop(); }
  HttpServer server;
  Mailbox mailbox;
};

TEST_CASE("http_server: a client that half-closes after its request gets an answer given at once, "
          "one still being made is cancelled",
          "[http_server]") {
  MixedFixture f;
  {
    Client c(f.server.port());
    c.send_raw("GET /now HTTP/1.1\r\nHost: x\r\n\r\n");
    c.socket().shutdown(tcp::socket::shutdown_send);  // nc -N, some health probes
    auto res = c.read();
    CHECK(res.result_int() == 200);
    CHECK(res.body() == "now");
    CHECK(c.closed_by_server());
  }
  {
    Client c(f.server.port());
    c.send_raw("POST /later HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}");
    auto got = f.mailbox.take();
    REQUIRE(got);
    std::promise<void> fired;
    got->second->on_disconnect([&] { fired.set_value(); });
    c.socket().shutdown(tcp::socket::shutdown_send);
    REQUIRE(fired.get_future().wait_for(1s) == std::future_status::ready);  // taken for gone: cancelled
    CHECK_FALSE(got->second->respond(200, "text/plain", "late"));
    CHECK(c.closed_by_server());
  }
}

TEST_CASE("http_server: a HEAD request is answered with GET's header and no body", "[http_server]") {
  MixedFixture f;
  Client c(f.server.port());
  // Two requests back to back: a body after the first header would be read as
  // the start of the second answer.
  c.send_raw("HEAD /now HTTP/1.1\r\nHost: x\r\n\r\nGET /now HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  std::string got;
  {
    Watchdog dog(c.socket(), kWait);
    beast::error_code ec;
    char buf[4096];
    for (;;) {
      const size_t n = c.socket().read_some(net::buffer(buf), ec);
      if (ec) break;
      got.append(buf, n);
    }
  }
  const size_t head_end = got.find("\r\n\r\n");
  REQUIRE(head_end != std::string::npos);
  const std::string head = got.substr(0, head_end + 4);
  CHECK(head.rfind("HTTP/1.1 200 ", 0) == 0);
  CHECK(head.find("Content-Length: 3\r\n") != std::string::npos);
  const std::string rest = got.substr(head_end + 4);
  CHECK(rest.rfind("HTTP/1.1 200 ", 0) == 0);  // the second answer follows the first header at once
  CHECK(rest.size() >= 3);
  CHECK(rest.substr(rest.size() - 3) == "now");
}

TEST_CASE("http_server: malformed requests get 400 and a close", "[http_server]") {
  Fixture f;
  for (const std::string& raw : {std::string("THIS IS NOT HTTP\r\n\r\n"),
                                std::string("GET / HTTP/1.1\r\nHost x\r\n\r\n"),
                                std::string("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n"),
                                std::string("GET / HTTP/9.9\r\n\r\n")}) {
    INFO(raw);
    Client c(f.server.port());
    c.send_raw(raw);
    const auto res = c.read();
    CHECK(res.result_int() == 400);
    CHECK(error_of(res)["type"] == "invalid_request_error");
    CHECK_FALSE(res.keep_alive());
    CHECK(c.closed_by_server());
  }
  CHECK(f.calls.load() == 0);
}

TEST_CASE("http_server: a dropped writer or a throwing handler is answered 500", "[http_server]") {
  HttpServer server(config_on("127.0.0.1", 0));
  REQUIRE(server
              .start([](HttpRequest req, std::shared_ptr<ResponseWriter> w) {
                if (req.target == "/throw") throw std::runtime_error("boom");
                w.reset();  // dropped without an answer
              })
              .is_ok());
  Client c(server.port());
  c.send(http::request<http::string_body>{http::verb::get, "/drop", 11});
  auto res = c.read();
  CHECK(res.result_int() == 500);
  CHECK(error_of(res)["type"] == "server_error");

  Client t(server.port());
  t.send(http::request<http::string_body>{http::verb::get, "/throw", 11});
  res = t.read();
  CHECK(res.result_int() == 500);
  CHECK_THAT(error_of(res)["message"].get<std::string>(), Catch::Matchers::Contains("boom"));
}

TEST_CASE("http_server: status codes outside 2xx..5xx are sent as 500, 204 has no body", "[http_server]") {
  Fixture f;
  Client c(f.server.port());
  c.send(http::request<http::string_body>{http::verb::get, "/a", 11});
  auto got = f.mailbox.take();
  REQUIRE(got);
  got->second->respond(204, "text/plain", "dropped");
  auto res = c.read();
  CHECK(res.result_int() == 204);
  CHECK(res.body().empty());
  c.send(http::request<http::string_body>{http::verb::get, "/b", 11});
  got = f.mailbox.take();
  REQUIRE(got);
  got->second->respond(42, "text/plain", "odd", {{"Bad\r\nHeader", "x"}, {"X-Ok", "a\r\nInjected: 1"}});
  res = c.read();
  CHECK(res.result_int() == 500);
  CHECK(res.body() == "odd");
  CHECK(res.find("Injected") == res.end());
  CHECK(res.find("X-Ok") == res.end());  // a value with CR/LF is dropped, not sent
}

TEST_CASE("http_server: after read_timeout an idle connection is closed, one mid-request answered 408",
          "[http_server]") {
  HttpServerConfig cfg;
  cfg.read_timeout = 200ms;
  Fixture f(cfg);
  {
    Client idle(f.server.port());  // sends nothing
    const auto t0 = std::chrono::steady_clock::now();
    CHECK(idle.closed_by_server());
    CHECK(std::chrono::steady_clock::now() - t0 < 3s);
  }
  for (const std::string& part : {std::string("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n12345"),
                                  std::string("GET /health HTTP/1.1\r\nHo")}) {  // and stalls
    INFO(part);
    Client c(f.server.port());
    c.send_raw(part);
    const auto t0 = std::chrono::steady_clock::now();
    const auto res = c.read();
    CHECK(res.result_int() == 408);
    CHECK_THAT(error_of(res)["message"].get<std::string>(), Catch::Matchers::Contains("http.read_timeout_ms"));
    CHECK_FALSE(res.keep_alive());
    CHECK(c.closed_by_server());
    CHECK(std::chrono::steady_clock::now() - t0 < 3s);
  }
  CHECK(f.calls.load() == 0);
}

TEST_CASE("http_server: input that ends mid-request is answered 400", "[http_server]") {
  Fixture f;
  Client c(f.server.port());
  c.send_raw("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n12345");
  c.socket().shutdown(tcp::socket::shutdown_send);  // the Content-Length was a lie
  const auto res = c.read();
  CHECK(res.result_int() == 400);
  CHECK_THAT(error_of(res)["message"].get<std::string>(), Catch::Matchers::Contains("ended before"));
  CHECK(f.calls.load() == 0);
}

TEST_CASE("http_server: a Transfer-Encoding other than chunked is refused and the connection closed, "
          "its body never read as a request",
          "[http_server]") {
  Fixture f;
  const std::string smuggled = "GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n";
  struct Case {
    std::string fields;
    unsigned status;
  };
  for (const Case& k : {Case{"Transfer-Encoding: gzip\r\n", 400}, Case{"Transfer-Encoding: identity\r\n", 400},
                        Case{"Transfer-Encoding: chunked, gzip\r\n", 400},
                        Case{"Transfer-Encoding: gzip\r\nContent-Length: " + std::to_string(smuggled.size()) + "\r\n", 400},
                        Case{"Transfer-Encoding: gzip, chunked\r\n", 501},
                        Case{"Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n", 501}}) {
    INFO(k.fields);
    Client c(f.server.port());
    c.send_raw("POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + k.fields + "\r\n" + smuggled);
    const auto res = c.read();
    CHECK(res.result_int() == k.status);
    CHECK_THAT(error_of(res)["message"].get<std::string>(), Catch::Matchers::Contains("Transfer-Encoding"));
    CHECK_FALSE(res.keep_alive());
    CHECK(c.closed_by_server());  // nothing more: /smuggled is never answered
  }
  CHECK(f.calls.load() == 0);
  // Chunked alone (any case) is read as before.
  Client ok(f.server.port());
  ok.send_raw("POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: Chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n");
  auto got = f.mailbox.take();
  REQUIRE(got);
  CHECK(got->first.body == "hi");
  got->second->respond(200, "text/plain", "ok");
  CHECK(ok.read().result_int() == 200);
}

TEST_CASE("http_server: an HTTP/1.1 request without one Host field is refused 400, an HTTP/1.0 one needs none",
          "[http_server]") {
  Fixture f;
  for (const std::string fields : {"", "Host: a\r\nHost: b\r\n"}) {
    INFO(fields);
    Client c(f.server.port());
    c.send_raw("GET /v1/models HTTP/1.1\r\n" + fields + "\r\n");
    const auto res = c.read();
    CHECK(res.result_int() == 400);
    CHECK_THAT(error_of(res)["message"].get<std::string>(), Catch::Matchers::Contains("Host"));
  }
  CHECK(f.calls.load() == 0);
  Client old(f.server.port());
  old.send_raw("GET /v1/models HTTP/1.0\r\n\r\n");
  auto got = f.mailbox.take();
  REQUIRE(got);
  got->second->respond(200, "text/plain", "ok");
  CHECK(old.read().result_int() == 200);
}

TEST_CASE("http_server: an HTTP/1.0 request's Expect 100-continue gets no interim answer", "[http_server]") {
  Fixture f;
  Client c(f.server.port());
  c.send_raw("POST /v1/completions HTTP/1.0\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n");
  std::this_thread::sleep_for(50ms);
  c.send_raw("hello");
  auto got = f.mailbox.take();
  REQUIRE(got);
  CHECK(got->first.body == "hello");
  got->second->respond(200, "text/plain", "done");
  const auto res = c.read();  // the first answer is the final one
  CHECK(res.result_int() == 200);
  CHECK(res.body() == "done");
}

TEST_CASE("http_server: the handler gets the target's path normalized (absolute form, '//', a trailing '/', dot segments)",
          "[http_server]") {
  Fixture f;
  for (const auto& [target, path] :
       {std::pair{"http://127.0.0.1:8000/v1/models?x=1", "/v1/models"}, std::pair{"HTTPS://h/v1/models", "/v1/models"},
        std::pair{"http://h", "/"}, std::pair{"/v1//chat/completions/", "/v1/chat/completions"},
        std::pair{"/v1/m%6Fdels", "/v1/models"}, std::pair{"/v1/models/org%2Fname", "/v1/models/org%2Fname"},
        std::pair{"/", "/"}, std::pair{"/v1/../v1/models", "/v1/models"}, std::pair{"/v1/./models/.", "/v1/models"},
        std::pair{"/../../v1/%2E%2E/v1/models", "/v1/models"}, std::pair{"/v1/.well/..x", "/v1/.well/..x"}}) {
    INFO(target);
    Client c(f.server.port());
    c.send_raw(std::string("GET ") + target + " HTTP/1.1\r\nHost: x\r\n\r\n");
    auto got = f.mailbox.take();
    REQUIRE(got);
    CHECK(got->first.target == path);
    got->second->respond(200, "text/plain", "ok");
    CHECK(c.read().result_int() == 200);
  }
}

TEST_CASE("http_server: CORS: preflights answered by the server, answers to allowed origins marked",
          "[http_server]") {
  HttpServerConfig cfg;
  cfg.allowed_origins = {"https://app.example"};
  Fixture f(cfg);
  auto preflight = [&](const std::string& origin) {
    Client c(f.server.port());
    c.send_raw("OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nOrigin: " + origin +
               "\r\nAccess-Control-Request-Method: POST\r\n"
               "Access-Control-Request-Headers: authorization, content-type\r\n\r\n");
    return c.read();
  };
  const auto yes = preflight("https://app.example");
  CHECK(yes.result_int() == 204);
  CHECK(yes[http::field::access_control_allow_origin] == "https://app.example");
  CHECK(yes[http::field::access_control_allow_headers] == "authorization, content-type");
  CHECK_THAT(std::string(yes[http::field::access_control_allow_methods]), Catch::Matchers::Contains("POST"));
  CHECK(yes[http::field::vary] == "Origin");
  const auto no = preflight("https://evil.example");
  CHECK(no.result_int() == 403);
  CHECK(error_of(no)["code"] == "origin_not_allowed");
  CHECK(no.find(http::field::access_control_allow_origin) == no.end());
  CHECK(f.calls.load() == 0);  // the handler never sees a preflight
  // A response and an event stream to the allowed origin carry the header; to another, not.
  for (const auto& [origin, marked] : {std::pair{"https://app.example", true}, std::pair{"https://evil.example", false}}) {
    INFO(origin);
    Client c(f.server.port());
    c.send_raw(std::string("GET /v1/models HTTP/1.1\r\nHost: x\r\nOrigin: ") + origin + "\r\n\r\n");
    auto got = f.mailbox.take();
    REQUIRE(got);
    CHECK(got->first.origin == origin);
    got->second->respond(200, "application/json", "{}");
    const auto res = c.read();
    CHECK((res.find(http::field::access_control_allow_origin) != res.end()) == marked);
    c.send_raw(std::string("POST /v1/completions HTTP/1.1\r\nHost: x\r\nOrigin: ") + origin +
               "\r\nContent-Length: 2\r\n\r\n{}");
    auto stream = f.mailbox.take();
    REQUIRE(stream);
    stream->second->start_sse();
    stream->second->finish();
    http::response_parser<http::string_body> p;
    Watchdog dog(c.socket(), kWait);
    http::read(c.socket(), c.buffer(), p);
    CHECK((p.get().find(http::field::access_control_allow_origin) != p.get().end()) == marked);
  }
}

TEST_CASE("http_server: stop fires on_disconnect for pending exchanges and is idempotent", "[http_server]") {
  auto f = std::make_unique<Fixture>();
  Client c(f->server.port());
  c.post("/v1/completions", "{}");
  auto got = f->mailbox.take();
  REQUIRE(got);
  std::atomic<int> fired{0};
  got->second->on_disconnect([&] { fired.fetch_add(1); });
  REQUIRE(got->second->start_sse());
  f->server.stop();
  CHECK(fired.load() == 1);
  CHECK(f->server.open_connections() == 0);
  CHECK_FALSE(got->second->send_event("after stop"));
  f->server.stop();
  f.reset();  // the writer outlives the server safely
  CHECK_FALSE(got->second->finish());
  got->second.reset();
}

TEST_CASE("http_server: an answer given just before stop still reaches its client", "[http_server]") {
  // The router's stop: the last request's answer is given, then the server
  // stops at once. The answer waits behind its bell on the connection's
  // strand; the stop writes it before it closes. Repeated: it is a race.
  for (int i = 0; i < 20; ++i) {
    auto f = std::make_unique<Fixture>();
    Client c(f->server.port());
    c.post("/v1/completions", "{}");
    auto got = f->mailbox.take();
    REQUIRE(got);
    REQUIRE(got->second->respond(200, "application/json", R"({"last":true})"));
    f->server.stop();
    const auto res = c.read();
    CHECK(res.result_int() == 200);
    CHECK(res.body() == R"({"last":true})");
  }
}

TEST_CASE("http_server: bind failure names host:port, stop_accepting refuses new clients", "[http_server]") {
  Fixture f;
  HttpServer second(config_on("127.0.0.1", f.server.port()));
  const Status st = second.start([](HttpRequest, std::shared_ptr<ResponseWriter>) {});
  REQUIRE_FALSE(st.is_ok());
  CHECK(st.is_io_error());
  CHECK_THAT(st.message(), Catch::Matchers::Contains("127.0.0.1:" + std::to_string(f.server.port())));

  HttpServer bad_host(config_on("no-such-host.invalid", 0));
  CHECK_FALSE(bad_host.start([](HttpRequest, std::shared_ptr<ResponseWriter>) {}).is_ok());

  // An open connection keeps working after stop_accepting; new ones are refused.
  Client c(f.server.port());
  REQUIRE(f.wait_open_connections(1));
  f.server.stop_accepting();
  net::io_context ioc;
  tcp::socket s(ioc);
  beast::error_code ec;
  s.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), f.server.port()), ec);
  CHECK(ec == net::error::connection_refused);
  c.post("/v1/completions", "{}");
  auto got = f.mailbox.take();
  REQUIRE(got);
  got->second->respond(200, "text/plain", "still here");
  CHECK(c.read().body() == "still here");
}


TEST_CASE("http_server: an endless chunk extension line is answered 413 after a bounded read", "[http_server]") {
  Fixture f;  // default limits: the read buffer holds 68 KiB
  Client c(f.server.port());
  // One chunk-size line "1;aaaa..." of 32 MiB, sent in pieces: the server must
  // give up once its buffer is full, not hold the line until the read timeout.
  const auto sent = send_until_answered(
      c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1;", 'a', size_t{32} << 20,
      /*give_up=*/size_t{1} << 20);
  REQUIRE(sent);
  INFO("answered after " << *sent << " bytes");
  CHECK(*sent <= 512 * 1024);
  const auto res = c.read();
  CHECK(res.result_int() == 413);
  CHECK_THAT(error_of(res)["message"].get<std::string>(), Catch::Matchers::Contains("chunk-size line"));
  CHECK_FALSE(res.keep_alive());
  CHECK(c.closed_by_server());
  CHECK(f.calls.load() == 0);
}

TEST_CASE("http_server: a huge trailer section is answered 413 after a bounded read", "[http_server]") {
  Fixture f;
  Client c(f.server.port());
  const auto sent = send_until_answered(c,
                                        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                                        "5\r\nhello\r\n0\r\nX-Trailer: ",
                                        'b', size_t{32} << 20, /*give_up=*/size_t{1} << 20);
  REQUIRE(sent);
  CHECK(*sent <= 512 * 1024);
  CHECK(c.read().result_int() == 413);
  CHECK(f.calls.load() == 0);
}

TEST_CASE("http_server: a field longer than Beast can store is refused, not thrown", "[http_server]") {
  // Beast keeps field lengths in 16 bits and throws past them, out of the read
  // and the io thread (it ended the process). A trailer field of 66,000 bytes
  // fits the read buffer, and a header limit above 64 KiB lets a header field
  // through: both must get an answer, and the server must keep serving.
  HttpServerConfig cfg;
  cfg.max_header_bytes = 256 * 1024;
  cfg.max_body_bytes = 1 << 20;
  Fixture f(cfg);
  {
    Client c(f.server.port());
    c.send_raw("POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
               "5\r\nhello\r\n0\r\nX-Trailer: " + std::string(66000, 't') + "\r\n\r\n");
    CHECK(c.read().result_int() == 431);
  }
  {
    Client c(f.server.port());
    c.send_raw("GET /x HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(70000, 'h') + "\r\n\r\n");
    CHECK(c.read().result_int() == 431);
  }
  Client c(f.server.port());
  c.post("/v1/completions", "{}");
  auto got = f.mailbox.take();
  REQUIRE(got);
  got->second->respond(200, "text/plain", "ok");
  CHECK(c.read().result_int() == 200);
}

TEST_CASE("http_server: chunk metadata counts toward max_request_bytes", "[http_server]") {
  HttpServerConfig cfg;
  cfg.max_body_bytes = 1024;  // max_request_bytes 0: 1024 + 16 KiB + 48 KiB = 66560
  Fixture f(cfg);
  {
    // 1000 one-byte chunks (a body within max_body_bytes), each with a 100-byte
    // extension: 113 KB in all.
    Client c(f.server.port());
    std::string req = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
    for (int i = 0; i < 1000; ++i) req += "1;e=" + std::string(100, 'a') + "\r\nx\r\n";
    req += "0\r\n\r\n";
    c.send_raw(req);
    const auto res = c.read();
    CHECK(res.result_int() == 413);
    CHECK_THAT(error_of(res)["message"].get<std::string>(), Catch::Matchers::Contains("66560"));
    CHECK(c.closed_by_server());
  }
  {
    // An explicit limit counts the header and the body together.
    HttpServerConfig small;
    small.max_request_bytes = 4096;
    Fixture g(small);
    Client c(g.server.port());
    c.post("/v1/completions", std::string(5000, 'x'));  // within max_body_bytes
    const auto res = c.read();
    CHECK(res.result_int() == 413);
    CHECK_THAT(error_of(res)["message"].get<std::string>(), Catch::Matchers::Contains("4096"));
    CHECK(g.calls.load() == 0);
  }
  CHECK(f.calls.load() == 0);
}

TEST_CASE("http_server: header fields are limited by max_header_bytes (431)", "[http_server]") {
  Fixture f;  // 16 KiB
  {
    Client c(f.server.port());
    c.send_raw("GET /a HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(12 * 1024, 'h') + "\r\n\r\n");
    auto got = f.mailbox.take();
    REQUIRE(got);  // above Beast's own 8 KiB default, within the configured limit
    got->second->respond(200, "text/plain", "ok");
    CHECK(c.read().result_int() == 200);
  }
  Client c(f.server.port());
  c.send_raw("GET /b HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(20 * 1024, 'h') + "\r\n\r\n");
  const auto res = c.read();
  CHECK(res.result_int() == 431);
  CHECK_THAT(error_of(res)["message"].get<std::string>(), Catch::Matchers::Contains("16384"));
  CHECK(c.closed_by_server());
  CHECK(f.calls.load() == 1);
}

TEST_CASE("http_server: a chunked request with extensions and trailers within the limits is served",
          "[http_server]") {
  Fixture f;
  Client c(f.server.port());
  c.send_raw(
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nTrailer: X-Sum\r\n\r\n"
      "5;name=value;flag\r\nhello\r\n1\r\n \r\n5;q=\"quoted\"\r\nworld\r\n0\r\nX-Sum: 11\r\n\r\n");
  auto got = f.mailbox.take();
  REQUIRE(got);
  CHECK(got->first.body == "hello world");
  got->second->respond(200, "text/plain", "ok");
  const auto res = c.read();
  CHECK(res.result_int() == 200);
  CHECK(res.keep_alive());
  // The connection is reused for a second, plain chunked request.
  c.send_raw("POST /again HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n");
  got = f.mailbox.take();
  REQUIRE(got);
  CHECK(got->first.body == "abc");
  got->second->respond(200, "text/plain", "ok");
  CHECK(c.read().result_int() == 200);
}

TEST_CASE("http_server: beyond max_connections /health is served, the rest gets 503, the ceiling holds",
          "[http_server]") {
  HttpServerConfig cfg;
  cfg.max_connections = 8;  // max_overflow_connections 64: at most 72 open
  Fixture f(cfg);
  // Eight slot holders whose requests the handler holds: busy, so none can be evicted.
  std::vector<std::unique_ptr<Client>> busy;
  std::vector<std::shared_ptr<ResponseWriter>> held;
  for (int i = 0; i < 8; ++i) {
    busy.push_back(std::make_unique<Client>(f.server.port()));
    busy.back()->post("/v1/held", "{}");
    auto got = f.mailbox.take();
    REQUIRE(got);
    held.push_back(got->second);
  }
  REQUIRE(f.wait_open_connections(8));

  {
    // A health check still reaches the handler; answered with Connection: close.
    Client h(f.server.port());
    h.send(http::request<http::string_body>{http::verb::get, "/health?verbose=1", 11});
    auto got = f.mailbox.take();
    REQUIRE(got);
    CHECK(got->first.target == "/health");
    got->second->respond(200, "application/json", R"({"status":"ok"})");
    const auto res = h.read();
    CHECK(res.result_int() == 200);
    CHECK_FALSE(res.keep_alive());
    CHECK(h.closed_by_server());
  }
  for (const auto& raw : {std::string("POST /v1/x HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"),
                          std::string("GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"),
                          std::string("POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")}) {
    INFO(raw);
    Client p(f.server.port());
    p.send_raw(raw);
    const auto res = p.read();
    CHECK(res.result_int() == 503);
    CHECK(res["Retry-After"] == "1");
    CHECK(error_of(res)["type"] == "service_unavailable");
    CHECK_THAT(error_of(res)["message"].get<std::string>(), Catch::Matchers::Contains("8"));
    CHECK_FALSE(res.keep_alive());
    CHECK(p.closed_by_server());
  }
  CHECK(f.calls.load() == 9);

  // A flood: the server never holds more than 8 + 64 sockets.
  std::atomic<bool> flooding{true};
  std::atomic<size_t> most{0};
  std::thread sampler([&] {
    while (flooding.load()) {
      const size_t n = f.server.open_connections();
      if (n > most.load()) most = n;
      std::this_thread::sleep_for(200us);
    }
  });
  std::vector<std::unique_ptr<Client>> flood;
  for (int i = 0; i < 100; ++i) flood.push_back(std::make_unique<Client>(f.server.port()));
  std::this_thread::sleep_for(300ms);
  flooding = false;
  sampler.join();
  CHECK(most.load() <= 72);
  CHECK(most.load() >= 8);
  // The overflow connections that send nothing are dropped after 2 s; the 8
  // busy slot holders stay.
  const auto until = std::chrono::steady_clock::now() + 5s;
  while (f.server.open_connections() > 8 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(10ms);
  CHECK(f.server.open_connections() == 8);
  flood.clear();
  busy.clear();
  CHECK(f.wait_open_connections(0));
  held.clear();

  // With the slots free again, any request is served.
  Client c(f.server.port());
  c.post("/v1/x", "{}");
  auto got = f.mailbox.take();
  REQUIRE(got);
  got->second->respond(200, "text/plain", "ok");
  const auto res = c.read();
  CHECK(res.result_int() == 200);
  CHECK(res.keep_alive());
}

TEST_CASE("http_server: at max_connections the longest idle keep-alive connection makes room", "[http_server]") {
  HttpServerConfig cfg;
  cfg.max_connections = 2;
  Fixture f(cfg);
  auto serve = [&](Client& c, const std::string& target) {
    c.post(target, "{}");
    auto got = f.mailbox.take();
    REQUIRE(got);
    CHECK(got->first.target == target);
    got->second->respond(200, "text/plain", "ok");
    const auto res = c.read();
    CHECK(res.result_int() == 200);
    return res.keep_alive();
  };
  // The server lists a connection as idle once its answer is written, which can
  // come after the client has read it: give it a moment, so the order is a, b.
  Client a(f.server.port());
  CHECK(serve(a, "/a"));  // a, then b: idle keep-alive connections holding both slots
  std::this_thread::sleep_for(200ms);
  Client b(f.server.port());
  CHECK(serve(b, "/b"));
  std::this_thread::sleep_for(200ms);
  Client c(f.server.port());
  CHECK(serve(c, "/c"));  // not 503: a made room
  CHECK(a.closed_by_server());
  CHECK(serve(b, "/b2"));  // b kept its slot
  CHECK(f.wait_open_connections(2));
}

TEST_CASE("http_server: a client that sends more than 64 KiB ahead and leaves is still noticed", "[http_server]") {
  Fixture f;
  {
    Client c(f.server.port());
    c.post("/v1/completions", "{}");
    auto got = f.mailbox.take();
    REQUIRE(got);
    std::promise<void> fired;
    got->second->on_disconnect([&] { fired.set_value(); });  // the handler never answers
    c.send_raw(std::string(100 * 1024, 'j'));
    c.close();
    CHECK(fired.get_future().wait_for(2s) == std::future_status::ready);
    CHECK(f.wait_open_connections(0));
  }
  {
    // Answered: with Connection: close, and the requests sent ahead are not served.
    Client c(f.server.port());
    c.post("/v1/completions", "{}");
    auto got = f.mailbox.take();
    REQUIRE(got);
    std::string ahead;
    while (ahead.size() < 100 * 1024) ahead += "GET /ahead HTTP/1.1\r\nHost: x\r\n\r\n";
    c.send_raw(ahead);
    std::this_thread::sleep_for(300ms);  // the server reads it all meanwhile
    got->second->respond(200, "text/plain", "ok");
    const auto res = c.read();
    CHECK(res.result_int() == 200);
    CHECK_FALSE(res.keep_alive());
    CHECK(c.closed_by_server());
    CHECK(f.calls.load() == 2);
  }
}

// A TCP connection to the server on loopback that sends nothing: its fd, or -1.
int connect_silent(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  ::inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Whether the server closed `fd` (EOF or reset) within `within`.
bool closed_within(int fd, std::chrono::milliseconds within) {
  pollfd pfd{fd, POLLIN, 0};
  if (::poll(&pfd, 1, static_cast<int>(within.count())) <= 0) return false;
  char c;
  const ssize_t k = ::recv(fd, &c, 1, MSG_DONTWAIT);
  return k == 0 || (k < 0 && errno == ECONNRESET);
}

TEST_CASE("http_server: at max_connections connections that never sent a byte make room, oldest first",
          "[http_server]") {
  HttpServerConfig cfg;
  cfg.max_connections = 16;  // + 64 overflow places: 300 silent sockets are far beyond both
  Fixture f(cfg);
  std::atomic<bool> flooding{true};
  std::atomic<size_t> most{0};
  std::thread sampler([&] {
    while (flooding.load()) {
      const size_t n = f.server.open_connections();
      if (n > most.load()) most = n;
      std::this_thread::sleep_for(200us);
    }
  });
  std::vector<int> silent;
  for (int i = 0; i < 300; ++i) {
    const int fd = connect_silent(f.server.port());
    REQUIRE(fd >= 0);
    silent.push_back(fd);
  }
  // Each newcomer takes the slot of the connection idle longest (accepted
  // first), which is closed: the server settles at its 16 slot holders.
  const auto settle = std::chrono::steady_clock::now() + 1s;
  while (f.server.open_connections() > 16 && std::chrono::steady_clock::now() < settle) {
    std::this_thread::sleep_for(5ms);
  }
  // A new client is served at once, holding a slot (keep-alive), not as an overflow connection.
  const auto t0 = std::chrono::steady_clock::now();
  Client h(f.server.port());
  h.send(http::request<http::string_body>{http::verb::get, "/health", 11});
  auto got = f.mailbox.take(2000ms);
  REQUIRE(got);
  CHECK(got->first.target == "/health");
  got->second->respond(200, "application/json", R"({"status":"ok"})");
  const auto res = h.read();
  CHECK(res.result_int() == 200);
  CHECK(res.keep_alive());
  CHECK(std::chrono::steady_clock::now() - t0 < 2s);
  flooding = false;
  sampler.join();
  CHECK(most.load() <= 16 + 64);
  // Oldest first: the first silent sockets were closed; the last 15 still hold slots (h took the 16th).
  CHECK(closed_within(silent.front(), 2000ms));
  for (size_t i = silent.size() - 15; i < silent.size(); ++i) {
    INFO("silent socket " << i << " of " << silent.size());
    CHECK_FALSE(closed_within(silent[i], 0ms));
  }
  CHECK(f.wait_open_connections(16));
  for (int fd : silent) ::close(fd);
  CHECK(f.wait_open_connections(1));  // h
}

TEST_CASE("http_server: at max_connections a connection silent mid-request for kStalledReadAfter makes room",
          "[http_server]") {
  HttpServerConfig cfg;
  cfg.max_connections = 2;
  Fixture f(cfg);
  Client k(f.server.port());  // a slot holder whose request the handler holds: never evicted
  k.post("/v1/k", "{}");
  auto held = f.mailbox.take();
  REQUIRE(held);
  Client a(f.server.port());
  a.send_raw("POST /v1/a HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{\"x\"");  // part of a body
  std::this_thread::sleep_for(200ms);
  {
    // a has not been silent that long: a newcomer gets an overflow place (503 but for /health).
    Client o(f.server.port());
    o.post("/v1/o", "{}");
    CHECK(o.read().result_int() == 503);
  }
  // The server times silence from when it read a byte, which a loaded
  // machine (CI's sanitizer run) delays: a margin past the limit.
  constexpr auto kMargin = 600ms;
  std::this_thread::sleep_for(kStalledReadAfter + kMargin);
  Client c(f.server.port());
  c.post("/v1/c", "{}");
  auto got = f.mailbox.take();
  REQUIRE(got);
  CHECK(got->first.target == "/v1/c");
  got->second->respond(200, "text/plain", "ok");
  auto res = c.read();
  CHECK(res.result_int() == 200);
  CHECK(res.keep_alive());
  CHECK(a.closed_by_server());  // its request dropped unanswered

  // Part of a header shows only once the header is whole: a connection that
  // sent part of one and nothing for kStalledReadAfter is closed when evicted.
  Client s(f.server.port());  // takes idle c's slot
  CHECK(c.closed_by_server());
  s.send_raw("GET /v1/s HTTP/1.1\r\nHo");
  std::this_thread::sleep_for(kStalledReadAfter + kMargin);
  Client t(f.server.port());
  t.post("/v1/t", "{}");
  got = f.mailbox.take();
  REQUIRE(got);
  CHECK(got->first.target == "/v1/t");
  got->second->respond(200, "text/plain", "ok");
  res = t.read();
  CHECK(res.result_int() == 200);
  CHECK(res.keep_alive());
  CHECK(s.closed_by_server());
  held->second->respond(200, "text/plain", "ok");
  CHECK(k.read().result_int() == 200);
  CHECK(f.calls.load() == 3);
}

TEST_CASE("http_server: a stream whose client falls behind by max_write_buffer_bytes is cut, on_disconnect fires once",
          "[http_server]") {
  HttpServerConfig cfg;
  cfg.max_write_buffer_bytes = 64 * 1024;
  cfg.write_timeout = 60s;  // the cut, not the write deadline
  Fixture f(cfg);
  Client c(f.server.port());  // never reads the stream
  c.post("/v1/completions", R"({"stream":true})");
  auto got = f.mailbox.take();
  REQUIRE(got);
  std::shared_ptr<ResponseWriter> w = got->second;
  std::promise<void> fired;
  std::atomic<int> times{0};
  w->on_disconnect([&] {
    if (times.fetch_add(1) == 0) fired.set_value();
  });
  REQUIRE(w->start_sse());
  // The kernel's socket buffers take a few MiB first (loopback autotuning);
  // then the events wait in the server, until the cut (over 64 KiB waiting
  // behind a write that began 100 ms ago).
  const std::string event(16 * 1024, 'e');
  constexpr size_t kGiveUp = size_t{64} << 20;
  size_t sent = 0;
  for (int i = 0; sent < kGiveUp && w->send_event(event); ++i) {
    sent += event.size();
    if (i % 4 == 3) std::this_thread::sleep_for(1ms);  // at most 64 MiB/s
  }
  REQUIRE(fired.get_future().wait_for(2s) == std::future_status::ready);
  INFO("sent " << sent << " bytes of events before the cut");
  CHECK(sent < kGiveUp);
  CHECK_FALSE(w->send_event(event));
  CHECK_FALSE(w->finish());
  CHECK(f.wait_open_connections(0));
  CHECK(times.load() == 1);
}

}  // namespace
}  // namespace pd::router
