// Membership: decides which ranks are in the cluster and in what state.
//  - Joins: a rank started later by its own mpirun asks to join (Join); it is
//    refused naming what differs (role, kv.block_size, kv.dtype, a colocated
//    cluster, the router stopping) or accepted, linked to the up ranks of the
//    other role, and sent work once it reports ready.
//  - Drains: a rank leaves gracefully (POST /admin/drain, or its own Leave):
//    it takes no new work, its queued prefills come back to be re-run elsewhere
//    (FailureKind::kLeaving), the rest finishes; on Drained the others get
//    PeerLeft and it gets Shutdown. One that does not finish within
//    timeouts.rank_drain_ms is ended as down, then removed.
//  - Liveness: every message from a worker is its heartbeat; one silent for
//    timeouts.heartbeat_ms is declared down and fenced (the others get
//    PeerDown; what it held re-runs or fails: check_liveness returns it as a
//    RankDown for the link loop to apply),
//    told to Rejoin when it speaks again, and re-admitted under a new epoch
//    once it reports under that epoch. A down rank whose process has ended
//    (env's rank_gone: mpirun's process table, any host) is reported to the
//    others once (PeerGone): blocks under its unfinished transfers can be freed.
// The worker table (dispatch.h) holds the states; this class moves them and
// tells the ranks. It calls nothing of the router: what the router must do
// about the requests comes back as events. Link thread only.
#pragma once

#include <chrono>
#include <optional>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include "config/cluster_config.h"
#include "protocol/control_channel.h"
#include "protocol/role_table.h"
#include "router/dispatch.h"
#include "router/router_metrics.h"
#include "util/env.h"

namespace pd::router {

// `rank` was declared down and the other ranks told (PeerDown): what it held
// is re-run or failed. `name` is "prefill rank N" / "decode rank N", `why` the cause.
struct RankDown {
  int rank = -1;
  std::string name;
  std::string why;
};
// A drain past its deadline: once its RankDown was applied, the rank is
// removed (Membership::remove).
struct RemoveRank {
  int rank = -1;
};
// What a membership check asks of the link loop, applied in order.
using MembershipEvent = std::variant<RankDown, RemoveRank>;

class Membership {
 public:
  // Every reference must outlive this.
  // `kv_dtype` and `model` (gguf_fingerprint; "" = not checked): what a
  // joining rank must have.
  Membership(const ClusterConfig& cfg, std::string kv_dtype, std::string model, WorkerTable& workers,
             ControlChannel& channel, RouterMetrics& metrics);
  void set_env(const Env* env) { env_ = env; }

  // A rank asks to join; refused while `router_stopping`.
  void on_join(int source, const proto::Join& m, bool router_stopping);
  // Starts draining `rank` out of the cluster; returns why it cannot, or "".
  std::string begin_drain(int rank, const std::string& why);
  // `rank` says it holds nothing more (Drained): a draining rank is removed.
  void on_drained(int rank);
  // Removes `rank` (a RemoveRank, or a drained or down rank taken out): the
  // others are told (PeerLeft), it gets Shutdown.
  void remove(int rank);
  void on_report(int source, const proto::LoadReport& m);
  // Drains past timeouts.rank_drain_ms, and ranks silent past
  // timeouts.heartbeat_ms (or not ready within timeouts.startup_ms): declared
  // down (fenced, the others told), returned for the caller to apply in order
  // (a late drain's RankDown is followed by its RemoveRank). The other way
  // round, every worker hears that the router is alive (RouterBeat, once a
  // second; a worker stops after timeouts.router_ms without it).
  [[nodiscard]] std::vector<MembershipEvent> check_liveness();
  // A rank that served and has been silent this long gets no RouterBeat until
  // it is heard again (check_liveness).
  static constexpr std::chrono::milliseconds kBeatSilence{1500};
  // Tells `rank` to drop wire id `id` (unless it is down: it dropped everything).
  void cancel_on(int rank, uint64_t id);
  // Every worker in the table except `except` (broadcasts).
  std::vector<int> worker_ranks(int except = -1) const;

 private:
  // Why a Join is refused, or "".
  std::string join_refusal(const proto::Join& m, bool router_stopping) const;
  void send_beats();
  void check_drains(std::vector<MembershipEvent>& events);
  // Down ranks whose process has ended: the others are told (PeerGone), once a rank, at most once a second.
  void confirm_deaths();
  // `rank` is declared down: fenced, the others told; its RankDown.
  RankDown declare_down(int rank, const std::string& why);

  const ClusterConfig& cfg_;
  const std::string kv_dtype_, model_;
  WorkerTable& workers_;
  ControlChannel& channel_;
  RouterMetrics& metrics_;
  const Env* env_ = &system_env();
  std::optional<std::chrono::steady_clock::time_point> last_beat_, last_death_check_;
  std::set<int> gone_;  // ranks confirmed ended (PeerGone sent)
};

}  // namespace pd::router
