// What a request's output must match (structured output): a JSON schema, any
// JSON object, a regular expression or an EBNF grammar, optionally between two
// literal texts (a tool call's tags). Plain data: the router builds it from the
// request, the wire carries it in SamplingParams, and every rank that samples
// the request's tokens compiles it (grammar/grammar.h).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace pd {

enum class GrammarKind : int32_t {
  kNone = 0,
  kJsonObject = 1,  // any JSON object
  kJsonSchema = 2,  // `text`: a JSON schema (JSON text)
  kRegex = 3,       // `text`: a regular expression the whole output matches
  kEbnf = 4,        // `text`: an EBNF grammar (GBNF syntax) whose start rule is "root"
};
inline constexpr int32_t kGrammarKindMax = 4;

const char* grammar_kind_name(GrammarKind k);

struct GrammarSpec {
  GrammarKind kind = GrammarKind::kNone;
  std::string text;
  std::string prefix;  // literal text the output starts with, before what `kind` matches
  std::string suffix;  // literal text after it
  bool active() const { return kind != GrammarKind::kNone; }
  bool operator==(const GrammarSpec&) const = default;
};

// The most bytes of a grammar's text (a schema, a regex, an EBNF grammar).
inline constexpr size_t kMaxGrammarBytes = 64 * 1024;

// `text` as an EBNF string literal ("..." with \", \\, \n, \r, \t and other
// control bytes as \xNN escaped): matches exactly those bytes.
std::string ebnf_literal(std::string_view text);

}  // namespace pd
