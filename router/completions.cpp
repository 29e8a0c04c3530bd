// A completion request on the io threads: parsed, its prompts tokenized
// (prompts.h), admitted (admission.h), fanned out into one Request per choice
// (n per prompt, each with its own seed), and handed to the link thread with
// the client's disconnect hooked (HttpFront, http_front.h).
#include <chrono>
#include <random>

#include "router/answer.h"
#include "router/http_front.h"

namespace pd::router {
namespace {

// A seed for a request that did not give one: per io thread, a generator seeded from the OS.
uint64_t fresh_seed() {
  thread_local std::mt19937_64 gen{(static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}()};
  return gen();
}

}  // namespace

HttpFront::HttpFront(FrontParts parts) : p_(parts) {
  sampling_defaults_.temperature = static_cast<float>(p_.cfg.sampling.temperature);
  sampling_defaults_.top_p = static_cast<float>(p_.cfg.sampling.top_p);
  sampling_defaults_.top_k = p_.cfg.sampling.top_k;
  sampling_defaults_.min_p = static_cast<float>(p_.cfg.sampling.min_p);
  const Tokenizer& tok = *p_.model.tokenizer;
  if (tok.eos_id() >= 0) hidden_ids_.push_back(tok.eos_id());
  chat_stop_ids_ = chat_stop_ids(p_.model);
  hidden_ids_.insert(hidden_ids_.end(), chat_stop_ids_.begin(), chat_stop_ids_.end());
}

ClusterState HttpFront::cluster_state() const {
  LinkSnapshot link = p_.status.snapshot();
  ClusterState s;
  s.stopping = link.state != RouterState::kServing;
  s.ready = link.ready;
  s.degraded = link.degraded;
  s.pool_left = link.pool_left;
  s.not_ready_reason = std::move(link.not_ready_reason);
  s.queued = p_.status.queued();
  s.decode_kv_tokens = link.decode_kv_tokens;
  return s;
}

void HttpFront::handle_completion(Endpoint ep, const HttpRequest& http, std::shared_ptr<ResponseWriter> w) {
  auto reject = [&](const ApiError& e, std::vector<std::pair<std::string, std::string>> headers = {}) {
    p_.metrics.requests_total.inc({"rejected"});
    respond_error(*w, e, std::move(headers));
  };
  ApiResult<ApiRequest> parsed = parse_request(ep, http.body, sampling_defaults_);
  if (!parsed.is_ok()) return reject(parsed.error());
  ApiRequest api = std::move(parsed).value();
  if (auto e = check_model(api.model)) return reject(*e);
  if (auto e = check_logit_bias(api.sampling, p_.model.tokenizer->vocab_size())) return reject(*e);
  if (auto e = check_stop_token_ids(api, p_.model.tokenizer->vocab_size())) return reject(*e);
  ApiResult<std::vector<Prompt>> prompts = encode_prompts(p_.model, ep, api);
  if (!prompts.is_ok()) return reject(prompts.error());
  api.sampling.stop_token_ids = api.stop_token_ids;
  if (ep == Endpoint::kChatCompletions)  // a chat ends at its template's end of turn as at EOS
    api.sampling.stop_token_ids.insert(api.sampling.stop_token_ids.end(), chat_stop_ids_.begin(), chat_stop_ids_.end());
  ApiResult<std::vector<int32_t>> max_tokens = fit_context(ep, api, prompts.value(), p_.model.context);
  if (!max_tokens.is_ok()) return reject(max_tokens.error());
  if (auto e = check_answer_size(api, prompts.value(), max_tokens.value(), p_.cfg.router.max_answer_entries))
    return reject(*e);
  const ClusterState cluster = cluster_state();
  if (auto e = check_kv_fit(ep, api, prompts.value(), max_tokens.value(), cluster.decode_kv_tokens)) return reject(*e);
  const int n_choices = static_cast<int>(prompts.value().size()) * api.n;
  if (auto refused = check_capacity(api, n_choices, cluster, p_.cfg.router))
    return reject(refused->error, std::move(refused->headers));
  // The room is taken here, at once for all the choices: other io threads may
  // have admitted requests since cluster_state() was read.
  if (!p_.status.try_add_queued(n_choices, p_.cfg.router.max_queued)) {
    Rejection full = queue_full(p_.cfg.router);
    return reject(full.error, std::move(full.headers));
  }

  auto response = std::make_shared<Response>();
  response->writer = w;
  response->endpoint = ep;
  response->stream = api.stream;
  response->include_usage = api.include_usage;
  response->created = unix_seconds_now();
  std::vector<std::unique_ptr<Request>> reqs = make_choices(api, prompts.value(), max_tokens.value(), response);
  response->id = make_response_id(ep, response->choices.front());
  response->open = reqs.size();
  // SSE headers go out before the link can send a chunk.
  if (api.stream) w->start_sse();
  post_choices(std::move(reqs), *response);
}

std::vector<std::unique_ptr<Request>> HttpFront::make_choices(const ApiRequest& api, std::vector<Prompt>& prompts,
                                                           const std::vector<int32_t>& max_tokens,
                                                           const std::shared_ptr<Response>& response) {
  // Choice j of prompt i has index i * n + j. With a seed, choice j samples
  // with seed + j (reproducible, yet the n choices differ); without one, each
  // gets a fresh seed, as OpenAI and vLLM do.
  std::vector<std::unique_ptr<Request>> reqs;
  // The request's stop tokens print nothing either, unless it asks for them.
  std::vector<TokenId> hidden = hidden_ids_;
  if (!api.include_stop_str_in_output) hidden.insert(hidden.end(), api.stop_token_ids.begin(), api.stop_token_ids.end());
  for (size_t i = 0; i < prompts.size(); ++i) {
    for (int32_t j = 0; j < api.n; ++j) {
      auto req = std::make_unique<Request>();
      req->wire_id = req->http_id = p_.ids.next();
      req->api = api;
      req->api.sampling.max_tokens = max_tokens[i];
      req->api.sampling.min_tokens = api.min_tokens;
      req->api.sampling.seed = api.seed_given ? api.sampling.seed + static_cast<uint64_t>(j) : fresh_seed();
      req->response = response;
      req->counts_prompt = j == 0;
      req->arrived = req->queued_at = env_->now();
      req->prompt = prompts[i].ids;
      ChoiceFormat format;
      format.index = static_cast<int32_t>(i) * api.n + j;
      format.stream = api.stream;
      format.chat = api.endpoint == Endpoint::kChatCompletions;
      format.with_logprobs = api.sampling.logprobs >= 0;
      format.prompt_logprobs = api.sampling.prompt_logprobs;
      format.skip_special = api.skip_special_tokens;
      format.include_stop = api.include_stop_str_in_output;
      format.min_tokens = api.min_tokens;
      req->out = std::make_unique<ChoiceStream>(*p_.model.tokenizer, format, api.stop, hidden,
                                                api.echo ? prompts[i].echo : std::string());
      if (format.chat && p_.model.chat_template && tools_described(api.tools, api.tool_choice)) {
        req->out->parse_tool_calls(p_.model.chat_template->tool_format(), api.tools,
                                   response_id_nonce() + "-" + std::to_string(req->http_id), !api.parallel_tool_calls);
      }
      response->choices.push_back(req->http_id);
      reqs.push_back(std::move(req));
    }
  }
  return reqs;
}

void HttpFront::post_choices(std::vector<std::unique_ptr<Request>> reqs, const Response& response) {
  // The NewRequests go in first and the disconnect hook is registered while
  // the batch still holds the inbox, so the hook's ClientGone lands after them
  // whether it runs later on an io thread or at once, here (a client already
  // gone once the server stopped).
  LinkInbox::Batch batch(p_.inbox);
  for (auto& req : reqs) batch.add(NewRequest{std::move(req)});
  response.writer->on_disconnect([&inbox = p_.inbox, ids = response.choices] { inbox.post(ClientGone{ids}); });
}

}  // namespace pd::router
