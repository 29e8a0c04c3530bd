// Log-probabilities of tokens: see logprobs.h for the contracts.
#include "sampling/logprobs.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace pd {

LogprobEntry token_logprob(std::span<const float> logits, TokenId token, int32_t top_n) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const size_t vocab = logits.size();
  LogprobEntry e;
  e.token = token;
  // log Z = max + log(sum exp(l - max)), over the finite and +inf logits (NaN is -inf).
  float max_logit = kNegInf;
  for (float l : logits) {
    if (l > max_logit) max_logit = l;  // false for NaN
  }
  double sum = 0.0;
  if (std::isfinite(max_logit)) {
    for (float l : logits) {
      if (l > kNegInf) sum += std::exp(static_cast<double>(l) - max_logit);
    }
  }
  // All mass on +inf logits, or no mass at all: the max (or nothing) gets probability 1.
  const double log_z = std::isfinite(max_logit) ? max_logit + std::log(sum) : max_logit;
  auto logprob_of = [&](size_t i) -> float {
    const float l = logits[i];
    if (!(l > kNegInf) || std::isnan(log_z)) return kNegInf;
    if (std::isinf(log_z)) return l == max_logit ? 0.0f : kNegInf;  // +inf logits share nothing finite
    return static_cast<float>(static_cast<double>(l) - log_z);
  };
  e.logprob = token >= 0 && static_cast<size_t>(token) < vocab ? logprob_of(static_cast<size_t>(token)) : kNegInf;

  const size_t n = static_cast<size_t>(std::clamp<int64_t>(top_n, 0, static_cast<int64_t>(vocab)));
  if (n == 0) return e;
  // The n best logits (NaN last), by a bounded min-heap of (logit, id): worst on top.
  auto key = [&](size_t i) { return std::isnan(logits[i]) ? kNegInf : logits[i]; };
  auto worse = [&](size_t a, size_t b) {  // a ranks after b
    const float ka = key(a), kb = key(b);
    return ka < kb || (ka == kb && a > b);
  };
  auto heap_cmp = [&](size_t a, size_t b) { return worse(b, a); };  // the worst element at the front
  std::vector<size_t> heap;
  heap.reserve(n + 1);
  for (size_t i = 0; i < vocab; ++i) {
    if (heap.size() < n) {
      heap.push_back(i);
      std::push_heap(heap.begin(), heap.end(), heap_cmp);
    } else if (worse(heap.front(), i)) {
      std::pop_heap(heap.begin(), heap.end(), heap_cmp);
      heap.back() = i;
      std::push_heap(heap.begin(), heap.end(), heap_cmp);
    }
  }
  std::sort(heap.begin(), heap.end(), [&](size_t a, size_t b) { return worse(b, a); });
  e.top.reserve(n);
  for (size_t i : heap) e.top.push_back({static_cast<TokenId>(i), logprob_of(i)});
  return e;
}

}  // namespace pd
