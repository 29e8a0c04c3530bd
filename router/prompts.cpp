// The tokens a request's prompt becomes (see prompts.h).
#include "router/prompts.h"

#include <string_view>
#include <utility>

#include "gguf/gguf_reader.h"
#include "router/answer.h"
#include "router/structured_output.h"
#include "router/tool_calls.h"

namespace pd::router {

std::string prompt_name(Endpoint ep, bool batch, size_t i) {
  if (batch && ep == Endpoint::kCompletions) return "prompt[" + std::to_string(i) + "]";
  return ep == Endpoint::kCompletions ? "prompt" : "messages";
}

ApiResult<std::vector<TokenId>> encode_chat(const ModelInfo& model, const std::vector<ApiMessage>& messages,
                                            bool add_generation_prompt, const std::vector<ToolFunction>& tools,
                                            const ToolChoice& tool_choice) {
  if (!model.chat_template) {
    return api_error(400, "messages: this model has no chat template, so it serves /v1/completions only (" +
                              model.no_chat_template + ")",
                     "messages");
  }
  const ChatTemplate& tpl = *model.chat_template;
  ApiResult<std::vector<ChatMessage>> rendered =
      render_tool_messages(tpl.tool_format(), messages, tools, tool_choice, tpl.default_system());
  if (!rendered.is_ok()) return rendered.error();
  auto ids = tools_described(tools, tool_choice)
                 ? tpl.with_tools_described().encode(*model.tokenizer, rendered.value(), add_generation_prompt)
                 : tpl.encode(*model.tokenizer, rendered.value(), add_generation_prompt);
  if (!ids.is_ok()) {
    // A message the template refuses is named first ("messages[1]: ..."): that is the param.
    const std::string& why = ids.status().message();
    if (why.rfind("messages[", 0) == 0 && why.find("]: ") != std::string::npos)
      return api_error(400, why, why.substr(0, why.find("]: ") + 1));
    return api_error(400, "messages: " + why, "messages");
  }
  return std::move(ids).value();
}

std::string choose_chat_template(const std::string& configured, const GgufFile& file, ModelInfo& model) {
  auto tmpl = configured.empty() ? ChatTemplate::from_gguf(file) : ChatTemplate::from_name(configured);
  if (tmpl.is_ok()) {
    model.chat_template = std::move(tmpl).value();
    model.no_chat_template.clear();
    return {};
  }
  model.chat_template.reset();
  model.no_chat_template = configured.empty()
                               ? tmpl.status().message() + "; cluster.json's \"chat_template\" can name one"
                               : tmpl.status().message() + " (config key 'chat_template')";
  return model.no_chat_template;
}

std::vector<TokenId> chat_stop_ids(const ModelInfo& model) {
  if (!model.chat_template) return {};
  return model.chat_template->stop_ids(*model.tokenizer);
}

namespace {

void add_bos(const Tokenizer& tok, std::vector<TokenId>& ids) {
  if (tok.add_bos() && tok.bos_id() >= 0) ids.insert(ids.begin(), tok.bos_id());
}

// Completions prompt `i`: its text encoded, or its token ids as given (checked).
ApiResult<Prompt> encode_completion_prompt(const Tokenizer& tok, const ApiRequest& api, PromptInput& in, size_t i) {
  Prompt p;
  if (!in.is_ids) {
    p.ids = tok.encode(in.text, api.parse_special);
    add_bos(tok, p.ids);
    p.echo = std::move(in.text);
    return p;
  }
  // Token ids are taken as they are (no BOS added).
  for (size_t j = 0; j < in.ids.size(); ++j) {
    if (in.ids[j] < tok.vocab_size()) continue;
    const std::string at = prompt_name(Endpoint::kCompletions, api.prompt_batch, i) + "[" + std::to_string(j) + "]";
    return api_error(400, at + " is token id " + std::to_string(in.ids[j]) + ", outside the vocabulary [0, " +
                              std::to_string(tok.vocab_size()) + ")",
                     at);
  }
  p.ids = std::move(in.ids);
  if (api.echo) p.echo = tok.decode(p.ids);
  return p;
}

}  // namespace

ApiResult<std::vector<Prompt>> encode_prompts(const ModelInfo& model, Endpoint ep, ApiRequest& api) {
  const Tokenizer& tok = *model.tokenizer;
  std::vector<Prompt> prompts;
  if (ep == Endpoint::kCompletions) {
    for (size_t i = 0; i < api.prompts.size(); ++i) {
      ApiResult<Prompt> p = encode_completion_prompt(tok, api, api.prompts[i], i);
      if (!p.is_ok()) return p.error();
      prompts.push_back(std::move(p).value());
    }
    api.prompts.clear();  // every choice gets a copy of `api`: keep it small
    return prompts;
  }
  // The tools and earlier tool turns in the template's own tool format (a 400
  // naming tools when it has none), and the grammar that forces a call.
  ApiResult<std::vector<TokenId>> ids =
      encode_chat(model, api.messages, api.add_generation_prompt, api.tools, api.tool_choice);
  if (!ids.is_ok()) return ids.error();
  const GrammarSpec forced = tool_call_grammar(model.chat_template->tool_format(), api.tools, api.tool_choice);
  if (forced.active()) {
    if (auto e = check_grammar(forced, "tools")) return *e;
    api.sampling.grammar = forced;
  }
  Prompt p;
  p.ids = std::move(ids).value();
  prompts.push_back(std::move(p));
  api.messages.clear();
  return prompts;
}

}  // namespace pd::router
