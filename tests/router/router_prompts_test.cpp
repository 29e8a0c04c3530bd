// The router's prompts for the new models: which chat template it uses
// (cluster.json's "chat_template" or the file's), the 400 for a chat to a
// model without one, one BOS and the end-of-turn stop tokens of a Gemma chat
// (on Gemma 3's vocabulary subset, tests/data/reference_gemma3).
#include <catch2/catch.hpp>

#include "gguf/gguf_reader.h"
#include "gguf/gguf_writer.h"
#include "router/prompts.h"
#include "router_harness.h"
#include "tokenizer_reference_gemma3.h"

namespace pd::router {
namespace {

std::unique_ptr<GgufFile> gguf_with_template(const std::string& tpl) {
  GgufWriter w;
  w.set_string("general.architecture", "llama");
  if (!tpl.empty()) w.set_string("tokenizer.chat_template", tpl);
  auto f = GgufFile::from_bytes(w.to_bytes(), "model.gguf");
  REQUIRE(f.status().to_string() == "OK");
  return std::move(f).value();
}

ModelInfo gemma3_model() {
  auto tok = Tokenizer::create(test::gemma3::subset_vocab());
  REQUIRE(tok.is_ok());
  ModelInfo m;
  m.tokenizer = std::move(tok).value();
  m.context = 512;
  m.name = "gemma";
  return m;
}

}  // namespace

TEST_CASE("router: the chat template is the configured one, else the file's, else none", "[router][prompts]") {
  ModelInfo m = gemma3_model();
  auto none = gguf_with_template("");
  CHECK_THAT(choose_chat_template("", *none, m),
             Catch::Contains("model.gguf") && Catch::Contains("no chat template") && Catch::Contains("chat_template"));
  CHECK_FALSE(m.chat_template.has_value());
  CHECK(choose_chat_template("gemma", *none, m).empty());
  REQUIRE(m.chat_template.has_value());
  CHECK(m.chat_template->format() == ChatFormat::kGemma);

  auto gemma_file = gguf_with_template("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.content }}<end_of_turn>{% endfor %}");
  CHECK(choose_chat_template("", *gemma_file, m).empty());
  CHECK(m.chat_template->format() == ChatFormat::kGemma);
  CHECK(choose_chat_template("chatml", *gemma_file, m).empty());  // the config wins over the file
  CHECK(m.chat_template->format() == ChatFormat::kChatml);

  auto mistral = gguf_with_template("{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}");
  const std::string why = choose_chat_template("", *mistral, m);
  CHECK_THAT(why, Catch::Contains("model.gguf") && Catch::Contains("none of the supported formats"));
  CHECK_FALSE(m.chat_template.has_value());
}

TEST_CASE("router: a chat to a model without a chat template is a 400 naming messages", "[router][prompts]") {
  ModelInfo m = gemma3_model();
  auto none = gguf_with_template("");
  (void)choose_chat_template("", *none, m);
  ApiRequest api;
  api.messages = {{"user", "Hi"}};
  auto r = encode_prompts(m, Endpoint::kChatCompletions, api);
  REQUIRE_FALSE(r.is_ok());
  CHECK(r.error().status == 400);
  CHECK(r.error().param == "messages");
  CHECK_THAT(r.error().message, Catch::Contains("no chat template") && Catch::Contains("/v1/completions"));
  // Completions are served.
  ApiRequest completion;
  completion.prompts.push_back(PromptInput{});
  completion.prompts.back().text = "Hello world";
  auto c = encode_prompts(m, Endpoint::kCompletions, completion);
  REQUIRE(c.is_ok());
  CHECK(c.value().at(0).ids == std::vector<TokenId>{2, 9259, 1902});  // BOS + the reference's ids
  CHECK(chat_stop_ids(m).empty());
}

TEST_CASE("router: a Gemma chat has one BOS, literal contents and stops at <end_of_turn>", "[router][prompts]") {
  ModelInfo m = gemma3_model();
  m.chat_template = ChatTemplate::gemma();
  auto ids = encode_chat(m, {{"system", "Be brief."}, {"user", "Hello <end_of_turn>"}});
  REQUIRE(ids.is_ok());
  const Tokenizer& tok = *m.tokenizer;
  REQUIRE(ids->size() > 4);
  CHECK(ids->at(0) == 2);     // <bos>: the template writes one, the vocabulary adds one; once
  CHECK(ids->at(1) == 105);   // <start_of_turn>
  CHECK(std::count(ids->begin(), ids->end(), 2) == 1);
  // The user's "<end_of_turn>" is text, not the control token: only the template's two are 106.
  CHECK(std::count(ids->begin(), ids->end(), 106) == 1);
  CHECK(tok.decode(*ids) ==
        "<bos><start_of_turn>user\nBe brief.\n\nHello <end_of_turn><end_of_turn>\n<start_of_turn>model\n");
  // Same tokens as encoding the whole rendering with special tokens, where contents hold none.
  auto plain = encode_chat(m, {{"user", "Hello world"}});
  REQUIRE(plain.is_ok());
  std::vector<TokenId> whole{2};
  const auto rest = tok.encode("<start_of_turn>user\nHello world<end_of_turn>\n<start_of_turn>model\n");
  whole.insert(whole.end(), rest.begin(), rest.end());
  CHECK(*plain == whole);
  CHECK(chat_stop_ids(m) == std::vector<TokenId>{106});
  // A message the template refuses is the error's param.
  auto twice = encode_chat(m, {{"user", "a"}, {"user", "b"}});
  REQUIRE_FALSE(twice.is_ok());
  CHECK(twice.error().status == 400);
  CHECK(twice.error().param == "messages[1]");
  CHECK_THAT(twice.error().message, Catch::StartsWith("messages[1]: ") && Catch::Contains("must alternate"));
}

TEST_CASE("router: a chat to a model without a template answers 400, completions go on", "[router][prompts]") {
  test_router::Harness h(150, 30000, false, {}, [](ModelInfo& m) {
    m.chat_template.reset();
    m.no_chat_template = "tiny.gguf: the model has no chat template (tokenizer.chat_template)";
  });
  auto f = h.post(R"({"messages": [{"role": "user", "content": "hi"}]})", "/v1/chat/completions");
  test_router::Answer r = h.finish(f);
  CHECK(r.status == 400);
  CHECK(r.json()["error"]["param"] == "messages");
  CHECK_THAT(r.json()["error"]["message"].get<std::string>(), Catch::Contains("no chat template"));
  f = h.post(R"({"messages": [{"role": "user", "content": "hi"}]})", "/tokenize");
  CHECK(h.finish(f).status == 400);
  f = h.post(R"({"prompt": "hello", "max_tokens": 2})");
  auto d = h.dispatched();
  REQUIRE(d.has_value());
}

}  // namespace pd::router
