#include "router/openai_api.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "router/structured_output.h"
#include "router/tool_calls.h"

namespace pd::router {
namespace {

using json = nlohmann::json;
// Responses keep OpenAI's field order (id, object, created, model, choices, usage).
using ojson = nlohmann::ordered_json;

template <typename J>
std::string dump(const J& j) {
  return j.dump(-1, ' ', false, J::error_handler_t::replace);
}

ApiError bad_request(std::string param, std::string message) { return invalid_request(std::move(param), std::move(message)); }

ApiError unsupported(const std::string& field) { return bad_request(field, field + " is not supported"); }

// `s` cut to at most `max` bytes at a UTF-8 character boundary, "..." appended when cut.
std::string cut(std::string_view s, size_t max = kMaxShownChars) {
  if (s.size() <= max) return std::string(s);
  size_t n = max - 3;
  while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;  // not inside a character
  return std::string(s.substr(0, n)) + "...";
}

// A client's key as shown in messages and `param` (bounded).
std::string shown_key(std::string_view key) { return cut(key); }

// Appends a preview of `v` to `out`, stopping once out holds `budget` bytes.
// Every call appends at least one byte before recursing, so the recursion is
// at most `budget` deep and the work is O(budget) whatever the size of `v`.
void preview(const json& v, std::string& out, size_t budget) {
  if (out.size() >= budget) return;
  if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    // Quote at most budget bytes of it; dump() escapes (and replaces invalid UTF-8).
    out += dump(json(s.substr(0, std::min(s.size(), budget))));
  } else if (v.is_array()) {
    out += '[';
    bool first = true;
    for (const json& e : v) {
      if (out.size() >= budget) return;
      if (!first) out += ',';
      first = false;
      preview(e, out, budget);
    }
    out += ']';
  } else if (v.is_object()) {
    out += '{';
    bool first = true;
    for (const auto& [k, e] : v.items()) {
      if (out.size() >= budget) return;
      if (!first) out += ',';
      first = false;
      out += dump(json(k.substr(0, std::min(k.size(), budget))));
      out += ':';
      preview(e, out, budget);
    }
    out += '}';
  } else {
    out += dump(v);  // a number, a boolean or null: short
  }
}

// A JSON value as the client wrote it, for "got ..." in messages: at most
// kMaxShownChars bytes, never a full dump of an arbitrarily large value.
std::string shown(const json& v) {
  std::string s;
  preview(v, s, kMaxShownChars + 1);
  return cut(s);
}

// The field's value, or nullptr when it is absent or null (null means "default").
const json* field(const json& obj, const char* key) {
  const auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

// An integer read from JSON: a JSON integer, or a float with an integral value (5.0).
struct IntRead {
  enum Kind { kOk, kNotInteger, kOutOfRange } kind = kNotInteger;
  int64_t value = 0;  // kOk only
};

// -2^63 and 2^63 as doubles (both exact): an integral double d converts to
// int64 without UB iff kInt64Lo <= d < kInt64End.
constexpr double kInt64Lo = -9223372036854775808.0;
constexpr double kInt64End = 9223372036854775808.0;
constexpr double kUint64End = 18446744073709551616.0;  // 2^64

// `v` as an int64: kNotInteger for non-numbers and fractions, kOutOfRange for
// integers beyond int64 (a uint64 above 2^63 - 1, or a float such as 1e300).
IntRead as_int64(const json& v) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return {IntRead::kOutOfRange, 0};
    return {IntRead::kOk, static_cast<int64_t>(u)};
  }
  if (v.is_number_integer()) return {IntRead::kOk, v.get<int64_t>()};
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (!std::isfinite(d) || std::trunc(d) != d) return {IntRead::kNotInteger, 0};
    if (d < kInt64Lo || d >= kInt64End) return {IntRead::kOutOfRange, 0};
    return {IntRead::kOk, static_cast<int64_t>(d)};
  }
  return {IntRead::kNotInteger, 0};
}

// Reads an optional number into `out`, checking lo <= v <= hi (lo < v when
// lo_open) on the double. The float stored is the nearest one, except that a
// value just above an open bound that rounds onto it (top_p 1e-320 -> 0) gets
// the next float inside, so what the sampler gets is always in range.
std::optional<ApiError> read_float(const json& obj, const char* key, double lo, double hi, bool lo_open,
                                   float& out) {
  const json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) return bad_request(key, std::string(key) + " must be a number, got " + shown(*v));
  const double d = v->get<double>();
  auto in_range = [&](double x) { return std::isfinite(x) && (lo_open ? x > lo : x >= lo) && x <= hi; };
  // Only convert once d is known to be in range: a double beyond FLT_MAX converts to float with UB.
  if (!in_range(d)) {
    char range[64];
    std::snprintf(range, sizeof(range), "%s%g, %g]", lo_open ? "(" : "[", lo, hi);
    return bad_request(key, std::string(key) + " must be in " + range + ", got " + shown(*v));
  }
  // lo and hi are small integers, exact as floats, so rounding never leaves [lo, hi].
  out = static_cast<float>(d);
  if (lo_open && out <= static_cast<float>(lo)) out = std::nextafter(static_cast<float>(lo), static_cast<float>(hi));
  return std::nullopt;
}

// Reads an optional integer into `out` (left empty when the field is absent or
// null). Values beyond int64 are refused as out of range, naming [lo, hi].
std::optional<ApiError> read_int(const json& obj, const char* key, int64_t lo, int64_t hi,
                                 std::optional<int64_t>& out) {
  const json* v = field(obj, key);
  if (!v) return std::nullopt;
  const IntRead i = as_int64(*v);
  if (i.kind == IntRead::kNotInteger) {
    return bad_request(key, std::string(key) + " must be an integer, got " + shown(*v));
  }
  if (i.kind == IntRead::kOutOfRange || i.value < lo || i.value > hi) {
    return bad_request(key, std::string(key) + " must be an integer in [" + std::to_string(lo) + ", " +
                                std::to_string(hi) + "], got " + shown(*v));
  }
  out = i.value;
  return std::nullopt;
}

std::optional<ApiError> read_bool(const json& obj, const char* key, bool& out) {
  const json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) return bad_request(key, std::string(key) + " must be a boolean, got " + shown(*v));
  out = v->get<bool>();
  return std::nullopt;
}

// What parse_request does with a top-level field.
enum class FieldKind {
  kHandled,      // read below
  kIgnored,      // harmless OpenAI metadata: accepted, no effect
  kUnsupported,  // refused unless its value asks for nothing (null, false, empty, the default)
};

// Fields handled for both endpoints.
constexpr const char* kCommonFields[] = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
    "frequency_penalty", "ignore_eos", "stop", "stream", "stream_options", "n", "echo", "logit_bias", "speculative",
    "skip_special_tokens", "repetition_penalty", "min_tokens", "stop_token_ids", "include_stop_str_in_output"};
constexpr const char* kIgnoredFields[] = {"user", "parallel_tool_calls", "service_tier", "metadata", "store"};
constexpr const char* kUnsupportedFields[] = {"best_of",       "top_logprobs", "tools",
                                              "functions",     "tool_choice",  "function_call",
                                              "suffix",        "continue_final_message", "chat_template_kwargs"};

std::optional<FieldKind> classify(Endpoint ep, const std::string& key) {
  for (const char* f : kCommonFields) {
    if (key == f) return FieldKind::kHandled;
  }
  if (key == "logprobs" || is_structured_output_field(key)) return FieldKind::kHandled;
  if (ep == Endpoint::kCompletions && (key == "prompt" || key == "parse_special")) return FieldKind::kHandled;
  if (ep == Endpoint::kChatCompletions && (key == "messages" || key == "max_completion_tokens" ||
                                           key == "top_logprobs" || key == "tools" || key == "tool_choice" ||
                                           key == "add_generation_prompt" || key == "parallel_tool_calls")) {
    return FieldKind::kHandled;
  }
  for (const char* f : kIgnoredFields) {
    if (key == f) return FieldKind::kIgnored;
  }
  for (const char* f : kUnsupportedFields) {
    if (key == f) return FieldKind::kUnsupported;
  }
  return std::nullopt;
}

// Whether an unsupported field's value asks for nothing beyond the default, so
// it can be accepted (clients often send best_of: 1, logprobs: false, tools: []).
bool asks_for_nothing(const std::string& key, const json& v) {
  if (v.is_null()) return true;
  if (key == "best_of" || key == "top_logprobs") {
    const IntRead i = as_int64(v);
    return i.kind == IntRead::kOk && i.value == (key == "best_of" ? 1 : 0);
  }
  if (key == "tools" || key == "functions") return v.is_array() && v.empty();
  if (key == "tool_choice" || key == "function_call") return v.is_string() && v.get<std::string>() == "none";
  if (key == "suffix") return v.is_string() && v.get<std::string>().empty();
  if (key == "continue_final_message") return v.is_boolean() && !v.get<bool>();
  if (key == "chat_template_kwargs") return v.is_object() && v.empty();
  return false;
}

// A token id of a token-id prompt: an integer in [0, 2^31) (the router checks the vocabulary).
std::optional<ApiError> read_token_id(const json& v, const std::string& where, TokenId& out) {
  const IntRead i = as_int64(v);
  if (i.kind != IntRead::kOk || i.value < 0 || i.value > std::numeric_limits<int32_t>::max()) {
    return bad_request(where, where + " must be a token id (an integer >= 0), got " + shown(v));
  }
  out = static_cast<TokenId>(i.value);
  return std::nullopt;
}

std::optional<ApiError> read_token_ids(const json& v, const std::string& where, PromptInput& out) {
  if (v.empty()) return bad_request(where, where + " must not be an empty array");
  out.is_ids = true;
  out.ids.resize(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    if (auto e = read_token_id(v[i], where + "[" + std::to_string(i) + "]", out.ids[i])) return e;
  }
  return std::nullopt;
}

// prompt: a string, an array of strings, an array of token ids, or an array of
// token-id arrays (each element one prompt of a batch).
std::optional<ApiError> parse_prompt(const json& obj, ApiRequest& r) {
  const json* v = field(obj, "prompt");
  if (!v) return bad_request("prompt", "prompt is required");
  if (v->is_string()) {
    r.prompts.push_back({v->get<std::string>(), {}, false});
    return std::nullopt;
  }
  constexpr const char* kForms =
      "prompt must be a string, an array of strings, an array of token ids or an array of token-id arrays";
  if (!v->is_array()) return bad_request("prompt", kForms);
  if (v->empty()) return bad_request("prompt", "prompt must not be an empty array");
  if (v->size() > static_cast<size_t>(kMaxChoices)) {
    return bad_request("prompt", "prompt holds " + std::to_string(v->size()) + " prompts; at most " +
                                     std::to_string(kMaxChoices) + " per request");
  }
  if ((*v)[0].is_number()) {  // one token-id prompt
    PromptInput p;
    if (auto e = read_token_ids(*v, "prompt", p)) return e;
    r.prompts.push_back(std::move(p));
    return std::nullopt;
  }
  const bool strings = (*v)[0].is_string();
  r.prompt_batch = true;
  for (size_t i = 0; i < v->size(); ++i) {
    const json& e = (*v)[i];
    const std::string where = "prompt[" + std::to_string(i) + "]";
    PromptInput p;
    if (strings && e.is_string()) {
      p.text = e.get<std::string>();
    } else if (!strings && e.is_array()) {
      if (auto err = read_token_ids(e, where, p)) return err;
    } else {
      return bad_request("prompt", std::string(kForms) + " (not mixed); " + where + " is " + shown(e));
    }
    r.prompts.push_back(std::move(p));
  }
  return std::nullopt;
}

// content: a string, or an array of {"type":"text","text":...} parts joined with "\n";
// an assistant message's parts may also be {"type":"refusal","refusal":...}
// (a refused turn replayed; its text, as vLLM reads it).
std::optional<ApiError> parse_content(const json& v, const std::string& where, bool assistant, std::string& out) {
  if (v.is_string()) {
    out = v.get<std::string>();
    return std::nullopt;
  }
  if (!v.is_array()) return bad_request(where, where + " must be a string or an array of text parts");
  out.clear();
  for (size_t j = 0; j < v.size(); ++j) {
    const std::string part = where + "[" + std::to_string(j) + "]";
    const json& p = v[j];
    if (!p.is_object()) return bad_request(part, part + " must be an object");
    const json* type = field(p, "type");
    if (!type || !type->is_string()) return bad_request(part + ".type", part + ".type must be a string");
    const bool refusal = assistant && *type == "refusal";
    if (*type != "text" && !refusal) {
      return bad_request(part + ".type", part + ".type " + shown(*type) + " is not supported (only \"text\"" +
                                             (assistant ? " and \"refusal\")" : ")"));
    }
    const std::string key = refusal ? "refusal" : "text";
    const json* text = field(p, key.c_str());
    if (!text || !text->is_string()) return bad_request(part + "." + key, part + "." + key + " must be a string");
    if (j > 0) out += "\n";
    out += text->get<std::string>();
  }
  return std::nullopt;
}

// An assistant message's tool_calls, a tool message's tool_call_id.
std::optional<ApiError> parse_tool_parts(const json& m, const std::string& where, ApiMessage& msg) {
  const json* calls = field(m, "tool_calls");
  if (calls && msg.role != "assistant" && !(calls->is_array() && calls->empty()))
    return bad_request(where + ".tool_calls", where + ".tool_calls is only for assistant messages");
  if (msg.role == "assistant") {
    if (auto e = parse_message_tool_calls(m, where, msg.tool_calls)) return e;
  }
  const json* id = field(m, "tool_call_id");
  if (msg.role == "tool") {
    if (!id || !id->is_string()) return bad_request(where + ".tool_call_id", where + ".tool_call_id must be a string");
    msg.tool_call_id = id->get<std::string>();
  } else if (id) {
    return bad_request(where + ".tool_call_id", where + ".tool_call_id is only for tool messages");
  }
  return std::nullopt;
}

std::optional<ApiError> parse_messages(const json& obj, ApiRequest& r) {
  const json* v = field(obj, "messages");
  if (!v) return bad_request("messages", "messages is required");
  if (!v->is_array()) return bad_request("messages", "messages must be an array");
  if (v->empty()) return bad_request("messages", "messages must not be empty");
  for (size_t i = 0; i < v->size(); ++i) {
    const std::string where = "messages[" + std::to_string(i) + "]";
    const json& m = (*v)[i];
    if (!m.is_object()) return bad_request(where, where + " must be an object");
    if (const json* t = field(m, "function_call"); t && !(t->is_array() && t->empty()))
      return unsupported(where + ".function_call");
    ApiMessage msg;
    const json* role = field(m, "role");
    if (!role) return bad_request(where + ".role", where + ".role is required");
    if (!role->is_string()) return bad_request(where + ".role", where + ".role must be a string");
    msg.role = role->get<std::string>();
    if (msg.role == "developer") msg.role = "system";  // OpenAI's newer name for the system role
    if (msg.role != "system" && msg.role != "user" && msg.role != "assistant" && msg.role != "tool") {
      return bad_request(where + ".role", where + ".role must be \"system\", \"user\", \"assistant\" or \"tool\", got " +
                                              shown(*role));
    }
    if (auto e = parse_tool_parts(m, where, msg)) return e;
    const json* content = field(m, "content");
    const bool may_omit = msg.role == "assistant" && !msg.tool_calls.empty();  // a reply that only called tools
    if (!content && !may_omit) return bad_request(where + ".content", where + ".content is required");
    if (content) {
      if (auto e = parse_content(*content, where + ".content", msg.role == "assistant", msg.content)) return e;
    }
    r.messages.push_back(std::move(msg));
  }
  return read_bool(obj, "add_generation_prompt", r.add_generation_prompt);
}

// One stop string: non-empty, at most kMaxStopBytes bytes.
std::optional<ApiError> add_stop(const std::string& s, ApiRequest& r) {
  if (s.empty()) return bad_request("stop", "stop strings must not be empty");
  if (s.size() > kMaxStopBytes) {
    return bad_request("stop", "stop strings may be at most " + std::to_string(kMaxStopBytes) + " bytes long, got one of " +
                                   std::to_string(s.size()));
  }
  r.stop.push_back(s);
  return std::nullopt;
}

std::optional<ApiError> parse_stop(const json& obj, ApiRequest& r) {
  // The text the stop strings are matched on: with or without control tokens.
  if (auto e = read_bool(obj, "skip_special_tokens", r.skip_special_tokens)) return e;
  const json* v = field(obj, "stop");
  if (!v) return std::nullopt;
  if (v->is_string()) return add_stop(v->get<std::string>(), r);
  if (!v->is_array()) return bad_request("stop", "stop must be a string or an array of strings");
  if (v->size() > kMaxStopStrings) {
    return bad_request("stop", "stop may hold at most " + std::to_string(kMaxStopStrings) + " strings, got " +
                                   std::to_string(v->size()));
  }
  for (const json& s : *v) {
    if (!s.is_string()) return bad_request("stop", "stop array elements must be strings, got " + shown(s));
    if (auto e = add_stop(s.get<std::string>(), r)) return e;
  }
  return std::nullopt;
}

std::optional<ApiError> parse_stream(const json& obj, ApiRequest& r) {
  if (auto e = read_bool(obj, "stream", r.stream)) return e;
  const json* opts = field(obj, "stream_options");
  if (!opts) return std::nullopt;
  if (!opts->is_object()) return bad_request("stream_options", "stream_options must be an object");
  if (!r.stream) return bad_request("stream_options", "stream_options is only allowed when stream is true");
  for (const auto& [key, value] : opts->items()) {
    if (key != "include_usage") {
      const std::string where = "stream_options." + shown_key(key);
      return bad_request(where, "unknown field: " + where);
    }
  }
  if (const json* u = field(*opts, "include_usage")) {
    if (!u->is_boolean()) {
      return bad_request("stream_options.include_usage", "stream_options.include_usage must be a boolean");
    }
    r.include_usage = u->get<bool>();
  }
  return std::nullopt;
}

// The sampler's knobs (temperature, top_p, min_p, penalties, ignore_eos,
// top_k) over the configured defaults.
std::optional<ApiError> parse_sampler_knobs(const json& obj, SamplingParams& s, const RequestDefaults& d) {
  s.temperature = d.temperature;  // OpenAI's 1 unless configured; SamplingParams' own default is greedy
  s.top_p = d.top_p;
  s.top_k = d.top_k < 0 ? 0 : d.top_k;
  s.min_p = d.min_p;
  if (auto e = read_float(obj, "temperature", 0.0, 2.0, false, s.temperature)) return e;
  if (auto e = read_float(obj, "top_p", 0.0, 1.0, true, s.top_p)) return e;
  if (auto e = read_float(obj, "min_p", 0.0, 1.0, false, s.min_p)) return e;
  if (auto e = read_float(obj, "presence_penalty", -2.0, 2.0, false, s.presence_penalty)) return e;
  if (auto e = read_float(obj, "frequency_penalty", -2.0, 2.0, false, s.frequency_penalty)) return e;
  if (auto e = read_bool(obj, "ignore_eos", s.ignore_eos)) return e;
  if (auto e = read_bool(obj, "speculative", s.speculate)) return e;

  if (const json* v = field(obj, "top_k"); v && as_int64(*v).kind == IntRead::kOk && as_int64(*v).value < -1) {
    return bad_request("top_k", "top_k must be -1 or 0 (disabled) or >= 1, got " + shown(*v));
  }
  std::optional<int64_t> top_k;
  if (auto e = read_int(obj, "top_k", -1, std::numeric_limits<int64_t>::max(), top_k)) return e;
  if (top_k) s.top_k = static_cast<int32_t>(std::clamp<int64_t>(*top_k, 0, std::numeric_limits<int32_t>::max()));
  return std::nullopt;
}

// seed: any 64-bit integer, signed or not, in [-2^63, 2^64 - 1]; stored as its
// two's-complement bits. An integral float is converted only inside that range.
std::optional<ApiError> parse_seed(const json& obj, ApiRequest& r) {
  const json* seed = field(obj, "seed");
  if (!seed) return std::nullopt;
  r.seed_given = true;
  const IntRead i = as_int64(*seed);
  const double d = seed->is_number_float() ? seed->get<double>() : 0.0;
  if (seed->is_number_unsigned()) {
    r.sampling.seed = seed->get<uint64_t>();
  } else if (i.kind == IntRead::kOk) {
    r.sampling.seed = static_cast<uint64_t>(i.value);
  } else if (i.kind == IntRead::kOutOfRange && d >= 0 && d < kUint64End) {
    r.sampling.seed = static_cast<uint64_t>(d);  // an integral float in [2^63, 2^64)
  } else if (i.kind == IntRead::kOutOfRange) {
    return bad_request("seed", "seed must be an integer in [-9223372036854775808, 18446744073709551615], got " +
                                   shown(*seed));
  } else {
    return bad_request("seed", "seed must be an integer, got " + shown(*seed));
  }
  return std::nullopt;
}

// max_tokens (chat: max_completion_tokens wins when both are given).
std::optional<ApiError> parse_max_tokens(Endpoint ep, const json& obj, ApiRequest& r) {
  const char* max_key = "max_tokens";
  if (ep == Endpoint::kChatCompletions && field(obj, "max_completion_tokens")) max_key = "max_completion_tokens";
  // Completions may ask for 0 tokens (with echo: the prompt's logprobs alone).
  const int64_t min_tokens = ep == Endpoint::kCompletions ? 0 : 1;
  std::optional<int64_t> max_tokens;
  for (const char* key : {"max_tokens", max_key}) {
    const json* v = field(obj, key);
    const IntRead i = v ? as_int64(*v) : IntRead{};
    const bool below = v && ((i.kind == IntRead::kOk && i.value < min_tokens) ||
                             (i.kind == IntRead::kOutOfRange && v->is_number_float() && v->get<double>() < 0));
    if (below) {
      return bad_request(key, std::string(key) + " must be >= " + std::to_string(min_tokens) + ", got " + shown(*v));
    }
    if (auto e = read_int(obj, key, min_tokens, std::numeric_limits<int64_t>::max(), max_tokens)) return e;
  }
  if (max_tokens && *max_tokens == 0) {
    r.prompt_only = true;  // one token is computed and dropped: the cluster always samples token 1
    max_tokens = 1;
  }
  if (max_tokens) {
    r.max_tokens_sent = *max_tokens;
    r.max_tokens_field = max_key;
    // Larger than any context: the caller clamps to the context left anyway.
    r.sampling.max_tokens = static_cast<int32_t>(std::min<int64_t>(*max_tokens, std::numeric_limits<int32_t>::max()));
    r.max_tokens_given = true;
  }
  return std::nullopt;
}

// logit_bias: {"<token id>": bias in [-100, 100], ...} (OpenAI's shape; the
// ids are checked against the vocabulary once the model is known).
std::optional<ApiError> parse_logit_bias(const json& obj, SamplingParams& s) {
  const json* v = field(obj, "logit_bias");
  if (!v || v->is_null()) return std::nullopt;
  if (!v->is_object()) return bad_request("logit_bias", "logit_bias must be an object of token id -> bias, got " + shown(*v));
  if (v->size() > kMaxLogitBias) {
    return bad_request("logit_bias", "logit_bias may hold at most " + std::to_string(kMaxLogitBias) + " tokens, got " +
                                         std::to_string(v->size()));
  }
  for (const auto& [key, bias] : v->items()) {
    TokenId id = 0;
    const char* end = key.data() + key.size();
    const auto [ptr, ec] = std::from_chars(key.data(), end, id);
    if (key.empty() || ec != std::errc() || ptr != end || id < 0) {
      return bad_request("logit_bias", "logit_bias keys must be token ids (integers >= 0 as strings), got \"" +
                                           shown_key(key) + "\"");
    }
    if (!bias.is_number() || !(bias.get<double>() >= -100.0 && bias.get<double>() <= 100.0)) {
      return bad_request("logit_bias", "logit_bias[\"" + std::to_string(id) + "\"] must be a number in [-100, 100], got " +
                                           shown(bias));
    }
    s.logit_bias.emplace_back(id, bias.get<float>());
  }
  std::sort(s.logit_bias.begin(), s.logit_bias.end());
  for (size_t i = 1; i < s.logit_bias.size(); ++i) {
    if (s.logit_bias[i].first == s.logit_bias[i - 1].first) {  // "7" and "07"
      return bad_request("logit_bias", "logit_bias names token " + std::to_string(s.logit_bias[i].first) + " twice");
    }
  }
  return std::nullopt;
}

}  // namespace

std::optional<ApiError> check_stop_token_ids(const ApiRequest& api, int32_t vocab) {
  for (size_t i = 0; i < api.stop_token_ids.size(); ++i) {
    if (api.stop_token_ids[i] >= vocab) {
      const std::string where = "stop_token_ids[" + std::to_string(i) + "]";
      return bad_request(where, where + " is token " + std::to_string(api.stop_token_ids[i]) +
                                    ", outside the vocabulary [0, " + std::to_string(vocab) + ")");
    }
  }
  return std::nullopt;
}

std::optional<ApiError> check_logit_bias(const SamplingParams& s, int32_t vocab) {
  for (const auto& [id, bias] : s.logit_bias) {
    if (id >= vocab) {
      return bad_request("logit_bias", "logit_bias names token " + std::to_string(id) + ", outside the vocabulary [0, " +
                                           std::to_string(vocab) + ")");
    }
  }
  return std::nullopt;
}

namespace {

// vLLM's sampling extras: repetition_penalty, min_tokens, stop_token_ids,
// include_stop_str_in_output (after max_tokens).
std::optional<ApiError> parse_vllm_extras(const json& obj, ApiRequest& r) {
  if (auto e = read_float(obj, "repetition_penalty", 0.0, 100.0, true, r.sampling.repetition_penalty)) return e;
  std::optional<int64_t> min_tokens;
  if (auto e = read_int(obj, "min_tokens", 0, std::numeric_limits<int32_t>::max(), min_tokens)) return e;
  if (min_tokens) r.min_tokens = static_cast<int32_t>(*min_tokens);
  if (r.max_tokens_given && r.min_tokens > r.max_tokens_sent) {
    return bad_request("min_tokens", "min_tokens " + std::to_string(r.min_tokens) + " is more than " +
                                         r.max_tokens_field + " " + std::to_string(r.max_tokens_sent));
  }
  if (auto e = read_bool(obj, "include_stop_str_in_output", r.include_stop_str_in_output)) return e;
  const json* v = field(obj, "stop_token_ids");
  if (!v) return std::nullopt;
  if (!v->is_array()) return bad_request("stop_token_ids", "stop_token_ids must be an array of token ids, got " + shown(*v));
  if (v->size() > kMaxStopTokenIds) {
    return bad_request("stop_token_ids", "stop_token_ids may hold at most " + std::to_string(kMaxStopTokenIds) +
                                             " ids, got " + std::to_string(v->size()));
  }
  for (size_t i = 0; i < v->size(); ++i) {
    const IntRead id = as_int64((*v)[i]);
    if (id.kind != IntRead::kOk || id.value < 0 || id.value > std::numeric_limits<int32_t>::max()) {
      const std::string where = "stop_token_ids[" + std::to_string(i) + "]";
      return bad_request(where, where + " must be a token id (an integer >= 0), got " + shown((*v)[i]));
    }
    r.stop_token_ids.push_back(static_cast<TokenId>(id.value));
  }
  return std::nullopt;
}

std::optional<ApiError> parse_sampling(Endpoint ep, const json& obj, ApiRequest& r, const RequestDefaults& d) {
  if (auto e = parse_sampler_knobs(obj, r.sampling, d)) return e;
  if (auto e = parse_logit_bias(obj, r.sampling)) return e;
  if (auto e = parse_seed(obj, r)) return e;
  if (auto e = parse_max_tokens(ep, obj, r)) return e;
  if (auto e = parse_vllm_extras(obj, r)) return e;
  std::optional<int64_t> n;
  if (auto e = read_int(obj, "n", 1, kMaxChoices, n)) return e;
  if (n) r.n = static_cast<int32_t>(*n);
  return std::nullopt;
}

// logprobs / top_logprobs / echo, after the prompt and sampling fields.
std::optional<ApiError> parse_logprobs(Endpoint ep, const json& obj, ApiRequest& r) {
  SamplingParams& s = r.sampling;
  const json* lp = field(obj, "logprobs");
  if (ep == Endpoint::kCompletions) {
    if (lp && !(lp->is_boolean() && !lp->get<bool>())) {  // false = none, as clients send it
      std::optional<int64_t> n;
      if (auto e = read_int(obj, "logprobs", 0, kMaxLogprobs, n)) return e;
      s.logprobs = static_cast<int32_t>(*n);
    }
    if (auto e = read_bool(obj, "echo", r.echo)) return e;
    if (r.prompt_only && !r.echo) return bad_request("max_tokens", "max_tokens 0 needs echo: true");
    s.prompt_logprobs = r.echo && s.logprobs >= 0;
    return read_bool(obj, "parse_special", r.parse_special);
  }
  bool want = false;
  if (auto e = read_bool(obj, "logprobs", want)) return e;
  std::optional<int64_t> top;
  if (auto e = read_int(obj, "top_logprobs", 0, kMaxLogprobs, top)) return e;
  if (top && *top > 0 && !want) return bad_request("top_logprobs", "top_logprobs needs logprobs: true");
  if (want) s.logprobs = static_cast<int32_t>(top.value_or(0));
  if (auto e = read_bool(obj, "echo", r.echo)) return e;
  if (r.echo) return unsupported("echo");
  return read_bool(obj, "parallel_tool_calls", r.parallel_tool_calls);
}

// The deepest nesting of arrays and objects in `body`, counting only brackets
// outside strings (escapes honoured). Linear, no recursion; stops counting once
// past `limit` (a body whose JSON is invalid may be over-counted, which only
// turns one 400 into another).
int json_depth(std::string_view body, int limit) {
  int depth = 0, deepest = 0;
  bool in_string = false;
  for (size_t i = 0; i < body.size(); ++i) {
    const char c = body[i];
    if (in_string) {
      if (c == '\\') ++i;  // the escaped character cannot end the string
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
      if (deepest > limit) break;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

// nlohmann's SAX interface building the DOM (as json::parse does) while
// tracking where it is, so that a number beyond double range (which nlohmann
// reports as a parse error, 406) is named by its path ("temperature",
// "messages[0].content"). Never throws for bad input: sax_parse returns false
// and error() says why.
class PathTrackingParser {
 public:
  explicit PathTrackingParser(json& root) : root_(root) {}

  bool null() { return add(nullptr); }
  bool boolean(bool v) { return add(v); }
  bool number_integer(json::number_integer_t v) { return add(v); }
  bool number_unsigned(json::number_unsigned_t v) { return add(v); }
  bool number_float(json::number_float_t v, const json::string_t& text) {
    // An integer literal beyond int64 and uint64 arrives as a double. Those
    // just below -2^63 round to exactly -2^63 and would pass as an int64:
    // keep them out of range (the next double down).
    if (v == kInt64Lo && text.find_first_of(".eE") == std::string::npos) v = std::nextafter(v, -HUGE_VAL);
    return add(v);
  }
  bool string(json::string_t& v) { return add(std::move(v)); }
  bool binary(json::binary_t& v) { return add(json::binary(std::move(v))); }
  bool start_object(std::size_t /*size*/) { return open(json::object()); }
  bool start_array(std::size_t /*size*/) { return open(json::array()); }
  bool key(json::string_t& k) {
    keys_.back() = k;
    slot_ = &(*stack_.back())[k];  // a repeated key: the last one wins, as in json::parse
    return true;
  }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool parse_error(std::size_t /*position*/, const std::string& token, const json::exception& ex) {
    if (ex.id == 406) {  // out_of_range: number overflow
      const std::string where = path();
      error_ = bad_request(where, (where.empty() ? std::string("a number") : where) +
                                      " is beyond the range of a double (about 1.8e308), got " + cut(token));
    } else {
      error_ = bad_request("", "invalid JSON: " + cut(ex.what(), 2 * kMaxShownChars));
    }
    return false;
  }

  const ApiError& error() const { return error_; }

 private:
  // Where the next value goes: the root, the end of the open array, or the
  // open object's slot for the last key. Pointers on stack_ stay valid: a
  // container only grows while it is the innermost open one.
  json* place(json&& v) {
    if (stack_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    json& top = *stack_.back();
    if (top.is_array()) {
      top.push_back(std::move(v));
      return &top.back();
    }
    *slot_ = std::move(v);
    return slot_;
  }
  bool add(json&& v) {
    place(std::move(v));
    return true;
  }
  bool open(json&& container) {
    stack_.push_back(place(std::move(container)));
    keys_.emplace_back();
    return true;
  }
  bool close() {
    stack_.pop_back();
    keys_.pop_back();
    return true;
  }
  // The path of the value being read: keys of open objects, indexes of open arrays.
  std::string path() const {
    std::string p;
    for (size_t i = 0; i < stack_.size(); ++i) {
      if (stack_[i]->is_array()) {
        // An outer array's current element is its last (the open container);
        // the innermost one's is the value not yet added.
        const size_t n = stack_[i]->size();
        p += "[" + std::to_string(i + 1 < stack_.size() ? n - 1 : n) + "]";
      } else {
        if (!p.empty()) p += ".";
        p += shown_key(keys_[i]);
      }
    }
    return p;
  }

  json& root_;
  std::vector<json*> stack_;       // the open containers, outermost first
  std::vector<std::string> keys_;  // per open container: its last key (objects)
  json* slot_ = nullptr;
  ApiError error_;
};

// A request body as a JSON object (into `obj`), or the 400 saying why not.
std::optional<ApiError> parse_body(std::string_view body, json& obj) {
  // Depth first: deep nesting is cheap to send and costly to handle (recursive
  // dump(), destruction); nothing deeper than kMaxJsonDepth reaches the parser.
  if (json_depth(body, kMaxJsonDepth) > kMaxJsonDepth) {
    return bad_request("", "the request body nests arrays and objects deeper than the limit of " +
                               std::to_string(kMaxJsonDepth) + " levels");
  }
  PathTrackingParser sax(obj);
  if (!json::sax_parse(body.begin(), body.end(), &sax)) return sax.error();
  if (!obj.is_object()) return bad_request("", "the request body must be a JSON object");
  return std::nullopt;
}

}  // namespace

std::string shown_text(std::string_view text) { return cut(text); }

ApiError invalid_request(std::string param, std::string message) {
  ApiError e;
  e.status = 400;
  e.message = std::move(message);
  e.param = std::move(param);
  return e;
}

std::string error_body(const ApiError& e) {
  ojson err = ojson::object();
  err["message"] = e.message;
  err["type"] = e.type;
  err["param"] = e.param.empty() ? ojson(nullptr) : ojson(e.param);
  err["code"] = e.code.empty() ? ojson(nullptr) : ojson(e.code);
  ojson body = ojson::object();
  body["error"] = std::move(err);
  return dump(body);
}

namespace {

// The parameters schemas of the tools a forced call may use: the grammar
// enforces them, so keywords it would not enforce are refused as in a
// response_format schema.
std::optional<ApiError> check_forced_tools(const ojson& body, const ApiRequest& r) {
  const auto tools = body.find("tools");
  if (tools == body.end() || !tools->is_array()) return std::nullopt;
  for (size_t i = 0; i < tools->size(); ++i) {
    const auto fn = (*tools)[i].is_object() ? (*tools)[i].find("function") : (*tools)[i].end();
    if (fn == (*tools)[i].end() || !fn->is_object()) continue;  // parse_tools refused it already
    const auto name = fn->find("name");
    const bool named = name != fn->end() && name->is_string() && name->get<std::string>() == r.tool_choice.name;
    if (r.tool_choice.mode == ToolChoiceMode::kNamed && !named) continue;
    const auto params = fn->find("parameters");
    if (params == fn->end()) continue;
    if (auto e = check_schema(*params, "tools[" + std::to_string(i) + "].function.parameters")) return e;
  }
  return std::nullopt;
}

// response_format and the other output constraints; chat: tools and tool_choice.
std::optional<ApiError> parse_constraints(Endpoint ep, std::string_view body, const json& obj, ApiRequest& r) {
  r.tool_choice.mode = ToolChoiceMode::kNone;  // parse_tools sets it when the request has tools
  const bool tools = ep == Endpoint::kChatCompletions && (obj.contains("tools") || obj.contains("tool_choice"));
  const bool constraint = std::any_of(obj.items().begin(), obj.items().end(),
                                      [](const auto& kv) { return is_structured_output_field(kv.key()); });
  if (!tools && !constraint) return std::nullopt;
  // Again with the keys in order: a schema's properties keep theirs (and the
  // output's keys follow them).
  const ojson ordered = ojson::parse(body, nullptr, /*allow_exceptions=*/false);
  if (auto e = parse_structured_output(ordered, r.sampling.grammar)) return e;
  if (ep != Endpoint::kChatCompletions) return std::nullopt;
  if (auto e = parse_tools(ordered, r.tools, r.tool_choice)) return e;
  const bool forced = r.tool_choice.mode == ToolChoiceMode::kRequired || r.tool_choice.mode == ToolChoiceMode::kNamed;
  if (forced && r.sampling.grammar.active()) {
    return bad_request("tool_choice", "tool_choice \"required\" or a named function constrains the output to a tool "
                                      "call: it cannot be combined with response_format or another output constraint");
  }
  return forced ? check_forced_tools(ordered, r) : std::nullopt;
}

}  // namespace

ApiResult<ApiRequest> parse_request(Endpoint ep, std::string_view body, const RequestDefaults& defaults) {
  json obj;
  if (auto e = parse_body(body, obj)) return *e;

  // Unknown and unsupported fields first, so a request is never half-understood.
  for (const auto& [key, value] : obj.items()) {
    const std::optional<FieldKind> kind = classify(ep, key);
    if (!kind) return bad_request(shown_key(key), "unknown field: " + shown_key(key));
    if (*kind == FieldKind::kUnsupported && !asks_for_nothing(key, value)) return unsupported(key);
  }

  ApiRequest r;
  r.endpoint = ep;
  if (const json* model = field(obj, "model")) {
    if (!model->is_string()) return bad_request("model", "model must be a string, got " + shown(*model));
    r.model = model->get<std::string>();
  }
  if (ep == Endpoint::kCompletions) {
    if (auto e = parse_prompt(obj, r)) return *e;
  } else {
    if (auto e = parse_messages(obj, r)) return *e;
  }
  if (auto e = parse_sampling(ep, obj, r, defaults)) return *e;
  if (auto e = parse_stop(obj, r)) return *e;
  if (auto e = parse_stream(obj, r)) return *e;
  if (auto e = parse_logprobs(ep, obj, r)) return *e;
  if (auto e = parse_constraints(ep, body, obj, r)) return *e;
  if (static_cast<int64_t>(r.prompts.size()) * r.n > kMaxChoices) {
    return bad_request("n", std::to_string(r.prompts.size()) + " prompts x n " + std::to_string(r.n) +
                                " choices is over the limit of " + std::to_string(kMaxChoices) + " per request");
  }

  // Backstop: the checks above are at least as strict as the sampler's own.
  if (Status st = r.sampling.validate(); !st.is_ok()) return bad_request("", st.message());
  return r;
}

int64_t text_chars(std::string_view bytes) {
  int64_t n = 0;
  for (unsigned char c : bytes) n += (c & 0xC0) != 0x80;
  return n;
}

const std::string& response_id_nonce() {
  static const std::string nonce = [] {
    std::random_device rd;
    const uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    char buf[17];
    std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
    return std::string(buf);
  }();
  return nonce;
}

std::string make_response_id(Endpoint ep, uint64_t n) {
  return (ep == Endpoint::kCompletions ? "cmpl-" : "chatcmpl-") + response_id_nonce() + "-" + std::to_string(n);
}

namespace {

// [{"id", "type": "function", "function": {"name", "arguments"}}]; a stream's
// deltas also carry each call's "index" among the choice's calls.
ojson tool_calls_json(const ChoiceOut& c, bool delta) {
  ojson calls = ojson::array();
  for (size_t k = 0; k < c.tool_calls.size(); ++k) {
    const ToolCall& t = c.tool_calls[k];
    ojson call = ojson::object();
    if (delta) call["index"] = c.tool_call_index + static_cast<int32_t>(k);
    call["id"] = t.id;
    call["type"] = "function";
    ojson fn = ojson::object();
    fn["name"] = t.name;
    fn["arguments"] = t.arguments;
    call["function"] = std::move(fn);
    calls.push_back(std::move(call));
  }
  return calls;
}

ojson envelope(const char* object, const std::string& id, const std::string& model, int64_t created) {
  ojson j = ojson::object();
  j["id"] = id;
  j["object"] = object;
  j["created"] = created;
  j["model"] = model;
  return j;
}

ojson usage_json(Usage u) {
  ojson j = ojson::object();
  j["prompt_tokens"] = u.prompt_tokens;
  j["completion_tokens"] = u.completion_tokens;
  j["total_tokens"] = u.prompt_tokens + u.completion_tokens;
  ojson details = ojson::object();
  details["cached_tokens"] = u.cached_tokens;
  j["prompt_tokens_details"] = std::move(details);
  return j;
}

}  // namespace

namespace {

// -inf as -9999.0 (vLLM's convention: JSON has no infinity).
double shown_logprob(float lp) { return std::isfinite(lp) ? static_cast<double>(lp) : -9999.0; }

ojson bytes_json(std::string_view text) {
  ojson b = ojson::array();
  for (unsigned char c : text) b.push_back(static_cast<int>(c));
  return b;
}

ojson completion_logprobs(const ChoiceOut& c) {
  ojson tokens = ojson::array(), lps = ojson::array(), tops = ojson::array(), offsets = ojson::array();
  int64_t offset = c.text_offset;
  for (const ShownToken& t : c.logprobs) {
    tokens.push_back(t.text);
    offsets.push_back(offset);
    if (t.in_text) offset += text_chars(t.text);
    if (!t.logprob) {
      lps.push_back(nullptr);
      tops.push_back(nullptr);
      continue;
    }
    lps.push_back(shown_logprob(*t.logprob));
    ojson top = ojson::object();
    for (const auto& [text, lp] : t.top) {
      if (!top.contains(text)) top[text] = shown_logprob(lp);  // tokens with the same text: the likelier one
    }
    if (!top.contains(t.text)) top[t.text] = shown_logprob(*t.logprob);
    tops.push_back(std::move(top));
  }
  ojson j = ojson::object();
  j["tokens"] = std::move(tokens);
  j["token_logprobs"] = std::move(lps);
  j["top_logprobs"] = std::move(tops);
  j["text_offset"] = std::move(offsets);
  return j;
}

ojson chat_logprobs(const ChoiceOut& c) {
  ojson content = ojson::array();
  for (const ShownToken& t : c.logprobs) {
    ojson e = ojson::object();
    e["token"] = t.text;
    e["logprob"] = shown_logprob(t.logprob.value_or(0.0f));
    e["bytes"] = bytes_json(t.text);
    ojson top = ojson::array();
    for (const auto& [text, lp] : t.top) {
      ojson alt = ojson::object();
      alt["token"] = text;
      alt["logprob"] = shown_logprob(lp);
      alt["bytes"] = bytes_json(text);
      top.push_back(std::move(alt));
    }
    e["top_logprobs"] = std::move(top);
    content.push_back(std::move(e));
  }
  ojson j = ojson::object();
  j["content"] = std::move(content);
  j["refusal"] = nullptr;
  return j;
}

ojson logprobs_json(Endpoint ep, const ChoiceOut& c) {
  if (!c.with_logprobs) return nullptr;
  return ep == Endpoint::kChatCompletions ? chat_logprobs(c) : completion_logprobs(c);
}

ojson finish_json(const ChoiceOut& c) { return c.finish_reason ? ojson(*c.finish_reason) : ojson(nullptr); }

}  // namespace

std::string completion_body(Endpoint ep, const std::string& id, const std::string& model, int64_t created,
                            const std::vector<ChoiceOut>& choices, Usage usage) {
  const bool chat = ep == Endpoint::kChatCompletions;
  ojson j = envelope(chat ? "chat.completion" : "text_completion", id, model, created);
  ojson list = ojson::array();
  for (const ChoiceOut& c : choices) {
    ojson choice = ojson::object();
    choice["index"] = c.index;
    if (chat) {
      ojson message = ojson::object();
      message["role"] = "assistant";
      // A reply that only called tools has content null (as OpenAI's).
      message["content"] = c.text.empty() && !c.tool_calls.empty() ? ojson(nullptr) : ojson(c.text);
      if (!c.tool_calls.empty()) message["tool_calls"] = tool_calls_json(c, /*delta=*/false);
      choice["message"] = std::move(message);
    } else {
      choice["text"] = c.text;
    }
    choice["logprobs"] = logprobs_json(ep, c);
    choice["finish_reason"] = finish_json(c);
    list.push_back(std::move(choice));
  }
  j["choices"] = std::move(list);
  j["usage"] = usage_json(usage);
  return dump(j);
}

std::string stream_chunk(Endpoint ep, const std::string& id, const std::string& model, int64_t created,
                         const ChoiceOut& c, bool first) {
  const bool chat = ep == Endpoint::kChatCompletions;
  ojson j = envelope(chat ? "chat.completion.chunk" : "text_completion", id, model, created);
  ojson choice = ojson::object();
  choice["index"] = c.index;
  if (chat) {
    ojson delta = ojson::object();
    if (first) delta["role"] = "assistant";
    delta["content"] = c.text.empty() && !c.tool_calls.empty() ? ojson(nullptr) : ojson(c.text);
    // A call goes out whole in one delta (its id, name and all its arguments).
    if (!c.tool_calls.empty()) delta["tool_calls"] = tool_calls_json(c, /*delta=*/true);
    choice["delta"] = std::move(delta);
  } else {
    choice["text"] = c.text;
  }
  choice["logprobs"] = logprobs_json(ep, c);
  choice["finish_reason"] = finish_json(c);
  j["choices"] = ojson::array({std::move(choice)});
  return dump(j);
}

std::string usage_chunk(Endpoint ep, const std::string& id, const std::string& model, int64_t created, Usage usage) {
  const bool chat = ep == Endpoint::kChatCompletions;
  ojson j = envelope(chat ? "chat.completion.chunk" : "text_completion", id, model, created);
  j["choices"] = ojson::array();
  j["usage"] = usage_json(usage);
  return dump(j);
}

namespace {

ojson model_json(const std::string& model, int64_t created) {
  ojson m = ojson::object();
  m["id"] = model;
  m["object"] = "model";
  m["created"] = created;
  m["owned_by"] = "pdcluster";
  return m;
}

}  // namespace

std::string models_body(const std::string& model, int64_t created) {
  ojson j = ojson::object();
  j["object"] = "list";
  j["data"] = ojson::array({model_json(model, created)});
  return dump(j);
}

std::string model_body(const std::string& model, int64_t created) { return dump(model_json(model, created)); }

ApiResult<TokenizeRequest> parse_tokenize(std::string_view body) {
  json obj;
  if (auto e = parse_body(body, obj)) return *e;
  TokenizeRequest r;
  r.chat = obj.contains("messages");
  for (const auto& [key, value] : obj.items()) {
    const bool known = key == "model" || key == "add_special_tokens" ||
                       (r.chat ? key == "messages" || key == "add_generation_prompt" || key == "tools" ||
                                     key == "tool_choice"
                               : key == "prompt" || key == "parse_special");
    if (!known) return bad_request(shown_key(key), "unknown field: " + shown_key(key));
  }
  if (const json* model = field(obj, "model")) {
    if (!model->is_string()) return bad_request("model", "model must be a string, got " + shown(*model));
    r.model = model->get<std::string>();
  }
  if (auto e = read_bool(obj, "add_special_tokens", r.add_special_tokens)) return *e;
  if (r.chat) {
    ApiRequest chat;
    if (auto e = parse_messages(obj, chat)) return *e;
    r.messages = std::move(chat.messages);
    if (auto e = read_bool(obj, "add_generation_prompt", r.add_generation_prompt)) return *e;
    if (obj.contains("tools") || obj.contains("tool_choice")) {
      const ojson ordered = ojson::parse(body, nullptr, /*allow_exceptions=*/false);
      if (auto e = parse_tools(ordered, r.tools, r.tool_choice)) return *e;
    }
    return r;
  }
  const json* prompt = field(obj, "prompt");
  if (!prompt) return bad_request("prompt", "prompt (a string) or messages is required");
  if (!prompt->is_string()) return bad_request("prompt", "prompt must be a string, got " + shown(*prompt));
  r.prompt = prompt->get<std::string>();
  if (auto e = read_bool(obj, "parse_special", r.parse_special)) return *e;
  return r;
}

std::string tokenize_body(const std::vector<TokenId>& tokens, int64_t max_model_len) {
  ojson j = ojson::object();
  j["tokens"] = tokens;
  j["count"] = tokens.size();
  j["max_model_len"] = max_model_len;
  return dump(j);
}

ApiResult<DetokenizeRequest> parse_detokenize(std::string_view body, int32_t vocab) {
  json obj;
  if (auto e = parse_body(body, obj)) return *e;
  DetokenizeRequest r;
  for (const auto& [key, value] : obj.items()) {
    if (key != "model" && key != "tokens") return bad_request(shown_key(key), "unknown field: " + shown_key(key));
  }
  if (const json* model = field(obj, "model")) {
    if (!model->is_string()) return bad_request("model", "model must be a string, got " + shown(*model));
    r.model = model->get<std::string>();
  }
  const json* tokens = field(obj, "tokens");
  if (!tokens) return bad_request("tokens", "tokens is required");
  if (!tokens->is_array()) return bad_request("tokens", "tokens must be an array of token ids, got " + shown(*tokens));
  for (size_t i = 0; i < tokens->size(); ++i) {
    const IntRead id = as_int64((*tokens)[i]);
    if (id.kind != IntRead::kOk || id.value < 0 || id.value >= vocab) {
      return bad_request("tokens", "tokens[" + std::to_string(i) + "] must be a token id in [0, " +
                                       std::to_string(vocab) + "), got " + shown((*tokens)[i]));
    }
    r.tokens.push_back(static_cast<TokenId>(id.value));
  }
  return r;
}

std::string detokenize_body(const std::string& text) {
  ojson j = ojson::object();
  j["prompt"] = text;
  return dump(j);
}

}  // namespace pd::router
