// The OpenAI-compatible API surface: request parsing and validation, and the
// exact JSON shapes of responses, stream chunks and errors. No I/O: the HTTP
// server and the router's dispatch use these as pure functions, and every
// function here may be called from any thread.
//
// Supported endpoints: POST /v1/completions (several prompts, token-id prompts,
// echo, logprobs) and POST /v1/chat/completions (logprobs, top_logprobs), n
// choices per prompt, structured output (router/structured_output.h); POST /tokenize and /detokenize. Anything a
// client asks for that is not served is refused with a 400 that names the
// field, never silently ignored; a short list of harmless OpenAI fields (user,
// metadata, store, ...) is accepted and ignored.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "sampling/sampler.h"
#include "tokenizer/tokenizer.h"

namespace pd::router {

// An error as the client sees it: an HTTP status and OpenAI's error object.
struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // the offending field ("" = null)
  std::string code;   // "" = null
};

// A 400 invalid_request_error naming `param` ("" = null).
ApiError invalid_request(std::string param, std::string message);

// {"error":{"message":..,"type":..,"param":..|null,"code":..|null}}
std::string error_body(const ApiError& e);

enum class Endpoint { kCompletions, kChatCompletions };

// Sampling for fields a request omits (the router's come from cluster.json
// "sampling"; these are OpenAI's).
struct RequestDefaults {
  float temperature = 1.0f;
  float top_p = 1.0f;
  int32_t top_k = 0;
  float min_p = 0.0f;
};

// The most choices one request may ask for: prompts x n.
inline constexpr int64_t kMaxChoices = 128;
// Stop strings: at most this many (OpenAI's bound), each at most this many
// bytes. Text that may begin a stop string is held back, and each token's text
// is matched against every stop string: long ones would cost the link thread
// and delay the stream.
inline constexpr size_t kMaxStopStrings = 4;
inline constexpr size_t kMaxStopBytes = 256;
inline constexpr size_t kMaxStopTokenIds = 64;  // stop_token_ids entries

// One completions prompt: text to tokenize, or token ids taken as they are.
struct PromptInput {
  std::string text;
  std::vector<TokenId> ids;  // is_ids only: each in [0, 2^31); the router checks them against the vocabulary
  bool is_ids = false;
};

// Tool calls (router/tool_calls.h has the functions).
struct ToolFunction {
  std::string name;
  std::string description;  // "" when the request gave none
  // A JSON schema as JSON text (compact, keys in the client's order);
  // {"type":"object","properties":{}} when the request gave none.
  std::string parameters;
};

enum class ToolChoiceMode { kAuto, kNone, kRequired, kNamed };

struct ToolChoice {
  ToolChoiceMode mode = ToolChoiceMode::kAuto;
  std::string name;  // kNamed only: one of the tools
};

struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments;  // JSON text of an object (compact, keys in order)
};

// A chat message as the API sends it, with its tool parts: an assistant
// message may carry tool_calls (its content then null or absent, read as ""),
// a "tool" message carries tool_call_id and the tool's result as content.
struct ApiMessage {
  std::string role;  // system, user, assistant or tool
  std::string content;
  std::vector<ToolCall> tool_calls;  // assistant only
  std::string tool_call_id;          // tool only
};

// A validated request. Sampling fields absent from the body take the
// RequestDefaults given to parse_request (no penalties); an absent seed is
// `seed_given` = false (the router then draws a fresh one).
struct ApiRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string model;                  // as given; "" when the field is absent or null (use the served model)
  std::vector<PromptInput> prompts;   // completions only: one or more (a batch), in order
  bool prompt_batch = false;          // completions: `prompt` was an array of prompts (errors name prompt[i])
  bool add_generation_prompt = true;  // chat only: the template's assistant header ends the prompt (false:
                                      // the prompt ends with the last message, as vLLM's field)
  std::vector<ApiMessage> messages;   // chat only; role is system/user/assistant/tool ("developer" maps to
                                      // system); content parts of type "text" are joined with "\n"; an
                                      // assistant's tool_calls and a tool message's tool_call_id kept
  std::vector<ToolFunction> tools;    // chat only: `tools` (router/tool_calls.h)
  ToolChoice tool_choice;             // chat only: `tool_choice` (kNone without tools)
  bool parallel_tool_calls = true;    // chat only: false keeps a reply's first tool call only (as vLLM)
  SamplingParams sampling;            // passes SamplingParams::validate(). Logprobs asked for are in it:
                                      // logprobs (-1 = none, else the alternatives per token: completions
                                      // `logprobs`, chat `top_logprobs` with `logprobs: true`) and
                                      // prompt_logprobs (echo with logprobs)
  bool max_tokens_given = false;      // false: sampling.max_tokens holds SamplingParams' default; the caller
                                      // fills it from the context left. Given values are clamped to INT32_MAX.
  int64_t max_tokens_sent = 0;        // max_tokens_given: the value as sent, before that clamp
  std::string max_tokens_field = "max_tokens";  // the field it came in (chat: max_completion_tokens wins)
  std::vector<std::string> stop;      // 0..kMaxStopStrings non-empty stop strings of <= kMaxStopBytes bytes
  bool stream = false;
  bool include_usage = false;         // stream_options.include_usage (stream_options needs stream = true)
  bool echo = false;                  // completions: the prompt's text (and logprobs) lead each choice
  bool prompt_only = false;           // completions: max_tokens 0 (needs echo): the answer is the prompt
                                      // alone; sampling.max_tokens is then 1 and the router drops that token
  bool parse_special = true;          // completions: special-token text in a string prompt ("<|im_start|>")
                                      // becomes control tokens; chat content never does
  bool skip_special_tokens = true;    // control tokens generated print nothing in the text (vLLM's default);
                                      // logprobs still show them
  std::vector<TokenId> stop_token_ids;  // vLLM's: up to kMaxStopTokenIds token ids that end the choice
                                        // (finish_reason "stop"), printing nothing unless include_stop_str_in_output
  int32_t min_tokens = 0;             // vLLM's: EOS, stop tokens and stop strings wait this many tokens; at most
                                      // max_tokens (checked once max_tokens is known: fit_context)
  bool include_stop_str_in_output = false;  // vLLM's: a matched stop string or stop token stays in the text
  int32_t n = 1;                      // choices per prompt, in [1, kMaxChoices]; prompts x n <= kMaxChoices
  bool seed_given = false;            // false: sampling.seed is 0 and the caller picks one
};

// A value or an ApiError (a small expected<T, ApiError>).
template <typename T>
class ApiResult {
 public:
  ApiResult(T value) : v_(std::move(value)) {}       // NOLINT: implicit by design
  ApiResult(ApiError error) : v_(std::move(error)) {}  // NOLINT: implicit by design
  bool is_ok() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return is_ok(); }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  const ApiError& error() const { return std::get<ApiError>(v_); }  // requires !is_ok()
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, ApiError> v_;
};

// Limits on what parse_request accepts and shows (each one a 400, never a crash).
// The deepest nesting of arrays and objects in a request body; the body's
// brackets are counted before it is parsed, so no deeper body reaches the parser.
inline constexpr int kMaxJsonDepth = 64;
// The most characters of a client's value (or key) quoted in an error message;
// longer ones are cut and end in "...".
inline constexpr size_t kMaxShownChars = 100;

// `text` (a client's string: a model name, a path) as quoted in an error
// message: at most kMaxShownChars bytes, cut at a UTF-8 character boundary and
// ending in "..." when cut.
std::string shown_text(std::string_view text);

// Parses and validates the JSON body of a request to `ep`. Every failure is a
// 400 invalid_request_error whose message and `param` name the field at fault:
// invalid JSON, nesting deeper than kMaxJsonDepth (param null), a number beyond
// the range of a double (1e400; param = the path to it, e.g. "temperature" or
// "messages[0].content"), a body that is not an object, a missing required field
// (prompt / messages), a wrong type, a value out of range (temperature [0, 2],
// top_p (0, 1], top_k -1, 0 or >= 1, min_p [0, 1], penalties [-2, 2],
// max_tokens >= 1 (completions: >= 0, 0 only with echo), n in [1, kMaxChoices];
// integer fields must also fit their type: max_tokens and top_k in int64, seed
// in [-2^63, 2^64 - 1]), a malformed prompt (param "prompt", the message naming
// the element: "prompt[1][2] must be a token id"), more than kMaxChoices
// choices, an unsupported feature ("<field> is not supported": best_of,
// completions top_logprobs, tools, functions, tool_choice,
// function_call, suffix, chat echo = true), a response_format or other output
// constraint that router/structured_output.h refuses,
// a `stop` of more than kMaxStopStrings strings or one longer than
// kMaxStopBytes bytes, a `logit_bias` that is not an object of token id strings
// to numbers in [-100, 100] (at most kMaxLogitBias of them),
// or an unknown field ("unknown field: X"). Completions `logprobs` is an
// integer in [0, kMaxLogprobs] (false = none); chat `logprobs` a boolean and
// `top_logprobs` an integer in [0, kMaxLogprobs] that needs logprobs: true.
// JSON null counts as absent for every optional field. Values and keys quoted in
// messages (and keys in `param`) are cut to kMaxShownChars. Integral floats (5.0)
// count as integers.
ApiResult<ApiRequest> parse_request(Endpoint ep, std::string_view body, const RequestDefaults& defaults = {});

// 400 naming logit_bias when one of its token ids is outside [0, vocab).
std::optional<ApiError> check_logit_bias(const SamplingParams& s, int32_t vocab);
// 400 naming stop_token_ids[i] for an id outside the vocabulary [0, vocab).
std::optional<ApiError> check_stop_token_ids(const ApiRequest& api, int32_t vocab);

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  // Of prompt_tokens, those whose KV came from a prefix cache (OpenAI's
  // usage.prompt_tokens_details.cached_tokens).
  int64_t cached_tokens = 0;
};

// "cmpl-<nonce>-<n>" or "chatcmpl-<nonce>-<n>": n the router's request id
// (its logs' number), nonce 16 hex digits drawn once per router process
// (response_id_nonce), so that ids do not repeat across restarts.
std::string make_response_id(Endpoint ep, uint64_t n);
const std::string& response_id_nonce();

// A token as a response's logprobs show it.
struct ShownToken {
  std::string text;              // the token's bytes (a token may hold part of a UTF-8 character)
  std::optional<float> logprob;  // none: a prompt's first token (nothing precedes it)
  std::vector<std::pair<std::string, float>> top;  // the most likely alternatives, most likely first
  // Whether the token's text is part of the choice's text: a control token
  // skipped by skip_special_tokens or a hidden stop token is shown in the
  // logprobs but prints nothing, and text_offset does not count it.
  bool in_text = true;
};

// One choice of an answer, or its part in one stream chunk.
struct ChoiceOut {
  int32_t index = 0;
  std::string text;
  std::optional<std::string> finish_reason;  // none = JSON null
  bool with_logprobs = false;                // false: "logprobs": null
  std::vector<ShownToken> logprobs;          // the tokens behind `text`, in order
  int64_t text_offset = 0;                   // completions: the choice's characters before logprobs[0]
  // Chat with tools: the calls the model made (the whole answer's, or those
  // completed in this stream chunk), and in a stream the index of the first
  // of them among the choice's calls.
  std::vector<ToolCall> tool_calls;
  int32_t tool_call_index = 0;
};
// Characters of a token's bytes as text_offset counts them: each character at
// the byte that starts it (so one split across tokens counts once, at its first).
int64_t text_chars(std::string_view bytes);

// Logprob values as JSON shows them: -inf (a token the model gives no mass) as
// -9999.0, as vLLM does, since JSON has no infinity.
//
// Completions logprobs: {"tokens", "token_logprobs", "top_logprobs" (one
// {token: logprob} object per token, holding the alternatives and the token
// itself, as vLLM; null for a prompt's first token), "text_offset" (characters,
// counting each one at the token holding its first byte)}. Chat logprobs:
// {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
// "logprob", "bytes"}]}], "refusal": null}.

// The non-streaming answer: a text_completion or a chat.completion with
// `choices` (in index order) and usage (total_tokens = prompt + completion).
std::string completion_body(Endpoint ep, const std::string& id, const std::string& model, int64_t created,
                            const std::vector<ChoiceOut>& choices, Usage usage);

// One SSE data payload (without "data: ") carrying one choice's delta.
// Chat: `first` adds delta.role = "assistant"; delta.content is always present.
std::string stream_chunk(Endpoint ep, const std::string& id, const std::string& model, int64_t created,
                         const ChoiceOut& choice, bool first);

// The last chunk of a stream with stream_options.include_usage: "choices": [] and usage.
std::string usage_chunk(Endpoint ep, const std::string& id, const std::string& model, int64_t created, Usage usage);

// GET /v1/models: {"object":"list","data":[{"id":model,"object":"model","created","owned_by":"pdcluster"}]}
std::string models_body(const std::string& model, int64_t created);
// GET /v1/models/{id} of the served model: the same object as in that list.
std::string model_body(const std::string& model, int64_t created);

// POST /tokenize: {"prompt": str, "add_special_tokens": bool (true), "parse_special": bool (true)}
// or {"messages": [...], "add_generation_prompt": bool (true), "add_special_tokens": bool (true),
// "tools": [...], "tool_choice": ...};
// "model" optional. add_special_tokens: prepend BOS where the model's tokenizer asks for one, as
// the completion endpoints do, so the tokens are what they would feed the model.
struct TokenizeRequest {
  std::string model;
  bool chat = false;
  std::string prompt;                 // !chat
  std::vector<ApiMessage> messages;   // chat
  bool add_special_tokens = true;
  bool parse_special = true;          // !chat
  bool add_generation_prompt = true;  // chat
  std::vector<ToolFunction> tools;    // chat: "tools" and "tool_choice", rendered as the chat endpoint does
  ToolChoice tool_choice{ToolChoiceMode::kNone, ""};
};
ApiResult<TokenizeRequest> parse_tokenize(std::string_view body);
// {"tokens": [...], "count": n, "max_model_len": context}
std::string tokenize_body(const std::vector<TokenId>& tokens, int64_t max_model_len);

// POST /detokenize: {"tokens": [ids], "model"?}. Ids must be in [0, vocab).
struct DetokenizeRequest {
  std::string model;
  std::vector<TokenId> tokens;
};
ApiResult<DetokenizeRequest> parse_detokenize(std::string_view body, int32_t vocab);
// {"prompt": text}
std::string detokenize_body(const std::string& text);

}  // namespace pd::router
