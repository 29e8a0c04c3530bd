// The router behind its real HTTP server: a completion and /health over a
// loopback socket, so the server is known to be wired to Router::submit, and a
// stream whose client stops reading (http.max_write_buffer_bytes). Every other
// router test drives submit() directly (router_harness.h).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <unistd.h>

#include <future>

#include "router/router_harness.h"

namespace pd::router::test_router {
namespace {

// One HTTP exchange on its own connection ("Connection: close"): the raw
// response, read to EOF. Runs on its own thread while the test steps the router.
struct HttpResult {
  int status = 0;
  std::string raw;  // status line, headers, body (chunked as sent)
};
HttpResult http_exchange(uint16_t port, const std::string& method, const std::string& path, const std::string& body,
                         const std::string& content_type = "application/json") {
  HttpResult out;
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  ::inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  timeval tv{20, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return out;
  }
  const std::string req = method + " " + path + " HTTP/1.1\r\nHost: test\r\nContent-Type: " + content_type + "\r\n" +
                          "Content-Length: " + std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" + body;
  (void)!::write(fd, req.data(), req.size());
  char buf[4096];
  for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;) out.raw.append(buf, static_cast<size_t>(n));
  ::close(fd);
  if (out.raw.rfind("HTTP/1.1 ", 0) == 0) out.status = std::stoi(out.raw.substr(9, 3));
  return out;
}

HttpResult finish(Harness& h, std::future<HttpResult>& f, std::chrono::milliseconds within = 5000ms) {
  const auto end = h.env.now() + within;
  while (f.wait_for(0ms) != std::future_status::ready && h.env.now() < end) h.pump();
  REQUIRE(f.wait_for(0ms) == std::future_status::ready);
  return f.get();
}

TEST_CASE("router over HTTP: a completion is served through the socket, and /health answers", "[router]") {
  Harness h(150, 30000, /*http=*/true);
  const uint16_t port = h.router->port();
  REQUIRE(port != 0);
  auto f = std::async(std::launch::async, [port] { return http_exchange(port, "POST", "/v1/completions", kStreamBody); });
  auto d = h.dispatched(5000ms);
  REQUIRE(d);
  h.tokens(d->second.decode_rank, d->second.id, 1, 2, true);
  h.tokens(d->first, d->second.id, 0, 1, false);
  const HttpResult r = finish(h, f);
  CHECK(r.status == 200);
  CHECK(r.raw.find("text/event-stream") != std::string::npos);
  CHECK(r.raw.find("\"finish_reason\":\"length\"") != std::string::npos);
  CHECK(count(r.raw, "data: [DONE]") == 1);
  auto g = std::async(std::launch::async, [port] { return http_exchange(port, "GET", "/health", ""); });
  const HttpResult health = finish(h, g);
  CHECK(health.status == 200);
  CHECK(health.raw.find("\"status\":\"ok\"") != std::string::npos);
  CHECK(illegal_transitions() == 0);
}

TEST_CASE("router over HTTP: a JSON body sent as a browser form or text is a 415, not served", "[router]") {
  Harness h(150, 30000, /*http=*/true);
  const uint16_t port = h.router->port();
  REQUIRE(port != 0);
  for (const char* type : {"text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=b"}) {
    INFO(type);
    auto f = std::async(std::launch::async,
                        [port, type] { return http_exchange(port, "POST", "/v1/completions", kBody, type); });
    const HttpResult r = finish(h, f);
    CHECK(r.status == 415);
    CHECK(r.raw.find("\"param\":\"Content-Type\"") != std::string::npos);
  }
  CHECK(h.dispatched(20ms) == std::nullopt);
}

TEST_CASE("router over HTTP: a stream whose client stops reading is cut at http.max_write_buffer_bytes, cancelled once",
          "[router]") {
  Harness h(
      150, 30000, /*http=*/true,
      [](ClusterConfig& c) {
        c.http.max_write_buffer_bytes = 64 * 1024;
        c.http.read_timeout_ms = 600000;  // the cut, not the write deadline
      },
      [](ModelInfo& m) { m.context = 32768; });  // room for a stream far longer than the kernel's socket buffers
  h.total_blocks = 32768 / h.cfg.kv.block_size;  // and a decode pool that holds it
  h.pump_for(30ms);
  const uint16_t port = h.router->port();
  REQUIRE(port != 0);
  // A client with a small receive buffer that sends its request and never reads.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  const int rcvbuf = 4096;
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  ::inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  constexpr int kMaxTokens = 30000;
  const std::string body = R"({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": true,
                               "logprobs": true, "top_logprobs": 20, "max_tokens": )" + std::to_string(kMaxTokens) + "}";
  const std::string req = "POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                          "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  REQUIRE(::write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size()));
  auto d = h.dispatched(5000ms);
  REQUIRE(d);
  const proto::RequestId id = d->second.id;
  const int prefill = d->first, decode = d->second.decode_rank;
  // Tokens [first, first + n), each with 20 alternatives (about 1 KiB of event each).
  auto events = [&](int first, int n) {
    proto::TokenEvents te;
    proto::TokenEvent ev;
    ev.id = id;
    ev.first_index = first;
    for (int i = 0; i < n; ++i) {
      ev.tokens.push_back('a' + 3);
      LogprobEntry lp{'a' + 3, -0.5f, {}};
      for (int k = 0; k < 20; ++k) lp.top.push_back({'a' + 3 + k, -0.5f - static_cast<float>(k)});
      ev.logprobs.push_back(std::move(lp));
    }
    te.events.push_back(std::move(ev));
    return te;
  };
  h.hub.send(prefill, kRouterRank, events(0, 1));
  int sent = 1;
  while (sent < kMaxTokens - 100 && h.cancelled().count(id) == 0) {
    h.hub.send(decode, kRouterRank, events(sent, 100));
    sent += 100;
    h.pump_for(2ms);
  }
  INFO("tokens sent before the cut: " << sent);
  // Cut long before the end: the decode rank was told to drop the request (the
  // prefill rank's part ended with token 0).
  REQUIRE(h.cancelled().count(id) == 1);
  CHECK(sent < kMaxTokens / 2);
  int decode_told = 0;
  for (const proto::Message& m : h.inbox[decode])
    if (auto* c = std::get_if<proto::Cancel>(&m); c && c->id == id) ++decode_told;
  CHECK(decode_told == 1);
  // Tokens after the cut change nothing: the request ended once, cancelled.
  h.hub.send(decode, kRouterRank, events(sent, 100));
  h.hub.send(decode, kRouterRank, [&] {
    proto::TokenEvents te = events(sent + 100, 1);
    te.events.back().finish = proto::Finish::kLength;
    return te;
  }());
  h.pump_for(20ms);
  const std::string metrics = h.get("/metrics").body;
  CHECK(metrics.find("pd_requests_total{outcome=\"cancelled\"} 1") != std::string::npos);
  CHECK(metrics.find("pd_requests_total{outcome=\"finished\"} 1") == std::string::npos);
  CHECK(metrics.find("pd_requests_total{outcome=\"failed\"} 1") == std::string::npos);
  // The client's socket was closed by the server: what it can still read is a cut stream, no [DONE].
  std::string got;
  char buf[65536];
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;) got.append(buf, static_cast<size_t>(n));
  ::close(fd);
  CHECK(got.rfind("HTTP/1.1 200", 0) == 0);
  CHECK(got.find("data: [DONE]") == std::string::npos);
  CHECK(illegal_transitions() == 0);
}

}  // namespace
}  // namespace pd::router::test_router
