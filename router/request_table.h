// The request table: decides which request a wire id names, the order requests
// wait for a worker in (the queue; a re-run goes to its front under a new wire
// id), whether a failed attempt is re-run (retryable kinds, RerunPolicy), and
// when a request is past its deadline (timeouts.queue_ms, timeouts.request_ms).
//
// A request's identities:
//  - http id: given when it arrives, never changes. The HTTP side knows it (the
//    answer's list of choices, a client's disconnect); logs and the lifecycle
//    check name the request by it.
//  - wire id: its current attempt's id on the wire to the workers. The first
//    attempt's equals the http id; every re-run gets a fresh one, so whatever a
//    worker still says about an earlier attempt names no request and is ignored.
// wire_id_of_http_id_ maps the one to the other for requests re-run at least once.
//
// A request's lifecycle (RequestState, every move checked by legal()):
//   kQueued -> kDispatched (sent to a prefill/decode pair) -> kStreaming (a
//   token reached the client) -> one of the ended family: kFinished (stop or
//   length), kCancelled (the client left, or a sibling choice failed and
//   answered), kFailed (a reason the client sees). kDispatched -> kQueued is a
//   re-run; kStreaming -> kQueued a migration (its next attempt's prompt ends
//   with the tokens already streamed, and the stream goes on from the next
//   token). A queued request ends cancelled or failed (deadline, shutdown); an
//   ended request leaves the table in the same step.
//
// Link thread only. Its ids come from RequestIds (front_link.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include "router/answer.h"
#include "router/choice_stream.h"
#include "router/dispatch.h"

namespace pd::router {

enum class RequestState { kQueued, kDispatched, kStreaming, kFinished, kCancelled, kFailed };
const char* state_name(RequestState s);
bool legal(RequestState from, RequestState to);
bool is_ended(RequestState s);

// Which leg of its current attempt a request is on: kPrefill until token 0 of
// the attempt arrives (the prefill rank, or a decode rank computing the prompt
// itself, still holds prompt work the router counts), then kDecode. A new
// attempt (re-run, migration) starts at kPrefill again.
enum class AttemptLeg { kPrefill, kDecode };
const char* state_name(AttemptLeg s);
bool legal(AttemptLeg from, AttemptLeg to);

struct Request {  // one choice of an answer
  using Clock = std::chrono::steady_clock;
  uint64_t wire_id = 0;           // the current attempt's id on the wire
  uint64_t http_id = 0;           // the id the HTTP side knows
  RequestState state = RequestState::kQueued;
  int attempts = 0;
  ApiRequest api;                 // this choice's (its own seed and max_tokens; no prompts or messages)
  std::shared_ptr<Response> response;
  bool counts_prompt = true;      // usage: the first choice of each prompt counts its tokens
  std::vector<TokenId> prompt;
  std::unique_ptr<ChoiceStream> out;
  AttemptLeg leg = AttemptLeg::kPrefill;  // of the current attempt
  bool prefill_done() const { return leg == AttemptLeg::kDecode; }
  DispatchChoice where;           // the pair serving the current attempt (kDispatched, kStreaming)
  std::vector<TokenId> generated;  // the tokens the client was given
  int64_t n_generated() const { return static_cast<int64_t>(generated.size()); }
  // The current attempt as sent (a migrated one's prompt ends with `generated`).
  int64_t sent_prompt_tokens = 0;
  int32_t sent_max_tokens = 0;
  // The chained hashes of the next attempt's prompt blocks (prefix-aware
  // dispatch), for `hashed_tokens` tokens of it; recomputed when that changes.
  std::vector<uint64_t> block_hashes;
  int64_t hashed_tokens = -1;
  int64_t cached_tokens = 0;  // usage: prompt tokens the computing rank had cached
  Clock::time_point arrived, dispatched_at, last_token_at;
  double max_gap_s = 0;  // the largest gap between two of its tokens at the router
  Clock::time_point queued_at;  // arrived, or went back to the queue (a re-run or migration)
};

// Worker failure kinds where another pair of ranks may well succeed.
bool retryable(proto::FailureKind k);
// When a failed attempt runs again (router.max_attempts, router.migrate).
struct RerunPolicy {
  int max_attempts = 3;
  bool migrate = true;  // also after tokens reached the client
};
// Whether a failed attempt of `r` runs again: it has attempts left, the router
// is not stopping, and no token reached the client yet or migration is on.
bool may_rerun(const Request& r, const RerunPolicy& policy, bool stopping);
// Whether rank `source` serves the current attempt of `r` (it was dispatched
// and `source` is its prefill or decode rank).
bool serves(const Request& r, int source);
// The next attempt's prompt length and max_tokens: a migrated request's prompt
// ends with the tokens generated so far, and it generates the rest.
int64_t attempt_prompt_tokens(const Request& r);
int32_t attempt_max_tokens(const Request& r);
// The current attempt's message to the workers: the prompt, and for a migrated
// request the tokens generated so far after it (sampling.resumed_tokens), the
// tokens still to generate (max_tokens) and no prompt logprobs (given already).
proto::PrefillRequest attempt_message(const Request& r, int32_t decode_rank);

class RequestTable {
 public:
  // An accepted request: queued at the back.
  void add(std::unique_ptr<Request> r);
  Request* find(uint64_t wire_id);
  // The request the HTTP side calls `http_id`; null once it ended.
  Request* find_by_http_id(uint64_t http_id);
  // The queue's front (skipping requests that ended while queued); null when empty.
  Request* front_of_queue();
  void pop_queue();
  // Removes the request (it ended) and returns it; null if unknown.
  std::unique_ptr<Request> take(uint64_t wire_id);
  // A re-run or migration: the request goes back to the front of the queue
  // under `new_wire_id` (queued since `now`).
  void requeue(uint64_t wire_id, uint64_t new_wire_id, Request::Clock::time_point now);
  // Wire ids of the requests a rank that went down held: every one it decodes,
  // and those it prefills whose prefill is not over.
  std::vector<uint64_t> held_by(int rank) const;
  // Requests past their deadline, with the error each ends with: in the queue
  // longer than `queue` since it last went there (503), or arrived longer than
  // `request` ago (504).
  std::vector<std::pair<uint64_t, ApiError>> expired(Request::Clock::time_point now, std::chrono::milliseconds queue,
                                                     std::chrono::milliseconds request) const;
  std::vector<uint64_t> wire_ids() const;
  bool empty() const { return requests_.empty(); }
  size_t size() const { return requests_.size(); }
  size_t queue_length() const { return queue_.size(); }

 private:
  std::unordered_map<uint64_t, std::unique_ptr<Request>> requests_;  // by wire id
  std::deque<uint64_t> queue_;  // wire ids, accepted and waiting for a worker
  std::unordered_map<uint64_t, uint64_t> wire_id_of_http_id_;  // re-run requests
};

}  // namespace pd::router
