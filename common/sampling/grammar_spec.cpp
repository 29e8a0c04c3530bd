#include "sampling/grammar_spec.h"

#include <cstdio>

namespace pd {

const char* grammar_kind_name(GrammarKind k) {
  switch (k) {
    case GrammarKind::kNone: return "none";
    case GrammarKind::kJsonObject: return "json_object";
    case GrammarKind::kJsonSchema: return "json_schema";
    case GrammarKind::kRegex: return "regex";
    case GrammarKind::kEbnf: return "grammar";
  }
  return "unknown";
}

std::string ebnf_literal(std::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    const auto b = static_cast<unsigned char>(c);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (b < 0x20 || b == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\x%02x", b);
          out += buf;
        } else {
          out += c;  // UTF-8 bytes go as they are
        }
    }
  }
  out += '"';
  return out;
}

}  // namespace pd
