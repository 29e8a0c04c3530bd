// The router's io-thread side: HTTP routing, authentication, request
// validation and tokenization, /tokenize and /detokenize, admission into the
// link thread's inbox. Everything here runs on the HTTP server's threads and
// touches the link thread's state only through inbox_ (router.h).
#include <spdlog/spdlog.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <random>

#include "router/auth.h"
#include "router/router.h"
#include "router/router_errors.h"

namespace pd::router {
namespace {

// A seed for a request that did not give one: per io thread, a generator seeded from the OS.
uint64_t fresh_seed() {
  thread_local std::mt19937_64 gen{(static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}()};
  return gen();
}
int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

// ---------------------------------------------------------------- io threads

void Router::handle_http(HttpRequest http, std::shared_ptr<ResponseWriter> w) {
  const std::string& path = http.target;
  auto method_not_allowed = [&](const char* allow) {
    respond_error(*w, api_error(405, "method " + shown_text(http.method) + " is not allowed on " + shown_text(path) + " (use " + allow + ")"),
                  {{"Allow", allow}});
  };
  if (path == "/health") {
    if (http.method != "GET") return method_not_allowed("GET");
    std::string why, ranks;
    {
      std::lock_guard lock(ready_mu_);
      why = draining_.load() ? "shutting down" : not_ready_reason_;
      ranks = ranks_json_;
    }
    nlohmann::json body;
    const bool ok = ready_.load() && !draining_.load();
    body["status"] = !ok ? "unavailable" : degraded_.load() ? "degraded" : "ok";
    if (!ok) body["reason"] = why;
    body["ranks"] = nlohmann::json::parse(ranks, nullptr, false);
    w->respond(ok ? 200 : 503, "application/json", body.dump());
    return;
  }
  const bool tokenizer = path == "/tokenize" || path == "/detokenize";
  const bool v1 = path.rfind("/v1/", 0) == 0 || path.rfind("/admin/", 0) == 0 || tokenizer;
  const bool needs_key = v1 || (path == "/metrics" && cfg_.http.metrics_require_key);
  if (needs_key && !authorized(http.authorization, cfg_.http.api_key)) {
    ApiError e = api_error(401, "missing or incorrect API key (send 'Authorization: Bearer <key>')", "", "invalid_request_error");
    e.code = "invalid_api_key";
    return respond_error(*w, e, {{"WWW-Authenticate", "Bearer"}});
  }
  if (path == "/metrics") {
    if (http.method != "GET") return method_not_allowed("GET");
    w->respond(200, "text/plain; version=0.0.4; charset=utf-8", metrics_.render());
    return;
  }
  if (path == "/v1/models") {
    if (http.method != "GET") return method_not_allowed("GET");
    w->respond(200, "application/json", models_body(model_.name, unix_now()));
    return;
  }
  if (path == "/admin/drain") {
    if (http.method != "POST") return method_not_allowed("POST");
    return handle_drain(http, std::move(w));
  }
  if (path == "/tokenize" || path == "/v1/tokenize") {
    if (http.method != "POST") return method_not_allowed("POST");
    return handle_tokenize(http, *w);
  }
  if (path == "/detokenize" || path == "/v1/detokenize") {
    if (http.method != "POST") return method_not_allowed("POST");
    return handle_detokenize(http, *w);
  }
  if (path == "/v1/completions" || path == "/v1/chat/completions") {
    if (http.method != "POST") return method_not_allowed("POST");
    handle_completion(path == "/v1/completions" ? Endpoint::kCompletions : Endpoint::kChatCompletions, http,
                      std::move(w));
    return;
  }
  ApiError e = api_error(404, "no route for " + shown_text(http.method) + " " + shown_text(path), "", "invalid_request_error");
  e.code = "not_found";
  respond_error(*w, e);
}

void Router::handle_drain(const HttpRequest& http, std::shared_ptr<ResponseWriter> w) {
  // {"rank": N}: the rank to drain out of the cluster (see /health for ranks).
  const nlohmann::json body = nlohmann::json::parse(http.body, nullptr, false);
  if (body.is_discarded() || !body.is_object())
    return respond_error(*w, api_error(400, "the body must be a JSON object {\"rank\": N}", "", "invalid_request_error"));
  auto it = body.find("rank");
  if (it == body.end() || !it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > (1 << 30))
    return respond_error(*w, api_error(400, "'rank' must be a non-negative integer (a worker rank from /health)", "rank",
                                       "invalid_request_error"));
  std::lock_guard lock(inbox_mu_);
  inbox_.push_back(DrainRank{static_cast<int>(it->get<int64_t>()), std::move(w)});
}

std::optional<ApiError> Router::check_model(const std::string& model) const {
  if (model.empty() || model == model_.name) return std::nullopt;
  ApiError e = api_error(404, "the model '" + shown_text(model) + "' does not exist (this server serves '" + model_.name + "')",
                         "model", "invalid_request_error");
  e.code = "model_not_found";
  return e;
}

void Router::handle_tokenize(const HttpRequest& http, ResponseWriter& w) {
  ApiResult<TokenizeRequest> parsed = parse_tokenize(http.body);
  if (!parsed.is_ok()) return respond_error(w, parsed.error());
  const TokenizeRequest& t = parsed.value();
  if (auto e = check_model(t.model)) return respond_error(w, *e);
  const Tokenizer& tok = *model_.tokenizer;
  std::vector<TokenId> ids;
  if (t.chat) {
    auto chat = encode_chat(t.messages, t.add_generation_prompt);
    if (!chat.is_ok()) return respond_error(w, api_error(400, "messages: " + chat.status().message(), "messages"));
    ids = std::move(chat).value();
  } else {
    ids = tok.encode(t.prompt, t.parse_special);
  }
  if (t.add_special_tokens && tok.add_bos() && tok.bos_id() >= 0) ids.insert(ids.begin(), tok.bos_id());
  w.respond(200, "application/json", tokenize_body(ids, model_.context));
}

void Router::handle_detokenize(const HttpRequest& http, ResponseWriter& w) {
  ApiResult<DetokenizeRequest> parsed = parse_detokenize(http.body, model_.tokenizer->vocab_size());
  if (!parsed.is_ok()) return respond_error(w, parsed.error());
  if (auto e = check_model(parsed.value().model)) return respond_error(w, *e);
  w.respond(200, "application/json", detokenize_body(model_.tokenizer->decode(parsed.value().tokens)));
}

Result<std::vector<TokenId>> Router::encode_chat(const std::vector<ChatMessage>& messages,
                                                 bool add_generation_prompt) const {
  // Render the template with a marker in place of each message's content, then
  // encode template text with special tokens and the contents without, so a
  // user cannot inject control tokens by writing "<|im_end|>".
  auto marker = [](size_t i) {
    std::string m(1, '\x1e');
    m += std::to_string(i);
    m += '\x1f';
    return m;
  };
  std::vector<ChatMessage> marked = messages;
  for (size_t i = 0; i < marked.size(); ++i) marked[i].content = marker(i);
  PD_ASSIGN_OR_RETURN(std::string rendered, model_.chat_template.apply(marked, add_generation_prompt));
  const Tokenizer& tok = *model_.tokenizer;
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

void Router::handle_completion(Endpoint ep, const HttpRequest& http, std::shared_ptr<ResponseWriter> w) {
  auto reject = [&](const ApiError& e, std::vector<std::pair<std::string, std::string>> headers = {}) {
    requests_total_.inc({"rejected"});
    respond_error(*w, e, std::move(headers));
  };
  ApiResult<ApiRequest> parsed = parse_request(ep, http.body, sampling_defaults_);
  if (!parsed.is_ok()) return reject(parsed.error());
  ApiRequest api = std::move(parsed).value();
  if (auto e = check_model(api.model)) return reject(*e);
  const Tokenizer& tok = *model_.tokenizer;

  // The prompts, tokenized: one per completions prompt, one for the chat.
  struct Prompt {
    std::vector<TokenId> ids;
    std::string echo;  // its text, for echo
  };
  std::vector<Prompt> prompts;
  const bool batched = api.prompts.size() > 1;
  const char* prompt_field = ep == Endpoint::kCompletions ? "prompt" : "messages";
  auto name = [&](size_t i) { return batched ? "prompt[" + std::to_string(i) + "]" : std::string(prompt_field); };
  if (ep == Endpoint::kCompletions) {
    for (size_t i = 0; i < api.prompts.size(); ++i) {
      PromptInput& in = api.prompts[i];
      Prompt p;
      if (in.is_ids) {
        // Token ids are taken as they are (no BOS added).
        for (size_t j = 0; j < in.ids.size(); ++j) {
          if (in.ids[j] >= tok.vocab_size())
            return reject(api_error(400, name(i) + (batched || in.ids.size() > 1 ? "[" + std::to_string(j) + "]" : "") +
                                             " is token id " + std::to_string(in.ids[j]) +
                                             ", outside the vocabulary [0, " + std::to_string(tok.vocab_size()) + ")",
                                    "prompt"));
        }
        p.ids = std::move(in.ids);
        if (api.echo) p.echo = tok.decode(p.ids);
      } else {
        p.ids = tok.encode(in.text, api.parse_special);
        if (tok.add_bos() && tok.bos_id() >= 0) p.ids.insert(p.ids.begin(), tok.bos_id());
        p.echo = std::move(in.text);
      }
      prompts.push_back(std::move(p));
    }
    api.prompts.clear();  // every choice gets a copy of `api`: keep it small
  } else {
    auto ids = encode_chat(api.messages);
    if (!ids.is_ok()) return reject(api_error(400, "messages: " + ids.status().message(), "messages"));
    Prompt p;
    p.ids = std::move(ids).value();
    if (tok.add_bos() && tok.bos_id() >= 0) p.ids.insert(p.ids.begin(), tok.bos_id());
    prompts.push_back(std::move(p));
    api.messages.clear();
    api.sampling.stop_token_ids.clear();
    if (im_end_ >= 0 && im_end_ != tok.eos_id()) api.sampling.stop_token_ids.push_back(im_end_);
  }
  std::vector<int32_t> max_tokens(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    const int64_t n = static_cast<int64_t>(prompts[i].ids.size());
    if (n == 0) return reject(api_error(400, name(i) + " is empty", prompt_field));
    if (n >= model_.context)
      return reject(api_error(400, name(i) + " has " + std::to_string(n) + " tokens; the model's context is " +
                                       std::to_string(model_.context),
                              prompt_field));
    if (api.max_tokens_given) {
      if (n + api.sampling.max_tokens > model_.context)
        return reject(api_error(400, "max_tokens " + std::to_string(api.sampling.max_tokens) + " + " +
                                         std::to_string(n) + " prompt tokens" + (batched ? " of " + name(i) : "") +
                                         " exceeds the model's context of " + std::to_string(model_.context) + " tokens",
                                "max_tokens"));
      max_tokens[i] = api.sampling.max_tokens;
    } else {
      // OpenAI's defaults: 16 for completions; chat runs to the end of the context.
      const int64_t left = model_.context - n;
      max_tokens[i] = static_cast<int32_t>(ep == Endpoint::kCompletions ? std::min<int64_t>(16, left) : left);
    }
  }
  const int n_choices = static_cast<int>(prompts.size()) * api.n;
  if (n_choices > 1 && n_choices > cfg_.router.max_queued)  // could never be queued at once: retrying would not help
    return reject(api_error(400, std::to_string(n_choices) + " choices (prompts x n) is more than this server queues at once (" +
                                     std::to_string(cfg_.router.max_queued) + ", router.max_queued)",
                            api.n > 1 ? "n" : "prompt"));
  if (draining_.load())
    return reject(api_error(503, "the server is shutting down"), {{"Retry-After", std::to_string(cfg_.router.retry_after_s)}});
  if (!ready_.load() && degraded_.load()) {
    std::string why;
    {
      std::lock_guard lock(ready_mu_);
      why = not_ready_reason_;
    }
    return reject(api_error(503, "no prefill->decode path is up (" + why + "); retry later"),
                  {{"Retry-After", std::to_string(cfg_.router.retry_after_s)}});
  }
  if (queued_.load() + n_choices > cfg_.router.max_queued)
    return reject(api_error(503, "the router's queue is full (" + std::to_string(cfg_.router.max_queued) +
                                     " requests waiting); retry later"),
                  {{"Retry-After", std::to_string(cfg_.router.retry_after_s)}});

  // One Request per choice: choice j of prompt i has index i * n + j. With a
  // seed, choice j samples with seed + j (reproducible, yet the n choices
  // differ); without one, each gets a fresh seed, as OpenAI and vLLM do.
  auto response = std::make_shared<Response>();
  response->writer = w;
  response->endpoint = ep;
  response->stream = api.stream;
  response->include_usage = api.include_usage;
  response->created = unix_now();
  std::vector<std::unique_ptr<Request>> reqs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    for (int32_t j = 0; j < api.n; ++j) {
      auto req = std::make_unique<Request>();
      req->id = req->first_id = next_id_.fetch_add(1);
      req->api = api;
      req->api.sampling.max_tokens = max_tokens[i];
      req->api.sampling.seed = api.seed_given ? api.sampling.seed + static_cast<uint64_t>(j) : fresh_seed();
      req->response = response;
      req->index = static_cast<int32_t>(i) * api.n + j;
      req->counts_prompt = j == 0;
      req->arrived = env_->now();
      req->prompt = prompts[i].ids;
      if (api.echo) req->echo_text = prompts[i].echo;
      req->text = std::make_unique<TextStream>(tok, api.stop, hidden_ids_);
      response->choices.push_back(req->id);
      reqs.push_back(std::move(req));
    }
  }
  response->id = make_response_id(ep, response->choices.front());
  response->open = reqs.size();
  // SSE headers go out before the link can send a chunk. The disconnect
  // callback is registered under the inbox lock, so its ClientGone (posted to
  // an io thread, never run inline) always lands after the NewRequests.
  if (api.stream) w->start_sse();
  queued_ += n_choices;
  std::lock_guard lock(inbox_mu_);
  w->on_disconnect([this, ids = response->choices] {
    std::lock_guard lock(inbox_mu_);
    inbox_.push_back(ClientGone{ids});
  });
  for (auto& req : reqs) inbox_.push_back(NewRequest{std::move(req)});
}

}  // namespace pd::router
