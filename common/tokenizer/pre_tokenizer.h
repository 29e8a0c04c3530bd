// Regex pre-tokenizer for byte-level BPE (private to the tokenizer module).
//
// A pre-tokenizer is a sequence of PCRE2 stages; each stage splits every piece
// left by the previous stage into its matches and the gaps between them (both
// kept, in order: Hugging Face's Split(behavior=Isolated)). Each piece is
// matched on its own, so a lookahead never sees past the end of its piece —
// exactly as Hugging Face's Sequence pre-tokenizer behaves.
#pragma once

#include <memory>
#include <string_view>
#include <vector>

#include "util/status.h"

namespace pd {

class PreTokenizer {
 public:
  // `pre` is tokenizer.ggml.pre. Known names:
  //   "gpt2", "gpt-2"                   GPT-2 regex
  //   "smollm", "starcoder", "refact"   every \p{N} alone, then the GPT-2 regex
  //   "llama3", "llama-bpe", "llama-v3" Llama-3 regex (and BPE ignores merges
  //                                     for a piece that is itself a token)
  //   "qwen2", "deepseek-r1-qwen"       Qwen2 regex: Llama 3's with single digits
  // Unsupported (naming `pre`) for anything else; Internal if PCRE2 fails.
  static Result<std::unique_ptr<PreTokenizer>> create(std::string_view pre);
  ~PreTokenizer();
  PreTokenizer(const PreTokenizer&) = delete;
  PreTokenizer& operator=(const PreTokenizer&) = delete;

  // Appends the pieces of `text` (views into it, in order, covering every byte)
  // to `out`. Never fails: text that is not valid UTF-8 is matched around, and
  // each invalid byte becomes a piece of its own. Thread-safe (const, no shared
  // mutable state).
  void split(std::string_view text, std::vector<std::string_view>& out) const;

  // Llama-3 BPE: a piece that is already a vocabulary token is emitted whole.
  bool ignore_merges() const { return ignore_merges_; }

 private:
  PreTokenizer() = default;
  struct Stage;
  std::vector<Stage> stages_;  // constant after create()
  bool ignore_merges_ = false;
};

}  // namespace pd
