// Unit tests of the SentencePiece-style tokenizer (tokenizer.ggml.model "llama"):
// the Gemma 3 reference cases on the part of Gemma 3's vocabulary they reach
// (tests/data/reference_gemma3, made by scripts/make_tokenizer_reference_gemma3.py
// with Hugging Face tokenizers), and small handmade vocabularies for the rules
// the reference does not exercise (score order, prefix space, unk fusing).
#include <catch2/catch.hpp>

#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gguf/gguf_reader.h"
#include "gguf/gguf_writer.h"
#include "test_support.h"
#include "tokenizer_reference_gemma3.h"
#include "tokenizer/tokenizer.h"

namespace pd {

TEST_CASE("SentencePiece tokenizer encodes the Gemma 3 reference exactly", "[tokenizer][sentencepiece]") {
  auto tok = Tokenizer::create(test::gemma3::subset_vocab());
  REQUIRE(tok.status().to_string() == "OK");
  CHECK((*tok)->kind() == VocabKind::kSentencePiece);
  CHECK((*tok)->vocab_size() == 262144);
  test::gemma3::check_reference_cases(**tok);
  // Whitespace-run tokens are stored with spaces; find_token takes the stored text.
  CHECK((*tok)->find_token("  ") == 138);
  CHECK((*tok)->find_token("<end_of_turn>") == 106);
  CHECK((*tok)->token_to_bytes(138) == "  ");
}

namespace {

// A handmade SentencePiece vocabulary: ids 0-5 specials, 6-261 the byte tokens
// (unless `bytes` is false), then the pieces with their scores.
TokenizerVocab tiny_spm(const std::vector<std::pair<std::string, float>>& pieces, bool bytes = true) {
  TokenizerVocab v;
  v.kind = VocabKind::kSentencePiece;
  auto add = [&](const std::string& text, TokenType type, float score) {
    v.tokens.push_back(text);
    v.types.push_back(type);
    v.scores.push_back(score);
  };
  add("<pad>", TokenType::kControl, 0);
  add("<eos>", TokenType::kControl, 0);
  add("<bos>", TokenType::kControl, 0);
  add("<unk>", TokenType::kUnknown, 0);
  add("<ctl>", TokenType::kControl, 0);
  add("<nl>", TokenType::kUserDefined, 0);
  if (bytes) {
    for (int b = 0; b < 256; ++b) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "<0x%02X>", b);
      add(buf, TokenType::kByte, 0);
    }
  }
  for (const auto& [text, score] : pieces) add(text, TokenType::kNormal, score);
  v.bos_id = 2;
  v.eos_id = 1;
  v.unk_id = 3;
  v.pad_id = 0;
  v.add_bos = true;
  return v;
}

std::vector<std::string> pieces_of(const Tokenizer& tok, const std::vector<TokenId>& ids) {
  std::vector<std::string> out;
  for (TokenId id : ids) out.push_back(tok.token_to_bytes(id));
  return out;
}

using Strings = std::vector<std::string>;

}  // namespace

TEST_CASE("SentencePiece merges go by score, or by id for Gemma files", "[tokenizer][sentencepiece]") {
  // "ab" comes before "bc" in the vocabulary but scores lower.
  TokenizerVocab v = tiny_spm({{"a", -1}, {"b", -2}, {"c", -3}, {"ab", -20}, {"bc", -10}});
  auto by_score = Tokenizer::create(v);
  REQUIRE(by_score.is_ok());
  CHECK(pieces_of(**by_score, (*by_score)->encode("abc")) == Strings{"a", "bc"});
  v.spm_gemma = true;
  auto by_id = Tokenizer::create(v);
  REQUIRE(by_id.is_ok());
  CHECK(pieces_of(**by_id, (*by_id)->encode("abc")) == Strings{"ab", "c"});
}

TEST_CASE("SentencePiece prefix space only where the input starts", "[tokenizer][sentencepiece]") {
  TokenizerVocab v = tiny_spm({{"\xE2\x96\x81", -1}, {"H", -2}, {"i", -3}, {"\xE2\x96\x81H", -4}, {"\xE2\x96\x81Hi", -5}});
  v.add_space_prefix = true;
  auto tok_r = Tokenizer::create(v);
  REQUIRE(tok_r.is_ok());
  const Tokenizer& tok = **tok_r;
  const TokenId hi = tok.find_token("\xE2\x96\x81Hi");
  CHECK(tok.encode("Hi") == std::vector<TokenId>{hi});
  CHECK(tok.decode({hi}) == "Hi");  // the prefix space is dropped again
  // Already starting with a space: no second one (HF's Metaspace).
  CHECK(tok.encode(" Hi") == std::vector<TokenId>{hi});
  // Not at the start: after a special token, or a piece from the middle of a prompt.
  CHECK(tok.encode("<ctl>Hi") == std::vector<TokenId>{4, tok.find_token("H"), tok.find_token("i")});
  CHECK(tok.encode("Hi", true, /*starts_input=*/false) == std::vector<TokenId>{tok.find_token("H"), tok.find_token("i")});
  // Without the flag nothing is added.
  v.add_space_prefix = false;
  auto plain = Tokenizer::create(v);
  REQUIRE(plain.is_ok());
  CHECK((*plain)->encode("Hi") == std::vector<TokenId>{tok.find_token("H"), tok.find_token("i")});
}

TEST_CASE("SentencePiece byte fallback, unk fusing and specials", "[tokenizer][sentencepiece]") {
  auto tok_r = Tokenizer::create(tiny_spm({{"a", -1}}));
  REQUIRE(tok_r.is_ok());
  const Tokenizer& tok = **tok_r;
  const TokenId a = tok.find_token("a");
  // "é" has no token: its two UTF-8 bytes' tokens; an ill-formed byte: its own.
  CHECK(tok.encode("a\xC3\xA9") == std::vector<TokenId>{a, 6 + 0xC3, 6 + 0xA9});
  CHECK(tok.encode("\xFF" "a") == std::vector<TokenId>{6 + 0xFF, a});
  CHECK(tok.decode(tok.encode("a\xC3\xA9\xFF")) == "a\xC3\xA9\xFF");
  // Control text is a token only with parse_special; user-defined always.
  CHECK(tok.encode("<ctl>") == std::vector<TokenId>{4});
  CHECK(tok.encode("<ctl>", /*parse_special=*/false).size() > 1);
  CHECK(tok.encode("<nl>", /*parse_special=*/false) == std::vector<TokenId>{5});

  // Without byte tokens, characters with no token become one unk per run.
  auto nobytes = Tokenizer::create(tiny_spm({{"a", -1}}, /*bytes=*/false));
  REQUIRE(nobytes.is_ok());
  CHECK((*nobytes)->encode("a\xC3\xA9xya") == std::vector<TokenId>{(*nobytes)->find_token("a"), 3, (*nobytes)->find_token("a")});
}

TEST_CASE("Tokenizer::from_gguf reads a SentencePiece vocabulary", "[tokenizer][sentencepiece]") {
  const TokenizerVocab v = tiny_spm({{"a", -1}, {"b", -2}, {"c", -3}, {"ab", -20}, {"bc", -10}});
  auto write = [&](const std::string& arch, bool with_prefix_key, size_t n_scores) {
    GgufWriter w;
    w.set_string("general.architecture", arch);
    w.set_string("tokenizer.ggml.model", "llama");
    w.set_string("tokenizer.ggml.pre", "default");
    w.set_string_array("tokenizer.ggml.tokens", v.tokens);
    std::vector<int32_t> types;
    for (TokenType t : v.types) types.push_back(int32_t(t));
    w.set_i32_array("tokenizer.ggml.token_type", types);
    w.set_f32_array("tokenizer.ggml.scores", std::vector<float>(v.scores.begin(), v.scores.begin() + long(n_scores)));
    w.set_u32("tokenizer.ggml.bos_token_id", 2);
    w.set_u32("tokenizer.ggml.eos_token_id", 1);
    w.set_u32("tokenizer.ggml.unknown_token_id", 3);
    if (with_prefix_key) w.set_bool("tokenizer.ggml.add_space_prefix", false);
    auto f = GgufFile::from_bytes(w.to_bytes(), "spm.gguf");
    REQUIRE(f.status().to_string() == "OK");
    return std::move(f).value();
  };
  auto llama = write("llama", true, v.tokens.size());
  auto tok = Tokenizer::from_gguf(*llama);
  REQUIRE(tok.status().to_string() == "OK");
  CHECK((*tok)->kind() == VocabKind::kSentencePiece);
  CHECK((*tok)->add_bos());  // the default for a SentencePiece vocabulary
  CHECK(pieces_of(**tok, (*tok)->encode("abc")) == Strings{"a", "bc"});  // by score

  auto gemma = write("gemma3", true, v.tokens.size());
  auto tg = Tokenizer::from_gguf(*gemma);
  REQUIRE(tg.is_ok());
  CHECK(pieces_of(**tg, (*tg)->encode("abc")) == Strings{"ab", "c"});  // by id

  // add_space_prefix defaults to true (as llama.cpp): "a" alone has no "▁a" token, so "▁" is a byte fallback.
  auto no_key = write("llama", false, v.tokens.size());
  auto tp = Tokenizer::from_gguf(*no_key);
  REQUIRE(tp.is_ok());
  CHECK((*tp)->encode("a") == std::vector<TokenId>{6 + 0xE2, 6 + 0x96, 6 + 0x81, (*tp)->find_token("a")});

  auto short_scores = write("llama", true, 3);
  auto bad = Tokenizer::from_gguf(*short_scores);
  REQUIRE_FALSE(bad.is_ok());
  CHECK(bad.status().is_corruption());
  CHECK_THAT(bad.status().message(), Catch::Contains("tokenizer.ggml.scores") && Catch::Contains("spm.gguf"));
}

TEST_CASE("SentencePiece encodes long inputs completely", "[tokenizer][sentencepiece]") {
  auto tok_r = Tokenizer::create(tiny_spm({{"\xE2\x96\x81", -1}, {"a", -2}, {"b", -3}, {"ab", -4}, {"\xE2\x96\x81" "ab", -5}}));
  REQUIRE(tok_r.is_ok());
  std::string text;
  for (int i = 0; i < 20000; ++i) text += (i % 7 == 0) ? " ab\xC3\xA9" : " ab";
  const auto ids = (*tok_r)->encode(text);
  CHECK((*tok_r)->decode(ids) == text);
  CHECK(ids.size() == 20000 + 2 * (20000 / 7 + 1));
}

}  // namespace pd
