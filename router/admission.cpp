// Whether a request is accepted: context, queue bounds, cluster state (see admission.h).
#include "router/admission.h"

#include <algorithm>

#include "router/answer.h"

namespace pd::router {

ApiResult<std::vector<int32_t>> fit_context(Endpoint ep, const ApiRequest& api, const std::vector<Prompt>& prompts,
                                            int context) {
  std::vector<int32_t> max_tokens(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    // Named as the client wrote it: the element of a prompt array, even of one.
    const std::string name = prompt_name(ep, api.prompt_batch, i);
    const int64_t n = static_cast<int64_t>(prompts[i].ids.size());
    if (n == 0) return api_error(400, name + " is empty", name);
    if (n >= context)
      return api_error(400, name + " has " + std::to_string(n) + " tokens; the model's context is " +
                                std::to_string(context),
                       name);
    if (api.max_tokens_given) {
      // The value the client sent (sampling.max_tokens is clamped to int32).
      if (n + api.max_tokens_sent > context)
        return api_error(400, api.max_tokens_field + " " + std::to_string(api.max_tokens_sent) + " + " +
                                  std::to_string(n) + " prompt tokens" + (api.prompt_batch ? " of " + name : "") +
                                  " exceeds the model's context of " + std::to_string(context) + " tokens",
                         api.max_tokens_field);
      max_tokens[i] = api.sampling.max_tokens;
    } else {
      // OpenAI's defaults: 16 for completions; chat runs to the end of the context.
      const int64_t left = context - n;
      max_tokens[i] = static_cast<int32_t>(ep == Endpoint::kCompletions ? std::min<int64_t>(16, left) : left);
    }
    if (api.min_tokens > max_tokens[i])
      return api_error(400, "min_tokens " + std::to_string(api.min_tokens) + " is more than the " +
                                std::to_string(max_tokens[i]) + " tokens " + name + " may generate",
                       "min_tokens");
  }
  return max_tokens;
}

int64_t answer_entries(const ApiRequest& api, const std::vector<Prompt>& prompts, const std::vector<int32_t>& max_tokens) {
  const int64_t per_token = 1 + std::max<int64_t>(0, api.sampling.logprobs);
  int64_t entries = 0;
  for (size_t i = 0; i < prompts.size() && i < max_tokens.size(); ++i) {
    const int64_t tokens = int64_t{max_tokens[i]} + (api.echo ? static_cast<int64_t>(prompts[i].ids.size()) : 0);
    entries += int64_t{api.n} * tokens * per_token;  // <= 128 x 2^32 x 21 in all: no overflow
  }
  return entries;
}

std::optional<ApiError> check_answer_size(const ApiRequest& api, const std::vector<Prompt>& prompts,
                                          const std::vector<int32_t>& max_tokens, int64_t limit) {
  if (api.stream) return std::nullopt;
  const int64_t entries = answer_entries(api, prompts, max_tokens);
  if (entries <= limit) return std::nullopt;
  const bool chat = api.endpoint == Endpoint::kChatCompletions;
  const char* logprobs_field = chat ? "top_logprobs" : "logprobs";
  const int64_t alternatives = std::max<int64_t>(0, api.sampling.logprobs);
  const int32_t most_tokens = max_tokens.empty() ? 0 : *std::max_element(max_tokens.begin(), max_tokens.end());
  const int64_t choices = static_cast<int64_t>(prompts.size()) * api.n;
  std::string message = "a non-streamed answer of " + std::to_string(choices) + " choice" + (choices == 1 ? "" : "s") +
                        " (prompts x n) x " + std::to_string(most_tokens) + " tokens (max_tokens" +
                        (api.echo ? ", plus the echoed prompt" : "") + ") x (1 + " + std::to_string(alternatives) + " " +
                        logprobs_field + ") would hold " + std::to_string(entries) +
                        " token entries, over this server's limit of " + std::to_string(limit) +
                        " (router.max_answer_entries); lower n, max_tokens or " + logprobs_field +
                        ", or stream the answer (\"stream\": true)";
  const std::string param = api.n > 1 ? "n" : alternatives > 0 ? logprobs_field : "max_tokens";
  return api_error(400, std::move(message), param);
}

std::optional<ApiError> check_kv_fit(Endpoint ep, const ApiRequest& api, const std::vector<Prompt>& prompts,
                                     const std::vector<int32_t>& max_tokens, int64_t decode_kv_tokens) {
  if (decode_kv_tokens <= 0) return std::nullopt;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const int64_t n = static_cast<int64_t>(prompts[i].ids.size());
    if (n + max_tokens[i] <= decode_kv_tokens) continue;
    const std::string name = prompt_name(ep, api.prompt_batch, i);
    if (api.prompt_only)  // max_tokens 0: the one token computed with the prompt is not the client's to lower
      return api_error(400,
                       name + "'s " + std::to_string(n) + " tokens and the token computed with them need more KV cache"
                       " than a decode rank holds: " + std::to_string(decode_kv_tokens) +
                       " tokens (kv.decode_budget_mb); shorten " + name,
                       name);
    return api_error(400,
                     name + "'s " + std::to_string(n) + " tokens + " + std::to_string(max_tokens[i]) + " to generate (" +
                         api.max_tokens_field + (api.max_tokens_given ? "" : ", by default") +
                         ") need more KV cache than a decode rank holds: " + std::to_string(decode_kv_tokens) +
                         " tokens (kv.decode_budget_mb); lower " + api.max_tokens_field,
                     n < decode_kv_tokens ? api.max_tokens_field : name);
  }
  return std::nullopt;
}

std::optional<Rejection> check_capacity(const ApiRequest& api, int n_choices, const ClusterState& cluster,
                                        const ClusterConfig::Router& limits) {
  const auto retry_after = retry_after_header(limits.retry_after_s);
  if (n_choices > 1 && n_choices > limits.max_queued)  // could never be queued at once: retrying would not help
    return Rejection{api_error(400, std::to_string(n_choices) + " choices (prompts x n) is more than this server queues at once (" +
                                        std::to_string(limits.max_queued) + ", router.max_queued)",
                               api.n > 1 ? "n" : "prompt"),
                     {}};
  if (cluster.stopping) return Rejection{api_error(503, "the server is shutting down"), retry_after};
  // No path, and none coming by itself (a role's ranks down or drained out):
  // at once. While the cluster starts, or its pools have not joined yet,
  // requests wait in the queue (timeouts.queue_ms).
  if (!cluster.ready && (cluster.degraded || cluster.pool_left))
    return Rejection{api_error(503, "no prefill->decode path is up (" + cluster.not_ready_reason + "); retry later"),
                     retry_after};
  if (cluster.queued + n_choices > limits.max_queued) return queue_full(limits);
  return std::nullopt;
}

Rejection queue_full(const ClusterConfig::Router& limits) {
  return Rejection{api_error(503, "the router's queue has no room for this request (it holds at most " +
                                      std::to_string(limits.max_queued) +
                                      " waiting choices, router.max_queued); retry later"),
                   retry_after_header(limits.retry_after_s)};
}

}  // namespace pd::router
