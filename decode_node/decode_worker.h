// The decode worker: receives KV handoffs straight into its paged blocks and
// runs continuous batching over them, streaming token events to the router.
//
// A sequence's life here: offered (waiting for room) -> receiving (blocks
// reserved, receives posted) -> ready (KV verified, waiting for admission) ->
// running (one token per iteration) -> finished/cancelled/failed; a running
// sequence may be preempted (blocks freed) and comes back by recomputing its
// KV from its tokens, which gives the same output (the CPU backend's kernels
// are batch-invariant). In colocated mode the router sends prompts here
// directly and this rank prefills them itself before they join the batch.
//
// Threading: one thread (the engine loop) calls everything, including MPI.
#pragma once

#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "config/cluster_config.h"
#include "kvtransfer/transport.h"
#include "protocol/control_channel.h"
#include "protocol/mpi_channel.h"
#include "sampling/sampler.h"
#include "serving/engine.h"

namespace pd {

class DecodeWorker {
 public:
  // `channel` carries the control messages (MpiControlChannel in the cluster),
  // `transport` the KV bytes.
  DecodeWorker(const ClusterConfig& cfg, const RoleTable& roles, std::unique_ptr<Engine> engine,
               std::unique_ptr<Transport> transport, std::unique_ptr<ControlChannel> channel);
  ~DecodeWorker();
  // Serves until the router sends Shutdown. Returns OK on a clean shutdown.
  Status run();
  // One iteration of run()'s loop (for tests and run()): handles the messages
  // that arrived, progresses transfers, applies deadlines, accepts offers that
  // fit, runs at most one decode step. Never sleeps. Returns whether it did
  // work (run() sleeps when not).
  bool run_once();
  // The router sent Shutdown: run() leaves its loop.
  bool shutting_down() const { return shutdown_; }

 private:
  using Clock = std::chrono::steady_clock;
  enum class SeqState { kOffered, kReceiving, kReady, kRunning, kPreempted, kDying };
  struct Seq {
    proto::RequestId id = 0;
    int source = -1;                   // prefill rank (-1: colocated, prompt came from the router)
    SeqState state = SeqState::kOffered;
    std::vector<int32_t> tokens;       // prompt + generated
    int32_t n_prompt = 0;
    int32_t n_generated = 0;
    SamplingParams params;
    std::optional<Sampler> sampler;
    bool has_blocks = false;
    bool kv_complete = false;          // every block it holds has its KV written
    bool needs_compute = false;        // colocated prompt or preempted: KV to (re)compute locally
    uint64_t order = 0;                // arrival order (preempted sequences resume oldest first)
    // transfer
    int tag = 0;
    std::vector<TransferOp> ops;
    std::vector<uint8_t> trailer;
    bool cancelled = false;            // cancelled/aborted while receiving: discard when ops finish
    bool failed = false;
    Clock::time_point arrived, accepted, received;  // received: KV complete (or arrival, colocated)
    Clock::time_point last_progress;   // accept, then each receive that completed (silent-sender backstop)
    bool timing_sent = false;
  };

  bool handle_messages();
  void on_offer(proto::HandoffOffer m, int source);
  void on_prompt(proto::PrefillRequest m);
  void on_cancel(proto::RequestId id, bool from_prefill, const std::string& reason);
  bool accept_offers();
  bool progress_transfers();
  void check_deadlines();
  bool step();
  Status compute_local(const std::vector<proto::RequestId>& ids, proto::TokenEvents& events);
  void finish_transfer(Seq& s);
  void fail(Seq& s, const std::string& reason, int http_status);
  void release(Seq& s);
  int64_t blocks_for_tokens(int64_t n) const;
  void report_load(bool force);
  Seq* find_seq(proto::RequestId id);
  void remember_cancelled(proto::RequestId id);
  bool was_cancelled(proto::RequestId id);

  const ClusterConfig cfg_;
  const RoleTable roles_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<ControlChannel> channel_;
  proto::KvWireHeader header_;

  std::unordered_map<proto::RequestId, Seq> seqs_;
  std::deque<proto::RequestId> offers_;    // offered, waiting for room (FIFO)
  std::vector<proto::RequestId> running_;  // admission order
  std::deque<proto::RequestId> waiting_;   // ready or preempted, in admission order
  std::map<proto::RequestId, Clock::time_point> cancelled_;  // tombstones: cancel before offer
  uint64_t next_order_ = 0;
  int next_tag_ = 0;
  int64_t preemptions_ = 0;
  bool shutdown_ = false;
  LoadReporter load_reporter_;
  std::vector<float> logits_;
  // The decode step's per-sequence inputs, reused from step to step (the
  // inner tables keep their capacity): a step allocates nothing in steady state.
  std::vector<std::vector<int32_t>> step_tables_;
  std::vector<SequenceBatch> step_batch_;
  std::vector<proto::RequestId> stepped_;
};

}  // namespace pd
