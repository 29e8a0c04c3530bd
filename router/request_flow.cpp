// A request's moves on the link thread: dispatched to the pair the worker
// table picks, its tokens delivered in order, a worker's failure re-run or
// answered, a down rank's requests re-run or failed, deadlines enforced, and
// its end — the workers released, the answer given — exactly once.
#include <spdlog/spdlog.h>

#include <algorithm>

#include "router/link_loop.h"
#include "util/env.h"
#include "util/lifecycle.h"

namespace pd::router {
namespace {

void set_state(Request& r, RequestState to) { transition(r.state, to, r.http_id, "router"); }

}  // namespace

void LinkLoop::dispatch_queued() {
  if (requests_.front_of_queue() != nullptr && workers_.pool_left()) {
    // No path, and none coming back by itself (a role's every rank left or is
    // draining out): what waits is answered now, as a new request would be.
    std::string why;
    workers_.ready(&why);
    while (Request* r = requests_.front_of_queue())
      finalize(r->wire_id, End::kFailed, "", api_error(503, "no prefill->decode path is up (" + why + "); retry later"));
    return;
  }
  while (Request* found = requests_.front_of_queue()) {
    Request& r = *found;
    const int64_t n = attempt_prompt_tokens(r);
    const int32_t max_tokens = attempt_max_tokens(r);
    // Prompt logprobs need every prompt row computed: no cache helps such a prompt.
    const bool cacheable = workers_.policy().cache_aware && !(r.generated.empty() && r.api.sampling.prompt_logprobs);
    if (cacheable && r.hashed_tokens != n) {
      std::vector<TokenId> tokens = r.prompt;
      tokens.insert(tokens.end(), r.generated.begin(), r.generated.end());
      r.block_hashes = prompt_block_hashes(tokens, p_.cfg.kv.block_size);
      r.hashed_tokens = n;
    }
    const DispatchRequest q{n, max_tokens, cacheable ? std::span<const uint64_t>(r.block_hashes) : std::span<const uint64_t>()};
    auto choice = workers_.pick(q, p_.cfg.router.max_inflight_per_worker);
    if (!choice) break;
    requests_.pop_queue();
    p_.status.add_queued(-1);
    set_state(r, RequestState::kDispatched);
    ++r.attempts;
    r.where = *choice;
    r.dispatched_at = env_->now();
    r.sent_prompt_tokens = n;
    r.sent_max_tokens = max_tokens;
    workers_.on_dispatch(*choice, n, max_tokens);
    if (r.attempts == 1) {
      p_.metrics.stage.observe({"router_queue"}, seconds(r.dispatched_at - r.arrived));
      p_.metrics.prompt_tokens_total.inc(static_cast<double>(n));
    }
    if (choice->prefill_rank >= 0)
      p_.metrics.rank_requests_total.inc({"prefill", std::to_string(choice->prefill_rank)});
    p_.metrics.rank_requests_total.inc({"decode", std::to_string(choice->decode_rank)});
    p_.metrics.routing_decisions_total.inc({route_reason_name(choice->reason)});
    // Colocated, or a decode rank that holds most of the prompt: it computes the prompt itself.
    channel_->send(choice->prefill_rank >= 0 ? choice->prefill_rank : choice->decode_rank,
                   attempt_message(r, choice->decode_rank));
  }
}

void LinkLoop::on_tokens(int source, const proto::TokenEvents& m) {
  for (const proto::TokenEvent& ev : m.events) {
    // Unknown: already ended here (cancel, stop string, timeout) or an earlier attempt.
    Request* found = requests_.find(ev.id);
    if (found == nullptr || !serves(*found, source)) continue;
    Request& r = *found;
    if (ev.first_index == 0 && !r.prefill_done()) {
      transition(r.leg, AttemptLeg::kDecode, r.wire_id, "router request");
      r.cached_tokens = ev.cached_tokens;
      workers_.on_prefill_done(source, r.where.prefill_work);  // the prefill rank, or a decode reuse's
      p_.metrics.stage.observe({"prefill_queue"}, ev.queue_s);
      p_.metrics.stage.observe({"prefill"}, ev.prefill_s);
    }
    if (ev.first_index == 1 && r.where.prefill_rank >= 0) p_.metrics.stage.observe({"decode_queue"}, ev.queue_s);
    r.out->add(ev);
    // Deliver in order; the prefill rank's token 0 and the decode rank's
    // later tokens come from different ranks and may arrive in either order.
    while (auto t = r.out->next())
      if (!on_token(r, r.out->next_index() - 1, *t)) break;
  }
}

bool LinkLoop::on_token(Request& r, int32_t index, const PendingToken& t) {
  const auto now = env_->now();
  if (index == 0) {
    p_.metrics.ttft.observe(seconds(now - r.arrived));
  } else {
    const double gap = seconds(now - r.last_token_at);
    p_.metrics.itl.observe(gap);
    if (index == 1) p_.metrics.first_itl.observe(gap);
    r.max_gap_s = std::max(r.max_gap_s, gap);
  }
  r.last_token_at = now;
  if (r.state == RequestState::kDispatched) set_state(r, RequestState::kStreaming);  // also a migrated attempt's first
  if (index == 0 && r.api.echo) r.out->deliver_echo(r.prompt, *r.response, p_.model.name);
  p_.metrics.generation_tokens_total.inc();
  if (r.api.prompt_only) {  // max_tokens 0: the token sampled anyway is not part of the answer
    finalize(r.wire_id, End::kFinished, "length", {}, t.finish == proto::Finish::kNone);
    return false;
  }
  r.generated.push_back(t.token);
  if (r.out->push(t, *r.response, p_.model.name)) {  // a stop string matched: end it here, tell the workers
    r.out->flush(*r.response, p_.model.name);  // what the tool-call split held back
    finalize(r.wire_id, End::kFinished, "stop");
    return false;
  }
  if (t.finish == proto::Finish::kNone) return true;
  r.out->flush(*r.response, p_.model.name);
  finalize(r.wire_id, End::kFinished, t.finish == proto::Finish::kLength ? "length" : "stop", {}, false);
  return false;
}

// The warm-up computes at most this many tokens (the answer, and what of the
// prompt the rank's cache no longer holds).
constexpr int64_t kWarmMaxTokens = 512;

void LinkLoop::warm_prefill(const Request& r) {
  if (!p_.cfg.router.warm_prefill || !workers_.policy().cache_aware || workers_.colocated() || r.generated.empty())
    return;
  std::vector<TokenId> tokens = r.prompt;
  tokens.insert(tokens.end(), r.generated.begin(), r.generated.end());
  const std::vector<uint64_t> hashes = prompt_block_hashes(tokens, p_.cfg.kv.block_size);
  const std::optional<DispatchChoice> c =
      workers_.pick_warm(hashes, static_cast<int64_t>(tokens.size()), kWarmMaxTokens);
  if (!c) return;
  const uint64_t id = p_.ids.next();
  workers_.on_dispatch(*c, c->prefill_work, 0);
  warm_[id] = *c;
  p_.metrics.warm_prefills_total.inc({"sent"});
  channel_->send(c->prefill_rank, proto::PrefillRequest{id, std::move(tokens), {}, -1});
}

void LinkLoop::end_warm(uint64_t id, const char* outcome) {
  auto it = warm_.find(id);
  if (it == warm_.end()) return;
  workers_.on_prefill_done(it->second.prefill_rank, it->second.prefill_work);
  warm_.erase(it);
  p_.metrics.warm_prefills_total.inc({outcome});
}

void LinkLoop::on_failed(int source, const proto::RequestFailed& m) {
  if (warm_.count(m.id)) return end_warm(m.id, "failed");
  Request* r = requests_.find(m.id);
  if (r == nullptr || !serves(*r, source)) return;
  spdlog::warn("router: request {} failed on rank {} ({}): {}", m.id, source, proto::failure_kind_name(m.kind),
               m.reason);
  if (retryable(m.kind) && rerun(*r, m.reason)) return;
  finalize(m.id, End::kFailed, "", api_error(http_status_of(m.kind), m.reason));
}

void LinkLoop::on_rank_down(const RankDown& down) {
  const std::string& name = down.name;
  std::erase_if(warm_, [&](const auto& w) { return w.second.prefill_rank == down.rank; });  // its work was zeroed
  const std::vector<uint64_t> hit = requests_.held_by(down.rank);
  for (uint64_t id : hit) {
    Request* r = requests_.find(id);
    if (r == nullptr) continue;  // a sibling choice that failed before it ended it
    if (rerun(*r, name + " went down")) continue;
    finalize(id, End::kFailed, "", api_error(503, name + " went down while serving the request (" + down.why + ")"));
  }
  if (!hit.empty()) spdlog::warn("router: {} requests were on {}", hit.size(), name);
}

void LinkLoop::check_deadlines() {
  for (auto& [id, e] : requests_.expired(env_->now(), std::chrono::milliseconds(p_.cfg.timeouts.queue_ms),
                                         std::chrono::milliseconds(p_.cfg.timeouts.request_ms)))
    finalize(id, End::kFailed, "", e);
}

bool LinkLoop::rerun(Request& r, const std::string& why) {
  const bool stopping = shown_.state != RouterState::kServing;
  if (!may_rerun(r, {p_.cfg.router.max_attempts, p_.cfg.router.migrate}, stopping)) return false;
  const uint64_t old_id = r.wire_id;
  const bool migrating = r.state == RequestState::kStreaming;
  release_workers(r, true);  // both legs drop the old attempt
  transition(r.leg, AttemptLeg::kPrefill, r.wire_id, "router request");  // a new attempt
  r.where = {};
  r.out->restart();  // the next attempt's tokens follow those delivered
  set_state(r, RequestState::kQueued);
  requests_.requeue(old_id, p_.ids.next(), env_->now());  // the next attempt travels under a new wire id
  if (migrating) {
    spdlog::info("router: migrating request {} as {} after {} tokens (attempt {}): {}", old_id, r.wire_id,
                 r.n_generated(), r.attempts + 1, why);
    p_.metrics.migrated_total.inc();
  } else {
    spdlog::info("router: re-running request {} as {} (attempt {}): {}", old_id, r.wire_id, r.attempts + 1, why);
    p_.metrics.retried_total.inc();
  }
  p_.status.add_queued(1);
  return true;
}

void LinkLoop::release_workers(const Request& r, bool tell_workers) {
  // Tell both legs; a worker that already finished ignores an unknown id.
  if (tell_workers) {
    if (r.where.prefill_rank >= 0 && !r.prefill_done()) membership_.cancel_on(r.where.prefill_rank, r.wire_id);
    membership_.cancel_on(r.where.decode_rank, r.wire_id);
  }
  if (!r.prefill_done())
    workers_.on_prefill_done(r.where.prefill_rank >= 0 ? r.where.prefill_rank : r.where.decode_rank,
                             r.where.prefill_work);
  workers_.on_request_done(r.where.decode_rank, r.sent_prompt_tokens, r.sent_max_tokens);
}

void LinkLoop::finalize(uint64_t wire_id, End how, const std::string& finish_reason, const ApiError& error,
                      bool tell_workers) {
  std::unique_ptr<Request> owned = requests_.take(wire_id);
  if (!owned) return;
  Request& r = *owned;
  const bool was_queued = r.state == RequestState::kQueued;
  set_state(r, how == End::kFinished ? RequestState::kFinished
               : how == End::kCancelled ? RequestState::kCancelled
                                        : RequestState::kFailed);
  p_.metrics.in_flight.add(-1);
  if (was_queued) p_.status.add_queued(-1);
  else release_workers(r, tell_workers || how != End::kFinished);
  p_.metrics.e2e.observe(seconds(env_->now() - r.arrived));
  Response& resp = *r.response;
  --resp.open;
  switch (how) {
    case End::kFinished: {
      p_.metrics.requests_total.inc({"finished"});
      if (r.n_generated() >= 2) p_.metrics.max_itl.observe(r.max_gap_s);
      warm_prefill(r);
      if (resp.ended()) break;
      const Usage usage{r.counts_prompt ? static_cast<int64_t>(r.prompt.size()) : 0, r.n_generated(),
                        r.counts_prompt ? std::clamp<int64_t>(r.cached_tokens, 0, static_cast<int64_t>(r.prompt.size())) : 0};
      const bool first_chunk = !r.out->first_chunk_sent();
      answer_finished_choice(resp, r.out->finish(finish_reason), usage, first_chunk, p_.model.name);
      break;
    }
    case End::kCancelled:
      p_.metrics.requests_total.inc({"cancelled"});
      // The client is gone, or another choice failed and answered.
      if (!resp.ended()) resp.end(AnswerState::kAbandoned);
      break;
    case End::kFailed:
      p_.metrics.requests_total.inc({error.status == 504 ? "timeout" : "failed"});
      if (resp.ended()) break;
      answer_failed(resp, error, p_.cfg.router.retry_after_s);
      end_siblings(resp, error);
      break;
  }
}

void LinkLoop::end_siblings(const Response& resp, const ApiError& error) {
  // They end with the answer's error (counted as it is: timeout or failed),
  // not as cancelled: no client left.
  for (uint64_t http_id : resp.choices)
    if (Request* other = requests_.find_by_http_id(http_id)) finalize(other->wire_id, End::kFailed, "", error);
}

}  // namespace pd::router
