// Prompts: decides the tokens a request's prompt becomes. Three shapes:
//  - completions text: encoded (special-token text parsed when parse_special),
//    BOS added when the model wants one; the text is what echo shows;
//  - completions token ids: taken as they are (no BOS), each checked against
//    the vocabulary (a 400 naming prompt[i][j]);
//  - chat messages: rendered through the chat template, the template's text
//    encoded with special tokens and each message's content without, so a user
//    cannot inject control tokens by writing "<|im_end|>"; BOS added when wanted.
// Pure functions of the model: any thread.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "router/openai_api.h"
#include "tokenizer/tokenizer.h"
#include "util/status.h"

namespace pd::router {

// What the router knows of the served model.
struct ModelInfo {
  std::unique_ptr<Tokenizer> tokenizer;
  ChatTemplate chat_template;
  int context = 0;
  std::string name;
  std::string kv_dtype = "f16";     // kv.dtype: the workers' KV cache elements
  int64_t kv_bytes_per_token = 0;   // of that cache (0: unknown, e.g. in tests)
};

struct Prompt {
  std::vector<TokenId> ids;
  std::string echo;  // its text, for echo
};

// The request's prompts, tokenized: one per completions prompt, one for the
// chat. Moves the prompts (or messages) out of `api`. A 400 naming the field
// for a token id outside the vocabulary or a chat the template cannot render.
ApiResult<std::vector<Prompt>> encode_prompts(const ModelInfo& model, Endpoint ep, ApiRequest& api);
// The chat `messages` as the template renders them (see above).
Result<std::vector<TokenId>> encode_chat(const ModelInfo& model, const std::vector<ChatMessage>& messages,
                                         bool add_generation_prompt = true);
// How error messages name prompt `i` of `n_prompts`: "prompt[i]" in a batch,
// else "prompt" (completions) or "messages" (chat).
std::string prompt_name(Endpoint ep, size_t n_prompts, size_t i);

}  // namespace pd::router
