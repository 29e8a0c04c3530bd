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
// - Senders: a message is acted on only from the rank that may send it
//   (proto::sender_of): the router's (Shutdown, Drain, Rejoin, PeerDown, a
//   prompt, ...) from the router alone, the workers' (offers, accepts, Hello)
//   from another worker; the rest are ignored and counted (the load report's
//   refused_messages). Links from ranks that joined later proved the cluster
//   secret before any of their messages gets here (protocol/link_auth.h).
// - Epochs (messages.h, "Epochs"): each peer's incarnation (PeerEpochs); a
//   message from another worker is judged by current() before it is acted
//   on. PeerDown / PeerUp / Hello / PeerLeft update it; the worker ends what
//   involved a peer that went down (on_peer_down).
// - Rejoin: this rank itself was declared down; the router re-ran or failed
//   all it held, so the worker drops everything (drop_all) and serves on
//   under the new epoch.
// - Leaving the pool: Drain starts it (the worker hands back what has not
//   started, on_drain); once nothing is held or in flight the rank tells the
//   router (Drained); the router then sends Shutdown. A joined rank that got
//   SIGTERM asks for it first (Leave).
// - Load reports (LoadReport), at most every few ms unless forced.
// - KV events (KvEvents): what the prefix cache stored and evicted since the
//   last iteration, for the router's prefix index; the whole set (reset) when
//   run() starts and after a Rejoin.
// - The router's liveness: it beats once a second (RouterBeat); after
//   timeouts.router_ms without any message from it the router is gone and
//   run() stops: the rank drops what it held, then joins a new router
//   (worker_main, timeouts.rejoin_ms) or exits (pools do not linger). Only
//   time this loop runs counts: a long pass or the process being stopped is
//   not the router's silence.
// - run()'s end: shutdown, the router gone, or a device failure (the rank
//   leaves like a crashed one: the router's heartbeat fences it).
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

namespace pd {

// A request's sequence in the engine's block manager (one per request id).
inline SeqId seq_of(proto::RequestId id) { return SeqId{static_cast<int64_t>(id)}; }

class WorkerCore {
 public:
  virtual ~WorkerCore();
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
  bool shutting_down() const { return shutdown_; }
  // Why this rank stops serving because its device failed (OK while none).
  const Status& device_fault() const { return device_fault_; }
  // Why this rank stops because the router fell silent (OK while it is heard).
  const Status& router_lost() const { return router_lost_; }
  // Time and other processes as this worker sees them (default: ClusterEnv
  // over its role table: a rank is gone when its pid on this host ended).
  // Tests step a FakeEnv instead of sleeping and declare processes gone.
  void set_env(std::shared_ptr<const Env> env) { env_ = std::move(env); }

 protected:
  using Clock = std::chrono::steady_clock;
  // `role`: "prefill" or "decode" (log lines say "<role> rank N").
  WorkerCore(const char* role, const ClusterConfig& cfg, const RoleTable& roles, std::shared_ptr<Engine> engine,
             std::unique_ptr<Transport> transport, std::unique_ptr<ControlChannel> channel);

  // --- What each worker supplies ---
  // A message of this worker's own kind (prompts, offers, handoff answers).
  // False: this worker does not take such messages (logged).
  virtual bool on_message(int source, proto::Message& m) = 0;
  // Moves the KV transfers; true when one made progress.
  virtual bool progress_transfers() = 0;
  // Ends what has waited longer than its deadline allows.
  virtual void check_deadlines() = 0;
  // At most one piece of compute (a pass, a step); true when it did work.
  virtual bool work() = 0;
  // Peer `rank`'s incarnation is over: end what involves it.
  virtual void on_peer_down(int rank) = 0;
  // Peer `rank` left the cluster for good (after on_peer_down).
  virtual void forget_peer(int /*rank*/) {}
  // This rank was declared down: drop everything it holds, silently.
  virtual void drop_all() = 0;
  // Leaving the pool begins: hand back what has not started.
  virtual void on_drain() = 0;
  // Requests this rank holds (Drained waits for none; logs).
  virtual size_t held() const = 0;
  // The worker's fields of a load report (waiting, running, ...).
  virtual void fill_load(proto::LoadReport& r) const = 0;
  // Shutdown: stops what need not finish; then run() waits up to exit_grace()
  // for the transfers still in flight.
  virtual void before_exit() {}
  virtual std::chrono::milliseconds exit_grace() const = 0;
  // Appended to the "ready" log line (e.g. what mode the rank serves in).
  virtual const char* ready_note() const { return ""; }
  // Whether the layer hook may act on `m` in the middle of a pass (only
  // workers that call handle_messages(true) from their hook need say).
  virtual bool mid_pass_message(const proto::Message& /*m*/) const { return false; }

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
  void count_prompt(int64_t cached, int64_t computed) {
    prompt_tokens_cached_ += cached;
    prompt_tokens_computed_ += computed;
  }
  const char* role() const { return role_; }
  // A message from a peer refused for what it says (an index or count out of
  // range): counted with those refused for their sender (refused_messages).
  void count_refused() { ++refused_messages_; }

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
  Status device_fault_;         // set when a failed pass finds the device itself gone: run() stops
  bool leaving_ = false;        // Drain received: no new work, finishing the rest

 private:
  void handle(int source, proto::Message& m);
  void peer_down(int rank, proto::Epoch epoch);
  void rejoin(proto::Epoch epoch);
  void peer_left(int rank);
  void drain();
  void leave_or_report_drained();
  // Tells the router what the prefix cache stored and evicted (snapshot: all it holds).
  void send_kv_events(bool snapshot);
  // Counts the router's silence since the last iteration (at most 1 s of it:
  // a long pass or a stopped process is not silence) and gives up past its limit.
  void watch_router();
  // run()'s end when the router fell silent (see run()).
  Status end_without_router();

  // Whether `source` may send `msg` (proto::sender_of: the router's messages
  // from the router only, the workers' from a worker); refused ones are counted.
  bool from_allowed_sender(int source, const proto::Message& msg);

  const char* role_;
  int64_t refused_messages_ = 0;  // messages ignored for their sender (from_allowed_sender)
  bool shutdown_ = false;
  bool drained_sent_ = false, leave_sent_ = false;
  LoadReporter load_reporter_;
  int64_t prompt_tokens_cached_ = 0, prompt_tokens_computed_ = 0;
  bool heard_router_;  // any message from the router yet (a joined rank has had its answer)
  Clock::duration router_silence_{};
  std::optional<Clock::time_point> last_iteration_;
  Status router_lost_;
};

}  // namespace pd
