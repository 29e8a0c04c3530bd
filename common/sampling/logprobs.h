// Log-probabilities of tokens, as the OpenAI API reports them (logprobs,
// top_logprobs, echo with prompt logprobs).
//
// They are of the model's raw distribution: log_softmax of the logits the
// model produced, before the sampler applies penalties, temperature, top-k,
// top-p or min-p (vLLM's default). So a request's logprobs do not depend on
// its sampling parameters, and under greedy decoding the chosen token is the
// first of the top alternatives.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace pd {

using TokenId = int32_t;

// The most alternatives a request may ask for per token (OpenAI's top_logprobs
// bound; vLLM's default max_logprobs).
inline constexpr int32_t kMaxLogprobs = 20;

struct TokenLogprob {
  TokenId id = 0;
  float logprob = 0.0f;  // natural log; -inf for a token the model gives no mass (a -inf or NaN logit)
  friend bool operator==(const TokenLogprob&, const TokenLogprob&) = default;
};

// One position of a sequence: the token there, its logprob, and the `top_n`
// most likely tokens of the distribution it was drawn from (most likely
// first, lower id first on ties; the token itself may or may not be among them).
struct LogprobEntry {
  TokenId token = 0;
  float logprob = 0.0f;
  std::vector<TokenLogprob> top;
  friend bool operator==(const LogprobEntry&, const LogprobEntry&) = default;
};

// The entry for `token` under `logits` (one row, size = vocab; not modified):
// log_softmax over the vocabulary, NaN logits counting as -inf. top_n is
// clamped to [0, vocab]. A token id outside the row gets -inf. Linear in the
// vocabulary plus O(vocab log top_n) for the alternatives; the same row and
// token always give bit-identical results, so a token's logprob and its value
// among the alternatives compare equal.
LogprobEntry token_logprob(std::span<const float> logits, TokenId token, int32_t top_n);

}  // namespace pd
