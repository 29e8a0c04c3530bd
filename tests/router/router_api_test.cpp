// The router's API side, driven through Router::submit with a recording writer
// (router_harness.h): seeds, batches of prompts x n, echo with logprobs, the
// tokenizer routes, the 400s naming a field and the bound on a non-streamed
// answer (router.max_answer_entries).
#include "router/router_harness.h"

#include <atomic>
#include <tuple>

namespace pd::router::test_router {
namespace {

TEST_CASE("router: a request without a seed gets a fresh one, a given seed is kept", "[router]") {
  Harness h;
  std::set<uint64_t> seeds;
  for (int i = 0; i < 3; ++i) {
    auto f = h.post(R"({"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 1})");
    auto d = h.dispatched();
    REQUIRE(d);
    seeds.insert(d->second.sampling.seed);
    CHECK(d->second.sampling.temperature == 1.0f);
    h.serve(d->first, d->second);
    CHECK(h.finish(f).status == 200);
  }
  CHECK(seeds.size() == 3);  // 2^-64-ish odds of a repeat
  for (int i = 0; i < 2; ++i) {
    auto f = h.post(R"({"model": "tiny", "prompt": "hello", "max_tokens": 3, "seed": 77})");
    auto d = h.dispatched();
    REQUIRE(d);
    CHECK(d->second.sampling.seed == 77u);
    h.serve(d->first, d->second);
    CHECK(h.finish(f).status == 200);
  }
}

TEST_CASE("router: a batch of prompts x n gets its choices in index order, usage summed", "[router]") {
  Harness h;
  auto f = h.post(R"({"model": "tiny", "prompt": ["hello", "hi there"], "n": 2, "max_tokens": 2, "seed": 7})");
  auto ds = h.dispatched_n(4);
  REQUIRE(ds.size() == 4);
  std::map<std::vector<int32_t>, std::set<uint64_t>> seeds_by_prompt;
  for (auto& [prefill, pr] : ds) seeds_by_prompt[pr.prompt].insert(pr.sampling.seed);
  REQUIRE(seeds_by_prompt.size() == 2);
  for (auto& [prompt, seeds] : seeds_by_prompt) CHECK(seeds == std::set<uint64_t>{7, 8});  // choice j: seed + j
  // Answer them in reverse order: the body still lists choices by index.
  for (auto it = ds.rbegin(); it != ds.rend(); ++it) h.serve(it->first, it->second, 1);
  const Answer r = h.finish(f);
  REQUIRE(r.status == 200);
  const nlohmann::json j = r.json();
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
  auto ds = h.dispatched_n(2);
  REQUIRE(ds.size() == 2);
  CHECK(ds[0].second.prompt != ds[1].second.prompt);  // token-id prompts as given
  for (auto& [prefill, pr] : ds) h.serve(prefill, pr, 1);
  const Answer r = h.finish(f);
  REQUIRE(r.status == 200);
  CHECK(count(r.raw(), "data: [DONE]") == 1);
  CHECK(r.events.back() == "[DONE]");
  std::map<int, int> finished;
  const std::vector<nlohmann::json> events = r.stream_events();
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
  auto ds = h.dispatched_n(3);
  REQUIRE(ds.size() == 3);
  h.tokens(ds[0].first, ds[0].second.id, 0, 1, false);
  h.hub.send(ds[1].first, kRouterRank, proto::RequestFailed{ds[1].second.id, "boom", proto::FailureKind::kInternal});
  const Answer r = h.finish(f);
  CHECK(r.status == 500);
  CHECK(r.json()["error"]["message"] == "boom");
  // The others are dropped on their ranks.
  h.pump_for(50ms);
  const std::set<proto::RequestId> cancelled = h.cancelled();
  CHECK(cancelled.count(ds[0].second.id));
  CHECK(cancelled.count(ds[2].second.id));
  // Late tokens of an ended choice change nothing.
  h.tokens(ds[2].second.decode_rank, ds[2].second.id, 0, 3, true);
  h.pump_for(20ms);
  CHECK(f->out_of_turn() == 0);
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
  const Answer r = h.finish(f);
  REQUIRE(r.status == 200);
  const nlohmann::json j = r.json();
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
  Answer r = h.finish(f);
  CHECK(r.status == 400);
  CHECK(r.json()["error"]["param"] == "prompt[1][1]");
  CHECK_THAT(r.json()["error"]["message"].get<std::string>(), Catch::Matchers::Contains("prompt[1][1] is token id 99999"));
  f = h.post(R"({"tokens": [1, 300]})", "/detokenize");
  r = h.finish(f);
  CHECK(r.status == 400);
  CHECK(r.json()["error"]["param"] == "tokens");
  f = h.post(R"({"prompt": 1})", "/v1/tokenize");
  CHECK(h.finish(f).status == 400);
  f = h.post(R"({"prompt": "x", "model": "other"})", "/tokenize");
  CHECK(h.finish(f).status == 404);
  // A round trip through both.
  f = h.post(R"({"prompt": "hello world"})", "/tokenize");
  r = h.finish(f);
  REQUIRE(r.status == 200);
  const nlohmann::json t = r.json();
  CHECK(t["count"] == t["tokens"].size());
  CHECK(t["max_model_len"] == 512);
  f = h.post(nlohmann::json{{"tokens", t["tokens"]}}.dump(), "/v1/detokenize");
  r = h.finish(f);
  REQUIRE(r.status == 200);
  CHECK(r.json()["prompt"] == "hello world");
}

TEST_CASE("router: routes answer 404 for unknown paths and 405 naming the allowed method", "[router]") {
  Harness h;
  const Answer none = h.get("/v2/nothing");
  CHECK(none.status == 404);
  CHECK(none.json()["error"]["code"] == "not_found");
  auto f = h.post("{}", "/health");
  const Answer wrong = h.finish(f);
  CHECK(wrong.status == 405);
  CHECK(wrong.header("Allow") == "GET, HEAD");
  const Answer get_completions = h.get("/v1/completions");
  CHECK(get_completions.status == 405);
  CHECK(get_completions.header("Allow") == "POST");
  const Answer head_completions = h.finish(h.submit("HEAD", "/v1/completions", ""));
  CHECK(head_completions.status == 405);
  CHECK(head_completions.header("Allow") == "POST");
  const Answer models = h.get("/v1/models");
  CHECK(models.status == 200);
  CHECK(models.json()["data"][0]["id"] == "tiny");
  // HEAD reaches a GET route (the HTTP layer drops the body it answers with).
  const Answer head_health = h.finish(h.submit("HEAD", "/health", ""));
  CHECK(head_health.status == 200);
  const Answer head_models = h.finish(h.submit("HEAD", "/v1/models", ""));
  CHECK(head_models.status == 200);
}

TEST_CASE("router: prompts that do not fit the context are 400s naming the field", "[router]") {
  Harness h;
  auto f = h.post(R"({"model": "tiny", "prompt": "hello", "max_tokens": 600})");
  Answer r = h.finish(f);
  CHECK(r.status == 400);
  CHECK(r.json()["error"]["param"] == "max_tokens");
  f = h.post(nlohmann::json{{"model", "tiny"}, {"prompt", {std::vector<int>{1}, std::vector<int>(600, 1)}}}.dump());
  r = h.finish(f);
  CHECK(r.status == 400);
  CHECK(r.json()["error"]["param"] == "prompt[1]");
  CHECK(r.json()["error"]["message"] == "prompt[1] has 600 tokens; the model's context is 512");
  h.pump_for(5ms);
  CHECK(h.get("/metrics").body.find("pd_requests_total{outcome=\"rejected\"} 2") != std::string::npos);
}

TEST_CASE("router: a non-streamed answer over router.max_answer_entries is a 400 naming n, max_tokens and logprobs",
          "[router]") {
  // The default bound, with SmolLM2's context: one choice of the whole context
  // with 20 logprobs fits, 128 of them do not (unless streamed).
  Harness h(150, 30000, false, {}, [](ModelInfo& m) { m.context = 8192; });
  auto body = [](const std::string& ep_fields, int n, bool stream) {
    nlohmann::json j = nlohmann::json::parse(ep_fields);
    j["model"] = "tiny";
    j["n"] = n;
    j["stream"] = stream;
    return j.dump();
  };
  const std::string completions = R"({"prompt": "hello", "max_tokens": 8000, "logprobs": 20})";
  const std::string chat = R"({"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 20})";
  auto f = h.post(body(completions, 128, false));
  Answer r = h.finish(f);
  CHECK(r.status == 400);
  nlohmann::json e = r.json()["error"];
  CHECK(e["param"] == "n");
  CHECK(e["type"] == "invalid_request_error");
  for (const char* part : {"non-streamed answer of 128 choices", "8000 tokens (max_tokens)", "(1 + 20 logprobs)",
                           "21504000 token entries", "limit of 4194304 (router.max_answer_entries)",
                           "lower n, max_tokens or logprobs", "\"stream\": true"}) {
    CHECK_THAT(e["message"].get<std::string>(), Catch::Matchers::Contains(part));
  }
  f = h.post(body(chat, 128, false), "/v1/chat/completions");
  r = h.finish(f);
  CHECK(r.status == 400);
  e = r.json()["error"];
  CHECK(e["param"] == "n");
  CHECK_THAT(e["message"].get<std::string>(), Catch::Matchers::Contains("(1 + 20 top_logprobs)"));
  CHECK(h.dispatched(50ms) == std::nullopt);
  // Streamed, it holds nothing: admitted.
  f = h.post(body(completions, 128, true));
  CHECK(h.dispatched());
  f->disconnect();
  h.pump_for(10ms);
  h.cancelled();  // takes what its choices were sent: the next dispatched() is the next request's
  // One choice of the whole context (chat's default max_tokens) with 20 alternatives fits.
  for (const auto& [fields, path] : {std::pair{completions, std::string("/v1/completions")},
                                     std::pair{chat, std::string("/v1/chat/completions")}}) {
    INFO(path);
    f = h.post(body(fields, 1, false), path);
    auto d = h.dispatched();
    REQUIRE(d);
    h.serve(d->first, d->second);
    CHECK(h.finish(f).status == 200);
  }
}

TEST_CASE("router: router.max_answer_entries counts choices x (max_tokens + echoed prompt) x (1 + logprobs)",
          "[router]") {
  Harness h(150, 30000, false, [](ClusterConfig& c) { c.router.max_answer_entries = 100; });
  struct Case {
    std::string body;
    std::string refused_param;  // "" = admitted (100 entries at most)
  };
  const std::vector<Case> cases = {
      {R"({"prompt": "hello", "max_tokens": 50, "logprobs": 1})", ""},             // 50 x 2
      {R"({"prompt": "hello", "max_tokens": 51, "logprobs": 1})", "logprobs"},     // 51 x 2
      {R"({"prompt": "hello", "max_tokens": 100})", ""},                           // 100 x 1
      {R"({"prompt": "hello", "max_tokens": 101})", "max_tokens"},                 // 101 x 1
      {R"({"prompt": "hello", "max_tokens": 25, "n": 4})", ""},                    // 4 x 25
      {R"({"prompt": "hello", "max_tokens": 26, "n": 4})", "n"},                   // 4 x 26
      {R"({"prompt": ["a", "b"], "max_tokens": 50})", ""},                         // 2 prompts x 50
      {R"({"prompt": ["a", "b"], "max_tokens": 51})", "max_tokens"},               // 2 prompts x 51
      {R"({"prompt": [[1, 2, 3]], "echo": true, "max_tokens": 97})", ""},          // 97 + 3 echoed
      {R"({"prompt": [[1, 2, 3]], "echo": true, "max_tokens": 98})", "max_tokens"},
      {R"({"prompt": "hello", "max_tokens": 101, "stream": true})", ""},           // streamed: not bounded
  };
  int refused = 0;
  for (const Case& c : cases) {
    INFO(c.body);
    nlohmann::json j = nlohmann::json::parse(c.body);
    j["model"] = "tiny";
    auto f = h.post(j.dump());
    if (c.refused_param.empty()) {
      const auto ds = h.dispatched_n(j.contains("prompt") && j["prompt"].size() == 2 ? 2 : j.value("n", 1));
      REQUIRE(!ds.empty());
      for (const auto& [prefill, pr] : ds) h.serve(prefill, pr);
      CHECK(h.finish(f).status == 200);
      continue;
    }
    ++refused;
    const Answer r = h.finish(f);
    CHECK(r.status == 400);
    CHECK(r.json()["error"]["param"] == c.refused_param);
    CHECK_THAT(r.json()["error"]["message"].get<std::string>(),
               Catch::Matchers::Contains("limit of 100 (router.max_answer_entries)"));
  }
  h.pump_for(5ms);
  CHECK(h.get("/metrics").body.find("pd_requests_total{outcome=\"rejected\"} " + std::to_string(refused)) !=
        std::string::npos);
}

TEST_CASE("router: the admin key, answer and write buffer bounds: config defaults and ranges", "[router]") {
  const ClusterConfig d;
  CHECK(d.http.admin_key.empty());
  CHECK(d.http.max_write_buffer_bytes == 4 << 20);
  CHECK(d.router.max_answer_entries == 1 << 22);
  auto ok = ClusterConfig::parse(R"({"http": {"api_key": "a", "admin_key": "b", "max_write_buffer_bytes": 65536},
                                     "router": {"max_answer_entries": 1000}})");
  INFO(ok.status().to_string());
  REQUIRE(ok.is_ok());
  CHECK(ok->http.admin_key == "b");
  CHECK(ok->http.max_write_buffer_bytes == 65536);
  CHECK(ok->router.max_answer_entries == 1000);
  auto err = [](const std::string& text) {
    auto r = ClusterConfig::parse(text);
    return r.is_ok() ? std::string() : r.status().message();
  };
  CHECK_THAT(err(R"({"http": {"max_write_buffer_bytes": 100}})"), Catch::Matchers::Contains("http.max_write_buffer_bytes"));
  CHECK_THAT(err(R"({"router": {"max_answer_entries": 0}})"), Catch::Matchers::Contains("router.max_answer_entries"));
  CHECK_THAT(err(R"({"http": {"admin_key": 5}})"), Catch::Matchers::Contains("http.admin_key"));
  // The API key must not open the admin endpoints.
  CHECK_THAT(err(R"({"http": {"api_key": "same", "admin_key": "same"}})"),
             Catch::Matchers::Contains("'http.admin_key' must differ from 'http.api_key'"));
}

// The harness's clock, but while `slow` each reading takes a while: admission
// reads the queue, then stamps each choice's arrival before queueing them, so
// this widens the window in which requests posted together used to see the
// same room and overfill the queue between them.
class SlowClock final : public Env {
 public:
  explicit SlowClock(const Env& inner) : inner_(inner) {}
  Clock::time_point now() const override {
    if (slow.load()) std::this_thread::sleep_for(std::chrono::microseconds(20));
    return inner_.now();
  }
  bool rank_gone(int rank) const override { return inner_.rank_gone(rank); }
  std::atomic<bool> slow{true};

 private:
  const Env& inner_;
};

TEST_CASE("router: router.max_queued bounds the queue as a whole when requests arrive together", "[router]") {
  // Nothing is dispatched while the clients post (the link is not stepped), so
  // every admitted choice stays queued: 256 room, 4 x 128 asked at once.
  constexpr int kClients = 4;
  Harness h(150, 30000, false, [](ClusterConfig& c) { c.router.max_queued = 256; });
  SlowClock clock(h.env);
  h.router->set_env(&clock);
  std::vector<std::shared_ptr<RecordingWriter>> writers(kClients);
  std::atomic<int> ready{0};
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.emplace_back([&, i] {
      ++ready;
      while (ready.load() < kClients) std::this_thread::yield();
      writers[i] = h.post(R"({"model": "tiny", "prompt": "Item )" + std::to_string(i) +
                          R"(:", "max_tokens": 30, "n": 128, "stream": true})");
    });
  }
  for (std::thread& t : clients) t.join();
  clock.slow = false;
  int full = 0;
  for (const auto& w : writers) {
    if (w->answer().status != 503) continue;
    ++full;
    CHECK_THAT(w->answer().body, Catch::Matchers::Contains("queue has no room"));
    CHECK(w->answer().header("Retry-After") != "");
  }
  CHECK(full == kClients - 2);  // two fit exactly; the others took no room
  // The queue holds 256: one more choice does not fit either.
  auto one = h.post(R"({"model": "tiny", "prompt": "x", "max_tokens": 3})");
  CHECK(one->answer().status == 503);
  for (const auto& w : writers) w->disconnect();
  h.pump_for(20ms);
  h.router->set_env(&h.env);  // `clock` goes before the router
}

TEST_CASE("router: control tokens are left out of the text unless skip_special_tokens is false", "[router]") {
  Harness h;
  const TokenId im_start = tiny_model_info().tokenizer->find_token("<|im_start|>");
  auto run = [&](const std::string& extra, bool stream) {
    auto f = h.post(R"({"model": "tiny", "prompt": "hello", "max_tokens": 3, "logprobs": 0)" + extra +
                    (stream ? R"(, "stream": true})" : "}"));
    auto d = h.dispatched();
    REQUIRE(d);
    h.tokens(d->first, d->second.id, 0, 1, false);
    h.tokens(d->second.decode_rank, d->second.id, 1, 1, false, im_start);
    h.tokens(d->second.decode_rank, d->second.id, 2, 1, true);
    const Answer r = h.finish(f);
    REQUIRE(r.status == 200);
    std::string text;
    std::vector<std::string> tokens;
    std::vector<int64_t> offsets;
    if (!stream) {
      const nlohmann::json c = r.json()["choices"][0];
      text = c["text"];
      for (const auto& t : c["logprobs"]["tokens"]) tokens.push_back(t);
      for (const auto& o : c["logprobs"]["text_offset"]) offsets.push_back(o);
    }
    for (const nlohmann::json& e : stream ? r.stream_events() : std::vector<nlohmann::json>{}) {
      if (e["choices"].empty()) continue;
      text += e["choices"][0]["text"].get<std::string>();
      for (const auto& t : e["choices"][0]["logprobs"]["tokens"]) tokens.push_back(t);
      for (const auto& o : e["choices"][0]["logprobs"]["text_offset"]) offsets.push_back(o);
    }
    CHECK(tokens == std::vector<std::string>{"a", "<|im_start|>", "a"});  // logprobs keep them
    // text_offset indexes the text as shown: a skipped token does not move it.
    const bool skipped = text == "aa";
    CHECK(offsets == std::vector<int64_t>{0, 1, skipped ? 1 : 13});
    return text;
  };
  for (bool stream : {false, true}) {
    INFO("stream " << stream);
    CHECK(run("", stream) == "aa");
    CHECK(run(R"(, "skip_special_tokens": true)", stream) == "aa");
    CHECK(run(R"(, "skip_special_tokens": false)", stream) == "a<|im_start|>a");
  }
}

TEST_CASE("router: vLLM's stop_token_ids, min_tokens and repetition_penalty reach the ranks, and a stop token prints "
          "nothing unless include_stop_str_in_output",
          "[router]") {
  Harness h;
  const TokenId a = 'a' + 3, b = 'b' + 3;  // the tiny vocabulary's byte tokens
  auto run = [&](const std::string& extra, proto::PrefillRequest* sent = nullptr) {
    auto f = h.post(R"({"model": "tiny", "prompt": "hello", "max_tokens": 5, "stop_token_ids": [)" +
                    std::to_string(b) + "]" + extra + "}");
    auto d = h.dispatched();
    REQUIRE(d);
    if (sent) *sent = d->second;
    h.tokens(d->first, d->second.id, 0, 1, false, a);
    proto::TokenEvents te;
    proto::TokenEvent ev;
    ev.id = d->second.id;
    ev.first_index = 1;
    ev.tokens = {b};
    ev.finish = proto::Finish::kStop;  // the rank stopped at the stop token
    te.events.push_back(ev);
    h.hub.send(d->second.decode_rank, kRouterRank, te);
    const Answer r = h.finish(f);
    REQUIRE(r.status == 200);
    const nlohmann::json c = r.json()["choices"][0];
    CHECK(c["finish_reason"] == "stop");
    return c["text"].get<std::string>();
  };
  proto::PrefillRequest sent;
  CHECK(run(R"(, "min_tokens": 2, "repetition_penalty": 1.3)", &sent) == "a");
  CHECK(sent.sampling.stop_token_ids == std::vector<TokenId>{b});
  CHECK(sent.sampling.min_tokens == 2);
  CHECK(sent.sampling.repetition_penalty == 1.3f);
  CHECK(run(R"(, "include_stop_str_in_output": true)") == "ab");

  // min_tokens beyond what the request may generate; a stop token outside the vocabulary.
  const Answer over = h.finish(h.post(R"({"model": "tiny", "prompt": "hello", "min_tokens": 17})"));
  CHECK(over.status == 400);
  CHECK(over.json()["error"]["param"] == "min_tokens");
  CHECK_THAT(over.json()["error"]["message"].get<std::string>(), Catch::Matchers::Contains("16 tokens"));
  const Answer outside = h.finish(h.post(R"({"model": "tiny", "prompt": "hello", "stop_token_ids": [1000000]})"));
  CHECK(outside.status == 400);
  CHECK(outside.json()["error"]["param"] == "stop_token_ids[0]");
}

TEST_CASE("router: a POST body that is not JSON by its Content-Type is a 415 naming the header", "[router]") {
  Harness h;
  auto post_as = [&](const std::string& path, const std::string& body, const std::string& content_type) {
    auto w = std::make_shared<RecordingWriter>();
    HttpRequest http;
    http.method = "POST";
    http.target = path;
    http.body = body;
    http.content_type = content_type;
    h.router->submit(std::move(http), w);
    return w;
  };
  const std::string chat = R"({"messages": [{"role": "user", "content": "go"}], "max_tokens": 3})";
  for (const char* type : {"text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                  "multipart/form-data; boundary=x", "application/xml", "json"}) {
    for (const auto& [path, body] : {std::pair{std::string("/v1/chat/completions"), chat},
                                     std::pair{std::string("/v1/completions"), kBody},
                                     std::pair{std::string("/tokenize"), std::string(R"({"prompt": "a"})")},
                                     std::pair{std::string("/detokenize"), std::string(R"({"tokens": [70]})")}}) {
      INFO(type << " " << path);
      auto w = post_as(path, body, type);
      REQUIRE(w->done());
      CHECK(w->answer().status == 415);
      const nlohmann::json e = w->answer().json()["error"];
      CHECK(e["param"] == "Content-Type");
      CHECK(e["code"] == "unsupported_media_type");
    }
  }
  // No Content-Type from a web page (a fetch of a Blob body: no preflight);
  // a compressed body.
  for (const auto& [origin, encoding, param] :
       {std::tuple{"https://evil.example", "", "Content-Type"}, std::tuple{"null", "", "Content-Type"},
        std::tuple{"", "gzip", "Content-Encoding"}, std::tuple{"", "br", "Content-Encoding"}}) {
    INFO(origin << " " << encoding);
    auto w = std::make_shared<RecordingWriter>();
    HttpRequest http;
    http.method = "POST";
    http.target = "/v1/completions";
    http.body = kBody;
    http.origin = origin;
    http.content_encoding = encoding;
    h.router->submit(std::move(http), w);
    REQUIRE(w->done());
    CHECK(w->answer().status == 415);
    CHECK(w->answer().json()["error"]["param"] == param);
  }
  CHECK(h.dispatched(20ms) == std::nullopt);
  // A web page's request with a JSON Content-Type (after a CORS preflight the
  // server allowed), and an identity Content-Encoding, are served.
  for (const auto& [origin, encoding] : {std::pair{"https://app.example", ""}, std::pair{"", "identity"}}) {
    auto w = std::make_shared<RecordingWriter>();
    HttpRequest http;
    http.method = "POST";
    http.target = "/v1/completions";
    http.body = kBody;
    http.content_type = "application/json";
    http.origin = origin;
    http.content_encoding = encoding;
    h.router->submit(std::move(http), w);
    auto d = h.dispatched();
    REQUIRE(d);
    h.serve(d->first, d->second);
    CHECK(h.finish(w).status == 200);
  }
  // JSON by any of its names, or no Content-Type at all, is served.
  for (const char* type : {"application/json", "Application/JSON; charset=utf-8", "application/vnd.api+json", ""}) {
    INFO(type);
    auto w = post_as("/v1/completions", kBody, type);
    auto d = h.dispatched();
    REQUIRE(d);
    h.serve(d->first, d->second);
    CHECK(h.finish(w).status == 200);
  }
}

TEST_CASE("router: a choice no decode rank's whole KV pool could hold is a 400 naming kv.decode_budget_mb",
          "[router]") {
  Harness h;
  h.total_blocks = 4;  // 4 blocks of kv.block_size tokens per rank
  h.pump_for(50ms);
  const int64_t pool_tokens = 4 * h.cfg.kv.block_size;
  const Answer over = h.finish(h.post(R"({"model": "tiny", "prompt": "hello", "max_tokens": )" +
                                      std::to_string(pool_tokens) + "}"));
  INFO(over.body);
  CHECK(over.status == 400);
  CHECK(over.json()["error"]["param"] == "max_tokens");
  CHECK_THAT(over.json()["error"]["message"].get<std::string>(), Catch::Matchers::Contains("kv.decode_budget_mb"));
  CHECK(h.dispatched(20ms) == std::nullopt);
  // max_tokens 0 (echo): the prompt alone is too long, and that is what it says.
  const Answer echo = h.finish(h.post(R"({"model": "tiny", "prompt": ")" + std::string(pool_tokens, 'x') +
                                      R"(", "max_tokens": 0, "echo": true})"));
  INFO(echo.body);
  CHECK(echo.status == 400);
  CHECK(echo.json()["error"]["param"] == "prompt");
  CHECK_THAT(echo.json()["error"]["message"].get<std::string>(), Catch::Matchers::Contains("shorten prompt"));
  // One that fits is served.
  auto fits = h.post(R"({"model": "tiny", "prompt": "hello", "max_tokens": 4})");
  auto d = h.dispatched();
  REQUIRE(d);
  h.serve(d->first, d->second);
  CHECK(h.finish(fits).status == 200);
}

TEST_CASE("router: GET /v1/models/{id} answers the served model's object, 404 model_not_found for another", "[router]") {
  Harness h;
  const Answer list = h.get("/v1/models");
  REQUIRE(list.status == 200);
  const Answer one = h.get("/v1/models/tiny");
  INFO(one.body);
  REQUIRE(one.status == 200);
  CHECK(one.json() == list.json()["data"][0]);
  CHECK(h.get("/v1/models/t%69ny").status == 200);  // percent-encoded, as clients send ids
  for (const char* path : {"/v1/models/other", "/v1/models/", "/v1/models/tiny/x"}) {
    INFO(path);
    const Answer none = h.get(path);
    CHECK(none.status == 404);
    CHECK(none.json()["error"]["code"] == "model_not_found");
    CHECK(none.json()["error"]["param"] == "model");
  }
  auto f = h.post("{}", "/v1/models/tiny");
  CHECK(h.finish(f).status == 405);
}

TEST_CASE("router: errors name the prompt element and the max_tokens value as sent", "[router]") {
  Harness h;
  Answer r = h.finish(h.post(R"({"model": "tiny", "prompt": [""]})"));
  CHECK(r.status == 400);
  CHECK(r.json()["error"]["param"] == "prompt[0]");
  CHECK(r.json()["error"]["message"] == "prompt[0] is empty");
  r = h.finish(h.post(R"({"model": "tiny", "prompt": [[1, 2], [3, 99999]]})"));
  CHECK(r.json()["error"]["param"] == "prompt[1][1]");
  r = h.finish(h.post(R"({"model": "tiny", "prompt": "hello", "max_tokens": 1000000000000})"));
  CHECK(r.status == 400);
  CHECK(r.json()["error"]["param"] == "max_tokens");
  const std::string message = r.json()["error"]["message"];
  CHECK_THAT(message, Catch::Matchers::Contains("max_tokens 1000000000000 + "));
  CHECK(message.find("2147483647") == std::string::npos);
  r = h.finish(h.post(R"({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                          "max_completion_tokens": 5000000000})",
                      "/v1/chat/completions"));
  CHECK(r.json()["error"]["param"] == "max_completion_tokens");
  CHECK_THAT(r.json()["error"]["message"].get<std::string>(),
             Catch::Matchers::Contains("max_completion_tokens 5000000000 + "));
}

}  // namespace
}  // namespace pd::router::test_router
