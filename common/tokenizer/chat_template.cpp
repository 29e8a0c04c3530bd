// ChatTemplate: ChatML rendering, with the default system prompt read off the
// model's own tokenizer.chat_template (Jinja) rather than hard-coded.
#include <string>
#include <string_view>
#include <vector>

#include "gguf/gguf_reader.h"
#include "tokenizer/status_context.h"
#include "tokenizer/tokenizer.h"

namespace pd {
namespace {

constexpr std::string_view kImStart = "<|im_start|>";
constexpr std::string_view kImEnd = "<|im_end|>";
constexpr std::string_view kSystemHeader = "<|im_start|>system\n";

// Reads the Jinja string literal whose opening quote is at tpl[i]; returns its
// value with escapes undone and sets `end` just past the closing quote (or to
// tpl.size() if unterminated).
std::string read_string_literal(std::string_view tpl, size_t i, size_t& end) {
  const char quote = tpl[i];
  std::string value;
  size_t j = i + 1;
  for (; j < tpl.size() && tpl[j] != quote; ++j) {
    if (tpl[j] != '\\' || j + 1 >= tpl.size()) {
      value.push_back(tpl[j]);
      continue;
    }
    const char e = tpl[++j];
    switch (e) {
      case 'n': value.push_back('\n'); break;
      case 't': value.push_back('\t'); break;
      case 'r': value.push_back('\r'); break;
      case '\\': case '\'': case '"': value.push_back(e); break;
      default: value.push_back('\\'); value.push_back(e); break;
    }
  }
  end = j < tpl.size() ? j + 1 : tpl.size();
  return value;
}

// The first word of a statement tag body ("if", "endif", "for", ...).
std::string_view statement_keyword(std::string_view tpl, size_t body) {
  while (body < tpl.size() && (tpl[body] == '-' || tpl[body] == '+' || tpl[body] == ' ' || tpl[body] == '\t' ||
                               tpl[body] == '\n' || tpl[body] == '\r')) {
    ++body;
  }
  size_t e = body;
  while (e < tpl.size() && ((tpl[e] >= 'a' && tpl[e] <= 'z') || tpl[e] == '_')) ++e;
  return tpl.substr(body, e - body);
}

// Finds the default system prompt of a ChatML template: a string literal that
// is output ({{ ... }}) inside a conditional block ({% if %} ... {% endif %},
// e.g. SmolLM2's `if loop.first and messages[0]['role'] != 'system'`, or the
// else-branch of Qwen's) and holds "<|im_start|>system\n<prompt><|im_end|>".
// Returns the prompt, or "" when the template inserts none.
std::string find_default_system(std::string_view tpl) {
  int if_depth = 0;
  size_t i = 0;
  while ((i = tpl.find('{', i)) != std::string_view::npos) {
    if (i + 1 >= tpl.size()) break;
    const char kind = tpl[i + 1];
    if (kind == '#') {  // comment
      const size_t e = tpl.find("#}", i + 2);
      if (e == std::string_view::npos) break;
      i = e + 2;
      continue;
    }
    if (kind != '{' && kind != '%') {
      ++i;
      continue;
    }
    const std::string_view close = kind == '{' ? "}}" : "%}";
    if (kind == '%') {
      const std::string_view kw = statement_keyword(tpl, i + 2);
      if (kw == "if") ++if_depth;
      if (kw == "endif" && if_depth > 0) --if_depth;
    }
    size_t j = i + 2;
    while (j < tpl.size() && tpl.compare(j, close.size(), close) != 0) {
      if (tpl[j] != '\'' && tpl[j] != '"') {
        ++j;
        continue;
      }
      size_t end = 0;
      const std::string lit = read_string_literal(tpl, j, end);
      j = end;
      if (kind != '{' || if_depth == 0) continue;
      const size_t h = lit.find(kSystemHeader);
      if (h == std::string::npos) continue;
      const size_t body = h + kSystemHeader.size();
      const size_t e = lit.find(kImEnd, body);
      if (e != std::string::npos && e > body) return lit.substr(body, e - body);
    }
    i = j + close.size();
  }
  return {};
}

}  // namespace

Result<ChatTemplate> ChatTemplate::from_gguf(const GgufFile& file) {
  auto tpl = file.get_string("tokenizer.chat_template");
  if (!tpl) return tokenizer_internal::with_context(tpl.status(), file.path());
  const std::string& t = *tpl;
  if (t.find(kImStart) == std::string::npos || t.find(kImEnd) == std::string::npos) {
    return Status::unsupported(file.path() +
                               ": tokenizer.chat_template is not a ChatML template (no <|im_start|> / "
                               "<|im_end|>); only ChatML is supported");
  }
  return chatml(find_default_system(t));
}

ChatTemplate ChatTemplate::chatml(std::string default_system) {
  ChatTemplate t;
  t.default_system_ = std::move(default_system);
  return t;
}

Result<std::string> ChatTemplate::apply(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const {
  if (messages.empty()) return Status::invalid_argument("messages is empty");
  size_t bytes = 64 + default_system_.size();
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& role = messages[i].role;
    if (role != "system" && role != "user" && role != "assistant") {
      return Status::invalid_argument("messages[" + std::to_string(i) + "].role '" + role +
                                      "' is not one of system, user, assistant");
    }
    bytes += messages[i].content.size() + role.size() + 32;
  }
  std::string out;
  out.reserve(bytes);
  auto append_turn = [&out](std::string_view role, std::string_view content) {
    out += kImStart;
    out += role;
    out += '\n';
    out += content;
    out += kImEnd;
    out += '\n';
  };
  if (!default_system_.empty() && messages[0].role != "system") append_turn("system", default_system_);
  for (const ChatMessage& m : messages) append_turn(m.role, m.content);
  if (add_generation_prompt) {
    out += kImStart;
    out += "assistant\n";
  }
  return out;
}

}  // namespace pd
