// Prompts: decides the tokens a request's prompt becomes. Three shapes:
//  - completions text: encoded (special-token text parsed when parse_special),
//    BOS added when the model wants one; the text is what echo shows;
//  - completions token ids: taken as they are (no BOS), each checked against
//    the vocabulary (a 400 naming prompt[i][j]);
//  - chat messages: rendered through the chat template, the template's text
//    encoded with special tokens and each message's content without, so a user
//    cannot inject control tokens by writing "<|im_end|>"; one BOS first when
//    the vocabulary adds one or the template writes one (Gemma, Llama 3). A
//    model without a chat template (none in the file, or one not recognized,
//    and none named in cluster.json) answers chats with a 400 saying so.
// Pure functions of the model: any thread.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "router/openai_api.h"
#include "tokenizer/tokenizer.h"
#include "util/status.h"

namespace pd::router {

// What the router knows of the served model.
struct ModelInfo {
  std::unique_ptr<Tokenizer> tokenizer;
  std::optional<ChatTemplate> chat_template;  // none: chat requests get a 400
  std::string no_chat_template;               // why there is none (for that 400)
  int context = 0;
  std::string name;
  std::string kv_dtype = "f16";     // kv.dtype: the workers' KV cache elements
  int64_t kv_bytes_per_token = 0;   // of that cache (0: unknown, e.g. in tests)
  std::string fingerprint;          // gguf_fingerprint of the file ("": unknown, e.g. in tests)
};

struct Prompt {
  std::vector<TokenId> ids;
  std::string echo;  // its text, for echo
};

// The request's prompts, tokenized: one per completions prompt, one for the
// chat. Moves the prompts (or messages) out of `api`. A 400 naming the field
// for a token id outside the vocabulary or a chat the template cannot render.
ApiResult<std::vector<Prompt>> encode_prompts(const ModelInfo& model, Endpoint ep, ApiRequest& api);
// The chat `messages` as the template renders them (see above; their tool
// turns in the template's tool format), BOS included. InvalidArgument (why)
// when the model has no chat template or the messages hold tool turns it has
// no format for.
// With tools (and tool_choice), the tools described in the template's tool
// format as the chat endpoint renders them.
ApiResult<std::vector<TokenId>> encode_chat(const ModelInfo& model, const std::vector<ApiMessage>& messages,
                                         bool add_generation_prompt = true,
                                         const std::vector<ToolFunction>& tools = {},
                                         const ToolChoice& tool_choice = {ToolChoiceMode::kNone, ""});
// The ids of the chat template's end-of-turn tokens that the vocabulary has
// (e.g. Gemma's <end_of_turn>, 106), EOS excluded: a chat reply ends there.
std::vector<TokenId> chat_stop_ids(const ModelInfo& model);
// Sets model.chat_template: the template cluster.json's "chat_template" names
// when `configured` is not empty, else the one the file's
// tokenizer.chat_template is recognized as. Without one (no template in the
// file, or one not recognized) model.no_chat_template says why, and chats get
// a 400 saying so. Returns that reason ("" when there is a template).
std::string choose_chat_template(const std::string& configured, const GgufFile& file, ModelInfo& model);
// How errors name prompt `i`: "prompt[i]" when the request's prompt was an
// array of prompts (even of one), else "prompt" (completions) or "messages" (chat).
std::string prompt_name(Endpoint ep, bool batch, size_t i);

}  // namespace pd::router
