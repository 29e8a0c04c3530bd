// The answer: decides what a client sees when its request ends — the HTTP
// status a worker's failure kind maps to, the OpenAI error body, and the
// response body (or the last stream events) once every choice of the answer
// finished: choices in index order, usage summed. Workers report kinds; only
// this file turns them into statuses.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "protocol/messages.h"
#include "router/http_server.h"
#include "router/openai_api.h"

namespace pd::router {

// The wall clock in whole seconds since the Unix epoch (OpenAI's `created`).
inline int64_t unix_seconds_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// An OpenAI-style error; 5xx get the type their status implies unless one is given.
inline ApiError api_error(int status, std::string message, std::string param = "", std::string type = "") {
  ApiError e;
  e.status = status;
  e.message = std::move(message);
  e.param = std::move(param);
  if (!type.empty()) e.type = std::move(type);
  else if (status >= 500) e.type = status == 503 ? "service_unavailable" : "server_error";
  return e;
}

// The header of a 503 that may be retried: Retry-After, in whole seconds
// (router.retry_after_s).
inline std::vector<std::pair<std::string, std::string>> retry_after_header(int seconds) {
  return {{"Retry-After", std::to_string(seconds)}};
}

inline void respond_error(ResponseWriter& w, const ApiError& e,
                          std::vector<std::pair<std::string, std::string>> headers = {}) {
  w.respond(e.status, "application/json", error_body(e), std::move(headers));
}

// The HTTP status a worker's failure kind means to the client.
int http_status_of(proto::FailureKind k);

// POST /admin/drain, answered once the link thread acted on it: 200 with the
// rank's new state, or `refusal` as 404 (`known_rank` false) or 409.
void respond_drain(ResponseWriter& w, int rank, const std::string& refusal, bool known_rank);

// An answer's lifecycle: kOpen until it is given — kAnswered (every choice
// finished), kFailed (a choice failed: the error was sent) or kAbandoned (the
// client left, or no one is left to answer) — once.
enum class AnswerState { kOpen, kAnswered, kFailed, kAbandoned };
const char* state_name(AnswerState s);
bool legal(AnswerState from, AnswerState to);

// One HTTP answer: the choices of one API request (several prompts, n per
// prompt), each generated as its own Request. Answered once every choice
// finished; the first choice that fails answers it with the error and ends
// the others (cancelled). Link thread only, once handed over.
struct Response {
  std::shared_ptr<ResponseWriter> writer;
  Endpoint endpoint = Endpoint::kCompletions;
  bool stream = false, include_usage = false;
  std::string id;                 // "cmpl-..." / "chatcmpl-..."
  int64_t created = 0;
  std::vector<uint64_t> choices;  // http ids of its Requests
  size_t open = 0;                // choices not yet ended
  std::vector<ChoiceOut> done;    // non-streaming: the finished choices
  Usage usage;                    // summed over the finished choices
  AnswerState state = AnswerState::kOpen;
  bool ended() const { return state != AnswerState::kOpen; }
  // The answer is given (`to`: how). Link thread.
  void end(AnswerState to);
};

// A choice of `resp` finished (resp.open already counts it out): its last
// chunk goes out (streaming) or it is kept; `usage` is added. Once no choice
// is open the answer is given (kAnswered): the body (choices by index) or, streaming, the
// usage chunk when asked, [DONE] and the end of the stream.
void answer_finished_choice(Response& resp, ChoiceOut c, Usage usage, bool first_chunk, const std::string& model);
// Answers `resp` with `error` (a 4xx/5xx body, or mid-stream an error event and
// [DONE]) and marks it kFailed. The caller ends the other choices. A 503 body
// carries Retry-After: `retry_after_s` (the cluster may serve it again soon).
void answer_failed(Response& resp, const ApiError& error, int retry_after_s);

}  // namespace pd::router
