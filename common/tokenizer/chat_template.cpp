// ChatTemplate: the chat formats of ChatML (SmolLM2, Qwen2/2.5, Qwen3), Gemma
// and Llama 3, recognized from the model's tokenizer.chat_template (Jinja) by
// their markers and rendered as that Jinja renders them. The default system
// prompt of a ChatML template is read off the template, not hard-coded.
#include <ctime>
#include <string>
#include <string_view>
#include <vector>

#include "gguf/gguf_reader.h"
#include "tokenizer/status_context.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

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

// Python's str.isspace() for one code point: what Jinja's `trim` strips.
bool py_isspace(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

// Jinja's `trim` (Python's str.strip()): leading and trailing whitespace.
// Bytes that are not UTF-8 are never whitespace.
std::string py_strip(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t begin = 0, end = 0;
  bool seen = false;
  for (size_t i = 0; i < s.size();) {
    const utf8::Step st = utf8::step(p + i, s.size() - i);
    const bool space = st.kind == utf8::StepKind::kValid && py_isspace(utf8::decode_valid(p + i, st.len));
    if (!space) {
      if (!seen) begin = i;
      seen = true;
      end = i + st.len;
    }
    i += st.len;
  }
  return seen ? std::string(s.substr(begin, end - begin)) : std::string();
}

// Python's str.lstrip('\n') / rstrip('\n').
std::string_view lstrip_nl(std::string_view s) {
  while (!s.empty() && s.front() == '\n') s.remove_prefix(1);
  return s;
}
std::string_view rstrip_nl(std::string_view s) {
  while (!s.empty() && s.back() == '\n') s.remove_suffix(1);
  return s;
}

// The literal Llama 3.1's template sets as its default date
// ({%- set date_string = "26 Jul 2024" %}), or "" when there is none.
std::string llama3_default_date(std::string_view tpl) {
  const size_t at = tpl.find("set date_string =");
  if (at == std::string_view::npos) return {};
  size_t q = at + 17;
  while (q < tpl.size() && tpl[q] == ' ') ++q;
  if (q >= tpl.size() || (tpl[q] != '"' && tpl[q] != '\'')) return {};
  size_t end = 0;
  return read_string_literal(tpl, q, end);
}

std::string today_date() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  char buf[32];
  return std::strftime(buf, sizeof(buf), "%d %b %Y", &tm) ? std::string(buf) : std::string();
}

// `ipython`: the template also takes "ipython" turns (a tool's result; Llama 3).
Status check_roles(const std::vector<ChatMessage>& messages, bool ipython) {
  if (messages.empty()) return Status::invalid_argument("messages is empty");
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& role = messages[i].role;
    if (role != "system" && role != "user" && role != "assistant" && !(ipython && role == "ipython")) {
      return Status::invalid_argument("messages[" + std::to_string(i) + "].role '" + role + "' is not one of " +
                                      (ipython ? "system, user, assistant, ipython" : "system, user, assistant"));
    }
  }
  return Status::ok();
}

// Appends to a rendering: template text merges into the previous template
// piece; contents stay pieces of their own (even when empty).
class Segments {
 public:
  void text(std::string_view t) {
    if (t.empty()) return;
    if (out_.empty() || out_.back().is_content) out_.push_back({std::string(), false});
    out_.back().text += t;
  }
  void content(std::string_view c) { out_.push_back({std::string(c), true}); }
  std::vector<ChatSegment> take() { return std::move(out_); }

 private:
  std::vector<ChatSegment> out_;
};

// Qwen3: the last user message (not a tool response); assistant turns after
// it keep their reasoning.
size_t qwen3_last_query(const std::vector<ChatMessage>& messages) {
  size_t last_query = messages.size() - 1;
  for (size_t i = messages.size(); i-- > 0;) {
    const std::string& c = messages[i].content;
    const bool tool_response = c.rfind("<tool_response>", 0) == 0 && c.size() >= 16 &&
                               c.compare(c.size() - 16, 16, "</tool_response>") == 0;
    if (messages[i].role == "user" && !tool_response) {
      last_query = i;
      break;
    }
  }
  return last_query;
}

// Qwen3's assistant turn: <think>...</think> split off the content and kept
// only for turns after the last query.
void qwen3_assistant_turn(Segments& out, const std::vector<ChatMessage>& messages, size_t i, size_t last_query) {
  std::string_view content = messages[i].content, reasoning;
  const size_t close = content.rfind("</think>");
  if (close != std::string_view::npos) {
    const std::string_view before = rstrip_nl(content.substr(0, content.find("</think>")));
    const size_t open = before.rfind("<think>");
    reasoning = lstrip_nl(open == std::string_view::npos ? before : before.substr(open + 7));
    content = lstrip_nl(content.substr(close + 8));
  }
  out.text(kImStart);
  out.text("assistant\n");
  if (i > last_query && (i + 1 == messages.size() || !reasoning.empty())) {
    out.text("<think>\n");
    out.content(rstrip_nl(lstrip_nl(reasoning)));
    out.text("\n</think>\n\n");
    out.content(lstrip_nl(content));
  } else {
    out.content(content);
  }
  out.text(kImEnd);
  out.text("\n");
}

// ChatML (and Qwen3, which reworks its assistant turns).
void render_chatml(Segments& out, const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                   std::string_view default_system, bool qwen3) {
  auto turn = [&](std::string_view role, std::string_view content) {
    out.text(kImStart);
    out.text(role);
    out.text("\n");
    out.content(content);
    out.text(kImEnd);
    out.text("\n");
  };
  if (!default_system.empty() && messages[0].role != "system") {
    out.text(kSystemHeader);
    out.text(default_system);
    out.text(kImEnd);
    out.text("\n");
  }
  const size_t last_query = qwen3_last_query(messages);
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (!qwen3 || m.role != "assistant") {
      turn(m.role, m.content);
      continue;
    }
    qwen3_assistant_turn(out, messages, i, last_query);
  }
  if (add_generation_prompt) {
    out.text(kImStart);
    out.text("assistant\n");
  }
}

// Gemma: the system message folds into the first user turn; roles alternate.
Status render_gemma(Segments& out, const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                    bool system_allowed) {
  size_t first = 0;
  std::string_view system;
  if (messages[0].role == "system") {
    if (!system_allowed) return Status::invalid_argument("messages[0]: this model's template refuses a system message");
    system = messages[0].content;
    first = 1;
  }
  for (size_t i = first; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if ((m.role == "user") != ((i - first) % 2 == 0)) {
      return Status::invalid_argument("messages[" + std::to_string(i) +
                                      "]: conversation roles must alternate user/assistant/user/assistant/...");
    }
    out.text("<start_of_turn>");
    out.text(m.role == "assistant" ? "model" : m.role);
    out.text("\n");
    if (i == first && first == 1) {
      out.content(system);
      out.text("\n\n");
    }
    out.content(py_strip(m.content));
    out.text("<end_of_turn>\n");
  }
  if (add_generation_prompt) out.text("<start_of_turn>model\n");
  return Status::ok();
}

// Llama 3 (3.1+ with date_header: a system header with the knowledge and
// today's dates, holding the system message if any; `tools`: the request's
// tools are described, and the header opens with "Environment: ipython\n").
void render_llama3(Segments& out, const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                   bool date_header, const std::string& date, bool tools) {
  auto header = [&](std::string_view role) {
    out.text("<|start_header_id|>");
    out.text(role);
    out.text("<|end_header_id|>\n\n");
  };
  size_t first = 0;
  if (date_header) {
    std::string_view system;
    if (messages[0].role == "system") {
      first = 1;
      system = messages[0].content;
    }
    header("system");
    if (tools) out.text("Environment: ipython\n");
    out.text("Cutting Knowledge Date: December 2023\nToday Date: ");
    out.text(date.empty() ? today_date() : date);
    out.text("\n\n");
    out.content(py_strip(system));
    out.text("<|eot_id|>");
  }
  for (size_t i = first; i < messages.size(); ++i) {
    header(messages[i].role);
    // A tool's result is written as it is (3.1's template does not trim it).
    out.content(messages[i].role == "ipython" ? messages[i].content : py_strip(messages[i].content));
    out.text("<|eot_id|>");
  }
  if (add_generation_prompt) header("assistant");
}

}  // namespace

Result<ChatTemplate> ChatTemplate::from_gguf(const GgufFile& file) {
  if (!file.find("tokenizer.chat_template")) {
    return Status::not_found(file.path() + ": the model has no chat template (tokenizer.chat_template)");
  }
  auto tpl = file.get_string("tokenizer.chat_template");
  if (!tpl) return tokenizer_internal::with_context(tpl.status(), file.path());
  return from_string(*tpl, file.path());
}

Result<ChatTemplate> ChatTemplate::from_string(std::string_view t, std::string_view source) {
  auto has = [&](std::string_view marker) { return t.find(marker) != std::string_view::npos; };
  if (has(kImStart) && has(kImEnd)) {
    ChatTemplate q = chatml(find_default_system(t));
    // Qwen3: strips <think>...</think> out of earlier assistant turns.
    if (has("</think>")) q.format_ = ChatFormat::kQwen3;
    // Qwen2.5, Qwen3, Hermes: tool calls as <tool_call> blocks.
    if (has("<tool_call>")) q.tool_format_ = ToolFormat::kHermes;
    return q;
  }
  if (has("<start_of_turn>") && has("<end_of_turn>")) return gemma(!has("System role not supported"));
  if (has("<|start_header_id|>") && has("<|end_header_id|>") && has("<|eot_id|>")) {
    const bool dated = has("Cutting Knowledge Date");
    ChatTemplate l = llama3(dated, has("strftime_now") ? std::string() : llama3_default_date(t));
    // Llama 3.1+: tools in the first user message, results as ipython turns.
    if (dated && (has("tools is not none") || has("Environment: ipython"))) l.tool_format_ = ToolFormat::kLlama31;
    return l;
  }
  return Status::unsupported(std::string(source) +
                             ": tokenizer.chat_template is none of the supported formats (ChatML with "
                             "<|im_start|>/<|im_end|>, Gemma with <start_of_turn>/<end_of_turn>, Llama 3 with "
                             "<|start_header_id|>/<|eot_id|>); set \"chat_template\" in cluster.json to serve chats");
}

Result<ChatTemplate> ChatTemplate::from_name(std::string_view name) {
  ChatTemplate t;
  if (name == "chatml") return chatml();
  if (name == "gemma") return gemma();
  if (name == "llama3") return llama3();
  if (name == "llama3.1") {
    t = llama3(/*date_header=*/true, "26 Jul 2024");  // 3.1's template's own date_string
    t.tool_format_ = ToolFormat::kLlama31;
    return t;
  }
  if (name == "hermes" || name == "qwen2.5") {
    t = chatml(name == "hermes" ? "" : "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.");
    t.tool_format_ = ToolFormat::kHermes;
    return t;
  }
  return Status::invalid_argument("chat template '" + std::string(name) +
                                  "' is not one of \"chatml\", \"gemma\", \"llama3\", \"llama3.1\", "
                                  "\"hermes\", \"qwen2.5\"");
}

ChatTemplate ChatTemplate::with_tools_described() const {
  ChatTemplate t = *this;
  t.tools_described_ = tool_format_ == ToolFormat::kLlama31;
  return t;
}

ChatTemplate ChatTemplate::chatml(std::string default_system) {
  ChatTemplate t;
  t.format_ = ChatFormat::kChatml;
  t.default_system_ = std::move(default_system);
  return t;
}

ChatTemplate ChatTemplate::gemma(bool system_allowed) {
  ChatTemplate t;
  t.format_ = ChatFormat::kGemma;
  t.system_allowed_ = system_allowed;
  return t;
}

ChatTemplate ChatTemplate::llama3(bool date_header, std::string date) {
  ChatTemplate t;
  t.format_ = ChatFormat::kLlama3;
  t.date_header_ = date_header;
  t.date_ = std::move(date);
  return t;
}

std::vector<std::string> ChatTemplate::end_of_turn_tokens() const {
  switch (format_) {
    case ChatFormat::kChatml:
    case ChatFormat::kQwen3: return {std::string(kImEnd)};
    case ChatFormat::kGemma: return {"<end_of_turn>"};
    case ChatFormat::kLlama3: return {"<|eot_id|>", "<|eom_id|>"};
  }
  return {};
}

Result<std::vector<ChatSegment>> ChatTemplate::render(const std::vector<ChatMessage>& messages,
                                                      bool add_generation_prompt) const {
  PD_RETURN_IF_ERROR(check_roles(messages, /*ipython=*/format_ == ChatFormat::kLlama3));
  Segments out;
  switch (format_) {
    case ChatFormat::kChatml:
    case ChatFormat::kQwen3:
      render_chatml(out, messages, add_generation_prompt, default_system_, format_ == ChatFormat::kQwen3);
      break;
    case ChatFormat::kGemma:
      PD_RETURN_IF_ERROR(render_gemma(out, messages, add_generation_prompt, system_allowed_));
      break;
    case ChatFormat::kLlama3:
      render_llama3(out, messages, add_generation_prompt, date_header_, date_, tools_described_);
      break;
  }
  return out.take();
}

Result<std::string> ChatTemplate::apply(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const {
  PD_ASSIGN_OR_RETURN(std::vector<ChatSegment> segments, render(messages, add_generation_prompt));
  std::string out;
  for (const ChatSegment& s : segments) out += s.text;
  return out;
}

Result<std::vector<TokenId>> ChatTemplate::encode(const Tokenizer& tok, const std::vector<ChatMessage>& messages,
                                                  bool add_generation_prompt) const {
  PD_ASSIGN_OR_RETURN(std::vector<ChatSegment> segments, render(messages, add_generation_prompt));
  std::vector<TokenId> ids;
  // One BOS: the template's own (Gemma, Llama 3 write bos_token) or the vocabulary's.
  if ((writes_bos() || tok.add_bos()) && tok.bos_id() >= 0) ids.push_back(tok.bos_id());
  bool first = true;
  for (const ChatSegment& s : segments) {
    if (s.text.empty()) continue;
    const std::vector<TokenId> part = tok.encode(s.text, /*parse_special=*/!s.is_content, /*starts_input=*/first);
    ids.insert(ids.end(), part.begin(), part.end());
    first = false;
  }
  return ids;
}

std::vector<TokenId> ChatTemplate::stop_ids(const Tokenizer& tok) const {
  std::vector<TokenId> ids;
  for (const std::string& text : end_of_turn_tokens()) {
    const TokenId id = tok.find_token(text);
    if (id >= 0 && id != tok.eos_id()) ids.push_back(id);
  }
  return ids;
}

}  // namespace pd
