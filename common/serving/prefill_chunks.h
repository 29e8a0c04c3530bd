// Chunked prefill: which prompts compute how many of their tokens in one pass.
// Pure policy over token counts; knows nothing of blocks, MPI or the model.
// Prefill ranks and colocated ranks both plan their passes with it.
//
// A pass is measured in work, not tokens: a prompt token at context position p
// costs 1 + p / K (K = context_cost_tokens, the context length at which one
// token's attention costs as much as the rest of its compute; 0: every token
// costs 1). So chunks late in a long prompt hold fewer tokens and each pass
// takes about as long as the first — which is what bounds the wait of the
// prompts and decodes behind it. Budget and chunk size below are in that cost.
//
// The rule (chunk_tokens C > 0), over the candidates in arrival order (a
// prompt already partly computed keeps its arrival place):
//  - A candidate whose r tokens left cost more than C is long; the earliest
//    long candidate gets the most tokens costing min(C, budget left less what
//    the short candidates still to come need) (at least kMinChunkTokens when
//    it is first in the pass). Further long candidates wait this
//    pass — at most one long prompt advances per pass, so the shorter prompts
//    behind it are not held up by a second long one (vLLM's
//    max_long_partial_prefills = 1) and long prompts finish in arrival order
//    rather than sharing the rank.
//  - A short candidate (its r tokens cost <= C) gets them all when they fit
//    the budget left, else the tokens that do (it finishes in a later pass).
//    The long chunk leaves the shorts their room: a short prompt that arrives
//    while a long one is being chunked joins the next pass even when the
//    budget is about one chunk (a colocated step: decode.step_tokens), and
//    the long prompt's chunk is smaller by the shorts' tokens that pass.
//  - The pass ends when the budget is used up or max_prompts are in it.
// Starvation: the earliest candidate always gets at least min(r, kMinChunkTokens) tokens,
// so every prompt advances at least once for each pass run while it is the
// earliest; a prompt waits only for prompts that arrived before it and, when
// it is long, for the shorts that overtake it (each of which ends within a
// pass or two of arriving). A short prompt behind a long one waits at most one
// pass, which holds at most C of the long prompt's tokens; with the shorts'
// room left beside the long chunk, it waits for none (the pass it arrives in
// being the one running).
//
// chunk_tokens = 0 turns chunking off: whole prompts in arrival order while
// they fit the budget, one prompt alone when it exceeds it, no overtaking.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace pd {

struct PrefillCandidate {
  uint64_t id = 0;
  int64_t remaining = 0;  // prompt tokens still to compute (> 0)
  int64_t position = 0;   // tokens of it already in the cache (computed or cached): where `remaining` starts
};

struct ChunkPolicy {
  int64_t budget = 2048;             // cost of one pass (> 0)
  int64_t chunk_tokens = 256;        // most cost of one prompt in one pass; 0 = whole prompts (token budget)
  int max_prompts = 16;              // prompts in one pass (> 0)
  int64_t context_cost_tokens = 0;   // K above; 0 = a token costs 1 wherever it is
};

// The first prompt of a pass always advances by at least this many tokens (or what is left).
inline constexpr int64_t kMinChunkTokens = 16;

// What computing n tokens from context position p costs (see above).
double chunk_cost(int64_t position, int64_t n, int64_t context_cost_tokens);

struct PrefillChunk {
  uint64_t id = 0;
  int64_t tokens = 0;  // > 0; == remaining when the candidate finishes in this pass
};

// The rule, one candidate at a time (offered in arrival order): what the
// workers' passes and pd-plan's simulated ranks both build a pass with.
class ChunkPlanner {
 public:
  explicit ChunkPlanner(const ChunkPolicy& policy);
  // What the short candidates of this pass need in all (their costs, in the
  // rule's units): a long candidate's chunk leaves that much of the budget
  // (less what shorts took before it) to them. Call before the first offer.
  void set_short_demand(double cost) { short_demand_ = cost; }
  // The cost of what a candidate would need to finish (its `remaining` tokens from `position`).
  double cost_of(int64_t remaining, int64_t position) const;
  // Tokens a candidate with `remaining` (> 0) tokens from `position` would
  // get if offered now: > 0 that many; 0 it is skipped (a long one after the
  // pass's long one, or none of it fits what is left); -1 the pass is full
  // (offer no more).
  int64_t grant(int64_t remaining, int64_t position) const;
  // Puts the candidate in the pass with `tokens` = grant(remaining, position) > 0.
  void take(int64_t remaining, int64_t position, int64_t tokens);
  // Whether a candidate counts as long (only one long one advances per pass).
  bool is_long(int64_t remaining, int64_t position) const;
  bool long_taken() const { return long_taken_; }
  int prompts() const { return prompts_; }

 private:
  ChunkPolicy p_;
  double left_;
  double short_demand_ = 0;  // left for short candidates not yet taken
  int prompts_ = 0;
  bool long_taken_ = false;
};

// The chunks of one pass, in candidate order. Empty only when there is no candidate.
std::vector<PrefillChunk> plan_prefill_chunks(std::span<const PrefillCandidate> candidates, const ChunkPolicy& policy);

// A colocated step's budget for prompt tokens: the step holds `step_tokens`
// tokens, one for each of `running` decodes, the rest for prompt chunks — but
// never less than a quarter of the step, so prompts still advance beside a
// batch as large as the step.
int64_t colocated_prompt_budget(int64_t step_tokens, int64_t running);

}  // namespace pd
