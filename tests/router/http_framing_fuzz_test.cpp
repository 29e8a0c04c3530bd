// A raw-socket framing fuzzer for the HTTP server: a seeded generator makes a
// few hundred odd or malformed requests (bad chunk sizes, chunk extensions,
// huge and tiny chunks, trailers, pipelining, half-close, slow clients,
// oversized headers and bodies, Content-Length / Transfer-Encoding conflicts,
// cut requests, garbage) and sends each over plain POSIX sockets. The server
// must survive (ASan/UBSan watch its memory), never answer anything but
// well-formed responses with a status below 500, and end every connection:
// afterwards no connection is left open and a valid request is still served.
// Every socket has send and receive timeouts, so nothing can hang.
#include "router/http_server.h"

#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

namespace pd::router {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
using namespace std::chrono_literals;
using namespace std::string_literals;
using Rng = std::mt19937_64;

constexpr uint64_t kSeed = 0x5eed'f00d'2024ULL;
constexpr int kCases = 360;
// PD_FUZZ_CASES / PD_FUZZ_FIRST run another range of cases (longer runs by hand).
int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != 0 ? std::atoi(v) : fallback;
}
constexpr int kWorkers = 4;  // client threads (they mostly wait on sockets)

size_t pick(Rng& r, size_t n) { return static_cast<size_t>(r() % n); }
bool chance(Rng& r, int percent) { return static_cast<int>(r() % 100) < percent; }

std::string hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string random_bytes(Rng& r, size_t n) {
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(r() & 0xff);
  return s;
}

std::string random_token(Rng& r, size_t n) {
  static const char kChars[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.";
  std::string s;
  for (size_t i = 0; i < n; ++i) s += kChars[pick(r, sizeof kChars - 1)];
  return s;
}

std::string start_line(Rng& r, const std::string& method) {
  static const char* kTargets[] = {"/echo", "/sse", "/health", "/v1/completions?x=1", "/", "*", "/a%20b"};
  return method + " " + kTargets[pick(r, std::size(kTargets))] + (chance(r, 90) ? " HTTP/1.1\r\n" : " HTTP/1.0\r\n");
}

std::string chunk_ext(Rng& r) {
  switch (pick(r, 5)) {
    case 0: return "";
    case 1: return ";" + random_token(r, 1 + pick(r, 8));
    case 2: return ";" + random_token(r, 3) + "=" + random_token(r, 1 + pick(r, 20));
    case 3: return ";q=\"" + random_token(r, pick(r, 12)) + "\"";
    default: return ";" + std::string(1 + pick(r, 3000), 'e');  // long, maybe past the limits
  }
}

// A chunked body of random chunks (sizes from tiny to large), maybe with trailers.
std::string chunked_body(Rng& r, std::string* payload) {
  std::string out;
  const size_t n = pick(r, 4) == 0 ? 50 + pick(r, 400) : pick(r, 6);
  for (size_t i = 0; i < n; ++i) {
    const size_t size = chance(r, 80) ? 1 + pick(r, 16) : 1 + pick(r, 24 * 1024);
    const std::string data(size, static_cast<char>('a' + pick(r, 26)));
    out += (chance(r, 20) ? std::string("000") : std::string()) + hex(size) + chunk_ext(r) + "\r\n" + data + "\r\n";
    *payload += data;
  }
  out += "0" + (chance(r, 20) ? chunk_ext(r) : std::string()) + "\r\n";
  if (chance(r, 30)) out += "X-Trailer: " + random_token(r, 1 + pick(r, 40)) + "\r\n";
  if (chance(r, 5)) out += "X-Huge-Trailer: " + std::string(8000 + pick(r, 80000), 't') + "\r\n";
  out += "\r\n";
  return out;
}

// A request the server should accept (given the limits), framed at random.
std::string valid_request(Rng& r) {
  static const char* kMethods[] = {"GET", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"};
  std::string req = start_line(r, kMethods[pick(r, std::size(kMethods))]);
  req += "Host: x\r\n";
  if (chance(r, 30)) req += "X-Pad: " + random_token(r, pick(r, 200)) + "\r\n";
  if (chance(r, 10)) req += "Connection: close\r\n";
  switch (pick(r, 3)) {
    case 0: return req + "\r\n";
    case 1: {
      const std::string body = random_token(r, pick(r, 300));
      return req + "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
    }
    default: {
      std::string payload;
      return req + "Transfer-Encoding: chunked\r\n\r\n" + chunked_body(r, &payload);
    }
  }
}

std::string chunked_head(Rng& r) { return start_line(r, "POST") + "Host: x\r\nTransfer-Encoding: chunked\r\n\r\n"; }

// One malformed or odd request.
std::string odd_request(Rng& r) {
  switch (pick(r, 16)) {
    case 0:  // chunk size that overflows 64 bits
      return chunked_head(r) + std::string(17 + pick(r, 10), "fF"[pick(r, 2)]) + "\r\nabc\r\n0\r\n\r\n";
    case 1:  // negative, non-hex or empty chunk size, or blanks around it
      return chunked_head(r) + std::vector<std::string>{"-5", "zz", "", " 5", "5 ", "0x5", "+5"}[pick(r, 7)] +
             "\r\nhello\r\n0\r\n\r\n";
    case 2:  // chunk data not followed by CRLF, or bare LF line endings
      return chunked_head(r) + std::vector<std::string>{"5\r\nhelloXX0\r\n\r\n", "5\nhello\n0\n\n",
                                                        "5\r\nhello\r0\r\n\r\n", "5\r\nhel"}[pick(r, 4)];
    case 3:  // a chunk far larger than the body limit, little data
      return chunked_head(r) + hex(1ULL << (20 + pick(r, 40))) + "\r\n" + random_token(r, pick(r, 100));
    case 4: {  // Content-Length and Transfer-Encoding together, in either order
      std::string payload;
      const std::string body = chunked_body(r, &payload);
      const std::string cl = "Content-Length: " + std::to_string(pick(r, 2) ? body.size() : pick(r, 10)) + "\r\n";
      const std::string te = "Transfer-Encoding: chunked\r\n";
      return start_line(r, "POST") + "Host: x\r\n" + (chance(r, 50) ? cl + te : te + cl) + "\r\n" + body;
    }
    case 5: {  // odd Transfer-Encoding lists
      static const char* kTe[] = {"gzip, chunked", "chunked, gzip", "identity", "chunked, chunked", "CHUNKED",
                                  "chunked;q=1", "x", ""};
      std::string payload;
      return start_line(r, "POST") + "Host: x\r\nTransfer-Encoding: " + kTe[pick(r, std::size(kTe))] + "\r\n\r\n" +
             chunked_body(r, &payload);
    }
    case 6: {  // conflicting, repeated or odd Content-Length values
      static const char* kCl[] = {"5\r\nContent-Length: 6", "5\r\nContent-Length: 5", "5, 5", "-1",
                                  "18446744073709551616", "99999999999999999999999", " 5", "0x5", ""};
      return start_line(r, "POST") + "Host: x\r\nContent-Length: " + kCl[pick(r, std::size(kCl))] + "\r\n\r\nhello";
    }
    case 7: {  // header fields larger than the limit
      return start_line(r, "GET") + "Host: x\r\nX-Big: " + std::string(3000 + pick(r, 12000), 'h') + "\r\n\r\n";
    }
    case 8: {  // a body larger than the limit
      const size_t n = 16 * 1024 + 1 + pick(r, 100 * 1024);
      return start_line(r, "POST") + "Host: x\r\nContent-Length: " + std::to_string(n) + "\r\n\r\n" +
             std::string(n, 'b');
    }
    case 9:  // many tiny chunks with extensions
    {
      std::string s = chunked_head(r);
      const size_t n = 100 + pick(r, 1500);
      for (size_t i = 0; i < n; ++i) s += "1;e=" + random_token(r, 1 + pick(r, 60)) + "\r\nx\r\n";
      return s + "0\r\n\r\n";
    }
    case 10: {  // header syntax oddities
      static const std::string kOdd[] = {
          "GET / HTTP/1.1\r\nHost: x\r\n folded: value\r\n\r\n"s, "GET / HTTP/1.1\r\nHost x\r\n\r\n"s,
          "GET / HTTP/1.1\r\nHost : x\r\n\r\n"s, "GET / HTTP/1.1\nHost: x\n\n"s, "GET / HTTP/2.0\r\nHost: x\r\n\r\n"s,
          "GET  /  HTTP/1.1\r\n\r\n"s, " GET / HTTP/1.1\r\n\r\n"s, "GET http://a/b HTTP/1.1\r\nHost: x\r\n\r\n"s,
          "\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n"s, "GET / HTTP/1.1\r\nX: a\0b\r\n\r\n"s,
          "G\x01T / HTTP/1.1\r\n\r\n"s, "GET /\x7f HTTP/1.1\r\n\r\n"s, "GET / HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n"s};
      return kOdd[pick(r, std::size(kOdd))];
    }
    case 11:  // Expect: 100-continue with and without the body following
      return start_line(r, "POST") + "Host: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n" +
             (chance(r, 70) ? "hello" : "");
    case 12:  // an endless chunk extension
      return chunked_head(r) + "1;" + std::string(70 * 1024 + pick(r, 60 * 1024), 'a');
    case 13:  // garbage
      return random_bytes(r, 1 + pick(r, 4000));
    case 14: {  // a valid request with bytes flipped
      std::string s = valid_request(r);
      for (int i = 0, n = 1 + static_cast<int>(pick(r, 4)); i < n && !s.empty(); ++i) {
        s[pick(r, s.size())] = static_cast<char>(r() & 0xff);
      }
      return s;
    }
    default: {  // a valid request with a random piece inserted
      std::string s = valid_request(r);
      s.insert(pick(r, s.size() + 1), chance(r, 50) ? "\r\n" : random_bytes(r, 1 + pick(r, 8)));
      return s;
    }
  }
}

enum class Ending { kHalfClose, kReadThenClose, kAbort };

struct FuzzCase {
  std::string bytes;
  bool dribble = false;  // sent in pieces with small sleeps
  Ending ending = Ending::kHalfClose;
};

FuzzCase make_case(uint64_t index) {
  Rng r(kSeed ^ (index * 0x9e3779b97f4a7c15ULL));
  FuzzCase c;
  const size_t parts = pick(r, 10) < 3 ? 2 + pick(r, 3) : 1;  // pipelined back to back
  for (size_t i = 0; i < parts; ++i) c.bytes += chance(r, 35) ? valid_request(r) : odd_request(r);
  if (chance(r, 15)) c.bytes.resize(pick(r, c.bytes.size() + 1));  // cut at a random point
  c.dribble = chance(r, 15) && c.bytes.size() < 64 * 1024;
  const size_t e = pick(r, 100);
  c.ending = e < 70 ? Ending::kHalfClose : e < 90 ? Ending::kReadThenClose : Ending::kAbort;
  return c;
}

int connect_to(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  timeval tv{2, 0};  // every blocking send or receive is bounded
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Sends what it can; false once the server closed or reset the connection.
bool send_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

// Reads until EOF, a reset, or `idle` without data (0: wait for EOF, bounded
// by SO_RCVTIMEO). `eof`: the server ended the connection.
std::string read_answers(int fd, std::chrono::milliseconds idle, bool* eof) {
  std::string got;
  char buf[16 * 1024];
  *eof = false;
  const auto give_up = std::chrono::steady_clock::now() + 5s;
  while (std::chrono::steady_clock::now() < give_up) {
    if (idle.count() > 0) {
      pollfd pfd{fd, POLLIN, 0};
      if (::poll(&pfd, 1, static_cast<int>(idle.count())) <= 0) return got;
    }
    const ssize_t k = ::recv(fd, buf, sizeof buf, 0);
    if (k > 0) {
      got.append(buf, static_cast<size_t>(k));
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    *eof = k == 0 || errno == ECONNRESET || errno == EPIPE;
    return got;
  }
  return got;
}

// Checks that `bytes` is a sequence of well-formed responses with statuses
// below 500 — or 501, the answer to a transfer coding the server does not
// decode (RFC 9112 6.1), which says nothing failed; the last may be cut short (the connection ended). "" if fine.
// Each complete answer's status is added to `statuses`.
std::string check_answers(const std::string& bytes, std::map<int, int>* statuses) {
  size_t off = 0;
  while (off < bytes.size()) {
    const std::string_view rest(bytes.data() + off, bytes.size() - off);
    const size_t eol = rest.find("\r\n");
    const std::string_view line = rest.substr(0, eol);
    if (eol == std::string_view::npos) {
      // A status line cut short: what there is of it must fit.
      const size_t n = std::min<size_t>(rest.size(), 7);
      if (rest.substr(0, n) != std::string_view("HTTP/1.").substr(0, n)) {
        return "not a status line: " + std::string(line.substr(0, 40));
      }
      return "";
    }
    if (line.size() < 12 || (line.substr(0, 9) != "HTTP/1.1 " && line.substr(0, 9) != "HTTP/1.0 ") ||
        (line.size() > 12 && line[12] != ' ') || line[9] < '1' || line[9] > '5' || line[10] < '0' ||
        line[10] > '9' || line[11] < '0' || line[11] > '9') {
      return "not a status line: " + std::string(line.substr(0, 40));
    }
    if (line[9] == '5' && line.substr(9, 3) != "501") return "a 5xx answer: " + std::string(line);
    http::response_parser<http::string_body> p;
    p.eager(true);
    p.body_limit(boost::none);
    beast::error_code ec;
    const size_t used = p.put(boost::asio::buffer(rest.data(), rest.size()), ec);
    if (ec == http::error::need_more || (!ec && !p.is_done())) return "";  // cut short
    if (ec) return "malformed response (" + ec.message() + "): " + std::string(line);
    ++(*statuses)[p.get().result_int()];
    off += used;
  }
  return "";
}

// Runs one case; "" if the server behaved.
std::string run_case(uint16_t port, const FuzzCase& c, std::map<int, int>* statuses) {
  const int fd = connect_to(port);
  if (fd < 0) return "cannot connect";
  bool open = true;
  if (c.dribble) {
    Rng r(c.bytes.size());
    size_t off = 0;
    while (open && off < c.bytes.size()) {
      const size_t n = std::min(c.bytes.size() - off, 1 + pick(r, 1 + c.bytes.size() / 6));
      open = send_all(fd, c.bytes.data() + off, n);
      off += n;
      std::this_thread::sleep_for(std::chrono::microseconds(200 + pick(r, 1500)));
    }
  } else {
    open = send_all(fd, c.bytes.data(), c.bytes.size());
  }
  std::string error;
  bool eof = false;
  switch (c.ending) {
    case Ending::kHalfClose: {
      ::shutdown(fd, SHUT_WR);
      const std::string got = read_answers(fd, 0ms, &eof);  // the server must close: it saw our EOF
      error = check_answers(got, statuses);
      if (error.empty() && !eof) error = "the server kept the connection open after the client's EOF";
      break;
    }
    case Ending::kReadThenClose:
      error = check_answers(read_answers(fd, 40ms, &eof), statuses);
      break;
    case Ending::kAbort:
      break;
  }
  ::close(fd);
  return error;
}

std::string printable(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < std::min<size_t>(s.size(), 300); ++i) {
    const unsigned char ch = static_cast<unsigned char>(s[i]);
    if (ch == '\r') {
      out += "\\r";
    } else if (ch == '\n') {
      out += "\\n";
    } else if (ch < 0x20 || ch >= 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", ch);
      out += buf;
    } else {
      out += static_cast<char>(ch);
    }
  }
  if (s.size() > 300) out += "... (" + std::to_string(s.size()) + " bytes)";
  return out;
}

TEST_CASE("http_framing_fuzz: odd and malformed framing never crashes the server or gets a 5xx",
          "[http_server][fuzz]") {
  HttpServerConfig cfg;
  cfg.port = 0;
  cfg.max_body_bytes = 16 * 1024;  // small limits: oversized cases stay cheap
  cfg.max_header_bytes = 8 * 1024;
  cfg.read_timeout = 2s;
  cfg.write_timeout = 2s;
  HttpServer server(cfg);
  // Echoes the body; /sse streams it as one event.
  REQUIRE(server
              .start([](HttpRequest req, std::shared_ptr<ResponseWriter> w) {
                if (req.target == "/sse") {
                  w->start_sse();
                  w->send_event(req.body.substr(0, 200));
                  w->finish();
                  return;
                }
                w->respond(200, "text/plain", std::move(req.body));
              })
              .is_ok());

  std::mutex mu;
  std::vector<std::string> failures;  // Catch2 assertions stay on this thread
  std::map<int, int> statuses;        // answers seen, by status
  const int first = env_int("PD_FUZZ_FIRST", 0);
  const int n_cases = env_int("PD_FUZZ_CASES", kCases);
  std::atomic<int> next{first};
  std::vector<std::thread> workers;
  for (int t = 0; t < kWorkers; ++t) {
    workers.emplace_back([&] {
      for (int i = next.fetch_add(1); i < first + n_cases; i = next.fetch_add(1)) {
        const FuzzCase c = make_case(static_cast<uint64_t>(i));
        std::map<int, int> seen;
        const std::string error = run_case(server.port(), c, &seen);
        std::lock_guard lock(mu);
        for (const auto& [status, n] : seen) statuses[status] += n;
        if (!error.empty()) {
          failures.push_back("case " + std::to_string(i) + ": " + error + "\n  sent: " + printable(c.bytes));
        }
      }
    });
  }
  for (auto& w : workers) w.join();
  for (const std::string& f : failures) FAIL_CHECK(f);
  CHECK(failures.empty());
  // The mix reached the handler and every kind of refusal.
  std::string mix;
  for (const auto& [status, n] : statuses) mix += " " + std::to_string(status) + "x" + std::to_string(n);
  INFO("answers:" << mix);
  CHECK(statuses[200] > 0);
  CHECK(statuses[400] > 0);
  CHECK(statuses[413] > 0);
  CHECK(statuses[431] > 0);

  // Every connection ends (the half-closed and aborted ones at once, the
  // stalled ones by read_timeout).
  const auto until = std::chrono::steady_clock::now() + 5s;
  while (server.open_connections() != 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(10ms);
  }
  CHECK(server.open_connections() == 0);

  // And the server still serves.
  const int fd = connect_to(server.port());
  REQUIRE(fd >= 0);
  const std::string req = "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello";
  REQUIRE(send_all(fd, req.data(), req.size()));
  bool eof = false;
  const std::string got = read_answers(fd, 0ms, &eof);
  ::close(fd);
  CHECK(got.rfind("HTTP/1.1 200 ", 0) == 0);
  CHECK(got.size() >= 5);
  CHECK(got.substr(got.size() - 5) == "hello");
  std::map<int, int> last;
  CHECK(check_answers(got, &last).empty());
  CHECK(last[200] == 1);
}

}  // namespace
}  // namespace pd::router
