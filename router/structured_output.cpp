#include "router/structured_output.h"

#include <cmath>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "grammar/grammar.h"

namespace pd::router {
namespace structured {  // named: this file shares unity batches with openai_api.cpp

using json = nlohmann::ordered_json;

ApiError bad(std::string param, std::string message) { return invalid_request(std::move(param), std::move(message)); }

const char* type_name(const json& v) { return v.type_name(); }

// One constraint read from a field: the spec and the field it came from.
struct Found {
  GrammarSpec spec;
  std::string param;
};

// JSON-schema keywords that constrain a value but that the grammar engine
// does not enforce (it would silently produce values that break them), each
// with why, and whether an empty value ({} or null) says nothing and may pass:
// {} as patternProperties, a dependency map, or if/then/else constrains
// nothing, but "not": {} matches no value and "contains": {} asks for a
// non-empty array. Anything else outside JSON Schema's vocabulary is an
// annotation, as the standard has it, and ignored.
struct Unenforced {
  const char* key;
  const char* why;
  bool empty_is_noop;
};
constexpr Unenforced kUnenforced[] = {
    {"not", "the grammar cannot exclude what a subschema matches", false},
    {"patternProperties", "the grammar cannot keep keys that match a pattern from repeating", true},
    {"propertyNames", "the grammar cannot keep keys that match a pattern from repeating", true},
    {"dependentRequired", "properties required by another one's presence are not enforced", true},
    {"dependentSchemas", "subschemas applied by a property's presence are not enforced", true},
    {"dependencies", "properties required by another one's presence are not enforced", true},
    {"if", "conditional subschemas (if/then/else) are not enforced", true},
    {"then", "conditional subschemas (if/then/else) are not enforced", true},
    {"else", "conditional subschemas (if/then/else) are not enforced", true},
    {"contains", "the grammar cannot require an item to match a subschema", false},
    {"minContains", "the grammar cannot require an item to match a subschema", false},
    {"maxContains", "the grammar cannot require an item to match a subschema", false},
};

// The subschemas of `schema` that are checked in turn: (the keyword's path
// piece, the subschema).
std::vector<std::pair<std::string, const json*>> subschemas(const json& schema) {
  std::vector<std::pair<std::string, const json*>> out;
  for (const char* map : {"properties", "$defs", "definitions"}) {
    const auto it = schema.find(map);
    if (it == schema.end() || !it->is_object()) continue;
    for (const auto& [key, sub] : it->items()) out.emplace_back(std::string(map) + "." + shown_text(key), &sub);
  }
  for (const char* list : {"anyOf", "oneOf", "allOf", "prefixItems", "items"}) {
    const auto it = schema.find(list);
    if (it == schema.end()) continue;
    if (it->is_array()) {
      for (size_t i = 0; i < it->size(); ++i) out.emplace_back(std::string(list) + "[" + std::to_string(i) + "]", &(*it)[i]);
    } else {
      out.emplace_back(list, &*it);
    }
  }
  // The engine applies these to the keys and items the keywords above leave
  // (xgrammar's JSON-schema converter reads them all).
  for (const char* rest : {"additionalProperties", "unevaluatedProperties", "additionalItems", "unevaluatedItems"}) {
    if (const auto it = schema.find(rest); it != schema.end()) out.emplace_back(rest, &*it);
  }
  return out;
}

// The refusal of keyword `key` of the schema at `path`.
ApiError unenforced(const std::string& path, const std::string& key, const std::string& why) {
  const std::string at = path + "." + key;
  return bad(at, at + ": the JSON-schema keyword " + key + " is not supported here: " + why);
}

// `required` may only name properties the schema defines: the grammar writes
// only those, so another one could never be present.
std::optional<ApiError> check_required(const json& schema, const std::string& path) {
  const auto req = schema.find("required");
  if (req == schema.end() || !req->is_array()) return std::nullopt;
  const auto props = schema.find("properties");
  for (const json& name : *req) {
    if (!name.is_string()) continue;  // the engine refuses it with its own reason
    if (props != schema.end() && props->is_object() && props->contains(name.get_ref<const std::string&>())) continue;
    return unenforced(path, "required", "it names \"" + shown_text(name.get_ref<const std::string&>()) +
                                            "\", which is not in the schema's properties");
  }
  return std::nullopt;
}

// The string formats the grammar writes (xgrammar's built-in ones): with one
// of them, or a pattern, the grammar follows it and drops minLength/maxLength.
constexpr const char* kGrammarFormats[] = {"date", "date-time", "duration", "email", "hostname", "ipv4", "ipv6",
                                           "json-pointer", "relative-json-pointer", "time", "uri", "uri-reference",
                                           "uri-template", "uuid"};

// The grammar engine's limits on integer multipleOf (xgrammar 0.2.9): a
// factor up to this, and with bounds, both of them at most this far apart.
constexpr double kMultipleOfMax = 1024, kMultipleOfRangeMax = 10000;

// Number and string keywords the grammar would drop with only a warning:
// multipleOf on a number, a fractional or large one, or one with a single
// bound or a wide range; a string's length bounds beside a pattern or a
// format; a pattern with a lookaround.
std::optional<ApiError> check_scalar_keywords(const json& schema, const std::string& path) {
  auto number = [&](const char* key) -> std::optional<double> {
    const auto it = schema.find(key);
    return it != schema.end() && it->is_number() ? std::optional<double>(it->get<double>()) : std::nullopt;
  };
  if (const auto m = number("multipleOf")) {
    const auto type = schema.find("type");
    const bool integer = type != schema.end() && type->is_string() && *type == "integer";
    std::optional<double> lo = number("minimum"), hi = number("maximum");
    if (!lo) lo = number("exclusiveMinimum");
    if (!hi) hi = number("exclusiveMaximum");
    if (!integer || *m != std::floor(*m) || *m > kMultipleOfMax)
      return unenforced(path, "multipleOf", "only a whole factor up to 1024 of a \"type\": \"integer\" is enforced");
    if (lo.has_value() != hi.has_value() || (lo && *hi - *lo > kMultipleOfRangeMax))
      return unenforced(path, "multipleOf", "with bounds, only with both a lower and an upper bound at most 10000 apart");
  }
  const bool length = schema.contains("minLength") || schema.contains("maxLength");
  if (const auto pattern = schema.find("pattern"); pattern != schema.end() && pattern->is_string()) {
    const std::string& re = pattern->get_ref<const std::string&>();
    for (const char* look : {"(?=", "(?!", "(?<=", "(?<!"})
      if (re.find(look) != std::string::npos) return unenforced(path, "pattern", "lookahead and lookbehind are not enforced");
    if (length) return unenforced(path, "pattern", "minLength and maxLength beside a pattern are not enforced (put the length in the pattern)");
  }
  if (const auto format = schema.find("format"); format != schema.end() && format->is_string() && length) {
    for (const char* f : kGrammarFormats)
      if (*format == f) return unenforced(path, "format", "minLength and maxLength beside a format are not enforced");
  }
  return std::nullopt;
}

// Refuses the keywords of `schema` (at `path`, a request field and the keys
// below it) and of its subschemas that the grammar would not enforce. A schema
// given as JSON text escaped the request's nesting bound: `depth` keeps the
// walk within it.
std::optional<ApiError> check_schema_keywords(const json& schema, const std::string& path, int depth = 0) {
  if (depth > kMaxJsonDepth)
    return bad(path, path + " nests subschemas deeper than the limit of " + std::to_string(kMaxJsonDepth) + " levels");
  if (!schema.is_object()) return std::nullopt;  // true / false, or a shape the engine judges
  for (const Unenforced& u : kUnenforced) {
    const auto it = schema.find(u.key);
    if (it == schema.end()) continue;
    const bool empty = it->is_null() || (it->is_object() && it->empty());
    if (!(empty && u.empty_is_noop)) return unenforced(path, u.key, u.why);
  }
  if (const auto all = schema.find("allOf"); all != schema.end() && all->is_array() && all->size() > 1)
    return unenforced(path, "allOf", "subschemas that must all hold are not merged (one subschema is accepted)");
  if (const auto u = schema.find("uniqueItems"); u != schema.end() && u->is_boolean() && u->get<bool>()) {
    const auto max = schema.find("maxItems");
    if (max == schema.end() || !max->is_number() || max->get<double>() > 1)
      return unenforced(path, "uniqueItems", "the grammar cannot keep array items distinct");
  }
  if (auto e = check_required(schema, path)) return e;
  if (auto e = check_scalar_keywords(schema, path)) return e;
  for (const auto& [piece, sub] : subschemas(schema)) {
    if (auto e = check_schema_keywords(*sub, path + "." + piece, depth + 1)) return e;
  }
  return std::nullopt;
}

std::optional<ApiError> schema_spec(const json& v, const std::string& where, Found& f) {
  if (v.is_string()) {  // a schema given as its JSON text
    json parsed = json::parse(v.get_ref<const std::string&>(), nullptr, /*allow_exceptions=*/false);
    if (parsed.is_discarded() || !parsed.is_object())
      return bad(where, where + " must be a JSON schema (an object, or its JSON text)");
    return schema_spec(parsed, where, f);
  }
  if (!v.is_object()) return bad(where, where + " must be a JSON schema object, got " + type_name(v));
  if (auto e = check_schema_keywords(v, where)) return e;
  f.spec.kind = GrammarKind::kJsonSchema;
  f.spec.text = v.dump(-1, ' ', false, json::error_handler_t::replace);
  f.param = where;
  return std::nullopt;
}

std::optional<ApiError> string_spec(const json& v, const std::string& where, GrammarKind kind, Found& f) {
  if (!v.is_string() || v.get_ref<const std::string&>().empty())
    return bad(where, where + " must be a non-empty string");
  f.spec.kind = kind;
  f.spec.text = v.get<std::string>();
  f.param = where;
  return std::nullopt;
}

// choice: the output is exactly one of the strings.
std::optional<ApiError> choice_spec(const json& v, const std::string& where, Found& f) {
  if (!v.is_array() || v.empty()) return bad(where, where + " must be a non-empty array of strings");
  std::string ebnf = "root ::= ";
  for (size_t i = 0; i < v.size(); ++i) {
    if (!v[i].is_string() || v[i].get_ref<const std::string&>().empty())
      return bad(where, where + "[" + std::to_string(i) + "] must be a non-empty string");
    if (i > 0) ebnf += " | ";
    ebnf += ebnf_literal(v[i].get_ref<const std::string&>());
  }
  f.spec.kind = GrammarKind::kEbnf;
  f.spec.text = std::move(ebnf);
  f.param = where;
  return std::nullopt;
}

std::optional<ApiError> response_format(const json& v, std::optional<Found>& out) {
  if (!v.is_object()) return bad("response_format", std::string("response_format must be an object, got ") + type_name(v));
  for (const auto& [key, value] : v.items()) {
    if (key != "type" && key != "json_schema")
      return bad("response_format", "unknown field: response_format." + shown_text(key));
  }
  const auto type = v.find("type");
  if (type == v.end() || !type->is_string()) return bad("response_format.type", "response_format.type must be a string");
  const std::string& t = type->get_ref<const std::string&>();
  if (t == "text") return std::nullopt;
  if (t == "json_object") {
    out = Found{GrammarSpec{GrammarKind::kJsonObject, "", "", ""}, "response_format"};
    return std::nullopt;
  }
  if (t != "json_schema") {
    return bad("response_format.type", "response_format.type \"" + shown_text(t) +
                                           "\" is not supported (\"text\", \"json_object\" or \"json_schema\")");
  }
  const auto js = v.find("json_schema");
  if (js == v.end() || !js->is_object())
    return bad("response_format.json_schema", "response_format.json_schema is required (an object) with type json_schema");
  for (const auto& [key, value] : js->items()) {
    if (key == "name" || key == "description") {
      if (!value.is_string()) return bad("response_format.json_schema." + key, "response_format.json_schema." + key + " must be a string");
    } else if (key == "strict") {
      if (!value.is_boolean() && !value.is_null())
        return bad("response_format.json_schema.strict", "response_format.json_schema.strict must be a boolean");
    } else if (key != "schema") {
      return bad("response_format.json_schema", "unknown field: response_format.json_schema." + shown_text(key));
    }
  }
  const auto schema = js->find("schema");
  if (schema == js->end() || schema->is_null())
    return bad("response_format.json_schema.schema", "response_format.json_schema.schema is required");
  Found f;
  if (auto e = schema_spec(*schema, "response_format.json_schema.schema", f)) return e;
  out = std::move(f);
  return std::nullopt;
}

// One key of structured_outputs (or a guided_* field: `where` names it).
std::optional<ApiError> constraint_field(const std::string& key, const json& v, const std::string& where, Found& f) {
  if (key == "json") return schema_spec(v, where, f);
  if (key == "regex") return string_spec(v, where, GrammarKind::kRegex, f);
  if (key == "grammar") return string_spec(v, where, GrammarKind::kEbnf, f);
  if (key == "choice") return choice_spec(v, where, f);
  if (key == "json_object") {
    if (!v.is_boolean()) return bad(where, where + " must be a boolean");
    f.spec.kind = v.get<bool>() ? GrammarKind::kJsonObject : GrammarKind::kNone;
    f.param = where;
    return std::nullopt;
  }
  return bad(where, where + " is not supported (json, regex, choice, grammar, json_object)");
}

std::optional<ApiError> structured_outputs(const json& v, std::optional<Found>& out) {
  if (!v.is_object()) return bad("structured_outputs", std::string("structured_outputs must be an object, got ") + type_name(v));
  for (const auto& [key, value] : v.items()) {
    if (value.is_null()) continue;
    const std::string where = "structured_outputs." + shown_text(key);
    Found f;
    if (auto e = constraint_field(key, value, where, f)) return e;
    if (!f.spec.active()) continue;
    if (out) return bad(where, "structured_outputs holds more than one constraint: " + out->param + " and " + where);
    out = std::move(f);
  }
  return std::nullopt;
}

constexpr const char* kGuided[][2] = {
    {"guided_json", "json"}, {"guided_regex", "regex"}, {"guided_choice", "choice"}, {"guided_grammar", "grammar"}};

}  // namespace structured

using structured::Found;
using structured::bad;
using structured::constraint_field;
using structured::kGuided;

bool is_structured_output_field(const std::string& key) {
  if (key == "response_format" || key == "structured_outputs" || key == "guided_decoding_backend") return true;
  for (const auto& g : kGuided)
    if (key == g[0]) return true;
  return false;
}

std::optional<ApiError> check_schema(const nlohmann::ordered_json& schema, const std::string& param) {
  return structured::check_schema_keywords(schema, param);
}

std::optional<ApiError> check_grammar(const GrammarSpec& spec, const std::string& param) {
  if (!spec.active()) return std::nullopt;
  if (spec.text.size() + spec.prefix.size() + spec.suffix.size() > kMaxGrammarBytes)
    return bad(param, param + " is over the limit of " + std::to_string(kMaxGrammarBytes) + " bytes");
  if (Status st = GrammarCompiler::check(spec); !st.is_ok()) {
    ApiError e = bad(param, param + ": " + st.message());
    if (!grammar_engine_built()) e.message = param + ": " + st.message();
    return e;
  }
  return std::nullopt;
}

std::optional<ApiError> parse_structured_output(const nlohmann::ordered_json& body, GrammarSpec& out) {
  out = GrammarSpec{};
  std::vector<Found> found;
  std::optional<Found> one;
  if (const auto v = body.find("response_format"); v != body.end() && !v->is_null()) {
    if (auto e = structured::response_format(*v, one)) return e;
    if (one) found.push_back(std::move(*one));
  }
  one.reset();
  if (const auto v = body.find("structured_outputs"); v != body.end() && !v->is_null()) {
    if (auto e = structured::structured_outputs(*v, one)) return e;
    if (one) found.push_back(std::move(*one));
  }
  for (const auto& g : kGuided) {
    const auto v = body.find(g[0]);
    if (v == body.end() || v->is_null()) continue;
    Found f;
    if (auto e = constraint_field(g[1], *v, g[0], f)) return e;
    if (f.spec.active()) found.push_back(std::move(f));
  }
  if (const auto v = body.find("guided_decoding_backend"); v != body.end() && !v->is_null() && !v->is_string())
    return bad("guided_decoding_backend", "guided_decoding_backend must be a string");
  if (found.empty()) return std::nullopt;
  if (found.size() > 1)
    return bad(found[1].param, "a request may hold one output constraint; got " + found[0].param + " and " + found[1].param);
  if (auto e = check_grammar(found[0].spec, found[0].param)) return e;
  out = std::move(found[0].spec);
  return std::nullopt;
}

}  // namespace pd::router
