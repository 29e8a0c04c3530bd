// Tests of the OpenAI API layer: every validation rule (status, param, message),
// good completions and chat requests parsed into the right fields, and the
// response bodies parsed back as JSON with OpenAI's shapes.
#include "grammar/grammar.h"
#include "router/openai_api.h"

#include <catch2/catch.hpp>

#include <iostream>
#include <nlohmann/json.hpp>

#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace pd::router {
namespace {

using json = nlohmann::json;

ApiRequest parse_ok(Endpoint ep, const std::string& body) {
  ApiResult<ApiRequest> r = parse_request(ep, body);
  INFO(body);
  if (!r.is_ok()) FAIL("unexpected error: " << r.error().message);
  return std::move(r).value();
}

ApiError parse_err(Endpoint ep, const std::string& body) {
  ApiResult<ApiRequest> r = parse_request(ep, body);
  INFO(body);
  if (r.is_ok()) FAIL("expected an error");
  return r.error();
}

// A completions body {"prompt":"hi", <extra>}.
std::string completions_with(const std::string& extra) {
  return extra.empty() ? R"({"prompt":"hi"})" : R"({"prompt":"hi",)" + extra + "}";
}
ChoiceOut choice(int32_t index, std::string text, std::optional<std::string> finish = std::nullopt) {
  ChoiceOut c;
  c.index = index;
  c.text = std::move(text);
  c.finish_reason = std::move(finish);
  return c;
}

std::string chat_with(const std::string& extra) {
  const std::string base = R"({"messages":[{"role":"user","content":"hi"}])";
  return extra.empty() ? base + "}" : base + "," + extra + "}";
}

struct BadCase {
  std::string extra;    // fields added to a valid body
  std::string param;    // expected param ("" = null)
  std::string message;  // a substring of the expected message
};

void check_bad(Endpoint ep, const BadCase& c) {
  const std::string body = ep == Endpoint::kCompletions ? completions_with(c.extra) : chat_with(c.extra);
  INFO(body);
  const ApiError e = parse_err(ep, body);
  CHECK(e.status == 400);
  CHECK(e.type == "invalid_request_error");
  CHECK(e.param == c.param);
  CHECK_THAT(e.message, Catch::Matchers::Contains(c.message));
}

TEST_CASE("openai_api: a full completions request is parsed into the right fields", "[openai_api]") {
  const ApiRequest r = parse_ok(Endpoint::kCompletions, R"({
    "model": "smol", "prompt": "Once upon", "max_tokens": 32, "temperature": 0.7, "top_p": 0.9,
    "top_k": 40, "min_p": 0.05, "seed": 1234, "presence_penalty": 0.5, "frequency_penalty": -0.25,
    "ignore_eos": true, "stop": ["\n\n", "END"], "stream": true, "stream_options": {"include_usage": true},
    "n": 1, "echo": false, "user": "u1", "best_of": 1, "logprobs": null, "suffix": null })");
  CHECK(r.endpoint == Endpoint::kCompletions);
  CHECK(r.model == "smol");
  REQUIRE(r.prompts.size() == 1);
  CHECK(r.prompts[0].text == "Once upon");
  CHECK_FALSE(r.prompts[0].is_ids);
  CHECK(r.messages.empty());
  CHECK(r.max_tokens_given);
  CHECK(r.sampling.max_tokens == 32);
  CHECK(r.sampling.temperature == Approx(0.7f));
  CHECK(r.sampling.top_p == Approx(0.9f));
  CHECK(r.sampling.top_k == 40);
  CHECK(r.sampling.min_p == Approx(0.05f));
  CHECK(r.sampling.seed == 1234u);
  CHECK(r.sampling.presence_penalty == Approx(0.5f));
  CHECK(r.sampling.frequency_penalty == Approx(-0.25f));
  CHECK(r.sampling.ignore_eos);
  CHECK(r.stop == std::vector<std::string>{"\n\n", "END"});
  CHECK(r.stream);
  CHECK(r.include_usage);
  CHECK_FALSE(r.echo);
  CHECK(r.sampling.validate().is_ok());
}

TEST_CASE("openai_api: defaults follow OpenAI", "[openai_api]") {
  const ApiRequest r = parse_ok(Endpoint::kCompletions, R"({"prompt":"x"})");
  CHECK(r.model.empty());
  CHECK(r.sampling.temperature == 1.0f);
  CHECK(r.sampling.top_p == 1.0f);
  CHECK(r.sampling.top_k == 0);
  CHECK(r.sampling.min_p == 0.0f);
  CHECK(r.sampling.seed == 0u);
  CHECK_FALSE(r.max_tokens_given);
  CHECK(r.stop.empty());
  CHECK_FALSE(r.stream);
  CHECK_FALSE(r.include_usage);

  // null means "default" for every optional field.
  const ApiRequest n = parse_ok(Endpoint::kCompletions,
                                R"({"prompt":"x","model":null,"temperature":null,"max_tokens":null,"stop":null,
                                    "stream":null,"seed":null,"top_k":null,"n":null})");
  CHECK(n.sampling.temperature == 1.0f);
  CHECK_FALSE(n.max_tokens_given);
  CHECK_FALSE(r.seed_given);  // the router then draws a fresh seed
  CHECK_FALSE(n.seed_given);
  CHECK(parse_ok(Endpoint::kCompletions, R"({"prompt":"x","seed":0})").seed_given);
}

TEST_CASE("openai_api: configured sampling defaults fill only what a request omits", "[openai_api]") {
  RequestDefaults d;
  d.temperature = 0.2f;
  d.top_p = 0.9f;
  d.top_k = 40;
  d.min_p = 0.05f;
  auto parsed = parse_request(Endpoint::kChatCompletions, R"({"messages":[{"role":"user","content":"hi"}]})", d);
  REQUIRE(parsed.is_ok());
  CHECK(parsed.value().sampling.temperature == 0.2f);
  CHECK(parsed.value().sampling.top_p == 0.9f);
  CHECK(parsed.value().sampling.top_k == 40);
  CHECK(parsed.value().sampling.min_p == 0.05f);
  auto own = parse_request(Endpoint::kCompletions,
                           R"({"prompt":"x","temperature":0,"top_p":1,"top_k":-1,"min_p":0,"seed":5})", d);
  REQUIRE(own.is_ok());
  CHECK(own.value().sampling.temperature == 0.0f);
  CHECK(own.value().sampling.top_p == 1.0f);
  CHECK(own.value().sampling.top_k == 0);
  CHECK(own.value().sampling.min_p == 0.0f);
  CHECK(own.value().sampling.seed == 5u);
  d.top_k = -1;  // -1 = disabled, as in a request
  CHECK(parse_request(Endpoint::kCompletions, R"({"prompt":"x"})", d).value().sampling.top_k == 0);
}

TEST_CASE("openai_api: prompt forms", "[openai_api]") {
  CHECK(parse_ok(Endpoint::kCompletions, R"({"prompt":["only one"]})").prompts[0].text == "only one");
  CHECK(parse_ok(Endpoint::kCompletions, R"({"prompt":""})").prompts[0].text.empty());
  // A batch of strings, one token-id prompt, a batch of token-id prompts.
  ApiRequest r = parse_ok(Endpoint::kCompletions, R"({"prompt":["a","b","c"]})");
  REQUIRE(r.prompts.size() == 3);
  CHECK(r.prompts[2].text == "c");
  r = parse_ok(Endpoint::kCompletions, R"({"prompt":[1,2,3.0]})");
  REQUIRE(r.prompts.size() == 1);
  CHECK(r.prompts[0].is_ids);
  CHECK(r.prompts[0].ids == std::vector<TokenId>{1, 2, 3});
  r = parse_ok(Endpoint::kCompletions, R"({"prompt":[[5],[6,7]], "n": 2})");
  REQUIRE(r.prompts.size() == 2);
  CHECK(r.prompts[1].ids == std::vector<TokenId>{6, 7});
  CHECK(r.n == 2);
  CHECK(r.parse_special);
  CHECK_FALSE(parse_ok(Endpoint::kCompletions, R"({"prompt":"x","parse_special":false})").parse_special);
}

TEST_CASE("openai_api: a full chat request is parsed into the right fields", "[openai_api]") {
  const ApiRequest r = parse_ok(Endpoint::kChatCompletions, R"({
    "model": "smol",
    "messages": [
      {"role": "system", "content": "be brief"},
      {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]},
      {"role": "assistant", "content": "ok", "name": "bot", "refusal": null},
      {"role": "developer", "content": "dev note"},
      {"role": "assistant", "content": [{"type": "text", "text": "well"}, {"type": "refusal", "refusal": "I cannot"}]}
    ],
    "max_completion_tokens": 7, "max_tokens": 99, "temperature": 0, "seed": -1, "top_k": -1,
    "stop": "###", "logprobs": false, "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
    "parallel_tool_calls": true, "service_tier": "auto", "metadata": {"k": "v"}, "store": false })");
  CHECK(r.endpoint == Endpoint::kChatCompletions);
  REQUIRE(r.messages.size() == 5);
  CHECK(r.messages[4].content == "well\nI cannot");  // a refused turn replayed: its refusal as text
  CHECK(r.messages[0].role == "system");
  CHECK(r.messages[0].content == "be brief");
  CHECK(r.messages[1].role == "user");
  CHECK(r.messages[1].content == "part one\npart two");
  CHECK(r.messages[2].role == "assistant");
  CHECK(r.messages[2].content == "ok");
  CHECK(r.messages[3].role == "system");  // developer is OpenAI's newer name for system
  CHECK(r.max_tokens_given);
  CHECK(r.sampling.max_tokens == 7);  // max_completion_tokens wins over max_tokens
  CHECK(r.sampling.temperature == 0.0f);
  CHECK(r.sampling.seed == ~uint64_t{0});  // -1 as its 64-bit pattern
  CHECK(r.sampling.top_k == 0);            // -1 = disabled
  CHECK(r.stop == std::vector<std::string>{"###"});
  CHECK(r.prompts.empty());
}

TEST_CASE("openai_api: chat max_tokens alone and large values", "[openai_api]") {
  const ApiRequest r = parse_ok(Endpoint::kChatCompletions, chat_with(R"("max_tokens": 12)"));
  CHECK(r.sampling.max_tokens == 12);
  const ApiRequest big = parse_ok(Endpoint::kCompletions, completions_with(R"("max_tokens": 10000000000)"));
  CHECK(big.sampling.max_tokens == 2147483647);  // clamped: the caller clamps to the context anyway
  const ApiRequest seed = parse_ok(Endpoint::kCompletions, completions_with(R"("seed": 18446744073709551615)"));
  CHECK(seed.sampling.seed == ~uint64_t{0});
  const ApiRequest integral = parse_ok(Endpoint::kCompletions, completions_with(R"("max_tokens": 5.0)"));
  CHECK(integral.sampling.max_tokens == 5);
}

TEST_CASE("openai_api: malformed bodies", "[openai_api]") {
  ApiError e = parse_err(Endpoint::kCompletions, R"({"prompt": "x",)");
  CHECK(e.status == 400);
  CHECK_THAT(e.message, Catch::Matchers::StartsWith("invalid JSON: "));
  CHECK(e.param.empty());
  e = parse_err(Endpoint::kCompletions, "");
  CHECK_THAT(e.message, Catch::Matchers::StartsWith("invalid JSON: "));
  e = parse_err(Endpoint::kCompletions, R"(["prompt"])");
  CHECK(e.status == 400);
  CHECK_THAT(e.message, Catch::Matchers::Contains("JSON object"));
  e = parse_err(Endpoint::kChatCompletions, "42");
  CHECK_THAT(e.message, Catch::Matchers::Contains("JSON object"));
}

TEST_CASE("openai_api: required fields", "[openai_api]") {
  ApiError e = parse_err(Endpoint::kCompletions, R"({"model":"m"})");
  CHECK(e.param == "prompt");
  CHECK_THAT(e.message, Catch::Matchers::Contains("prompt is required"));
  e = parse_err(Endpoint::kCompletions, R"({"prompt":null})");
  CHECK(e.param == "prompt");
  e = parse_err(Endpoint::kChatCompletions, R"({"model":"m"})");
  CHECK(e.param == "messages");
  CHECK_THAT(e.message, Catch::Matchers::Contains("messages is required"));
}

TEST_CASE("openai_api: wrong types name the field", "[openai_api]") {
  const std::vector<BadCase> cases = {
      {R"("max_tokens": "10")", "max_tokens", "max_tokens must be an integer"},
      {R"("max_tokens": 10.5)", "max_tokens", "max_tokens must be an integer"},
      {R"("temperature": "hot")", "temperature", "temperature must be a number"},
      {R"("temperature": true)", "temperature", "temperature must be a number"},
      {R"("top_p": [1])", "top_p", "top_p must be a number"},
      {R"("top_k": 1.5)", "top_k", "top_k must be an integer"},
      {R"("min_p": {})", "min_p", "min_p must be a number"},
      {R"("seed": "7")", "seed", "seed must be an integer"},
      {R"("presence_penalty": "0")", "presence_penalty", "presence_penalty must be a number"},
      {R"("frequency_penalty": false)", "frequency_penalty", "frequency_penalty must be a number"},
      {R"("stream": "yes")", "stream", "stream must be a boolean"},
      {R"("ignore_eos": 1)", "ignore_eos", "ignore_eos must be a boolean"},
      {R"("echo": "no")", "echo", "echo must be a boolean"},
      {R"("model": 3)", "model", "model must be a string"},
      {R"("n": "1")", "n", "n must be an integer"},
      {R"("stop": 5)", "stop", "stop must be a string or an array"},
      {R"("stop": ["a", 1])", "stop", "stop array elements must be strings"},
      {R"("stream": true, "stream_options": true)", "stream_options", "stream_options must be an object"},
      {R"("stream": true, "stream_options": {"include_usage": "y"})", "stream_options.include_usage",
       "must be a boolean"},
  };
  for (const BadCase& c : cases) {
    check_bad(Endpoint::kCompletions, c);
    check_bad(Endpoint::kChatCompletions, c);
  }
}

TEST_CASE("openai_api: ranges", "[openai_api]") {
  const std::vector<BadCase> cases = {
      {R"("temperature": -0.1)", "temperature", "temperature must be in [0, 2]"},
      {R"("temperature": 2.5)", "temperature", "temperature must be in [0, 2]"},
      {R"("top_p": 0)", "top_p", "top_p must be in (0, 1]"},
      {R"("top_p": 1.01)", "top_p", "top_p must be in (0, 1]"},
      {R"("top_k": -2)", "top_k", "top_k must be -1 or 0 (disabled) or >= 1"},
      {R"("min_p": -0.5)", "min_p", "min_p must be in [0, 1]"},
      {R"("min_p": 1.5)", "min_p", "min_p must be in [0, 1]"},
      {R"("presence_penalty": 2.1)", "presence_penalty", "presence_penalty must be in [-2, 2]"},
      {R"("frequency_penalty": -3)", "frequency_penalty", "frequency_penalty must be in [-2, 2]"},
      {R"("max_tokens": -5)", "max_tokens", "max_tokens must be >= "},
      {R"("n": 129)", "n", "n must be an integer in [1, 128]"},
      {R"("n": 0)", "n", "n must be an integer in [1, 128]"},
      {R"("stop": "")", "stop", "must not be empty"},
      {R"("stop": ["a", ""])", "stop", "must not be empty"},
      {R"("stop": ["a", "b", "c", "d", "e"])", "stop", "at most 4"},
  };
  for (const BadCase& c : cases) {
    check_bad(Endpoint::kCompletions, c);
    check_bad(Endpoint::kChatCompletions, c);
  }
  // The edges themselves are accepted.
  const ApiRequest r = parse_ok(Endpoint::kCompletions, completions_with(R"("temperature": 2, "top_p": 1,
      "min_p": 1, "presence_penalty": -2, "frequency_penalty": 2, "max_tokens": 1, "top_k": 1, "n": 1,
      "stop": ["a", "b", "c", "d"])"));
  CHECK(r.sampling.temperature == 2.0f);
  CHECK(r.sampling.top_k == 1);
  CHECK(r.stop.size() == 4);
  CHECK(parse_ok(Endpoint::kChatCompletions, chat_with(R"("max_completion_tokens": 3)")).sampling.max_tokens == 3);
  check_bad(Endpoint::kChatCompletions, {R"("max_completion_tokens": 0)", "max_completion_tokens",
                                         "max_completion_tokens must be >= 1"});
}

TEST_CASE("openai_api: stop holds at most 4 strings of at most kMaxStopBytes bytes each", "[openai_api]") {
  const std::string longest(kMaxStopBytes, 's');
  const std::string too_long(kMaxStopBytes + 1, 's');
  const std::string too_long_utf8 = std::string(kMaxStopBytes - 1, 's') + "\xc3\xa9";  // bytes, not characters
  const std::vector<BadCase> cases = {
      {R"("stop": ")" + too_long + R"(")", "stop", "at most 256 bytes long, got one of 257"},
      {R"("stop": ["a", ")" + too_long + R"("])", "stop", "at most 256 bytes long, got one of 257"},
      {R"("stop": ")" + too_long_utf8 + R"(")", "stop", "at most 256 bytes long, got one of 257"},
      {R"("stop": ")" + std::string(1 << 19, 's') + R"(")", "stop", "at most 256 bytes long"},
      {R"("stop": ["a", "b", "c", "d", "e"])", "stop", "at most 4 strings, got 5"},
  };
  for (const BadCase& c : cases) {
    check_bad(Endpoint::kCompletions, c);
    check_bad(Endpoint::kChatCompletions, c);
  }
  for (Endpoint ep : {Endpoint::kCompletions, Endpoint::kChatCompletions}) {
    const auto with = [&](const std::string& extra) {
      return ep == Endpoint::kCompletions ? completions_with(extra) : chat_with(extra);
    };
    CHECK(parse_ok(ep, with(R"("stop": ")" + longest + R"(")")).stop == std::vector<std::string>{longest});
    const ApiRequest r = parse_ok(ep, with(R"("stop": [")" + longest + R"(", "b", "c", ")" + longest + R"("])"));
    CHECK(r.stop == std::vector<std::string>{longest, "b", "c", longest});
  }
}

TEST_CASE("openai_api: logit_bias is read as token id -> bias, ids ascending, and refused by name when malformed",
          "[openai_api]") {
  for (Endpoint ep : {Endpoint::kCompletions, Endpoint::kChatCompletions}) {
    const auto with = [&](const std::string& extra) {
      return ep == Endpoint::kCompletions ? completions_with(extra) : chat_with(extra);
    };
    const ApiRequest r = parse_ok(ep, with(R"("logit_bias": {"50256": -100, "7": 2.5, "0": 100})"));
    const std::vector<std::pair<TokenId, float>> want = {{0, 100.0f}, {7, 2.5f}, {50256, -100.0f}};
    CHECK(r.sampling.logit_bias == want);
    CHECK(parse_ok(ep, with(R"("logit_bias": {})")).sampling.logit_bias.empty());
    CHECK(parse_ok(ep, with(R"("logit_bias": null)")).sampling.logit_bias.empty());
    CHECK(check_logit_bias(r.sampling, 50257) == std::nullopt);
    const std::optional<ApiError> outside = check_logit_bias(r.sampling, 50000);
    REQUIRE(outside);
    CHECK(outside->param == "logit_bias");
    CHECK(outside->message.find("outside the vocabulary") != std::string::npos);
    const std::vector<BadCase> cases = {
        {R"("logit_bias": [1, 2])", "logit_bias", "must be an object"},
        {R"("logit_bias": {"x": 1})", "logit_bias", "token ids"},
        {R"("logit_bias": {"-1": 1})", "logit_bias", "token ids"},
        {R"("logit_bias": {"1.5": 1})", "logit_bias", "token ids"},
        {R"("logit_bias": {"": 1})", "logit_bias", "token ids"},
        {R"("logit_bias": {"99999999999": 1})", "logit_bias", "token ids"},
        {R"("logit_bias": {"3": 101})", "logit_bias", "[-100, 100]"},
        {R"("logit_bias": {"3": "5"})", "logit_bias", "[-100, 100]"},
        {R"("logit_bias": {"3": 1, "03": 2})", "logit_bias", "twice"},
    };
    for (const BadCase& c : cases) check_bad(ep, c);
  }
}

TEST_CASE("openai_api: unsupported features are refused by name", "[openai_api]") {
  const std::vector<BadCase> cases = {
      {R"("best_of": 2)", "best_of", "best_of is not supported"},
      {R"("functions": [{"name": "f"}])", "functions", "functions is not supported"},
      {R"("suffix": "tail")", "suffix", "suffix is not supported"},
      {R"("continue_final_message": true)", "continue_final_message", "continue_final_message is not supported"},
      {R"("chat_template_kwargs": {"enable_thinking": false})", "chat_template_kwargs",
       "chat_template_kwargs is not supported"},
  };
  for (const BadCase& c : cases) {
    check_bad(Endpoint::kCompletions, c);
    check_bad(Endpoint::kChatCompletions, c);
  }
  check_bad(Endpoint::kChatCompletions, {R"("echo": true)", "echo", "echo is not supported"});
  // What vLLM's clients send when they ask for nothing is accepted.
  parse_ok(Endpoint::kChatCompletions, chat_with(R"("continue_final_message": false, "chat_template_kwargs": {})"));
  // add_generation_prompt (chat): the template's assistant header, on by default.
  CHECK(parse_ok(Endpoint::kChatCompletions, chat_with("")).add_generation_prompt);
  CHECK_FALSE(parse_ok(Endpoint::kChatCompletions, chat_with(R"("add_generation_prompt": false)")).add_generation_prompt);
  check_bad(Endpoint::kChatCompletions, {R"("add_generation_prompt": "no")", "add_generation_prompt", "boolean"});
  check_bad(Endpoint::kCompletions, {R"("add_generation_prompt": true)", "add_generation_prompt", "unknown field"});
  // Tools are a chat feature.
  check_bad(Endpoint::kCompletions, {R"("tools": [{"type": "function"}])", "tools", "tools is not supported"});
  check_bad(Endpoint::kCompletions, {R"("tool_choice": "auto")", "tool_choice", "tool_choice is not supported"});
  check_bad(Endpoint::kCompletions, {R"("top_logprobs": 3)", "top_logprobs", "top_logprobs is not supported"});
  check_bad(Endpoint::kCompletions, {R"("stream_options": {"include_usage": true})", "stream_options",
                                     "only allowed when stream is true"});
  check_bad(Endpoint::kCompletions, {R"("stream": true, "stream_options": {"continuous": true})",
                                     "stream_options.continuous", "unknown field: stream_options.continuous"});
}

TEST_CASE("openai_api: output constraints become the request's grammar", "[openai_api]") {
  for (Endpoint ep : {Endpoint::kCompletions, Endpoint::kChatCompletions}) {
    auto with = [&](const std::string& extra) {
      return parse_ok(ep, ep == Endpoint::kCompletions ? completions_with(extra) : chat_with(extra)).sampling.grammar;
    };
    CHECK(!with(R"("response_format": {"type": "text"})").active());
    CHECK(with(R"("response_format": {"type": "json_object"})").kind == GrammarKind::kJsonObject);
    // The schema's keys keep their order (the output's follow it).
    const GrammarSpec s = with(R"("response_format": {"type": "json_schema", "json_schema": {"name": "p",
        "strict": true, "schema": {"type": "object", "properties": {"zeta": {"type": "string"},
        "alpha": {"type": "integer"}}, "required": ["zeta", "alpha"]}}})");
    CHECK(s.kind == GrammarKind::kJsonSchema);
    CHECK(s.text == R"({"type":"object","properties":{"zeta":{"type":"string"},"alpha":{"type":"integer"}},)"
                    R"("required":["zeta","alpha"]})");
    CHECK(with(R"("structured_outputs": {"regex": "[0-9]+"})").kind == GrammarKind::kRegex);
    CHECK(with(R"("structured_outputs": {"json": "{\"type\": \"object\"}"})").kind == GrammarKind::kJsonSchema);
    const GrammarSpec choice = with(R"("guided_choice": ["yes", "no \"way\""])");
    CHECK(choice.kind == GrammarKind::kEbnf);
    CHECK(choice.text == R"(root ::= "yes" | "no \"way\"")");
    CHECK(with(R"("guided_grammar": "root ::= \"a\"", "guided_decoding_backend": "xgrammar")").kind ==
          GrammarKind::kEbnf);
    CHECK(with(R"("structured_outputs": {"json_object": true})").kind == GrammarKind::kJsonObject);
  }
}

TEST_CASE("openai_api: speculative turns speculative decoding off for a request", "[openai_api]") {
  CHECK(parse_ok(Endpoint::kCompletions, completions_with("")).sampling.speculate);
  CHECK_FALSE(parse_ok(Endpoint::kCompletions, completions_with(R"("speculative": false)")).sampling.speculate);
  CHECK_FALSE(parse_ok(Endpoint::kChatCompletions, chat_with(R"("speculative": false)")).sampling.speculate);
  check_bad(Endpoint::kChatCompletions, {R"("speculative": 3)", "speculative", "speculative"});
}

TEST_CASE("openai_api: vLLM's repetition_penalty, min_tokens, stop_token_ids and include_stop_str_in_output",
          "[openai_api]") {
  const ApiRequest plain = parse_ok(Endpoint::kCompletions, completions_with(""));
  CHECK(plain.sampling.repetition_penalty == 1.0f);
  CHECK(plain.min_tokens == 0);
  CHECK(plain.stop_token_ids.empty());
  CHECK_FALSE(plain.include_stop_str_in_output);
  const ApiRequest r = parse_ok(Endpoint::kCompletions, completions_with(
      R"("repetition_penalty": 1.2, "min_tokens": 5, "max_tokens": 9, "stop_token_ids": [7, 0], "include_stop_str_in_output": true)"));
  CHECK(r.sampling.repetition_penalty == 1.2f);
  CHECK(r.min_tokens == 5);
  CHECK(r.stop_token_ids == std::vector<pd::TokenId>{7, 0});
  CHECK(r.include_stop_str_in_output);
  // As vLLM's clients send them when nothing is asked.
  const ApiRequest none = parse_ok(Endpoint::kChatCompletions, chat_with(
      R"("repetition_penalty": 1.0, "min_tokens": 0, "stop_token_ids": [], "include_stop_str_in_output": false)"));
  CHECK(none.sampling.repetition_penalty == 1.0f);
  CHECK(none.stop_token_ids.empty());
  // min_tokens without max_tokens: checked once max_tokens is known (fit_context).
  CHECK(parse_ok(Endpoint::kChatCompletions, chat_with(R"("min_tokens": 100000)")).min_tokens == 100000);
  for (const BadCase& c : std::vector<BadCase>{
           {R"("repetition_penalty": 0)", "repetition_penalty", "repetition_penalty must be in (0, 100]"},
           {R"("repetition_penalty": -1.5)", "repetition_penalty", "got -1.5"},
           {R"("repetition_penalty": "high")", "repetition_penalty", "must be a number"},
           {R"("min_tokens": -1)", "min_tokens", "min_tokens must be an integer in [0, "},
           {R"("min_tokens": 1.5)", "min_tokens", "must be an integer"},
           {R"("min_tokens": 10, "max_tokens": 4)", "min_tokens", "min_tokens 10 is more than max_tokens 4"},
           {R"("stop_token_ids": 5)", "stop_token_ids", "must be an array of token ids"},
           {R"("stop_token_ids": [1, -2])", "stop_token_ids[1]", "stop_token_ids[1] must be a token id"},
           {R"("stop_token_ids": ["1"])", "stop_token_ids[0]", "must be a token id"},
           {R"("include_stop_str_in_output": 1)", "include_stop_str_in_output", "must be a boolean"},
       }) {
    check_bad(Endpoint::kCompletions, c);
  }
  check_bad(Endpoint::kChatCompletions,
            {R"("min_tokens": 10, "max_completion_tokens": 4)", "min_tokens", "more than max_completion_tokens 4"});
  std::string many = "[";
  for (size_t i = 0; i <= kMaxStopTokenIds; ++i) many += (i ? "," : "") + std::to_string(i);
  check_bad(Endpoint::kCompletions, {R"("stop_token_ids": )" + many + "]", "stop_token_ids", "at most 64 ids"});
  ApiRequest out_of_vocab = parse_ok(Endpoint::kCompletions, completions_with(R"("stop_token_ids": [3, 500])"));
  CHECK_FALSE(check_stop_token_ids(out_of_vocab, 501).has_value());
  const std::optional<ApiError> e = check_stop_token_ids(out_of_vocab, 500);
  REQUIRE(e.has_value());
  CHECK(e->param == "stop_token_ids[1]");
}

TEST_CASE("openai_api: chat tools, tool turns and a forced call", "[openai_api]") {
  const ApiRequest r = parse_ok(Endpoint::kChatCompletions, R"({"messages": [
      {"role": "user", "content": "weather?"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
          "function": {"name": "w", "arguments": "{\"city\": \"Oslo\"}"}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "5C"}],
      "tools": [{"type": "function", "function": {"name": "w", "parameters": {"type": "object",
          "properties": {"zeta": {"type": "string"}, "alpha": {"type": "string"}}}}}],
      "tool_choice": "required"})");
  REQUIRE(r.messages.size() == 3);
  CHECK(r.messages[1].content.empty());
  REQUIRE(r.messages[1].tool_calls.size() == 1);
  CHECK(r.messages[1].tool_calls[0].name == "w");
  CHECK(r.messages[2].role == "tool");
  CHECK(r.messages[2].tool_call_id == "c1");
  REQUIRE(r.tools.size() == 1);
  CHECK(r.tools[0].parameters.find("zeta") < r.tools[0].parameters.find("alpha"));  // the client's key order
  CHECK(r.tool_choice.mode == ToolChoiceMode::kRequired);
  // No tools: no tool choice.
  CHECK(parse_ok(Endpoint::kChatCompletions, chat_with("")).tool_choice.mode == ToolChoiceMode::kNone);
  // A forced call and another output constraint cannot both hold.
  check_bad(Endpoint::kChatCompletions,
            {R"("tools": [{"type": "function", "function": {"name": "w"}}], "tool_choice": "required",
                "response_format": {"type": "json_object"})", "tool_choice", "cannot be combined"});
}

TEST_CASE("openai_api: bad output constraints are refused by name", "[openai_api]") {
  if (!grammar_engine_built()) {
    std::cout << "SKIP: this build has no grammar engine (scripts/build_xgrammar.sh)\n";
    return;
  }
  const std::vector<BadCase> cases = {
      {R"("response_format": {"type": "regex"})", "response_format.type", "not supported"},
      {R"("response_format": "json")", "response_format", "must be an object"},
      {R"("response_format": {"type": "json_schema"})", "response_format.json_schema", "is required"},
      {R"("response_format": {"type": "json_schema", "json_schema": {"name": "x"}})",
       "response_format.json_schema.schema", "is required"},
      {R"("response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}})",
       "response_format.json_schema.schema", "nonsense"},
      {R"("response_format": {"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}})",
       "response_format.json_schema", "unknown field"},
      {R"("response_format": {"type": "json_object", "schema": {}})", "response_format", "unknown field"},
      {R"("structured_outputs": {"regex": "(unclosed"})", "structured_outputs.regex", "structured_outputs.regex"},
      {R"("structured_outputs": {"regex": "a", "choice": ["b"]})", "structured_outputs.choice", "more than one"},
      {R"("structured_outputs": {"whitespace_pattern": " "})", "structured_outputs.whitespace_pattern",
       "not supported"},
      {R"("guided_choice": [])", "guided_choice", "non-empty array"},
      {R"("guided_choice": ["a", 3])", "guided_choice", "guided_choice[1]"},
      {R"("guided_json": "not json")", "guided_json", "JSON schema"},
      {R"("guided_grammar": "root ::= missing")", "guided_grammar", "guided_grammar"},
      {R"("response_format": {"type": "json_object"}, "guided_regex": "a")", "guided_regex", "one output constraint"},
  };
  for (const BadCase& c : cases) {
    check_bad(Endpoint::kCompletions, c);
    check_bad(Endpoint::kChatCompletions, c);
  }
}

TEST_CASE("openai_api: a grammar or regex that admits no output is a 400 naming the field", "[openai_api]") {
  if (!grammar_engine_built()) {
    std::cout << "SKIP: this build has no grammar engine (scripts/build_xgrammar.sh)\n";
    return;
  }
  const std::vector<BadCase> cases = {
      {R"("guided_grammar": "root ::= root")", "guided_grammar", "admits no output"},
      {R"("guided_regex": "[^\\x00-\\U0010FFFF]")", "guided_regex", "admits no output"},
      {R"("structured_outputs": {"grammar": "root ::= root"})", "structured_outputs.grammar", "admits no output"},
  };
  for (const BadCase& c : cases) {
    check_bad(Endpoint::kCompletions, c);
    check_bad(Endpoint::kChatCompletions, c);
  }
}

TEST_CASE("openai_api: schema keywords the grammar does not enforce are a 400 naming the keyword's path",
          "[openai_api]") {
  if (!grammar_engine_built()) {
    std::cout << "SKIP: this build has no grammar engine (scripts/build_xgrammar.sh)\n";
    return;
  }
  const std::string rf = "response_format.json_schema.schema";
  auto schema = [](const std::string& s) {
    return R"("response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": )" + s + "}}";
  };
  const std::vector<BadCase> cases = {
      {schema(R"({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]})"),
       rf + ".allOf", "allOf"},
      {schema(R"({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                  "uniqueItems": true}}, "required": ["tags"]})"),
       rf + ".properties.tags.uniqueItems", "uniqueItems"},
      {schema(R"({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]})"),
       rf + ".required", "\"b\""},
      {schema(R"({"not": {"type": "string"}})"), rf + ".not", "not"},
      {schema(R"({"type": "object", "patternProperties": {"^x": {"type": "integer"}}})"), rf + ".patternProperties",
       "patternProperties"},
      {schema(R"({"anyOf": [{"type": "integer"}, {"type": "array", "contains": {"type": "integer"}}]})"),
       rf + ".anyOf[1].contains", "contains"},
      {schema(R"({"$defs": {"p": {"type": "object", "if": {"required": []}, "then": {}}}, "$ref": "#/$defs/p"})"),
       rf + ".$defs.p.if", "if"},
      {R"("guided_json": "{\"type\": \"object\", \"propertyNames\": {\"pattern\": \"^x\"}}")",
       "guided_json.propertyNames", "propertyNames"},
      // Empty, yet constraints: "not": {} matches no value, "contains": {} asks for an item.
      {schema(R"({"type": "object", "properties": {"a": {"not": {}}}, "required": ["a"]})"),
       rf + ".properties.a.not", "not"},
      {schema(R"({"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"},
                  "contains": {}, "maxItems": 0}}, "required": ["xs"]})"),
       rf + ".properties.xs.contains", "contains"},
      // Subschemas for the keys and items the others leave are checked too.
      {schema(R"({"type": "object", "unevaluatedProperties": {"not": {"type": "string"}}})"),
       rf + ".unevaluatedProperties.not", "not"},
      {schema(R"({"type": "array", "prefixItems": [{"type": "integer"}], "unevaluatedItems": {"type": "array",
                  "uniqueItems": true}})"),
       rf + ".unevaluatedItems.uniqueItems", "uniqueItems"},
      // Number and string keywords the grammar would drop with only a warning.
      {schema(R"({"type": "object", "properties": {"s": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 2}}})"),
       rf + ".properties.s.pattern", "maxLength"},
      {schema(R"({"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]+$"})"), rf + ".pattern", "lookahead"},
      {schema(R"({"type": "string", "format": "date", "maxLength": 4})"), rf + ".format", "maxLength"},
      {schema(R"({"type": "number", "multipleOf": 0.5})"), rf + ".multipleOf", "multipleOf"},
      {schema(R"({"type": "integer", "multipleOf": 1.5})"), rf + ".multipleOf", "whole"},
      {schema(R"({"type": "integer", "multipleOf": 5, "minimum": 0})"), rf + ".multipleOf", "both"},
      {schema(R"({"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100000})"), rf + ".multipleOf", "10000"},
  };
  for (const BadCase& c : cases) {
    check_bad(Endpoint::kCompletions, c);
    check_bad(Endpoint::kChatCompletions, c);
  }
  // A forced tool call's parameters are held to the same rule; tools the model
  // may call freely (tool_choice auto) are not constrained, so not checked.
  const std::string tools = R"("tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
      "properties": {"xs": {"type": "array", "items": {"type": "integer"}, "uniqueItems": true}}}}}])";
  check_bad(Endpoint::kChatCompletions, {tools + R"(, "tool_choice": "required")",
                                         "tools[0].function.parameters.properties.xs.uniqueItems", "uniqueItems"});
  check_bad(Endpoint::kChatCompletions, {tools + R"(, "tool_choice": {"type": "function", "function": {"name": "f"}})",
                                         "tools[0].function.parameters.properties.xs.uniqueItems", "uniqueItems"});
  parse_ok(Endpoint::kChatCompletions, chat_with(tools + R"(, "tool_choice": "auto")"));
  // What is enforced, or trivially so, is accepted: oneOf (as anyOf), allOf of
  // one subschema, uniqueItems false or over at most one item, annotations.
  for (const char* ok : {
           R"({"oneOf": [{"type": "integer"}, {"type": "string"}], "title": "T", "x-vendor": 1})",
           R"({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}]})",
           R"({"type": "array", "items": {"type": "integer"}, "uniqueItems": false})",
           R"({"type": "array", "items": {"type": "integer"}, "uniqueItems": true, "maxItems": 1})",
           R"({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "patternProperties": {}})",
           R"({"type": "object", "properties": {"a": {"type": "integer"}}, "if": {}, "then": {}, "dependencies": {}})",
           R"({"type": "object", "properties": {"a": {"type": "integer"}}, "unevaluatedProperties": false})",
           R"({"type": "array", "prefixItems": [{"type": "integer"}], "unevaluatedItems": false})",
           R"({"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100})",
           R"({"type": "integer", "multipleOf": 5})",
           R"({"type": "string", "pattern": "^[a-z]{1,2}$"})",
           R"({"type": "string", "format": "my-format", "maxLength": 4})",
           R"({"type": "string", "format": "email"})"}) {
    CHECK(parse_ok(Endpoint::kChatCompletions, chat_with(schema(ok))).sampling.grammar.active());
  }
}

TEST_CASE("openai_api: unknown fields are refused, harmless ones ignored", "[openai_api]") {
  check_bad(Endpoint::kCompletions, {R"("length_penalty": 1.1)", "length_penalty", "unknown field: length_penalty"});
  check_bad(Endpoint::kChatCompletions, {R"("foo": 1)", "foo", "unknown field: foo"});
  // Fields of the other endpoint are unknown here.
  check_bad(Endpoint::kCompletions, {R"("messages": [])", "messages", "unknown field: messages"});
  check_bad(Endpoint::kCompletions, {R"("max_completion_tokens": 3)", "max_completion_tokens", "unknown field"});
  check_bad(Endpoint::kChatCompletions, {R"("prompt": "x")", "prompt", "unknown field: prompt"});
  for (const char* extra : {R"("user": "u")", R"("parallel_tool_calls": false)", R"("service_tier": "default")",
                            R"("metadata": {"a": "b"})", R"("store": true)"}) {
    parse_ok(Endpoint::kCompletions, completions_with(extra));
    parse_ok(Endpoint::kChatCompletions, chat_with(extra));
  }
}

TEST_CASE("openai_api: completions prompt validation", "[openai_api]") {
  // (prompt, the error's param: the element at fault where there is one, its message)
  const std::vector<std::tuple<std::string, std::string, std::string>> cases = {
      {R"([])", "prompt", "prompt must not be an empty array"},
      {R"({"text":"x"})", "prompt", "prompt must be a string, an array of strings, an array of token ids"},
      {R"([-1, 2])", "prompt[0]", "prompt[0] must be a token id (an integer >= 0), got -1"},
      {R"([1, 2.5])", "prompt[1]", "prompt[1] must be a token id"},
      {R"([1, "a"])", "prompt[1]", "prompt[1] must be a token id"},
      {R"([2147483648])", "prompt[0]", "prompt[0] must be a token id"},
      {R"([[1], []])", "prompt[1]", "prompt[1] must not be an empty array"},
      {R"([[1], [2, -3]])", "prompt[1][1]", "prompt[1][1] must be a token id"},
      {R"(["a", [1]])", "prompt", "(not mixed); prompt[1] is [1]"},
      {R"([[1], "a"])", "prompt", "(not mixed); prompt[1] is \"a\""},
      {R"([null])", "prompt", "prompt[0] is null"},
  };
  for (const auto& [prompt, param, message] : cases) {
    const ApiError e = parse_err(Endpoint::kCompletions, R"({"prompt":)" + prompt + "}");
    CHECK(e.param == param);
    CHECK_THAT(e.message, Catch::Matchers::Contains(message));
  }
  // At most kMaxChoices choices: prompts x n.
  std::string many = "[";
  for (int i = 0; i <= kMaxChoices; ++i) many += std::string(i ? "," : "") + "\"p\"";
  ApiError e = parse_err(Endpoint::kCompletions, R"({"prompt":)" + many + "]}");
  CHECK(e.param == "prompt");
  CHECK_THAT(e.message, Catch::Matchers::Contains("at most 128"));
  e = parse_err(Endpoint::kCompletions, R"({"prompt":["a","b","c"],"n":50})");
  CHECK(e.param == "n");
  CHECK_THAT(e.message, Catch::Matchers::Contains("3 prompts x n 50"));
  CHECK(parse_ok(Endpoint::kCompletions, R"({"prompt":["a","b"],"n":64})").n == 64);
}

TEST_CASE("openai_api: logprobs, top_logprobs, echo and max_tokens 0", "[openai_api]") {
  // Completions: logprobs is the number of alternatives; false or null is none.
  ApiRequest r = parse_ok(Endpoint::kCompletions, completions_with(R"("logprobs": 3)"));
  CHECK(r.sampling.logprobs == 3);
  CHECK_FALSE(r.sampling.prompt_logprobs);
  CHECK(parse_ok(Endpoint::kCompletions, completions_with(R"("logprobs": 0)")).sampling.logprobs == 0);
  CHECK(parse_ok(Endpoint::kCompletions, completions_with(R"("logprobs": false)")).sampling.logprobs == -1);
  CHECK(parse_ok(Endpoint::kCompletions, completions_with("")).sampling.logprobs == -1);
  // lm-evaluation-harness's loglikelihood request.
  r = parse_ok(Endpoint::kCompletions, R"({"prompt":[[1,2,3]],"echo":true,"max_tokens":0,"logprobs":1,"temperature":0})");
  CHECK(r.echo);
  CHECK(r.prompt_only);
  CHECK(r.sampling.max_tokens == 1);  // computed, then dropped
  CHECK(r.sampling.logprobs == 1);
  CHECK(r.sampling.prompt_logprobs);
  CHECK(r.sampling.validate().is_ok());
  r = parse_ok(Endpoint::kCompletions, completions_with(R"("echo": true, "max_tokens": 2)"));
  CHECK(r.echo);
  CHECK_FALSE(r.prompt_only);
  CHECK_FALSE(r.sampling.prompt_logprobs);  // echo without logprobs: the text alone
  check_bad(Endpoint::kCompletions, {R"("max_tokens": 0)", "max_tokens", "max_tokens 0 needs echo: true"});
  check_bad(Endpoint::kCompletions, {R"("logprobs": 21)", "logprobs", "logprobs must be an integer in [0, 20]"});
  check_bad(Endpoint::kCompletions, {R"("logprobs": -1)", "logprobs", "logprobs must be an integer in [0, 20]"});
  check_bad(Endpoint::kCompletions, {R"("logprobs": true)", "logprobs", "logprobs must be an integer"});
  check_bad(Endpoint::kCompletions, {R"("parse_special": 1)", "parse_special", "parse_special must be a boolean"});

  // Chat: logprobs is a boolean, top_logprobs the number of alternatives.
  r = parse_ok(Endpoint::kChatCompletions, chat_with(R"("logprobs": true, "top_logprobs": 5)"));
  CHECK(r.sampling.logprobs == 5);
  CHECK(parse_ok(Endpoint::kChatCompletions, chat_with(R"("logprobs": true)")).sampling.logprobs == 0);
  CHECK(parse_ok(Endpoint::kChatCompletions, chat_with(R"("logprobs": false, "top_logprobs": 0)")).sampling.logprobs == -1);
  check_bad(Endpoint::kChatCompletions, {R"("top_logprobs": 2)", "top_logprobs", "top_logprobs needs logprobs: true"});
  check_bad(Endpoint::kChatCompletions,
            {R"("logprobs": true, "top_logprobs": 21)", "top_logprobs", "top_logprobs must be an integer in [0, 20]"});
  check_bad(Endpoint::kChatCompletions,
            {R"("logprobs": true, "top_logprobs": -1e300)", "top_logprobs", "top_logprobs must be an integer in [0, 20]"});
  check_bad(Endpoint::kChatCompletions, {R"("logprobs": 1)", "logprobs", "logprobs must be a boolean"});
  check_bad(Endpoint::kChatCompletions, {R"("max_tokens": 0)", "max_tokens", "max_tokens must be >= 1"});
  check_bad(Endpoint::kChatCompletions, {R"("parse_special": false)", "parse_special", "unknown field"});
  CHECK(parse_ok(Endpoint::kChatCompletions, chat_with(R"("n": 3)")).n == 3);
}

TEST_CASE("openai_api: tokenize and detokenize requests", "[openai_api]") {
  ApiResult<TokenizeRequest> t = parse_tokenize(R"({"prompt":"hi <|im_start|>","add_special_tokens":false})");
  REQUIRE(t.is_ok());
  CHECK_FALSE(t.value().chat);
  CHECK(t.value().prompt == "hi <|im_start|>");
  CHECK_FALSE(t.value().add_special_tokens);
  CHECK(t.value().parse_special);
  t = parse_tokenize(R"({"messages":[{"role":"user","content":"x"}],"add_generation_prompt":false,"model":"m"})");
  REQUIRE(t.is_ok());
  CHECK(t.value().chat);
  CHECK(t.value().model == "m");
  REQUIRE(t.value().messages.size() == 1);
  CHECK_FALSE(t.value().add_generation_prompt);
  CHECK(t.value().add_special_tokens);  // as the chat endpoint feeds the model
  CHECK(t.value().tools.empty());
  t = parse_tokenize(R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":)"
                     R"({"name":"get_weather","parameters":{"type":"object"}}}],"tool_choice":"required"})");
  REQUIRE(t.is_ok());
  REQUIRE(t.value().tools.size() == 1);
  CHECK(t.value().tools[0].name == "get_weather");
  CHECK(t.value().tool_choice.mode == ToolChoiceMode::kRequired);
  const std::vector<std::pair<std::string, std::string>> bad_tokenize = {
      {R"({})", "prompt"},
      {R"({"prompt": 5})", "prompt"},
      {R"({"prompt": "x", "add_special_tokens": "yes"})", "add_special_tokens"},
      {R"({"prompt": "x", "add_generation_prompt": true})", "add_generation_prompt"},  // a chat field
      {R"({"messages": "x"})", "messages"},
      {R"({"messages": [{"role": "robot", "content": "x"}]})", "messages[0].role"},
      {R"({"prompt": "x", "junk": 1})", "junk"},
      {R"({"prompt": "x", "tools": []})", "tools"},  // a chat field
      {R"({"messages": [{"role": "user", "content": "x"}], "tools": 5})", "tools"},
      {R"([1])", ""},
      {R"({"prompt": "x")", ""},
  };
  for (const auto& [body, param] : bad_tokenize) {
    INFO(body);
    t = parse_tokenize(body);
    REQUIRE_FALSE(t.is_ok());
    CHECK(t.error().status == 400);
    CHECK(t.error().param == param);
  }
  ApiResult<DetokenizeRequest> d = parse_detokenize(R"({"tokens":[0, 5, 99]})", 100);
  REQUIRE(d.is_ok());
  CHECK(d.value().tokens == std::vector<TokenId>{0, 5, 99});
  CHECK(parse_detokenize(R"({"tokens":[]})", 100).is_ok());
  const std::vector<std::tuple<std::string, std::string, std::string>> bad_detokenize = {
      {R"({"tokens":[100]})", "tokens", "tokens[0] must be a token id in [0, 100), got 100"},
      {R"({"tokens":[1, -1]})", "tokens", "tokens[1] must be a token id in [0, 100)"},
      {R"({"tokens":[1, "a"]})", "tokens", "tokens[1] must be a token id"},
      {R"({"tokens":"1 2"})", "tokens", "tokens must be an array of token ids"},
      {R"({})", "tokens", "tokens is required"},
      {R"({"tokens":[1], "prompt": "x"})", "prompt", "unknown field: prompt"},
      {R"({"tokens":[1], "model": 1})", "model", "model must be a string"},
  };
  for (const auto& [body, param, message] : bad_detokenize) {
    INFO(body);
    d = parse_detokenize(body, 100);
    REQUIRE_FALSE(d.is_ok());
    CHECK(d.error().param == param);
    CHECK_THAT(d.error().message, Catch::Matchers::Contains(message));
  }
  json j = json::parse(tokenize_body({3, 4}, 8192));
  CHECK(j["tokens"] == json::array({3, 4}));
  CHECK(j["count"] == 2);
  CHECK(j["max_model_len"] == 8192);
  CHECK(json::parse(detokenize_body("a\xff"))["prompt"].get<std::string>().size() > 1);  // invalid UTF-8 replaced
}

TEST_CASE("openai_api: chat messages validation", "[openai_api]") {
  struct Case {
    std::string messages;
    std::string param;
    std::string message;
  };
  const std::vector<Case> cases = {
      {R"("hi")", "messages", "messages must be an array"},
      {R"([])", "messages", "messages must not be empty"},
      {R"(["hi"])", "messages[0]", "messages[0] must be an object"},
      {R"([{"content":"x"}])", "messages[0].role", "messages[0].role is required"},
      {R"([{"role":3,"content":"x"}])", "messages[0].role", "must be a string"},
      {R"([{"role":"user","content":"a"},{"role":"function","content":"x"}])", "messages[1].role",
       R"(must be "system", "user", "assistant" or "tool")"},
      {R"([{"role":"user","content":"a"},{"role":"tool","content":"x"}])", "messages[1].tool_call_id",
       "must be a string"},
      {R"([{"role":"user","content":"a","tool_call_id":"c"}])", "messages[0].tool_call_id", "only for tool"},
      {R"([{"role":"user","content":"a","tool_calls":[{"id":"1"}]}])", "messages[0].tool_calls", "only for assistant"},
      {R"([{"role":"assistant"}])", "messages[0].content", "is required"},
      {R"([{"role":"user"}])", "messages[0].content", "messages[0].content is required"},
      {R"([{"role":"user","content":null}])", "messages[0].content", "is required"},
      {R"([{"role":"user","content":5}])", "messages[0].content", "must be a string or an array of text parts"},
      {R"([{"role":"user","content":["x"]}])", "messages[0].content[0]", "must be an object"},
      {R"([{"role":"user","content":[{"type":"image_url","image_url":{"url":"u"}}]}])",
       "messages[0].content[0].type", "is not supported"},
      {R"([{"role":"user","content":[{"type":"text"}]}])", "messages[0].content[0].text", "must be a string"},
      {R"([{"role":"user","content":[{"type":"refusal","refusal":"no"}]}])", "messages[0].content[0].type",
       "is not supported"},
      {R"([{"role":"assistant","content":[{"type":"refusal","refusal":1}]}])", "messages[0].content[0].refusal",
       "must be a string"},
      {R"([{"role":"assistant","content":"x","tool_calls":[{"id":"1"}]}])", "messages[0].tool_calls[0].function",
       "is required"},
      {R"([{"role":"assistant","content":"x","function_call":{"name":"f"}}])", "messages[0].function_call",
       "not supported"},
  };
  for (const Case& c : cases) {
    const std::string body = R"({"messages":)" + c.messages + "}";
    INFO(body);
    const ApiError e = parse_err(Endpoint::kChatCompletions, body);
    CHECK(e.status == 400);
    CHECK(e.param == c.param);
    CHECK_THAT(e.message, Catch::Matchers::Contains(c.message));
  }
}

TEST_CASE("openai_api: nesting deeper than kMaxJsonDepth is refused before parsing", "[openai_api]") {
  // 500k levels in 1 MB: the parser itself is iterative, but showing the value
  // in an error message (dump()) recursed once per level and overflowed the stack.
  constexpr size_t kDeep = 500000;
  const std::string deep = R"({"model": )" + std::string(kDeep, '[') + std::string(kDeep, ']') + "}";
  ApiError e = parse_err(Endpoint::kCompletions, deep);
  CHECK(e.status == 400);
  CHECK(e.param.empty());
  CHECK_THAT(e.message, Catch::Matchers::Contains("deeper than the limit of 64 levels"));
  const std::string deep_objects = std::string(kDeep, '{') + std::string(kDeep, '}');  // invalid, still 400
  CHECK(parse_err(Endpoint::kChatCompletions, deep_objects).status == 400);

  auto nested = [](int depth) {  // a body of exactly `depth` levels, the root counting as one
    return R"({"prompt":"x","metadata":)" + std::string(depth - 1, '[') + std::string(depth - 1, ']') + "}";
  };
  parse_ok(Endpoint::kCompletions, nested(kMaxJsonDepth));
  e = parse_err(Endpoint::kCompletions, nested(kMaxJsonDepth + 1));
  CHECK_THAT(e.message, Catch::Matchers::Contains("64"));

  // Brackets inside strings (escaped quotes included) are text, not nesting.
  const std::string brackets(1000, '[');
  CHECK(parse_ok(Endpoint::kCompletions, R"({"prompt":"\")" + brackets + R"("})").prompts[0].text == "\"" + brackets);
  const std::string stop_brackets(kMaxStopBytes, '[');
  CHECK(parse_ok(Endpoint::kCompletions, R"({"prompt":"\\", "stop":")" + stop_brackets + R"("})").stop[0] ==
        stop_brackets);

  // At the limit, the value shown in the message is still bounded.
  const std::string at_limit = R"({"model":)" + std::string(kMaxJsonDepth - 1, '[') +
                               std::string(kMaxJsonDepth - 1, ']') + "}";
  e = parse_err(Endpoint::kCompletions, at_limit);
  CHECK(e.param == "model");
  CHECK(e.message.size() < 40 + kMaxShownChars);
}

TEST_CASE("openai_api: values and keys shown in errors are bounded", "[openai_api]") {
  const std::string big(1 << 20, 'x');
  struct Case {
    std::string extra;
    std::string param;
  };
  const std::vector<Case> cases = {
      {R"("temperature": ")" + big + R"(")", "temperature"},
      {R"("max_tokens": [")" + big + R"(", 1, 2])", "max_tokens"},
      {R"("seed": {")" + big + R"(": ")" + big + R"("})", "seed"},
      {R"("stop": ["a", [")" + big + R"("]])", "stop"},
      {R"("model": [)" + [] {
         std::string many;
         for (int i = 0; i < 100000; ++i) many += (i ? ",1" : "1");
         return many;
       }() + "]",
       "model"},
  };
  for (const Case& c : cases) {
    const ApiError e = parse_err(Endpoint::kCompletions, completions_with(c.extra));
    CHECK(e.param == c.param);
    CHECK(e.message.size() < 60 + kMaxShownChars);
    CHECK_THAT(e.message, Catch::Matchers::EndsWith("..."));
  }
  // An unknown key (top level or in stream_options) is cut in the message and in param.
  ApiError e = parse_err(Endpoint::kCompletions, completions_with(R"(")" + big + R"(": 1)"));
  CHECK(e.param.size() <= kMaxShownChars);
  CHECK(e.message.size() < 40 + kMaxShownChars);
  CHECK_THAT(e.message, Catch::Matchers::StartsWith("unknown field: xxx"));
  e = parse_err(Endpoint::kCompletions, completions_with(R"("stream": true, "stream_options": {")" + big + R"(": 1})"));
  CHECK(e.param.size() <= 20 + kMaxShownChars);
  CHECK(e.message.size() < 60 + kMaxShownChars);
  // A cut never splits a UTF-8 character.
  std::string utf8;
  for (int i = 0; i < 200; ++i) utf8 += "\xc3\xa9";  // é
  e = parse_err(Endpoint::kCompletions, completions_with(R"(")" + utf8 + R"(": 1)"));
  CHECK_NOTHROW(json(e.param).dump());  // strict: throws on invalid UTF-8
  CHECK_NOTHROW(json(e.message).dump());
  // shown_text: for the router's own messages (a model name, a path).
  CHECK(shown_text("tiny") == "tiny");
  CHECK(shown_text(std::string(kMaxShownChars, 'm')) == std::string(kMaxShownChars, 'm'));
  CHECK(shown_text(big) == std::string(kMaxShownChars - 3, 'x') + "...");
  CHECK(shown_text(utf8).size() <= kMaxShownChars);
  CHECK_NOTHROW(json(shown_text(utf8)).dump());
  // Invalid JSON with a huge token: the parser's message is cut too.
  e = parse_err(Endpoint::kCompletions, R"({"prompt": ")" + big);
  CHECK_THAT(e.message, Catch::Matchers::StartsWith("invalid JSON: "));
  CHECK(e.message.size() < 20 + 2 * kMaxShownChars);
}

TEST_CASE("openai_api: numbers beyond double range are a 400 naming the field", "[openai_api]") {
  const std::vector<BadCase> cases = {
      {R"("temperature": 1e400)", "temperature", "temperature is beyond the range of a double"},
      {R"("temperature": -1e400)", "temperature", "got -1e400"},
      {R"("max_tokens": 1E+999)", "max_tokens", "max_tokens is beyond the range of a double"},
      {R"("seed": -123e456)", "seed", "seed is beyond"},
      {R"("metadata": {"x": [1, 2, 1e400]})", "metadata.x[2]", "metadata.x[2] is beyond"},
  };
  for (const BadCase& c : cases) {
    check_bad(Endpoint::kCompletions, c);
    check_bad(Endpoint::kChatCompletions, c);
  }
  ApiError e = parse_err(Endpoint::kChatCompletions, R"({"messages":[{"role":"user","content":"a"},
      {"role":"user","content":[{"type":"text","text":"b"},{"type":"text","text":1e999}]}]})");
  CHECK(e.status == 400);
  CHECK(e.param == "messages[1].content[1].text");
  e = parse_err(Endpoint::kCompletions, "1e400");
  CHECK(e.status == 400);
  CHECK(e.param.empty());
  // Huge but finite is an ordinary range error.
  check_bad(Endpoint::kCompletions, {R"("temperature": 1e300)", "temperature", "temperature must be in [0, 2]"});
  check_bad(Endpoint::kCompletions, {R"("top_p": -1.7e308)", "top_p", "top_p must be in (0, 1]"});
  // In range as a double, 0 as a float: the sampler gets the smallest float above 0, never 0.
  const ApiRequest tiny = parse_ok(Endpoint::kCompletions, completions_with(R"("top_p": 1e-320, "temperature": 1e-320)"));
  CHECK(tiny.sampling.top_p > 0.0f);
  CHECK(tiny.sampling.temperature == 0.0f);  // a closed bound: 0 is in range
  CHECK(tiny.sampling.validate().is_ok());
}

TEST_CASE("openai_api: integers beyond their type are a 400 naming the field", "[openai_api]") {
  const std::vector<BadCase> cases = {
      {R"("max_tokens": 1e300)", "max_tokens", "max_tokens must be an integer in ["},
      {R"("max_tokens": 18446744073709551615)", "max_tokens", "max_tokens must be an integer in ["},
      {R"("max_tokens": 9223372036854775808)", "max_tokens", "max_tokens must be an integer in ["},
      {R"("max_tokens": -1e300)", "max_tokens", "max_tokens must be >= "},
      {R"("max_tokens": -9223372036854775808)", "max_tokens", "max_tokens must be >= "},
      {R"("seed": 1e30)", "seed", "seed must be an integer in [-9223372036854775808, 18446744073709551615]"},
      {R"("seed": -1e30)", "seed", "seed must be an integer in ["},
      {R"("seed": 18446744073709551616)", "seed", "seed must be an integer in ["},  // 2^64: parsed as a float
      // -2^63 - 1: parsed as a float that rounds to exactly -2^63, yet still out of range.
      {R"("seed": -9223372036854775809)", "seed", "seed must be an integer in ["},
      {R"("top_k": -9223372036854775809)", "top_k", "top_k must be an integer in [-1, "},
      {R"("seed": 0.5)", "seed", "seed must be an integer, got 0.5"},
      {R"("n": 1e20)", "n", "n must be an integer in [1, 128]"},
      {R"("n": 18446744073709551615)", "n", "n must be an integer in [1, 128]"},
      {R"("n": -1e20)", "n", "n must be an integer in [1, 128]"},
      {R"("top_k": 1e19)", "top_k", "top_k must be an integer in [-1, 9223372036854775807]"},
      {R"("top_k": 18446744073709551615)", "top_k", "top_k must be an integer in [-1, "},
      {R"("top_k": -1e19)", "top_k", "top_k must be an integer in [-1, "},
      {R"("top_k": -9223372036854775808)", "top_k", "top_k must be -1 or 0 (disabled) or >= 1"},
      {R"("best_of": 1e300)", "best_of", "best_of is not supported"},
  };
  for (const BadCase& c : cases) {
    check_bad(Endpoint::kCompletions, c);
    check_bad(Endpoint::kChatCompletions, c);
  }
  check_bad(Endpoint::kChatCompletions,
            {R"("max_completion_tokens": 1e300)", "max_completion_tokens", "max_completion_tokens must be an integer in"});
  // The edges of each type are accepted (and clamped where documented).
  ApiRequest r = parse_ok(Endpoint::kCompletions, completions_with(R"("max_tokens": 9223372036854775807,
      "top_k": 9223372036854775807, "seed": -9223372036854775808)"));
  CHECK(r.sampling.max_tokens == 2147483647);
  CHECK(r.sampling.top_k == 2147483647);
  CHECK(r.sampling.seed == uint64_t{1} << 63);
  r = parse_ok(Endpoint::kCompletions, completions_with(R"("seed": 1.5e19, "max_tokens": 9.0e18, "top_k": 3e9)"));
  CHECK(r.sampling.seed == 15000000000000000000u);
  CHECK(r.sampling.max_tokens == 2147483647);
  CHECK(r.sampling.top_k == 2147483647);
  r = parse_ok(Endpoint::kCompletions, completions_with(R"("seed": -9.223372036854775808e18, "n": 1.0)"));
  CHECK(r.sampling.seed == uint64_t{1} << 63);
}

TEST_CASE("openai_api: error_body has OpenAI's shape", "[openai_api]") {
  ApiError e;
  e.message = "temperature must be in [0, 2], got 3";
  e.param = "temperature";
  json j = json::parse(error_body(e));
  REQUIRE(j.contains("error"));
  CHECK(j["error"]["message"] == e.message);
  CHECK(j["error"]["type"] == "invalid_request_error");
  CHECK(j["error"]["param"] == "temperature");
  CHECK(j["error"]["code"].is_null());
  CHECK(j["error"].size() == 4);

  ApiError busy{503, "overloaded \"now\"\n", "server_error", "", "overloaded"};
  j = json::parse(error_body(busy));
  CHECK(j["error"]["message"] == "overloaded \"now\"\n");
  CHECK(j["error"]["type"] == "server_error");
  CHECK(j["error"]["param"].is_null());
  CHECK(j["error"]["code"] == "overloaded");
}

TEST_CASE("openai_api: non-streaming bodies", "[openai_api]") {
  const std::string& nonce = pd::router::response_id_nonce();
  REQUIRE(nonce.size() == 16);
  CHECK(nonce.find_first_not_of("0123456789abcdef") == std::string::npos);
  CHECK(make_response_id(Endpoint::kCompletions, 7) == "cmpl-" + nonce + "-7");
  CHECK(make_response_id(Endpoint::kChatCompletions, 8) == "chatcmpl-" + nonce + "-8");

  json j = json::parse(completion_body(Endpoint::kCompletions, "cmpl-7", "smol", 1700000000,
                                       {choice(0, "hello \"world\"", "length")}, Usage{5, 3}));
  CHECK(j["id"] == "cmpl-7");
  CHECK(j["object"] == "text_completion");
  CHECK(j["created"] == 1700000000);
  CHECK(j["model"] == "smol");
  REQUIRE(j["choices"].size() == 1);
  CHECK(j["choices"][0]["index"] == 0);
  CHECK(j["choices"][0]["text"] == "hello \"world\"");
  CHECK(j["choices"][0]["logprobs"].is_null());
  CHECK(j["choices"][0]["finish_reason"] == "length");
  CHECK(j["usage"]["prompt_tokens"] == 5);
  CHECK(j["usage"]["completion_tokens"] == 3);
  CHECK(j["usage"]["total_tokens"] == 8);

  j = json::parse(
      completion_body(Endpoint::kChatCompletions, "chatcmpl-8", "smol", 1, {choice(0, "héllo", "stop")}, Usage{10, 2}));
  CHECK(j["object"] == "chat.completion");
  CHECK(j["choices"][0]["message"]["role"] == "assistant");
  CHECK(j["choices"][0]["message"]["content"] == "héllo");
  CHECK_FALSE(j["choices"][0].contains("text"));
  CHECK(j["choices"][0]["logprobs"].is_null());
  CHECK(j["choices"][0]["finish_reason"] == "stop");
  CHECK(j["usage"]["total_tokens"] == 12);

  // Invalid UTF-8 never breaks the body (replaced, still valid JSON).
  j = json::parse(completion_body(Endpoint::kCompletions, "cmpl-1", "m", 1, {choice(0, std::string("a\xff") + "b", "stop")}, {}));
  CHECK(j["choices"][0]["text"].get<std::string>().size() > 2);

  // Several choices, in the order given, each with its index.
  j = json::parse(completion_body(Endpoint::kCompletions, "cmpl-2", "m", 1,
                                  {choice(0, "a", "stop"), choice(1, "b", "length"), choice(2, "c", "stop")}, {6, 9}));
  REQUIRE(j["choices"].size() == 3);
  for (int i = 0; i < 3; ++i) CHECK(j["choices"][i]["index"] == i);
  CHECK(j["choices"][1]["text"] == "b");
  CHECK(j["choices"][1]["finish_reason"] == "length");
  CHECK(j["usage"]["total_tokens"] == 15);
}

TEST_CASE("openai_api: logprobs in OpenAI's shapes", "[openai_api]") {
  ChoiceOut c = choice(0, "Hi th\xc3\xa9", "length");
  c.with_logprobs = true;
  c.logprobs = {ShownToken{"Hi", std::nullopt, {}},  // an echoed prompt's first token
                ShownToken{" th", -0.5f, {{" th", -0.5f}, {" the", -1.25f}}},
                ShownToken{"\xc3", -0.25f, {{"\xc3", -0.25f}}},  // half of "é"
                ShownToken{"\xa9", -std::numeric_limits<float>::infinity(), {{"x", -2.0f}}}};
  json j = json::parse(completion_body(Endpoint::kCompletions, "cmpl-1", "m", 1, {c}, {}));
  const json& lp = j["choices"][0]["logprobs"];
  CHECK(lp["tokens"] == json::array({"Hi", " th", "\xef\xbf\xbd", "\xef\xbf\xbd"}));  // invalid UTF-8 replaced
  CHECK(lp["token_logprobs"][0].is_null());
  CHECK(lp["token_logprobs"][1] == -0.5);
  CHECK(lp["token_logprobs"][3] == -9999.0);  // -inf has no JSON form
  CHECK(lp["top_logprobs"][0].is_null());
  CHECK(lp["top_logprobs"][1] == json({{" th", -0.5}, {" the", -1.25}}));
  CHECK(lp["top_logprobs"][3] == json({{"x", -2.0}, {"\xef\xbf\xbd", -9999.0}}));  // the token itself joins, as vLLM
  CHECK(lp["text_offset"] == json::array({0, 2, 5, 6}));  // "é" counts once, at its first byte
  c.text_offset = 10;  // a later stream chunk
  j = json::parse(stream_chunk(Endpoint::kCompletions, "cmpl-1", "m", 1, c, false));
  CHECK(j["choices"][0]["logprobs"]["text_offset"] == json::array({10, 12, 15, 16}));
  // A token that prints nothing (a skipped control token) does not move the offsets.
  ChoiceOut h = choice(0, "ab", "stop");
  h.with_logprobs = true;
  h.logprobs = {ShownToken{"a", -0.5f, {}}, ShownToken{"<|im_start|>", -0.5f, {}, false}, ShownToken{"b", -0.5f, {}}};
  j = json::parse(completion_body(Endpoint::kCompletions, "cmpl-1", "m", 1, {h}, {}));
  CHECK(j["choices"][0]["logprobs"]["tokens"] == json::array({"a", "<|im_start|>", "b"}));
  CHECK(j["choices"][0]["logprobs"]["text_offset"] == json::array({0, 1, 1}));

  j = json::parse(completion_body(Endpoint::kChatCompletions, "chatcmpl-1", "m", 1, {c}, {}));
  const json& content = j["choices"][0]["logprobs"]["content"];
  CHECK(j["choices"][0]["logprobs"]["refusal"].is_null());
  REQUIRE(content.size() == 4);
  CHECK(content[1]["token"] == " th");
  CHECK(content[1]["logprob"] == -0.5);
  CHECK(content[1]["bytes"] == json::array({32, 116, 104}));
  CHECK(content[2]["bytes"] == json::array({0xc3}));
  REQUIRE(content[1]["top_logprobs"].size() == 2);
  CHECK(content[1]["top_logprobs"][1] == json({{"token", " the"}, {"logprob", -1.25}, {"bytes", {32, 116, 104, 101}}}));
  CHECK(content[3]["top_logprobs"].size() == 1);  // chat: exactly the alternatives asked for
  j = json::parse(stream_chunk(Endpoint::kChatCompletions, "chatcmpl-1", "m", 1, c, true));
  CHECK(j["choices"][0]["logprobs"]["content"].size() == 4);
}

TEST_CASE("openai_api: stream chunks", "[openai_api]") {
  json j = json::parse(stream_chunk(Endpoint::kCompletions, "cmpl-1", "smol", 5, choice(0, "tok"), true));
  CHECK(j["object"] == "text_completion");
  CHECK(j["id"] == "cmpl-1");
  CHECK(j["created"] == 5);
  CHECK(j["choices"][0]["text"] == "tok");
  CHECK(j["choices"][0]["finish_reason"].is_null());
  CHECK(j["choices"][0]["logprobs"].is_null());
  CHECK_FALSE(j.contains("usage"));
  j = json::parse(stream_chunk(Endpoint::kCompletions, "cmpl-1", "smol", 5, choice(3, "", "stop"), false));
  CHECK(j["choices"][0]["finish_reason"] == "stop");
  CHECK(j["choices"][0]["index"] == 3);

  j = json::parse(stream_chunk(Endpoint::kChatCompletions, "chatcmpl-1", "smol", 5, choice(0, "Hi"), true));
  CHECK(j["object"] == "chat.completion.chunk");
  CHECK(j["choices"][0]["index"] == 0);
  CHECK(j["choices"][0]["delta"]["role"] == "assistant");
  CHECK(j["choices"][0]["delta"]["content"] == "Hi");
  CHECK(j["choices"][0]["finish_reason"].is_null());
  j = json::parse(stream_chunk(Endpoint::kChatCompletions, "chatcmpl-1", "smol", 5, choice(0, " there", "stop"), false));
  CHECK_FALSE(j["choices"][0]["delta"].contains("role"));
  CHECK(j["choices"][0]["delta"]["content"] == " there");
  CHECK(j["choices"][0]["finish_reason"] == "stop");

  for (Endpoint ep : {Endpoint::kCompletions, Endpoint::kChatCompletions}) {
    j = json::parse(usage_chunk(ep, "x-1", "smol", 9, Usage{4, 6}));
    CHECK(j["object"] == (ep == Endpoint::kCompletions ? "text_completion" : "chat.completion.chunk"));
    CHECK(j["choices"].is_array());
    CHECK(j["choices"].empty());
    CHECK(j["usage"]["prompt_tokens"] == 4);
    CHECK(j["usage"]["completion_tokens"] == 6);
    CHECK(j["usage"]["total_tokens"] == 10);
  }
}

TEST_CASE("openai_api: models body", "[openai_api]") {
  const json j = json::parse(models_body("smol", 42));
  CHECK(j["object"] == "list");
  REQUIRE(j["data"].size() == 1);
  CHECK(j["data"][0]["id"] == "smol");
  CHECK(j["data"][0]["object"] == "model");
  CHECK(j["data"][0]["created"] == 42);
  CHECK(j["data"][0]["owned_by"] == "pdcluster");
}

}  // namespace
}  // namespace pd::router
