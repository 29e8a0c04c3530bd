// Joins, drains and liveness of the worker ranks (see membership.h).
#include "router/membership.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cctype>
#include <utility>

namespace pd::router {

Membership::Membership(const ClusterConfig& cfg, std::string kv_dtype, std::string model, WorkerTable& workers,
                       ControlChannel& channel, RouterMetrics& metrics)
    : cfg_(cfg),
      kv_dtype_(std::move(kv_dtype)),
      model_(std::move(model)),
      workers_(workers),
      channel_(channel),
      metrics_(metrics) {}

std::vector<int> Membership::worker_ranks(int except) const {
  std::vector<int> out;
  for (const auto* pool : {&workers_.prefill(), &workers_.decode()})
    for (const WorkerView& w : *pool)
      if (w.rank != except) out.push_back(w.rank);
  return out;
}

void Membership::on_report(int source, const proto::LoadReport& m) {
  WorkerView* w = workers_.find(source);
  if (w->state != RankState::kDown) {
    const proto::LoadReport before = w->load;
    workers_.on_report(source, m);
    metrics_.count_prompt_tokens(*w, before, m);
    return;
  }
  const proto::Epoch next = w->epoch + 1;
  if (m.epoch == next) {
    // It dropped everything of its old incarnation (Rejoin): admit it again.
    const proto::LoadReport before = w->load;
    workers_.mark_up(source, next);
    workers_.on_report(source, m);
    metrics_.count_prompt_tokens(*w, before, m);
    spdlog::info("router: {} rank {} is back (epoch {})", role_label(*w), source, next);
    for (int r : worker_ranks(source)) channel_.send(r, proto::PeerUp{source, next});
    return;
  }
  // A fenced rank that is running again and does not know it yet.
  const auto now = env_->now();
  if (now - w->last_rejoin_sent > std::chrono::milliseconds(500)) {
    w->last_rejoin_sent = now;
    channel_.send(source, proto::Rejoin{next});
  }
}

std::string Membership::join_refusal(const proto::Join& m, bool router_stopping) const {
  const bool prefill = m.role == static_cast<int32_t>(Role::kPrefill);
  if (!prefill && m.role != static_cast<int32_t>(Role::kDecode))
    return "role " + std::to_string(m.role) + " cannot join (only prefill and decode ranks)";
  if (prefill && workers_.colocated())
    return "this cluster is colocated (no prefill pool): only decode ranks can join it";
  if (m.block_size != cfg_.kv.block_size)
    return "kv.block_size " + std::to_string(m.block_size) + " differs from the cluster's " +
           std::to_string(cfg_.kv.block_size);
  if (m.kv_dtype != kv_dtype_) return "kv.dtype " + m.kv_dtype + " differs from the cluster's " + kv_dtype_;
  if (!model_.empty() && m.model != model_) {
    // A peer's string, shown only when it is what a fingerprint looks like.
    const bool hex = !m.model.empty() && m.model.size() <= 16 &&
                     std::all_of(m.model.begin(), m.model.end(), [](unsigned char c) { return std::isxdigit(c); });
    return "its model file (fingerprint " + (hex ? m.model : std::string(m.model.empty() ? "none" : "malformed")) +
           ") is not the cluster's (" + model_ + "): a joining pool must serve the same model file";
  }
  if (router_stopping) return "the cluster is shutting down";
  return "";
}

void Membership::on_join(int source, const proto::Join& m, bool router_stopping) {
  const bool prefill = m.role == static_cast<int32_t>(Role::kPrefill);
  const char* role = prefill ? "prefill" : "decode";
  if (const std::string refused = join_refusal(m, router_stopping); !refused.empty()) {
    spdlog::warn("router: refused a {} rank from {} (pid {}): {}", role, m.host, m.pid, refused);
    channel_.send(source, proto::JoinRefused{refused});
    channel_.forget(source);
    return;
  }
  proto::JoinAccepted a;
  a.rank = source;
  a.epoch = 0;
  a.colocated = workers_.colocated();
  std::vector<int> linked;
  for (const WorkerView& w : prefill ? workers_.decode() : workers_.prefill()) {
    // Up, or joined a moment ago and not ready yet (ranks that join together
    // — a pool's ranks after a new router started — must link to each other);
    // a rank of the joiner's own pool is reached through their MPI job.
    const bool live = w.state == RankState::kUp || w.state == RankState::kStarting;
    if (!live || w.port.empty() || (!m.pool.empty() && w.pool == m.pool)) continue;
    a.peers.push_back({w.rank, static_cast<int32_t>(w.is_prefill ? Role::kPrefill : Role::kDecode), w.port, w.epoch});
    linked.push_back(w.rank);
  }
  WorkerView& v = workers_.add(source, prefill, m.pool);
  v.port = m.port;
  v.last_heard = env_->now();
  for (int r : linked) workers_.link(source, r);
  metrics_.joined_total.inc({role});
  spdlog::info("router: {} rank {} joined from {} (pid {}, pool {}); linking it to {} ranks", role, source, m.host,
               m.pid, m.pool, linked.size());
  channel_.send(source, a);
}

std::string Membership::begin_drain(int rank, const std::string& why) {
  WorkerView* w = workers_.find(rank);
  if (w == nullptr) return "rank " + std::to_string(rank) + " is not a worker of this cluster (see /health)";
  if (w->state == RankState::kDraining) return "rank " + std::to_string(rank) + " is already draining";
  if (w->state == RankState::kDown) {
    // Down: the router already re-ran or failed what it had; removing it holds
    // nothing up (a pool that died is cleared from /health this way).
    spdlog::info("router: removing {} rank {}, which is down ({})", role_label(*w), rank, why);
    remove(rank);
    return "";
  }
  if (!workers_.begin_drain(rank))
    return "rank " + std::to_string(rank) + " is " + rank_state_name(w->state) + "; only an up rank can be drained";
  spdlog::info("router: draining {} rank {} out of the cluster ({}; {} requests on it)", role_label(*w), rank, why,
               w->outstanding);
  channel_.send(rank, proto::Drain{});
  return "";
}

void Membership::on_drained(int rank) {
  const WorkerView* w = workers_.find(rank);
  if (w == nullptr || w->state != RankState::kDraining) return;
  // It holds nothing; anything the router still counts on it (a request whose
  // last token is on its way from the other leg) is unaffected by its leaving.
  spdlog::info("router: {} rank {} drained; removing it", role_label(*w), rank);
  remove(rank);
}

void Membership::remove(int rank) {
  WorkerView* w = workers_.find(rank);
  if (w == nullptr) return;
  for (int r : worker_ranks(rank)) channel_.send(r, proto::PeerLeft{rank});
  channel_.send(rank, proto::Shutdown{});
  metrics_.rank_left(*w);
  workers_.remove(rank);
  channel_.forget(rank);
}

void Membership::check_drains(std::vector<MembershipEvent>& events) {
  const auto limit = std::chrono::milliseconds(cfg_.timeouts.rank_drain_ms);
  std::vector<int> late;
  for (const auto* pool : {&workers_.prefill(), &workers_.decode()})
    for (const WorkerView& w : *pool)
      if (w.state == RankState::kDraining && env_->now() - w.drain_started > limit) late.push_back(w.rank);
  for (int rank : late) {
    // What it still holds ends as if it had gone down (re-run or failed); then
    // it is removed. Down now, so this check's heartbeat pass does not declare
    // it again.
    events.emplace_back(declare_down(rank, "did not finish draining within " +
                                               std::to_string(cfg_.timeouts.rank_drain_ms) +
                                               " ms (timeouts.rank_drain_ms)"));
    workers_.mark_down(rank);
    events.emplace_back(RemoveRank{rank});
  }
}

std::vector<MembershipEvent> Membership::check_liveness() {
  send_beats();
  std::vector<MembershipEvent> events;
  check_drains(events);
  confirm_deaths();
  for (int rank : workers_.expire(std::chrono::milliseconds(cfg_.timeouts.heartbeat_ms),
                                  std::chrono::milliseconds(cfg_.timeouts.startup_ms)))
    events.emplace_back(declare_down(
        rank, "sent nothing for " + std::to_string(cfg_.timeouts.heartbeat_ms) + " ms (timeouts.heartbeat_ms)"));
  return events;
}

void Membership::send_beats() {
  const auto now = env_->now();
  if (!last_beat_ || now - *last_beat_ >= std::chrono::seconds(1)) {
    // Not to a down rank (it hears Rejoin when it speaks again), nor to one
    // that served and has been silent for more than kBeatSilence (a live rank
    // reports every second): it may be stopped, and a message to a stopped
    // process on another host can make Open MPI open a new TCP connection to
    // it whose handshake never ends. Open MPI 4.1 aborts the process that
    // started such a connection when its peer then dies (btl/tcp: a failed
    // connect ACK is fatal), and the router must outlive any worker. The
    // rank's own router_ms (15 s) is far longer than the pause. A rank still
    // starting is beaten as always: until it first hears the router it waits
    // for it as long as timeouts.startup_ms.
    for (const auto* pool : {&workers_.prefill(), &workers_.decode()})
      for (const WorkerView& w : *pool) {
        const bool silent = w.state != RankState::kStarting && now - w.last_heard > kBeatSilence;
        if (w.state != RankState::kDown && !silent) channel_.send(w.rank, proto::RouterBeat{});
      }
    last_beat_ = now;
  }
}

void Membership::confirm_deaths() {
  const auto now = env_->now();
  if (last_death_check_ && now - *last_death_check_ < std::chrono::seconds(1)) return;
  last_death_check_ = now;
  for (const auto* pool : {&workers_.prefill(), &workers_.decode()})
    for (const WorkerView& w : *pool) {
      if (w.state != RankState::kDown || gone_.count(w.rank) > 0 || !env_->rank_gone(w.rank)) continue;
      gone_.insert(w.rank);
      spdlog::info("router: {} rank {} has ended (mpirun's process table): nothing it began can complete",
                   role_label(w), w.rank);
      for (int r : worker_ranks(w.rank)) channel_.send(r, proto::PeerGone{w.rank, w.epoch});
    }
}

RankDown Membership::declare_down(int rank, const std::string& why) {
  const WorkerView* w = workers_.find(rank);
  const std::string name = std::string(role_label(*w)) + " rank " + std::to_string(rank);
  spdlog::error("router: {} is down: {}", name, why);
  metrics_.rank_down_total.inc({role_label(*w), std::to_string(rank)});
  // Fence it: the other workers drop what they share with this incarnation.
  for (int r : worker_ranks(rank)) channel_.send(r, proto::PeerDown{rank, w->epoch});
  return RankDown{rank, name, why};
}

void Membership::cancel_on(int rank, uint64_t id) {
  const WorkerView* w = workers_.find(rank);
  if (w != nullptr && w->state != RankState::kDown) channel_.send(rank, proto::Cancel{id});  // a down rank dropped it
}

}  // namespace pd::router
