// A request's output text as it streams: incremental detokenization, control
// tokens hidden, and stop strings applied (OpenAI semantics: the text ends
// before the first stop string, which is not returned). Text that might be the
// start of a stop string is held back until it is known not to be one, and
// what is emitted always ends on a UTF-8 character boundary.
#pragma once

#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace pd::router {

// How a request's text is made, beyond its stop strings.
struct TextOptions {
  // Every control token prints nothing (the request's skip_special_tokens,
  // vLLM's default), so stop strings are matched on the text the client gets.
  bool skip_control = false;
  // A matched stop string stays at the end of the text, and so does a stop
  // token's own text (vLLM's include_stop_str_in_output).
  bool include_stop = false;
  // Stop strings are not looked for until this many tokens were generated
  // (vLLM's min_tokens); one that ends later is matched in the text that
  // came after that point.
  int32_t min_tokens = 0;
};

class TextStream {
 public:
  // `hidden`: token ids that end generation and print nothing (EOS, <|im_end|>,
  // the request's stop_token_ids).
  TextStream(const Tokenizer& tok, std::vector<std::string> stops, std::vector<TokenId> hidden,
             TextOptions options = {});
  // Feeds the next generated token; returns the text that may be sent now.
  // After a stop string matched, stopped() is true and further tokens add nothing.
  std::string push(TokenId id);
  // End of generation: whatever is held back (no stop string can match any more).
  std::string finish();
  bool stopped() const { return stopped_; }
  // Whether push(id) adds the token's text (before stop strings): false for
  // a hidden token and, with skip_control, a control token.
  bool prints(TokenId id) const;

 private:
  std::string take_safe();
  const Tokenizer& tok_;
  StreamDecoder decoder_;
  std::vector<std::string> stops_;
  std::vector<TokenId> hidden_;
  std::string pending_;  // decoded, not yet emitted
  bool stopped_ = false;
  TextOptions options_;
  int32_t generated_ = 0;  // tokens pushed
};

}  // namespace pd::router
