// The OpenAI-compatible API surface: request parsing and validation, and the
// exact JSON shapes of responses, stream chunks and errors. No I/O: the HTTP
// server and the router's dispatch use these as pure functions, and every
// function here may be called from any thread.
//
// Supported endpoints: POST /v1/completions and POST /v1/chat/completions, one
// choice (n = 1), no logprobs, no tools. Anything a client asks for that is not
// served is refused with a 400 that names the field, never silently ignored; a
// short list of harmless OpenAI fields (user, metadata, store, ...) is accepted
// and ignored.
#pragma once

#include <cstddef>
#include <cstdint>
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

// A validated request. Sampling fields absent from the body take the
// RequestDefaults given to parse_request (no penalties); an absent seed is
// `seed_given` = false (the router then draws a fresh one).
struct ApiRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string model;                  // as given; "" when the field is absent or null (use the served model)
  std::string prompt;                 // completions only
  std::vector<ChatMessage> messages;  // chat only; role is system/user/assistant ("developer" maps to system);
                                      // content parts of type "text" are joined with "\n"
  SamplingParams sampling;            // passes SamplingParams::validate()
  bool max_tokens_given = false;      // false: sampling.max_tokens holds SamplingParams' default; the caller
                                      // fills it from the context left. Given values are clamped to INT32_MAX.
  std::vector<std::string> stop;      // 0..4 non-empty stop strings
  bool stream = false;
  bool include_usage = false;         // stream_options.include_usage (stream_options needs stream = true)
  bool echo = false;                  // always false: echo = true is refused
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
// max_tokens >= 1; integer fields must also fit their type: max_tokens and top_k
// in int64, seed in [-2^63, 2^64 - 1]), an unsupported feature ("<field> is not supported": n > 1,
// best_of, logprobs, top_logprobs, logit_bias, tools, functions, tool_choice,
// function_call, response_format other than text, suffix, echo = true,
// token-id prompts, batched prompts), or an unknown field ("unknown field: X").
// JSON null counts as absent for every optional field. Values and keys quoted in
// messages (and keys in `param`) are cut to kMaxShownChars. Integral floats (5.0)
// count as integers.
ApiResult<ApiRequest> parse_request(Endpoint ep, std::string_view body, const RequestDefaults& defaults = {});

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
};

// "cmpl-<n>" or "chatcmpl-<n>".
std::string make_response_id(Endpoint ep, uint64_t n);

// The non-streaming answer: a text_completion or a chat.completion with one
// choice and usage (total_tokens = prompt + completion).
std::string completion_body(Endpoint ep, const std::string& id, const std::string& model, int64_t created,
                            const std::string& text, const std::string& finish_reason, Usage usage);

// One SSE data payload (without "data: "). finish_reason: nullptr = JSON null.
// Chat: `first` adds delta.role = "assistant"; delta.content is always present.
std::string stream_chunk(Endpoint ep, const std::string& id, const std::string& model, int64_t created,
                         const std::string& delta_text, const std::string* finish_reason, bool first);

// The last chunk of a stream with stream_options.include_usage: "choices": [] and usage.
std::string usage_chunk(Endpoint ep, const std::string& id, const std::string& model, int64_t created, Usage usage);

// GET /v1/models: {"object":"list","data":[{"id":model,"object":"model","created","owned_by":"pdcluster"}]}
std::string models_body(const std::string& model, int64_t created);

}  // namespace pd::router
