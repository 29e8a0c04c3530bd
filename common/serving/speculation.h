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

// One sequence's draft length, from its acceptance: it grows by one after a
// step that accepted every draft token, shrinks to what was accepted plus one
// otherwise, and after `kMissesToRest` steps in a row that accepted nothing it
// rests (drafts nothing) for kRestSteps steps, so a sequence with nothing to
// copy pays almost nothing.
class DraftLength {
 public:
  static constexpr int kMissesToRest = 2;
  static constexpr int kRestSteps = 16;

  explicit DraftLength(int max_draft) : max_(max_draft), next_(max_draft) {}
  // How many tokens to draft this step (0: none).
  int next() const { return resting_ > 0 ? 0 : next_; }
  int max() const { return max_; }
  // After a step: `drafted` tokens were proposed (0: none, which only counts
  // down a rest), `accepted` of them taken.
  void update(int drafted, int accepted);

 private:
  int max_ = 0;
  int next_ = 0;
  int misses_ = 0;
  int resting_ = 0;
};

}  // namespace pd
