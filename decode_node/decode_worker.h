// The decode worker: receives KV handoffs straight into its paged blocks and
// runs continuous batching over them, streaming token events to the router.
//
// Handoffs — offers, tags, receives, seals, quarantined blocks — are the
// handoff intake's (handoff_intake.h): it hands this worker each sequence
// whose KV has landed and verified. This class is the batcher: it schedules
// (scheduler.h) and runs one step per iteration.
//
// A sequence's life here (SeqState; every change checked, util/lifecycle.h):
//   kReady (KV received, waiting for admission) -> kRunning (one token per
//   iteration) <-> kPreempted (blocks freed; comes back by recomputing its
//   KV from its tokens, which gives the same output: the CPU backend's
//   kernels are batch-invariant) -> ended (erased).
//   kReady -> kPreempted: a waiting holder evicted to break a deadlock.
//   kQueued (a colocated prompt, KV to compute) / kPreempted -> kPrefilling
//   (KV computed here chunk by chunk, each chunk in a step beside the running
//   decodes) -> kRunning | kPreempted; or, whole prompts, kQueued/kPreempted
//   -> kRunning after one pass before the step.
// Its blocks (SeqKv, seq_kv.h) are held and written, or not, beside that.
// Prefix cache (kv.prefix_cache): a finished sequence's KV stays resident,
// evictable, and a prompt computed here reuses the leading blocks it shares
// with it (a follow-up turn the router sent back to this rank). Blocks filled
// by a KV transfer or a local prefill register for reuse only once their KV
// is written (AllocateOptions::publish), so nothing reads a block in flight.
// In colocated mode the router sends prompts here directly (kQueued) and this
// rank prefills them itself (worker/prompt_pass.h) before they join the
// batch: chunked (prefill.chunk_tokens > 0; each step holds
// decode.step_tokens tokens, Sarathi-style), or whole in a pass before the
// step (chunk_tokens 0).
//
// The loop, peers' epochs, Rejoin, leaving the pool and load reports are the
// worker core's (worker/worker_core.h); this class is what is decode's own.
#pragma once

#include <chrono>
#include <deque>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "decode_node/handoff_intake.h"
#include "decode_node/scheduler.h"
#include "decode_node/seq_kv.h"
#include "sampling/sampler.h"
#include "serving/speculation.h"
#include "serving/prefill_chunks.h"
#include "worker/prompt_pass.h"
#include "worker/worker_core.h"

namespace pd {

class DecodeWorker final : public WorkerCore {
 public:
  // `channel` carries the control messages (MpiControlChannel in the cluster),
  // `transport` the KV bytes. run() / run_once(): WorkerCore; each iteration's
  // work accepts the offers that fit, then runs at most one step.
  DecodeWorker(const ClusterConfig& cfg, const RoleTable& roles, std::shared_ptr<Engine> engine,
               std::unique_ptr<Transport> transport, std::unique_ptr<ControlChannel> channel);

 private:
  enum class SeqState { kReady, kQueued, kRunning, kPreempted, kPrefilling };
  friend const char* state_name(SeqState s);
  friend bool legal(SeqState from, SeqState to);
  struct Seq {
    proto::RequestId id = 0;
    int source = -1;                   // prefill rank (-1: colocated, prompt came from the router)
    SeqState state = SeqState::kReady;
    std::vector<int32_t> tokens;       // prompt + generated
    int32_t n_generated = 0;
    SamplingParams params;
    std::optional<Sampler> sampler;
    SeqKv kv;                          // its blocks: none, being written, written
    PromptPass prompt;                 // kPrefilling, or a whole prompt's pass: its KV computed here
    uint64_t order = 0;                // arrival order (preempted sequences resume oldest first)
    Clock::time_point arrived, received;  // received: KV complete (or arrival, colocated)
    // Its first event here carried its queue time (a fact the router needs
    // once, not a stage: preemption does not change it).
    bool timing_sent = false;
    // Speculative decoding: its policy (how much to draft), and this step's
    // tokens (its last token, then the tokens drafted after it).
    DraftPolicy draft{0};
    std::vector<int32_t> step;
    // Leading tokens whose KV this rank computes: a new prompt all its tokens
    // (logits for token 1); a preempted sequence all but its last token, which
    // its next step feeds.
    int64_t compute_target() const { return static_cast<int64_t>(tokens.size()) - (n_generated == 0 ? 0 : 1); }
    // Prompt logprobs need every prompt row computed: no cache reuse then.
    bool reuses_cache() const { return !(n_generated == 0 && params.prompt_logprobs); }
    // Samples the next token from its logits row (its sampler set up),
    // appends it, and returns its event (no timings).
    proto::TokenEvent next_token(std::span<float> row, int32_t eos_id, std::vector<float>& scratch);
  };

  // WorkerCore
  bool on_message(int source, proto::Message& m) override;
  bool progress_transfers() override;
  void check_deadlines() override;
  bool work() override;
  void on_peer_down(int rank) override { intake_.on_peer_down(rank); }
  void forget_peer(int rank) override { intake_.forget_peer(rank); }
  void drop_all() override;
  void on_drain() override;
  size_t held() const override { return seqs_.size() + intake_.size(); }
  void fill_load(proto::LoadReport& r) const override;
  void before_exit() override { intake_.before_exit(); }
  std::chrono::milliseconds exit_grace() const override { return std::chrono::milliseconds(2000); }
  const char* ready_note() const override { return roles_.colocated() ? ", colocated: prefills its own prompts" : ""; }

  void on_prompt(proto::PrefillRequest m);
  // Erases an ended sequence: blocks released, out of every list.
  void erase(Seq& s);
  void fail(Seq& s, const std::string& reason, proto::FailureKind kind);
  // The intake accepts the offers that fit beside the blocks this worker's
  // sequences need next; none while a preempted sequence waits for blocks.
  bool accept_offers();
  bool step();
  SchedulerInput plan_input(std::vector<PrefillChunk>& chunks);
  std::vector<proto::RequestId> commit(const SchedulerPlan& plan);
  // Places the tokens whose KV this rank computes itself (a PromptPass),
  // reusing its prefix cache; the new blocks register once written (publish).
  Status start_prompt(Seq& s);
  void run_step(const std::vector<PrefillChunk>& chunks, proto::TokenEvents& events);
  // Speculation: s.step becomes its last token and what it drafts this step,
  // within `spare` blocks (those the running batch's next tokens leave; what
  // the draft takes is subtracted).
  void plan_draft(Seq& s, int64_t& spare);
  // The step's rows of a running sequence: its tokens sampled in order while
  // they confirm its draft (one when it drafted nothing), their events, the
  // rejected draft tokens rolled out of its KV, and its end when one stops it.
  void verify_step(Seq& s, std::span<float> rows, Clock::time_point step_start, proto::TokenEvents& events);
  void finish_local_chunk(Seq& s, int64_t n, std::span<float> rows, proto::TokenEvents& events);
  // A new prompt's KV is computed: token 1 from `last_row`, its event (with
  // timings to `now`), then the running batch (or its end).
  void first_token(Seq& s, std::span<float> last_row, Clock::time_point now, proto::TokenEvents& events);
  Status compute_local(const std::vector<proto::RequestId>& ids, proto::TokenEvents& events);

  HandoffIntake intake_;
  std::unordered_map<proto::RequestId, Seq> seqs_;  // KV here or to compute here (the intake holds the rest)
  std::vector<proto::RequestId> running_;  // admission order
  std::vector<proto::RequestId> prefilling_;  // computing their KV chunk by chunk, admission order
  std::deque<proto::RequestId> waiting_;   // ready, queued or preempted, in admission order
  uint64_t next_order_ = 0;
  int64_t preemptions_ = 0;
  int64_t drafted_ = 0;   // speculation: tokens drafted, of those accepted, steps that drafted (LoadReport)
  int64_t accepted_ = 0;
  int64_t spec_steps_ = 0;
  StepCost step_cost_;    // speculation: what a step's tokens cost, from the decode steps run
  std::vector<float> logits_;
  std::vector<float> raw_row_;  // a logits row before sample() changes it (logprobs are of the raw one)
  // The decode step's per-sequence inputs, reused from step to step (the
  // inner tables keep their capacity): a step allocates nothing in steady state.
  std::vector<std::vector<int32_t>> step_tables_;
  std::vector<SequenceBatch> step_batch_;
  std::vector<proto::RequestId> stepped_;
};

}  // namespace pd
