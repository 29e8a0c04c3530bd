// Byte-level BPE tokenizer built from a GGUF file's own vocabulary
// (tokenizer.ggml.tokens / token_type / merges / bos, eos ids / pre).
//
// encode(): special tokens written literally in the text (e.g. "<|im_start|>")
// are matched first when parse_special is true; the remaining spans are
// pre-tokenized with the regex the model's pre-tokenizer requires (chosen by
// tokenizer.ggml.pre: "smollm", "gpt2", "llama-bpe", ...; unknown values are
// refused) and then merged by BPE rank.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "util/status.h"

namespace pd {

class GgufFile;
using TokenId = int32_t;

enum class TokenType : int32_t {  // llama.cpp's llama_token_type values
  kUndefined = 0, kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6,
};

struct TokenizerVocab {
  std::vector<std::string> tokens;     // byte-level unicode strings as stored in GGUF
  std::vector<TokenType> types;        // same length as tokens (kNormal if absent)
  std::vector<std::string> merges;     // "left right", in rank order
  std::string pre = "gpt2";            // tokenizer.ggml.pre
  TokenId bos_id = -1, eos_id = -1, unk_id = -1, pad_id = -1;
  bool add_bos = false;
};

class Tokenizer {
 public:
  static Result<std::unique_ptr<Tokenizer>> create(TokenizerVocab vocab);
  static Result<std::unique_ptr<Tokenizer>> from_gguf(const GgufFile& file);
  ~Tokenizer();

  // Never prepends BOS (callers that want one check add_bos()). With
  // parse_special, CONTROL and USER_DEFINED token texts in `text` become single
  // ids (leftmost, longest first); without it only USER_DEFINED ones do (as in
  // HF tokenizers and llama.cpp) and CONTROL text is encoded as ordinary text.
  // Accepts any bytes, invalid UTF-8 included; a byte with no token of its own
  // encodes as unk_id (dropped when there is none). Thread-safe.
  std::vector<TokenId> encode(std::string_view text, bool parse_special = true) const;
  // Bytes of one token (control tokens render as their text, e.g. "<|im_end|>");
  // "" for an id outside the vocabulary.
  std::string token_to_bytes(TokenId id) const;
  // Whole-sequence decode (may contain invalid UTF-8 if the ids cut a character;
  // ids outside the vocabulary render as nothing).
  std::string decode(const std::vector<TokenId>& ids) const;

  int32_t vocab_size() const;
  TokenId bos_id() const;
  TokenId eos_id() const;
  bool add_bos() const;
  bool is_control(TokenId id) const;
  // Id of a token whose text is exactly `text` as stored in the vocabulary
  // (byte-level form, e.g. "Ġthe"; specials as written, e.g. "<|im_end|>"), or -1.
  TokenId find_token(std::string_view text) const;

 private:
  Tokenizer();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Incremental detokenizer: feed token ids one at a time, get back only complete
// UTF-8 text. Bytes of a character split across tokens are held until the
// character completes; flush() returns whatever is left (invalid sequences are
// replaced by U+FFFD).
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok) : tok_(tok) {}
  std::string push(TokenId id);
  std::string flush();

 private:
  const Tokenizer& tok_;
  std::string pending_;
};

// Chat template. SmolLM2 (and every ChatML model) uses
//   <|im_start|>{role}\n{content}<|im_end|>\n ... <|im_start|>assistant\n
// SmolLM2's template inserts a default system message when the first message
// is not a system one; ChatTemplate reproduces that from the GGUF's
// tokenizer.chat_template string.
struct ChatMessage {
  std::string role;     // "system", "user", "assistant"
  std::string content;
};

class ChatTemplate {
 public:
  // Recognizes the template in tokenizer.chat_template (ChatML family);
  // Unsupported with a message naming the file if it is something else.
  static Result<ChatTemplate> from_gguf(const GgufFile& file);
  static ChatTemplate chatml(std::string default_system = "");

  // InvalidArgument naming the message index for an unknown role or empty list.
  Result<std::string> apply(const std::vector<ChatMessage>& messages, bool add_generation_prompt = true) const;
  const std::string& default_system() const { return default_system_; }

 private:
  std::string default_system_;  // inserted when messages[0] is not "system"; empty = none
};

}  // namespace pd
