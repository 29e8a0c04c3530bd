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
//
// Threading: one thread (the engine loop) calls everything, including MPI.
#pragma once

#include <chrono>
#include <deque>
#include <memory>
#include <unordered_map>

#include "config/cluster_config.h"
#include "kvtransfer/transport.h"
#include "protocol/control_channel.h"
#include "protocol/mpi_channel.h"
#include "serving/engine.h"

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

 private:
  using Clock = std::chrono::steady_clock;
  enum class JobState { kQueued, kHeld, kSending, kZombie };
  struct Job {
    proto::PrefillRequest req;
    JobState state = JobState::kQueued;
    Clock::time_point arrived, offered, computed, send_started;
    Clock::time_point last_progress;     // last layer posted or send completed (transfer deadline)
    int64_t bytes_posted = 0;
    bool accepted = false;
    int tag = 0;
    bool has_seq = false;
    int64_t cached = 0;                  // leading prompt tokens whose KV the prefix cache held
    std::vector<int32_t> table;          // block ids (valid while has_seq)
    std::vector<uint64_t> checksums;     // per layer, filled as layers are written
    int layers_posted = 0;
    std::vector<TransferOp> ops;
    std::vector<uint8_t> trailer;
    int32_t first_token = -1;
    bool finished_at_first = false;
    double queue_s = 0;
  };

  bool handle_messages();
  void on_request(proto::PrefillRequest req);
  void on_cancel(proto::RequestId id);
  void on_accept(const proto::HandoffAccept& m, int source);
  void on_reject(const proto::HandoffReject& m);
  bool run_batch();
  void post_layer(Job& job, int layer);
  void post_trailer(Job& job);
  bool progress_transfers();
  void pump_transfers();
  void check_deadlines();
  void fail(Job& job, const std::string& reason, int http_status, bool tell_decode);
  void release(Job& job, bool kv_written);
  void report_load(bool force);
  Job* find_job(proto::RequestId id);
  bool in_batch(proto::RequestId id) const;

  const ClusterConfig cfg_;
  const RoleTable roles_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<ControlChannel> channel_;
  proto::KvWireHeader header_;

  std::unordered_map<proto::RequestId, Job> jobs_;
  std::deque<proto::RequestId> queue_;
  std::vector<proto::RequestId> batch_;  // ids in the running batch (hook reads it)
  int64_t next_seq_ = 0;
  bool shutdown_ = false;
  LoadReporter load_reporter_;
};

}  // namespace pd
