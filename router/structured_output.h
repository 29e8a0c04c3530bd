// The request fields that constrain a completion's text (structured output):
// OpenAI's response_format, and vLLM's structured_outputs and older guided_*
// fields. Pure functions, callable from any thread.
#pragma once

#include <optional>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "router/openai_api.h"
#include "sampling/grammar_spec.h"

namespace pd::router {

// The top-level fields read here (parse_request hands them over).
bool is_structured_output_field(const std::string& key);

// Reads the constraint of a request body into `out` (inactive when none):
//  - response_format: {"type": "text"} (none), {"type": "json_object"}, or
//    {"type": "json_schema", "json_schema": {"name", "schema", "strict",
//    "description"}} (schema required, an object);
//  - structured_outputs: {"json": schema (object or its text), "regex": str,
//    "choice": [str, ...], "grammar": EBNF str, "json_object": true}, one of them;
//  - guided_json, guided_regex, guided_choice, guided_grammar (vLLM's older
//    names for the same), guided_decoding_backend (accepted, ignored).
// At most one constraint per request. A 400 names the field at fault: a wrong
// shape, a schema/regex/grammar the grammar engine refuses (its message), one
// over kMaxGrammarBytes, or a build without the grammar engine.
// `body` is the request parsed with its keys in order (a schema's properties
// keep their order: the output's keys follow it).
std::optional<ApiError> parse_structured_output(const nlohmann::ordered_json& body, GrammarSpec& out);

// Refuses (a 400 whose param is `param` and the path below it) the keywords of
// a JSON schema, and of its subschemas, that the grammar would not enforce:
// not, allOf of several subschemas, uniqueItems, patternProperties, ... (the
// list and the reasons are in structured_output.cpp and docs/API.md).
std::optional<ApiError> check_schema(const nlohmann::ordered_json& schema, const std::string& param);

// Checks a spec with the grammar engine (no vocabulary needed): a 400 naming
// `param` with the engine's message when it refuses it.
std::optional<ApiError> check_grammar(const GrammarSpec& spec, const std::string& param);

}  // namespace pd::router
