// The router stepped by hand (Router::run_once) against the in-process control
// channel: the test plays the prefill and decode ranks (heartbeats, tokens,
// failures, going silent) and the client, whose requests go straight to
// Router::submit with a RecordingWriter in place of a connection. No sockets,
// no MPI job, no sleeping: the router's clock is a FakeEnv each pump() steps.
#pragma once

#include <catch2/catch.hpp>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gguf/gguf_reader.h"
#include "gguf/gguf_writer.h"
#include "fake_channel.h"
#include "router/router.h"
#include "fake_env.h"
#include "util/env.h"
#include "util/lifecycle.h"

namespace pd::router::test_router {

using namespace std::chrono_literals;
using test::FakeChannelHub;

constexpr int kRouterRank = 0, kP1 = 1, kP2 = 2, kD1 = 3, kD2 = 4;

inline std::filesystem::path model_path() {
  return std::filesystem::temp_directory_path() / ("pd_router_test_" + std::to_string(::getpid()) + ".gguf");
}
inline std::string tiny_model_file() {
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
};
inline Cleanup cleanup_at_exit;

inline ModelInfo tiny_model_info() {
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

inline size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + what.size())) ++n;
  return n;
}

// What a client received: a plain response, or a stream (status 200, its events).
struct Answer {
  int status = 0;  // 0: not answered
  std::string content_type;
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;                 // a plain response's
  std::vector<std::string> events;  // a stream's data: payloads, [DONE] included
  bool stream_finished = false;
  // Everything the client read, events as "data: X\n\n" (what a socket would carry after the headers).
  std::string raw() const {
    std::string out = body;
    for (const std::string& e : events) out += "data: " + e + "\n\n";
    return out;
  }
  std::string header(const std::string& name) const {
    for (const auto& [k, v] : headers)
      if (k == name) return v;
    return "";
  }
  nlohmann::json json() const { return nlohmann::json::parse(body); }
  // The data: payloads of a stream, [DONE] excluded.
  std::vector<nlohmann::json> stream_events() const {
    std::vector<nlohmann::json> out;
    for (const std::string& e : events)
      if (e != "[DONE]") out.push_back(nlohmann::json::parse(e));
    return out;
  }
};

// A ResponseWriter that records what the router sends, holding it to the
// interface's contract: exactly one of respond() or start_sse() ... finish();
// any call out of turn is counted (and refused, as the real one refuses it).
// disconnect() plays the client going away.
class RecordingWriter : public ResponseWriter {
 public:
  bool respond(int status, std::string content_type, std::string body,
               std::vector<std::pair<std::string, std::string>> headers) override {
    if (began_ || gone_) return refuse();
    began_ = answered_ = true;
    a_.status = status;
    a_.content_type = std::move(content_type);
    a_.body = std::move(body);
    a_.headers = std::move(headers);
    return true;
  }
  bool start_sse() override {
    if (began_ || gone_) return refuse();
    began_ = true;
    a_.status = 200;
    a_.content_type = "text/event-stream";
    return true;
  }
  bool send_event(std::string data) override {
    if (!began_ || answered_ || a_.stream_finished || gone_) return refuse();
    a_.events.push_back(std::move(data));
    return true;
  }
  bool finish() override {
    if (!began_ || answered_ || a_.stream_finished || gone_) return refuse();
    a_.stream_finished = true;
    return true;
  }
  void on_disconnect(std::function<void()> cb) override { on_disconnect_ = std::move(cb); }

  // The final answer was given (a response, or the end of a stream).
  bool done() const { return answered_ || a_.stream_finished; }
  const Answer& answer() const { return a_; }
  int out_of_turn() const { return out_of_turn_; }
  // The client leaves before the final answer: the router's callback runs (as on an io thread).
  void disconnect() {
    gone_ = true;
    if (!done() && on_disconnect_) on_disconnect_();
  }

 private:
  bool refuse() {
    if (!gone_) ++out_of_turn_;
    return false;
  }
  Answer a_;
  bool began_ = false, answered_ = false, gone_ = false;
  int out_of_turn_ = 0;
  std::function<void()> on_disconnect_;
};

// The admin key the harness's router is configured with (http.admin_key).
inline const std::string kAdminKey = "test-admin-key";

// The router on a fake channel, 2 prefill + 2 decode ranks played by the test.
struct Harness {
  FakeChannelHub hub;
  ClusterConfig cfg;
  std::unique_ptr<Router> router;
  std::set<int> silent;  // ranks that stopped sending heartbeats
  std::vector<int> live{kP1, kP2, kD1, kD2};  // ranks the test plays (joined ones are added)
  std::chrono::steady_clock::time_point last_beat{};
  // The router's clock: deadlines (heartbeat_ms, rank_drain_ms, startup_ms) run on
  // it, and each pump() moves it 200 us.
  FakeEnv env;
  bool serve_http = false;  // true: the router also listens on a loopback port
  std::map<int, proto::Epoch> epochs;
  std::map<int, std::vector<proto::Message>> inbox;

  // `configure` may change the config further before the router is made.
  // `change_model` may change what the router knows of the model.
  // `drain_ms`: timeouts.rank_drain_ms and timeouts.stop_grace_ms.
  explicit Harness(int heartbeat_ms = 150, int drain_ms = 30000, bool http = false,
                   const std::function<void(ClusterConfig&)>& configure = {},
                   const std::function<void(ModelInfo&)>& change_model = {})
      : serve_http(http) {
    cfg.timeouts.rank_drain_ms = cfg.timeouts.stop_grace_ms = drain_ms;
    cfg.http.port = 0;
    cfg.timeouts.heartbeat_ms = heartbeat_ms;  // below the config's floor: the test's ranks beat every 10 ms
    cfg.http.admin_key = kAdminKey;  // the admin endpoints are closed without one
    if (configure) configure(cfg);
    RoleTable roles;
    roles.roles = {Role::kRouter, Role::kPrefill, Role::kPrefill, Role::kDecode, Role::kDecode};
    roles.hosts.assign(5, "test");
    roles.pids.assign(5, 0);
    roles.self = kRouterRank;
    roles.router = kRouterRank;
    roles.prefill = {kP1, kP2};
    roles.decode = {kD1, kD2};
    ModelInfo model = tiny_model_info();
    if (change_model) change_model(model);
    router = std::make_unique<Router>(cfg, roles, std::move(model), hub.endpoint(kRouterRank));
    router->set_env(&env);
    REQUIRE(router->start(serve_http).is_ok());
    for (int r : {kP1, kP2, kD1, kD2}) beat(r);
    pump_for(30ms);
  }
  ~Harness() { router.reset(); }

  int64_t total_blocks = 1000;  // the KV pool each rank's reports give

  void beat(int rank, proto::Epoch epoch = 0) {
    proto::LoadReport lr;
    lr.ready = true;
    lr.free_blocks = lr.total_blocks = total_blocks;
    lr.epoch = epoch;
    hub.send(rank, kRouterRank, lr);
  }
  // One router iteration; the live ranks beat every 10 ms.
  void pump() {
    if (env.now() - last_beat > 10ms) {
      for (int r : live)
        if (!silent.count(r)) beat(r, epochs[r]);
      last_beat = env.now();
    }
    router->run_once();
    env.advance(200us);
    if (serve_http) std::this_thread::sleep_for(200us);  // the HTTP threads run on real time
  }
  void pump_for(std::chrono::milliseconds d) {
    const auto end = env.now() + d;
    while (env.now() < end) pump();
  }
  // Pumps until a message of type T reaches `rank`; returns it (the others it took go to inbox).
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
  // Pumps until prompts reach the prefill ranks: (that rank, the request) for each, up to `n`.
  std::vector<std::pair<int, proto::PrefillRequest>> dispatched_n(size_t n, std::chrono::milliseconds within = 2000ms,
                                                                  const std::function<bool()>& stop = {}) {
    std::vector<std::pair<int, proto::PrefillRequest>> out;
    const auto end = env.now() + within;
    while (out.size() < n && env.now() < end && !(stop && stop())) {
      pump();
      for (int r : {kP1, kP2})
        for (auto& [src, m] : hub.take_all(r)) {
          inbox[r].push_back(m);
          if (auto* p = std::get_if<proto::PrefillRequest>(&m)) out.emplace_back(r, *p);
        }
    }
    return out;
  }
  std::optional<std::pair<int, proto::PrefillRequest>> dispatched(std::chrono::milliseconds within = 2000ms,
                                                                  const std::function<bool()>& stop = {}) {
    auto d = dispatched_n(1, within, stop);
    if (d.empty()) return std::nullopt;
    return d.front();
  }

  // A client's request, submitted as the HTTP server would hand it over;
  // `authorization`: its Authorization header ("" = none).
  std::shared_ptr<RecordingWriter> post(const std::string& body, const std::string& path = "/v1/completions",
                                        const std::string& authorization = "") {
    return submit("POST", path, body, authorization);
  }
  // POST to an admin route with the admin key.
  std::shared_ptr<RecordingWriter> admin_post(const std::string& body, const std::string& path = "/admin/drain") {
    return post(body, path, "Bearer " + kAdminKey);
  }
  std::shared_ptr<RecordingWriter> submit(const std::string& method, const std::string& path, const std::string& body,
                                          const std::string& authorization = "") {
    auto w = std::make_shared<RecordingWriter>();
    HttpRequest http;
    http.method = method;
    http.target = path;
    http.body = body;
    http.authorization = authorization;
    http.content_type = "application/json";
    router->submit(std::move(http), w);
    return w;
  }
  Answer get(const std::string& path) {
    auto w = submit("GET", path, "");
    return finish(w);
  }
  // Pumps until `w` got its final answer; the router never answered out of turn.
  Answer finish(const std::shared_ptr<RecordingWriter>& w, std::chrono::milliseconds within = 5000ms) {
    const auto end = env.now() + within;
    while (!w->done() && env.now() < end) pump();
    REQUIRE(w->done());
    CHECK(w->out_of_turn() == 0);
    return w->answer();
  }
  // As a worker: tokens [first, first + n) of request `id`, the last one ending it when `finish`;
  // each is `token` (byte token 'a' + 3 shows as "a").
  void tokens(int from, proto::RequestId id, int first, int n, bool finish, TokenId token = 'a' + 3) {
    proto::TokenEvents te;
    for (int i = 0; i < n; ++i) {
      proto::TokenEvent ev;
      ev.id = id;
      ev.first_index = first + i;
      ev.tokens = {token};  // a printable byte token of the tiny vocabulary
      ev.finish = finish && i + 1 == n ? proto::Finish::kLength : proto::Finish::kNone;
      te.events.push_back(ev);
    }
    hub.send(from, kRouterRank, te);
  }
  // Both legs answer request `pr` (dispatched to `prefill`): token 0, then `rest` more ending it.
  void serve(int prefill, const proto::PrefillRequest& pr, int rest = 2) {
    tokens(prefill, pr.id, 0, 1, false);
    tokens(pr.decode_rank, pr.id, 1, rest, true);
  }
  // Cancels the ranks received, collected from everything they were sent so far.
  std::set<proto::RequestId> cancelled() {
    std::set<proto::RequestId> out;
    for (int rank : {kP1, kP2, kD1, kD2}) {
      for (auto& [src, m] : hub.take_all(rank)) inbox[rank].push_back(m);
      for (const proto::Message& m : inbox[rank])
        if (auto* c = std::get_if<proto::Cancel>(&m)) out.insert(c->id);
    }
    return out;
  }
};

inline const std::string kBody = R"({"model": "tiny", "prompt": "hello", "max_tokens": 3})";
inline const std::string kStreamBody = R"({"model": "tiny", "prompt": "hello", "max_tokens": 3, "stream": true})";

}  // namespace pd::router::test_router
