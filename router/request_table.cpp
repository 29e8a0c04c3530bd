// Requests by wire id and http id, the queue, re-runs, deadlines, lifecycle states (see request_table.h).
#include "router/request_table.h"

#include <string>

namespace pd::router {

const char* state_name(RequestState s) {
  switch (s) {
    case RequestState::kQueued: return "queued";
    case RequestState::kDispatched: return "dispatched";
    case RequestState::kStreaming: return "streaming";
    case RequestState::kFinished: return "finished";
    case RequestState::kCancelled: return "cancelled";
    case RequestState::kFailed: return "failed";
  }
  return "?";
}

const char* state_name(AttemptLeg s) { return s == AttemptLeg::kPrefill ? "prefill" : "decode"; }

// Prefill -> decode within an attempt; any -> prefill starts a new attempt (a re-run or migration).
bool legal(AttemptLeg from, AttemptLeg to) {
  return to == AttemptLeg::kPrefill || (from == AttemptLeg::kPrefill && to == AttemptLeg::kDecode);
}

bool is_ended(RequestState s) {
  return s == RequestState::kFinished || s == RequestState::kCancelled || s == RequestState::kFailed;
}

bool legal(RequestState from, RequestState to) {
  using S = RequestState;
  switch (from) {
    case S::kQueued: return to == S::kDispatched || to == S::kCancelled || to == S::kFailed;
    case S::kDispatched: return to == S::kStreaming || to == S::kQueued || to == S::kCancelled || to == S::kFailed;
    case S::kStreaming: return to == S::kQueued || is_ended(to);
    case S::kFinished:
    case S::kCancelled:
    case S::kFailed: return false;  // ended exactly once
  }
  return false;
}

bool retryable(proto::FailureKind k) {
  return k == proto::FailureKind::kPeerDown || k == proto::FailureKind::kTransfer || k == proto::FailureKind::kLeaving;
}

bool serves(const Request& r, int source) {
  return r.state != RequestState::kQueued && (source == r.where.decode_rank || source == r.where.prefill_rank);
}

bool may_rerun(const Request& r, const RerunPolicy& policy, bool stopping) {
  const bool before_tokens = r.state == RequestState::kDispatched;
  const bool migrates = r.state == RequestState::kStreaming && policy.migrate &&
                        attempt_max_tokens(r) > 0;  // tokens left to generate
  return (before_tokens || migrates) && r.attempts < policy.max_attempts && !stopping;
}

int64_t attempt_prompt_tokens(const Request& r) { return static_cast<int64_t>(r.prompt.size()) + r.n_generated(); }

int32_t attempt_max_tokens(const Request& r) { return r.api.sampling.max_tokens - static_cast<int32_t>(r.n_generated()); }

proto::PrefillRequest attempt_message(const Request& r, int32_t decode_rank) {
  proto::PrefillRequest m{r.wire_id, r.prompt, r.api.sampling, decode_rank};
  if (r.generated.empty()) return m;
  m.prompt.insert(m.prompt.end(), r.generated.begin(), r.generated.end());
  m.sampling.resumed_tokens = static_cast<int32_t>(r.n_generated());
  m.sampling.max_tokens = attempt_max_tokens(r);
  m.sampling.prompt_logprobs = false;
  return m;
}

void RequestTable::add(std::unique_ptr<Request> r) {
  const uint64_t id = r->wire_id;
  queue_.push_back(id);
  requests_.emplace(id, std::move(r));
}

Request* RequestTable::find(uint64_t wire_id) {
  auto it = requests_.find(wire_id);
  return it == requests_.end() ? nullptr : it->second.get();
}

Request* RequestTable::find_by_http_id(uint64_t http_id) {
  if (auto re = wire_id_of_http_id_.find(http_id); re != wire_id_of_http_id_.end()) http_id = re->second;
  return find(http_id);
}

Request* RequestTable::front_of_queue() {
  while (!queue_.empty()) {
    if (Request* r = find(queue_.front())) return r;
    queue_.pop_front();  // ended while queued
  }
  return nullptr;
}

void RequestTable::pop_queue() { queue_.pop_front(); }

std::unique_ptr<Request> RequestTable::take(uint64_t wire_id) {
  auto it = requests_.find(wire_id);
  if (it == requests_.end()) return nullptr;
  std::unique_ptr<Request> owned = std::move(it->second);
  requests_.erase(it);
  if (owned->http_id != owned->wire_id) wire_id_of_http_id_.erase(owned->http_id);
  return owned;
}

void RequestTable::requeue(uint64_t wire_id, uint64_t new_wire_id, Request::Clock::time_point now) {
  auto it = requests_.find(wire_id);
  std::unique_ptr<Request> owned = std::move(it->second);
  requests_.erase(it);
  owned->wire_id = new_wire_id;
  owned->queued_at = now;
  wire_id_of_http_id_[owned->http_id] = new_wire_id;
  queue_.push_front(new_wire_id);
  requests_.emplace(new_wire_id, std::move(owned));
}

std::vector<uint64_t> RequestTable::held_by(int rank) const {
  std::vector<uint64_t> out;
  for (const auto& [id, r] : requests_) {
    if (r->state == RequestState::kQueued) continue;
    if (r->where.decode_rank == rank || (r->where.prefill_rank == rank && !r->prefill_done())) out.push_back(id);
  }
  return out;
}

std::vector<std::pair<uint64_t, ApiError>> RequestTable::expired(Request::Clock::time_point now,
                                                                 std::chrono::milliseconds queue,
                                                                 std::chrono::milliseconds request) const {
  std::vector<std::pair<uint64_t, ApiError>> out;
  for (const auto& [id, r] : requests_) {
    if (r->state == RequestState::kQueued && now - r->queued_at > queue)
      out.push_back({id, api_error(503, "no worker could take the request within " + std::to_string(queue.count()) + " ms")});
    else if (now - r->arrived > request)
      out.push_back({id, api_error(504, "the request did not finish within " + std::to_string(request.count()) + " ms")});
  }
  return out;
}

std::vector<uint64_t> RequestTable::wire_ids() const {
  std::vector<uint64_t> out;
  for (const auto& [id, r] : requests_) out.push_back(id);
  return out;
}

}  // namespace pd::router
