#include "router/openai_api.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

namespace pd::router {
namespace {

using json = nlohmann::json;
// Responses keep OpenAI's field order (id, object, created, model, choices, usage).
using ojson = nlohmann::ordered_json;

template <typename J>
std::string dump(const J& j) {
  return j.dump(-1, ' ', false, J::error_handler_t::replace);
}

ApiError bad_request(std::string param, std::string message) {
  ApiError e;
  e.status = 400;
  e.message = std::move(message);
  e.param = std::move(param);
  return e;
}

ApiError unsupported(const std::string& field) { return bad_request(field, field + " is not supported"); }

// A JSON value as the client wrote it, for "got ..." in messages (bounded in length).
std::string shown(const json& v) {
  std::string s = dump(v);
  if (s.size() > 64) s = s.substr(0, 61) + "...";
  return s;
}

// The field's value, or nullptr when it is absent or null (null means "default").
const json* field(const json& obj, const char* key) {
  const auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

// An integer value: a JSON integer, or a float with an integral value (5.0).
std::optional<int64_t> as_int64(const json& v) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::isfinite(d) && std::trunc(d) == d && std::fabs(d) < 9.0e18) return static_cast<int64_t>(d);
  }
  return std::nullopt;
}

// Reads an optional number into `out`, checking lo <= v <= hi (lo < v when lo_open).
std::optional<ApiError> read_float(const json& obj, const char* key, double lo, double hi, bool lo_open,
                                   float& out) {
  const json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) return bad_request(key, std::string(key) + " must be a number, got " + shown(*v));
  const double d = v->get<double>();
  const bool low_ok = lo_open ? d > lo : d >= lo;
  if (!low_ok || d > hi) {
    char range[64];
    std::snprintf(range, sizeof(range), "%s%g, %g]", lo_open ? "(" : "[", lo, hi);
    return bad_request(key, std::string(key) + " must be in " + range + ", got " + shown(*v));
  }
  out = static_cast<float>(d);
  return std::nullopt;
}

// Reads an optional integer into `out` (left empty when the field is absent or null).
std::optional<ApiError> read_int(const json& obj, const char* key, std::optional<int64_t>& out) {
  const json* v = field(obj, key);
  if (!v) return std::nullopt;
  const std::optional<int64_t> i = as_int64(*v);
  if (!i) return bad_request(key, std::string(key) + " must be an integer, got " + shown(*v));
  out = *i;
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
    "frequency_penalty", "ignore_eos", "stop", "stream", "stream_options", "n", "echo"};
constexpr const char* kIgnoredFields[] = {"user", "parallel_tool_calls", "service_tier", "metadata", "store"};
constexpr const char* kUnsupportedFields[] = {"best_of", "logprobs", "top_logprobs", "logit_bias", "tools",
                                              "functions", "tool_choice", "function_call", "response_format",
                                              "suffix"};

std::optional<FieldKind> classify(Endpoint ep, const std::string& key) {
  for (const char* f : kCommonFields) {
    if (key == f) return FieldKind::kHandled;
  }
  if (ep == Endpoint::kCompletions && key == "prompt") return FieldKind::kHandled;
  if (ep == Endpoint::kChatCompletions && (key == "messages" || key == "max_completion_tokens")) {
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
  if (key == "best_of" || key == "top_logprobs") return as_int64(v) == (key == "best_of" ? 1 : 0);
  if (key == "logprobs") return v.is_boolean() && !v.get<bool>();
  if (key == "logit_bias") return v.is_object() && v.empty();
  if (key == "tools" || key == "functions") return v.is_array() && v.empty();
  if (key == "tool_choice" || key == "function_call") return v.is_string() && v.get<std::string>() == "none";
  if (key == "response_format") {
    return v.is_object() && v.size() == 1 && v.contains("type") && v["type"] == "text";
  }
  if (key == "suffix") return v.is_string() && v.get<std::string>().empty();
  return false;
}

std::optional<ApiError> parse_prompt(const json& obj, ApiRequest& r) {
  const json* v = field(obj, "prompt");
  if (!v) return bad_request("prompt", "prompt is required");
  if (v->is_string()) {
    r.prompt = v->get<std::string>();
    return std::nullopt;
  }
  if (!v->is_array()) return bad_request("prompt", "prompt must be a string or an array of one string");
  if (v->empty()) return bad_request("prompt", "prompt must not be an empty array");
  for (const json& e : *v) {
    if (e.is_number() || e.is_array()) return bad_request("prompt", "token-id prompts are not supported");
    if (!e.is_string()) return bad_request("prompt", "prompt array elements must be strings");
  }
  if (v->size() > 1) return bad_request("prompt", "prompt arrays of more than one string are not supported");
  r.prompt = (*v)[0].get<std::string>();
  return std::nullopt;
}

// content: a string, or an array of {"type":"text","text":...} parts joined with "\n".
std::optional<ApiError> parse_content(const json& v, const std::string& where, std::string& out) {
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
    if (*type != "text") {
      return bad_request(part + ".type", part + ".type " + shown(*type) + " is not supported (only \"text\")");
    }
    const json* text = field(p, "text");
    if (!text || !text->is_string()) return bad_request(part + ".text", part + ".text must be a string");
    if (j > 0) out += "\n";
    out += text->get<std::string>();
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
    for (const char* key : {"tool_calls", "function_call", "tool_call_id"}) {
      const json* t = field(m, key);
      if (t && !(t->is_array() && t->empty())) return unsupported(where + "." + key);
    }
    ChatMessage msg;
    const json* role = field(m, "role");
    if (!role) return bad_request(where + ".role", where + ".role is required");
    if (!role->is_string()) return bad_request(where + ".role", where + ".role must be a string");
    msg.role = role->get<std::string>();
    if (msg.role == "developer") msg.role = "system";  // OpenAI's newer name for the system role
    if (msg.role != "system" && msg.role != "user" && msg.role != "assistant") {
      return bad_request(where + ".role",
                         where + ".role must be \"system\", \"user\" or \"assistant\", got " + shown(*role));
    }
    const json* content = field(m, "content");
    if (!content) return bad_request(where + ".content", where + ".content is required");
    if (auto e = parse_content(*content, where + ".content", msg.content)) return e;
    r.messages.push_back(std::move(msg));
  }
  return std::nullopt;
}

std::optional<ApiError> parse_stop(const json& obj, ApiRequest& r) {
  const json* v = field(obj, "stop");
  if (!v) return std::nullopt;
  if (v->is_string()) {
    if (v->get<std::string>().empty()) return bad_request("stop", "stop strings must not be empty");
    r.stop.push_back(v->get<std::string>());
    return std::nullopt;
  }
  if (!v->is_array()) return bad_request("stop", "stop must be a string or an array of strings");
  if (v->size() > 4) return bad_request("stop", "stop may hold at most 4 strings, got " + std::to_string(v->size()));
  for (const json& s : *v) {
    if (!s.is_string()) return bad_request("stop", "stop array elements must be strings, got " + shown(s));
    if (s.get<std::string>().empty()) return bad_request("stop", "stop strings must not be empty");
    r.stop.push_back(s.get<std::string>());
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
    if (key != "include_usage") return bad_request("stream_options." + key, "unknown field: stream_options." + key);
  }
  if (const json* u = field(*opts, "include_usage")) {
    if (!u->is_boolean()) {
      return bad_request("stream_options.include_usage", "stream_options.include_usage must be a boolean");
    }
    r.include_usage = u->get<bool>();
  }
  return std::nullopt;
}

std::optional<ApiError> parse_sampling(Endpoint ep, const json& obj, ApiRequest& r) {
  SamplingParams& s = r.sampling;
  s.temperature = 1.0f;  // OpenAI's default; SamplingParams' own default is greedy
  if (auto e = read_float(obj, "temperature", 0.0, 2.0, false, s.temperature)) return e;
  if (auto e = read_float(obj, "top_p", 0.0, 1.0, true, s.top_p)) return e;
  if (auto e = read_float(obj, "min_p", 0.0, 1.0, false, s.min_p)) return e;
  if (auto e = read_float(obj, "presence_penalty", -2.0, 2.0, false, s.presence_penalty)) return e;
  if (auto e = read_float(obj, "frequency_penalty", -2.0, 2.0, false, s.frequency_penalty)) return e;
  if (auto e = read_bool(obj, "ignore_eos", s.ignore_eos)) return e;

  std::optional<int64_t> top_k;
  if (auto e = read_int(obj, "top_k", top_k)) return e;
  if (top_k) {
    if (*top_k < -1) {
      return bad_request("top_k", "top_k must be -1 or 0 (disabled) or >= 1, got " + std::to_string(*top_k));
    }
    s.top_k = static_cast<int32_t>(std::clamp<int64_t>(*top_k, 0, std::numeric_limits<int32_t>::max()));
  }

  // seed: any 64-bit integer, signed or not; stored as its two's-complement bits.
  if (const json* seed = field(obj, "seed")) {
    if (seed->is_number_unsigned()) {
      s.seed = seed->get<uint64_t>();
    } else if (const std::optional<int64_t> i = as_int64(*seed)) {
      s.seed = static_cast<uint64_t>(*i);
    } else {
      return bad_request("seed", "seed must be an integer, got " + shown(*seed));
    }
  }

  // max_tokens (chat: max_completion_tokens wins when both are given).
  const char* max_key = "max_tokens";
  if (ep == Endpoint::kChatCompletions && field(obj, "max_completion_tokens")) max_key = "max_completion_tokens";
  std::optional<int64_t> max_tokens;
  if (auto e = read_int(obj, "max_tokens", max_tokens)) return e;
  if (max_key != std::string_view("max_tokens")) {
    if (auto e = read_int(obj, max_key, max_tokens)) return e;
  }
  if (max_tokens) {
    if (*max_tokens < 1) {
      return bad_request(max_key, std::string(max_key) + " must be >= 1, got " + std::to_string(*max_tokens));
    }
    // Larger than any context: the caller clamps to the context left anyway.
    s.max_tokens = static_cast<int32_t>(std::min<int64_t>(*max_tokens, std::numeric_limits<int32_t>::max()));
    r.max_tokens_given = true;
  }

  std::optional<int64_t> n;
  if (auto e = read_int(obj, "n", n)) return e;
  if (n && *n > 1) return bad_request("n", "n > 1 is not supported");
  if (n && *n < 1) return bad_request("n", "n must be 1, got " + std::to_string(*n));
  return std::nullopt;
}

}  // namespace

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

ApiResult<ApiRequest> parse_request(Endpoint ep, std::string_view body) {
  json obj;
  try {
    obj = json::parse(body.begin(), body.end());
  } catch (const json::parse_error& e) {
    return bad_request("", std::string("invalid JSON: ") + e.what());
  }
  if (!obj.is_object()) return bad_request("", "the request body must be a JSON object");

  // Unknown and unsupported fields first, so a request is never half-understood.
  for (const auto& [key, value] : obj.items()) {
    const std::optional<FieldKind> kind = classify(ep, key);
    if (!kind) return bad_request(key, "unknown field: " + key);
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
  if (auto e = parse_sampling(ep, obj, r)) return *e;
  if (auto e = parse_stop(obj, r)) return *e;
  if (auto e = parse_stream(obj, r)) return *e;
  if (auto e = read_bool(obj, "echo", r.echo)) return *e;
  if (r.echo) return unsupported("echo");

  // Backstop: the checks above are at least as strict as the sampler's own.
  if (Status st = r.sampling.validate(); !st.is_ok()) return bad_request("", st.message());
  return r;
}

std::string make_response_id(Endpoint ep, uint64_t n) {
  return (ep == Endpoint::kCompletions ? "cmpl-" : "chatcmpl-") + std::to_string(n);
}

namespace {

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
  return j;
}

}  // namespace

std::string completion_body(Endpoint ep, const std::string& id, const std::string& model, int64_t created,
                            const std::string& text, const std::string& finish_reason, Usage usage) {
  const bool chat = ep == Endpoint::kChatCompletions;
  ojson j = envelope(chat ? "chat.completion" : "text_completion", id, model, created);
  ojson choice = ojson::object();
  choice["index"] = 0;
  if (chat) {
    ojson message = ojson::object();
    message["role"] = "assistant";
    message["content"] = text;
    choice["message"] = std::move(message);
  } else {
    choice["text"] = text;
  }
  choice["logprobs"] = nullptr;
  choice["finish_reason"] = finish_reason;
  j["choices"] = ojson::array({std::move(choice)});
  j["usage"] = usage_json(usage);
  return dump(j);
}

std::string stream_chunk(Endpoint ep, const std::string& id, const std::string& model, int64_t created,
                         const std::string& delta_text, const std::string* finish_reason, bool first) {
  const bool chat = ep == Endpoint::kChatCompletions;
  ojson j = envelope(chat ? "chat.completion.chunk" : "text_completion", id, model, created);
  ojson choice = ojson::object();
  choice["index"] = 0;
  if (chat) {
    ojson delta = ojson::object();
    if (first) delta["role"] = "assistant";
    delta["content"] = delta_text;
    choice["delta"] = std::move(delta);
  } else {
    choice["text"] = delta_text;
  }
  choice["logprobs"] = nullptr;
  choice["finish_reason"] = finish_reason ? ojson(*finish_reason) : ojson(nullptr);
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

std::string models_body(const std::string& model, int64_t created) {
  ojson m = ojson::object();
  m["id"] = model;
  m["object"] = "model";
  m["created"] = created;
  m["owned_by"] = "pdcluster";
  ojson j = ojson::object();
  j["object"] = "list";
  j["data"] = ojson::array({std::move(m)});
  return dump(j);
}

}  // namespace pd::router
