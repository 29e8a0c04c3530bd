// Tests of one exchange between a handler and a connection
// (router/http_exchange.h), without a socket: the turn rules a Writer's calls
// follow (ExchangeState), the order answers reach the connection's side, the
// bell that says answers came, the on_disconnect callback's exactly-once
// rules, a writer dropped unanswered or mid-stream, and a stopped server.
#include "router/http_exchange.h"

#include <catch2/catch.hpp>

#include <memory>
#include <string>
#include <vector>

namespace pd::router::detail {
namespace {

using Kind = Answer::Kind;

// A server core (never started) and one exchange on a strand of it.
struct Fixture {
  std::shared_ptr<ServerCore> core = std::make_shared<ServerCore>(HttpServerConfig{});
  Strand strand = net::make_strand(core->ioc);
  std::shared_ptr<Exchange> exchange = std::make_shared<Exchange>(core, strand, 7);

  std::shared_ptr<Writer> writer(unsigned version = 11, bool keep_alive = true) {
    return std::make_shared<Writer>(exchange, nullptr, version, keep_alive);
  }
  std::vector<Kind> taken() {
    std::vector<Kind> kinds;
    for (const Answer& a : exchange->take()) kinds.push_back(a.kind);
    return kinds;
  }
  void run() {
    core->ioc.restart();
    core->ioc.poll();
  }
  // What the exchange posted and no test ran holds the core (its io_context
  // owns the handlers, the handlers own the core): run it dry, as stop() does.
  ~Fixture() {
    exchange.reset();
    core->work.reset();
    run();
  }
};

TEST_CASE("http exchange: a response, once, and nothing after it", "[http]") {
  Fixture f;
  auto w = f.writer();
  CHECK(w->respond(200, "text/plain", "ok", {}));
  CHECK(!w->respond(200, "text/plain", "again", {}));
  CHECK(!w->start_sse());
  CHECK(!w->send_event("x"));
  CHECK(!w->finish());
  CHECK(f.taken() == std::vector<Kind>{Kind::kRespond});
  w.reset();  // answered: dropping it queues nothing
  CHECK(f.taken().empty());
}

TEST_CASE("http exchange: a stream's answers arrive in order, events only between its head and its end", "[http]") {
  Fixture f;
  auto w = f.writer();
  CHECK(!w->send_event("early"));
  CHECK(!w->finish());
  CHECK(w->start_sse());
  CHECK(!w->respond(200, "text/plain", "late", {}));
  CHECK(w->send_event("a"));
  CHECK(w->send_event("b"));
  CHECK(w->finish());
  CHECK(!w->send_event("after"));
  const std::deque<Answer> got = f.exchange->take();
  REQUIRE(got.size() == 4);
  CHECK(got[0].kind == Kind::kStartSse);
  CHECK(got[1].data == "data: a\n\n");
  CHECK(got[2].data == "data: b\n\n");
  CHECK(got[3].kind == Kind::kFinish);
}

TEST_CASE("http exchange: queued answers ring the bell on the connection's strand", "[http]") {
  Fixture f;
  bool rung = false;
  f.exchange->bell().async_wait([&](beast::error_code ec) { rung = ec == net::error::operation_aborted; });
  f.run();
  CHECK(!rung);  // nothing queued: it waits
  auto w = f.writer();
  CHECK(w->respond(200, "text/plain", "ok", {}));
  f.run();
  CHECK(rung);
  CHECK(f.taken() == std::vector<Kind>{Kind::kRespond});
}

TEST_CASE("http exchange: the handler's headers, Connection: close and the framing ones", "[http]") {
  Fixture f;
  auto w = f.writer();
  CHECK(w->respond(201, "application/json", "{}",
                   {{"Connection", "close"}, {"Content-Length", "99"}, {"X-Bad", "a\r\nb"}, {"X-Ok", "1"}}));
  std::deque<Answer> got = f.exchange->take();
  REQUIRE(got.size() == 1);
  CHECK(got[0].close_after);
  const Response& res = *got[0].response;
  CHECK(!res.keep_alive());
  CHECK(res[http::field::content_length] == "2");
  CHECK(res["X-Bad"].empty());
  CHECK(res["X-Ok"] == "1");
  Fixture g;
  CHECK(g.writer(11, /*keep_alive=*/false)->respond(200, "text/plain", "ok", {}));
  CHECK(g.exchange->take().front().close_after);  // the request or the connection said so
}

TEST_CASE("http exchange: a writer dropped unanswered or mid-stream tells the connection", "[http]") {
  Fixture f;
  f.writer().reset();
  CHECK(f.taken() == std::vector<Kind>{Kind::kDroppedUnanswered});
  Fixture g;
  {
    auto w = g.writer();
    CHECK(w->start_sse());
  }
  CHECK(g.taken() == std::vector<Kind>{Kind::kStartSse, Kind::kDroppedMidStream});
}

TEST_CASE("http exchange: on_disconnect fires once, whether set before or after the client left", "[http]") {
  SECTION("set before") {
    Fixture f;
    auto w = f.writer();
    int calls = 0;
    w->on_disconnect([&] { ++calls; });
    f.exchange->client_gone();
    CHECK(calls == 1);  // at once, on the strand that saw it
    f.exchange->client_gone();
    CHECK(calls == 1);
    CHECK(!w->respond(200, "text/plain", "late", {}));
  }
  SECTION("set after") {
    Fixture f;
    auto w = f.writer();
    f.exchange->client_gone();
    int calls = 0;
    w->on_disconnect([&] { ++calls; });
    CHECK(calls == 0);  // posted
    f.run();
    CHECK(calls == 1);
    w->on_disconnect([&] { ++calls; });  // reported already: never fires
    f.run();
    CHECK(calls == 1);
  }
  SECTION("answered first") {
    Fixture f;
    auto w = f.writer();
    int calls = 0;
    w->on_disconnect([&] { ++calls; });
    CHECK(w->respond(200, "text/plain", "ok", {}));
    f.exchange->client_gone();
    f.run();
    CHECK(calls == 0);
  }
}

TEST_CASE("http exchange: after the server stopped nothing is queued, a due callback runs inline", "[http]") {
  Fixture f;
  auto w = f.writer();
  f.exchange->client_gone();
  f.core->mark_stopped();
  int calls = 0;
  w->on_disconnect([&] { ++calls; });
  CHECK(calls == 1);
  Fixture g;
  auto v = g.writer();
  g.core->mark_stopped();
  CHECK(!v->respond(200, "text/plain", "ok", {}));
  CHECK(!v->start_sse());
  CHECK(g.taken().empty());
}

}  // namespace
}  // namespace pd::router::detail
