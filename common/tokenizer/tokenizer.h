// Tokenizer built from a GGUF file's own vocabulary, of either kind llama.cpp
// writes (tokenizer.ggml.model):
//  - "gpt2": byte-level BPE (tokens / token_type / merges / pre). Special
//    tokens written literally in the text (e.g. "<|im_start|>") are matched
//    first; the remaining spans are pre-tokenized with the regex the model's
//    pre-tokenizer requires (tokenizer.ggml.pre: "smollm", "gpt2", "llama-bpe",
//    "qwen2", ...; unknown values are refused) and then merged by BPE rank.
//  - "llama": SentencePiece-style BPE with byte fallback (tokens / scores /
//    token_type; Gemma, Llama 2). Special tokens are matched first; in the rest
//    spaces become U+2581 ("▁", with one in front of the input when
//    add_space_prefix), each character starts as its own token (or as its
//    UTF-8 bytes' <0xXX> tokens when it has none), and adjacent tokens whose
//    concatenation is a token merge, best first. "Best" is what Hugging Face's
//    conversion of such a file does: the merged token's score, or for Gemma
//    files its position in the vocabulary (see spm_gemma).
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

enum class VocabKind { kByteLevelBpe, kSentencePiece };  // tokenizer.ggml.model "gpt2" / "llama"

struct TokenizerVocab {
  VocabKind kind = VocabKind::kByteLevelBpe;
  std::vector<std::string> tokens;     // as stored in GGUF (byte-level unicode / SentencePiece pieces)
  std::vector<TokenType> types;        // same length as tokens (kNormal if absent)
  std::vector<std::string> merges;     // byte-level BPE: "left right", in rank order
  std::string pre = "gpt2";            // byte-level BPE: tokenizer.ggml.pre
  std::vector<float> scores;           // SentencePiece: merge priority (higher first); empty = all 0
  // SentencePiece, Hugging Face's conversion of Gemma files (from_gguf sets it
  // for architectures gemma, gemma2 and gemma3): merges are ranked by the
  // merged token's id (lower first) instead of its score, since Gemma's scores
  // do not follow the merge order (whitespace-run and control tokens carry
  // -1000); and whitespace tokens stored with spaces ("  ") are spelled with
  // "▁" as the text will be, reached by merging rather than matched as added
  // tokens.
  bool spm_gemma = false;
  bool add_space_prefix = false;       // SentencePiece: "▁" before text that starts the input
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
  // encodes as unk_id (dropped when there is none); in a SentencePiece
  // vocabulary every byte of an ill-formed sequence is its <0xXX> token.
  // `starts_input`: the text is the beginning of the model's input (a
  // SentencePiece vocabulary with add_space_prefix puts "▁" only there; pass
  // false for a piece encoded in the middle of a prompt). Thread-safe.
  std::vector<TokenId> encode(std::string_view text, bool parse_special = true, bool starts_input = true) const;
  // Bytes of one token (control tokens render as their text, e.g. "<|im_end|>");
  // "" for an id outside the vocabulary.
  std::string token_to_bytes(TokenId id) const;
  // Whole-sequence decode (may contain invalid UTF-8 if the ids cut a character;
  // ids outside the vocabulary render as nothing). A SentencePiece vocabulary
  // with add_space_prefix drops the one leading space that prefix became.
  std::string decode(const std::vector<TokenId>& ids) const;

  int32_t vocab_size() const;
  TokenId bos_id() const;
  TokenId eos_id() const;
  bool add_bos() const;
  bool is_control(TokenId id) const;
  VocabKind kind() const;
  // Id of a token whose text is exactly `text` as stored in the vocabulary
  // (byte-level form, e.g. "Ġthe", or piece, e.g. "▁the"; specials as written,
  // e.g. "<|im_end|>"), or -1.
  TokenId find_token(std::string_view text) const;

 private:
  Tokenizer();
  static Result<std::unique_ptr<Tokenizer>> create_sentencepiece(TokenizerVocab vocab);
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

// Chat template: the prompt formats of the models served, recognized from the
// GGUF's tokenizer.chat_template (Jinja) by their markers and rendered here
// exactly as their Jinja renders them (no Jinja engine):
//  - ChatML (SmolLM2, Qwen2/2.5): <|im_start|>{role}\n{content}<|im_end|>\n ...
//    <|im_start|>assistant\n, with the default system message the template
//    inserts when the first message is not a system one (read off the
//    template, e.g. SmolLM2's or Qwen2.5's "You are Qwen, ...");
//  - Qwen3: ChatML, no default system message; an assistant message's
//    <think>...</think> is dropped from turns before the last user message;
//  - Gemma (2, 3): <start_of_turn>user\n{content}<end_of_turn>\n ...
//    <start_of_turn>model\n; contents trimmed; Gemma 3 folds a system message
//    into the first user turn (Gemma 2 refuses one); user/assistant must alternate;
//  - Llama 3: <|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>,
//    contents trimmed; 3.1+ always open with a system turn holding "Cutting
//    Knowledge Date: December 2023\nToday Date: {date}\n\n" and the system message.
// Gemma and Llama 3 templates begin with the BOS token (writes_bos()).
struct ChatMessage {
  std::string role;     // "system", "user", "assistant" (Llama 3 also "ipython": a tool's result)
  std::string content;
};

// A piece of a rendered chat: template text (special-token text in it is
// meant) or a message's content (to be encoded as plain text).
struct ChatSegment {
  std::string text;
  bool is_content = false;
};

enum class ChatFormat { kChatml, kQwen3, kGemma, kLlama3 };

// How a template writes tools and tool calls (router/tool_calls.h renders and
// parses them):
//  - kHermes (Qwen2.5, Qwen3, NousHermes): tools described in the system
//    message, calls as <tool_call>\n{"name": .., "arguments": ..}\n</tool_call>,
//    results as <tool_response> blocks in a user turn;
//  - kLlama31 (Llama 3.1+): tools described in the first user message, a call
//    is the whole reply {"name": .., "parameters": ..}, results are "ipython" turns;
//  - kNone: the template has no tool calls (SmolLM2, Gemma, Llama 3.0).
enum class ToolFormat { kNone, kHermes, kLlama31 };

class ChatTemplate {
 public:
  // Recognizes tokenizer.chat_template; NotFound naming the file when there is
  // none, Unsupported naming the file when it is none of the formats above.
  static Result<ChatTemplate> from_gguf(const GgufFile& file);
  // The same from a template string; `source` names it in errors.
  static Result<ChatTemplate> from_string(std::string_view tpl, std::string_view source);
  // A template by name, as cluster.json's "chat_template" gives it: "chatml"
  // (no default system message), "gemma" (Gemma 3's), "llama3" (Llama 3.0's:
  // no system turn unless one is given), "llama3.1" (3.1's: the dated system
  // turn, dated "26 Jul 2024" as 3.1's template dates it; tool format
  // kLlama31), "hermes" (ChatML, no default system message, tool format
  // kHermes) or "qwen2.5" (ChatML with Qwen2.5's default system message,
  // kHermes). InvalidArgument otherwise.
  static Result<ChatTemplate> from_name(std::string_view name);
  static ChatTemplate chatml(std::string default_system = "");
  static ChatTemplate gemma(bool system_allowed = true);
  // date_header: the 3.1+ system turn with the dates; `date` = its "Today
  // Date" ("" = today's, as strftime_now("%d %b %Y") renders it).
  static ChatTemplate llama3(bool date_header = false, std::string date = "");

  // The rendered prompt in pieces, without the BOS token. InvalidArgument
  // naming the message for an unknown role, an empty list, or what the
  // template itself refuses (Gemma: roles not alternating, Gemma 2: system).
  // Roles: system, user, assistant; Llama 3 also "ipython" (a tool's result,
  // written as it is: not trimmed).
  Result<std::vector<ChatSegment>> render(const std::vector<ChatMessage>& messages,
                                          bool add_generation_prompt = true) const;
  // render() joined into one string.
  Result<std::string> apply(const std::vector<ChatMessage>& messages, bool add_generation_prompt = true) const;

  ChatFormat format() const { return format_; }
  // The template's tool-call format, recognized from its source (ChatML or
  // Qwen3 mentioning <tool_call>: kHermes; Llama 3.1+ handling `tools` or
  // "Environment: ipython": kLlama31) or set by from_name; kNone otherwise.
  ToolFormat tool_format() const { return tool_format_; }
  // This template for a request whose tools are described to the model: Llama
  // 3.1+ (kLlama31) then opens its system turn with "Environment: ipython\n",
  // as its Jinja does when tools are given; other formats are unchanged.
  ChatTemplate with_tools_described() const;
  const std::string& default_system() const { return default_system_; }
  // The template writes bos_token first: the prompt starts with one BOS
  // whether or not the vocabulary adds one.
  bool writes_bos() const { return format_ == ChatFormat::kGemma || format_ == ChatFormat::kLlama3; }
  // Texts of the tokens that end an assistant turn ("<|im_end|>",
  // "<end_of_turn>", "<|eot_id|>" and "<|eom_id|>"): generation stops there.
  std::vector<std::string> end_of_turn_tokens() const;
  // The messages as token ids: the template's text encoded with special
  // tokens, each message's content without (a user cannot inject control
  // tokens), one BOS first when the template writes one or `tok` adds one.
  // What the router and pd-generate both send to the engine.
  Result<std::vector<TokenId>> encode(const Tokenizer& tok, const std::vector<ChatMessage>& messages,
                                      bool add_generation_prompt = true) const;
  // The ids of end_of_turn_tokens() that `tok` has, its EOS excluded: a chat
  // reply stops there.
  std::vector<TokenId> stop_ids(const Tokenizer& tok) const;

 private:
  ChatFormat format_ = ChatFormat::kChatml;
  std::string default_system_;  // ChatML: inserted when messages[0] is not "system"; empty = none
  bool system_allowed_ = true;  // Gemma 2 refuses a system message
  bool date_header_ = false;    // Llama 3.1+
  std::string date_;            // Llama 3.1+: "" = today
  ToolFormat tool_format_ = ToolFormat::kNone;
  bool tools_described_ = false;  // Llama 3.1+: "Environment: ipython\n" in the system turn
};

}  // namespace pd
