// Tests of the HTTP connection's parts that stand alone (router/http_connection.h,
// http_server.h, connection_slots.h): the transition tables of its states
// (phase, fate, watch read), of an exchange, of the server and of a slot; the
// read limits of a slot holder and of an overflow connection; what a failed
// read is answered with; the paths an overflow connection still serves.
#include "router/http_connection.h"

#include <catch2/catch.hpp>

#include <string>
#include <vector>

namespace pd::router::detail {
namespace {

TEST_CASE("http connection parts: a connection's fate only moves on", "[http]") {
  using F = ConnFate;
  const std::vector<F> order = {F::kKeepAlive, F::kLastRequest, F::kCloseAfterAnswer, F::kDiscardAhead};
  for (size_t i = 0; i < order.size(); ++i) {
    for (size_t j = 0; j < order.size(); ++j) {
      INFO(state_name(order[i]) << " -> " << state_name(order[j]));
      CHECK(legal(order[i], order[j]) == (j > i));
    }
  }
}

TEST_CASE("http connection parts: the phase table", "[http]") {
  using P = ConnPhase;
  struct Row {
    P from, to;
    bool legal;
  };
  const std::vector<Row> rows = {
      {P::kAccepted, P::kIdle, true},           {P::kAccepted, P::kHandling, false},
      {P::kIdle, P::kReadingHeader, true},      {P::kIdle, P::kReadingBody, false},
      {P::kReadingHeader, P::kWriting, true},   {P::kReadingBody, P::kSendingContinue, true},
      {P::kSendingContinue, P::kReadingBody, true}, {P::kReadingBody, P::kHandling, true},
      {P::kHandling, P::kWriting, true},        {P::kHandling, P::kIdle, false},
      {P::kWriting, P::kCancellingWatch, true}, {P::kWriting, P::kDiscarding, true},
      {P::kCancellingWatch, P::kIdle, true},    {P::kDiscarding, P::kIdle, false},
      {P::kDiscarding, P::kClosed, true},       {P::kClosed, P::kClosed, false},
  };
  for (const Row& r : rows) {
    INFO(state_name(r.from) << " -> " << state_name(r.to));
    CHECK(legal(r.from, r.to) == r.legal);
  }
  CHECK(in_exchange(P::kHandling));
  CHECK(in_exchange(P::kWriting));
  CHECK(!in_exchange(P::kCancellingWatch));
}

TEST_CASE("http connection parts: the watch read, the write, the exchange, the server, a slot", "[http]") {
  CHECK(legal(WatchState::kNone, WatchState::kPending));
  CHECK(!legal(WatchState::kPending, WatchState::kPending));  // one watch read at a time
  CHECK(!legal(WriteState::kInFlight, WriteState::kInFlight));
  using E = ExchangeState;
  CHECK(legal(E::kAwaiting, E::kDone));
  CHECK(legal(E::kLeftUnheard, E::kLeft));
  CHECK(!legal(E::kDone, E::kLeft));       // answered: the departure is not reported
  CHECK(!legal(E::kLeft, E::kStreaming));  // gone: no more answers
  CHECK(legal(HttpServerState::kCreated, HttpServerState::kServing));
  CHECK(!legal(HttpServerState::kStopped, HttpServerState::kServing));  // not restarted
  CHECK(!legal(HttpServerState::kCreated, HttpServerState::kStopped));  // stop() before start() does nothing
  CHECK(legal(SlotHold::kHeld, SlotHold::kLost));
  CHECK(!legal(SlotHold::kLost, SlotHold::kHeld));  // an evicted connection never gets one back
}

TEST_CASE("http connection parts: read limits of a slot holder and of an overflow connection", "[http]") {
  HttpServerConfig cfg;
  cfg.max_header_bytes = 8192;
  cfg.max_body_bytes = 100000;
  cfg.read_timeout = std::chrono::milliseconds(5000);
  const ServerCore core(cfg);
  const ReadLimits slot = read_limits_of(core, Admission::kSlot);
  CHECK(slot.header_bytes == 8192);
  CHECK(slot.body_bytes == 100000);
  CHECK(slot.request_bytes == 100000 + 8192 + kRequestOverheadBytes);
  CHECK(slot.timeout == std::chrono::milliseconds(5000));
  CHECK(read_limits_of(core, Admission::kUnlimited).request_bytes == slot.request_bytes);
  const ReadLimits overflow = read_limits_of(core, Admission::kOverflow);
  CHECK(overflow.header_bytes == 4096);
  CHECK(overflow.body_bytes == 1024);
  CHECK(overflow.request_bytes == 8192);
  CHECK(overflow.timeout == std::chrono::milliseconds(2000));
}

TEST_CASE("http connection parts: what a failed read is answered with", "[http]") {
  const ReadLimits limits{16384, 1000, 70000, std::chrono::milliseconds(1000)};
  CHECK(refusal_of(http::error::body_limit, limits, 70000)->status == 413);
  CHECK(refusal_of(http::error::body_limit, limits, 70000)->message.find("1000 bytes") != std::string::npos);
  CHECK(refusal_of(http::error::buffer_overflow, limits, 70000)->status == 413);
  CHECK(refusal_of(http::error::header_limit, limits, 70000)->status == 431);
  CHECK(refusal_of(http::error::bad_method, limits, 70000)->status == 400);
  CHECK(!refusal_of(http::error::end_of_stream, limits, 70000));    // the peer left: nobody to answer
  CHECK(refusal_of(http::error::partial_message, limits, 70000)->status == 400);  // input ended mid-request
  CHECK(!refusal_of(net::error::operation_aborted, limits, 70000));  // the deadline closed it
  const Refusal busy = overflow_refusal(64);
  CHECK(busy.status == 503);
  CHECK(busy.type == "service_unavailable");
  CHECK(busy.headers == std::vector<std::pair<std::string, std::string>>{{"Retry-After", "1"}});
}

TEST_CASE("http connection parts: an overflow connection serves only a GET of an always-served path", "[http]") {
  const std::vector<std::string> paths = {"/health"};
  http::request<http::string_body> get{http::verb::get, "/health?verbose=1", 11};
  CHECK(always_served(get, paths));
  get.target("/metrics");
  CHECK(!always_served(get, paths));
  http::request<http::string_body> post{http::verb::post, "/health", 11};
  CHECK(!always_served(post, paths));
}

}  // namespace
}  // namespace pd::router::detail

namespace pd::router::detail {
namespace {

TEST_CASE("http connection parts: the Access-Control-Allow-Origin of an origin", "[http]") {
  CHECK(cors_allow_origin({}, "https://a.example").empty());
  CHECK(cors_allow_origin({"https://a.example"}, "https://a.example") == "https://a.example");
  CHECK(cors_allow_origin({"https://a.example"}, "https://b.example").empty());
  CHECK(cors_allow_origin({"https://a.example"}, "https://a.example:8443").empty());
  CHECK(cors_allow_origin({"*"}, "null") == "*");
  CHECK(cors_allow_origin({"*"}, "").empty());  // no Origin: not a CORS request
}

}  // namespace
}  // namespace pd::router::detail
