// Token sampling: greedy, temperature, top-k, top-p, min-p, presence and
// frequency penalties, and a per-request seed (same seed + same input = same
// output, independent of batch composition).
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "sampling/grammar_spec.h"
#include "sampling/logprobs.h"
#include "util/status.h"

namespace pd {

using TokenId = int32_t;

struct SamplingParams {
  float temperature = 0.0f;   // 0 = greedy
  int32_t top_k = 0;          // 0 = disabled
  float top_p = 1.0f;         // 1 = disabled
  float min_p = 0.0f;         // 0 = disabled
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  uint64_t seed = 0;
  int32_t max_tokens = 16;
  bool ignore_eos = false;
  std::vector<TokenId> stop_token_ids;  // in addition to EOS
  // vLLM's (and transformers') repetition penalty: the logit of every token
  // seen so far, in the prompt or the output, is divided by it where positive
  // and multiplied where negative, before the presence and frequency
  // penalties. 1 = off; > 0.
  float repetition_penalty = 1.0f;
  // vLLM's min_tokens: until this many tokens are generated, EOS and the stop
  // tokens get -inf (unless the grammar's output is complete: then only they
  // may follow). The router holds the stop strings back as long. 0 = off;
  // at most max_tokens.
  int32_t min_tokens = 0;
  // Log-probabilities the workers report with each token (sampling/logprobs.h;
  // of the raw model distribution, not the processed one the draw uses):
  // -1 = none; n in [0, kMaxLogprobs] = each generated token's logprob and
  // the n most likely alternatives.
  int32_t logprobs = -1;
  // Also every prompt token's after the first (given the tokens before it),
  // with as many alternatives. Needs logprobs >= 0.
  bool prompt_logprobs = false;
  // Set by the router, never by a client: a request moved to another pair of
  // ranks after it had generated tokens (request migration) sends them as the
  // prompt's last `resumed_tokens` tokens; the sampler replays them (resume()),
  // so the penalties and a seeded draw go on where they were.
  int32_t resumed_tokens = 0;
  // Added to the logits of these tokens before anything else (OpenAI's
  // logit_bias): ids ascending, each once, biases in [-100, 100]. -100 in
  // effect bans a token, +100 forces it. Logprobs stay those of the raw model
  // distribution. At most kMaxLogitBias entries.
  std::vector<std::pair<TokenId, float>> logit_bias;
  // Structured output: what the generated text must match (grammar_spec.h).
  // Every rank that samples the request's tokens follows it from the first
  // generated token on, so a handoff and a migration keep it.
  GrammarSpec grammar;
  // Speculative decoding may draft tokens for this request (whether it runs
  // at all is the decode pool's setting, decode.speculate). Its output is the
  // same either way; false only spends no compute on drafts.
  bool speculate = true;

  // InvalidArgument naming the field (e.g. "top_p must be in (0, 1]").
  Status validate() const;
};

inline constexpr size_t kMaxLogitBias = 1024;

// Which tokens may come next (structured output; grammar/grammar.h makes
// them). One per sequence; not thread-safe.
class TokenConstraint {
 public:
  virtual ~TokenConstraint() = default;
  // Works out the tokens allowed next. May run on another thread than the
  // sampler's (while the forward pass runs), never at the same time as the
  // other calls.
  virtual void prepare() = 0;
  // Sets the logits of the tokens not allowed next to -inf (prepare()s first
  // unless done since the last accept()).
  virtual void apply(std::span<float> logits) = 0;
  // Moves past `id`. False when it was not allowed (nothing changes).
  virtual bool accept(TokenId id) = 0;
  // The output is complete: only stop tokens may follow.
  virtual bool done() const = 0;
};

// One request's sampler: owns its RNG and the counts of tokens it generated.
// Order of operations (as vLLM): logit bias -> grammar mask -> penalties -> temperature -> top-k -> top-p -> min-p -> draw.
class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  // Follows `c` from now on (structured output): sample() draws only tokens it
  // allows, and accept()/replay()/resume() move it on. Set it before the first
  // token is sampled, replayed or resumed.
  void constrain(std::unique_ptr<TokenConstraint> c) { constraint_ = std::move(c); }
  TokenConstraint* constraint() const { return constraint_.get(); }
  // Picks the next token from raw logits (size = vocab). `logits` may be modified
  // (the penalties are applied in place). Greedy (temperature 0 or top_k 1) is
  // argmax and draws no random number; otherwise exactly one 64-bit draw from
  // the request's RNG per call, so the same params, seed and logits sequence
  // give the same tokens (no libm or standard-library distribution is
  // involved; bit-identical across builds with the same floating-point
  // contraction). NaN and -inf logits are never drawn; at a top-k/top-p cut a
  // tie keeps the lower token id. Linear in the vocabulary (no full sort).
  // params must have passed validate().
  TokenId sample(std::span<float> logits);
  // Records an emitted token (feeds the penalties).
  void accept(TokenId id);
  // For a token another Sampler with the same params sampled as this
  // request's next one (the prefill rank samples token 1, the decode rank goes
  // on): advances the RNG exactly as that sample() call did, then accept()s it.
  void replay(TokenId id);
  // Starts the request on this rank from its prompt (every rank that samples
  // calls it once, before its first sample() or replay()): the prompt's tokens
  // count as seen for repetition_penalty, and a migrated request replays the
  // prompt's last params().resumed_tokens tokens (its output before it moved),
  // as if this sampler had drawn them.
  void resume(std::span<const TokenId> prompt);
  // The model's end-of-sequence token, banned before min_tokens (-1: none).
  void set_eos(TokenId eos_id) { eos_id_ = eos_id; }
  const SamplingParams& params() const { return params_; }

 private:
  void apply_repetition_penalty(std::span<float> logits) const;

  SamplingParams params_;
  std::mt19937_64 rng_;
  std::unordered_map<TokenId, int32_t> counts_;
  int32_t generated_ = 0;              // tokens accepted (and replayed) so far
  std::vector<TokenId> prompt_seen_;   // repetition_penalty: the prompt's tokens, sorted, each once
  TokenId eos_id_ = -1;
  std::unique_ptr<TokenConstraint> constraint_;
  // Per-call scratch, kept to avoid reallocating each token.
  std::vector<float> weights_;                       // [vocab] exp((logit - max) / T)
  std::vector<std::pair<float, TokenId>> scratch_;  // surviving candidates (weight, id)
  std::vector<std::pair<float, TokenId>> edge_;     // candidates of one weight bucket
};

// Index of the largest logit (lowest index on ties).
TokenId argmax(std::span<const float> logits);

enum class StopReason { kNone, kEos, kStopToken, kLength };
// Whether generation ends after emitting `id` as the n_generated-th token.
// Checked in this order: EOS (unless p.ignore_eos), p.stop_token_ids (also
// with ignore_eos), then length (n_generated >= p.max_tokens).
StopReason check_stop(const SamplingParams& p, TokenId id, TokenId eos_id, int32_t n_generated);

}  // namespace pd
