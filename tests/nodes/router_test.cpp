// The router's request lifecycle and its view of the workers, stepped by hand
// (Router::run_once) against the in-process control channel: the test plays
// the prefill and decode ranks (heartbeats, tokens, failures, going silent)
// and a real HTTP client talks to the router on a loopback port. No MPI job.
#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <nlohmann/json.hpp>
#include <thread>

#include "gguf/gguf_reader.h"
#include "gguf/gguf_writer.h"
#include "nodes/fake_channel.h"
#include "protocol/role_table.h"
#include "router/router.h"
#include "util/env.h"
#include "util/lifecycle.h"

namespace pd::router {
namespace {

using namespace std::chrono_literals;
using test::FakeChannelHub;
using Clock = std::chrono::steady_clock;

constexpr int kRouterRank = 0, kP1 = 1, kP2 = 2, kD1 = 3, kD2 = 4;

std::filesystem::path model_path() {
  return std::filesystem::temp_directory_path() / ("pd_router_test_" + std::to_string(::getpid()) + ".gguf");
}
std::string tiny_model_file() {
  static const bool written = [] {
    const std::vector<uint8_t> bytes = make_tiny_llama_gguf(TinyLlamaSpec{});
    std::ofstream f(model_path(), std::ios::binary);
    f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    return f.good();
  }();
  REQUIRE(written);
  return model_path().string();
}
struct Cleanup {
  ~Cleanup() {
    std::error_code ec;
    std::filesystem::remove(model_path(), ec);  // computed again: no static of this file may be used at exit
  }
} cleanup_at_exit;

ModelInfo tiny_model_info() {
  auto file = GgufFile::open(tiny_model_file());
  REQUIRE(file.is_ok());
  auto tok = Tokenizer::from_gguf(**file);
  REQUIRE(tok.is_ok());
  ModelInfo info;
  info.tokenizer = std::move(tok).value();
  info.chat_template = ChatTemplate::chatml();
  info.context = 512;
  info.name = "tiny";
  return info;
}

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
size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + what.size())) ++n;
  return n;
}

// The router on a fake channel, 2 prefill + 2 decode ranks played by the test.
struct Harness {
  FakeChannelHub hub;
  ClusterConfig cfg;
  std::unique_ptr<Router> router;
  std::set<int> silent;  // ranks that stopped sending heartbeats
  std::vector<int> live{kP1, kP2, kD1, kD2};  // ranks the test plays (joined ones are added)
  Clock::time_point last_beat{};
  // The router's clock: deadlines (heartbeat_ms, drain_ms, startup_ms) run on
  // it, and each pump() moves it 200 us.
  FakeEnv env;

  explicit Harness(int heartbeat_ms = 150, int drain_ms = 30000) {
    cfg.timeouts.drain_ms = drain_ms;
    cfg.http.port = 0;
    cfg.timeouts.heartbeat_ms = heartbeat_ms;  // below the config's floor: the test's ranks beat every 10 ms
    RoleTable roles;
    roles.roles = {Role::kRouter, Role::kPrefill, Role::kPrefill, Role::kDecode, Role::kDecode};
    roles.hosts.assign(5, "test");
    roles.pids.assign(5, 0);
    roles.self = kRouterRank;
    roles.router = kRouterRank;
    roles.prefill = {kP1, kP2};
    roles.decode = {kD1, kD2};
    router = std::make_unique<Router>(cfg, roles, tiny_model_info(), hub.endpoint(kRouterRank));
    router->set_env(&env);
    REQUIRE(router->start().is_ok());
    for (int r : {kP1, kP2, kD1, kD2}) beat(r);
    pump_for(30ms);
  }
  ~Harness() { router.reset(); }

  void beat(int rank, proto::Epoch epoch = 0) {
    proto::LoadReport lr;
    lr.ready = true;
    lr.free_blocks = lr.total_blocks = 1000;
    lr.epoch = epoch;
    hub.send(rank, kRouterRank, lr);
  }
  std::map<int, proto::Epoch> epochs;
  // One router iteration; the live ranks beat every 10 ms.
  void pump() {
    if (env.now() - last_beat > 10ms) {
      for (int r : live)
        if (!silent.count(r)) beat(r, epochs[r]);
      last_beat = env.now();
    }
    router->run_once();
    env.advance(200us);
    std::this_thread::sleep_for(200us);  // the HTTP threads run on real time
  }
  void pump_for(std::chrono::milliseconds d) {
    const auto end = env.now() + d;
    while (env.now() < end) pump();
  }
  // Pumps until a message of type T reaches `rank`; returns it with the others it took.
  template <typename T>
  std::optional<T> expect(int rank, std::chrono::milliseconds within = 2000ms) {
    const auto end = env.now() + within;
    while (env.now() < end) {
      pump();
      for (auto& [source, m] : hub.take_all(rank)) {
        inbox[rank].push_back(m);
        if (auto* t = std::get_if<T>(&m)) return *t;
      }
    }
    return std::nullopt;
  }
  std::map<int, std::vector<proto::Message>> inbox;
  // Pumps until a prompt reaches one of the prefill ranks: (that rank, the request).
  std::optional<std::pair<int, proto::PrefillRequest>> dispatched(std::chrono::milliseconds within = 2000ms,
                                                                  const std::function<bool()>& stop = {}) {
    const auto end = env.now() + within;
    while (env.now() < end && !(stop && stop())) {
      pump();
      for (int r : {kP1, kP2})
        for (auto& [src, m] : hub.take_all(r)) {
          inbox[r].push_back(m);
          if (auto* p = std::get_if<proto::PrefillRequest>(&m)) return std::pair{r, *p};
        }
    }
    return std::nullopt;
  }

  std::future<HttpResult> post(const std::string& body, const std::string& path = "/v1/completions") {
    const uint16_t port = router->port();
    return std::async(std::launch::async, [=] { return http_exchange(port, "POST", path, body); });
  }
  HttpResult get(const std::string& path) {
    auto f = std::async(std::launch::async, [port = router->port(), path] { return http_exchange(port, "GET", path, ""); });
    while (f.wait_for(0ms) != std::future_status::ready) pump();
    return f.get();
  }
  HttpResult finish(std::future<HttpResult>& f, std::chrono::milliseconds within = 5000ms) {
    const auto end = env.now() + within;
    while (f.wait_for(0ms) != std::future_status::ready && env.now() < end) pump();
    REQUIRE(f.wait_for(0ms) == std::future_status::ready);
    return f.get();
  }
  // As a worker: tokens [first, first + n) of request `id`, the last one ending it when `finish`.
  void tokens(int from, proto::RequestId id, int first, int n, bool finish) {
    proto::TokenEvents te;
    for (int i = 0; i < n; ++i) {
      proto::TokenEvent ev;
      ev.id = id;
      ev.first_index = first + i;
      ev.tokens = {'a' + 3};  // a printable byte token of the tiny vocabulary
      ev.finish = finish && i + 1 == n ? proto::Finish::kLength : proto::Finish::kNone;
      te.events.push_back(ev);
    }
    hub.send(from, kRouterRank, te);
  }
};

const std::string kBody = R"({"model": "tiny", "prompt": "hello", "max_tokens": 3})";
const std::string kStreamBody = R"({"model": "tiny", "prompt": "hello", "max_tokens": 3, "stream": true})";

TEST_CASE("router: queued -> dispatched -> streaming -> finished, tokens from both legs in any order", "[router]") {
  Harness h;
  auto f = h.post(kBody);
  auto d = h.dispatched();
  REQUIRE(d);
  const auto& [prefill, req] = *d;
  const proto::PrefillRequest* pr = &req;
  h.tokens(pr->decode_rank, pr->id, 1, 2, true);  // the decode rank's tokens overtake the first one
  h.tokens(prefill, pr->id, 0, 1, false);
  const HttpResult r = h.finish(f);
  CHECK(r.status == 200);
  CHECK(r.raw.find("\"finish_reason\":\"length\"") != std::string::npos);
  CHECK(illegal_transitions() == 0);
}

TEST_CASE("router: a prefill rank that goes silent is declared down; its request re-runs on the other one", "[router]") {
  Harness h;
  auto f = h.post(kBody);
  auto d = h.dispatched();
  REQUIRE(d);
  const int first = d->first;
  const proto::PrefillRequest* pr = &d->second;
  const int other = first == kP1 ? kP2 : kP1;
  h.silent.insert(first);  // kill -STOP
  auto again = h.expect<proto::PrefillRequest>(other, 2s);
  REQUIRE(again);
  CHECK(again->id != pr->id);        // a new wire id for the new attempt
  CHECK(again->prompt == pr->prompt);
  // The other workers were told; the stopped one was not sent anything more.
  bool told = false;
  for (auto& [src, m] : h.hub.take_all(again->decode_rank))
    if (auto* d = std::get_if<proto::PeerDown>(&m)) told |= d->rank == first;
  for (auto& m : h.inbox[again->decode_rank])
    if (auto* d = std::get_if<proto::PeerDown>(&m)) told |= d->rank == first;
  CHECK(told);
  // The stopped rank wakes up and speaks of the old attempt: ignored (it is fenced).
  h.tokens(first, pr->id, 0, 1, false);
  h.hub.send(first, kRouterRank, proto::RequestFailed{pr->id, "late", proto::FailureKind::kInternal});
  h.tokens(other, again->id, 0, 1, false);
  h.tokens(again->decode_rank, again->id, 1, 2, true);
  const HttpResult r = h.finish(f);
  CHECK(r.status == 200);
  const HttpResult health = h.get("/health");
  CHECK(health.status == 200);
  CHECK(health.raw.find("\"degraded\"") != std::string::npos);
  const HttpResult metrics = h.get("/metrics");
  CHECK(metrics.raw.find("pd_rank_up{role=\"prefill\",rank=\"" + std::to_string(first) + "\"} 0") != std::string::npos);
  CHECK(metrics.raw.find("pd_requests_retried_total 1") != std::string::npos);
  CHECK(metrics.raw.find("pd_rank_down_total{role=\"prefill\",rank=\"" + std::to_string(first) + "\"} 1") !=
        std::string::npos);
}

TEST_CASE("router: a fenced rank that comes back is told to rejoin and re-admitted under a new epoch", "[router]") {
  Harness h;
  h.silent.insert(kD2);
  h.pump_for(250ms);  // past the heartbeat: declared down
  h.hub.take_all(kD2);
  h.silent.erase(kD2);  // kill -CONT: it reports under its old epoch
  auto rejoin = h.expect<proto::Rejoin>(kD2, 1s);
  REQUIRE(rejoin);
  CHECK(rejoin->epoch == 1);
  CHECK(h.get("/health").raw.find("\"degraded\"") != std::string::npos);
  h.epochs[kD2] = 1;  // it dropped its old state and reports under the new epoch
  auto up = h.expect<proto::PeerUp>(kP1, 1s);
  REQUIRE(up);
  CHECK((up->rank == kD2 && up->epoch == 1));
  h.pump_for(30ms);  // /health reflects the table as of the last housekeeping pass (every 10 ms)
  const HttpResult health = h.get("/health");
  INFO(health.raw);
  CHECK(health.status == 200);
  CHECK(health.raw.find("\"status\":\"ok\"") != std::string::npos);
}

TEST_CASE("router: a decode rank lost after the first token ends the stream with one error", "[router]") {
  Harness h;
  auto f = h.post(kStreamBody);
  auto d = h.dispatched();
  REQUIRE(d);
  const auto& [prefill, req] = *d;
  const proto::PrefillRequest* pr = &req;
  h.tokens(prefill, pr->id, 0, 1, false);  // the first token reaches the client
  h.pump_for(20ms);
  h.silent.insert(pr->decode_rank);
  const HttpResult r = h.finish(f);
  CHECK(r.status == 200);  // the stream had started
  CHECK(count(r.raw, "\"error\"") == 1);
  CHECK(count(r.raw, "data: [DONE]") == 1);
  CHECK(count(r.raw, "finish_reason\":\"length") == 0);
  CHECK(r.raw.find("went down") != std::string::npos);
}

TEST_CASE("router: workers report failure kinds; the router picks the status and re-runs the retryable ones",
          "[router]") {
  Harness h;
  auto run = [&](proto::FailureKind kind, bool from_decode) {
    auto f = h.post(kBody);
    auto d = h.dispatched();
    REQUIRE(d);
    h.hub.send(from_decode ? d->second.decode_rank : d->first, kRouterRank,
               proto::RequestFailed{d->second.id, "why", kind});
    // A retryable kind comes back as a new attempt: answer that one.
    auto again = h.dispatched(300ms, [&] { return f.wait_for(0ms) == std::future_status::ready; });
    if (again) {
      h.tokens(again->first, again->second.id, 0, 1, false);
      h.tokens(again->second.decode_rank, again->second.id, 1, 2, true);
    }
    return h.finish(f).status;
  };
  CHECK(run(proto::FailureKind::kInvalid, false) == 400);
  CHECK(run(proto::FailureKind::kOverloaded, true) == 503);
  CHECK(run(proto::FailureKind::kTimeout, false) == 504);
  CHECK(run(proto::FailureKind::kInternal, true) == 500);
  CHECK(run(proto::FailureKind::kPeerDown, true) == 200);  // re-run elsewhere, then served
  CHECK(run(proto::FailureKind::kTransfer, false) == 200);
}

TEST_CASE("router: with no prefill->decode path /health is 503 naming why, and requests fail at once", "[router]") {
  Harness h;
  h.silent.insert(kD1);
  h.silent.insert(kD2);
  h.pump_for(250ms);
  const HttpResult health = h.get("/health");
  CHECK(health.status == 503);
  CHECK(health.raw.find("every decode rank is down") != std::string::npos);
  auto f = h.post(kBody);
  const HttpResult r = h.finish(f, 1000ms);
  CHECK(r.status == 503);
  CHECK(r.raw.find("no prefill->decode path") != std::string::npos);
}

TEST_CASE("router: a rank joins, is linked to the up workers of the other role, and gets work once ready", "[router]") {
  Harness h;
  for (int r : {kP1, kP2}) h.hub.send(r, kRouterRank, proto::Listening{"port-" + std::to_string(r)});
  constexpr int kJoined = 7;
  h.hub.send(kJoined, kRouterRank,
             proto::Join{static_cast<int32_t>(Role::kDecode), "node-c", 4242, h.cfg.kv.block_size, "port-7", "node-c:1"});
  auto accepted = h.expect<proto::JoinAccepted>(kJoined);
  REQUIRE(accepted);
  CHECK(accepted->rank == kJoined);
  CHECK(!accepted->colocated);
  REQUIRE(accepted->peers.size() == 2);
  CHECK((accepted->peers[0].rank == kP1 && accepted->peers[0].port == "port-1"));
  CHECK((accepted->peers[1].rank == kP2 && accepted->peers[1].port == "port-2"));
  h.live.push_back(kJoined);  // it reports ready
  h.pump_for(30ms);
  // Three requests, none answered: the decode ranks take one each (fewest outstanding).
  std::vector<std::future<HttpResult>> fs;
  std::set<int> decode_ranks;
  std::vector<proto::PrefillRequest> reqs;
  for (int i = 0; i < 3; ++i) {
    fs.push_back(h.post(kBody));
    auto d = h.dispatched();
    REQUIRE(d);
    decode_ranks.insert(d->second.decode_rank);
    reqs.push_back(d->second);
    h.tokens(d->first, d->second.id, 0, 1, false);
  }
  CHECK(decode_ranks.count(kJoined) == 1);
  for (const auto& r : reqs) h.tokens(r.decode_rank, r.id, 1, 2, true);
  for (auto& f : fs) CHECK(h.finish(f).status == 200);
  const HttpResult health = h.get("/health");
  CHECK(health.raw.find("{\"rank\":7,\"role\":\"decode\",\"state\":\"up\"}") != std::string::npos);
  CHECK(h.get("/metrics").raw.find("pd_ranks_joined_total{role=\"decode\"} 1") != std::string::npos);
}

TEST_CASE("router: a request without a seed gets a fresh one; a given seed is kept", "[router]") {
  Harness h;
  std::set<uint64_t> seeds;
  for (int i = 0; i < 3; ++i) {
    auto f = h.post(R"({"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 1})");
    auto d = h.dispatched();
    REQUIRE(d);
    seeds.insert(d->second.sampling.seed);
    CHECK(d->second.sampling.temperature == 1.0f);
    h.tokens(d->first, d->second.id, 0, 1, false);
    h.tokens(d->second.decode_rank, d->second.id, 1, 2, true);
    CHECK(h.finish(f).status == 200);
  }
  CHECK(seeds.size() == 3);  // 2^-64-ish odds of a repeat
  for (int i = 0; i < 2; ++i) {
    auto f = h.post(R"({"model": "tiny", "prompt": "hello", "max_tokens": 3, "seed": 77})");
    auto d = h.dispatched();
    REQUIRE(d);
    CHECK(d->second.sampling.seed == 77u);
    h.tokens(d->first, d->second.id, 0, 1, false);
    h.tokens(d->second.decode_rank, d->second.id, 1, 2, true);
    CHECK(h.finish(f).status == 200);
  }
}

TEST_CASE("router: a join is refused naming what differs", "[router]") {
  Harness h;
  h.hub.send(8, kRouterRank, proto::Join{static_cast<int32_t>(Role::kDecode), "x", 1, h.cfg.kv.block_size * 2, "p", "x:1"});
  auto refused = h.expect<proto::JoinRefused>(8);
  REQUIRE(refused);
  CHECK(refused->reason.find("kv.block_size") != std::string::npos);
  CHECK(h.hub.forgotten(kRouterRank).count(8) == 1);  // its link is released
  h.hub.send(9, kRouterRank, proto::Join{3, "x", 1, h.cfg.kv.block_size, "p", "x:1"});
  auto bad_role = h.expect<proto::JoinRefused>(9);
  REQUIRE(bad_role);
  CHECK(bad_role->reason.find("role 3") != std::string::npos);
  proto::Join other_kv{static_cast<int32_t>(Role::kDecode), "x", 1, h.cfg.kv.block_size, "p", "x:1"};
  other_kv.kv_dtype = "q8_0";  // the harness's cluster keeps f16
  h.hub.send(10, kRouterRank, other_kv);
  auto bad_kv = h.expect<proto::JoinRefused>(10);
  REQUIRE(bad_kv);
  CHECK(bad_kv->reason.find("kv.dtype q8_0 differs from the cluster's f16") != std::string::npos);
  CHECK(h.get("/health").raw.find("\"rank\":8") == std::string::npos);
}

TEST_CASE("router: a drained rank takes no new work, its handed-back prompts re-run elsewhere, then it is removed",
          "[router]") {
  Harness h;
  auto f = h.post(kBody);
  auto d = h.dispatched();
  REQUIRE(d);
  const int leaving = d->first, other = d->first == kP1 ? kP2 : kP1;
  auto drain = h.post("{\"rank\": " + std::to_string(leaving) + "}", "/admin/drain");
  CHECK(h.finish(drain).status == 200);
  REQUIRE(h.expect<proto::Drain>(leaving));
  // The rank hands its queued prompt back: it re-runs on the other prefill rank.
  h.hub.send(leaving, kRouterRank, proto::RequestFailed{d->second.id, "leaving", proto::FailureKind::kLeaving});
  auto again = h.expect<proto::PrefillRequest>(other);
  REQUIRE(again);
  h.tokens(other, again->id, 0, 1, false);
  h.tokens(again->decode_rank, again->id, 1, 2, true);
  CHECK(h.finish(f).status == 200);
  // New requests go only to the other prefill rank.
  for (int i = 0; i < 3; ++i) {
    auto g = h.post(kBody);
    auto n = h.dispatched();
    REQUIRE(n);
    CHECK(n->first == other);
    h.tokens(other, n->second.id, 0, 1, false);
    h.tokens(n->second.decode_rank, n->second.id, 1, 2, true);
    CHECK(h.finish(g).status == 200);
  }
  auto twice = h.post("{\"rank\": " + std::to_string(leaving) + "}", "/admin/drain");
  CHECK(h.finish(twice).status == 409);
  h.hub.send(leaving, kRouterRank, proto::Drained{});
  auto left = h.expect<proto::PeerLeft>(kD1);
  REQUIRE(left);
  CHECK(left->rank == leaving);
  REQUIRE(h.expect<proto::Shutdown>(leaving));
  CHECK(h.hub.forgotten(kRouterRank).count(leaving) == 1);
  h.live.erase(std::find(h.live.begin(), h.live.end(), leaving));
  h.pump_for(30ms);
  const HttpResult health = h.get("/health");
  CHECK(health.status == 200);
  CHECK(health.raw.find("\"rank\":" + std::to_string(leaving) + ",") == std::string::npos);
  CHECK(h.get("/metrics").raw.find("pd_ranks_left_total{role=\"prefill\"} 1") != std::string::npos);
  CHECK(illegal_transitions() == 0);
}

TEST_CASE("router: a rank that does not finish draining within drain_ms is ended as down and removed", "[router]") {
  Harness h(150, 300);
  auto f = h.post(kStreamBody);
  auto d = h.dispatched();
  REQUIRE(d);
  h.tokens(d->first, d->second.id, 0, 1, false);  // streaming: cannot be re-run
  const int decode = d->second.decode_rank;
  auto drain = h.post("{\"rank\": " + std::to_string(decode) + "}", "/admin/drain");
  CHECK(h.finish(drain).status == 200);
  REQUIRE(h.expect<proto::Drain>(decode));
  // It keeps beating but never says Drained: after drain_ms its request ends with
  // one error, the others are told it left, and it is told to shut down.
  const HttpResult r = h.finish(f);
  CHECK(count(r.raw, "\"error\"") == 1);
  CHECK(count(r.raw, "data: [DONE]") == 1);
  REQUIRE(h.expect<proto::Shutdown>(decode));
  bool left = false;
  for (auto& m : h.inbox[kP1])
    if (auto* l = std::get_if<proto::PeerLeft>(&m)) left |= l->rank == decode;
  if (!left) left = h.expect<proto::PeerLeft>(kP1).has_value();
  CHECK(left);
  h.live.erase(std::find(h.live.begin(), h.live.end(), decode));
  h.pump_for(30ms);
  CHECK(h.get("/health").raw.find("\"rank\":" + std::to_string(decode) + ",") == std::string::npos);
}

TEST_CASE("router: POST /admin/drain refuses bodies and ranks it cannot act on", "[router]") {
  Harness h;
  auto post = [&](const std::string& body) {
    auto f = h.post(body, "/admin/drain");
    return h.finish(f);
  };
  const HttpResult unknown = post(R"({"rank": 99})");
  CHECK(unknown.status == 404);
  CHECK(unknown.raw.find("\"param\":\"rank\"") != std::string::npos);
  CHECK(post(R"({"rank": "one"})").status == 400);
  CHECK(post(R"({"rank": -1})").status == 400);
  CHECK(post("[1]").status == 400);
  CHECK(post("not json").status == 400);
  h.silent.insert(kD2);
  h.pump_for(250ms);  // declared down
  // A down rank is removed at once (its requests were already re-run or failed).
  CHECK(post(R"({"rank": 4})").status == 200);
  REQUIRE(h.expect<proto::PeerLeft>(kP1));
  h.pump_for(30ms);
  const HttpResult health = h.get("/health");
  CHECK(health.raw.find("\"rank\":4,") == std::string::npos);
  CHECK(health.raw.find("\"status\":\"ok\"") != std::string::npos);  // no longer degraded
  CHECK(post(R"({"rank": 4})").status == 404);
}


// The JSON body of a non-streaming answer.
nlohmann::json body_json(const HttpResult& r) {
  const size_t at = r.raw.find("\r\n\r\n");
  REQUIRE(at != std::string::npos);
  return nlohmann::json::parse(r.raw.substr(at + 4));
}
// The data: payloads of a stream, [DONE] excluded.
std::vector<nlohmann::json> stream_events(const HttpResult& r) {
  std::vector<nlohmann::json> out;
  for (size_t at = r.raw.find("data: "); at != std::string::npos; at = r.raw.find("data: ", at + 6)) {
    const size_t end = r.raw.find("\n", at);
    const std::string payload = r.raw.substr(at + 6, end - at - 6);
    if (payload != "[DONE]") out.push_back(nlohmann::json::parse(payload));
  }
  return out;
}

// Collects the prompts dispatched to the prefill ranks until `n` arrived (or 2 s passed).
std::vector<std::pair<int, proto::PrefillRequest>> dispatched_n(Harness& h, size_t n) {
  std::vector<std::pair<int, proto::PrefillRequest>> out;
  const auto end = Clock::now() + 2000ms;
  while (out.size() < n && Clock::now() < end) {
    h.pump();
    for (int r : {kP1, kP2})
      for (auto& [src, m] : h.hub.take_all(r)) {
        h.inbox[r].push_back(m);
        if (auto* p = std::get_if<proto::PrefillRequest>(&m)) out.emplace_back(r, *p);
      }
  }
  return out;
}

TEST_CASE("router: a batch of prompts x n gets its choices in index order, usage summed", "[router]") {
  Harness h;
  auto f = h.post(R"({"model": "tiny", "prompt": ["hello", "hi there"], "n": 2, "max_tokens": 2, "seed": 7})");
  auto ds = dispatched_n(h, 4);
  REQUIRE(ds.size() == 4);
  std::map<std::vector<int32_t>, std::set<uint64_t>> seeds_by_prompt;
  for (auto& [prefill, pr] : ds) seeds_by_prompt[pr.prompt].insert(pr.sampling.seed);
  REQUIRE(seeds_by_prompt.size() == 2);
  for (auto& [prompt, seeds] : seeds_by_prompt) CHECK(seeds == std::set<uint64_t>{7, 8});  // choice j: seed + j
  // Answer them in reverse order: the body still lists choices by index.
  for (auto it = ds.rbegin(); it != ds.rend(); ++it) {
    h.tokens(it->first, it->second.id, 0, 1, false);
    h.tokens(it->second.decode_rank, it->second.id, 1, 1, true);
  }
  const HttpResult r = h.finish(f);
  REQUIRE(r.status == 200);
  const nlohmann::json j = body_json(r);
  REQUIRE(j["choices"].size() == 4);
  for (int i = 0; i < 4; ++i) CHECK(j["choices"][i]["index"] == i);
  int64_t prompt_tokens = 0;
  for (auto& [prompt, seeds] : seeds_by_prompt) prompt_tokens += static_cast<int64_t>(prompt.size());
  CHECK(j["usage"]["prompt_tokens"] == prompt_tokens);  // each prompt once, whatever n
  CHECK(j["usage"]["completion_tokens"] == 8);
  CHECK(illegal_transitions() == 0);
}

TEST_CASE("router: a streamed batch tags chunks with their choice and ends once", "[router]") {
  Harness h;
  auto f = h.post(R"({"model": "tiny", "prompt": [[70, 71], [72]], "max_tokens": 2, "stream": true,
                      "stream_options": {"include_usage": true}})");
  auto ds = dispatched_n(h, 2);
  REQUIRE(ds.size() == 2);
  CHECK(ds[0].second.prompt != ds[1].second.prompt);  // token-id prompts as given
  for (auto& [prefill, pr] : ds) {
    h.tokens(prefill, pr.id, 0, 1, false);
    h.tokens(pr.decode_rank, pr.id, 1, 1, true);
  }
  const HttpResult r = h.finish(f);
  REQUIRE(r.status == 200);
  CHECK(count(r.raw, "data: [DONE]") == 1);
  std::map<int, int> finished;
  const std::vector<nlohmann::json> events = stream_events(r);
  REQUIRE_FALSE(events.empty());
  for (const nlohmann::json& e : events) {
    if (e["choices"].empty()) continue;  // the usage chunk
    if (!e["choices"][0]["finish_reason"].is_null()) ++finished[e["choices"][0]["index"].get<int>()];
  }
  CHECK(finished == std::map<int, int>{{0, 1}, {1, 1}});
  CHECK(events.back()["usage"]["prompt_tokens"] == 3);
  CHECK(events.back()["usage"]["completion_tokens"] == 4);
}

TEST_CASE("router: one failing choice answers the batch with its error and cancels the others", "[router]") {
  Harness h;
  auto f = h.post(R"({"model": "tiny", "prompt": ["a", "b", "c"], "max_tokens": 3})");
  auto ds = dispatched_n(h, 3);
  REQUIRE(ds.size() == 3);
  h.tokens(ds[0].first, ds[0].second.id, 0, 1, false);
  h.hub.send(ds[1].first, kRouterRank, proto::RequestFailed{ds[1].second.id, "boom", proto::FailureKind::kInternal});
  const HttpResult r = h.finish(f);
  CHECK(r.status == 500);
  CHECK(body_json(r)["error"]["message"] == "boom");
  // The others are dropped on their ranks.
  h.pump_for(50ms);
  std::set<proto::RequestId> cancelled;
  for (int rank : {kP1, kP2, kD1, kD2}) {
    for (auto& [src, m] : h.hub.take_all(rank)) h.inbox[rank].push_back(m);
    for (const proto::Message& m : h.inbox[rank])
      if (auto* c = std::get_if<proto::Cancel>(&m)) cancelled.insert(c->id);
  }
  CHECK(cancelled.count(ds[0].second.id));
  CHECK(cancelled.count(ds[2].second.id));
  // Late tokens of an ended choice change nothing.
  h.tokens(ds[2].second.decode_rank, ds[2].second.id, 0, 3, true);
  h.pump_for(20ms);
  CHECK(illegal_transitions() == 0);
}

TEST_CASE("router: echo with max_tokens 0 answers the prompt and its logprobs, first one null", "[router]") {
  Harness h;
  auto f = h.post(R"({"model": "tiny", "prompt": [[100, 101, 102]], "echo": true, "max_tokens": 0, "logprobs": 1})");
  auto d = h.dispatched();
  REQUIRE(d);
  const proto::PrefillRequest& pr = d->second;
  CHECK(pr.sampling.prompt_logprobs);
  CHECK(pr.sampling.logprobs == 1);
  CHECK(pr.sampling.max_tokens == 1);
  proto::TokenEvent ev;
  ev.id = pr.id;
  ev.tokens = {104};
  ev.finish = proto::Finish::kLength;
  ev.logprobs = {LogprobEntry{104, -0.5f, {{104, -0.5f}}}};
  ev.prompt_logprobs = {LogprobEntry{101, -2.0f, {{103, -1.0f}}}, LogprobEntry{102, -0.25f, {{102, -0.25f}}}};
  h.hub.send(d->first, kRouterRank, proto::TokenEvents{{ev}});
  const HttpResult r = h.finish(f);
  REQUIRE(r.status == 200);
  const nlohmann::json j = body_json(r);
  const nlohmann::json& c = j["choices"][0];
  const ModelInfo info = tiny_model_info();
  const Tokenizer& tok = *info.tokenizer;
  CHECK(c["text"] == tok.decode({100, 101, 102}));  // the sampled token is not part of the answer
  CHECK(c["finish_reason"] == "length");
  const nlohmann::json& lp = c["logprobs"];
  REQUIRE(lp["tokens"].size() == 3);
  CHECK(lp["tokens"][1] == tok.token_to_bytes(101));
  CHECK(lp["token_logprobs"] == nlohmann::json::parse("[null, -2.0, -0.25]"));
  CHECK(lp["top_logprobs"][0].is_null());
  CHECK(lp["top_logprobs"][1].size() == 2);  // the alternative and the token itself
  CHECK(lp["top_logprobs"][1][tok.token_to_bytes(103)] == -1.0);
  CHECK(lp["text_offset"][0] == 0);
  CHECK(j["usage"]["prompt_tokens"] == 3);
  CHECK(j["usage"]["completion_tokens"] == 0);
}

TEST_CASE("router: token ids outside the vocabulary and bad tokenizer bodies are 400s naming the field", "[router]") {
  Harness h;
  auto f = h.post(R"({"model": "tiny", "prompt": [[1, 2], [3, 99999]]})");
  HttpResult r = h.finish(f);
  CHECK(r.status == 400);
  CHECK(body_json(r)["error"]["param"] == "prompt");
  CHECK_THAT(body_json(r)["error"]["message"].get<std::string>(), Catch::Matchers::Contains("prompt[1][1] is token id 99999"));
  f = h.post(R"({"tokens": [1, 300]})", "/detokenize");
  r = h.finish(f);
  CHECK(r.status == 400);
  CHECK(body_json(r)["error"]["param"] == "tokens");
  f = h.post(R"({"prompt": 1})", "/v1/tokenize");
  CHECK(h.finish(f).status == 400);
  f = h.post(R"({"prompt": "x", "model": "other"})", "/tokenize");
  CHECK(h.finish(f).status == 404);
  // A round trip through both.
  f = h.post(R"({"prompt": "hello world"})", "/tokenize");
  r = h.finish(f);
  REQUIRE(r.status == 200);
  const nlohmann::json t = body_json(r);
  CHECK(t["count"] == t["tokens"].size());
  CHECK(t["max_model_len"] == 512);
  f = h.post(nlohmann::json{{"tokens", t["tokens"]}}.dump(), "/v1/detokenize");
  r = h.finish(f);
  REQUIRE(r.status == 200);
  CHECK(body_json(r)["prompt"] == "hello world");
}

}  // namespace
}  // namespace pd::router
