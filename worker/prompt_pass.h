// One sequence's prompt pass on a worker rank: its prompt's KV placed in the
// engine's block manager (reusing the prefix cache where it may), computed
// chunk by chunk, the prompt logprobs gathered from each chunk's logits rows,
// then token 1 sampled from the last row and its event built (prompt
// logprobs, cached tokens, timings). The prefill worker runs every prompt
// this way; the decode worker its colocated prompts and the recompute of a
// preempted sequence (no token 1 then: it has its tokens already).
//
//   PromptPass p(id, {.target = n, .first_token = true, .prompt_logprobs = lp, ...});
//   p.place(blocks, tokens, end);             // the first call allocates, later ones append
//   p.start(now);                             // its first chunk's pass begins
//   batch.push_back(p.chunk(tokens, end, table));
//   ... forward ...
//   p.chunk_done(tokens, end, rows, vocab);   // computed() = end; prompt logprobs gathered
//   if (p.done()) ev = p.first_token(sampler, tokens, rows.last(vocab), eos, scratch);
//   p.stamp(ev, arrived, now);
//
// The worker owns the sequence, its blocks' release and its counts; this
// object knows how far the prompt got and what its rows said.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <vector>

#include "kv/kv_block_manager.h"
#include "model/llama_model.h"
#include "protocol/messages.h"
#include "sampling/logprobs.h"
#include "sampling/sampler.h"
#include "util/status.h"

namespace pd {

class PromptPass {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  struct Options {
    int64_t target = 0;            // leading tokens whose KV this pass computes
    bool first_token = true;       // a new prompt: its last chunk wants the logits for token 1
    // Logits rows of every prompt token (needs first_token): no cached prefix
    // is reused then, every position is computed.
    bool prompt_logprobs = false;
    int32_t top_logprobs = -1;     // alternatives per prompt position (SamplingParams::logprobs)
    // Register the fresh full blocks for reuse as they are placed (the next
    // pass writes them); false: the worker publishes them once written.
    bool publish = true;
  };

  PromptPass() = default;
  PromptPass(proto::RequestId id, Options opts) : id_(id), opts_(opts) {}

  // Places tokens [0, end) of `tokens` (end <= target): the first call
  // allocates the sequence, reusing the cached prefix unless prompt logprobs
  // are wanted (computed() and cached() become what the cache held); a later
  // one appends [placed_end(), end). On failure nothing changed.
  Status place(KvBlockManager& blocks, std::span<const int32_t> tokens, int64_t end);
  // Its first chunk's pass begins now (the queue wait ends, the prefill time starts).
  void start(TimePoint now) { started_ = now; }
  // The chunk [computed(), end) as the model takes it; `table` covers [0, end).
  SequenceBatch chunk(std::span<const int32_t> tokens, int64_t end, std::span<const int32_t> table) const;
  // Logits rows a chunk ending at `end` returns (one per token with prompt
  // logprobs, one for token 1, else none).
  size_t rows(int64_t end) const;
  // The chunk's KV is in the cache: gathers its prompt logprobs from `rows`
  // (the chunk's rows, in order) and moves computed() to `end`.
  void chunk_done(std::span<const int32_t> tokens, int64_t end, std::span<const float> rows, int64_t vocab);
  // The whole prompt is computed (first_token): resumes `sampler` over the
  // prompt, samples token 1 from `last_row` and returns its event, with the
  // prompt logprobs gathered and the cached tokens.
  proto::TokenEvent first_token(Sampler& sampler, std::span<const int32_t> prompt, std::span<float> last_row,
                                int32_t eos_id, std::vector<float>& scratch);
  // Token 1's timings: the queue time (`arrived` to start()) and the prefill
  // time (start() to `now`).
  void stamp(proto::TokenEvent& ev, TimePoint arrived, TimePoint now) const;

  bool placed() const { return placed_; }
  int64_t computed() const { return computed_; }   // leading tokens whose KV is in the cache (cached ones included)
  int64_t cached() const { return cached_; }       // of them, found in the prefix cache when placed
  int64_t placed_end() const { return placed_end_; }
  int64_t target() const { return opts_.target; }
  bool done() const { return computed_ == opts_.target; }
  TimePoint started() const { return started_; }

 private:
  proto::RequestId id_ = 0;
  Options opts_;
  bool placed_ = false;                       // the block manager holds the sequence (place() succeeded)
  int64_t computed_ = 0, cached_ = 0, placed_end_ = 0;
  std::vector<LogprobEntry> prompt_logprobs_;  // gathered chunk by chunk
  TimePoint started_{};
};

}  // namespace pd
