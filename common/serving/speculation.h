// Speculative decoding's pieces that do not depend on where it runs (offline
// generate(), a decode rank): drafting tokens from the sequence's own history
// (prompt lookup, n-grams: no second model), and choosing how many to draft
// from what was accepted so far.
//
// Verification samples every position with the request's own Sampler, one
// sample and one accept per emitted token, exactly as plain decoding does: the
// first position whose sampled token differs from the draft ends the step
// (that sampled token is emitted), and when every draft token is accepted the
// position after them gives one more. For a draft that is a single proposed
// token (not a distribution) this is the rejection-sampling rule itself (accept
// with probability p(draft), else sample the rest of p), so the output has the
// distribution of plain decoding; with batch-invariant logits it is the same
// tokens, greedy or seeded, and the sampler's random stream advances one draw
// per emitted token as before (a migration's replay stays in step).
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "sampling/sampler.h"

namespace pd {

struct SpeculationConfig {
  int max_draft = 0;  // tokens drafted per step at most; 0 = off
  int max_ngram = 3;  // the longest suffix looked up in the history
  int min_ngram = 2;  // the shortest (1 finds a match almost always, and mostly a wrong one)
};

// The tokens that followed the most recent earlier occurrence of the
// history's last n tokens, for the largest n in [min_ngram, max_ngram] that
// occurs, at most `max_draft` of them (fewer when the history ends first).
// Empty when nothing matches. Linear in the history.
std::vector<TokenId> ngram_draft(std::span<const TokenId> history, int max_draft, int max_ngram, int min_ngram);

// Most tokens a step drafts for one sequence (SpeculationConfig::max_draft's bound).
inline constexpr int kMaxDraft = 16;
// A step's cost with k tokens drafted for one sequence, relative to the step
// without them, k = 0..kMaxDraft (DraftCosts[0] = 1).
using DraftCosts = std::array<double, kMaxDraft + 1>;

// What a forward step costs as a function of the tokens in it, learned from
// the steps that ran, two ways: each step size's own average (the sizes seen
// at least kMinSeen times, up to kMaxSized tokens), and seconds ~ fixed +
// per_token * tokens, least squares over the recent steps (each older step
// weighs kDecay less), for the sizes not seen yet. Where a step is bound by
// reading the weights (a few tokens on a CPU, many on a GPU) per_token is
// small next to fixed and drafting is cheap; where it is bound by arithmetic
// every drafted token costs about what a sequence's own token does; and where
// a kernel takes tokens in tiles (8 on AVX-512, 4 on AVX2), a step one token
// past a tile streams the weights once more: a jump the line does not see and
// the sizes' own averages do. Until the steps seen vary enough in size to
// tell fixed and per_token apart, kPriorCost stands in.
class StepCost {
 public:
  static constexpr double kDecay = 0.98;
  // A drafted token's cost relative to a one-token step before anything is
  // learned: measured on two cores of a CPU at batch 1 (pd-bench-engine
  // --verify: 4 tokens cost 1.9x one, 8 tokens 3.35x).
  static constexpr double kPriorCost = 0.33;
  static constexpr int kMaxSized = 64;
  static constexpr int kMinSeen = 3;
  static constexpr double kSizeDecay = 0.8;  // a size's average: each older step of that size weighs this much less

  // One step of `tokens` tokens in all (every sequence's, drafts included) took `seconds`.
  void observe(int tokens, double seconds);
  // What one drafted token adds to a step of `sequences` sequences, relative
  // to that step's cost per sequence: per_token / (fixed / sequences +
  // per_token), in (0, 1]. The same ratio weighs a draft against the tokens
  // the whole batch gives per step.
  double draft_cost(int sequences) const;
  // What drafting k tokens for one of `sequences` sequences makes of its
  // share of the step: 1 + sequences * (T(sequences + k) - T(sequences)) /
  // T(sequences), from the sizes' own averages where both are known, else 1 +
  // draft_cost(sequences) * k; never less than the cost at k - 1.
  DraftCosts draft_costs(int sequences) const;

 private:
  double w_ = 0, sx_ = 0, sy_ = 0, sxx_ = 0, sxy_ = 0;  // decayed sums of 1, x, y, x^2, xy
  std::array<double, kMaxSized + 1> size_w_{}, size_y_{};  // per size: decayed count and sum of seconds
  int size_n_[kMaxSized + 1] = {};                         // per size: steps seen, up to kMinSeen
};

// One sequence's speculation policy: how many tokens to draft, from how often
// its drafts were right. Acceptance is taken as a chance p per drafted token
// (a draft is accepted up to its first wrong token): k drafted tokens then
// give (1 - p^(k+1)) / (1 - p) tokens for a step costing 1 + c k (c:
// StepCost::draft_cost), and the policy drafts the k that gives the most
// tokens per cost, none where no k gives kMinGain more than a plain step.
// p is estimated from the recent drafted tokens (each older one weighs kDecay
// less), starting from a prior that tries drafting. A sequence that is not
// drafting still learns: the caller hands it the draft it would have made
// (shadow) and each token plain decoding emits, so that it starts drafting
// when its text starts to repeat what came before, at no cost to its steps.
class DraftPolicy {
 public:
  static constexpr double kDecay = 0.85;
  static constexpr double kPriorAccepted = 3, kPriorRejected = 1;  // p = 0.75 before anything is seen
  static constexpr double kMinGain = 1.02;

  explicit DraftPolicy(int max_draft) : max_(max_draft) {}
  int max() const { return max_; }
  double acceptance() const { return accepted_ / (accepted_ + rejected_); }
  // Tokens to draft this step (0: none), given what a step drafting k tokens
  // costs relative to one drafting none (StepCost::draft_costs).
  int next(const DraftCosts& cost) const;
  // After a step that drafted `drafted` tokens (0: nothing was drafted, no
  // change) of which `accepted` were taken.
  void verified(int drafted, int accepted);
  // A step that drafts nothing: whether a shadow draft is wanted (none is
  // being followed), then the draft it would have made.
  bool wants_shadow() const { return shadow_.empty(); }
  void shadow(std::vector<TokenId> draft);
  // A token a step without drafts emitted: checked against the shadow draft.
  void emitted(TokenId token);

 private:
  void record(int accepted, bool rejected);
  int max_ = 0;
  double accepted_ = kPriorAccepted, rejected_ = kPriorRejected;
  std::vector<TokenId> shadow_;
  size_t shadow_at_ = 0;
};

}  // namespace pd
