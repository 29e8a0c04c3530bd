#include "router/tool_calls.h"

#include <algorithm>
#include <cstddef>
#include <initializer_list>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace pd::router {
// Named, not anonymous: in a unity build this file shares a translation unit
// with openai_api.cpp, whose anonymous namespace has helpers of the same names.
namespace tool_calls_impl {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

constexpr std::string_view kOpenTag = "<tool_call>";
constexpr std::string_view kCloseTag = "</tool_call>";
constexpr const char* kEmptyParameters = R"({"type":"object","properties":{}})";

ApiError bad_request(std::string param, std::string message) { return invalid_request(std::move(param), std::move(message)); }

// A client's key as shown in a message or `param`: at most kMaxShownChars
// bytes, cut at a UTF-8 character boundary, "..." when cut.
std::string shown_key(std::string_view s) { return shown_text(s); }

// A client's scalar for "got ..." (containers by their type: never a big dump).
template <typename J>
std::string shown(const J& v) {
  if (v.is_structured()) return std::string("an ") + (v.is_array() ? "array" : "object");
  return shown_key(v.dump(-1, ' ', false, J::error_handler_t::replace));
}

// The field's value, or nullptr when it is absent or null.
template <typename J>
const J* field(const J& obj, const char* key) {
  const auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

// 400 naming the first key of `obj` that is not in `known`.
template <typename J>
std::optional<ApiError> unknown_keys(const J& obj, const std::string& where, std::initializer_list<const char*> known) {
  for (const auto& [key, value] : obj.items()) {
    if (std::none_of(known.begin(), known.end(), [&](const char* k) { return key == k; })) {
      const std::string path = where + "." + shown_key(key);
      return bad_request(path, "unknown field: " + path);
    }
  }
  return std::nullopt;
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

std::string_view ltrim(std::string_view s) {
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  return s;
}

std::string_view rtrim(std::string_view s) {
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}

std::string_view trim(std::string_view s) { return ltrim(rtrim(s)); }

// Python's json.dumps(v, ensure_ascii=False) (what the templates' `tojson`
// writes): ", " and ": " between items, keys in order.
void py_dump(const ojson& v, std::string& out) {
  if (v.is_object()) {
    out += '{';
    bool first = true;
    for (const auto& [k, e] : v.items()) {
      if (!first) out += ", ";
      first = false;
      out += ojson(k).dump(-1, ' ', false, ojson::error_handler_t::replace);
      out += ": ";
      py_dump(e, out);
    }
    out += '}';
  } else if (v.is_array()) {
    out += '[';
    for (size_t i = 0; i < v.size(); ++i) {
      if (i > 0) out += ", ";
      py_dump(v[i], out);
    }
    out += ']';
  } else {
    out += v.dump(-1, ' ', false, ojson::error_handler_t::replace);
  }
}

std::string py_dump(const ojson& v) {
  std::string out;
  py_dump(v, out);
  return out;
}

// JSON text we wrote ourselves (a tool's parameters, a call's arguments).
ojson parse_ours(const std::string& text) {
  ojson v = ojson::parse(text, nullptr, /*allow_exceptions=*/false);
  return v.is_discarded() ? ojson::object() : v;
}

// An OpenAI function name: 1..kMaxToolNameChars of [A-Za-z0-9_-].
bool valid_tool_name(std::string_view n) {
  if (n.empty() || n.size() > kMaxToolNameChars) return false;
  return std::all_of(n.begin(), n.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
  });
}

// tools[i].function.
template <typename J>
std::optional<ApiError> parse_function(const J& f, const std::string& where, ToolFunction& out) {
  if (!f.is_object()) return bad_request(where, where + " must be an object, got " + shown(f));
  if (auto e = unknown_keys(f, where, {"name", "description", "parameters", "strict"})) return e;
  const J* name = field(f, "name");
  if (!name) return bad_request(where + ".name", where + ".name is required");
  if (!name->is_string() || !valid_tool_name(name->template get_ref<const std::string&>())) {
    return bad_request(where + ".name", where + ".name must be 1 to 64 letters, digits, '_' or '-', got " +
                                            shown(*name));
  }
  out.name = name->template get<std::string>();
  if (const J* d = field(f, "description")) {
    if (!d->is_string()) return bad_request(where + ".description", where + ".description must be a string");
    out.description = d->template get<std::string>();
  }
  out.parameters = kEmptyParameters;
  if (const J* p = field(f, "parameters")) {
    if (!p->is_object()) {
      return bad_request(where + ".parameters",
                         where + ".parameters must be a JSON schema object, got " + shown(*p));
    }
    out.parameters = p->dump(-1, ' ', false, J::error_handler_t::replace);
  }
  const J* strict = field(f, "strict");
  if (strict && !strict->is_boolean()) return bad_request(where + ".strict", where + ".strict must be a boolean");
  return std::nullopt;
}

// tools[i].
template <typename J>
std::optional<ApiError> parse_tool(const J& t, const std::string& where, ToolFunction& out) {
  if (!t.is_object()) return bad_request(where, where + " must be an object, got " + shown(t));
  if (auto e = unknown_keys(t, where, {"type", "function"})) return e;
  const J* type = field(t, "type");
  if (type && *type != "function") {
    return bad_request(where + ".type", where + ".type must be \"function\", got " + shown(*type));
  }
  const J* f = field(t, "function");
  if (!f) return bad_request(where + ".function", where + ".function is required");
  return parse_function(*f, where + ".function", out);
}

bool has_tool(const std::vector<ToolFunction>& tools, std::string_view name) {
  return std::any_of(tools.begin(), tools.end(), [&](const ToolFunction& t) { return t.name == name; });
}

// tool_choice {"type": "function", "function": {"name": ...}}.
template <typename J>
std::optional<ApiError> parse_named_choice(const J& tc, ToolChoice& choice) {
  const char* kForm =
      R"(tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": NAME}})";
  if (auto e = unknown_keys(tc, "tool_choice", {"type", "function"})) return e;
  const J* type = field(tc, "type");
  const J* f = field(tc, "function");
  if ((type && *type != "function") || !f || !f->is_object()) return bad_request("tool_choice", kForm);
  if (auto e = unknown_keys(*f, "tool_choice.function", {"name"})) return e;
  const J* name = field(*f, "name");
  if (!name || !name->is_string()) return bad_request("tool_choice", kForm);
  choice.mode = ToolChoiceMode::kNamed;
  choice.name = name->template get<std::string>();
  return std::nullopt;
}

template <typename J>
std::optional<ApiError> parse_tool_choice(const J& body, const std::vector<ToolFunction>& tools,
                                          ToolChoice& choice) {
  choice = ToolChoice{tools.empty() ? ToolChoiceMode::kNone : ToolChoiceMode::kAuto, ""};
  const J* tc = field(body, "tool_choice");
  if (!tc) return std::nullopt;
  if (tc->is_string()) {
    const std::string& s = tc->template get_ref<const std::string&>();
    if (s == "required") {
      choice.mode = ToolChoiceMode::kRequired;
    } else if (s == "none") {
      choice.mode = ToolChoiceMode::kNone;
    } else if (s != "auto") {
      return bad_request("tool_choice", "tool_choice must be \"none\", \"auto\", \"required\" or a named function, "
                                        "got " + shown(*tc));
    }
  } else if (tc->is_object()) {
    if (auto e = parse_named_choice(*tc, choice)) return e;
  } else {
    return bad_request("tool_choice", "tool_choice must be a string or an object, got " + shown(*tc));
  }
  const bool needs_tools = choice.mode == ToolChoiceMode::kRequired || choice.mode == ToolChoiceMode::kNamed;
  if (needs_tools && tools.empty()) {
    return bad_request("tool_choice", "tool_choice " + shown(*tc) + " needs tools, and the request gives none");
  }
  if (choice.mode == ToolChoiceMode::kNamed && !has_tool(tools, choice.name)) {
    return bad_request("tool_choice", "tool_choice names function " + shown_key(choice.name) +
                                          ", which is not among the tools");
  }
  return std::nullopt;
}

template <typename J>
std::optional<ApiError> parse_tools_impl(const J& body, std::vector<ToolFunction>& tools, ToolChoice& choice) {
  tools.clear();
  if (const J* v = field(body, "tools")) {
    if (!v->is_array()) return bad_request("tools", "tools must be an array, got " + shown(*v));
    if (v->size() > kMaxTools) {
      return bad_request("tools", "tools holds " + std::to_string(v->size()) + " tools; at most " +
                                      std::to_string(kMaxTools) + " are allowed");
    }
    std::set<std::string> names;
    for (size_t i = 0; i < v->size(); ++i) {
      const std::string where = "tools[" + std::to_string(i) + "]";
      ToolFunction t;
      if (auto e = parse_tool((*v)[i], where, t)) return e;
      if (!names.insert(t.name).second) {
        return bad_request(where + ".function.name", where + ".function.name \"" + t.name + "\" is given twice");
      }
      tools.push_back(std::move(t));
    }
  }
  return parse_tool_choice(body, tools, choice);
}

// messages[i].tool_calls[j].function.
template <typename J>
std::optional<ApiError> parse_call_function(const J& f, const std::string& where, ToolCall& out) {
  if (!f.is_object()) return bad_request(where, where + " must be an object, got " + shown(f));
  if (auto e = unknown_keys(f, where, {"name", "arguments"})) return e;
  const J* name = field(f, "name");
  if (!name || !name->is_string() || name->template get_ref<const std::string&>().empty()) {
    return bad_request(where + ".name", where + ".name must be a non-empty string");
  }
  out.name = name->template get<std::string>();
  const J* args = field(f, "arguments");
  if (!args || !args->is_string()) {
    return bad_request(where + ".arguments", where + ".arguments must be a string holding a JSON object");
  }
  const ojson parsed = ojson::parse(args->template get_ref<const std::string&>(), nullptr, false);
  if (parsed.is_discarded() || !parsed.is_object()) {
    return bad_request(where + ".arguments", where + ".arguments must be a string holding a JSON object, got " +
                                                 shown(*args));
  }
  out.arguments = parsed.dump(-1, ' ', false, ojson::error_handler_t::replace);
  return std::nullopt;
}

template <typename J>
std::optional<ApiError> parse_message_tool_calls_impl(const J& msg, const std::string& where,
                                                      std::vector<ToolCall>& out) {
  const J* v = field(msg, "tool_calls");
  if (!v) return std::nullopt;
  const std::string base = where + ".tool_calls";
  if (!v->is_array()) return bad_request(base, base + " must be an array, got " + shown(*v));
  for (size_t j = 0; j < v->size(); ++j) {
    const std::string at = base + "[" + std::to_string(j) + "]";
    const J& c = (*v)[j];
    if (!c.is_object()) return bad_request(at, at + " must be an object, got " + shown(c));
    if (auto e = unknown_keys(c, at, {"id", "type", "function"})) return e;
    ToolCall call;
    const J* id = field(c, "id");
    if (!id || !id->is_string()) return bad_request(at + ".id", at + ".id must be a string");
    call.id = id->template get<std::string>();
    const J* type = field(c, "type");
    if (type && *type != "function") {
      return bad_request(at + ".type", at + ".type must be \"function\", got " + shown(*type));
    }
    const J* f = field(c, "function");
    if (!f) return bad_request(at + ".function", at + ".function is required");
    if (auto e = parse_call_function(*f, at + ".function", call)) return e;
    out.push_back(std::move(call));
  }
  return std::nullopt;
}

// A tool as the templates show it: {"type": "function", "function": {...}}.
ojson tool_object(const ToolFunction& t) {
  ojson f = ojson::object();
  f["name"] = t.name;
  if (!t.description.empty()) f["description"] = t.description;
  f["parameters"] = parse_ours(t.parameters);
  ojson o = ojson::object();
  o["type"] = "function";
  o["function"] = std::move(f);
  return o;
}

// Qwen2.5's tool section (after the system text).
std::string hermes_tool_section(const std::vector<ToolFunction>& tools) {
  std::string s =
      "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
      "You are provided with function signatures within <tools></tools> XML tags:\n<tools>";
  for (const ToolFunction& t : tools) s += "\n" + py_dump(tool_object(t));
  s += "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
       "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
       "<args-json-object>}\n</tool_call>";
  return s;
}

std::string hermes_call(const ToolCall& c) {
  return "<tool_call>\n{\"name\": \"" + c.name + "\", \"arguments\": " + py_dump(parse_ours(c.arguments)) +
         "}\n</tool_call>";
}

// An assistant message with its tool calls appended.
std::string hermes_assistant(const ApiMessage& m) {
  std::string s = m.content;
  for (const ToolCall& c : m.tool_calls) {
    if (!s.empty()) s += "\n";
    s += hermes_call(c);
  }
  return s;
}

std::vector<ChatMessage> render_hermes(const std::vector<ApiMessage>& messages, const std::vector<ToolFunction>& tools,
                                       bool describe, const std::string& default_system) {
  std::vector<ChatMessage> out;
  if (describe) {
    const bool has_system = !messages.empty() && messages[0].role == "system";
    std::string system = has_system ? messages[0].content : default_system;
    std::string section = hermes_tool_section(tools);
    if (!has_system && system.empty()) section.erase(0, 2);  // Qwen3: no system text, no "\n\n"
    out.push_back({"system", system + section});
  }
  for (size_t i = describe && !messages.empty() && messages[0].role == "system" ? 1 : 0; i < messages.size(); ++i) {
    const ApiMessage& m = messages[i];
    if (m.role == "assistant") {
      out.push_back({"assistant", hermes_assistant(m)});
    } else if (m.role == "tool") {
      const std::string block = "<tool_response>\n" + m.content + "\n</tool_response>";
      if (i > 0 && messages[i - 1].role == "tool") {
        out.back().content += "\n" + block;
      } else {
        out.push_back({"user", block});
      }
    } else {
      out.push_back({m.role, m.content});
    }
  }
  return out;
}

std::string llama_tool_prompt(const std::vector<ToolFunction>& tools) {
  std::string s =
      "Given the following functions, please respond with a JSON for a function call with its proper arguments "
      "that best answers the given prompt.\n\nRespond in the format {\"name\": function name, \"parameters\": "
      "dictionary of argument name and its value}.Do not use variables.\n\n";
  for (const ToolFunction& t : tools) s += tool_object(t).dump(4, ' ', false, ojson::error_handler_t::replace) + "\n\n";
  return s;
}

std::string llama_calls(const std::vector<ToolCall>& calls) {
  std::string s;
  for (const ToolCall& c : calls) {
    if (!s.empty()) s += "; ";
    s += "{\"name\": \"" + c.name + "\", \"parameters\": " + py_dump(parse_ours(c.arguments)) + "}";
  }
  return s;
}

ApiResult<std::vector<ChatMessage>> render_llama31(const std::vector<ApiMessage>& messages,
                                                   const std::vector<ToolFunction>& tools, bool describe) {
  std::vector<ChatMessage> out;
  bool prefixed = !describe;
  for (const ApiMessage& m : messages) {
    if (m.role == "tool") {
      // As Llama 3.1's template writes it: a string content goes through
      // `tojson` (a string is iterable in Jinja), so the model sees it quoted.
      out.push_back({"ipython", py_dump(ojson(m.content))});
    } else if (m.role == "assistant" && !m.tool_calls.empty()) {
      out.push_back({"assistant", llama_calls(m.tool_calls)});
    } else if (m.role == "user" && !prefixed) {
      out.push_back({"user", llama_tool_prompt(tools) + std::string(trim(m.content))});
      prefixed = true;
    } else {
      out.push_back({m.role, m.content});
    }
  }
  if (!prefixed) {
    return bad_request("messages", "the model's chat template puts the tools in the first user message, and "
                                   "messages holds none");
  }
  return out;
}

bool has_tool_parts(const std::vector<ApiMessage>& messages) {
  return std::any_of(messages.begin(), messages.end(),
                     [](const ApiMessage& m) { return m.role == "tool" || !m.tool_calls.empty(); });
}

// One call's object: {"name": a tool's name, args_key: an object or a string
// holding one} (kLlama31 also takes "arguments"); nullopt when it is not one.
std::optional<ToolCall> read_call(std::string_view body, const char* args_key, bool also_arguments,
                                  const std::vector<ToolFunction>& tools) {
  const ojson v = ojson::parse(body, nullptr, /*allow_exceptions=*/false);
  if (v.is_discarded() || !v.is_object()) return std::nullopt;
  const auto name = v.find("name");
  if (name == v.end() || !name->is_string() || !has_tool(tools, name->get_ref<const std::string&>())) {
    return std::nullopt;
  }
  auto args = v.find(args_key);
  if (args == v.end() && also_arguments) args = v.find("arguments");
  if (args == v.end()) return std::nullopt;
  ojson a = *args;
  if (a.is_string()) a = ojson::parse(a.get_ref<const std::string&>(), nullptr, false);
  if (a.is_discarded() || !a.is_object()) return std::nullopt;
  return ToolCall{"", name->get<std::string>(), a.dump(-1, ' ', false, ojson::error_handler_t::replace)};
}

std::string call_id(const std::string& id_base, size_t index) {
  return "call_" + id_base + "_" + std::to_string(index);
}

// The parts of `s` between top-level ';' (outside JSON strings, brackets).
std::vector<std::string_view> split_top_level(std::string_view s) {
  std::vector<std::string_view> parts;
  int depth = 0;
  bool in_string = false, escaped = false;
  size_t start = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      ++depth;
    } else if (c == '}' || c == ']') {
      --depth;
    } else if (c == ';' && depth == 0) {
      parts.push_back(s.substr(start, i - start));
      start = i + 1;
    }
  }
  parts.push_back(s.substr(start));
  return parts;
}

// kLlama31: the whole output as calls (each part must be one), or nullopt.
std::optional<std::vector<ToolCall>> llama_output_calls(std::string_view text, const std::vector<ToolFunction>& tools,
                                                        const std::string& id_base) {
  const std::string_view t = trim(text);
  if (t.empty() || t.front() != '{') return std::nullopt;
  std::vector<ToolCall> calls;
  for (std::string_view part : split_top_level(t)) {
    std::optional<ToolCall> c = read_call(trim(part), "parameters", /*also_arguments=*/true, tools);
    if (!c) return std::nullopt;
    c->id = call_id(id_base, calls.size());
    calls.push_back(std::move(*c));
  }
  return calls;
}

// The longest end of `s` that is a proper beginning of `tag`.
size_t partial_tag_at_end(std::string_view s, std::string_view tag) {
  for (size_t n = std::min(s.size(), tag.size() - 1); n > 0; --n) {
    if (s.substr(s.size() - n) == tag.substr(0, n)) return n;
  }
  return 0;
}

// The schema of a forced call: one tool's object (kNamed) or anyOf them all
// (kRequired); "" when no tool matches.
// A tool's parameters move under the call schema, so the references inside
// them (Pydantic's "#/$defs/Model", a recursive "#") would point nowhere: the
// parameters become the call schema's $defs/<base> and their own definitions
// $defs/<base>_<name>, and every "$ref" is rewritten to match.
void rebase_refs(ojson& j, const std::string& base) {
  if (j.is_array()) {
    for (ojson& v : j) rebase_refs(v, base);
    return;
  }
  if (!j.is_object()) return;
  for (auto& [key, v] : j.items()) {
    if (key != "$ref" || !v.is_string()) {
      rebase_refs(v, base);
      continue;
    }
    std::string r = v.get<std::string>();
    bool moved = false;
    for (const std::string d : {"#/$defs/", "#/definitions/"}) {
      if (r.rfind(d, 0) == 0) {
        r = "#/$defs/" + base + "_" + r.substr(d.size());
        moved = true;
        break;
      }
    }
    if (!moved && (r == "#" || r.rfind("#/", 0) == 0)) r = "#/$defs/" + base + r.substr(1);
    v = r;
  }
}

// The tool's parameters as a reference to their new place, their definitions added to `defs`.
ojson hoisted_parameters(const std::string& parameters, size_t k, ojson& defs) {
  ojson params = parse_ours(parameters);
  const std::string base = "tool" + std::to_string(k);
  rebase_refs(params, base);
  for (const char* key : {"$defs", "definitions"}) {
    if (!params.is_object() || !params.contains(key)) continue;
    if (params[key].is_object()) {
      for (auto& [name, def] : params[key].items()) defs[base + "_" + name] = def;
    }
    params.erase(key);
  }
  defs[base] = std::move(params);
  return ojson{{"$ref", "#/$defs/" + base}};
}

std::string call_schema(const std::vector<ToolFunction>& tools, const ToolChoice& choice, const char* args_key) {
  ojson any = ojson::array();
  ojson defs = ojson::object();
  for (size_t k = 0; k < tools.size(); ++k) {
    const ToolFunction& t = tools[k];
    if (choice.mode == ToolChoiceMode::kNamed && t.name != choice.name) continue;
    ojson o = ojson::object();
    o["type"] = "object";
    o["properties"] = ojson::object();
    o["properties"]["name"] = ojson{{"const", t.name}};
    o["properties"][args_key] = hoisted_parameters(t.parameters, k, defs);
    o["required"] = ojson::array({"name", args_key});
    any.push_back(std::move(o));
  }
  if (any.empty()) return {};
  ojson schema = choice.mode == ToolChoiceMode::kNamed ? any[0] : ojson{{"anyOf", any}};
  schema["$defs"] = std::move(defs);
  return schema.dump(-1, ' ', false, ojson::error_handler_t::replace);
}

}  // namespace tool_calls_impl

namespace tci = tool_calls_impl;

std::optional<ApiError> parse_tools(const nlohmann::json& body, std::vector<ToolFunction>& tools, ToolChoice& choice) {
  return tci::parse_tools_impl(body, tools, choice);
}

std::optional<ApiError> parse_tools(const nlohmann::ordered_json& body, std::vector<ToolFunction>& tools,
                                    ToolChoice& choice) {
  return tci::parse_tools_impl(body, tools, choice);
}

std::optional<ApiError> parse_message_tool_calls(const nlohmann::json& msg, const std::string& where,
                                                 std::vector<ToolCall>& out) {
  return tci::parse_message_tool_calls_impl(msg, where, out);
}

std::optional<ApiError> parse_message_tool_calls(const nlohmann::ordered_json& msg, const std::string& where,
                                                 std::vector<ToolCall>& out) {
  return tci::parse_message_tool_calls_impl(msg, where, out);
}

bool tools_described(const std::vector<ToolFunction>& tools, const ToolChoice& choice) {
  return !tools.empty() && choice.mode != ToolChoiceMode::kNone;
}

ApiResult<std::vector<ChatMessage>> render_tool_messages(ToolFormat format, const std::vector<ApiMessage>& messages,
                                                         const std::vector<ToolFunction>& tools,
                                                         const ToolChoice& choice, const std::string& default_system) {
  const bool describe = tools_described(tools, choice);
  if (!describe && !tci::has_tool_parts(messages)) {
    std::vector<ChatMessage> out;
    out.reserve(messages.size());
    for (const ApiMessage& m : messages) out.push_back({m.role, m.content});
    return out;
  }
  switch (format) {
    case ToolFormat::kHermes: return tci::render_hermes(messages, tools, describe, default_system);
    case ToolFormat::kLlama31: return tci::render_llama31(messages, tools, describe);
    case ToolFormat::kNone: break;
  }
  // Name what asked for a tool format: the tools, else the first tool turn.
  std::string param = "tools";
  for (size_t i = 0; !describe && i < messages.size(); ++i) {
    const ApiMessage& m = messages[i];
    if (m.role != "tool" && m.tool_calls.empty()) continue;
    param = "messages[" + std::to_string(i) + "]" + (m.role == "tool" ? "" : ".tool_calls");
    break;
  }
  return tci::bad_request(param, param + ": the model's chat template has no tool-call format; serve a model whose "
                                         "template has one, or set chat_template to \"hermes\"/\"qwen2.5\"/\"llama3.1\" "
                                         "in cluster.json");
}

GrammarSpec tool_call_grammar(ToolFormat format, const std::vector<ToolFunction>& tools, const ToolChoice& choice) {
  GrammarSpec g;
  const bool forced = choice.mode == ToolChoiceMode::kRequired || choice.mode == ToolChoiceMode::kNamed;
  if (!forced || tools.empty() || format == ToolFormat::kNone) return g;
  g.text = tci::call_schema(tools, choice, format == ToolFormat::kHermes ? "arguments" : "parameters");
  if (g.text.empty()) return g;
  g.kind = GrammarKind::kJsonSchema;
  if (format == ToolFormat::kHermes) {
    g.prefix = std::string(tci::kOpenTag) + "\n";
    g.suffix = "\n" + std::string(tci::kCloseTag);
  }
  return g;
}

ParsedOutput parse_tool_output(ToolFormat format, std::string_view text, const std::vector<ToolFunction>& tools,
                               const std::string& id_base) {
  ParsedOutput out;
  if (format == ToolFormat::kLlama31) {
    if (auto calls = tci::llama_output_calls(text, tools, id_base)) {
      out.calls = std::move(*calls);
    } else {
      out.content = std::string(text);
    }
    return out;
  }
  if (format != ToolFormat::kHermes) {
    out.content = std::string(text);
    return out;
  }
  // The reply's whitespace is kept but where a call begins or ends it: before
  // a first call, after a last one.
  size_t pos = 0;
  bool text_before_call = false, text_after_call = false;
  while (true) {
    const size_t open = text.find(tci::kOpenTag, pos);
    const size_t close = open == std::string_view::npos ? open : text.find(tci::kCloseTag, open + tci::kOpenTag.size());
    const bool last = close == std::string_view::npos;
    const std::string_view body = last ? std::string_view() : text.substr(open + tci::kOpenTag.size(), close - open - tci::kOpenTag.size());
    std::optional<ToolCall> c = last ? std::nullopt : tci::read_call(tci::trim(body), "arguments", false, tools);
    const std::string_view seg = c ? text.substr(pos, open - pos) : text.substr(pos, last ? std::string_view::npos : close + tci::kCloseTag.size() - pos);
    out.content += seg;
    const bool has_text = !tci::trim(seg).empty();
    text_after_call = text_after_call || has_text;
    if (out.calls.empty()) text_before_call = text_before_call || has_text;
    if (last) break;
    if (c) {
      c->id = tci::call_id(id_base, out.calls.size());
      out.calls.push_back(std::move(*c));
      text_after_call = false;
    }
    pos = close + tci::kCloseTag.size();
  }
  if (!out.calls.empty() && !text_before_call) out.content = std::string(tci::ltrim(out.content));
  if (!out.calls.empty() && !text_after_call) out.content = std::string(tci::rtrim(out.content));
  return out;
}

ToolCallStream::ToolCallStream(ToolFormat format, std::vector<ToolFunction> tools, std::string id_base)
    : format_(format), tools_(std::move(tools)), id_base_(std::move(id_base)) {}

void ToolCallStream::content(std::string_view text, Piece& out) {
  if (!started_) {  // leading whitespace: kept for the first text, dropped if a call comes first
    const std::string_view rest = tci::ltrim(text);
    if (calls_ == 0) pending_ws_ += text.substr(0, text.size() - rest.size());
    text = rest;
    if (text.empty()) return;
    started_ = true;
  }
  size_t end = text.size();
  while (end > 0 && tci::is_space(text[end - 1])) --end;
  if (end == 0) {  // whitespace waits: dropped if the reply ends with a call
    pending_ws_ += text;
    return;
  }
  after_call_ = false;
  out.content += pending_ws_;
  out.content += text.substr(0, end);
  pending_ws_ = std::string(text.substr(end));
}

void ToolCallStream::feed_hermes(std::string_view text, Piece& out) {
  const size_t scanned = held_.size();
  held_ += text;
  size_t from = in_block_ ? (scanned >= tci::kCloseTag.size() ? scanned - tci::kCloseTag.size() + 1 : 0) : 0;
  while (true) {
    if (!in_block_) {
      const size_t open = held_.find(tci::kOpenTag);
      if (open == std::string::npos) {
        const size_t keep = tci::partial_tag_at_end(held_, tci::kOpenTag);
        content(std::string_view(held_).substr(0, held_.size() - keep), out);
        held_.erase(0, held_.size() - keep);
        return;
      }
      content(std::string_view(held_).substr(0, open), out);
      held_.erase(0, open + tci::kOpenTag.size());
      in_block_ = true;
      from = 0;
    }
    const size_t close = held_.find(tci::kCloseTag, from);
    if (close == std::string::npos) return;
    const std::string_view body = std::string_view(held_).substr(0, close);
    if (std::optional<ToolCall> c = tci::read_call(tci::trim(body), "arguments", false, tools_)) {
      c->id = tci::call_id(id_base_, static_cast<size_t>(calls_++));
      out.calls.push_back(std::move(*c));
      if (!started_) pending_ws_.clear();  // the reply begins with a call
      after_call_ = true;
    } else {
      content(std::string(tci::kOpenTag) + std::string(body) + std::string(tci::kCloseTag), out);
    }
    held_.erase(0, close + tci::kCloseTag.size());
    in_block_ = false;
  }
}

ToolCallStream::Piece ToolCallStream::feed(std::string_view text) {
  Piece out;
  if (format_ == ToolFormat::kHermes) {
    feed_hermes(text, out);
    return out;
  }
  if (format_ != ToolFormat::kLlama31 || llama_ == LlamaMode::kText) {
    out.content = std::string(text);
    return out;
  }
  held_ += text;
  if (llama_ == LlamaMode::kUndecided) {
    const size_t first = held_.find_first_not_of(" \t\n\r\f\v");
    if (first == std::string::npos) return out;
    if (held_[first] == '{') {
      llama_ = LlamaMode::kHolding;
    } else {
      llama_ = LlamaMode::kText;
      out.content = std::move(held_);
      held_.clear();
    }
  }
  return out;
}

ToolCallStream::Piece ToolCallStream::finish() {
  Piece out;
  if (format_ == ToolFormat::kHermes) {
    // An unterminated block, or a possible tag start, is content.
    content((in_block_ ? std::string(tci::kOpenTag) : std::string()) + held_, out);
    held_.clear();
    in_block_ = false;
    if (!after_call_) out.content += pending_ws_;  // trailing whitespace, unless the reply ends with a call
    pending_ws_.clear();
    return out;
  }
  if (format_ == ToolFormat::kLlama31 && llama_ == LlamaMode::kHolding) {
    if (auto calls = tci::llama_output_calls(held_, tools_, id_base_)) {
      calls_ = static_cast<int>(calls->size());
      out.calls = std::move(*calls);
    } else {
      out.content = std::move(held_);
    }
  } else {
    out.content = std::move(held_);
  }
  held_.clear();
  return out;
}

}  // namespace pd::router
