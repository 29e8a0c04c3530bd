// Admission: decides whether a request is accepted, and with how many tokens
// to generate. In order:
//  - context: each prompt is non-empty and shorter than the model's context,
//    and prompt + max_tokens fits it (max_tokens, when not given, defaults as
//    OpenAI's: 16 for completions, the rest of the context for chat) — a 400;
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

// What admission needs to know of the link thread's state.
struct ClusterState {
  bool stopping = false;
  bool ready = false;
  bool degraded = false;
  std::string not_ready_reason;
  int queued = 0;  // requests accepted, not yet dispatched
};

struct Rejection {
  ApiError error;
  std::vector<std::pair<std::string, std::string>> headers;
};

// Whether `n_choices` more requests may be queued now; the refusal if not.
std::optional<Rejection> check_capacity(const ApiRequest& api, int n_choices, const ClusterState& cluster,
                                        const ClusterConfig::Router& limits);

}  // namespace pd::router
