#include "serving/prefill_chunks.h"

#include <algorithm>

namespace pd {

double chunk_cost(int64_t p, int64_t n, int64_t k) {
  if (k <= 0 || n <= 0) return static_cast<double>(std::max<int64_t>(n, 0));
  // Sum over the chunk's tokens of 1 + (their position) / K.
  const double positions = static_cast<double>(n) * static_cast<double>(p) + 0.5 * static_cast<double>(n) * (n - 1);
  return static_cast<double>(n) + positions / static_cast<double>(k);
}

namespace {

// The most tokens (<= r) from position p costing at most `allowance`; 0 if none.
int64_t tokens_within(int64_t p, int64_t r, double allowance, int64_t k) {
  int64_t lo = 0, hi = r;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (chunk_cost(p, mid, k) <= allowance) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

}  // namespace

ChunkPlanner::ChunkPlanner(const ChunkPolicy& policy) : p_(policy), left_(static_cast<double>(policy.budget)) {}

double ChunkPlanner::cost_of(int64_t remaining, int64_t position) const {
  return chunk_cost(position, remaining, p_.context_cost_tokens);
}

bool ChunkPlanner::is_long(int64_t remaining, int64_t position) const {
  return p_.chunk_tokens > 0 &&
         chunk_cost(position, remaining, p_.context_cost_tokens) > static_cast<double>(p_.chunk_tokens);
}

int64_t ChunkPlanner::grant(int64_t remaining, int64_t position) const {
  if (prompts_ >= p_.max_prompts) return -1;
  if (p_.chunk_tokens <= 0) {  // whole prompts, in order; a longer one runs alone
    if (prompts_ > 0 && static_cast<double>(remaining) > left_) return -1;
    return remaining;
  }
  if (left_ <= 0) return -1;
  if (remaining <= 0 || (long_taken_ && is_long(remaining, position))) return 0;
  double allowance = std::min(static_cast<double>(p_.chunk_tokens), left_);
  if (is_long(remaining, position)) allowance = std::min(allowance, left_ - short_demand_);  // the shorts' room
  int64_t n = tokens_within(position, remaining, allowance, p_.context_cost_tokens);
  if (prompts_ == 0) n = std::max(n, std::min(remaining, kMinChunkTokens));  // the first always advances
  return n;
}

void ChunkPlanner::take(int64_t remaining, int64_t position, int64_t tokens) {
  const double cost =
      p_.chunk_tokens <= 0 ? static_cast<double>(tokens) : chunk_cost(position, tokens, p_.context_cost_tokens);
  left_ -= cost;
  ++prompts_;
  if (is_long(remaining, position)) long_taken_ = true;
  else short_demand_ = std::max(0.0, short_demand_ - cost_of(remaining, position));
}

std::vector<PrefillChunk> plan_prefill_chunks(std::span<const PrefillCandidate> candidates, const ChunkPolicy& p) {
  std::vector<PrefillChunk> pass;
  ChunkPlanner planner(p);
  double shorts = 0;
  for (const PrefillCandidate& c : candidates)
    if (c.remaining > 0 && !planner.is_long(c.remaining, c.position)) shorts += planner.cost_of(c.remaining, c.position);
  planner.set_short_demand(shorts);
  for (const PrefillCandidate& c : candidates) {
    const int64_t n = planner.grant(c.remaining, c.position);
    if (n < 0) break;
    if (n == 0) continue;
    planner.take(c.remaining, c.position, n);
    pass.push_back({c.id, n});
  }
  return pass;
}

int64_t colocated_prompt_budget(int64_t step_tokens, int64_t running) {
  return std::max(step_tokens - running, std::max<int64_t>(step_tokens / 4, 1));
}

}  // namespace pd
