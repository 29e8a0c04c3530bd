// The SentencePiece tokenizer on the real Gemma 3 270M file against the
// reference made by Hugging Face tokenizers (tests/data/reference_gemma3,
// scripts/make_tokenizer_reference_gemma3.py). Skips, saying so, when the model
// file is absent (it is not part of the default model download).
#include <catch2/catch.hpp>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>

#include "gguf/gguf_reader.h"
#include "test_support.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer_reference_gemma3.h"

namespace pd {
namespace {

std::unique_ptr<GgufFile> open_gemma3() {
  test::require_gemma3_model();
  const std::string path = test::gemma3_model_path();
  auto file = GgufFile::open(path);
  REQUIRE(file.status().to_string() == "OK");
  return std::move(file).value();
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TEST_CASE("Gemma 3 tokenizer encodes exactly as Hugging Face tokenizers", "[tokenizer][sentencepiece][gemma3]") {
  auto file = open_gemma3();
  const auto t0 = std::chrono::steady_clock::now();
  auto tok_r = Tokenizer::from_gguf(*file);
  const double load_s = seconds_since(t0);
  REQUIRE(tok_r.status().to_string() == "OK");
  const Tokenizer& tok = **tok_r;
  // Informational (this machine is shared): building the 262k-token vocabulary.
  WARN("Tokenizer::from_gguf (262144 tokens): " << load_s << " s");
  CHECK(tok.kind() == VocabKind::kSentencePiece);
  CHECK(tok.vocab_size() == 262144);
  CHECK(tok.bos_id() == 2);
  CHECK(tok.eos_id() == 1);
  CHECK(tok.add_bos());
  CHECK(tok.find_token("<start_of_turn>") == 105);
  CHECK(tok.find_token("<end_of_turn>") == 106);
  CHECK(tok.is_control(106));
  test::gemma3::check_reference_cases(tok);
}

TEST_CASE("Gemma 3 tokenizer round-trips a long text", "[tokenizer][sentencepiece][gemma3]") {
  auto file = open_gemma3();
  auto tok_r = Tokenizer::from_gguf(*file);
  REQUIRE(tok_r.is_ok());
  const Tokenizer& tok = **tok_r;
  std::ifstream in(test::test_data_dir() + "/text/pride_and_prejudice_ch1-11.txt", std::ios::binary);
  REQUIRE(in);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string novel = ss.str();
  // The novel's first 8 KB is a reference case; here the whole of it (87 KB) and
  // one paragraph without line breaks (one long merge word, ~100 KB).
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<TokenId> ids = tok.encode(novel);
  const double novel_s = seconds_since(t0);
  CHECK(tok.decode(ids) == novel);
  std::string paragraph;
  for (char c : novel) paragraph.push_back(c == '\n' ? ' ' : c);
  while (paragraph.size() < 100000) paragraph += paragraph.substr(0, 100000 - paragraph.size());
  const auto t1 = std::chrono::steady_clock::now();
  const std::vector<TokenId> pids = tok.encode(paragraph);
  const double para_s = seconds_since(t1);
  CHECK(tok.decode(pids) == paragraph);
  WARN("encode: " << novel.size() << " bytes -> " << ids.size() << " tokens in " << novel_s << " s; " << paragraph.size()
                  << " bytes without a line break -> " << pids.size() << " tokens in " << para_s << " s");
}

}  // namespace pd
