#include "worker/worker_core.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <thread>

#include "kvtransfer/kv_path.h"
#include "protocol/cluster_env.h"
#include "util/lifecycle.h"
#include "worker/worker_main.h"

namespace pd {

const char* state_name(WorkerStage s) {
  switch (s) {
    case WorkerStage::kServing: return "serving";
    case WorkerStage::kLeaveAsked: return "leave asked";
    case WorkerStage::kLeaving: return "leaving";
    case WorkerStage::kDrained: return "drained";
    case WorkerStage::kShutdown: return "shutdown";
    case WorkerStage::kRouterLost: return "router lost";
    case WorkerStage::kDeviceFailed: return "device failed";
  }
  return "?";
}

bool legal(WorkerStage from, WorkerStage to) {
  using S = WorkerStage;
  const bool stops = to == S::kShutdown || to == S::kRouterLost || to == S::kDeviceFailed;
  switch (from) {
    case S::kServing: return to == S::kLeaveAsked || to == S::kLeaving || stops;
    case S::kLeaveAsked: return to == S::kLeaving || stops;
    case S::kLeaving: return to == S::kDrained || stops;
    case S::kDrained: return stops;
    case S::kShutdown:
    case S::kRouterLost:
    case S::kDeviceFailed: return false;  // run() has ended
  }
  return false;
}

WorkerCore::WorkerCore(const char* role, const ClusterConfig& cfg, const RoleTable& roles,
                       std::shared_ptr<Engine> engine, std::unique_ptr<Transport> transport,
                       std::unique_ptr<ControlChannel> channel)
    : cfg_(cfg),
      roles_(roles),
      engine_(std::move(engine)),
      transport_(std::move(transport)),
      channel_(std::move(channel)),
      env_(std::make_shared<ClusterEnv>(roles)),
      role_(role),
      link_(role, cfg_, roles_, *channel_) {
  header_ = engine_->wire_header();
  engine_->blocks->enable_events(true);
  for (const auto& [rank, epoch] : roles_.peer_epochs) peers_.up(rank, epoch);
  endpoint_ = local_kv_endpoint(engine_->backend->device_memory(), engine_->backend->device_id(), transport_->paths());
}

// The workers set a layer hook that calls into them: it must not outlive them.
WorkerCore::~WorkerCore() { engine_->model->set_kv_written_hook({}); }

Status WorkerCore::run() {
  spdlog::info("{} rank {} ready ({} KV blocks of {} tokens{})", role_, roles_.self, engine_->blocks->num_blocks(),
               engine_->blocks->block_size(), ready_note());
  report_load(true);
  link_.send_kv_events(*engine_->blocks, epoch_, true);
  while (stage_ != WorkerStage::kShutdown && stage_ != WorkerStage::kRouterLost &&
         stage_ != WorkerStage::kDeviceFailed)
    // Idle: wait for a message or a transfer that ended (the communication side
    // wakes us), at most 5 ms — deadlines and load reports need no finer step.
    if (!run_once()) channel_->wait_for_work(std::chrono::milliseconds(5));
  if (stage_ == WorkerStage::kRouterLost) return end_without_router();
  if (stage_ == WorkerStage::kDeviceFailed) {
    // The device is gone: nothing more can run here. Leave like a crashed rank
    // (the cluster's heartbeats fence it and re-run or fail what it held).
    spdlog::critical("{} rank {}: device failed, stopping: {}", role_, roles_.self, stop_cause_.to_string());
    return stop_cause_;
  }
  // Shutdown: the router drained first; give in-flight transfers a bounded chance.
  before_exit();
  const auto end = Clock::now() + exit_grace();
  while (transport_->pending() && Clock::now() < end) {
    progress_transfers();
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  channel_->flush(std::chrono::milliseconds(2000));
  return Status::ok();
}

bool WorkerCore::run_once() {
  transport_->progress();
  bool busy = handle_messages();
  if (std::optional<Status> lost = link_.watch(env_->now()); lost && set_stage(WorkerStage::kRouterLost))
    stop_cause_ = std::move(*lost);
  busy |= progress_transfers();
  check_deadlines();
  busy |= work();
  leave_or_report_drained();
  link_.send_kv_events(*engine_->blocks, epoch_, false);
  channel_->progress();
  report_load(false);
  return busy;
}

bool WorkerCore::handle_messages(bool in_pass) {
  const auto fn = [this](int source, proto::Message& m) { handle(source, m); };
  if (!in_pass) return channel_->receive(fn) > 0;
  const auto now_ok = [this](int, const proto::Message& m) {
    return std::holds_alternative<proto::RouterBeat>(m) || mid_pass_message(m);
  };
  return channel_->receive_while(now_ok, fn) > 0;
}

Status WorkerCore::end_without_router() {
  // Nobody can reach this rank's requests any more: drop them, and let the
  // transfers they began end (cancelled receives, sends the peer gives up).
  const size_t dropped = held();
  drop_all();
  const auto end = Clock::now() + exit_grace();
  while ((held() > 0 || transport_->pending() > 0) && Clock::now() < end) {
    progress_transfers();
    check_deadlines();
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (held() > 0 || transport_->pending() > 0) {
    // A transfer still in flight may yet write into this rank's KV memory:
    // it must not serve again in this process.
    spdlog::critical("{} rank {}: {}; stopping ({} requests dropped; {} KV transfers did not end)", role_, roles_.self,
                     stop_cause_.message(), dropped, transport_->pending());
    return stop_cause_;
  }
  spdlog::warn("{} rank {}: {}; {} requests dropped, nothing in flight", role_, roles_.self, stop_cause_.message(),
               dropped);
  return Status::unavailable(stop_cause_.message());
}

void WorkerCore::handle(int source, proto::Message& msg) {
  if (!link_.accept(source, msg)) return;
  // One bad message must not end the rank (and, with it, every request on it).
  try {
    std::visit(
        [&](auto&& m) {
          using T = std::decay_t<decltype(m)>;
          if constexpr (std::is_same_v<T, proto::PeerDown>) peer_down(m.rank, m.epoch);
          else if constexpr (std::is_same_v<T, proto::PeerUp>) peers_.up(m.rank, m.epoch);
          else if constexpr (std::is_same_v<T, proto::Hello>) peers_.up(source, m.epoch);
          else if constexpr (std::is_same_v<T, proto::Rejoin>) rejoin(m.epoch);
          else if constexpr (std::is_same_v<T, proto::Drain>) {
            // Leaving the pool: no new work, the rest finishes (a second Drain changes nothing).
            if ((stage_ == WorkerStage::kServing || stage_ == WorkerStage::kLeaveAsked) &&
                set_stage(WorkerStage::kLeaving))
              on_drain();
          }
          else if constexpr (std::is_same_v<T, proto::PeerLeft>) peer_left(m.rank);
          else if constexpr (std::is_same_v<T, proto::RouterBeat>) return;  // heard: that is all
          else if constexpr (std::is_same_v<T, proto::PeerGone>) {
            if (peers_.is_down(m.rank)) gone_.insert(m.rank);  // a process that ended does not come back
          }
          else if constexpr (std::is_same_v<T, proto::Shutdown>) {
            const bool drained = stage_ == WorkerStage::kDrained;
            if (set_stage(WorkerStage::kShutdown) && drained) note_left();
          } else if (!on_message(source, msg)) {
            spdlog::warn("{} rank {}: unexpected {} from rank {}", role_, roles_.self, proto::message_name(msg), source);
          }
        },
        msg);
  } catch (const std::exception& e) {
    spdlog::error("{} rank {}: handling {} from rank {}: {}", role_, roles_.self, proto::message_name(msg), source,
                  e.what());
  }
}

bool WorkerCore::current(int source, proto::Epoch epoch) {
  switch (peers_.check(source, epoch)) {
    case PeerEpochs::Verdict::kCurrent: return true;
    case PeerEpochs::Verdict::kNewer:
      // Re-admitted before the router's PeerDown/PeerUp reached us.
      peer_down(source, peers_.epoch(source));
      peers_.up(source, epoch);
      return true;
    case PeerEpochs::Verdict::kStale:
      spdlog::warn("{} rank {}: dropped a message from rank {}'s ended epoch {}", role_, roles_.self, source, epoch);
      return false;
    case PeerEpochs::Verdict::kDown:
      spdlog::warn("{} rank {}: dropped a message from rank {}, which is down", role_, roles_.self, source);
      return false;
  }
  return false;
}

void WorkerCore::peer_down(int rank, proto::Epoch epoch) {
  if (!peers_.down(rank, epoch)) return;  // an incarnation already known to be over
  on_peer_down(rank);
}

void WorkerCore::peer_left(int rank) {
  // The router drained the rank before removing it: nothing here should
  // involve it any more. Anything that still does ends as if it were down.
  peer_down(rank, peers_.epoch(rank));
  peers_.forget(rank);
  forget_peer(rank);
  transport_->forget_peer(rank);
  channel_->forget(rank);
}

void WorkerCore::rejoin(proto::Epoch epoch) {
  if (epoch <= epoch_) return;
  // The router declared this rank down (it was stopped or too slow to report)
  // and has re-run or failed everything it held: drop it all, silently.
  spdlog::warn("{} rank {}: rejoining under epoch {} (was declared down); dropping {} requests", role_, roles_.self,
               epoch, held());
  drop_all();
  epoch_ = epoch;
  report_load(true);
  link_.send_kv_events(*engine_->blocks, epoch_, true);
}

bool WorkerCore::set_stage(WorkerStage to) {
  const bool stopped = stage_ == WorkerStage::kShutdown || stage_ == WorkerStage::kRouterLost ||
                       stage_ == WorkerStage::kDeviceFailed;
  if (stopped) return false;  // the first reason to stop stands
  return transition(stage_, to, static_cast<uint64_t>(roles_.self), role_);
}

void WorkerCore::check_device() {
  Status health = engine_->backend->device_health();
  if (!health.is_ok() && set_stage(WorkerStage::kDeviceFailed)) stop_cause_ = std::move(health);
}

void WorkerCore::leave_or_report_drained() {
  // A joined rank got SIGTERM: it asks the router to drain it (once; a rank
  // already leaving has nothing to ask).
  if (stage_ == WorkerStage::kServing && leave_requested() && set_stage(WorkerStage::kLeaveAsked))
    channel_->send(roles_.router, proto::Leave{});
  // Leaving: everything it held has finished (or failed) and no transfer is in
  // flight (a quarantined receive holds this until it resolves).
  if (stage_ == WorkerStage::kLeaving && held() == 0 && transport_->pending() == 0 &&
      set_stage(WorkerStage::kDrained))
    channel_->send(roles_.router, proto::Drained{});
}

void WorkerCore::report_load(bool force) {
  proto::LoadReport r;
  fill_load(r);
  r.free_blocks = engine_->blocks->num_free_blocks();
  r.total_blocks = engine_->blocks->num_blocks();
  r.ready = true;
  r.epoch = epoch_;
  link_.report_load(std::move(r), force, env_->now());
}

void WorkerCore::release_blocks(proto::RequestId id, bool& has_blocks, bool kv_written) {
  if (!has_blocks) return;
  Status st = kv_written ? engine_->blocks->free(seq_of(id)) : engine_->blocks->discard(seq_of(id));
  if (!st.is_ok()) spdlog::error("{} rank {}: releasing request {}: {}", role_, roles_.self, id, st.to_string());
  has_blocks = false;
}

int64_t WorkerCore::blocks_for_tokens(int64_t n) const {
  const int64_t bs = engine_->blocks->block_size();
  return (n + bs - 1) / bs;
}

}  // namespace pd
