// ChatTemplate against the models' own Jinja chat templates as transformers
// renders them (tests/data/reference_chat/chat.json, made by
// scripts/make_tokenizer_reference_chat.py): each template is recognized as
// its format (or refused), and every conversation renders to the same text,
// or is refused where the template raises.
#include <catch2/catch.hpp>

#include <ctime>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "test_support.h"
#include "tokenizer/tokenizer.h"

namespace pd {
namespace {

using nlohmann::json;

json load_chat_reference() {
  const std::string path = test::test_data_dir() + "/reference_chat/chat.json";
  std::ifstream in(path, std::ios::binary);
  if (!in) FAIL("reference file " << path << " is missing (committed data; scripts/make_tokenizer_reference_chat.py)");
  std::stringstream ss;
  ss << in.rdbuf();
  json j = json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) FAIL(path << " is not valid JSON");
  return j;
}

std::string format_name(ChatFormat f) {
  switch (f) {
    case ChatFormat::kChatml: return "chatml";
    case ChatFormat::kQwen3: return "qwen3";
    case ChatFormat::kGemma: return "gemma";
    case ChatFormat::kLlama3: return "llama3";
  }
  return "?";
}

std::string today() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%d %b %Y", &tm);
  return buf;
}

}  // namespace

TEST_CASE("chat templates render as the models' Jinja templates do", "[chat_template][reference]") {
  const json ref = load_chat_reference();
  size_t n_rendered = 0, n_refused = 0;
  for (const auto& [name, t] : ref.at("templates").items()) {
    INFO("template " << name);
    auto tpl = ChatTemplate::from_string(t.at("template").get<std::string>(), name);
    if (t.at("format").is_null()) {
      REQUIRE_FALSE(tpl.is_ok());
      CHECK(tpl.status().is_unsupported());
      CHECK_THAT(tpl.status().message(), Catch::Contains(name));
      continue;
    }
    REQUIRE(tpl.status().to_string() == "OK");
    CHECK(format_name(tpl->format()) == t.at("format").get<std::string>());
    CHECK(tpl->writes_bos() == (tpl->format() == ChatFormat::kGemma || tpl->format() == ChatFormat::kLlama3));
    for (const json& c : ref.at("cases")) {
      if (c.at("template") != name) continue;
      std::vector<ChatMessage> messages;
      for (const json& m : c.at("messages")) messages.push_back({m.at("role"), m.at("content")});
      INFO("messages: " << c.at("messages").dump());
      auto out = tpl->apply(messages, /*add_generation_prompt=*/true);
      if (c.contains("error")) {
        ++n_refused;
        CHECK_FALSE(out.is_ok());
        CHECK(out.status().is_invalid_argument());
        continue;
      }
      ++n_rendered;
      REQUIRE(out.status().to_string() == "OK");
      std::string want = c.at("rendered").get<std::string>();
      // A template that dates its system turn with strftime_now renders today's date.
      if (c.contains("date")) {
        const std::string d = "Today Date: " + c.at("date").get<std::string>();
        want.replace(want.find(d), d.size(), "Today Date: " + today());
      }
      CHECK(*out == want);
    }
  }
  CHECK(n_rendered >= 50);
  CHECK(n_refused > 0);
}

TEST_CASE("chat segments: contents apart from template text", "[chat_template]") {
  auto gemma = ChatTemplate::gemma();
  auto seg = gemma.render({{"system", "S"}, {"user", " <end_of_turn> "}});
  REQUIRE(seg.is_ok());
  std::vector<std::string> contents, texts;
  for (const ChatSegment& s : *seg) (s.is_content ? contents : texts).push_back(s.text);
  CHECK(contents == std::vector<std::string>{"S", "<end_of_turn>"});  // trimmed
  CHECK(texts == std::vector<std::string>{"<start_of_turn>user\n", "\n\n", "<end_of_turn>\n<start_of_turn>model\n"});
  CHECK(gemma.end_of_turn_tokens() == std::vector<std::string>{"<end_of_turn>"});
  CHECK(ChatTemplate::chatml().end_of_turn_tokens() == std::vector<std::string>{"<|im_end|>"});
  CHECK(ChatTemplate::llama3().end_of_turn_tokens() == std::vector<std::string>{"<|eot_id|>", "<|eom_id|>"});
  auto bad = ChatTemplate::from_name("mistral");
  REQUIRE_FALSE(bad.is_ok());
  CHECK_THAT(bad.status().message(), Catch::Contains("mistral"));
}

TEST_CASE("chat templates: the tool-call format read off the template", "[chat_template]") {
  const json ref = load_chat_reference();
  const std::vector<std::pair<std::string, ToolFormat>> want = {
      {"qwen2.5-instruct", ToolFormat::kHermes},      {"qwen3", ToolFormat::kHermes},
      {"llama-3.1-instruct", ToolFormat::kLlama31},   {"llama-3.2-instruct", ToolFormat::kLlama31},
      {"llama-3.3-instruct", ToolFormat::kLlama31},   {"gemma-3-it", ToolFormat::kNone},
      {"gemma-2-it", ToolFormat::kNone}};
  for (const auto& [name, format] : want) {
    INFO("template " << name);
    REQUIRE(ref.at("templates").contains(name));
    auto tpl = ChatTemplate::from_string(ref.at("templates").at(name).at("template").get<std::string>(), name);
    REQUIRE(tpl.is_ok());
    CHECK(tpl->tool_format() == format);
  }
  // SmolLM2's template (its file's own): ChatML with no tools.
  auto smol = ChatTemplate::from_string(
      "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\n"
      "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>'"
      " + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt "
      "%}{{ '<|im_start|>assistant\\n' }}{% endif %}",
      "smollm2");
  REQUIRE(smol.is_ok());
  CHECK(smol->format() == ChatFormat::kChatml);
  CHECK(smol->tool_format() == ToolFormat::kNone);
  // Llama 3.0 (no dated system turn) has none either.
  auto l30 = ChatTemplate::from_string("<|start_header_id|><|end_header_id|><|eot_id|> tools is not none", "llama3");
  REQUIRE(l30.is_ok());
  CHECK(l30->tool_format() == ToolFormat::kNone);
}

TEST_CASE("chat templates by name: hermes, qwen2.5 and llama3.1 carry their tool formats", "[chat_template]") {
  for (const char* name : {"chatml", "gemma", "llama3"}) {
    auto t = ChatTemplate::from_name(name);
    REQUIRE(t.is_ok());
    CHECK(t->tool_format() == ToolFormat::kNone);
  }
  auto hermes = ChatTemplate::from_name("hermes");
  REQUIRE(hermes.is_ok());
  CHECK(hermes->format() == ChatFormat::kChatml);
  CHECK(hermes->default_system().empty());
  CHECK(hermes->tool_format() == ToolFormat::kHermes);
  auto qwen = ChatTemplate::from_name("qwen2.5");
  REQUIRE(qwen.is_ok());
  CHECK(qwen->default_system() == "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.");
  CHECK(qwen->tool_format() == ToolFormat::kHermes);
  CHECK(qwen->with_tools_described().apply({{"user", "Hi"}}).value() == qwen->apply({{"user", "Hi"}}).value());
  auto llama = ChatTemplate::from_name("llama3.1");
  REQUIRE(llama.is_ok());
  CHECK(llama->format() == ChatFormat::kLlama3);
  CHECK(llama->tool_format() == ToolFormat::kLlama31);
  const std::string head = "<|start_header_id|>system<|end_header_id|>\n\n";
  const std::string dates = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n";
  const std::string rest =
      "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>ipython<|end_header_id|>"
      "\n\n \"r\" <|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n";
  // ipython turns (a tool's result) are Llama 3's, written untrimmed; tools
  // described add the environment line.
  const std::vector<ChatMessage> m = {{"user", "Hi"}, {"ipython", " \"r\" "}};
  CHECK(llama->apply(m).value() == head + dates + rest);
  CHECK(llama->with_tools_described().apply(m).value() == head + "Environment: ipython\n" + dates + rest);
  CHECK_FALSE(ChatTemplate::chatml().apply(m).is_ok());
}

}  // namespace pd
