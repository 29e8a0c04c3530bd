// The router's HTTP front: what the io threads do with a request. The routes,
// the API and admin keys, /health, /metrics, /v1/models, /tokenize and
// /detokenize are answered here (http_routes.cpp); a completion is parsed,
// tokenized, admitted and fanned out into its choices (completions.cpp) and
// handed to the link loop through the LinkInbox, as is POST /admin/drain. It
// reads the link's state only through the LinkStatus (front_link.h) and never
// waits on the link.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "config/cluster_config.h"
#include "router/admission.h"
#include "router/front_link.h"
#include "router/http_server.h"
#include "router/metrics.h"
#include "router/prompts.h"
#include "router/router_metrics.h"
#include "util/env.h"

namespace pd::router {

// What the front reads and writes; every reference must outlive the front.
struct FrontParts {
  const ClusterConfig& cfg;
  const ModelInfo& model;
  Registry& registry;       // GET /metrics
  RouterMetrics& metrics;   // requests_total{rejected}
  RequestIds& ids;
  LinkInbox& inbox;
  LinkStatus& status;
};

class HttpFront {
 public:
  explicit HttpFront(FrontParts parts);
  // Where arrival times are read (the link's clock). Before serving; `env` must outlive the front.
  void set_env(const Env* env) { env_ = env; }
  // One HTTP request, already received. Answers through `w`, now or later
  // from the link thread. Any thread; never blocks on the link.
  void submit(HttpRequest http, std::shared_ptr<ResponseWriter> w);

 private:
  // http_routes.cpp
  void respond_health(ResponseWriter& w);
  void handle_drain(const HttpRequest& http, std::shared_ptr<ResponseWriter> w);
  void handle_tokenize(const HttpRequest& http, ResponseWriter& w);
  void handle_detokenize(const HttpRequest& http, ResponseWriter& w);
  // GET /v1/models/{id}: the served model's object, else 404 model_not_found.
  void respond_model(const std::string& id, ResponseWriter& w);
  // 404 model_not_found unless `model` is empty or the served one.
  std::optional<ApiError> check_model(const std::string& model) const;
  // completions.cpp
  void handle_completion(Endpoint ep, const HttpRequest& http, std::shared_ptr<ResponseWriter> w);
  ClusterState cluster_state() const;
  // One Request per choice of `api`'s prompts, answering through `response`.
  std::vector<std::unique_ptr<Request>> make_choices(const ApiRequest& api, std::vector<Prompt>& prompts,
                                                     const std::vector<int32_t>& max_tokens,
                                                     const std::shared_ptr<Response>& response);
  // Hands the choices to the link and hooks the client's disconnect.
  void post_choices(std::vector<std::unique_ptr<Request>> reqs, const Response& response);

  FrontParts p_;
  RequestDefaults sampling_defaults_;    // cfg.sampling, for fields a request omits
  std::vector<TokenId> chat_stop_ids_;   // the chat template's end-of-turn tokens (e.g. <|im_end|>, <end_of_turn>)
  std::vector<TokenId> hidden_ids_;      // EOS + chat_stop_ids_: end generation, print nothing
  const Env* env_ = &system_env();
};

}  // namespace pd::router
