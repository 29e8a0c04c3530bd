// A completion request on the io threads: parsed, its prompts tokenized
// (prompts.h), admitted (admission.h), fanned out into one Request per choice
// (n per prompt, each with its own seed), and handed to the link thread with
// the client's disconnect hooked.
#include <chrono>
#include <random>

#include "router/answer.h"
#include "router/router.h"

namespace pd::router {
namespace {

// A seed for a request that did not give one: per io thread, a generator seeded from the OS.
uint64_t fresh_seed() {
  thread_local std::mt19937_64 gen{(static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}()};
  return gen();
}

}  // namespace

ClusterState Router::cluster_state() const {
  ClusterState s;
  s.stopping = stopping_.load();
  s.ready = ready_.load();
  s.degraded = degraded_.load();
  if (!s.ready && s.degraded) {
    std::lock_guard lock(ready_mu_);
    s.not_ready_reason = not_ready_reason_;
  }
  s.queued = queued_.load();
  return s;
}

void Router::handle_completion(Endpoint ep, const HttpRequest& http, std::shared_ptr<ResponseWriter> w) {
  auto reject = [&](const ApiError& e, std::vector<std::pair<std::string, std::string>> headers = {}) {
    metrics_.requests_total.inc({"rejected"});
    respond_error(*w, e, std::move(headers));
  };
  ApiResult<ApiRequest> parsed = parse_request(ep, http.body, sampling_defaults_);
  if (!parsed.is_ok()) return reject(parsed.error());
  ApiRequest api = std::move(parsed).value();
  if (auto e = check_model(api.model)) return reject(*e);
  ApiResult<std::vector<Prompt>> prompts = encode_prompts(model_, ep, api);
  if (!prompts.is_ok()) return reject(prompts.error());
  if (ep == Endpoint::kChatCompletions) {  // a chat ends at its template's end of turn as at EOS
    api.sampling.stop_token_ids = chat_stop_ids_;
  }
  ApiResult<std::vector<int32_t>> max_tokens = fit_context(ep, api, prompts.value(), model_.context);
  if (!max_tokens.is_ok()) return reject(max_tokens.error());
  if (auto e = check_answer_size(api, prompts.value(), max_tokens.value(), cfg_.router.max_answer_entries))
    return reject(*e);
  const int n_choices = static_cast<int>(prompts.value().size()) * api.n;
  if (auto refused = check_capacity(api, n_choices, cluster_state(), cfg_.router))
    return reject(refused->error, std::move(refused->headers));

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
  queued_ += n_choices;
  post_choices(std::move(reqs), *response);
}

std::vector<std::unique_ptr<Request>> Router::make_choices(const ApiRequest& api, std::vector<Prompt>& prompts,
                                                           const std::vector<int32_t>& max_tokens,
                                                           const std::shared_ptr<Response>& response) {
  // Choice j of prompt i has index i * n + j. With a seed, choice j samples
  // with seed + j (reproducible, yet the n choices differ); without one, each
  // gets a fresh seed, as OpenAI and vLLM do.
  std::vector<std::unique_ptr<Request>> reqs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    for (int32_t j = 0; j < api.n; ++j) {
      auto req = std::make_unique<Request>();
      req->wire_id = req->http_id = requests_.new_id();
      req->api = api;
      req->api.sampling.max_tokens = max_tokens[i];
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
      req->out = std::make_unique<ChoiceStream>(*model_.tokenizer, format, api.stop, hidden_ids_,
                                                api.echo ? prompts[i].echo : std::string());
      response->choices.push_back(req->http_id);
      reqs.push_back(std::move(req));
    }
  }
  return reqs;
}

void Router::post_choices(std::vector<std::unique_ptr<Request>> reqs, const Response& response) {
  // The disconnect callback is registered under the inbox lock, so its
  // ClientGone (posted to an io thread, never run inline) always lands after
  // the NewRequests.
  std::lock_guard lock(inbox_mu_);
  response.writer->on_disconnect([this, ids = response.choices] {
    std::lock_guard lock(inbox_mu_);
    inbox_.push_back(ClientGone{ids});
  });
  for (auto& req : reqs) inbox_.push_back(NewRequest{std::move(req)});
}

}  // namespace pd::router
