// What the prefill and the decode worker have in common: one loop, one way of
// knowing the other ranks, one way of joining, leaving and reporting load.
//
// A worker rank runs WorkerCore::run(): each iteration (run_once) takes the
// control messages that arrived, moves its KV transfers, applies its
// deadlines, does one piece of its own work (a prefill pass, or a decode step
// after accepting handoffs), and reports its load. The messages every worker
// handles the same way are handled here; the rest go to the worker's
// on_message. What is the worker's own — its requests and their states — it
// supplies through the virtual functions below (the template-method shape of
// vLLM's EngineCore and the two SGLang disaggregation loops).
//
// Shared here:
// - The router link (router_link.h): which messages are taken from whom, the
//   router's liveness (it beats once a second; after timeouts.router_ms
//   without any message from it the router is gone), load reports and KV
//   events (what the prefix cache stored and evicted, for the router's prefix
//   index; the whole set when run() starts and after a Rejoin). Links from
//   ranks that joined later proved the cluster secret before any of their
//   messages gets here (protocol/link_auth.h).
// - Epochs (messages.h, "Epochs"): each peer's incarnation (PeerEpochs); a
//   message from another worker is judged by current() before it is acted
//   on. PeerDown / PeerUp / Hello / PeerLeft update it; the worker ends what
//   involved a peer that went down (on_peer_down).
// - Rejoin: this rank itself was declared down; the router re-ran or failed
//   all it held, so the worker drops everything (drop_all) and serves on
//   under the new epoch.
// - The rank's stage (WorkerStage; every change checked, util/lifecycle.h):
//     kServing -> kLeaveAsked (a joined rank got SIGTERM: Leave sent)
//              -> kLeaving (Drain: queued work handed back, on_drain)
//              -> kDrained (nothing held or in flight: Drained sent)
//              -> kShutdown (the router's Shutdown)
//   kServing may go straight to kLeaving (POST /admin/drain) or kShutdown
//   (the router stops). From any stage before kShutdown: kRouterLost (the
//   router fell silent: the rank drops what it held, then joins a new router,
//   worker_main and timeouts.rejoin_ms, or exits: pools do not linger) or
//   kDeviceFailed (the rank leaves like a crashed one: the router's heartbeat
//   fences it). The last three end run().
//
// Threading: one thread (the engine loop, a compute thread) calls everything;
// it never calls MPI: `channel` and `transport` are the communication side's
// ends in the cluster (kvtransfer/comm_side.h).
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include "config/cluster_config.h"
#include "kvtransfer/transport.h"
#include "protocol/control_channel.h"
#include "protocol/role_table.h"
#include "protocol/peer_epochs.h"
#include "serving/engine.h"
#include "util/env.h"
#include "worker/router_link.h"
#include "worker/worker_hooks.h"

namespace pd {

// A request's sequence in the engine's block manager (one per request id).
inline SeqId seq_of(proto::RequestId id) { return SeqId{static_cast<int64_t>(id)}; }

enum class WorkerStage { kServing, kLeaveAsked, kLeaving, kDrained, kShutdown, kRouterLost, kDeviceFailed };
const char* state_name(WorkerStage s);
bool legal(WorkerStage from, WorkerStage to);

class WorkerCore : public WorkerHooks {
 public:
  ~WorkerCore() override;
  WorkerCore(const WorkerCore&) = delete;
  WorkerCore& operator=(const WorkerCore&) = delete;

  // Serves until the router sends Shutdown (OK), the router is gone or the
  // device fails (why, as an error). The router gone: what this rank held is
  // dropped; Unavailable when nothing is left in flight (the rank may serve a
  // new router with the same engine), Timeout when a KV transfer did not end
  // within exit_grace() (it must not: its memory may still be written).
  Status run();
  // One iteration of run()'s loop (for tests and run()): handles the messages
  // that arrived, progresses transfers, applies deadlines, does at most one
  // piece of work. Never sleeps. Returns whether it did work (run() waits for
  // the next message when not).
  bool run_once();
  // The router sent Shutdown: run() leaves its loop.
  bool shutting_down() const { return stage_ == WorkerStage::kShutdown; }
  // Why this rank stops serving because its device failed (OK while none).
  const Status& device_fault() const { return stage_ == WorkerStage::kDeviceFailed ? stop_cause_ : kOk; }
  // Why this rank stops because the router fell silent (OK while it is heard).
  const Status& router_lost() const { return stage_ == WorkerStage::kRouterLost ? stop_cause_ : kOk; }
  WorkerStage stage() const { return stage_; }
  // Time and other processes as this worker sees them (default: ClusterEnv
  // over its role table: a rank is gone when its pid on this host ended).
  // Tests step a FakeEnv instead of sleeping and declare processes gone.
  void set_env(std::shared_ptr<const Env> env) { env_ = std::move(env); }

 protected:
  using Clock = std::chrono::steady_clock;
  // `role`: "prefill" or "decode" (log lines say "<role> rank N").
  WorkerCore(const char* role, const ClusterConfig& cfg, const RoleTable& roles, std::shared_ptr<Engine> engine,
             std::unique_ptr<Transport> transport, std::unique_ptr<ControlChannel> channel);

  // What each worker supplies: worker_hooks.h.

  // --- Shared ---
  // Handles the messages that arrived; in a pass, only those mid_pass_message
  // allows (the rest, and every later one, wait: order per source holds).
  bool handle_messages(bool in_pass = false);
  // Whether peer `rank`'s process is known to have ended: the router said so
  // (PeerGone: mpirun's process table, any host), or it ran on this host and its pid is gone.
  bool peer_gone(int rank) const { return gone_.count(rank) > 0 || env_->rank_gone(rank); }
  // Whether a message from worker `source` under `epoch` is from a live incarnation.
  bool current(int source, proto::Epoch epoch);
  void report_load(bool force);
  // Frees (KV written: its blocks may be offered to later prompts) or discards
  // a request's blocks; `has_blocks` is cleared.
  void release_blocks(proto::RequestId id, bool& has_blocks, bool kv_written);
  int64_t blocks_for_tokens(int64_t n) const;
  // A prompt's KV is complete: `cached` of its tokens came from the prefix
  // cache, `computed` were computed (load reports carry the totals).
  void count_prompt(int64_t cached, int64_t computed) { link_.count_prompt(cached, computed); }
  const char* role() const { return role_; }
  // A message from a peer refused for what it says (an index or count out of
  // range): counted with those refused for their sender (refused_messages).
  void count_refused() { link_.count_refused(); }
  // A pass failed: if the device itself is gone, run() stops (kDeviceFailed).
  // A rank already stopping keeps its own reason.
  void check_device();

  const ClusterConfig cfg_;
  const RoleTable roles_;
  std::shared_ptr<Engine> engine_;  // shared with worker_main: it outlives a router (see run())
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<ControlChannel> channel_;
  std::shared_ptr<const Env> env_;
  proto::KvWireHeader header_;
  proto::KvEndpoint endpoint_;  // where this rank's KV lives and its device paths (offers and accepts carry it)
  proto::Epoch epoch_ = 0;      // this rank's incarnation (Rejoin)
  PeerEpochs peers_;            // the other workers' epochs, which are down
  std::set<int> gone_;          // peers whose process has ended (PeerGone)

 private:
  static inline const Status kOk = Status::ok();
  void handle(int source, proto::Message& m);
  void peer_down(int rank, proto::Epoch epoch);
  void rejoin(proto::Epoch epoch);
  void peer_left(int rank);
  // The stage moves to `to` (checked); false when the rank already stopped.
  bool set_stage(WorkerStage to);
  // Leave (a joined rank asked to go by SIGTERM) and Drained, when due.
  void leave_or_report_drained();
  // run()'s end when the router fell silent (see run()).
  Status end_without_router();

  const char* role_;
  WorkerStage stage_ = WorkerStage::kServing;
  Status stop_cause_;  // why the stage is kRouterLost / kDeviceFailed
  RouterLink link_;
};

}  // namespace pd
