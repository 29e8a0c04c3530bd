// Unit tests of the byte-level BPE tokenizer, the pre-tokenizers, StreamDecoder
// and ChatTemplate, on small handmade vocabularies (no model file needed).
#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <string>
#include <thread>
#include <vector>

#include "gguf/gguf_reader.h"
#include "gguf/gguf_writer.h"
#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/tokenizer.h"

namespace pd {
namespace {

// GPT-2 bytes_to_unicode, written independently of the implementation.
std::string byte_token(unsigned char b) {
  static const std::array<std::string, 256> table = [] {
    std::array<std::string, 256> t;
    int extra = 0;
    for (int c = 0; c < 256; ++c) {
      const bool printable = (c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF);
      const int cp = printable ? c : 256 + extra++;
      std::string s;
      if (cp < 0x80) {
        s.push_back(char(cp));
      } else {
        s.push_back(char(0xC0 | (cp >> 6)));
        s.push_back(char(0x80 | (cp & 0x3F)));
      }
      t[size_t(c)] = s;
    }
    return t;
  }();
  return table[b];
}

// ids: 0 "<|endoftext|>" CONTROL, 1 "<|im_start|>" CONTROL, 2 "<|im_end|>" CONTROL,
// 3 "<tool>" USER_DEFINED, 4 "<a>" CONTROL, 5 "<a><b>" CONTROL,
// 6..261 the byte tokens (byte b = 6 + b), then one token per merge in rank order.
constexpr TokenId kFirstByte = 6;
TokenId byte_id(unsigned char b) { return kFirstByte + b; }

TokenizerVocab make_vocab(const std::string& pre, const std::vector<std::string>& merges) {
  TokenizerVocab v;
  auto add = [&](const std::string& text, TokenType type) {
    v.tokens.push_back(text);
    v.types.push_back(type);
  };
  add("<|endoftext|>", TokenType::kControl);
  add("<|im_start|>", TokenType::kControl);
  add("<|im_end|>", TokenType::kControl);
  add("<tool>", TokenType::kUserDefined);
  add("<a>", TokenType::kControl);
  add("<a><b>", TokenType::kControl);
  for (int b = 0; b < 256; ++b) add(byte_token(static_cast<unsigned char>(b)), TokenType::kNormal);
  for (const std::string& m : merges) {
    const size_t sp = m.find(' ');
    add(m.substr(0, sp) + m.substr(sp + 1), TokenType::kNormal);
    v.merges.push_back(m);
  }
  v.pre = pre;
  v.bos_id = 1;
  v.eos_id = 2;
  v.unk_id = 0;
  return v;
}

const std::vector<std::string> kMerges = {
    "Ġ t", "h e", "Ġt he", "i n", "in g", "o w", "l o", "lo w", "1 2", "a a", "e r", "Ġ Ġ", "ĠĠ ĠĠ",
};

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& pre = "smollm",
                                          const std::vector<std::string>& merges = kMerges) {
  auto tok = Tokenizer::create(make_vocab(pre, merges));
  REQUIRE(tok.status().to_string() == "OK");
  return std::move(tok).value();
}

std::vector<std::string> pieces(const std::string& pre, std::string_view text) {
  auto p = PreTokenizer::create(pre);
  REQUIRE(p.is_ok());
  std::vector<std::string_view> views;
  (*p)->split(text, views);
  return {views.begin(), views.end()};
}

std::vector<std::string> token_texts(const Tokenizer& tok, const std::vector<TokenId>& ids) {
  std::vector<std::string> out;
  for (TokenId id : ids) out.push_back(tok.token_to_bytes(id));
  return out;
}

using Strings = std::vector<std::string>;

}  // namespace

TEST_CASE("bpe applies merges in rank order, ties leftmost", "[tokenizer]") {
  auto tok = make_tokenizer();
  // "Ġ t" (rank 0) then "h e" (1) then "Ġt he" (2).
  CHECK(token_texts(*tok, tok->encode(" the")) == Strings{" the"});
  CHECK(tok->encode(" the") == std::vector<TokenId>{tok->find_token("Ġthe")});
  // "o w" (rank 5) fires before "l o" (6), so "lo w" can never apply to "low".
  CHECK(token_texts(*tok, tok->encode("low")) == Strings{"l", "ow"});
  // "i n" then "in g".
  CHECK(token_texts(*tok, tok->encode("sing")) == Strings{"s", "ing"});
  // Equal ranks: the leftmost pair merges first.
  CHECK(token_texts(*tok, tok->encode("aaa")) == Strings{"aa", "a"});
  CHECK(token_texts(*tok, tok->encode("aaaa")) == Strings{"aa", "aa"});
  // No merge joins "Ġ" and "er"; merges never cross pre-token boundaries.
  CHECK(token_texts(*tok, tok->encode("er er")) == Strings{"er", " ", "er"});
  CHECK(token_texts(*tok, tok->encode("the")) == Strings{"t", "he"});
}

TEST_CASE("bpe with a reversed rank order gives a different split", "[tokenizer]") {
  auto tok = make_tokenizer("gpt2", {"l o", "lo w", "o w"});
  CHECK(token_texts(*tok, tok->encode("low")) == Strings{"low"});
}

TEST_CASE("special tokens are matched literally, longest first", "[tokenizer]") {
  auto tok = make_tokenizer();
  const TokenId im_start = 1, im_end = 2, tool = 3, a = 4, ab = 5;
  auto ids = tok->encode("<|im_start|>user\nhi<|im_end|>\n");
  REQUIRE(ids.size() >= 4);
  CHECK(ids.front() == im_start);
  CHECK(tok->decode(ids) == "<|im_start|>user\nhi<|im_end|>\n");
  CHECK(std::count(ids.begin(), ids.end(), im_end) == 1);
  CHECK(tok->encode("<a><b>") == std::vector<TokenId>{ab});
  CHECK(tok->encode("<a><c>").front() == a);
  CHECK(tok->encode("x<a>y") == std::vector<TokenId>{byte_id('x'), a, byte_id('y')});
  CHECK(tok->encode("<a><a>") == std::vector<TokenId>{a, a});
  // A partial special token is plain text.
  auto partial = tok->encode("<|im_sta");
  CHECK(std::find(partial.begin(), partial.end(), im_start) == partial.end());
  CHECK(tok->decode(partial) == "<|im_sta");

  // parse_special = false: CONTROL text is ordinary text; USER_DEFINED still matches.
  auto plain = tok->encode("<|im_start|><tool>", /*parse_special=*/false);
  CHECK(std::find(plain.begin(), plain.end(), im_start) == plain.end());
  CHECK(plain.back() == tool);
  CHECK(tok->decode(plain) == "<|im_start|><tool>");

  CHECK(tok->token_to_bytes(im_end) == "<|im_end|>");
  CHECK(tok->is_control(im_end));
  CHECK_FALSE(tok->is_control(tool));
  CHECK_FALSE(tok->is_control(byte_id('a')));
  CHECK_FALSE(tok->is_control(-1));
  CHECK_FALSE(tok->is_control(100000));
  CHECK(tok->find_token("<|im_end|>") == im_end);
  CHECK(tok->find_token("no such token") == -1);
  CHECK(tok->vocab_size() == int32_t(6 + 256 + kMerges.size()));
  CHECK(tok->bos_id() == 1);
  CHECK(tok->eos_id() == 2);
  CHECK_FALSE(tok->add_bos());
}

TEST_CASE("smollm pre-tokenizer splits every digit", "[tokenizer]") {
  CHECK(pieces("smollm", "abc 12345") == Strings{"abc", " ", "1", "2", "3", "4", "5"});
  CHECK(pieces("smollm", "x1y") == Strings{"x", "1", "y"});
  // Unicode digits (\p{N}) too: Arabic-Indic digits and a superscript two.
  CHECK(pieces("smollm", "\u0661\u0662\u00B2") == Strings{"\u0661", "\u0662", "\u00B2"});
  // "1 2" is a merge, but the digits never share a piece under smollm...
  auto tok = make_tokenizer("smollm");
  CHECK(token_texts(*tok, tok->encode("123")) == Strings{"1", "2", "3"});
  // ...while gpt2 keeps " ?\p{N}+" together, so the merge applies.
  auto gpt2 = make_tokenizer("gpt2");
  CHECK(pieces("gpt2", "abc 12345") == Strings{"abc", " 12345"});
  CHECK(token_texts(*gpt2, gpt2->encode("123")) == Strings{"12", "3"});
}

TEST_CASE("whitespace runs", "[tokenizer]") {
  // \s+(?!\S) leaves the last space to join the next word.
  CHECK(pieces("gpt2", "a   b") == Strings{"a", "  ", " b"});
  CHECK(pieces("gpt2", "a \n\n b") == Strings{"a", " \n\n", " b"});
  CHECK(pieces("gpt2", "trailing   ") == Strings{"trailing", "   "});
  CHECK(pieces("gpt2", "\tx") == Strings{"\t", "x"});
  // smollm splits digits first, and the lookahead then ends at the piece end.
  CHECK(pieces("smollm", "a  1") == Strings{"a", "  ", "1"});
  CHECK(pieces("gpt2", "a  1") == Strings{"a", " ", " 1"});
  // llama3: newlines kept with the whitespace before them.
  CHECK(pieces("llama3", "a \n\nb") == Strings{"a", " \n\n", "b"});
  auto tok = make_tokenizer();
  CHECK(token_texts(*tok, tok->encode("     x")) == Strings{"    ", " ", "x"});
}

TEST_CASE("contractions", "[tokenizer]") {
  CHECK(pieces("gpt2", "I'm don't they're we've he'll you'd it's") ==
        Strings{"I", "'m", " don", "'t", " they", "'re", " we", "'ve", " he", "'ll", " you", "'d", " it", "'s"});
  // gpt2's contractions are case-sensitive, Llama 3's are not.
  CHECK(pieces("gpt2", "I'M") == Strings{"I", "'", "M"});
  CHECK(pieces("llama3", "I'M") == Strings{"I", "'M"});
  CHECK(pieces("llama3", "12345 x") == Strings{"123", "45", " x"});
  CHECK(pieces("llama3", "!!!x") == Strings{"!!!", "x"});
  CHECK(pieces("llama3", "(hello") == Strings{"(hello"});
}

// Expected pieces from Hugging Face tokenizers' Split(Regex(...), "isolated")
// with transformers' Qwen2 PRETOKENIZE_REGEX and the GPT-2 regex.
TEST_CASE("qwen2 pre-tokenizer: where it differs from gpt2", "[tokenizer]") {
  CHECK(pieces("qwen2", "I'M HERE, it's 12345 $hello") ==
        Strings{"I", "'M", " HERE", ",", " it", "'s", " ", "1", "2", "3", "4", "5", " $", "hello"});
  CHECK(pieces("gpt2", "I'M HERE, it's 12345 $hello") ==
        Strings{"I", "'", "M", " HERE", ",", " it", "'s", " 12345", " $", "hello"});
  CHECK(pieces("qwen2", "x\n\n  y\r\n") == Strings{"x", "\n\n", " ", " y", "\r\n"});
  CHECK(pieces("gpt2", "x\n\n  y\r\n") == Strings{"x", "\n\n ", " y", "\r\n"});
  CHECK(pieces("qwen2", "\u65e5\u672c\u8a9e123abc") == Strings{"\u65e5\u672c\u8a9e", "1", "2", "3", "abc"});
  CHECK(pieces("gpt2", "\u65e5\u672c\u8a9e123abc") == Strings{"\u65e5\u672c\u8a9e", "123", "abc"});
  CHECK(pieces("qwen2", "price: 1,000.50\u20ac!!\n") ==
        Strings{"price", ":", " ", "1", ",", "0", "0", "0", ".", "5", "0", "\u20ac!!\n"});
  CHECK(pieces("gpt2", "price: 1,000.50\u20ac!!\n") ==
        Strings{"price", ":", " 1", ",", "000", ".", "50", "\u20ac!!", "\n"});
  CHECK(pieces("deepseek-r1-qwen", "12") == Strings{"1", "2"});
  // Qwen2 BPE keeps merges (unlike llama3): "1 2" never applies, digits are alone.
  auto tok = make_tokenizer("qwen2");
  CHECK(token_texts(*tok, tok->encode("12 the")) == Strings{"1", "2", " the"});
}

TEST_CASE("unknown pre-tokenizer is refused, naming it", "[tokenizer]") {
  auto tok = Tokenizer::create(make_vocab("no-such-pre", kMerges));
  REQUIRE_FALSE(tok.is_ok());
  CHECK(tok.status().is_unsupported());
  CHECK_THAT(tok.status().message(), Catch::Contains("no-such-pre"));
}

TEST_CASE("invalid vocabularies are refused", "[tokenizer]") {
  auto v = make_vocab("gpt2", kMerges);
  v.types.pop_back();
  CHECK(Tokenizer::create(v).status().is_invalid_argument());
  v = make_vocab("gpt2", kMerges);
  v.eos_id = 100000;
  auto r = Tokenizer::create(v);
  CHECK(r.status().is_invalid_argument());
  CHECK_THAT(r.status().message(), Catch::Contains("eos_id"));
  v = make_vocab("gpt2", kMerges);
  v.merges.push_back("nospace");
  CHECK(Tokenizer::create(v).status().is_invalid_argument());
  CHECK(Tokenizer::create(TokenizerVocab{}).status().is_invalid_argument());
}

TEST_CASE("invalid UTF-8 input is encoded byte for byte", "[tokenizer]") {
  auto tok = make_tokenizer();
  const std::vector<std::string> inputs = {
      std::string("\xFF\xFE", 2), "ab\xC3", "\xC3(x", "\xE2\x82", "a\xF0\x9F\x98 the", "\xED\xA0\x80 12",
      std::string("\x80\x80\x00z", 4), "caf\xC3\xA9\xE9", "<|im_end|>\xF8\x88\x80\x80\x80",
  };
  for (const std::string& s : inputs) {
    INFO("input bytes: " << s.size());
    const auto ids = tok->encode(s);
    CHECK(tok->decode(ids) == s);
    for (const char* pre : {"gpt2", "smollm", "llama3"}) {
      std::string joined;
      for (const std::string& p : pieces(pre, s)) joined += p;
      CHECK(joined == s);
    }
  }
  CHECK(pieces("gpt2", "ab\xFFx") == Strings{"ab", "\xFF", "x"});
}

TEST_CASE("decode(encode(x)) == x", "[tokenizer]") {
  for (const char* pre : {"smollm", "gpt2", "llama3"}) {
    auto tok = make_tokenizer(pre);
    const std::vector<std::string> texts = {
        "",
        "Hello, world!",
        "  leading and trailing  ",
        "The quick brown fox jumps over the lazy dog 1234567890.",
        "日本語のテキストと中文文本",
        "emoji 😀👍🏽 and flags 🇫🇷",
        "Ünïcödé — “quotes” … ≠ ∑",
        "tabs\tand\nnewlines\r\n\n",
        "<|im_start|>user\nWhat's 2+2?<|im_end|>\n<|im_start|>assistant\n",
        "mixed <tool> call and <a><b> specials",
        "Здравствуй, мир! مرحبا بالعالم",
    };
    for (const std::string& t : texts) {
      INFO("pre=" << pre << " text=" << t);
      CHECK(tok->decode(tok->encode(t)) == t);
    }
  }
}

TEST_CASE("StreamDecoder holds split characters and never emits broken UTF-8", "[tokenizer]") {
  auto tok = make_tokenizer();
  const std::string emoji = "\xF0\x9F\x98\x80";  // U+1F600, four bytes
  StreamDecoder dec(*tok);
  CHECK(dec.push(byte_id('a')) == "a");
  CHECK(dec.push(byte_id(0xF0)) == "");
  CHECK(dec.push(byte_id(0x9F)) == "");
  CHECK(dec.push(byte_id(0x98)) == "");
  CHECK(dec.push(byte_id(0x80)) == emoji);
  CHECK(dec.flush() == "");

  // Whole-token streaming of mixed text reproduces the text exactly.
  const std::string text = "héllo 世界 " + emoji + " done<|im_end|>";
  std::string streamed;
  StreamDecoder dec2(*tok);
  for (TokenId id : tok->encode(text)) streamed += dec2.push(id);
  streamed += dec2.flush();
  CHECK(streamed == text);

  // Byte-by-byte streaming of the same text.
  std::string bytewise;
  StreamDecoder dec3(*tok);
  for (unsigned char b : text) {
    const std::string out = dec3.push(byte_id(b));
    bytewise += out;
  }
  CHECK(dec3.flush() == "");
  // The <|im_end|> text came as bytes here, so it renders the same.
  CHECK(bytewise == text);
}

TEST_CASE("StreamDecoder replaces sequences that can never complete", "[tokenizer]") {
  auto tok = make_tokenizer();
  const std::string fffd = "\xEF\xBF\xBD";
  StreamDecoder dec(*tok);
  CHECK(dec.push(byte_id(0xF0)) == "");
  CHECK(dec.push(byte_id(0x9F)) == "");
  // 'b' cannot continue the sequence: the held bytes become one U+FFFD at once.
  CHECK(dec.push(byte_id('b')) == fffd + "b");
  // A lone continuation byte or an impossible lead byte is replaced immediately.
  CHECK(dec.push(byte_id(0x80)) == fffd);
  CHECK(dec.push(byte_id(0xFF)) == fffd);
  // Overlong and surrogate encodings are invalid from their second byte.
  CHECK(dec.push(byte_id(0xE0)) == "");
  CHECK(dec.push(byte_id(0x80)) == fffd + fffd);
  CHECK(dec.push(byte_id(0xED)) == "");
  CHECK(dec.push(byte_id(0xA0)) == fffd + fffd);
  // flush() turns an unfinished character into U+FFFD and empties the buffer.
  CHECK(dec.push(byte_id(0xE4)) == "");
  CHECK(dec.push(byte_id(0xB8)) == "");
  CHECK(dec.flush() == fffd);
  CHECK(dec.flush() == "");
  CHECK(dec.push(byte_id('z')) == "z");
  // Unknown ids render as nothing.
  CHECK(dec.push(-5) == "");
  CHECK(dec.push(1 << 30) == "");
}

TEST_CASE("encode is safe to call from several threads", "[tokenizer]") {
  auto tok = make_tokenizer();
  const std::string text = "The theory of everything 123 <|im_end|> 😀 sing low aaaa";
  const auto expected = tok->encode(text);
  std::vector<std::thread> threads;
  std::array<bool, 4> ok{};
  for (size_t t = 0; t < ok.size(); ++t) {
    threads.emplace_back([&, t] {
      bool all = true;
      for (int i = 0; i < 200; ++i) all = all && tok->encode(text) == expected;
      ok[t] = all;
    });
  }
  for (auto& th : threads) th.join();
  for (bool b : ok) CHECK(b);
}

TEST_CASE("long inputs encode completely", "[tokenizer]") {
  auto tok = make_tokenizer();
  std::string text;
  for (int i = 0; i < 2000; ++i) text += " the thing " + std::to_string(i);
  text += std::string(100000, 'x') + std::string(50000, ' ') + std::string(30000, '7');
  const auto ids = tok->encode(text);
  CHECK(tok->decode(ids) == text);
  // The 100000 'x's have no merges: one token per byte.
  CHECK(ids.size() > 100000 + 50000 / 4 + 30000);
}

// ---- from_gguf, through the project's GGUF writer/reader -------------------

namespace {

std::unique_ptr<GgufFile> gguf_with_tokenizer(const std::string& model, const std::string& chat_template) {
  const TokenizerVocab v = make_vocab("smollm", kMerges);
  GgufWriter w;
  w.set_string("tokenizer.ggml.model", model);
  w.set_string("tokenizer.ggml.pre", v.pre);
  w.set_string_array("tokenizer.ggml.tokens", v.tokens);
  std::vector<int32_t> types;
  for (TokenType t : v.types) types.push_back(int32_t(t));
  w.set_i32_array("tokenizer.ggml.token_type", types);
  w.set_string_array("tokenizer.ggml.merges", v.merges);
  w.set_u32("tokenizer.ggml.bos_token_id", 1);
  w.set_u32("tokenizer.ggml.eos_token_id", 2);
  w.set_u32("tokenizer.ggml.unknown_token_id", 0);
  w.set_bool("tokenizer.ggml.add_bos_token", true);
  if (!chat_template.empty()) w.set_string("tokenizer.chat_template", chat_template);
  auto f = GgufFile::from_bytes(w.to_bytes(), "test.gguf");
  REQUIRE(f.status().to_string() == "OK");
  return std::move(f).value();
}

// SmolLM2-Instruct's template, with "\n" escapes in the literals (the real file
// carries raw newlines there; both spellings must parse).
const std::string kSmolTemplate =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful test bot, it\\'s true<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

}  // namespace

TEST_CASE("Tokenizer::from_gguf reads the tokenizer.ggml keys", "[tokenizer]") {
  auto file = gguf_with_tokenizer("gpt2", "");
  auto tok = Tokenizer::from_gguf(*file);
  REQUIRE(tok.status().to_string() == "OK");
  CHECK((*tok)->vocab_size() == int32_t(6 + 256 + kMerges.size()));
  CHECK((*tok)->bos_id() == 1);
  CHECK((*tok)->eos_id() == 2);
  CHECK((*tok)->add_bos());
  CHECK((*tok)->decode((*tok)->encode(" the 12")) == " the 12");
  CHECK((*tok)->encode(" the") == std::vector<TokenId>{(*tok)->find_token("Ġthe")});

  auto t5 = gguf_with_tokenizer("t5", "");
  auto bad = Tokenizer::from_gguf(*t5);
  REQUIRE_FALSE(bad.is_ok());
  CHECK(bad.status().is_unsupported());
  CHECK_THAT(bad.status().message(), Catch::Contains("'t5'") && Catch::Contains("test.gguf"));
}

TEST_CASE("Tokenizer::from_gguf on the tiny test model", "[tokenizer]") {
  TinyLlamaSpec spec;
  auto file = GgufFile::from_bytes(make_tiny_llama_gguf(spec), "tiny.gguf");
  REQUIRE(file.status().to_string() == "OK");
  auto tok = Tokenizer::from_gguf(**file);
  REQUIRE(tok.status().to_string() == "OK");
  CHECK((*tok)->vocab_size() == kTinyVocabSize);
  CHECK((*tok)->eos_id() == TokenId(kTinyEosId));
  CHECK((*tok)->encode(" the") == std::vector<TokenId>{kTinyVocabFirstMerge + 8});  // "Ġt he"
  auto tpl = ChatTemplate::from_gguf(**file);
  REQUIRE(tpl.status().to_string() == "OK");
  CHECK(tpl->default_system().empty());
}

TEST_CASE("ChatTemplate renders ChatML", "[chat_template]") {
  const ChatTemplate t = ChatTemplate::chatml();
  auto out = t.apply({{"user", "Hi"}, {"assistant", "Hello!"}, {"user", "Bye"}});
  REQUIRE(out.is_ok());
  CHECK(*out ==
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n");
  auto no_gen = t.apply({{"user", "Hi"}}, /*add_generation_prompt=*/false);
  REQUIRE(no_gen.is_ok());
  CHECK(*no_gen == "<|im_start|>user\nHi<|im_end|>\n");
}

TEST_CASE("ChatTemplate inserts its default system prompt", "[chat_template]") {
  const ChatTemplate t = ChatTemplate::chatml("Be brief.");
  auto out = t.apply({{"user", "Hi"}});
  REQUIRE(out.is_ok());
  CHECK(*out == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  auto own = t.apply({{"system", "Mine."}, {"user", "Hi"}});
  REQUIRE(own.is_ok());
  CHECK(*own == "<|im_start|>system\nMine.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

TEST_CASE("ChatTemplate rejects unknown roles and empty lists", "[chat_template]") {
  const ChatTemplate t = ChatTemplate::chatml();
  auto bad = t.apply({{"user", "Hi"}, {"tool", "x"}});
  REQUIRE_FALSE(bad.is_ok());
  CHECK(bad.status().is_invalid_argument());
  CHECK_THAT(bad.status().message(), Catch::Contains("messages[1].role"));
  auto empty = t.apply({});
  REQUIRE_FALSE(empty.is_ok());
  CHECK(empty.status().is_invalid_argument());
}

TEST_CASE("ChatTemplate::from_gguf extracts the default system prompt", "[chat_template]") {
  auto file = gguf_with_tokenizer("gpt2", kSmolTemplate);
  auto t = ChatTemplate::from_gguf(*file);
  REQUIRE(t.status().to_string() == "OK");
  CHECK(t->default_system() == "You are a helpful test bot, it's true");
  auto out = t->apply({{"user", "Hi"}});
  REQUIRE(out.is_ok());
  CHECK(*out ==
        "<|im_start|>system\nYou are a helpful test bot, it's true<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");

  // Raw newlines inside the literal (as the real SmolLM2 file has them).
  std::string raw = kSmolTemplate;
  for (size_t p; (p = raw.find("\\n")) != std::string::npos;) raw.replace(p, 2, "\n");
  auto file_raw = gguf_with_tokenizer("gpt2", raw);
  auto t_raw = ChatTemplate::from_gguf(*file_raw);
  REQUIRE(t_raw.is_ok());
  CHECK(t_raw->default_system() == "You are a helpful test bot, it's true");

  // Qwen-style: the default sits in the else-branch of "if messages[0] is system".
  auto qwen = gguf_with_tokenizer(
      "gpt2",
      "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
      "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen.<|im_end|>\\n' }}{%- endif %}"
      "{%- for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
      "'<|im_end|>' + '\\n'}}{%- endfor %}");
  auto tq = ChatTemplate::from_gguf(*qwen);
  REQUIRE(tq.is_ok());
  CHECK(tq->default_system() == "You are Qwen.");
}

TEST_CASE("ChatTemplate::from_gguf refuses non-ChatML templates", "[chat_template]") {
  auto file = gguf_with_tokenizer(
      "gpt2", "{% for message in messages %}[INST] {{ message['content'] }} [/INST]{% endfor %}");
  auto t = ChatTemplate::from_gguf(*file);
  REQUIRE_FALSE(t.is_ok());
  CHECK(t.status().is_unsupported());
  CHECK_THAT(t.status().message(), Catch::Contains("test.gguf"));

  auto none = gguf_with_tokenizer("gpt2", "");
  auto tn = ChatTemplate::from_gguf(*none);
  REQUIRE_FALSE(tn.is_ok());
  CHECK_THAT(tn.status().message(), Catch::Contains("test.gguf") && Catch::Contains("tokenizer.chat_template"));
}

}  // namespace pd
