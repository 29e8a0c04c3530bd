// The router's request lifecycle, driven through Router::submit with a
// recording writer (router_harness.h): dispatch, tokens from both legs in any
// order, failure kinds and their statuses, re-runs, a client leaving.
#include <set>

#include "router/router_harness.h"

namespace pd::router::test_router {
namespace {

TEST_CASE("router: queued -> dispatched -> streaming -> finished, tokens from both legs in any order", "[router]") {
  Harness h;
  auto f = h.post(kBody);
  auto d = h.dispatched();
  REQUIRE(d);
  const auto& [prefill, pr] = *d;
  h.tokens(pr.decode_rank, pr.id, 1, 2, true);  // the decode rank's tokens overtake the first one
  h.tokens(prefill, pr.id, 0, 1, false);
  const Answer r = h.finish(f);
  CHECK(r.status == 200);
  CHECK(r.content_type == "application/json");
  CHECK(r.raw().find("\"finish_reason\":\"length\"") != std::string::npos);
  CHECK(r.json()["choices"][0]["text"] == "aaa");  // three tokens, in order
  CHECK(r.json()["usage"]["completion_tokens"] == 3);
  CHECK(illegal_transitions() == 0);
}

TEST_CASE("router: a streamed answer sends its chunks in token order, then [DONE] once", "[router]") {
  Harness h;
  auto f = h.post(kStreamBody);
  auto d = h.dispatched();
  REQUIRE(d);
  CHECK(f->answer().status == 200);  // the stream began before any token
  CHECK(f->answer().content_type == "text/event-stream");
  h.serve(d->first, d->second);
  const Answer r = h.finish(f);
  CHECK(r.stream_finished);
  REQUIRE(r.events.size() >= 2);
  CHECK(r.events.back() == "[DONE]");
  CHECK(count(r.raw(), "data: [DONE]") == 1);
  std::string text;
  for (const nlohmann::json& e : r.stream_events()) text += e["choices"][0]["text"].get<std::string>();
  CHECK(text == "aaa");
  CHECK(illegal_transitions() == 0);
}

TEST_CASE("router: with router.migrate off, a decode rank lost after the first token ends the stream with one error",
          "[router]") {
  Harness h(150, 30000, false, [](ClusterConfig& c) { c.router.migrate = false; });
  auto f = h.post(kStreamBody);
  auto d = h.dispatched();
  REQUIRE(d);
  const auto& [prefill, pr] = *d;
  h.tokens(prefill, pr.id, 0, 1, false);  // the first token reaches the client
  h.pump_for(20ms);
  h.silent.insert(pr.decode_rank);
  const Answer r = h.finish(f);
  CHECK(r.status == 200);  // the stream had started
  CHECK(count(r.raw(), "\"error\"") == 1);
  CHECK(count(r.raw(), "data: [DONE]") == 1);
  CHECK(count(r.raw(), "finish_reason\":\"length") == 0);
  CHECK(r.raw().find("went down") != std::string::npos);
  CHECK(r.stream_finished);
}

// Byte tokens of the tiny vocabulary: token_of('x') shows as "x".
constexpr TokenId token_of(char c) { return static_cast<TokenId>(c) + 3; }

// The decode rank of attempt `d` goes silent (declared down after heartbeat_ms);
// returns the next attempt of the request `f` waits on.
std::optional<std::pair<int, proto::PrefillRequest>> lose_decode_rank(
    Harness& h, const std::shared_ptr<RecordingWriter>& f, const std::pair<int, proto::PrefillRequest>& d) {
  h.pump_for(20ms);
  h.silent.insert(d.second.decode_rank);
  return h.dispatched(2000ms, [&] { return f->done(); });
}

TEST_CASE("router: a decode rank lost mid-stream: the stream goes on from the next token on another pair", "[router]") {
  for (bool stream : {true, false}) {
    INFO((stream ? "streamed" : "not streamed"));
    Harness h;
    auto f = h.post(stream ? R"({"model": "tiny", "prompt": "hello", "max_tokens": 5, "stream": true,
                                 "stream_options": {"include_usage": true}})"
                           : R"({"model": "tiny", "prompt": "hello", "max_tokens": 5})");
    auto d = h.dispatched();
    REQUIRE(d);
    const auto& [prefill, pr] = *d;
    h.tokens(prefill, pr.id, 0, 1, false, token_of('a'));
    h.tokens(pr.decode_rank, pr.id, 1, 1, false, token_of('b'));
    auto again = lose_decode_rank(h, f, *d);
    REQUIRE(again);
    const proto::PrefillRequest& m = again->second;
    CHECK(m.id != pr.id);
    CHECK(m.decode_rank != pr.decode_rank);
    std::vector<TokenId> want_prompt = pr.prompt;
    want_prompt.push_back(token_of('a'));
    want_prompt.push_back(token_of('b'));
    CHECK(m.prompt == want_prompt);  // the prompt, then the tokens the client has
    CHECK(m.sampling.resumed_tokens == 2);
    CHECK(m.sampling.max_tokens == 3);
    CHECK(m.sampling.seed == pr.sampling.seed);  // the same draw stream, replayed by the workers
    h.tokens(pr.decode_rank, pr.id, 2, 1, false, token_of('z'));  // the old attempt's late token: ignored
    h.tokens(again->first, m.id, 0, 1, false, token_of('c'));
    h.tokens(m.decode_rank, m.id, 1, 2, true, token_of('d'));
    const Answer r = h.finish(f);
    CHECK(r.status == 200);
    CHECK(count(r.raw(), "\"error\"") == 0);
    nlohmann::json usage;
    std::string text;
    if (stream) {
      CHECK(r.stream_finished);
      CHECK(count(r.raw(), "data: [DONE]") == 1);
      for (const nlohmann::json& e : r.stream_events()) {
        if (!e["choices"].empty()) text += e["choices"][0]["text"].get<std::string>();
        if (e.contains("usage") && !e["usage"].is_null()) usage = e["usage"];
      }
    } else {
      text = r.json()["choices"][0]["text"].get<std::string>();
      usage = r.json()["usage"];
    }
    CHECK(text == "abcdd");  // every token once, in order
    CHECK(count(r.raw(), "finish_reason\":\"length") == 1);
    CHECK(usage["completion_tokens"] == 5);
    CHECK(usage["prompt_tokens"] == pr.prompt.size());  // the client's prompt, not the migrated one
    CHECK(h.get("/metrics").body.find("pd_requests_migrated_total 1") != std::string::npos);
    CHECK(illegal_transitions() == 0);
  }
}

TEST_CASE("router: which failed attempts run again, and what a migrated attempt sends", "[router]") {
  Request r;
  r.wire_id = 9;
  r.prompt = {5, 6, 7};
  r.api.sampling.max_tokens = 4;
  r.api.sampling.prompt_logprobs = true;
  r.api.sampling.logprobs = 0;
  const RerunPolicy on{3, true}, off{3, false};
  r.state = RequestState::kDispatched;
  r.attempts = 1;
  CHECK(may_rerun(r, off, false));  // no token out: a re-run, migration or not
  CHECK_FALSE(may_rerun(r, on, true));  // stopping
  r.attempts = 3;
  CHECK_FALSE(may_rerun(r, on, false));  // attempts used up
  r.attempts = 1;
  r.state = RequestState::kStreaming;
  r.generated = {40, 41};
  CHECK(may_rerun(r, on, false));
  CHECK_FALSE(may_rerun(r, off, false));
  const proto::PrefillRequest m = attempt_message(r, 4);
  CHECK(m.id == 9);
  CHECK(m.decode_rank == 4);
  CHECK(m.prompt == std::vector<TokenId>{5, 6, 7, 40, 41});
  CHECK(m.sampling.resumed_tokens == 2);
  CHECK(m.sampling.max_tokens == 2);
  CHECK_FALSE(m.sampling.prompt_logprobs);
  CHECK(attempt_prompt_tokens(r) == 5);
  r.generated = {40, 41, 42, 43};  // every token out: nothing left to migrate
  CHECK_FALSE(may_rerun(r, on, false));
  r.state = RequestState::kFinished;
  r.generated.clear();
  CHECK_FALSE(may_rerun(r, on, false));
}

TEST_CASE("router: a re-run request's queue deadline counts from when it went back to the queue", "[router]") {
  Harness h(150, 30000, false, [](ClusterConfig& c) {
    c.router.max_inflight_per_worker = 1;  // two pairs, each busy with one request
    c.timeouts.queue_ms = 300;
  });
  auto a = h.post(kBody);
  auto b = h.post(kBody);
  auto ds = h.dispatched_n(2, 50ms);
  REQUIRE(ds.size() == 2);
  if (ds[0].second.id > ds[1].second.id) std::swap(ds[0], ds[1]);  // a's first
  h.pump_for(400ms);  // both arrived longer than queue_ms ago
  h.silent.insert(ds[0].second.decode_rank);
  h.pump_for(250ms);  // declared down after 150 ms: a is back in the queue, no pair free
  CHECK_FALSE(a->done());  // waiting, not 503 at once
  h.serve(ds[1].first, ds[1].second);  // b ends: its pair takes a
  CHECK(h.finish(b).status == 200);
  auto again = h.dispatched(500ms, [&] { return a->done(); });
  REQUIRE(again);
  h.serve(again->first, again->second);
  CHECK(h.finish(a).status == 200);
}

// With tools offered, text that may begin a call is held back; a stop string
// matching after it must still release it (the text before the stop is the
// answer), streamed or not.
TEST_CASE("router: a stop string after text held back as a possible tool call keeps that text", "[router]") {
  Harness h(150, 30000, false, {}, [](ModelInfo& m) {
    auto t = ChatTemplate::from_name("hermes");
    REQUIRE(t.is_ok());
    m.chat_template = std::move(t).value();
  });
  for (const bool stream : {false, true}) {
    CAPTURE(stream);
    auto f = h.post(std::string(R"({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20,
        "stop": ["b>"], "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "stream": )") + (stream ? "true" : "false") + "}",
                    "/v1/chat/completions");
    auto d = h.dispatched();
    REQUIRE(d);
    const std::string out = "Use a <b>bold";
    h.tokens(d->first, d->second.id, 0, 1, false, token_of(out[0]));
    for (size_t i = 1; i < out.size(); ++i)
      h.tokens(d->second.decode_rank, d->second.id, static_cast<int>(i), 1, false, token_of(out[i]));
    const Answer r = h.finish(f);
    REQUIRE(r.status == 200);
    std::string content;
    if (!stream) {
      content = r.json()["choices"][0]["message"]["content"].get<std::string>();
      CHECK(r.json()["choices"][0]["finish_reason"] == "stop");
    } else {
      for (const std::string& e : r.events) {
        if (e == "[DONE]") continue;
        const nlohmann::json j = nlohmann::json::parse(e);
        if (!j["choices"].empty() && j["choices"][0]["delta"].contains("content"))
          content += j["choices"][0]["delta"]["content"].get<std::string>();
      }
    }
    CHECK(content == "Use a <");
  }
  CHECK(illegal_transitions() == 0);
}

// parallel_tool_calls false: a reply that makes two calls gives the first only
// (vLLM's reading), streamed or not; true (the default) gives both.
TEST_CASE("router: parallel_tool_calls false keeps a reply's first tool call", "[router]") {
  Harness h(150, 30000, false, {}, [](ModelInfo& m) {
    auto t = ChatTemplate::from_name("hermes");
    REQUIRE(t.is_ok());
    m.chat_template = std::move(t).value();
    m.context = 2048;  // the tools' system prompt and two calls, a byte a token
  });
  const std::string call = "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\n";
  const std::string out = call + call;
  for (const bool parallel : {false, true})
    for (const bool stream : {false, true}) {
      CAPTURE(parallel, stream);
      auto f = h.post(std::string(R"({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
          "max_tokens": 200, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
          "parallel_tool_calls": )") + (parallel ? "true" : "false") + R"(, "stream": )" + (stream ? "true" : "false") + "}",
                      "/v1/chat/completions");
      auto d = h.dispatched();
      if (!d) FAIL(h.finish(f).body);
      h.tokens(d->first, d->second.id, 0, 1, false, token_of(out[0]));
      for (size_t i = 1; i < out.size(); ++i)
        h.tokens(d->second.decode_rank, d->second.id, static_cast<int>(i), 1, i + 1 == out.size(), token_of(out[i]));
      const Answer r = h.finish(f);
      REQUIRE(r.status == 200);
      std::set<int> indices;
      if (!stream) {
        const nlohmann::json j = r.json();
        for (size_t k = 0; k < j["choices"][0]["message"]["tool_calls"].size(); ++k) indices.insert(static_cast<int>(k));
      } else {
        for (const std::string& e : r.events) {
          if (e == "[DONE]") continue;
          const nlohmann::json j = nlohmann::json::parse(e);
          if (j["choices"].empty() || !j["choices"][0]["delta"].contains("tool_calls")) continue;
          for (const auto& c : j["choices"][0]["delta"]["tool_calls"]) indices.insert(c["index"].get<int>());
        }
      }
      CHECK(indices.size() == (parallel ? 2u : 1u));
    }
}

TEST_CASE("router: a stop string split across a migration still stops the choice", "[router]") {
  Harness h;
  auto f = h.post(R"({"model": "tiny", "prompt": "hello", "max_tokens": 8, "stop": ["bc"]})");
  auto d = h.dispatched();
  REQUIRE(d);
  h.tokens(d->first, d->second.id, 0, 1, false, token_of('a'));
  h.tokens(d->second.decode_rank, d->second.id, 1, 1, false, token_of('b'));  // held back: it may start "bc"
  auto again = lose_decode_rank(h, f, *d);
  REQUIRE(again);
  h.tokens(again->first, again->second.id, 0, 1, false, token_of('c'));
  const Answer r = h.finish(f);
  REQUIRE(r.status == 200);
  CHECK(r.json()["choices"][0]["text"] == "a");
  CHECK(r.json()["choices"][0]["finish_reason"] == "stop");
  CHECK(h.cancelled().count(again->second.id) == 1);  // the new attempt's ranks are told it ended
  CHECK(illegal_transitions() == 0);
}

TEST_CASE("router: a migration asks for no prompt logprobs again and the echo is not repeated", "[router]") {
  Harness h;
  auto f = h.post(R"({"model": "tiny", "prompt": "hello", "max_tokens": 3, "echo": true, "logprobs": 1})");
  auto d = h.dispatched();
  REQUIRE(d);
  CHECK(d->second.sampling.prompt_logprobs);
  h.tokens(d->first, d->second.id, 0, 1, false, token_of('a'));
  auto again = lose_decode_rank(h, f, *d);
  REQUIRE(again);
  CHECK_FALSE(again->second.sampling.prompt_logprobs);
  CHECK(again->second.sampling.logprobs == 1);
  h.tokens(again->first, again->second.id, 0, 1, false, token_of('b'));
  h.tokens(again->second.decode_rank, again->second.id, 1, 1, true, token_of('c'));
  const Answer r = h.finish(f);
  REQUIRE(r.status == 200);
  CHECK(r.json()["choices"][0]["text"] == "helloabc");  // the prompt once, then every token once
  CHECK(r.json()["choices"][0]["logprobs"]["tokens"].size() == r.json()["choices"][0]["logprobs"]["token_logprobs"].size());
  CHECK(illegal_transitions() == 0);
}

TEST_CASE("router: workers report failure kinds, the router picks the status and re-runs the retryable ones",
          "[router]") {
  Harness h;
  auto run = [&](proto::FailureKind kind, bool from_decode) {
    auto f = h.post(kBody);
    auto d = h.dispatched();
    REQUIRE(d);
    h.hub.send(from_decode ? d->second.decode_rank : d->first, kRouterRank,
               proto::RequestFailed{d->second.id, "why", kind});
    // A retryable kind comes back as a new attempt: answer that one.
    auto again = h.dispatched(300ms, [&] { return f->done(); });
    if (again) {
      CHECK(again->second.id != d->second.id);  // a new wire id for the new attempt
      h.serve(again->first, again->second);
    }
    return h.finish(f).status;
  };
  CHECK(run(proto::FailureKind::kInvalid, false) == 400);
  CHECK(run(proto::FailureKind::kOverloaded, true) == 503);
  CHECK(run(proto::FailureKind::kTimeout, false) == 504);
  CHECK(run(proto::FailureKind::kInternal, true) == 500);
  CHECK(run(proto::FailureKind::kPeerDown, true) == 200);  // re-run elsewhere, then served
  CHECK(run(proto::FailureKind::kTransfer, false) == 200);
  CHECK(h.get("/metrics").body.find("pd_requests_retried_total 2") != std::string::npos);
}

TEST_CASE("router: a request re-run router.max_attempts times fails with the last attempt's status", "[router]") {
  Harness h;
  const int max_attempts = h.cfg.router.max_attempts;
  auto f = h.post(kBody);
  std::set<proto::RequestId> ids;
  for (int attempt = 0; attempt < max_attempts; ++attempt) {
    auto d = h.dispatched(2000ms, [&] { return f->done(); });
    REQUIRE(d);
    ids.insert(d->second.id);
    h.hub.send(d->first, kRouterRank, proto::RequestFailed{d->second.id, "link broke", proto::FailureKind::kTransfer});
  }
  const Answer r = h.finish(f);
  CHECK(r.status == 500);
  CHECK(r.json()["error"]["message"] == "link broke");
  CHECK(ids.size() == static_cast<size_t>(max_attempts));  // each attempt under its own wire id
}

TEST_CASE("router: a client that leaves cancels its request on both legs, late tokens change nothing", "[router]") {
  Harness h;
  auto f = h.post(kStreamBody);
  auto d = h.dispatched();
  REQUIRE(d);
  h.tokens(d->first, d->second.id, 0, 1, false);
  h.pump_for(5ms);
  f->disconnect();
  h.pump_for(5ms);
  const std::set<proto::RequestId> cancelled = h.cancelled();
  CHECK(cancelled.count(d->second.id) == 1);
  bool decode_told = false;
  for (const proto::Message& m : h.inbox[d->second.decode_rank])
    if (auto* c = std::get_if<proto::Cancel>(&m)) decode_told |= c->id == d->second.id;
  CHECK(decode_told);
  const size_t events = f->answer().events.size();
  h.tokens(d->second.decode_rank, d->second.id, 1, 2, true);
  h.pump_for(5ms);
  CHECK(f->answer().events.size() == events);
  CHECK(h.get("/metrics").body.find("pd_requests_total{outcome=\"cancelled\"} 1") != std::string::npos);
  CHECK(illegal_transitions() == 0);
}

TEST_CASE("router: a request no worker takes within queue_ms fails 503, one past request_ms 504", "[router]") {
  Harness h(150, 30000, false, [](ClusterConfig& c) {
    c.router.max_inflight_per_worker = 1;  // two pairs: a third request waits in the router's queue
    c.timeouts.queue_ms = 100;
    c.timeouts.request_ms = 400;
  });
  std::vector<std::shared_ptr<RecordingWriter>> fs;
  for (int i = 0; i < 3; ++i) fs.push_back(h.post(kBody));
  auto ds = h.dispatched_n(3, 50ms);
  CHECK(ds.size() == 2);  // the workers never answer
  const Answer queued = h.finish(fs[2], 300ms);
  CHECK(queued.status == 503);
  CHECK(queued.json()["error"]["message"] == "no worker could take the request within 100 ms");
  CHECK(queued.header("Retry-After") == "1");  // a 503: the cluster may take it later
  const Answer late = h.finish(fs[0], 1000ms);
  CHECK(late.status == 504);
  CHECK(late.header("Retry-After").empty());
  CHECK(late.json()["error"]["message"] == "the request did not finish within 400 ms");
  CHECK(h.finish(fs[1], 100ms).status == 504);
  CHECK(h.cancelled() == std::set<proto::RequestId>{ds[0].second.id, ds[1].second.id});  // the workers drop them
  CHECK(h.get("/metrics").body.find("pd_requests_total{outcome=\"timeout\"} 2") != std::string::npos);
  CHECK(illegal_transitions() == 0);
}

TEST_CASE("router: when one choice of n fails, the others end with it and count as it does, not as cancelled",
          "[router]") {
  Harness h;
  auto f = h.post(R"({"model": "tiny", "prompt": "hello", "max_tokens": 3, "n": 3})");
  auto ds = h.dispatched_n(3, 100ms);
  REQUIRE(ds.size() == 3);
  h.hub.send(ds[0].first, kRouterRank, proto::RequestFailed{ds[0].second.id, "too long", proto::FailureKind::kInvalid});
  CHECK(h.finish(f).status == 400);
  h.pump_for(20ms);
  const std::string metrics = h.get("/metrics").body;
  INFO(metrics);
  CHECK(metrics.find("pd_requests_total{outcome=\"failed\"} 3") != std::string::npos);
  CHECK(metrics.find("pd_requests_total{outcome=\"cancelled\"}") == std::string::npos);  // none counted
  CHECK(h.cancelled().size() == 3);  // the workers drop every choice
}

}  // namespace
}  // namespace pd::router::test_router

namespace pd::router::test_router {
namespace {

// A prompt of 80 byte tokens: 4 full blocks of 16 are cacheable (never the last token).
const std::string kLongBody = R"({"model": "tiny", "prompt": ")" + std::string(80, 'x') + R"(", "max_tokens": 3})";

TEST_CASE("router: a prompt a decode rank holds goes to that decode rank, usage counts its cached tokens",
          "[router]") {
  for (const char* policy : {"cache_aware", "least_work"}) {
    CAPTURE(policy);
    Harness h(150, 30000, false, [&](ClusterConfig& c) { c.router.policy = policy; });
    auto f = h.post(kLongBody);
    auto d = h.dispatched();
    REQUIRE(d);
    const auto [prefill, pr] = *d;
    h.serve(prefill, pr);
    CHECK(h.finish(f).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0);
    // The decode rank's cache now holds the prompt's blocks (its KV events say so).
    const int decode = pr.decode_rank;
    h.hub.send(decode, kRouterRank, proto::KvEvents{0, false, prompt_block_hashes(pr.prompt, 16), {}});
    auto again = h.post(kLongBody);
    if (std::string(policy) == "least_work") {  // the index is not consulted
      auto d2 = h.dispatched();
      REQUIRE(d2);
      h.serve(d2->first, d2->second);
      h.finish(again);
      continue;
    }
    auto m = h.expect<proto::PrefillRequest>(decode);
    REQUIRE(m);
    CHECK(m->decode_rank == decode);  // it computes the rest itself and decodes
    CHECK(m->prompt == pr.prompt);
    proto::TokenEvent first;
    first.id = m->id;
    first.tokens = {'a' + 3};
    first.cached_tokens = 64;
    h.hub.send(decode, kRouterRank, proto::TokenEvents{{first}});
    h.tokens(decode, m->id, 1, 2, true);
    const Answer a = h.finish(again);
    CHECK(a.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 64);
    CHECK(a.json()["usage"]["prompt_tokens"] == m->prompt.size());  // 80 (the test vocabulary adds no BOS)
    CHECK(m->prompt.size() == 80);
    // Declared down, the decode rank's entry is gone: the next one goes to a prefill rank.
    h.silent.insert(decode);
    h.pump_for(400ms);
    auto third = h.post(kLongBody);
    auto d3 = h.dispatched();
    REQUIRE(d3);
    CHECK(d3->second.decode_rank != decode);
    h.serve(d3->first, d3->second);
    h.finish(third);
    CHECK(illegal_transitions() == 0);
  }
}

}  // namespace
}  // namespace pd::router::test_router
