// A choice's output stream: decides the order its tokens reach the client (a
// token that arrives before the ones preceding it waits for them: the prefill
// rank's token 0 and the decode rank's later ones travel separately), the text
// each delivers (TextStream: detokenization, stop strings), and the logprobs
// and text offsets sent with that text. Echo puts the prompt's text (and its
// logprobs) first. Link thread only.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "protocol/messages.h"
#include "router/answer.h"
#include "router/text_stream.h"
#include "router/tool_calls.h"

namespace pd::router {

struct PendingToken {  // a token that arrived before the ones preceding it
  TokenId token = 0;
  proto::Finish finish = proto::Finish::kNone;
  std::optional<LogprobEntry> logprob;
};

// How a choice is shown: constant for its life.
struct ChoiceFormat {
  int32_t index = 0;             // the choice's index in the answer
  bool stream = false;           // sent as it comes (SSE) or kept for the body
  bool chat = false;             // chat: the first chunk goes out even empty (it carries the role)
  bool with_logprobs = false;    // logprobs asked (sampling.logprobs >= 0)
  bool prompt_logprobs = false;  // echo shows the prompt's logprobs
  bool skip_special = true;      // control tokens print nothing (logprobs still show them)
  bool include_stop = false;     // a matched stop string or stop token's text ends the text (TextOptions)
  int32_t min_tokens = 0;        // no stop string before this many tokens (TextOptions)
};

class ChoiceStream {
 public:
  // `tok` must outlive the stream; `echo_text` leads the choice when echo is asked.
  ChoiceStream(const Tokenizer& tok, ChoiceFormat format, std::vector<std::string> stops, std::vector<TokenId> hidden,
               std::string echo_text);
  // Keeps the tokens of `ev` until their turn (and, from token 0's event, the prompt's logprobs).
  void add(const proto::TokenEvent& ev);
  // The next token in order, once it arrived; its index is next_index() - 1 after the call.
  std::optional<PendingToken> next();
  int32_t next_index() const { return next_index_; }
  // Echo: the prompt's text, and its tokens' logprobs when asked.
  void deliver_echo(const std::vector<TokenId>& prompt, const Response& resp, const std::string& model);
  // A generated token: its logprob is kept and the text it completes delivered.
  // True when a stop string matched (the choice ends here).
  bool push(const PendingToken& t, const Response& resp, const std::string& model);
  // End of generation: the text held back for a possible stop string.
  void flush(const Response& resp, const std::string& model);
  // The choice as it ends (its text and logprobs not yet sent, when streaming).
  ChoiceOut finish(const std::string& finish_reason);
  bool first_chunk_sent() const { return first_chunk_sent_; }
  // Chat with tools: the text is split into content and tool calls in
  // `format`'s words (ToolCallStream); the calls go out as OpenAI's
  // tool_calls, and a choice that made any ends with "tool_calls".
  // `one_call`: a reply's first call only (parallel_tool_calls false).
  void parse_tool_calls(ToolFormat format, std::vector<ToolFunction> tools, std::string id_base, bool one_call = false);
  // A re-run or a migration: what arrived from the old attempt and was not
  // delivered is dropped; the next attempt's token i is this choice's token
  // next_index() + i (a migrated attempt goes on from the tokens delivered).
  void restart();

 private:
  // Text that is out of the TextStream: through the tool-call split, if any, then send().
  void deliver(const std::string& text, const Response& resp, const std::string& model);
  // Sends (streaming) or keeps (not) `text` and `calls` with the logprobs in shown_.
  void send(const std::string& text, std::vector<ToolCall> calls, const Response& resp, const std::string& model);
  ShownToken shown_token(TokenId id, const LogprobEntry* logprob) const;

  const Tokenizer* tok_;
  ChoiceFormat format_;
  TextStream text_;
  std::string echo_text_;
  bool one_call_ = false;           // parse_tool_calls
  std::string text_out_;           // non-streaming: the whole answer
  std::vector<ShownToken> shown_;  // logprobs of tokens not yet sent (streaming) or of all (not streaming)
  int64_t chars_shown_ = 0;        // characters of the logprob tokens already sent (text_offset)
  std::vector<LogprobEntry> prompt_logprobs_;  // echo with logprobs, from token 0's event
  bool first_chunk_sent_ = false;
  int32_t next_index_ = 0;
  int32_t attempt_base_ = 0;  // the current attempt's token 0 is this choice's token attempt_base_
  std::map<int32_t, PendingToken> pending_;  // out-of-order tokens
  std::optional<ToolCallStream> tools_;      // chat with tools: splits content from calls
  std::vector<ToolCall> calls_;              // non-streaming: the calls made
  int32_t calls_sent_ = 0;                   // streaming: the calls sent
};

}  // namespace pd::router
