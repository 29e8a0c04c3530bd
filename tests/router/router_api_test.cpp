// The router's API side, driven through Router::submit with a recording writer
// (router_harness.h): seeds, batches of prompts x n, echo with logprobs, the
// tokenizer routes and the 400s naming a field.
#include "router/router_harness.h"

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
  CHECK(r.json()["error"]["param"] == "prompt");
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
  CHECK(wrong.header("Allow") == "GET");
  const Answer get_completions = h.get("/v1/completions");
  CHECK(get_completions.status == 405);
  CHECK(get_completions.header("Allow") == "POST");
  const Answer models = h.get("/v1/models");
  CHECK(models.status == 200);
  CHECK(models.json()["data"][0]["id"] == "tiny");
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
  CHECK(r.json()["error"]["param"] == "prompt");
  CHECK(r.json()["error"]["message"] == "prompt[1] has 600 tokens; the model's context is 512");
  h.pump_for(5ms);
  CHECK(h.get("/metrics").body.find("pd_requests_total{outcome=\"rejected\"} 2") != std::string::npos);
}

}  // namespace
}  // namespace pd::router::test_router
