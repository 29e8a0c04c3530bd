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

}  // namespace pd
