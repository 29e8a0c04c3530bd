// The Gemma 3 tokenizer reference (tests/data/reference_gemma3, made by
// scripts/make_tokenizer_reference_gemma3.py with Hugging Face tokenizers),
// shared by the unit test (on the vocabulary subset stored there) and the
// model test (on the real GGUF file).
#pragma once

#include <catch2/catch.hpp>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "test_support.h"
#include "tokenizer/tokenizer.h"

namespace pd::test::gemma3 {

using nlohmann::json;

inline json load_json(const std::string& name) {
  const std::string path = test::test_data_dir() + "/reference_gemma3/" + name;
  std::ifstream in(path, std::ios::binary);
  if (!in) FAIL("reference file " << path << " is missing (committed data; scripts/make_tokenizer_reference_gemma3.py)");
  std::stringstream ss;
  ss << in.rdbuf();
  json j = json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) FAIL("reference file " << path << " is not valid JSON");
  return j;
}

inline std::string from_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out.push_back(char(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}

inline std::string ids_to_string(const std::vector<TokenId>& ids) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? ", " : "") + std::to_string(ids[i]);
  return s + "]";
}

inline std::string shown(const std::string& text) {
  std::string out;
  for (unsigned char c : text) {
    if (c < 0x20 || c == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02X", c);
      out += buf;
    } else {
      out.push_back(char(c));
    }
  }
  return out.size() > 200 ? out.substr(0, 200) + "..." : out;
}

// Gemma 3's vocabulary with only the tokens in vocab.json present, each at its
// own id (the rest are empty placeholders no text can reach).
inline TokenizerVocab subset_vocab() {
  const json v = load_json("vocab.json");
  TokenizerVocab vocab;
  vocab.kind = VocabKind::kSentencePiece;
  const size_t n = v.at("n_vocab").get<size_t>();
  vocab.tokens.assign(n, "");
  vocab.types.assign(n, TokenType::kUnused);
  vocab.scores.assign(n, 0.0f);
  for (const json& t : v.at("tokens")) {
    const size_t id = t.at(0).get<size_t>();
    REQUIRE(id < n);
    vocab.tokens[id] = t.at(1).get<std::string>();
    vocab.types[id] = TokenType(t.at(2).get<int>());
    vocab.scores[id] = t.at(3).get<float>();
  }
  REQUIRE(v.at("architecture") == "gemma3");
  vocab.spm_gemma = true;
  vocab.add_space_prefix = v.at("add_space_prefix").get<bool>();
  vocab.add_bos = v.at("add_bos_token").get<bool>();
  vocab.bos_id = v.at("bos_token_id").get<TokenId>();
  vocab.eos_id = v.at("eos_token_id").get<TokenId>();
  vocab.unk_id = v.at("unknown_token_id").get<TokenId>();
  vocab.pad_id = v.at("padding_token_id").get<TokenId>();
  return vocab;
}

// Encodes every case of tokenizer.json and checks the ids, decode() and
// StreamDecoder against it.
inline void check_reference_cases(const Tokenizer& tok) {
  const json ref = load_json("tokenizer.json");
  size_t n_cases = 0, n_mismatch = 0;
  for (const json& c : ref.at("cases")) {
    ++n_cases;
    const bool is_hex = c.contains("hex");
    const std::string text = is_hex ? from_hex(c.at("hex").get<std::string>()) : c.at("text").get<std::string>();
    const std::vector<TokenId> expected = c.at("ids").get<std::vector<TokenId>>();
    const std::vector<TokenId> got = tok.encode(text, /*parse_special=*/true);
    INFO("text: \"" << shown(text) << "\"");
    INFO("expected ids: " << ids_to_string(expected));
    INFO("got ids:      " << ids_to_string(got));
    if (got != expected) ++n_mismatch;
    CHECK(got == expected);
    // decode is HF's decode ("decoded" where that is not the text: a literal
    // "▁" comes back as a space); non-UTF-8 input comes back byte for byte.
    const std::string want = c.contains("decoded") ? c.at("decoded").get<std::string>() : text;
    CHECK(tok.decode(expected) == want);
    if (!is_hex) {
      StreamDecoder stream(tok);
      std::string streamed;
      for (TokenId id : expected) streamed += stream.push(id);
      streamed += stream.flush();
      CHECK(streamed == want);
    }
  }
  CHECK(n_cases >= 60);
  INFO(n_mismatch << " of " << n_cases << " cases encode differently");
  CHECK(n_mismatch == 0);
}

}  // namespace pd::test::gemma3
