#include "serving/prefill_chunks.h"

#include <algorithm>

namespace pd {

std::vector<PrefillChunk> plan_prefill_chunks(std::span<const PrefillCandidate> candidates, const ChunkPolicy& p) {
  std::vector<PrefillChunk> pass;
  int64_t left = p.budget;
  if (p.chunk_tokens <= 0) {
    for (const PrefillCandidate& c : candidates) {
      if (static_cast<int>(pass.size()) >= p.max_prompts) break;
      if (!pass.empty() && c.remaining > left) break;  // one prompt may exceed the budget alone
      pass.push_back({c.id, c.remaining});
      left -= c.remaining;
    }
    return pass;
  }
  bool long_taken = false;
  for (const PrefillCandidate& c : candidates) {
    if (left <= 0 || static_cast<int>(pass.size()) >= p.max_prompts) break;
    if (c.remaining <= 0) continue;
    int64_t n;
    if (c.remaining > p.chunk_tokens) {
      if (long_taken) continue;  // one long prompt advances per pass
      long_taken = true;
      n = std::min(p.chunk_tokens, left);
    } else {
      n = std::min(c.remaining, left);
    }
    pass.push_back({c.id, n});
    left -= n;
  }
  return pass;
}

int64_t colocated_prompt_budget(int64_t step_tokens, int64_t running) {
  return std::max(step_tokens - running, std::max<int64_t>(step_tokens / 4, 1));
}

}  // namespace pd
