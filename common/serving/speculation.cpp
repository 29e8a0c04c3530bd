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

void StepCost::observe(int tokens, double seconds) {
  if (tokens <= 0 || !(seconds > 0)) return;
  const double x = tokens;
  w_ = w_ * kDecay + 1, sx_ = sx_ * kDecay + x, sy_ = sy_ * kDecay + seconds;
  sxx_ = sxx_ * kDecay + x * x, sxy_ = sxy_ * kDecay + x * seconds;
  if (tokens > kMaxSized) return;
  // A step the machine stalled in (another process, a page fault storm) counts
  // as twice the size's average at most, once the average means something.
  double y = seconds;
  if (size_n_[tokens] >= kMinSeen) y = std::min(y, 2.0 * size_y_[tokens] / size_w_[tokens]);
  size_w_[tokens] = size_w_[tokens] * kSizeDecay + 1, size_y_[tokens] = size_y_[tokens] * kSizeDecay + y;
  if (size_n_[tokens] < kMinSeen) ++size_n_[tokens];  // only "seen enough" matters: no count to overflow
}

DraftCosts StepCost::draft_costs(int sequences) const {
  const int n = std::max(sequences, 1);
  const double c = draft_cost(n);
  auto known = [&](int size) { return size <= kMaxSized && size_n_[size] >= kMinSeen; };
  auto mean = [&](int size) { return size_y_[size] / size_w_[size]; };
  DraftCosts out;
  out[0] = 1.0;
  for (int k = 1; k <= kMaxDraft; ++k) {
    double cost = 1.0 + c * k;
    if (known(n) && known(n + k)) cost = 1.0 + n * (mean(n + k) - mean(n)) / mean(n);
    out[k] = std::max(cost, out[k - 1]);
  }
  return out;
}

double StepCost::draft_cost(int sequences) const {
  const double n = std::max(sequences, 1);
  const double prior = kPriorCost / (1.0 + (n - 1.0) * kPriorCost) * n;  // per_token = c, fixed = 1 - c
  const double var = sxx_ * w_ - sx_ * sx_;                             // w^2 times the variance of x
  // At least ~8 steps, whose sizes spread by a quarter of a token or more.
  if (w_ < 8 || var < 0.0625 * w_ * w_) return std::min(prior, 1.0);
  const double per_token = (w_ * sxy_ - sx_ * sy_) / var;
  const double fixed = (sy_ - per_token * sx_) / w_;
  if (!(per_token > 0)) return 0.01;  // no measurable cost per token
  if (!(fixed > 0)) return 1.0;       // all arithmetic: a draft costs what a token does
  return std::clamp(per_token / (fixed / n + per_token), 0.01, 1.0);
}

int DraftPolicy::next(const DraftCosts& cost) const {
  const double p = std::min(acceptance(), 0.999);
  double best = kMinGain;
  int best_k = 0;
  double expected = 1, pk = 1;  // tokens a step gives with k drafted: 1 + p + ... + p^k
  for (int k = 1; k <= std::min(max_, kMaxDraft); ++k) {
    pk *= p;
    expected += pk;
    const double gain = expected / cost[static_cast<size_t>(k)];
    if (gain > best) best = gain, best_k = k;
  }
  return best_k;
}

void DraftPolicy::record(int accepted, bool rejected) {
  for (int i = 0; i < accepted; ++i) accepted_ = accepted_ * kDecay + 1, rejected_ *= kDecay;
  if (rejected) accepted_ *= kDecay, rejected_ = rejected_ * kDecay + 1;
}

void DraftPolicy::verified(int drafted, int accepted) {
  shadow_.clear();
  if (drafted <= 0) return;
  record(accepted, accepted < drafted);
}

void DraftPolicy::shadow(std::vector<TokenId> draft) {
  shadow_ = std::move(draft);
  shadow_at_ = 0;
}

void DraftPolicy::emitted(TokenId token) {
  if (shadow_.empty()) return;
  const bool right = shadow_[shadow_at_] == token;
  record(right ? 1 : 0, !right);
  if (!right || ++shadow_at_ == shadow_.size()) shadow_.clear();
}

}  // namespace pd
