// A choice's tokens in order, its text and logprobs (see choice_stream.h).
#include "router/choice_stream.h"

#include <utility>

namespace pd::router {

ChoiceStream::ChoiceStream(const Tokenizer& tok, ChoiceFormat format, std::vector<std::string> stops,
                           std::vector<TokenId> hidden, std::string echo_text)
    : tok_(&tok),
      format_(format),
      text_(tok, std::move(stops), std::move(hidden),
            TextOptions{format.skip_special, format.include_stop, format.min_tokens}),
      echo_text_(std::move(echo_text)) {}

void ChoiceStream::add(const proto::TokenEvent& ev) {
  const int32_t first = attempt_base_ + ev.first_index;
  if (first == 0 && !ev.prompt_logprobs.empty()) prompt_logprobs_ = ev.prompt_logprobs;
  const bool with_logprobs = format_.with_logprobs && ev.logprobs.size() == ev.tokens.size();
  for (size_t i = 0; i < ev.tokens.size(); ++i) {
    PendingToken& p = pending_[first + static_cast<int32_t>(i)];
    p.token = ev.tokens[i];
    p.finish = i + 1 == ev.tokens.size() ? ev.finish : proto::Finish::kNone;
    p.logprob.reset();
    if (with_logprobs) p.logprob.emplace(ev.logprobs[i]);
  }
}

std::optional<PendingToken> ChoiceStream::next() {
  if (pending_.empty() || pending_.begin()->first != next_index_) return std::nullopt;
  std::optional<PendingToken> p(std::move(pending_.extract(pending_.begin()).mapped()));
  ++next_index_;
  return p;
}

void ChoiceStream::restart() {
  pending_.clear();
  attempt_base_ = next_index_;
  if (next_index_ == 0) prompt_logprobs_.clear();  // not yet shown: the next attempt's token 0 brings them
}

bool ChoiceStream::push(const PendingToken& t, const Response& resp, const std::string& model) {
  if (format_.with_logprobs) {
    shown_.push_back(shown_token(t.token, t.logprob ? &*t.logprob : nullptr));
    shown_.back().in_text = text_.prints(t.token);
  }
  deliver(text_.push(t.token), resp, model);
  return text_.stopped();
}

void ChoiceStream::flush(const Response& resp, const std::string& model) {
  deliver(text_.finish(), resp, model);
  if (tools_) {
    ToolCallStream::Piece rest = tools_->finish();
    send(rest.content, std::move(rest.calls), resp, model);
  }
}

void ChoiceStream::parse_tool_calls(ToolFormat format, std::vector<ToolFunction> tools, std::string id_base,
                                    bool one_call) {
  tools_.emplace(format, std::move(tools), std::move(id_base));
  one_call_ = one_call;
}

void ChoiceStream::deliver(const std::string& text, const Response& resp, const std::string& model) {
  if (!tools_) return send(text, {}, resp, model);
  ToolCallStream::Piece piece = tools_->feed(text);
  send(piece.content, std::move(piece.calls), resp, model);
}

void ChoiceStream::send(const std::string& text, std::vector<ToolCall> calls, const Response& resp,
                        const std::string& model) {
  if (one_call_ && !calls.empty()) calls.resize(calls_sent_ > 0 || !calls_.empty() ? 0 : 1);
  if (!format_.stream) {
    text_out_ += text;
    for (ToolCall& t : calls) calls_.push_back(std::move(t));
    return;
  }
  const bool first = !first_chunk_sent_;
  if (text.empty() && calls.empty() && !(first && format_.chat)) return;
  ChoiceOut c;
  c.index = format_.index;
  c.text = text;
  c.tool_call_index = calls_sent_;
  calls_sent_ += static_cast<int32_t>(calls.size());
  c.tool_calls = std::move(calls);
  c.with_logprobs = format_.with_logprobs;
  if (!text.empty()) {  // logprobs go with text (a chat's empty role chunk carries none)
    c.text_offset = chars_shown_;
    for (const ShownToken& t : shown_) chars_shown_ += t.in_text ? text_chars(t.text) : 0;
    c.logprobs = std::move(shown_);
    shown_.clear();
  }
  resp.writer->send_event(stream_chunk(resp.endpoint, resp.id, model, resp.created, c, first));
  first_chunk_sent_ = true;
}

void ChoiceStream::deliver_echo(const std::vector<TokenId>& prompt, const Response& resp, const std::string& model) {
  if (format_.prompt_logprobs) {
    for (size_t i = 0; i < prompt.size(); ++i) {
      const bool have = i > 0 && i - 1 < prompt_logprobs_.size();
      shown_.push_back(shown_token(prompt[i], have ? &prompt_logprobs_[i - 1] : nullptr));
      if (i == 0) shown_.back().logprob.reset();  // nothing precedes the first token
    }
  }
  deliver(echo_text_, resp, model);
}

ShownToken ChoiceStream::shown_token(TokenId id, const LogprobEntry* logprob) const {
  ShownToken t;
  t.text = tok_->token_to_bytes(id);
  if (logprob == nullptr) return t;
  t.logprob = logprob->logprob;
  for (const TokenLogprob& alt : logprob->top) t.top.emplace_back(tok_->token_to_bytes(alt.id), alt.logprob);
  return t;
}

ChoiceOut ChoiceStream::finish(const std::string& finish_reason) {
  ChoiceOut c;
  c.index = format_.index;
  // A reply that called tools ends with "tool_calls" (a length cut stays "length").
  const bool called = calls_sent_ > 0 || !calls_.empty();
  c.finish_reason = called && finish_reason == "stop" ? "tool_calls" : finish_reason;
  c.tool_calls = std::move(calls_);
  c.tool_call_index = calls_sent_;
  c.with_logprobs = format_.with_logprobs;
  c.text_offset = chars_shown_;
  c.logprobs = std::move(shown_);
  shown_.clear();
  if (!format_.stream) c.text = std::move(text_out_);
  return c;
}

}  // namespace pd::router
