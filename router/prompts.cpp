// The tokens a request's prompt becomes (see prompts.h).
#include "router/prompts.h"

#include <string_view>
#include <utility>

#include "router/answer.h"

namespace pd::router {

std::string prompt_name(Endpoint ep, size_t n_prompts, size_t i) {
  if (n_prompts > 1) return "prompt[" + std::to_string(i) + "]";
  return ep == Endpoint::kCompletions ? "prompt" : "messages";
}

Result<std::vector<TokenId>> encode_chat(const ModelInfo& model, const std::vector<ChatMessage>& messages,
                                         bool add_generation_prompt) {
  // Render the template with a marker in place of each message's content, then
  // encode template text with special tokens and the contents without.
  auto marker = [](size_t i) {
    std::string m(1, '\x1e');
    m += std::to_string(i);
    m += '\x1f';
    return m;
  };
  std::vector<ChatMessage> marked = messages;
  for (size_t i = 0; i < marked.size(); ++i) marked[i].content = marker(i);
  PD_ASSIGN_OR_RETURN(std::string rendered, model.chat_template.apply(marked, add_generation_prompt));
  const Tokenizer& tok = *model.tokenizer;
  std::vector<TokenId> ids;
  auto add = [&](const std::vector<TokenId>& v) { ids.insert(ids.end(), v.begin(), v.end()); };
  size_t pos = 0;
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string m = marker(i);
    const size_t at = rendered.find(m, pos);
    if (at == std::string::npos) return Status::internal("chat template dropped message " + std::to_string(i));
    add(tok.encode(std::string_view(rendered).substr(pos, at - pos), true));
    add(tok.encode(messages[i].content, false));
    pos = at + m.size();
  }
  add(tok.encode(std::string_view(rendered).substr(pos), true));
  return ids;
}

namespace {

void add_bos(const Tokenizer& tok, std::vector<TokenId>& ids) {
  if (tok.add_bos() && tok.bos_id() >= 0) ids.insert(ids.begin(), tok.bos_id());
}

// Completions prompt `i`: its text encoded, or its token ids as given (checked).
ApiResult<Prompt> encode_completion_prompt(const Tokenizer& tok, const ApiRequest& api, PromptInput& in, size_t i) {
  const bool batched = api.prompts.size() > 1;
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
    const std::string at = batched || in.ids.size() > 1 ? "[" + std::to_string(j) + "]" : "";
    return api_error(400, prompt_name(Endpoint::kCompletions, api.prompts.size(), i) + at + " is token id " +
                              std::to_string(in.ids[j]) + ", outside the vocabulary [0, " +
                              std::to_string(tok.vocab_size()) + ")",
                     "prompt");
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
  auto ids = encode_chat(model, api.messages);
  if (!ids.is_ok()) return api_error(400, "messages: " + ids.status().message(), "messages");
  Prompt p;
  p.ids = std::move(ids).value();
  add_bos(tok, p.ids);
  prompts.push_back(std::move(p));
  api.messages.clear();
  return prompts;
}

}  // namespace pd::router
