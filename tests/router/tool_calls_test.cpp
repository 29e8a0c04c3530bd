// Tests of the tool-call functions: every parse error names its field; the
// tools and tool turns render exactly as the models' own Jinja templates render
// them (expected strings made with jinja2 from tests/data/reference_chat's
// Qwen2.5, Qwen3 and Llama 3.1 templates, tools passed as the request gives
// them, tool-call arguments as objects, as vLLM passes them); the forcing
// grammar's schema; output parsing; and streaming equal to parsing the whole.
#include "router/tool_calls.h"

#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <vector>

namespace tool_calls_test {

using nlohmann::json;
using nlohmann::ordered_json;
using pd::ChatMessage;
using pd::ChatTemplate;
using pd::GrammarKind;
using pd::GrammarSpec;
using pd::ToolFormat;
using pd::router::ApiError;
using pd::router::ApiMessage;
using pd::router::ParsedOutput;
using pd::router::ToolCall;
using pd::router::ToolCallStream;
using pd::router::ToolChoice;
using pd::router::ToolChoiceMode;
using pd::router::ToolFunction;

const char* kWeatherTool = R"({"type": "function", "function": {"name": "get_weather", "description": "Get the weather",
  "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})";
const char* kTimeTool = R"({"type": "function", "function": {"name": "get_time"}})";

// The body's tools parsed (keys in order), REQUIREd to succeed.
std::vector<ToolFunction> tools_of(const std::string& body, ToolChoice* choice = nullptr) {
  std::vector<ToolFunction> tools;
  ToolChoice c;
  const std::optional<ApiError> e = pd::router::parse_tools(ordered_json::parse(body), tools, c);
  INFO((e ? e->param + ": " + e->message : std::string("ok")));
  REQUIRE_FALSE(e.has_value());
  if (choice) *choice = c;
  return tools;
}

std::vector<ToolFunction> weather_and_time() {
  return tools_of(std::string(R"({"tools": [)") + kWeatherTool + ", " + kTimeTool + "]}");
}

// The 400 parse_tools gives for `body` (REQUIREd).
ApiError tools_error(const std::string& body) {
  std::vector<ToolFunction> tools;
  ToolChoice c;
  const std::optional<ApiError> e = pd::router::parse_tools(json::parse(body), tools, c);
  INFO(body);
  REQUIRE(e.has_value());
  CHECK(e->status == 400);
  CHECK(e->type == "invalid_request_error");
  return *e;
}

ApiError calls_error(const std::string& msg) {
  std::vector<ToolCall> calls;
  const std::optional<ApiError> e = pd::router::parse_message_tool_calls(json::parse(msg), "messages[2]", calls);
  INFO(msg);
  REQUIRE(e.has_value());
  CHECK(e->status == 400);
  return *e;
}

ToolCall call(std::string id, std::string name, std::string args) {
  return ToolCall{std::move(id), std::move(name), std::move(args)};
}

// The conversation of the rendering tests: a system message, two calls in one
// turn, their two results, an answer and a new question.
std::vector<ApiMessage> conversation(bool with_system) {
  std::vector<ApiMessage> m;
  if (with_system) m.push_back({"system", "You are terse.", {}, ""});
  m.push_back({"user", "Weather in Paris and the time?", {}, ""});
  m.push_back({"assistant", "",
               {call("call_1", "get_weather", R"({"city":"Paris"})"), call("call_2", "get_time", "{}")},
               ""});
  m.push_back({"tool", "18C", {}, "call_1"});
  m.push_back({"tool", "12:00", {}, "call_2"});
  m.push_back({"assistant", "It is 18C at 12:00.", {}, ""});
  m.push_back({"user", "Thanks", {}, ""});
  return m;
}

const std::string kToolsSection =
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>\n"
    R"({"type": "function", "function": {"name": "get_weather", "description": "Get the weather", "parameters": )"
    R"({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})"
    "\n"
    R"({"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}})"
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call>";

const std::string kHermesTurns =
    "<|im_start|>user\nWeather in Paris and the time?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
    R"({"name": "get_weather", "arguments": {"city": "Paris"}})"
    "\n</tool_call>\n<tool_call>\n"
    R"({"name": "get_time", "arguments": {}})"
    "\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n12:00\n"
    "</tool_response><|im_end|>\n<|im_start|>assistant\nIt is 18C at 12:00.<|im_end|>\n<|im_start|>user\nThanks"
    "<|im_end|>\n<|im_start|>assistant\n";

// render_tool_messages, then the template: the prompt text.
std::string prompt(const ChatTemplate& tpl, const std::vector<ApiMessage>& messages,
                   const std::vector<ToolFunction>& tools, ToolChoice choice) {
  auto rendered = pd::router::render_tool_messages(tpl.tool_format(), messages, tools, choice, tpl.default_system());
  INFO((rendered ? std::string("ok") : rendered.error().message));
  REQUIRE(rendered.is_ok());
  const ChatTemplate t = pd::router::tools_described(tools, choice) ? tpl.with_tools_described() : tpl;
  auto text = t.apply(rendered.value());
  INFO(text.status().to_string());
  REQUIRE(text.is_ok());
  return *text;
}

ChatTemplate named(const char* name) {
  auto t = ChatTemplate::from_name(name);
  REQUIRE(t.is_ok());
  return *t;
}

// The same text fed whole, and in pieces of every size from 1 to 7, gives the
// same content and calls.
void check_stream_matches(ToolFormat format, const std::string& text, const std::vector<ToolFunction>& tools) {
  INFO("text: " << text);
  const ParsedOutput whole = pd::router::parse_tool_output(format, text, tools, "chatcmpl-7_0");
  for (size_t step = 1; step <= 7; ++step) {
    INFO("pieces of " << step);
    ToolCallStream s(format, tools, "chatcmpl-7_0");
    std::string content;
    std::vector<ToolCall> calls;
    auto take = [&](ToolCallStream::Piece p) {
      content += p.content;
      calls.insert(calls.end(), p.calls.begin(), p.calls.end());
    };
    for (size_t i = 0; i < text.size(); i += step) take(s.feed(std::string_view(text).substr(i, step)));
    take(s.finish());
    CHECK(content == whole.content);
    REQUIRE(calls.size() == whole.calls.size());
    CHECK(s.calls_so_far() == static_cast<int>(whole.calls.size()));
    for (size_t i = 0; i < calls.size(); ++i) {
      CHECK(calls[i].id == whole.calls[i].id);
      CHECK(calls[i].name == whole.calls[i].name);
      CHECK(calls[i].arguments == whole.calls[i].arguments);
    }
  }
}


TEST_CASE("tools: none, null or empty means no tools and tool_choice none", "[tool_calls]") {
  for (const char* body : {R"({})", R"({"tools": null})", R"({"tools": []})", R"({"tools": [], "tool_choice": "auto"})",
                           R"({"tool_choice": "none"})", R"({"tools": null, "tool_choice": null})"}) {
    ToolChoice c;
    CHECK(tools_of(body, &c).empty());
    CHECK(c.mode == ToolChoiceMode::kNone);
  }
}

TEST_CASE("tools: functions are read with their description and parameters", "[tool_calls]") {
  ToolChoice c;
  const auto tools = tools_of(std::string(R"({"tools": [)") + kWeatherTool + ", " + kTimeTool + "]}", &c);
  REQUIRE(tools.size() == 2);
  CHECK(tools[0].name == "get_weather");
  CHECK(tools[0].description == "Get the weather");
  // The client's key order is kept (ordered_json body).
  CHECK(tools[0].parameters == R"({"type":"object","properties":{"city":{"type":"string"}},"required":["city"]})");
  CHECK(tools[1].name == "get_time");
  CHECK(tools[1].description.empty());
  CHECK(tools[1].parameters == R"({"type":"object","properties":{}})");
  CHECK(c.mode == ToolChoiceMode::kAuto);
  // strict, a null description and null parameters are accepted.
  const auto t2 = tools_of(R"({"tools": [{"type": "function", "function": {"name": "a-b_C9", "strict": true,
      "description": null, "parameters": null}}]})");
  REQUIRE(t2.size() == 1);
  CHECK(t2[0].parameters == R"({"type":"object","properties":{}})");
  // A body parsed as nlohmann::json has its keys sorted.
  std::vector<ToolFunction> sorted;
  ToolChoice c2;
  REQUIRE_FALSE(pd::router::parse_tools(json::parse(std::string(R"({"tools": [)") + kWeatherTool + "]}"), sorted, c2));
  CHECK(sorted[0].parameters == R"({"properties":{"city":{"type":"string"}},"required":["city"],"type":"object"})");
}

TEST_CASE("tools: tool_choice auto, none, required and a named function", "[tool_calls]") {
  const std::string tools = std::string(R"("tools": [)") + kWeatherTool + ", " + kTimeTool + "]";
  ToolChoice c;
  tools_of("{" + tools + R"(, "tool_choice": "auto"})", &c);
  CHECK(c.mode == ToolChoiceMode::kAuto);
  tools_of("{" + tools + R"(, "tool_choice": "none"})", &c);
  CHECK(c.mode == ToolChoiceMode::kNone);
  tools_of("{" + tools + R"(, "tool_choice": "required"})", &c);
  CHECK(c.mode == ToolChoiceMode::kRequired);
  tools_of("{" + tools + R"(, "tool_choice": {"type": "function", "function": {"name": "get_time"}}})", &c);
  CHECK(c.mode == ToolChoiceMode::kNamed);
  CHECK(c.name == "get_time");
  tools_of("{" + tools + R"(, "tool_choice": null})", &c);
  CHECK(c.mode == ToolChoiceMode::kAuto);
}

TEST_CASE("tools: malformed tools are refused naming the field", "[tool_calls]") {
  const std::string w = kWeatherTool;
  struct Case {
    std::string body, param;
  };
  std::string many = R"({"tools": [)";
  for (int i = 0; i < 129; ++i) {
    many += std::string(i ? "," : "") + R"({"function": {"name": "f)" + std::to_string(i) + "\"}}";
  }
  many += "]}";
  const std::vector<Case> cases = {
      {R"({"tools": {}})", "tools"},
      {R"({"tools": "get_weather"})", "tools"},
      {many, "tools"},
      {"{\"tools\": [" + w + ", 5]}", "tools[1]"},
      {R"({"tools": [{"type": "retrieval", "function": {"name": "f"}}]})", "tools[0].type"},
      {R"({"tools": [{"type": "function"}]})", "tools[0].function"},
      {R"({"tools": [{"type": "function", "function": "f"}]})", "tools[0].function"},
      {R"({"tools": [{"type": "function", "function": {"name": "f"}, "extra": 1}]})", "tools[0].extra"},
      {R"({"tools": [{"type": "function", "function": {"name": "f", "returns": {}}}]})", "tools[0].function.returns"},
      {R"({"tools": [{"type": "function", "function": {"description": "d"}}]})", "tools[0].function.name"},
      {R"({"tools": [{"type": "function", "function": {"name": ""}}]})", "tools[0].function.name"},
      {R"({"tools": [{"type": "function", "function": {"name": "get weather"}}]})", "tools[0].function.name"},
      {R"({"tools": [{"type": "function", "function": {"name": "f.g"}}]})", "tools[0].function.name"},
      {R"({"tools": [{"type": "function", "function": {"name": 7}}]})", "tools[0].function.name"},
      {R"({"tools": [{"function": {"name": ")" + std::string(65, 'a') + "\"}}]}", "tools[0].function.name"},
      {"{\"tools\": [" + w + ", " + w + "]}", "tools[1].function.name"},
      {R"({"tools": [{"function": {"name": "f", "parameters": "{}"}}]})", "tools[0].function.parameters"},
      {R"({"tools": [{"function": {"name": "f", "parameters": []}}]})", "tools[0].function.parameters"},
      {R"({"tools": [{"function": {"name": "f", "description": 3}}]})", "tools[0].function.description"},
      {R"({"tools": [{"function": {"name": "f", "strict": "yes"}}]})", "tools[0].function.strict"},
  };
  for (const Case& c : cases) {
    const ApiError e = tools_error(c.body);
    CHECK(e.param == c.param);
    CHECK_THAT(e.message, Catch::Contains(c.param));
  }
  // 64 characters is the longest name.
  CHECK(tools_of(R"({"tools": [{"function": {"name": ")" + std::string(64, 'a') + "\"}}]}").size() == 1);
}

TEST_CASE("tools: a tool_choice that cannot be met is refused naming tool_choice", "[tool_calls]") {
  const std::string tools = std::string(R"("tools": [)") + kWeatherTool + "]";
  for (const std::string& body : {
           std::string(R"({"tool_choice": "required"})"),
           std::string(R"({"tools": [], "tool_choice": "required"})"),
           std::string(R"({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}})"),
           "{" + tools + R"(, "tool_choice": {"type": "function", "function": {"name": "get_time"}}})",
           "{" + tools + R"(, "tool_choice": "sometimes"})",
           "{" + tools + R"(, "tool_choice": 1})",
           "{" + tools + R"(, "tool_choice": {"type": "function"}})",
           "{" + tools + R"(, "tool_choice": {"type": "tool", "function": {"name": "get_weather"}}})",
           "{" + tools + R"(, "tool_choice": {"function": {"name": 3}}})",
       }) {
    const ApiError e = tools_error(body);
    CHECK(e.param == "tool_choice");
    CHECK_THAT(e.message, Catch::Contains("tool_choice"));
  }
  CHECK_THAT(tools_error("{" + tools + R"(, "tool_choice": {"function": {"name": "get_time"}}})").message,
             Catch::Contains("get_time") && Catch::Contains("not among the tools"));
  CHECK(tools_error("{" + tools + R"(, "tool_choice": {"function": {"name": "x", "y": 1}}})").param ==
        "tool_choice.function.y");
}

TEST_CASE("tool_calls: an assistant message's calls are read", "[tool_calls]") {
  std::vector<ToolCall> calls;
  REQUIRE_FALSE(pd::router::parse_message_tool_calls(json::parse(R"({"role": "assistant", "content": null,
      "tool_calls": [{"id": "call_9", "type": "function", "function": {"name": "get_weather",
      "arguments": "{\"city\": \"Paris\", \"days\": 2}"}}, {"id": "c2", "function": {"name": "get_time",
      "arguments": "{}"}}]})"), "messages[1]", calls));
  REQUIRE(calls.size() == 2);
  CHECK(calls[0].id == "call_9");
  CHECK(calls[0].name == "get_weather");
  CHECK(calls[0].arguments == R"({"city":"Paris","days":2})");  // compact, in order
  CHECK(calls[1].arguments == "{}");
  std::vector<ToolCall> none;
  REQUIRE_FALSE(pd::router::parse_message_tool_calls(json::parse(R"({"role": "assistant", "content": "hi"})"),
                                                     "messages[0]", none));
  REQUIRE_FALSE(pd::router::parse_message_tool_calls(json::parse(R"({"tool_calls": null})"), "messages[0]", none));
  CHECK(none.empty());
}

TEST_CASE("tool_calls: a malformed call is refused naming its path", "[tool_calls]") {
  struct Case {
    std::string msg, param;
  };
  const std::string f = R"("function": {"name": "f", "arguments": "{}"})";
  const std::vector<Case> cases = {
      {R"({"tool_calls": {}})", "messages[2].tool_calls"},
      {R"({"tool_calls": [3]})", "messages[2].tool_calls[0]"},
      {R"({"tool_calls": [{)" + f + "}]}", "messages[2].tool_calls[0].id"},
      {R"({"tool_calls": [{"id": 5, )" + f + "}]}", "messages[2].tool_calls[0].id"},
      {R"({"tool_calls": [{"id": "a", "type": "code", )" + f + "}]}", "messages[2].tool_calls[0].type"},
      {R"({"tool_calls": [{"id": "a", "extra": 1, )" + f + "}]}", "messages[2].tool_calls[0].extra"},
      {R"({"tool_calls": [{"id": "a"}]})", "messages[2].tool_calls[0].function"},
      {R"({"tool_calls": [{"id": "a", "function": []}]})", "messages[2].tool_calls[0].function"},
      {R"({"tool_calls": [{"id": "a", "function": {"arguments": "{}"}}]})", "messages[2].tool_calls[0].function.name"},
      {R"({"tool_calls": [{"id": "a", "function": {"name": "f"}}]})", "messages[2].tool_calls[0].function.arguments"},
      {R"({"tool_calls": [{"id": "a", "function": {"name": "f", "arguments": {}}}]})",
       "messages[2].tool_calls[0].function.arguments"},
      {R"({"tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{\"a\": "}}]})",
       "messages[2].tool_calls[0].function.arguments"},
      {R"({"tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "[1]"}}]})",
       "messages[2].tool_calls[0].function.arguments"},
      {R"({"tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{}", "x": 1}}]})",
       "messages[2].tool_calls[0].function.x"},
      {R"({"tool_calls": [{"id": "a", )" + f + R"(}, {"id": "b", "function": {"name": ""}}]})",
       "messages[2].tool_calls[1].function.name"},
  };
  for (const Case& c : cases) {
    const ApiError e = calls_error(c.msg);
    CHECK(e.param == c.param);
    CHECK_THAT(e.message, Catch::Contains(c.param));
  }
}

TEST_CASE("render hermes: the tool section, calls and results as Qwen2.5's template writes them", "[tool_calls]") {
  const auto tools = weather_and_time();
  ToolChoice autoc;
  const ChatTemplate qwen = named("qwen2.5");
  CHECK(prompt(qwen, conversation(true), tools, autoc) ==
        "<|im_start|>system\nYou are terse.\n\n" + kToolsSection + "<|im_end|>\n" + kHermesTurns);
  // No system message: Qwen2.5's default one, before the section.
  CHECK(prompt(qwen, conversation(false), tools, autoc) ==
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n" +
            kToolsSection + "<|im_end|>\n" + kHermesTurns);
  // The messages themselves.
  auto r = pd::router::render_tool_messages(ToolFormat::kHermes, conversation(true), tools, autoc, "");
  REQUIRE(r.is_ok());
  const std::vector<ChatMessage>& m = r.value();
  REQUIRE(m.size() == 6);
  CHECK(m[0].role == "system");
  CHECK(m[0].content == "You are terse.\n\n" + kToolsSection);
  CHECK(m[2].role == "assistant");
  CHECK(m[2].content == "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n"
                        "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>");
  CHECK(m[3].role == "user");
  CHECK(m[3].content == "<tool_response>\n18C\n</tool_response>\n<tool_response>\n12:00\n</tool_response>");
}

TEST_CASE("render hermes: Qwen3 without a system message, and content before a call", "[tool_calls]") {
  const auto tools = weather_and_time();
  // Qwen3's template (no default system message): the section alone, no leading blank line.
  auto qwen3 = ChatTemplate::from_string("<|im_start|><|im_end|></think><tool_call>", "qwen3");
  REQUIRE(qwen3.is_ok());
  CHECK(qwen3->tool_format() == ToolFormat::kHermes);
  CHECK(prompt(*qwen3, conversation(false), tools, ToolChoice{}) ==
        "<|im_start|>system\n" + kToolsSection + "<|im_end|>\n" + kHermesTurns);
  // An assistant message with content: each call on a new line after it.
  std::vector<ApiMessage> m = {{"user", "Hi", {}, ""},
                               {"assistant", "Let me check.", {call("c", "get_time", "{}")}, ""}};
  auto r = pd::router::render_tool_messages(ToolFormat::kHermes, m, tools, ToolChoice{}, "");
  REQUIRE(r.is_ok());
  CHECK(r.value().back().content ==
        "Let me check.\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>");
  // Non-ASCII and nested arguments render as Python's json.dumps(ensure_ascii=False).
  m[1].tool_calls[0].arguments = R"({"q":"Zürich","list":[1,2.5,{"a":null}],"ok":true})";
  r = pd::router::render_tool_messages(ToolFormat::kHermes, m, tools, ToolChoice{}, "");
  REQUIRE(r.is_ok());
  CHECK_THAT(r.value().back().content,
             Catch::Contains(R"("arguments": {"q": "Zürich", "list": [1, 2.5, {"a": null}], "ok": true}})"));
}

TEST_CASE("render: tool_choice none describes no tools, earlier tool turns still render", "[tool_calls]") {
  const auto tools = weather_and_time();
  const ToolChoice none{ToolChoiceMode::kNone, ""};
  CHECK_FALSE(pd::router::tools_described(tools, none));
  CHECK(prompt(named("qwen2.5"), conversation(true), tools, none) ==
        "<|im_start|>system\nYou are terse.<|im_end|>\n" + kHermesTurns);
  // No tools and no tool parts: the messages pass through.
  std::vector<ApiMessage> plain = {{"system", "S", {}, ""}, {"user", "U", {}, ""}, {"assistant", "A", {}, ""}};
  for (ToolFormat f : {ToolFormat::kNone, ToolFormat::kHermes, ToolFormat::kLlama31}) {
    auto r = pd::router::render_tool_messages(f, plain, {}, none, "default");
    REQUIRE(r.is_ok());
    REQUIRE(r.value().size() == 3);
    CHECK(r.value()[0].role == "system");
    CHECK(r.value()[0].content == "S");
    CHECK(r.value()[2].content == "A");
  }
  // tool_choice none with tools, no tool parts: plain too, even where the template has no tool format.
  CHECK(pd::router::render_tool_messages(ToolFormat::kNone, plain, tools, none, "").is_ok());
}

TEST_CASE("render: a template without a tool format refuses tools naming tools, and tool turns naming the turn",
          "[tool_calls]") {
  const auto tools = weather_and_time();
  std::vector<ApiMessage> plain = {{"user", "U", {}, ""}};
  auto with_tools = pd::router::render_tool_messages(ToolFormat::kNone, plain, tools, ToolChoice{}, "");
  REQUIRE_FALSE(with_tools.is_ok());
  CHECK(with_tools.error().status == 400);
  CHECK(with_tools.error().param == "tools");
  CHECK_THAT(with_tools.error().message, Catch::Contains("no tool-call format") && Catch::Contains("hermes"));
  auto with_turns = pd::router::render_tool_messages(ToolFormat::kNone, conversation(true), {},
                                                     ToolChoice{ToolChoiceMode::kNone, ""}, "");
  REQUIRE_FALSE(with_turns.is_ok());
  CHECK(with_turns.error().param == "messages[2].tool_calls");  // the assistant's calls come first
  CHECK_THAT(with_turns.error().message, Catch::Contains("messages[2].tool_calls"));
  // A tool result alone, no tools in the request: the message is named.
  std::vector<ApiMessage> result = {{"user", "U", {}, ""}, {"tool", "18C", {}, "call_1"}};
  auto with_result = pd::router::render_tool_messages(ToolFormat::kNone, result, {},
                                                      ToolChoice{ToolChoiceMode::kNone, ""}, "");
  REQUIRE_FALSE(with_result.is_ok());
  CHECK(with_result.error().param == "messages[1]");
}

TEST_CASE("render llama3.1: tools in the first user message, calls and ipython turns", "[tool_calls]") {
  const auto tools = weather_and_time();
  const std::vector<ApiMessage> m = {{"system", "You are terse.", {}, ""},
                                     {"user", "Weather in Paris?", {}, ""},
                                     {"assistant", "", {call("call_1", "get_weather", R"({"city":"Paris"})")}, ""},
                                     {"tool", "18C", {}, "call_1"},
                                     {"assistant", "It is 18C.", {}, ""}};
  const std::string tools_json =
      "{\n    \"type\": \"function\",\n    \"function\": {\n        \"name\": \"get_weather\",\n        "
      "\"description\": \"Get the weather\",\n        \"parameters\": {\n            \"type\": \"object\",\n"
      "            \"properties\": {\n                \"city\": {\n                    \"type\": \"string\"\n"
      "                }\n            },\n            \"required\": [\n                \"city\"\n            ]\n"
      "        }\n    }\n}\n\n{\n    \"type\": \"function\",\n    \"function\": {\n        \"name\": \"get_time\",\n"
      "        \"parameters\": {\n            \"type\": \"object\",\n            \"properties\": {}\n"
      "        }\n    }\n}"
      "\n\n";
  // As Llama 3.1's template renders it (a tool's result through tojson: quoted).
  const std::string want =
      "<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\nCutting Knowledge Date: December 2023\n"
      "Today Date: 26 Jul 2024\n\nYou are terse.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nGiven the "
      "following functions, please respond with a JSON for a function call with its proper arguments that best "
      "answers the given prompt.\n\nRespond in the format {\"name\": function name, \"parameters\": dictionary of "
      "argument name and its value}.Do not use variables.\n\n" +
      tools_json +
      "Weather in Paris?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
      R"({"name": "get_weather", "parameters": {"city": "Paris"}})"
      "<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n\"18C\"<|eot_id|><|start_header_id|>assistant"
      "<|end_header_id|>\n\nIt is 18C.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n";
  const ChatTemplate llama = named("llama3.1");
  CHECK(llama.tool_format() == ToolFormat::kLlama31);
  CHECK(prompt(llama, m, tools, ToolChoice{}) == want);
  // tool_choice none: no environment line, no tool prompt; the turns stay.
  const std::string want_none =
      "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024"
      "\n\nYou are terse.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\n"
      R"({"name": "get_weather", "parameters": {"city": "Paris"}})"
      "<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n\"18C\"<|eot_id|><|start_header_id|>assistant"
      "<|end_header_id|>\n\nIt is 18C.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n";
  CHECK(prompt(llama, m, tools, ToolChoice{ToolChoiceMode::kNone, ""}) == want_none);
  // The messages: the tool turn is "ipython"; several calls join with "; ".
  std::vector<ApiMessage> two = {{"user", "Q", {}, ""},
                                 {"assistant", "", {call("a", "get_time", "{}"), call("b", "get_time", "{}")}, ""}};
  const ToolChoice none{ToolChoiceMode::kNone, ""};
  auto r = pd::router::render_tool_messages(ToolFormat::kLlama31, two, tools, none, "");
  REQUIRE(r.is_ok());
  CHECK(r.value()[1].content == R"({"name": "get_time", "parameters": {}}; {"name": "get_time", "parameters": {}})");
  // A result is written as a JSON string (escaped, non-ASCII kept).
  std::vector<ApiMessage> result = {{"user", "Q", {}, ""}, {"tool", "{\"t\": \"20°\"}\n", {}, "a"}};
  r = pd::router::render_tool_messages(ToolFormat::kLlama31, result, tools, none, "");
  REQUIRE(r.is_ok());
  CHECK(r.value()[1].role == "ipython");
  CHECK(r.value()[1].content == R"("{\"t\": \"20°\"}\n")");
  // Tools described but no user message to put them in.
  auto bad = pd::router::render_tool_messages(ToolFormat::kLlama31, {{"system", "S", {}, ""}}, tools, ToolChoice{}, "");
  REQUIRE_FALSE(bad.is_ok());
  CHECK(bad.error().param == "messages");
}

TEST_CASE("tool_call_grammar: a tool's own definitions and references move with it", "[tool_calls]") {
  std::vector<ToolFunction> tools = {
      {"f", "", R"({"$defs":{"C":{"enum":["a","b"]}},"type":"object","properties":{"c":{"$ref":"#/$defs/C"},)"
                R"("self":{"$ref":"#"},"d":{"$ref":"#/properties/c"}}})"},
      {"g", "", R"({"definitions":{"C":{"type":"integer"}},"type":"object","properties":{"c":{"$ref":"#/definitions/C"}}})"}};
  const json a = json::parse(pd::router::tool_call_grammar(ToolFormat::kHermes, tools, {ToolChoiceMode::kRequired, ""}).text);
  CHECK(a["$defs"]["tool0_C"] == json::parse(R"({"enum":["a","b"]})"));
  CHECK(a["$defs"]["tool1_C"] == json::parse(R"({"type":"integer"})"));
  CHECK_FALSE(a["$defs"]["tool0"].contains("$defs"));
  CHECK(a["$defs"]["tool0"]["properties"]["c"]["$ref"] == "#/$defs/tool0_C");
  CHECK(a["$defs"]["tool0"]["properties"]["self"]["$ref"] == "#/$defs/tool0");
  CHECK(a["$defs"]["tool0"]["properties"]["d"]["$ref"] == "#/$defs/tool0/properties/c");
  CHECK(a["$defs"]["tool1"]["properties"]["c"]["$ref"] == "#/$defs/tool1_C");
}

TEST_CASE("tool_call_grammar: a schema forcing the named tool or any of them", "[tool_calls]") {
  const auto tools = weather_and_time();
  CHECK_FALSE(pd::router::tool_call_grammar(ToolFormat::kHermes, tools, ToolChoice{}).active());
  CHECK_FALSE(pd::router::tool_call_grammar(ToolFormat::kHermes, tools, {ToolChoiceMode::kNone, ""}).active());
  CHECK_FALSE(pd::router::tool_call_grammar(ToolFormat::kNone, tools, {ToolChoiceMode::kRequired, ""}).active());
  CHECK_FALSE(pd::router::tool_call_grammar(ToolFormat::kHermes, {}, {ToolChoiceMode::kRequired, ""}).active());

  const GrammarSpec named_g =
      pd::router::tool_call_grammar(ToolFormat::kHermes, tools, {ToolChoiceMode::kNamed, "get_weather"});
  CHECK(named_g.kind == GrammarKind::kJsonSchema);
  CHECK(named_g.prefix == "<tool_call>\n");
  CHECK(named_g.suffix == "\n</tool_call>");
  const ordered_json s = ordered_json::parse(named_g.text);
  // The parameters sit in $defs (references inside them keep working).
  CHECK(s == ordered_json::parse(R"({"type": "object", "properties": {"name": {"const": "get_weather"},
      "arguments": {"$ref": "#/$defs/tool0"}}, "required": ["name", "arguments"], "$defs": {"tool0":
      {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})"));
  CHECK(s.at("properties").begin().key() == "name");  // the name is written first

  const GrammarSpec any = pd::router::tool_call_grammar(ToolFormat::kHermes, tools, {ToolChoiceMode::kRequired, ""});
  const json a = json::parse(any.text);
  REQUIRE(a.at("anyOf").size() == 2);
  CHECK(a["anyOf"][1]["properties"]["name"]["const"] == "get_time");
  CHECK(a["anyOf"][1]["properties"]["arguments"] == json::parse(R"({"$ref": "#/$defs/tool1"})"));
  CHECK(a["$defs"]["tool1"] == json::parse(R"({"type":"object","properties":{}})"));
  CHECK(a["anyOf"][0]["required"] == json::parse(R"(["name", "arguments"])"));

  const GrammarSpec llama = pd::router::tool_call_grammar(ToolFormat::kLlama31, tools, {ToolChoiceMode::kRequired, ""});
  CHECK(llama.kind == GrammarKind::kJsonSchema);
  CHECK(llama.prefix.empty());
  CHECK(llama.suffix.empty());
  const json l = json::parse(llama.text);
  CHECK(l["anyOf"][0]["properties"].contains("parameters"));
  CHECK_FALSE(l["anyOf"][0]["properties"].contains("arguments"));
  CHECK(l["anyOf"][0]["required"] == json::parse(R"(["name", "parameters"])"));
}

TEST_CASE("parse hermes output: calls, content around them, malformed blocks kept as content", "[tool_calls]") {
  const auto tools = weather_and_time();
  auto p = pd::router::parse_tool_output(
      ToolFormat::kHermes,
      "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n"
      "{\"name\": \"get_time\", \"arguments\": \"{}\"}\n</tool_call>",
      tools, "chatcmpl-3_0");
  CHECK(p.content.empty());
  REQUIRE(p.calls.size() == 2);
  CHECK(p.calls[0].id == "call_chatcmpl-3_0_0");
  CHECK(p.calls[0].name == "get_weather");
  CHECK(p.calls[0].arguments == R"({"city":"Paris"})");
  CHECK(p.calls[1].id == "call_chatcmpl-3_0_1");
  CHECK(p.calls[1].arguments == "{}");  // a string holding an object

  p = pd::router::parse_tool_output(
      ToolFormat::kHermes, "  I will check.\n<tool_call>{\"name\":\"get_time\",\"arguments\":{}}</tool_call>\nDone. ",
      tools, "x");
  CHECK(p.content == "  I will check.\n\nDone. ");  // text on both sides: its whitespace as written
  REQUIRE(p.calls.size() == 1);

  // Not JSON, an unknown tool, arguments not an object, no arguments: content.
  for (const char* bad : {"<tool_call>{\"name\": \"get_time\", </tool_call>",
                          "<tool_call>{\"name\": \"rm_rf\", \"arguments\": {}}</tool_call>",
                          "<tool_call>{\"name\": \"get_time\", \"arguments\": [1]}</tool_call>",
                          "<tool_call>{\"name\": \"get_time\", \"arguments\": \"nope\"}</tool_call>",
                          "<tool_call>{\"name\": \"get_time\"}</tool_call>", "<tool_call>[1, 2]</tool_call>"}) {
    p = pd::router::parse_tool_output(ToolFormat::kHermes, bad, tools, "x");
    CHECK(p.calls.empty());
    CHECK(p.content == bad);
  }
  // A good block after a bad one is still a call, numbered from 0; an unterminated one is content.
  p = pd::router::parse_tool_output(ToolFormat::kHermes,
                                    "<tool_call>oops</tool_call> <tool_call>{\"name\": \"get_time\", \"arguments\": {}}"
                                    "</tool_call> <tool_call>{\"name\"",
                                    tools, "x");
  CHECK(p.content == "<tool_call>oops</tool_call>  <tool_call>{\"name\"");
  REQUIRE(p.calls.size() == 1);
  CHECK(p.calls[0].id == "call_x_0");
  // Whitespace before a first call and after a last one goes; a reply without
  // a call is content as written; kNone keeps everything as it is.
  p = pd::router::parse_tool_output(ToolFormat::kHermes,
                                    "\n Ok. <tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>\n", tools, "x");
  CHECK(p.content == "\n Ok.");
  p = pd::router::parse_tool_output(ToolFormat::kHermes,
                                    "\n<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>\n Ok. ", tools, "x");
  CHECK(p.content == "Ok. ");
  CHECK(pd::router::parse_tool_output(ToolFormat::kHermes, "\n Hello <b>world</b> \n", tools, "x").content ==
        "\n Hello <b>world</b> \n");
  CHECK(pd::router::parse_tool_output(ToolFormat::kNone, " <tool_call>{}</tool_call> ", tools, "x").content ==
        " <tool_call>{}</tool_call> ");
}

TEST_CASE("parse llama3.1 output: the whole reply as one or several calls", "[tool_calls]") {
  const auto tools = weather_and_time();
  auto p = pd::router::parse_tool_output(ToolFormat::kLlama31,
                                         " {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}} ", tools,
                                         "r_1");
  CHECK(p.content.empty());
  REQUIRE(p.calls.size() == 1);
  CHECK(p.calls[0].id == "call_r_1_0");
  CHECK(p.calls[0].arguments == R"({"city":"Paris"})");
  // Several joined by ";" (a ";" inside a string does not split); "arguments" is read too.
  p = pd::router::parse_tool_output(ToolFormat::kLlama31,
                                    "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"a;b\"}}; "
                                    "{\"name\": \"get_time\", \"arguments\": {}}",
                                    tools, "r");
  REQUIRE(p.calls.size() == 2);
  CHECK(p.calls[0].arguments == R"({"city":"a;b"})");
  CHECK(p.calls[1].name == "get_time");
  CHECK(p.calls[1].id == "call_r_1");
  // Anything else stays content, unchanged.
  for (const char* text : {"The weather is fine. ", "{\"name\": \"get_time\", \"parameters\": {}}; not json",
                           "{\"name\": \"nope\", \"parameters\": {}}", "{\"a\": 1}", "{", "  ", "",
                           "Sure: {\"name\": \"get_time\", \"parameters\": {}}"}) {
    p = pd::router::parse_tool_output(ToolFormat::kLlama31, text, tools, "r");
    CHECK(p.calls.empty());
    CHECK(p.content == text);
  }
}

TEST_CASE("ToolCallStream: text streams at once, a tag is held, the pieces equal the whole", "[tool_calls]") {
  const auto tools = weather_and_time();
  ToolCallStream s(ToolFormat::kHermes, tools, "id");
  CHECK(s.feed("Hello").content == "Hello");
  CHECK(s.feed(" wor").content == " wor");  // trailing whitespace waits for what follows
  CHECK(s.feed("ld <tool").content == "ld");
  auto p = s.feed("_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_c");
  CHECK(p.content.empty());
  CHECK(p.calls.empty());
  p = s.feed("all> after");
  REQUIRE(p.calls.size() == 1);
  CHECK(p.calls[0].id == "call_id_0");
  CHECK(p.content == "  after");
  CHECK(s.calls_so_far() == 1);
  CHECK(s.finish().content.empty());

  ToolCallStream l(ToolFormat::kLlama31, tools, "id");
  CHECK(l.feed("  ").content.empty());
  CHECK(l.feed("Hi").content == "  Hi");
  ToolCallStream held(ToolFormat::kLlama31, tools, "id");
  CHECK(held.feed(" {\"name\": \"get_time\", ").content.empty());
  CHECK(held.feed("\"parameters\": {}}").content.empty());
  p = held.finish();
  REQUIRE(p.calls.size() == 1);
  CHECK(p.content.empty());
}

TEST_CASE("ToolCallStream: fed piece by piece, the same content and calls as parse_tool_output", "[tool_calls]") {
  const auto tools = weather_and_time();
  const std::vector<std::string> hermes = {
      "",
      "   ",
      "Plain answer with < and <tool and <tool_call but no close.",
      "Trailing partial <tool_ca",
      "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
      "Checking.\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": "
      "\"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Oslo\\\"}\"}\n</tool_call>\nDone.  \n",
      "<tool_call>not json</tool_call> text <tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>",
      "<tool_call>{\"name\": \"get_time\", \"arguments\": {\"s\": \"</tool_\"}}</tool_call>",
      "<tool_call><tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call></tool_call>",
      "a <tool_call>{\"name\": \"get_time\", \"arguments\": {}}",
      " \n <tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call> \n ",
      "Zürich — ünïcödé <tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}"
      "</tool_call>",
      "\n\nHello world\n\n",
      "  a <tool box> b <tool_c d",
      "\n<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>\n Ok. ",
      "A \n<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>\n B",
      " <tool_call>bad</tool_call> \n<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call> ",
  };
  for (const std::string& t : hermes) check_stream_matches(ToolFormat::kHermes, t, tools);
  const std::vector<std::string> llama = {
      "",
      "  \n",
      "Plain answer.",
      "  Plain after spaces {\"name\": \"get_time\", \"parameters\": {}}",
      "{\"name\": \"get_time\", \"parameters\": {}}",
      " \n{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}; {\"name\": \"get_time\", "
      "\"parameters\": {}}\n",
      "{\"name\": \"get_time\", \"parameters\": {}} and text",
      "{not json",
  };
  for (const std::string& t : llama) check_stream_matches(ToolFormat::kLlama31, t, tools);
  check_stream_matches(ToolFormat::kNone, " <tool_call>{}</tool_call> ", tools);
}

}  // namespace tool_calls_test
