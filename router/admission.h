// Admission: decides whether a request is accepted, and with how many tokens
// to generate. In order:
//  - context: each prompt is non-empty and shorter than the model's context,
//    and prompt + max_tokens fits it (max_tokens, when not given, defaults as
//    OpenAI's: 16 for completions, the rest of the context for chat) — a 400;
//  - the answer's size: a non-streamed answer is held whole until it is sent;
//    one that could hold more than router.max_answer_entries token entries
//    is a 400 (answer_entries() says how they are counted);
//  - queue bounds: a request whose choices (prompts x n) could never be queued
//    at once is a 400; one that finds the router's queue full (router.max_queued)
//    a 503 with Retry-After;
//  - the cluster: a 503 with Retry-After while the router stops, or while no
//    prefill->decode path is up.
// The io threads call these; nothing here waits.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "config/cluster_config.h"
#include "router/openai_api.h"
#include "router/prompts.h"

namespace pd::router {

// The max_tokens of each prompt's choices, or the 400 naming the prompt and field.
ApiResult<std::vector<int32_t>> fit_context(Endpoint ep, const ApiRequest& api, const std::vector<Prompt>& prompts,
                                            int context);

// What a non-streamed answer to `api` may hold, in token entries (a token, or
// one of the logprobs alternatives shown with it): summed over its choices,
// (its max_tokens, plus its prompt's tokens when echo shows them) x (1 + the
// logprobs alternatives asked for per token: completions `logprobs`, chat
// `top_logprobs`). `max_tokens` is fit_context()'s, one per prompt.
int64_t answer_entries(const ApiRequest& api, const std::vector<Prompt>& prompts, const std::vector<int32_t>& max_tokens);

// The 400 for a non-streamed request whose answer_entries() exceed `limit`
// (router.max_answer_entries); nothing for a streamed one (it holds no answer).
// The message names n, max_tokens and the logprobs field and the limit's key;
// `param` is the field most likely at fault: n when it is above 1, else the
// logprobs field when alternatives are asked for, else max_tokens.
std::optional<ApiError> check_answer_size(const ApiRequest& api, const std::vector<Prompt>& prompts,
                                          const std::vector<int32_t>& max_tokens, int64_t limit);

// The 400 for a choice whose prompt plus max_tokens would not fit the KV pool
// of any decode rank (`decode_kv_tokens`: the most tokens an up decode rank's
// whole pool holds; 0 = none has reported yet, nothing is checked): no decode
// rank could ever take it, so retrying would not help. Names
// kv.decode_budget_mb; `param` is the max_tokens field, or the prompt when
// the prompt alone is too long.
std::optional<ApiError> check_kv_fit(Endpoint ep, const ApiRequest& api, const std::vector<Prompt>& prompts,
                                     const std::vector<int32_t>& max_tokens, int64_t decode_kv_tokens);

// What admission needs to know of the link thread's state.
struct ClusterState {
  bool stopping = false;
  bool ready = false;
  bool degraded = false;
  bool pool_left = false;  // a role's every rank left (drained out): none is expected back
  std::string not_ready_reason;
  int queued = 0;  // requests accepted, not yet dispatched
  int64_t decode_kv_tokens = 0;  // the most tokens an up decode rank's KV pool holds (0 = not known yet)
};

struct Rejection {
  ApiError error;
  std::vector<std::pair<std::string, std::string>> headers;
};

// The 503 (with Retry-After) for a request whose choices would take the
// router's queue past router.max_queued.
Rejection queue_full(const ClusterConfig::Router& limits);

// Whether `n_choices` more requests may be queued now; the refusal if not.
// The queue's bound is checked against `cluster.queued` as read; the caller
// then takes the room with LinkStatus::try_add_queued, which refuses (with
// queue_full()) when requests admitted meanwhile took it.
std::optional<Rejection> check_capacity(const ApiRequest& api, int n_choices, const ClusterState& cluster,
                                        const ClusterConfig::Router& limits);

}  // namespace pd::router
