// OpenAI tool calls as pure functions: reading a request's `tools` and
// `tool_choice`, writing the tools and the earlier tool turns into the
// messages a chat template renders (in the template's own tool format), the
// grammar that forces a call, and splitting a model's output (whole or as it
// streams) into content and calls. No I/O; every function may be called from
// any thread (a ToolCallStream belongs to one choice and one thread at a time).
//
// The formats (pd::ToolFormat, read off the chat template):
//  - kHermes (Qwen2.5, Qwen3, NousHermes): the tools are listed in the system
//    message; a call is <tool_call>\n{"name": .., "arguments": {..}}\n</tool_call>
//    anywhere in the reply; results go back as <tool_response> blocks in a user turn.
//  - kLlama31 (Llama 3.1+, tools in the user message): the tools are listed in
//    the first user message; a call is the whole reply {"name": .., "parameters":
//    {..}} (several joined by ";"); results go back as "ipython" turns.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "router/openai_api.h"
#include "sampling/grammar_spec.h"
#include "tokenizer/tokenizer.h"

namespace pd::router {

// The most tools one request may give (OpenAI's bound).
inline constexpr size_t kMaxTools = 128;
// The longest function name (OpenAI's bound): 1..64 of [A-Za-z0-9_-].
inline constexpr size_t kMaxToolNameChars = 64;

// Reads "tools" (OpenAI: [{"type": "function", "function": {"name",
// "description"?, "parameters"?, "strict"?}}]) and "tool_choice" ("auto" |
// "none" | "required" | {"type": "function", "function": {"name"}}) from a chat
// request body (an object). Absent, null or [] tools = none. tool_choice
// defaults to "auto" with tools and "none" without; with no tools "auto" is
// "none". A 400 naming the field at fault: tools not an array or longer than
// kMaxTools ("tools"); a tool or its function not an object, a type other than
// "function", an unknown key ("tools[i].KEY", "tools[i].function.KEY"); a name
// missing, not 1..64 of [A-Za-z0-9_-] or given twice ("tools[i].function.name");
// parameters not an object ("tools[i].function.parameters"), description not a
// string, strict not a boolean; tool_choice malformed, "required" or a named
// function without tools, or a name not among the tools ("tool_choice").
// On success fills `tools` and `choice` (replacing what they held).
// The ordered_json overload keeps the client's key order in `parameters`
// (what the model is shown and the order a grammar writes properties in);
// nlohmann::json sorts keys.
std::optional<ApiError> parse_tools(const nlohmann::json& body, std::vector<ToolFunction>& tools,
                                    ToolChoice& choice);
std::optional<ApiError> parse_tools(const nlohmann::ordered_json& body, std::vector<ToolFunction>& tools,
                                    ToolChoice& choice);

// Reads an assistant message's "tool_calls" ([{"id", "type": "function",
// "function": {"name", "arguments": a string holding a JSON object}}]) into
// `out` (appended; arguments re-dumped compactly). Absent or null: nothing.
// A bad shape is a 400 naming the path under `where` (e.g. "messages[2]"):
// "messages[2].tool_calls", "...tool_calls[0].id", "...tool_calls[0].type",
// "...tool_calls[0].function.name", "...tool_calls[0].function.arguments".
std::optional<ApiError> parse_message_tool_calls(const nlohmann::json& msg, const std::string& where,
                                                 std::vector<ToolCall>& out);
std::optional<ApiError> parse_message_tool_calls(const nlohmann::ordered_json& msg, const std::string& where,
                                                 std::vector<ToolCall>& out);

// The messages the chat template renders, the tools and the tool turns
// written in `format`'s words (exactly as the model's own Jinja writes them):
//  kHermes: the tool section ("\n\n# Tools\n\n...<tools>\n" one JSON line per
//    tool "\n</tools>\n\n...</tool_call>") appended to the system message (one
//    made of `default_system` when there is none; the section's leading
//    "\n\n" dropped when that is empty); an assistant's tool_calls appended to
//    its content as "\n<tool_call>\n{"name": "f", "arguments": {..}}\n</tool_call>"
//    each (no leading "\n" on an empty content); consecutive tool messages
//    become one user message of "<tool_response>\n" + content +
//    "\n</tool_response>" blocks joined by "\n".
//  kLlama31: the first user message prefixed with the instructions and each
//    tool's JSON (indent 4) + "\n\n"; an assistant's tool calls as its whole
//    content {"name": "f", "parameters": {..}} (several joined by "; ");
//    tool messages become "ipython" turns whose content is the result as a
//    JSON string (quoted, as the template's `tojson` writes it). Render these with
//    ChatTemplate::with_tools_described() when tools_described() is true.
//  kNone: a 400 naming "tools" when there are tools (tool_choice not none) or
//    tool parts in the messages.
// tool_choice kNone: the tools are not described (as vLLM by default), but
// earlier tool turns still render. With no tools described and no tool parts
// the messages pass through (role, content). kLlama31 with tools described
// and no user message is a 400 naming "messages".
ApiResult<std::vector<ChatMessage>> render_tool_messages(ToolFormat format, const std::vector<ApiMessage>& messages,
                                                         const std::vector<ToolFunction>& tools,
                                                         const ToolChoice& choice, const std::string& default_system);

// Whether render_tool_messages describes the tools to the model: there are
// some and tool_choice is not none.
bool tools_described(const std::vector<ToolFunction>& tools, const ToolChoice& choice);

// The grammar that forces a tool call: tool_choice kRequired (any of the
// tools) or kNamed (that one); an inactive GrammarSpec for kAuto, kNone, no
// tools or ToolFormat::kNone.
//  kHermes: prefix "<tool_call>\n", kJsonSchema {"type": "object", "properties":
//    {"name": {"const": NAME}, "arguments": PARAMS}, "required": ["name",
//    "arguments"]} (kRequired: {"anyOf": [one per tool]}), suffix "\n</tool_call>".
//  kLlama31: no prefix or suffix; "parameters" in place of "arguments".
GrammarSpec tool_call_grammar(ToolFormat format, const std::vector<ToolFunction>& tools, const ToolChoice& choice);

// A finished output split into content and calls.
struct ParsedOutput {
  std::string content;
  std::vector<ToolCall> calls;
};

// kHermes: each <tool_call>...</tool_call> block whose body is a JSON object
// {"name": one of the tools, "arguments": an object or a string holding one}
// becomes a call (arguments re-dumped compactly); the text outside those
// blocks (invalid blocks and an unterminated one included) is the content, as
// the model wrote it but for its ASCII whitespace before a first call and after
// a last one (a reply that made no call is content, verbatim). kLlama31: the output (trimmed) starting with "{"
// and being one or more such objects ({"name", "parameters" (or "arguments")})
// joined by ";" is that many calls and no content; otherwise the output is
// the content, unchanged. kNone: all content. Call ids: "call_" + id_base +
// "_" + index (from 0).
ParsedOutput parse_tool_output(ToolFormat format, std::string_view text, const std::vector<ToolFunction>& tools,
                               const std::string& id_base);

// parse_tool_output as the text streams: feed() each piece as it is
// generated; it returns the content that is safe to send now and the calls
// completed. kHermes holds back text that may begin "<tool_call>", the body of
// an open block, and whitespace that may turn out to be trailing; kLlama31
// holds back an output whose first non-whitespace character is "{" until
// finish(). finish() returns the rest. All the pieces joined give exactly what
// parse_tool_output gives for the whole text (same content, same calls, same ids).
class ToolCallStream {
 public:
  ToolCallStream(ToolFormat format, std::vector<ToolFunction> tools, std::string id_base);

  struct Piece {
    std::string content;
    std::vector<ToolCall> calls;
  };
  Piece feed(std::string_view text);
  Piece finish();  // once, after the last feed
  int calls_so_far() const { return calls_; }

 private:
  void feed_hermes(std::string_view text, Piece& out);
  void content(std::string_view text, Piece& out);  // whitespace kept or dropped as parse_tool_output does

  ToolFormat format_;
  std::vector<ToolFunction> tools_;
  std::string id_base_;
  std::string held_;          // kHermes: a possible tag start or an open block's body; kLlama31: the output
  bool in_block_ = false;     // kHermes: inside <tool_call>, held_ = its body so far
  bool started_ = false;      // kHermes: non-whitespace content was sent
  bool after_call_ = false;   // kHermes: the last thing was a call block
  std::string pending_ws_;    // kHermes: whitespace not yet sent (leading, or after the last content)
  enum class LlamaMode { kUndecided, kHolding, kText } llama_ = LlamaMode::kUndecided;
  int calls_ = 0;
};

}  // namespace pd::router
