// The link loop's iteration: the inbox, the workers' messages, dispatch, and
// (every 10 ms) liveness, deadlines and the state the front reads; the stop
// (see link_loop.h).
#include "router/link_loop.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include <nlohmann/json.hpp>

#include "util/lifecycle.h"

namespace pd::router {

const char* state_name(StartupCheck s) {
  switch (s) {
    case StartupCheck::kWatching: return "watching";
    case StartupCheck::kWarned: return "warned";
  }
  return "?";
}

bool legal(StartupCheck from, StartupCheck to) {
  return from == StartupCheck::kWatching && to == StartupCheck::kWarned;
}

LinkLoop::LinkLoop(LinkParts parts, std::unique_ptr<ControlChannel> channel)
    : p_(parts),
      channel_(std::move(channel)),
      workers_(p_.roles.prefill, p_.roles.decode, p_.cfg.kv.block_size),
      membership_(p_.cfg, p_.model.kv_dtype, p_.model.fingerprint, workers_, *channel_, p_.metrics) {
  const ClusterConfig::Router& r = p_.cfg.router;
  workers_.set_policy(RoutingPolicy{r.policy == "cache_aware", r.queue_weight, r.balance_ratio, r.balance_tokens,
                                    r.decode_reuse_tokens, r.decode_reuse_weight, r.min_cached_fraction});
}

void LinkLoop::set_env(const Env* env) {
  env_ = env;
  workers_.set_env(env);
  membership_.set_env(env);
}

void LinkLoop::start() {
  started_ = env_->now();
  last_housekeeping_ = started_ - std::chrono::seconds(1);
}

bool LinkLoop::run_once(bool stop_asked) {
  excuse_own_stall();
  take_inbox();
  handle_messages();
  dispatch_queued();
  channel_->progress();
  // Deadlines and gauges are O(requests + ranks): every 10 ms is plenty.
  if (env_->now() - last_housekeeping_ >= std::chrono::milliseconds(10)) {
    apply(membership_.check_liveness());
    check_deadlines();
    dispatch_queued();  // re-run requests go out at once
    update_health();
    last_housekeeping_ = env_->now();
  }
  if (stop_asked && shown_.state == RouterState::kServing) begin_stop();
  if (stop_deadline_ && (requests_.empty() || env_->now() > *stop_deadline_)) return false;
  if (!shown_.ready && startup_check_ == StartupCheck::kWatching &&
      env_->now() - started_ > std::chrono::milliseconds(p_.cfg.timeouts.startup_ms)) {
    spdlog::error("router: workers not ready after {} ms: {}", p_.cfg.timeouts.startup_ms, shown_.not_ready_reason);
    transition(startup_check_, StartupCheck::kWarned, 0, "router startup");
  }
  return true;
}

// A stall of the router's own loop (a stopped process, an MPI progress call
// that blocked) is not the ranks' silence: what passed beyond kLoopGapCounted
// between two iterations is kept out of their heartbeat and startup
// deadlines, as a worker counts only its own loop time against the router's.
// Their reports from the stall are taken in the iterations that follow.
void LinkLoop::excuse_own_stall() {
  const Clock::time_point now = env_->now();
  if (last_iteration_ && now - *last_iteration_ > kLoopGapCounted) {
    const auto stalled = now - *last_iteration_;
    workers_.excuse(stalled - kLoopGapCounted);
    if (stalled > std::chrono::seconds(1))
      spdlog::warn("router: its own loop did not run for {} ms; the ranks' silence in that time is not counted",
                   std::chrono::duration_cast<std::chrono::milliseconds>(stalled).count());
  }
  last_iteration_ = now;
}

void LinkLoop::begin_stop() {
  spdlog::info("router: stopping; {} in-flight requests get up to {} ms (timeouts.stop_grace_ms)", requests_.size(),
               p_.cfg.timeouts.stop_grace_ms);
  transition(shown_.state, RouterState::kStopping, 0, "router");
  p_.status.publish(shown_);
  stop_deadline_ = env_->now() + std::chrono::milliseconds(p_.cfg.timeouts.stop_grace_ms);
}

void LinkLoop::finish() {
  // Whatever is left failed the stop deadline.
  for (uint64_t id : requests_.wire_ids())
    finalize(id, End::kFailed, "", api_error(503, "the server shut down before the request finished"));
  // Down ranks too: one that is only stopped must exit when it resumes, or the
  // job would never end (to a dead one the small message completes unseen).
  for (int r : membership_.worker_ranks()) channel_->send(r, proto::Shutdown{});
  channel_->flush(std::chrono::milliseconds(5000));
  transition(shown_.state, RouterState::kStopped, 0, "router");
  p_.status.publish(shown_);
}

void LinkLoop::take_inbox() {
  for (auto& item : p_.inbox.take()) {
    if (auto* n = std::get_if<NewRequest>(&item)) {
      requests_.add(std::move(n->req));
      p_.metrics.in_flight.add(1);
    } else if (auto* d = std::get_if<DrainRank>(&item)) {
      const std::string refusal = membership_.begin_drain(d->rank, "POST /admin/drain");
      respond_drain(*d->writer, d->rank, refusal, workers_.find(d->rank) != nullptr);
    } else {
      for (uint64_t http_id : std::get<ClientGone>(item).http_ids)
        if (Request* r = requests_.find_by_http_id(http_id)) finalize(r->wire_id, End::kCancelled, "");
    }
  }
}

void LinkLoop::handle_messages() {
  channel_->receive([&](int source, proto::Message& msg) { on_worker_message(source, msg); }, 256);
}

void LinkLoop::on_worker_message(int source, proto::Message& msg) {
  const WorkerView* w = workers_.find(source);
  if (auto* join = std::get_if<proto::Join>(&msg); join != nullptr && w == nullptr)
    return membership_.on_join(source, *join, shown_.state != RouterState::kServing);
  if (w == nullptr) {
    // A rank that left, before its Shutdown: its last reports mean nothing now.
    if (std::holds_alternative<proto::LoadReport>(msg) || std::holds_alternative<proto::KvEvents>(msg)) return;
    spdlog::warn("router: {} from rank {}, which is not a worker", proto::message_name(msg), source);
    return;
  }
  if (auto* report = std::get_if<proto::LoadReport>(&msg)) return membership_.on_report(source, *report);
  // A rank declared down is fenced: until it rejoins, nothing it says counts.
  if (w->state == RankState::kDown) return;
  workers_.heard(source);
  std::visit(
      [&](auto&& m) {
        using T = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<T, proto::TokenEvents>) on_tokens(source, m);
        else if constexpr (std::is_same_v<T, proto::RequestFailed>) on_failed(source, m);
        else if constexpr (std::is_same_v<T, proto::Listening>) workers_.find(source)->port = m.port;
        else if constexpr (std::is_same_v<T, proto::Leave>) membership_.begin_drain(source, "the rank asked to leave");
        else if constexpr (std::is_same_v<T, proto::Drained>) membership_.on_drained(source);
        else if constexpr (std::is_same_v<T, proto::TransferStats>) p_.metrics.observe_transfer(m);
        else if constexpr (std::is_same_v<T, proto::Warmed>) end_warm(m.id, "done");
        else if constexpr (std::is_same_v<T, proto::KvEvents>) workers_.on_kv_events(source, m);
        else spdlog::warn("router: unexpected {} from rank {}", proto::message_name(m), source);
      },
      msg);
}

void LinkLoop::apply(const std::vector<MembershipEvent>& events) {
  for (const MembershipEvent& e : events) {
    if (const auto* down = std::get_if<RankDown>(&e)) on_rank_down(*down);
    else membership_.remove(std::get<RemoveRank>(e).rank);
  }
}

void LinkLoop::update_health() {
  p_.metrics.router_queue.set(static_cast<double>(requests_.queue_length()));
  p_.metrics.update_ranks(workers_, p_.cfg.kv.block_size);
  p_.metrics.refused_links.set(static_cast<double>(channel_->refused_links()));
  std::string why;
  const bool ok = workers_.ready(&why);
  nlohmann::json ranks = nlohmann::json::array();
  for (const auto* pool : {&workers_.prefill(), &workers_.decode()})
    for (const WorkerView& wv : *pool)
      ranks.push_back({{"rank", wv.rank}, {"role", role_label(wv)}, {"state", rank_state_name(wv.state)}});
  shown_.decode_kv_tokens = 0;
  for (const WorkerView& wv : workers_.decode())
    if (wv.state == RankState::kUp)
      // (A rank's report, bounded before it is multiplied: the pool of a rank is far below 2^40 blocks.)
      shown_.decode_kv_tokens = std::max(shown_.decode_kv_tokens,
                                         std::clamp<int64_t>(wv.load.total_blocks, 0, int64_t{1} << 40) * p_.cfg.kv.block_size);
  if (!ok) shown_.not_ready_reason = why;
  shown_.ranks_json = ranks.dump();
  shown_.degraded = workers_.degraded();
  shown_.pool_left = workers_.pool_left();
  shown_.ready = ok;
  p_.status.publish(shown_);
}

}  // namespace pd::router
