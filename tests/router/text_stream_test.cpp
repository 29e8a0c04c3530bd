// Output text streaming: stop strings (across token boundaries, earliest
// wins, never returned), hold-back of possible stop prefixes, hidden control
// tokens, and never a split UTF-8 character.
#include <catch2/catch.hpp>

#include "gguf/gguf_reader.h"
#include "gguf/gguf_writer.h"
#include "router/text_stream.h"

using pd::router::TextOptions;
using pd::router::TextStream;

namespace {
std::unique_ptr<pd::Tokenizer> tiny_tokenizer() {
  auto f = pd::GgufFile::from_bytes(pd::make_tiny_llama_gguf({}), "tiny.gguf");
  REQUIRE(f.is_ok());
  auto t = pd::Tokenizer::from_gguf(**f);
  REQUIRE(t.is_ok());
  return std::move(t).value();
}
// Feeds `text` one token at a time; returns everything emitted (push + finish).
std::string run(TextStream& s, const pd::Tokenizer& tok, const std::string& text, std::vector<std::string>* pieces = nullptr) {
  std::string out;
  for (pd::TokenId id : tok.encode(text, false)) {
    std::string p = s.push(id);
    if (pieces) pieces->push_back(p);
    out += p;
  }
  return out + s.finish();
}
}  // namespace

TEST_CASE("text stream: no stop strings passes text through", "[router]") {
  auto tok = tiny_tokenizer();
  TextStream s(*tok, {}, {});
  CHECK(run(s, *tok, "hello world, caf\xC3\xA9!") == "hello world, caf\xC3\xA9!");
  CHECK(!s.stopped());
}

TEST_CASE("text stream: a stop string ends the text before it, across tokens", "[router]") {
  auto tok = tiny_tokenizer();
  TextStream s(*tok, {"STOP", "xyz"}, {});
  std::vector<std::string> pieces;
  CHECK(run(s, *tok, "abc STOP def xyz", &pieces) == "abc ");
  CHECK(s.stopped());
  for (const auto& p : pieces) CHECK(p.find('S') == std::string::npos);  // never emitted, even partly
}

TEST_CASE("text stream: the earliest stop string wins, a near-miss prefix is released", "[router]") {
  auto tok = tiny_tokenizer();
  TextStream a(*tok, {"world", "lo w"}, {});
  CHECK(run(a, *tok, "hello world") == "hel");
  TextStream b(*tok, {"wombat"}, {});
  CHECK(run(b, *tok, "hello wombre") == "hello wombre");  // "womb" was held back, then released at finish
  CHECK(!b.stopped());
}

TEST_CASE("text stream: hidden control tokens print nothing", "[router]") {
  auto tok = tiny_tokenizer();
  const pd::TokenId eos = tok->eos_id();
  TextStream s(*tok, {}, {eos});
  std::string out;
  for (pd::TokenId id : tok->encode("ab", false)) out += s.push(id);
  out += s.push(eos);
  CHECK(out + s.finish() == "ab");
}

TEST_CASE("text stream: skip_control drops every control token, and stop strings match what is shown", "[router]") {
  auto tok = tiny_tokenizer();
  const pd::TokenId im_start = tok->find_token("<|im_start|>");
  REQUIRE(tok->is_control(im_start));
  auto feed = [&](TextStream& s) {
    std::string out;
    for (pd::TokenId id : tok->encode("ab", false)) {
      out += s.push(id);
      out += s.push(im_start);
    }
    return out + s.finish();
  };
  TextStream skipped(*tok, {}, {}, TextOptions{.skip_control = true});
  CHECK(feed(skipped) == "ab");
  TextStream shown(*tok, {}, {}, TextOptions{.skip_control = false});
  CHECK(feed(shown) == "a<|im_start|>b<|im_start|>");
  // "ab" is what the client would read: it stops there.
  TextStream stop(*tok, {"ab"}, {}, TextOptions{.skip_control = true});
  CHECK(feed(stop).empty());
  CHECK(stop.stopped());
  // prints() says which tokens add text (what logprobs' text_offset counts).
  const pd::TokenId a = tok->encode("a", false).at(0);
  CHECK(skipped.prints(a));
  CHECK_FALSE(skipped.prints(im_start));
  CHECK(shown.prints(im_start));
  TextStream hidden(*tok, {}, {tok->eos_id()}, TextOptions{.skip_control = false});
  CHECK_FALSE(hidden.prints(tok->eos_id()));
  CHECK(hidden.prints(im_start));
}

TEST_CASE("text stream: held-back text never splits a UTF-8 character", "[router]") {
  auto tok = tiny_tokenizer();
  TextStream s(*tok, {"\xC3\xA9X"}, {});  // "éX": hold-back point falls inside é's two bytes otherwise
  std::vector<std::string> pieces;
  const std::string out = run(s, *tok, "caf\xC3\xA9 \xC3\xA9", &pieces);
  CHECK(out == "caf\xC3\xA9 \xC3\xA9");
  for (const auto& p : pieces)
    if (!p.empty()) CHECK((static_cast<unsigned char>(p[0]) & 0xC0) != 0x80);
}

TEST_CASE("text stream: include_stop keeps the matched stop string", "[router]") {
  auto tok = tiny_tokenizer();
  TextStream plain(*tok, {"world"}, {});
  CHECK(run(plain, *tok, "hello world and more") == "hello ");
  TextStream kept(*tok, {"world"}, {}, TextOptions{.include_stop = true});
  CHECK(run(kept, *tok, "hello world and more") == "hello world");
  CHECK(kept.stopped());
  TextStream earliest(*tok, {"and", "lo w"}, {}, TextOptions{.include_stop = true});
  CHECK(run(earliest, *tok, "hello world and more") == "hello w");
}

TEST_CASE("text stream: min_tokens lets stop strings through until that many tokens came", "[router]") {
  auto tok = tiny_tokenizer();
  const std::string text = "ab ab ab ab";
  const std::vector<pd::TokenId> ids = tok->encode(text, false);
  // The tokens of the first "ab" (whatever the tokenizer makes of it).
  int32_t first_ab = 0;
  while (first_ab < static_cast<int32_t>(ids.size()) &&
         tok->decode(std::vector<pd::TokenId>(ids.begin(), ids.begin() + first_ab)) != "ab")
    ++first_ab;
  REQUIRE(first_ab < static_cast<int32_t>(ids.size()));
  TextStream early(*tok, {"ab"}, {});
  CHECK(run(early, *tok, text).empty());
  // Past the whole text: no stop at all.
  TextStream late(*tok, {"ab"}, {}, TextOptions{.min_tokens = static_cast<int32_t>(ids.size()) + 1});
  CHECK(run(late, *tok, text) == text);
  CHECK_FALSE(late.stopped());
  // Checked from the token after the first "ab" on (as vLLM: once that many
  // tokens were generated): the first "ab" is sent, the next one ends the text.
  TextStream middle(*tok, {"ab"}, {}, TextOptions{.min_tokens = first_ab + 1});
  CHECK(run(middle, *tok, text) == "ab ");
  CHECK(middle.stopped());
}
