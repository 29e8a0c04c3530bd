// Offline generation: a fixed set of requests run to completion with batched
// prefill and batched decode over the paged KV cache. This is what
// pd-generate and the engine's tests use; the serving cluster's continuous
// batching lives in decode_node/.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "grammar/grammar.h"
#include "kv/kv_block_manager.h"
#include "model/kv_cache.h"
#include "model/llama_model.h"
#include "sampling/sampler.h"
#include "serving/speculation.h"

namespace pd {

struct GenerateRequest {
  std::vector<TokenId> prompt;
  SamplingParams sampling;
};

struct GenerateResult {
  std::vector<TokenId> tokens;  // generated tokens, including a final EOS/stop token if one ended it
  StopReason stop = StopReason::kNone;
};

struct GenerateStats {
  int64_t prompt_tokens = 0;   // prompt tokens submitted
  int64_t prefill_tokens = 0;  // prompt tokens computed (after prefix-cache reuse)
  double prefill_seconds = 0;
  int64_t decode_tokens = 0;   // tokens produced by decode steps
  double decode_seconds = 0;
  int64_t decode_steps = 0;
  int64_t drafted_tokens = 0;   // speculation: tokens drafted
  int64_t accepted_tokens = 0;  // and of those, accepted
};

struct GenerateOptions {
  TokenId eos_id = -1;
  // Called as each token is produced: (request index, token).
  std::function<void(size_t, TokenId)> on_token;
  // Run every request alone (batch of one) instead of together; for tests.
  bool one_at_a_time = false;
  // Compiles the requests' grammars (structured output); needed only by
  // requests that have one.
  GrammarCompiler* grammars = nullptr;
  // Speculative decoding (serving/speculation.h); off by default.
  SpeculationConfig speculation;
};

// Requires: every request's prompt is non-empty and prompt + max_tokens fits
// the model's context; the block manager and cache have matching geometry.
// ResourceExhausted if the pool cannot hold the requests (nothing is leaked:
// every sequence this call allocated is freed before it returns).
Result<std::vector<GenerateResult>> generate(LlamaModel& model, KvCache& cache, KvBlockManager& blocks,
                                             std::span<const GenerateRequest> requests,
                                             const GenerateOptions& options, GenerateStats* stats);

}  // namespace pd
