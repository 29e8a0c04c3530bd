// Structured output: GrammarCompiler (xgrammar) over a small byte-level
// vocabulary, and the Sampler following a TokenConstraint.
#include "grammar/grammar.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <limits>
#include <regex>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace pd {
namespace grammar_test {

// ids: 0 "<|endoftext|>" (EOS, control), 1 "<|im_end|>" (control), then one
// token per printable ASCII character ('!'..'~', "Ġ" for the space), then a
// few longer ones.
const std::vector<std::string> kLong = {"true", "false", "{\"", "\":", "ab", "null"};

std::unique_ptr<Tokenizer> make_tokenizer() {
  TokenizerVocab v;
  auto add = [&](const std::string& text, TokenType type) {
    v.tokens.push_back(text);
    v.types.push_back(type);
  };
  add("<|endoftext|>", TokenType::kControl);
  add("<|im_end|>", TokenType::kControl);
  add("Ġ", TokenType::kNormal);
  for (char c = '!'; c <= '~'; ++c) add(std::string(1, c), TokenType::kNormal);
  for (const std::string& t : kLong) add(t, TokenType::kNormal);
  v.pre = "smollm";
  v.eos_id = 0;
  v.bos_id = -1;
  auto tok = Tokenizer::create(v);
  REQUIRE(tok.is_ok());
  return std::move(tok).value();
}

std::unique_ptr<GrammarCompiler> make_compiler(const Tokenizer& tok) {
  auto gc = GrammarCompiler::create(tok);
  REQUIRE(gc.is_ok());
  return std::move(gc).value();
}

TokenId id_of(const Tokenizer& tok, const std::string& text) {
  const TokenId id = tok.find_token(text);
  REQUIRE(id >= 0);
  return id;
}

bool skip_without_engine() {
  if (grammar_engine_built()) return false;
  std::cout << "SKIP: this build has no grammar engine (scripts/build_xgrammar.sh)\n";
  return true;
}

// Greedy decoding where the raw logits always prefer `favourite` (then lower
// ids), under `spec`: the text the grammar lets through.
std::string greedy_text(const Tokenizer& tok, GrammarCompiler& gc, const GrammarSpec& spec, TokenId favourite,
                        int max_tokens, std::vector<TokenId>* ids = nullptr) {
  SamplingParams p;
  p.grammar = spec;
  p.max_tokens = max_tokens;
  Sampler s(p);
  REQUIRE(constrain(s, &gc, tok.eos_id()).is_ok());
  std::string text;
  for (int i = 0; i < max_tokens; ++i) {
    std::vector<float> logits(static_cast<size_t>(tok.vocab_size()));
    for (size_t t = 0; t < logits.size(); ++t) logits[t] = -static_cast<float>(t) * 0.001f;
    logits[static_cast<size_t>(favourite)] = 10.0f;
    const TokenId t = s.sample(logits);
    s.accept(t);
    if (ids) ids->push_back(t);
    if (t == tok.eos_id()) break;
    text += tok.token_to_bytes(t);
  }
  return text;
}

}  // namespace grammar_test

using grammar_test::greedy_text;
using grammar_test::id_of;
using grammar_test::make_tokenizer;
using grammar_test::skip_without_engine;

TEST_CASE("grammar: a regex forces the text whatever the model prefers, then EOS") {
  if (skip_without_engine()) return;
  auto tok = make_tokenizer();
  auto gc = grammar_test::make_compiler(*tok);
  const GrammarSpec spec{GrammarKind::kRegex, "(yes|no)!", "", ""};
  std::vector<TokenId> ids;
  CHECK(greedy_text(*tok, *gc, spec, id_of(*tok, "z"), 10, &ids) == "no!");  // 'n' < 'y' by id
  REQUIRE(!ids.empty());
  CHECK(ids.back() == tok->eos_id());
}

TEST_CASE("grammar: a choice grammar, a prefix and a suffix") {
  if (skip_without_engine()) return;
  auto tok = make_tokenizer();
  auto gc = grammar_test::make_compiler(*tok);
  const GrammarSpec spec{GrammarKind::kEbnf, "root ::= \"ab\" | \"cd\"", "<", ">"};
  CHECK(greedy_text(*tok, *gc, spec, id_of(*tok, "c"), 10) == "<cd>");
}

TEST_CASE("grammar: a JSON schema's output is compact JSON the schema accepts") {
  if (skip_without_engine()) return;
  auto tok = make_tokenizer();
  auto gc = grammar_test::make_compiler(*tok);
  const GrammarSpec spec{GrammarKind::kJsonSchema,
                         R"({"type":"object","properties":{"ok":{"type":"boolean"}},"required":["ok"]})", "", ""};
  CHECK(greedy_text(*tok, *gc, spec, id_of(*tok, "f"), 40) == R"({"ok": false})");
  CHECK(greedy_text(*tok, *gc, spec, id_of(*tok, "true"), 40) == R"({"ok": true})");
}

TEST_CASE("grammar: json_object gives an object") {
  if (skip_without_engine()) return;
  auto tok = make_tokenizer();
  auto gc = grammar_test::make_compiler(*tok);
  const std::string text = greedy_text(*tok, *gc, GrammarSpec{GrammarKind::kJsonObject, "", "", ""},
                                       id_of(*tok, "}"), 40);
  CHECK(text == "{}");
}

TEST_CASE("grammar: a replayed or resumed sampler is where the sampling one is") {
  if (skip_without_engine()) return;
  auto tok = make_tokenizer();
  auto gc = grammar_test::make_compiler(*tok);
  SamplingParams p;
  p.grammar = GrammarSpec{GrammarKind::kRegex, "[a-c]{3}x", "", ""};
  p.temperature = 1.0f;
  p.seed = 7;
  p.max_tokens = 8;
  Sampler first(p);
  REQUIRE(constrain(first, gc.get(), tok->eos_id()).is_ok());
  std::vector<float> flat(static_cast<size_t>(tok->vocab_size()), 0.0f);
  std::vector<TokenId> drawn;
  for (int i = 0; i < 2; ++i) {
    std::vector<float> l = flat;
    drawn.push_back(first.sample(l));
    first.accept(drawn.back());
  }
  // The handoff: token 1 replayed, the rest sampled on.
  Sampler second(p);
  REQUIRE(constrain(second, gc.get(), tok->eos_id()).is_ok());
  second.replay(drawn[0]);
  second.replay(drawn[1]);
  // A migration: the output so far comes back as the prompt's last tokens.
  SamplingParams moved_params = p;
  moved_params.resumed_tokens = 2;
  Sampler moved(moved_params);
  REQUIRE(constrain(moved, gc.get(), tok->eos_id()).is_ok());
  const std::vector<TokenId> prompt = {id_of(*tok, "Q"), drawn[0], drawn[1]};
  moved.resume(prompt);
  std::string text = tok->token_to_bytes(drawn[0]) + tok->token_to_bytes(drawn[1]);
  for (int i = 0; i < 6; ++i) {
    std::vector<float> a = flat, b = flat, c = flat;
    const TokenId t1 = first.sample(a), t2 = second.sample(b), t3 = moved.sample(c);
    CHECK(t1 == t2);
    CHECK(t1 == t3);
    first.accept(t1);
    second.accept(t2);
    moved.accept(t3);
    if (t1 == tok->eos_id()) break;
    text += tok->token_to_bytes(t1);
  }
  CHECK(std::regex_match(text, std::regex("[a-c]{3}x")));
}

TEST_CASE("grammar: once complete only stop tokens are left, the request's own included") {
  if (skip_without_engine()) return;
  auto tok = make_tokenizer();
  auto gc = grammar_test::make_compiler(*tok);
  SamplingParams p;
  p.grammar = GrammarSpec{GrammarKind::kRegex, "a", "", ""};
  p.stop_token_ids = {1};  // <|im_end|>
  Sampler s(p);
  REQUIRE(constrain(s, gc.get(), tok->eos_id()).is_ok());
  std::vector<float> l(static_cast<size_t>(tok->vocab_size()), 0.0f);
  s.accept(s.sample(l));
  REQUIRE(s.constraint()->done() == false);
  std::vector<float> after(static_cast<size_t>(tok->vocab_size()), 0.0f);
  after[1] = 1.0f;
  CHECK(s.sample(after) == 1);
  std::vector<float> rest(static_cast<size_t>(tok->vocab_size()), 0.0f);
  s.constraint()->apply(rest);
  CHECK(std::count_if(rest.begin(), rest.end(), [](float v) { return std::isfinite(v); }) == 2);  // EOS, <|im_end|>
  CHECK(std::isfinite(rest[0]));
  CHECK(std::isfinite(rest[1]));
}

TEST_CASE("grammar: bad specs are InvalidArgument with the engine's reason") {
  if (skip_without_engine()) return;
  CHECK(GrammarCompiler::check(GrammarSpec{GrammarKind::kJsonSchema, R"({"type": "nonsense"})", "", ""})
            .is_invalid_argument());
  CHECK(GrammarCompiler::check(GrammarSpec{GrammarKind::kJsonSchema, "not json", "", ""}).is_invalid_argument());
  CHECK(GrammarCompiler::check(GrammarSpec{GrammarKind::kRegex, "(unclosed", "", ""}).is_invalid_argument());
  CHECK(GrammarCompiler::check(GrammarSpec{GrammarKind::kEbnf, "root ::= undefined_rule", "", ""})
            .is_invalid_argument());
  const Status st = GrammarCompiler::check(GrammarSpec{GrammarKind::kEbnf, "root ::= ", "", ""});
  CHECK(st.is_invalid_argument());
  CHECK(!st.message().empty());
  CHECK(GrammarCompiler::check(GrammarSpec{}).is_ok());
}

TEST_CASE("grammar: a grammar that admits no output is InvalidArgument") {
  if (skip_without_engine()) return;
  const Status self = GrammarCompiler::check(GrammarSpec{GrammarKind::kEbnf, "root ::= root", "", ""});
  CHECK(self.is_invalid_argument());
  CHECK(self.message().find("admits no output") != std::string::npos);
  CHECK(GrammarCompiler::check(GrammarSpec{GrammarKind::kRegex, "[^\\x00-\\U0010FFFF]", "", ""}).is_invalid_argument());
  // One that may be empty, or that starts with any byte, is fine.
  CHECK(GrammarCompiler::check(GrammarSpec{GrammarKind::kRegex, "a*", "", ""}).is_ok());
  CHECK(GrammarCompiler::check(GrammarSpec{GrammarKind::kRegex, "[\\x00-\\xff]", "", ""}).is_ok());
  CHECK(GrammarCompiler::check(GrammarSpec{GrammarKind::kEbnf, "root ::= \"ab\" x\nx ::= x", "", ""}).is_ok());
}

TEST_CASE("grammar: a matcher at a dead end leaves only the stop tokens") {
  if (skip_without_engine()) return;
  auto tok = make_tokenizer();
  auto gc = grammar_test::make_compiler(*tok);
  // "a", then a rule that only refers to itself: nothing can follow the "a".
  SamplingParams p;
  p.grammar = GrammarSpec{GrammarKind::kEbnf, "root ::= \"a\" x\nx ::= x", "", ""};
  p.stop_token_ids = {1};  // <|im_end|>
  Sampler s(p);
  REQUIRE(constrain(s, gc.get(), tok->eos_id()).is_ok());
  std::vector<float> first(static_cast<size_t>(tok->vocab_size()), 0.0f);
  const TokenId a = s.sample(first);
  REQUIRE(a == id_of(*tok, "a"));
  s.accept(a);
  std::vector<float> next(static_cast<size_t>(tok->vocab_size()), 0.0f);
  next[1] = 1.0f;
  s.constraint()->apply(next);
  // EOS and <|im_end|>: the output ends with what it has
  CHECK(std::count_if(next.begin(), next.end(), [](float v) { return std::isfinite(v); }) == 2);
  CHECK(s.constraint()->done());
  std::vector<float> again(static_cast<size_t>(tok->vocab_size()), 0.0f);
  again[1] = 1.0f;
  CHECK(s.sample(again) == 1);
}

TEST_CASE("grammar: compiled once, then matchers come from the cache") {
  if (skip_without_engine()) return;
  auto tok = make_tokenizer();
  auto gc = grammar_test::make_compiler(*tok);
  const GrammarSpec spec{GrammarKind::kRegex, "[0-9]+", "", ""};
  REQUIRE(gc->compile(spec).is_ok());
  REQUIRE(gc->matcher(spec, {0}).is_ok());
  REQUIRE(gc->matcher(spec, {0}).is_ok());
  const GrammarCompiler::Stats st = gc->stats();
  CHECK(st.compiled == 1);
  CHECK(st.cache_hits == 2);
  CHECK(st.cache_bytes > 0);
}

TEST_CASE("grammar: ebnf_literal escapes what EBNF strings need") {
  CHECK(ebnf_literal("a\"b\\c\nd") == "\"a\\\"b\\\\c\\nd\"");
  CHECK(ebnf_literal(std::string("\x01", 1)) == "\"\\x01\"");
}

TEST_CASE("grammar: a grammar travels in the sampling parameters' checks") {
  SamplingParams p;
  p.grammar.kind = GrammarKind::kRegex;
  p.grammar.text = std::string(kMaxGrammarBytes + 1, 'a');
  CHECK(p.validate().is_invalid_argument());
  p.grammar.text = "a";
  CHECK(p.validate().is_ok());
}

}  // namespace pd

namespace pd {

TEST_CASE("grammar: a background compile is waited for, not repeated") {
  if (grammar_test::skip_without_engine()) return;
  auto tok = grammar_test::make_tokenizer();
  auto gc = grammar_test::make_compiler(*tok);
  const GrammarSpec spec{GrammarKind::kJsonSchema, R"({"type":"object","properties":{"n":{"type":"integer"}}})", "", ""};
  gc->compile_in_background(spec);
  gc->compile_in_background(spec);  // already on its way
  REQUIRE(gc->matcher(spec, {0}).is_ok());
  REQUIRE(gc->matcher(spec, {0}).is_ok());
  CHECK(gc->stats().compiled == 1);
  // A spec the engine refuses: the error shows at matcher().
  const GrammarSpec bad{GrammarKind::kJsonSchema, R"({"type":"nonsense"})", "", ""};
  gc->compile_in_background(bad);
  CHECK(gc->matcher(bad, {0}).status().is_invalid_argument());
  // Destroyed with a compile still queued: it finishes or is dropped, nothing dangles.
  gc->compile_in_background(GrammarSpec{GrammarKind::kRegex, "[a-z]{1,9}", "", ""});
}

}  // namespace pd
