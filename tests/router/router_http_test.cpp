// The router behind its real HTTP server: a completion and /health over a
// loopback socket, so the server is known to be wired to Router::submit. Every
// other router test drives submit() directly (router_harness.h).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

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
HttpResult http_exchange(uint16_t port, const std::string& method, const std::string& path, const std::string& body) {
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
  const std::string req = method + " " + path + " HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n" +
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

}  // namespace
}  // namespace pd::router::test_router
