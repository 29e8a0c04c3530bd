// The router's HTTP routes (io threads): which handler a path and method reach,
// the API-key and admin-key checks, /health, /metrics, /v1/models, /tokenize
// and /detokenize, and POST /admin/drain (handed to the link thread).
// Completions are in completions.cpp. Reaches the link thread only through the
// LinkInbox and the LinkStatus (front_link.h).
#include <spdlog/spdlog.h>

#include <cctype>
#include <chrono>
#include <optional>
#include <string_view>
#include <nlohmann/json.hpp>

#include "router/answer.h"
#include "router/auth.h"
#include "router/http_front.h"

namespace pd::router {
namespace {

enum class Route { kHealth, kMetrics, kModels, kModel, kDrain, kTokenize, kDetokenize, kCompletions, kChatCompletions, kNone };

struct RouteInfo {
  Route route;
  const char* method;  // the one it accepts (a GET route takes HEAD too)
};

RouteInfo route_of(const std::string& path) {
  if (path == "/health") return {Route::kHealth, "GET"};
  if (path == "/metrics") return {Route::kMetrics, "GET"};
  if (path == "/v1/models") return {Route::kModels, "GET"};
  if (path.rfind("/v1/models/", 0) == 0) return {Route::kModel, "GET"};
  if (path == "/admin/drain") return {Route::kDrain, "POST"};
  if (path == "/tokenize" || path == "/v1/tokenize") return {Route::kTokenize, "POST"};
  if (path == "/detokenize" || path == "/v1/detokenize") return {Route::kDetokenize, "POST"};
  if (path == "/v1/completions") return {Route::kCompletions, "POST"};
  if (path == "/v1/chat/completions") return {Route::kChatCompletions, "POST"};
  return {Route::kNone, ""};
}

// Whether `path` is an admin route: it needs the admin key (http.admin_key),
// never the API key, and is closed while no admin key is configured.
bool is_admin(const std::string& path) { return path.rfind("/admin/", 0) == 0; }

// Whether `path` needs the API key: the API and tokenizer routes, and /metrics
// when http.metrics_require_key.
bool needs_key(const std::string& path, bool metrics_require_key) {
  const bool tokenizer = path == "/tokenize" || path == "/detokenize";
  const bool v1 = path.rfind("/v1/", 0) == 0 || tokenizer;
  return v1 || (path == "/metrics" && metrics_require_key);
}

// Whether a POST body with this Content-Type may be read as JSON:
// application/json (parameters such as charset allowed), any */*+json, or no
// Content-Type at all (curl scripts and our own tools may send none). The
// types a browser may send cross-origin without asking first (text/plain,
// application/x-www-form-urlencoded, multipart/form-data) are refused like
// every other one: otherwise any web page could post to a keyless server on
// localhost.
bool json_content_type(const std::string& content_type) {
  std::string media = content_type.substr(0, content_type.find(';'));
  media.erase(0, media.find_first_not_of(" \t"));
  media.erase(media.find_last_not_of(" \t") + 1);
  for (char& c : media) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (content_type.empty() || media == "application/json") return true;
  const size_t slash = media.find('/');
  return slash != std::string::npos && slash > 0 && media.size() > slash + 5 &&
         media.compare(media.size() - 5, 5, "+json") == 0;
}

// 415 naming the header, for a POST body that is not JSON.
ApiError unsupported_media_type(const std::string& content_type) {
  ApiError e = api_error(415,
                         "Content-Type '" + shown_text(content_type) +
                             "' is not supported: send the body as JSON ('Content-Type: application/json')",
                         "Content-Type", "invalid_request_error");
  e.code = "unsupported_media_type";
  return e;
}

// Why a POST body cannot be read as JSON, if it cannot: a Content-Type that
// is not JSON; none at all from a web page (a browser sends Origin; a page's
// fetch of a Blob or ArrayBuffer body sends no Content-Type and needs no
// preflight, so that case would reopen what the 415 closes); a coded body
// (Content-Encoding: the server decodes none).
std::optional<ApiError> unreadable_body(const HttpRequest& http) {
  if (!json_content_type(http.content_type)) return unsupported_media_type(http.content_type);
  if (http.content_type.empty() && !http.origin.empty()) {
    ApiError e = api_error(415,
                           "a request from a web page (it sent Origin) must send its body as JSON with "
                           "'Content-Type: application/json'",
                           "Content-Type", "invalid_request_error");
    e.code = "unsupported_media_type";
    return e;
  }
  if (!http.content_encoding.empty() && http.content_encoding != "identity") {
    ApiError e = api_error(415,
                           "Content-Encoding '" + shown_text(http.content_encoding) +
                               "' is not supported: send the body uncompressed",
                           "Content-Encoding", "invalid_request_error");
    e.code = "unsupported_media_type";
    return e;
  }
  return std::nullopt;
}

// 401 for a request without the key it needs (`what`: which key).
void respond_unauthorized(ResponseWriter& w, const std::string& what) {
  ApiError e = api_error(401, "missing or incorrect " + what + " (send 'Authorization: Bearer <key>')", "",
                         "invalid_request_error");
  e.code = "invalid_api_key";
  respond_error(w, e, {{"WWW-Authenticate", "Bearer"}});
}

}  // namespace

void HttpFront::submit(HttpRequest http, std::shared_ptr<ResponseWriter> w) {
  const std::string& path = http.target;
  const RouteInfo ri = route_of(path);
  // /health answers before the key check: load balancers probe it without one.
  if (is_admin(path)) {
    switch (admin_access(http.authorization, p_.cfg.http.admin_key)) {
      case AdminAccess::kAllowed: break;
      case AdminAccess::kDisabled: {
        ApiError e = api_error(403,
                               "the admin endpoints are disabled: this server has no admin key "
                               "(set http.admin_key in the config to enable them)",
                               "", "invalid_request_error");
        e.code = "admin_disabled";
        return respond_error(*w, e);
      }
      case AdminAccess::kDenied: return respond_unauthorized(*w, "admin key (http.admin_key)");
    }
  } else if (ri.route != Route::kHealth && needs_key(path, p_.cfg.http.metrics_require_key) &&
             !authorized(http.authorization, p_.cfg.http.api_key)) {
    return respond_unauthorized(*w, "API key");
  }
  if (ri.route == Route::kNone) {
    ApiError e = api_error(404, "no route for " + shown_text(http.method) + " " + shown_text(path), "", "invalid_request_error");
    e.code = "not_found";
    return respond_error(*w, e);
  }
  // HEAD is GET without the body (the connection drops it).
  const bool get_route = std::string_view(ri.method) == "GET";
  if (http.method != ri.method && !(get_route && http.method == "HEAD")) {
    const std::string allow = get_route ? "GET, HEAD" : ri.method;
    return respond_error(*w, api_error(405, "method " + shown_text(http.method) + " is not allowed on " + shown_text(path) +
                                                " (use " + allow + ")"),
                         {{"Allow", allow}});
  }
  if (http.method == "POST") {
    if (auto e = unreadable_body(http)) return respond_error(*w, *e);
  }
  switch (ri.route) {
    case Route::kHealth: return respond_health(*w);
    case Route::kMetrics: w->respond(200, "text/plain; version=0.0.4; charset=utf-8", p_.registry.render()); return;
    case Route::kModels: w->respond(200, "application/json", models_body(p_.model.name, unix_seconds_now())); return;
    case Route::kModel: return respond_model(path.substr(std::string_view("/v1/models/").size()), *w);
    case Route::kDrain: return handle_drain(http, std::move(w));
    case Route::kTokenize: return handle_tokenize(http, *w);
    case Route::kDetokenize: return handle_detokenize(http, *w);
    case Route::kCompletions: return handle_completion(Endpoint::kCompletions, http, std::move(w));
    case Route::kChatCompletions: return handle_completion(Endpoint::kChatCompletions, http, std::move(w));
    case Route::kNone: return;
  }
}

void HttpFront::respond_health(ResponseWriter& w) {
  const LinkSnapshot link = p_.status.snapshot();
  const bool stopping = link.state != RouterState::kServing;
  nlohmann::json body;
  const bool ok = link.ready && !stopping;
  body["status"] = !ok ? "unavailable" : link.degraded ? "degraded" : "ok";
  if (!ok) body["reason"] = stopping ? "shutting down" : link.not_ready_reason;
  body["ranks"] = nlohmann::json::parse(link.ranks_json, nullptr, false);
  w.respond(ok ? 200 : 503, "application/json", body.dump());
}

void HttpFront::handle_drain(const HttpRequest& http, std::shared_ptr<ResponseWriter> w) {
  // {"rank": N}: the rank to drain out of the cluster (see /health for ranks).
  const nlohmann::json body = nlohmann::json::parse(http.body, nullptr, false);
  if (body.is_discarded() || !body.is_object())
    return respond_error(*w, api_error(400,
                                       std::string(body.is_discarded() ? "the body is not JSON (or holds a number beyond "
                                                                         "double range)"
                                                                       : "the body is not a JSON object") +
                                           ": expected {\"rank\": N}",
                                       "", "invalid_request_error"));
  auto it = body.find("rank");
  if (it == body.end() || !it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > (1 << 30))
    return respond_error(*w, api_error(400, "'rank' must be a non-negative integer (a worker rank from /health)", "rank",
                                       "invalid_request_error"));
  p_.inbox.post(DrainRank{static_cast<int>(it->get<int64_t>()), std::move(w)});
}

void HttpFront::respond_model(const std::string& id, ResponseWriter& w) {
  // The id as the openai client sends it: percent-encoded ("org%2Fname").
  std::string model;
  for (size_t i = 0; i < id.size(); ++i) {
    const bool escape = id[i] == '%' && i + 2 < id.size() && std::isxdigit(static_cast<unsigned char>(id[i + 1])) &&
                        std::isxdigit(static_cast<unsigned char>(id[i + 2]));
    if (!escape) {
      model += id[i];
      continue;
    }
    model += static_cast<char>(std::stoi(id.substr(i + 1, 2), nullptr, 16));
    i += 2;
  }
  if (model.empty()) model = " ";  // "/v1/models/" names no model: not found
  if (auto e = check_model(model)) return respond_error(w, *e);
  w.respond(200, "application/json", model_body(p_.model.name, unix_seconds_now()));
}

std::optional<ApiError> HttpFront::check_model(const std::string& model) const {
  if (model.empty() || model == p_.model.name) return std::nullopt;
  ApiError e = api_error(404,
                         "the model '" + shown_text(model) + "' does not exist (this server serves '" + p_.model.name +
                             "')",
                         "model", "invalid_request_error");
  e.code = "model_not_found";
  return e;
}

void HttpFront::handle_tokenize(const HttpRequest& http, ResponseWriter& w) {
  ApiResult<TokenizeRequest> parsed = parse_tokenize(http.body);
  if (!parsed.is_ok()) return respond_error(w, parsed.error());
  const TokenizeRequest& t = parsed.value();
  if (auto e = check_model(t.model)) return respond_error(w, *e);
  const Tokenizer& tok = *p_.model.tokenizer;
  std::vector<TokenId> ids;
  if (t.chat) {
    // As the chat endpoint feeds the model: BOS included (the template's or the vocabulary's).
    auto chat = encode_chat(p_.model, t.messages, t.add_generation_prompt, t.tools, t.tool_choice);
    if (!chat.is_ok()) return respond_error(w, chat.error());
    ids = std::move(chat).value();
    if (!t.add_special_tokens && !ids.empty() && ids.front() == tok.bos_id()) ids.erase(ids.begin());
  } else {
    ids = tok.encode(t.prompt, t.parse_special);
    if (t.add_special_tokens && tok.add_bos() && tok.bos_id() >= 0) ids.insert(ids.begin(), tok.bos_id());
  }
  w.respond(200, "application/json", tokenize_body(ids, p_.model.context));
}

void HttpFront::handle_detokenize(const HttpRequest& http, ResponseWriter& w) {
  ApiResult<DetokenizeRequest> parsed = parse_detokenize(http.body, p_.model.tokenizer->vocab_size());
  if (!parsed.is_ok()) return respond_error(w, parsed.error());
  if (auto e = check_model(parsed.value().model)) return respond_error(w, *e);
  w.respond(200, "application/json", detokenize_body(p_.model.tokenizer->decode(parsed.value().tokens)));
}

}  // namespace pd::router
