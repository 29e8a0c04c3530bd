// The decode worker: receives KV handoffs straight into its paged blocks and
// runs continuous batching over them, streaming token events to the router.
//
// A sequence's life here (SeqState; every change checked, util/lifecycle.h):
//   kOffered (waiting for room) -> kReceiving (blocks reserved, receives
//   posted) -> kReady (KV verified, waiting for admission) -> kRunning (one
//   token per iteration) <-> kPreempted (blocks freed; comes back by
//   recomputing its KV from its tokens, which gives the same output: the CPU
//   backend's kernels are batch-invariant) -> ended (erased).
//   kReady -> kPreempted: a waiting holder evicted to break a deadlock.
//   kReceiving -> kCancelling: ended while receives are posted; the blocks are
//   freed only when MPI can no longer write into them (below).
//   kReady/kPreempted -> kPrefilling (KV computed here chunk by chunk, each
//   chunk in a step beside the running decodes) -> kRunning | kPreempted.
// Prefix cache (kv.prefix_cache): a finished sequence's KV stays resident,
// evictable, and a prompt computed here reuses the leading blocks it shares
// with it (a follow-up turn the router sent back to this rank). Blocks filled
// by a KV transfer or a local prefill register for reuse only once their KV
// is written (AllocateOptions::publish), so nothing reads a block in flight.
// In colocated mode the router sends prompts here directly (kReady, KV to
// compute) and this rank prefills them itself before they join the batch:
// chunked (prefill.chunk_tokens > 0; each step holds decode.step_tokens
// tokens, Sarathi-style), or whole in a pass before the step (chunk_tokens 0).
//
// When may blocks under a receive be reused? When every receive completed or
// was cancelled (MPI reports it). A receive already matched to a send cannot
// be cancelled; if its sender is declared down, the sequence stays kCancelling
// and its blocks are quarantined: a stopped sender that resumes completes the
// send into them. They are released when the receives complete, or when the
// sender's process is confirmed gone (same host, pid ended: nothing can write
// any more). A sender on another host that never resumes keeps them
// quarantined (reported in LoadReport.quarantined_blocks).
//
// Tags (kv_tags.h): a handoff's tag is free again when every receive under it
// completed. One that ended early (cancelled, failed) with its sender up, on
// the mpi path, is reclaimed: the sender is asked to seal it (KvTagSeal:
// it ends the handoff if it still holds it, then posts an empty message under
// the tag after all it sent there), and this rank takes and drops what the
// sender posted under the tag up to that seal (Transport::post_reclaim, on the
// communication side), then gives the tag out again. That record lives in the
// tag pool, not the sequence, so either order works: the sender's abort first
// or this rank's cancel first. A tag whose sender is down, or whose handoff
// took a device path, is retired until the sender leaves. LoadReport carries
// the counts (kv_tags_retired, kv_tags_reclaiming).
//
// The loop, peers' epochs, Rejoin, leaving the pool and load reports are the
// worker core's (worker/worker_core.h); this class is what is decode's own.
#pragma once

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "decode_node/kv_tags.h"
#include "decode_node/scheduler.h"
#include "kvtransfer/handoff_receiver.h"
#include "sampling/logprobs.h"
#include "sampling/sampler.h"
#include "serving/prefill_chunks.h"
#include "worker/worker_core.h"

namespace pd {

class DecodeWorker final : public WorkerCore {
 public:
  // `channel` carries the control messages (MpiControlChannel in the cluster),
  // `transport` the KV bytes. run() / run_once(): WorkerCore; each iteration's
  // work accepts the offers that fit, then runs at most one step.
  DecodeWorker(const ClusterConfig& cfg, const RoleTable& roles, std::shared_ptr<Engine> engine,
               std::unique_ptr<Transport> transport, std::unique_ptr<ControlChannel> channel);
  // Tests: a small tag space per prefill rank, so reuse shows within a few
  // handoffs (the cluster's is kv.tag_span). For pools made from now on.
  void set_kv_tag_span(int span) { tag_span_ = span; }

 private:
  enum class SeqState { kOffered, kReceiving, kReady, kRunning, kPreempted, kPrefilling, kCancelling };
  friend const char* state_name(SeqState s);
  friend bool legal(SeqState from, SeqState to);
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
    int64_t computed = 0;              // kPrefilling: leading tokens whose KV this rank has computed
    int64_t cached = 0;                // of those, found in this rank's prefix cache
    Clock::time_point prefill_started; // its first chunk's step
    std::vector<LogprobEntry> prompt_logprobs;  // gathered chunk by chunk
    uint64_t order = 0;                // arrival order (preempted sequences resume oldest first)
    // transfer
    KvPathChoice path;                 // how its KV travels (from the offer's and this rank's endpoints)
    int tag = 0;                       // from tags_of(source) while it holds one
    HandoffReceiver handoff;           // its receives, trailer, and whether they all completed
    Clock::time_point arrived, accepted, received;  // received: KV complete (or arrival, colocated)
    bool timing_sent = false;
  };

  // WorkerCore
  bool on_message(int source, proto::Message& m) override;
  bool progress_transfers() override;
  void check_deadlines() override;
  bool work() override;
  void on_peer_down(int rank) override;
  void forget_peer(int rank) override;
  void drop_all() override;
  void on_drain() override;
  size_t held() const override { return seqs_.size(); }
  void fill_load(proto::LoadReport& r) const override;
  void before_exit() override;
  std::chrono::milliseconds exit_grace() const override { return std::chrono::milliseconds(2000); }
  const char* ready_note() const override { return roles_.colocated() ? ", colocated: prefills its own prompts" : ""; }

  void on_offer(proto::HandoffOffer m, int source);
  void on_prompt(proto::PrefillRequest m);
  void on_cancel(proto::RequestId id, bool from_prefill, const std::string& reason);
  void set_state(Seq& s, SeqState to);
  // Ends a sequence whose receives are posted: cancels them (kCancelling) or,
  // with none left, frees it.
  void cancel_receives(Seq& s);
  // Erases an ended sequence: its tag back to the pool (end_tag), blocks freed.
  void erase(Seq& s);
  // The sequence's tag as its handoff ends: free (every receive completed),
  // to reclaim (ended early, the sender up, the mpi path), else retired.
  void end_tag(Seq& s);
  // Asks each prefill rank to seal the tags of its handoffs that ended early,
  // posting the reclaim that sweeps them; true when it asked.
  bool seal_tags();
  // Tests the reclaims; true when a tag came back (or was retired).
  bool poll_tags();
  bool accept_offers();
  bool step();
  bool chunked() const;
  int64_t compute_target(const Seq& s) const;
  SchedulerInput plan_input(std::vector<PrefillChunk>& chunks);
  std::vector<proto::RequestId> commit(const SchedulerPlan& plan);
  Status start_prefill(Seq& s);
  // Places the tokens whose KV this rank computes itself, reusing its prefix
  // cache; the new blocks register once written (publish). Sets s.cached.
  Status allocate_local(Seq& s);
  // Prompt logprobs need every prompt row computed: no cache reuse then.
  static bool reuses_cache(const Seq& s) { return !(s.n_generated == 0 && s.params.prompt_logprobs); }
  void run_step(const std::vector<PrefillChunk>& chunks, proto::TokenEvents& events);
  void finish_local_chunk(Seq& s, int64_t n, std::span<float> rows, proto::TokenEvents& events);
  proto::TokenEvent next_token_event(Seq& s, std::span<float> row);
  Status compute_local(const std::vector<proto::RequestId>& ids, proto::TokenEvents& events);
  void finish_transfer(Seq& s);
  void fail(Seq& s, const std::string& reason, proto::FailureKind kind);
  void release(Seq& s) { release_blocks(s.id, s.has_blocks, s.kv_complete); }
  // Every block `s` holds has its KV written: kv_complete, and its blocks are offered for reuse.
  void kv_written(Seq& s);
  Seq* find_seq(proto::RequestId id);
  void remember_cancelled(proto::RequestId id);
  bool was_cancelled(proto::RequestId id);

  std::unordered_map<proto::RequestId, Seq> seqs_;
  std::deque<proto::RequestId> offers_;    // offered, waiting for room (FIFO)
  std::vector<proto::RequestId> running_;  // admission order
  std::vector<proto::RequestId> prefilling_;  // computing their KV chunk by chunk, admission order
  std::deque<proto::RequestId> waiting_;   // ready or preempted, in admission order
  std::map<proto::RequestId, Clock::time_point> cancelled_;  // tombstones: cancel before offer
  uint64_t next_order_ = 0;
  std::unordered_map<int, KvTagPool> tags_;           // by prefill rank (tags_of)
  int tag_span_ = proto::kKvTagSpan;  // kv.tag_span
  KvTagPool& tags_of(int source) { return tags_.try_emplace(source, proto::kTagKvFirst, tag_span_).first->second; }
  int64_t preemptions_ = 0;
  std::vector<float> logits_;
  std::vector<float> raw_row_;  // a logits row before sample() changes it (logprobs are of the raw one)
  // The decode step's per-sequence inputs, reused from step to step (the
  // inner tables keep their capacity): a step allocates nothing in steady state.
  std::vector<std::vector<int32_t>> step_tables_;
  std::vector<SequenceBatch> step_batch_;
  std::vector<proto::RequestId> stepped_;
};

}  // namespace pd
