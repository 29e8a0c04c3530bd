#include "serving/speculation.h"

#include <algorithm>

namespace pd {

std::vector<TokenId> ngram_draft(std::span<const TokenId> history, int max_draft, int max_ngram, int min_ngram) {
  std::vector<TokenId> out;
  const int64_t len = static_cast<int64_t>(history.size());
  if (max_draft <= 0 || min_ngram < 1) return out;
  for (int n = std::min<int64_t>(max_ngram, len - 1); n >= min_ngram; --n) {
    const std::span<const TokenId> suffix = history.last(static_cast<size_t>(n));
    // The most recent earlier occurrence: its end is before the history's end.
    for (int64_t start = len - n - 1; start >= 0; --start) {
      if (!std::equal(suffix.begin(), suffix.end(), history.begin() + start)) continue;
      const int64_t from = start + n;
      const int64_t take = std::min<int64_t>(max_draft, len - from);
      out.assign(history.begin() + from, history.begin() + from + take);
      return out;
    }
  }
  return out;
}

void DraftLength::update(int drafted, int accepted) {
  if (resting_ > 0) {
    --resting_;
    return;
  }
  if (drafted <= 0) return;
  if (accepted >= drafted) {
    next_ = std::min(max_, next_ + 1);
    misses_ = 0;
    return;
  }
  next_ = std::clamp(accepted + 1, 1, max_);
  misses_ = accepted == 0 ? misses_ + 1 : 0;
  if (misses_ >= kMissesToRest) {
    resting_ = kRestSteps;
    misses_ = 0;
    next_ = max_;  // a fresh start after the rest
  }
}

}  // namespace pd
