// Chunked prefill: which prompts compute how many of their tokens in one pass.
// Pure policy over token counts; knows nothing of blocks, MPI or the model.
// Prefill ranks and colocated ranks both plan their passes with it.
//
// The rule (chunk_tokens C > 0), over the candidates in arrival order (a
// prompt already partly computed keeps its arrival place):
//  - A candidate with r > C tokens left is long; the earliest long candidate
//    gets a chunk of min(C, budget left). Further long candidates wait this
//    pass — at most one long prompt advances per pass, so the shorter prompts
//    behind it are not held up by a second long one (vLLM's
//    max_long_partial_prefills = 1) and long prompts finish in arrival order
//    rather than sharing the rank.
//  - A short candidate (r <= C) gets min(r, budget left): whole when it fits,
//    else the rest of the budget (it finishes in a later pass).
//  - The pass ends when the budget is used up or max_prompts are in it.
// Starvation: the earliest candidate always gets min(r, C, budget) > 0 tokens,
// so every prompt advances at least once for each pass run while it is the
// earliest; a prompt waits only for prompts that arrived before it and, when
// it is long, for the shorts that overtake it (each of which ends within a
// pass or two of arriving). A short prompt behind a long one waits at most one
// pass, which holds at most C of the long prompt's tokens.
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
};

struct ChunkPolicy {
  int64_t budget = 2048;      // prompt tokens in one pass (> 0)
  int64_t chunk_tokens = 512; // most tokens of one prompt in one pass; 0 = whole prompts
  int max_prompts = 16;       // prompts in one pass (> 0)
};

struct PrefillChunk {
  uint64_t id = 0;
  int64_t tokens = 0;  // > 0; == remaining when the candidate finishes in this pass
};

// The chunks of one pass, in candidate order. Empty only when there is no candidate.
std::vector<PrefillChunk> plan_prefill_chunks(std::span<const PrefillCandidate> candidates, const ChunkPolicy& policy);

// A colocated step's budget for prompt tokens: the step holds `step_tokens`
// tokens, one for each of `running` decodes, the rest for prompt chunks — but
// never less than a quarter of the step, so prompts still advance beside a
// batch as large as the step.
int64_t colocated_prompt_budget(int64_t step_tokens, int64_t running);

}  // namespace pd
