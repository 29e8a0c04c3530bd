// Tests of a connection's write queue (router/http_outgoing.h, OutQueue): one
// write in flight at a time, SSE events waiting behind it gathered into one
// write with their chunk framing, the final write told apart, a client behind
// its events detected, and clear() keeping the write in flight.
#include "router/http_outgoing.h"

#include <catch2/catch.hpp>

#include <chrono>
#include <string>

namespace pd::router::detail {
namespace {

using Clock = OutQueue::Clock;
using namespace std::chrono_literals;

Outgoing event(std::string data) { return Outgoing{Outgoing::kChunk, nullptr, nullptr, std::move(data)}; }
Outgoing last_chunk() { return Outgoing{Outgoing::kLastChunk, nullptr, nullptr, {}, /*final=*/true}; }

TEST_CASE("http outgoing: one write in flight, the final one told apart", "[http]") {
  OutQueue q(1, 1 << 20);
  CHECK(q.begin_write(Clock::now(), true) == nullptr);  // nothing waits
  q.push(Outgoing{Outgoing::kResponse, make_response(11, true, 200, "text/plain", "ok"), nullptr, {}, true});
  Outgoing* w = q.begin_write(Clock::now(), true);
  REQUIRE(w != nullptr);
  CHECK(w->kind == Outgoing::kResponse);
  CHECK(q.in_flight());
  CHECK(q.begin_write(Clock::now(), true) == nullptr);  // one at a time
  CHECK(q.end_write());                                  // it was final
  CHECK(!q.in_flight());
  CHECK(q.empty());
}

TEST_CASE("http outgoing: events waiting behind a write go out as one write, each its own chunk", "[http]") {
  OutQueue q(1, 1 << 20);
  q.push(Outgoing{Outgoing::kSseHead, nullptr, make_sse_head(11, true)});
  REQUIRE(q.begin_write(Clock::now(), true)->kind == Outgoing::kSseHead);
  q.push(event("data: a\n\n"));
  q.push(event("data: bc\n\n"));
  q.push(last_chunk());
  CHECK(!q.end_write());
  Outgoing* w = q.begin_write(Clock::now(), /*chunked=*/true);
  REQUIRE(w != nullptr);
  CHECK(w->kind == Outgoing::kChunk);
  CHECK(w->data == "9\r\ndata: a\n\n\r\na\r\ndata: bc\n\n\r\n");
  CHECK(!q.end_write());
  REQUIRE(q.begin_write(Clock::now(), true)->kind == Outgoing::kLastChunk);
  CHECK(q.end_write());
  CHECK(q.empty());
}

TEST_CASE("http outgoing: HTTP/1.0 events go out bare", "[http]") {
  OutQueue q(1, 1 << 20);
  q.push(event("data: a\n\n"));
  q.push(event("data: b\n\n"));
  CHECK(q.begin_write(Clock::now(), /*chunked=*/false)->data == "data: a\n\ndata: b\n\n");
}

TEST_CASE("http outgoing: a client is behind only when too much waits behind a write begun 100 ms ago", "[http]") {
  OutQueue q(1, /*max_waiting_bytes=*/10);
  const Clock::time_point t0 = Clock::now();
  q.push(event("0123456789"));
  REQUIRE(q.begin_write(t0, true) != nullptr);  // what is being written does not count
  CHECK(!q.behind(t0 + 1s));
  q.push(event("01234567"));
  q.push(event("01234567"));  // 16 bytes wait
  CHECK(!q.behind(t0 + 50ms));  // a burst, the socket may yet take it
  CHECK(q.behind(t0 + kBehindAfter));
  CHECK(!q.end_write());
  CHECK(!q.behind(t0 + 1s));  // no write in flight
  REQUIRE(q.begin_write(t0 + 1s, true) != nullptr);  // both gathered: nothing waits
  CHECK(!q.behind(t0 + 2s));
}

TEST_CASE("http outgoing: clear() keeps the write in flight until it ends", "[http]") {
  OutQueue q(1, 1 << 20);
  q.push(event("data: a\n\n"));
  REQUIRE(q.begin_write(Clock::now(), true) != nullptr);
  q.push(event("data: b\n\n"));
  q.push(last_chunk());
  q.clear();
  CHECK(!q.empty());  // the write in flight: the socket still reads its bytes
  CHECK(!q.end_write());
  CHECK(q.empty());
  CHECK(q.begin_write(Clock::now(), true) == nullptr);
}

TEST_CASE("http outgoing: the server's responses", "[http]") {
  auto ok = make_response(11, true, 200, "text/plain", "hello");
  CHECK(ok->result_int() == 200);
  CHECK(ok->keep_alive());
  CHECK((*ok)[http::field::content_length] == "5");
  CHECK(make_response(11, true, 700, "", "x")->result_int() == 500);  // not a final status
  CHECK(make_response(11, true, 204, "", "dropped")->body().empty());
  auto err = make_error_response(11, 413, "too big", "invalid_request_error");
  CHECK(!err->keep_alive());
  CHECK(err->body().find("too big") != std::string::npos);
  auto head = make_sse_head(10, false);
  CHECK(!head->res.chunked());  // HTTP/1.0: the stream ends with the connection
  CHECK(head->res[http::field::content_type] == "text/event-stream; charset=utf-8");
}

}  // namespace
}  // namespace pd::router::detail
