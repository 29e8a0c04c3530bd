// The tokenizer and chat template on the real default model, against reference
// data made by Hugging Face `tokenizers` / `transformers`
// (scripts/make_reference.py -> tests/data/reference/{tokenizer,greedy}.json).
// The reference files are committed data: a missing one is a failure, not a skip.
#include <catch2/catch.hpp>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gguf/gguf_reader.h"
#include "test_support.h"
#include "tokenizer/tokenizer.h"

namespace pd {
namespace {

using nlohmann::json;

json load_reference(const std::string& name) {
  const std::string path = test::test_data_dir() + "/reference/" + name;
  std::ifstream in(path, std::ios::binary);
  if (!in) FAIL("reference file " << path << " is missing (it is committed data; regenerate with scripts/make_reference.py)");
  std::stringstream ss;
  ss << in.rdbuf();
  json j = json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.contains("cases") || !j["cases"].is_array()) {
    FAIL("reference file " << path << " is not valid JSON with a \"cases\" array");
  }
  return j;
}

std::unique_ptr<GgufFile> open_default_model() {
  test::require_default_model();
  auto file = GgufFile::open(test::default_model_path());
  REQUIRE(file.status().to_string() == "OK");
  return std::move(file).value();
}

std::string ids_to_string(const std::vector<TokenId>& ids) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? ", " : "") + std::to_string(ids[i]);
  return s + "]";
}

// Shows control characters and non-ASCII bytes so a failure message stays readable.
std::string escaped(const std::string& text) {
  std::string out;
  for (unsigned char c : text) {
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c < 0x20 || c == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02X", c);
      out += buf;
    } else {
      out.push_back(char(c));
    }
  }
  return out;
}

}  // namespace

TEST_CASE("tokenizer encodes and decodes exactly as Hugging Face tokenizers", "[tokenizer][reference]") {
  auto file = open_default_model();
  const json ref = load_reference("tokenizer.json");
  auto tok_r = Tokenizer::from_gguf(*file);
  REQUIRE(tok_r.status().to_string() == "OK");
  const Tokenizer& tok = **tok_r;
  CHECK(tok.vocab_size() == 49152);

  size_t n_cases = 0, n_encode_mismatch = 0;
  for (const json& c : ref["cases"]) {
    ++n_cases;
    const std::string text = c.at("text").get<std::string>();
    const std::vector<TokenId> expected = c.at("ids").get<std::vector<TokenId>>();
    const std::vector<TokenId> got = tok.encode(text, /*parse_special=*/true);
    if (got != expected) ++n_encode_mismatch;
    INFO("text: \"" << escaped(text) << "\"");
    INFO("expected ids: " << ids_to_string(expected));
    INFO("got ids:      " << ids_to_string(got));
    CHECK(got == expected);

    // "decoded" (when present) is HF's decode: ill-formed UTF-8 shown as U+FFFD.
    // decode() returns raw bytes, so without "decoded" it must give the text back
    // byte for byte; StreamDecoder (U+FFFD for ill-formed bytes, like HF) must
    // give "decoded" or the text.
    if (!c.contains("decoded")) CHECK(tok.decode(expected) == text);
    const std::string want_text = c.contains("decoded") ? c["decoded"].get<std::string>() : text;
    StreamDecoder stream(tok);
    std::string streamed;
    for (TokenId id : expected) streamed += stream.push(id);
    streamed += stream.flush();
    CHECK(streamed == want_text);
  }
  CHECK(n_cases > 0);
  INFO(n_encode_mismatch << " of " << n_cases << " cases encode differently");
  CHECK(n_encode_mismatch == 0);
}

TEST_CASE("chat template renders prompts exactly as transformers", "[chat_template][reference]") {
  auto file = open_default_model();
  const json ref = load_reference("greedy.json");
  auto tpl = ChatTemplate::from_gguf(*file);
  REQUIRE(tpl.status().to_string() == "OK");
  // Read off the file's template, not hard-coded.
  CHECK(tpl->default_system() == "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
  auto tok_r = Tokenizer::from_gguf(*file);
  REQUIRE(tok_r.status().to_string() == "OK");
  const Tokenizer& tok = **tok_r;

  size_t n_chat = 0;
  for (const json& c : ref["cases"]) {
    const std::string name = c.value("name", std::string("?"));
    INFO("case " << name);
    const std::string prompt = c.at("prompt").get<std::string>();
    if (c.value("chat", false)) {
      ++n_chat;
      std::vector<ChatMessage> messages;
      for (const json& m : c.at("messages")) {
        messages.push_back({m.at("role").get<std::string>(), m.at("content").get<std::string>()});
      }
      auto rendered = tpl->apply(messages, /*add_generation_prompt=*/true);
      REQUIRE(rendered.status().to_string() == "OK");
      INFO("expected prompt: \"" << escaped(prompt) << "\"");
      INFO("rendered prompt: \"" << escaped(*rendered) << "\"");
      CHECK(*rendered == prompt);
    }
    // The prompt's token ids, where recorded, are what encode() gives.
    if (c.contains("prompt_ids")) {
      const auto expected = c["prompt_ids"].get<std::vector<TokenId>>();
      const auto got = tok.encode(prompt, /*parse_special=*/true);
      INFO("expected ids: " << ids_to_string(expected));
      INFO("got ids:      " << ids_to_string(got));
      CHECK(got == expected);
    }
  }
  CHECK(n_chat > 0);
}

}  // namespace pd
