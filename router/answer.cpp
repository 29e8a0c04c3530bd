// The answer a client sees when its request ends; failure kind -> HTTP status (see answer.h).
#include "router/answer.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "util/lifecycle.h"

namespace pd::router {

const char* state_name(AnswerState s) {
  switch (s) {
    case AnswerState::kOpen: return "open";
    case AnswerState::kAnswered: return "answered";
    case AnswerState::kFailed: return "failed";
    case AnswerState::kAbandoned: return "abandoned";
  }
  return "?";
}

bool legal(AnswerState from, AnswerState to) { return from == AnswerState::kOpen && to != AnswerState::kOpen; }

void Response::end(AnswerState to) { transition(state, to, choices.empty() ? 0 : choices.front(), "router answer"); }

int http_status_of(proto::FailureKind k) {
  switch (k) {
    case proto::FailureKind::kInvalid: return 400;
    case proto::FailureKind::kOverloaded: return 503;
    case proto::FailureKind::kTimeout: return 504;
    case proto::FailureKind::kPeerDown: return 503;
    case proto::FailureKind::kTransfer: return 500;
    case proto::FailureKind::kInternal: return 500;
    case proto::FailureKind::kLeaving: return 503;
  }
  return 500;
}

void respond_drain(ResponseWriter& w, int rank, const std::string& refusal, bool known_rank) {
  if (!refusal.empty()) {
    respond_error(w, api_error(known_rank ? 409 : 404, refusal, "rank", "invalid_request_error"));
    return;
  }
  w.respond(200, "application/json", nlohmann::json{{"rank", rank}, {"state", "draining"}}.dump());
}

void answer_finished_choice(Response& resp, ChoiceOut c, Usage usage, bool first_chunk, const std::string& model) {
  ResponseWriter& w = *resp.writer;
  resp.usage.prompt_tokens += usage.prompt_tokens;
  resp.usage.completion_tokens += usage.completion_tokens;
  resp.usage.cached_tokens += usage.cached_tokens;
  if (!resp.stream) resp.done.push_back(std::move(c));
  else w.send_event(stream_chunk(resp.endpoint, resp.id, model, resp.created, c, first_chunk));
  if (resp.open > 0) return;
  resp.end(AnswerState::kAnswered);
  if (!resp.stream) {
    std::sort(resp.done.begin(), resp.done.end(), [](const ChoiceOut& a, const ChoiceOut& b) { return a.index < b.index; });
    w.respond(200, "application/json", completion_body(resp.endpoint, resp.id, model, resp.created, resp.done, resp.usage));
    return;
  }
  if (resp.include_usage) w.send_event(usage_chunk(resp.endpoint, resp.id, model, resp.created, resp.usage));
  w.send_event("[DONE]");
  w.finish();
}

void answer_failed(Response& resp, const ApiError& error, int retry_after_s) {
  resp.end(AnswerState::kFailed);
  ResponseWriter& w = *resp.writer;
  if (!resp.stream) {
    if (error.status == 503) return respond_error(w, error, retry_after_header(retry_after_s));
    return respond_error(w, error);
  }
  w.send_event(error_body(error));
  w.send_event("[DONE]");
  w.finish();
}

}  // namespace pd::router
