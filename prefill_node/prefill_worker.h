// The prefill worker: takes prompts from the router, runs them in batches under
// a token budget, samples each request's first token, and hands the KV cache to
// the request's decode rank layer by layer while the remaining layers compute.
//
// Handoff protocol (pull; see common/protocol/messages.h): on arrival the worker
// offers the request to its decode rank at once, so the decode rank can reserve
// blocks and post receives while the prompt is still queued or computing.
// Layers of accepted requests are sent as soon as each is written; a request
// whose offer is not yet accepted when its batch ends keeps its KV here until
// the accept (then all layers go at once), a reject, or the handoff timeout.
// Each job's transfer is one HandoffSender (kvtransfer/handoff_sender.h): its
// tag, the order of its sends, its trailer and checksums, what went out behind
// compute, and abandonment; this worker keeps the queue, the batches and the
// request's lifecycle.
//
// A job's lifecycle (JobState; every change checked, see util/lifecycle.h):
//   kQueued -> kComputing -> kHeld -> kSending -> (ended: erased)
//                        \-----------> kSending
//   kComputing -> kAborted (ended while forward() still reads its blocks;
//                           erased when the pass returns)
//   any other state -> (ended: erased)
// Ending a job with sends in flight abandons them (MPI cannot cancel a send):
// the decode rank was told (HandoffAbort) or is down, and discards whatever
// arrives; it never re-posts a receive under that tag for us (decode_worker.h).
// So the blocks may be reused at once; the trailer bytes, which MPI may still
// read, are kept alive (graveyard_).
//
// Faults: the router declares ranks down (PeerDown) and up (PeerUp); messages
// from another worker carry its epoch and are dropped when that incarnation is
// over. A Rejoin means this rank itself was declared down: it drops every
// request (the router already re-ran or failed them) and continues under the
// new epoch.
//
// Threading: one thread (the engine loop, a compute thread) calls everything;
// it never calls MPI: `channel` and `transport` are the communication side's
// ends in the cluster (kvtransfer/comm_side.h), which keep messages and sends
// moving while a pass runs. A control message that arrives during a pass is
// acted on at the next layer's end (mid_pass_message); sends of an accepted
// handoff go out layer by layer as each is written.
#pragma once

#include <chrono>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>
#include <unordered_set>

#include "config/cluster_config.h"
#include "kvtransfer/handoff_sender.h"
#include "kvtransfer/transport.h"
#include "protocol/control_channel.h"
#include "protocol/peer_epochs.h"
#include "protocol/role_table.h"
#include "serving/engine.h"
#include "util/env.h"

namespace pd {

class PrefillWorker {
 public:
  // `channel` carries the control messages (MpiControlChannel in the cluster),
  // `transport` the KV bytes.
  PrefillWorker(const ClusterConfig& cfg, const RoleTable& roles, std::unique_ptr<Engine> engine,
                std::unique_ptr<Transport> transport, std::unique_ptr<ControlChannel> channel);
  ~PrefillWorker();
  // Serves until the router sends Shutdown. Returns OK on a clean shutdown.
  Status run();
  // One iteration of run()'s loop (for tests and run()): handles the messages
  // that arrived, progresses transfers, applies deadlines, runs at most one
  // batch. Never sleeps. Returns whether it did work (run() sleeps when not).
  bool run_once();
  // The router sent Shutdown: run() leaves its loop.
  bool shutting_down() const { return shutdown_; }
  // Time and other processes as this worker sees them (default: ClusterEnv
  // over its role table). Tests step a FakeEnv instead of sleeping.
  void set_env(std::shared_ptr<const Env> env) { env_ = std::move(env); }
  // Why this rank stops serving because its device failed (OK while none).
  const Status& device_fault() const { return device_fault_; }

 private:
  using Clock = std::chrono::steady_clock;
  enum class JobState { kQueued, kComputing, kPrefilling, kHeld, kSending, kAborted };
  friend const char* state_name(JobState s);
  friend bool legal(JobState from, JobState to);
  struct Job {
    proto::PrefillRequest req;
    JobState state = JobState::kQueued;
    Clock::time_point arrived, offered, started, computed;  // started: its first chunk's pass began
    bool has_seq = false;
    int64_t done = 0;                    // leading prompt tokens whose KV is in the cache (cached ones included)
    int64_t chunk_end = 0;               // end of the chunk placed for the running (or last) pass
    std::vector<LogprobEntry> prompt_logprobs;  // gathered chunk by chunk
    bool last_chunk() const { return chunk_end == static_cast<int64_t>(req.prompt.size()); }
    std::vector<int32_t> table;          // block ids (valid while has_seq)
    HandoffSender handoff;               // the KV's way to the decode rank (tag, sends, trailer, checksums)
    int64_t hidden_bytes = 0;            // bytes sent when the last layer was computed
    double queue_s = 0;
  };

  // Handles the messages that arrived; in a pass, only those mid_pass_message allows.
  bool handle_messages(bool in_pass);
  static bool mid_pass_message(const proto::Message& m);
  void on_request(proto::PrefillRequest req);
  void on_cancel(proto::RequestId id);
  void on_accept(const proto::HandoffAccept& m, int source);
  void on_reject(const proto::HandoffReject& m, int source);
  void on_peer_down(int rank, proto::Epoch epoch);
  void on_peer_up(int rank, proto::Epoch epoch);
  void on_rejoin(proto::Epoch epoch);
  void on_peer_left(int rank);
  // Drain: hand queued jobs back (FailureKind::kLeaving), finish the rest,
  // then tell the router (Drained) once nothing is held or in flight.
  void on_drain();
  void maybe_report_drained();
  // Whether a message from worker `source` under `epoch` is from a live incarnation.
  bool current(int source, proto::Epoch epoch);
  void set_state(Job& job, JobState to);
  bool run_batch();
  void plan_pass();
  Status place_chunk(Job& job, int64_t end);
  std::optional<proto::TokenEvent> finish_chunk(Job& job, std::span<float> rows);
  int64_t uncached_tokens(const Job& job) const;
  int64_t reserved_blocks() const;
  // Hands the written layers of an accepted handoff to the transport.
  void post_written(Job& job);
  HandoffSender::RegionOf region_of(const Job& job) const;
  bool progress_transfers();
  void check_deadlines();
  void fail(Job& job, const std::string& reason, proto::FailureKind kind, bool tell_decode);
  // Ends the job: abandons its sends, frees its blocks, erases it (or, in the
  // running batch, marks it kAborted for run_batch to erase).
  void end(proto::RequestId id);
  void release(Job& job, bool kv_written);
  void report_load(bool force);
  Job* find_job(proto::RequestId id);
  bool in_batch(proto::RequestId id) const;

  const ClusterConfig cfg_;
  const RoleTable roles_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<ControlChannel> channel_;
  std::shared_ptr<const Env> env_;
  proto::KvWireHeader header_;
  proto::KvEndpoint endpoint_;  // where this rank's KV lives and its device paths (offers carry it)

  std::unordered_map<proto::RequestId, Job> jobs_;
  std::deque<proto::RequestId> queue_;
  std::vector<proto::RequestId> batch_;  // ids in the running batch (hook reads it)
  int64_t next_seq_ = 0;
  bool shutdown_ = false;
  bool leaving_ = false, drained_sent_ = false, leave_sent_ = false;
  bool in_pass_ = false;
  Status device_fault_;  // set when a failed pass finds the device itself gone: run() stops                              // forward() is running (the layer hook may call in)
  proto::Epoch epoch_ = 0;
  PeerEpochs peers_;                                  // the other workers' epochs, which are down
  std::deque<std::vector<uint8_t>> graveyard_;        // trailers of abandoned handoffs (MPI may still read them)
  LoadReporter load_reporter_;
};

}  // namespace pd
