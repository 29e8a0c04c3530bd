// Token sampling: see sampler.h for the contracts.
#include "sampling/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

namespace pd {

namespace {

std::string fmt_float(float v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(v));
  return buf;
}

// NaN-safe "lo <= v <= hi".
bool in_closed(float v, float lo, float hi) { return v >= lo && v <= hi; }

// Candidate order: larger value first, lower token id on ties (deterministic).
bool better(const std::pair<float, TokenId>& a, const std::pair<float, TokenId>& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// Of the first `n` candidates of `c`, puts the `k` best at the front, sorted best-first.
void partial_sort_best_of(std::vector<std::pair<float, TokenId>>& c, size_t n, size_t k) {
  auto first = c.begin();
  auto mid = first + static_cast<ptrdiff_t>(std::min(k, n));
  auto last = first + static_cast<ptrdiff_t>(n);
  if (mid < last) std::nth_element(first, mid, last, better);
  std::sort(first, mid, better);
}

// Uniform double in [0, 1) from the top 53 bits: the same on every standard
// library (std::uniform_real_distribution is implementation-defined).
double uniform01(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

}  // namespace

Status SamplingParams::validate() const {
  if (!in_closed(temperature, 0.0f, 100.0f)) {
    return Status::invalid_argument("temperature must be in [0, 100], got " + fmt_float(temperature));
  }
  if (top_k < 0) return Status::invalid_argument("top_k must be >= 0, got " + std::to_string(top_k));
  if (!(top_p > 0.0f && top_p <= 1.0f)) {
    return Status::invalid_argument("top_p must be in (0, 1], got " + fmt_float(top_p));
  }
  if (!in_closed(min_p, 0.0f, 1.0f)) return Status::invalid_argument("min_p must be in [0, 1], got " + fmt_float(min_p));
  if (!in_closed(presence_penalty, -2.0f, 2.0f)) {
    return Status::invalid_argument("presence_penalty must be in [-2, 2], got " + fmt_float(presence_penalty));
  }
  if (!in_closed(frequency_penalty, -2.0f, 2.0f)) {
    return Status::invalid_argument("frequency_penalty must be in [-2, 2], got " + fmt_float(frequency_penalty));
  }
  if (max_tokens < 1) return Status::invalid_argument("max_tokens must be >= 1, got " + std::to_string(max_tokens));
  return Status::ok();
}

TokenId argmax(std::span<const float> logits) {
  if (logits.empty()) return 0;
  size_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i) {
    if (logits[i] > logits[best]) best = i;  // strict: the first maximum wins; NaN never wins
  }
  return static_cast<TokenId>(best);
}

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {}

void Sampler::accept(TokenId id) { ++counts_[id]; }

TokenId Sampler::sample(std::span<float> logits) {
  const size_t vocab = logits.size();
  if (vocab == 0) return 0;

  // 1. Penalties on the tokens generated so far (OpenAI semantics).
  if (params_.presence_penalty != 0.0f || params_.frequency_penalty != 0.0f) {
    for (const auto& [id, count] : counts_) {
      if (id < 0 || static_cast<size_t>(id) >= vocab || count <= 0) continue;
      logits[id] -= params_.frequency_penalty * static_cast<float>(count) + params_.presence_penalty;
    }
  }

  // 2. Greedy.
  if (params_.temperature <= 0.0f || params_.top_k == 1) return argmax(logits);

  // 3. Temperature; NaN logits are treated as -inf (never drawn).
  const float inv_t = 1.0f / params_.temperature;
  scratch_.resize(vocab);
  for (size_t i = 0; i < vocab; ++i) {
    const float l = logits[i];
    scratch_[i] = {std::isnan(l) ? -std::numeric_limits<float>::infinity() : l * inv_t, static_cast<TokenId>(i)};
  }

  // 4. Top-k: keep the k best, sorted best-first.
  size_t n = vocab;
  bool sorted = false;
  if (params_.top_k > 0 && static_cast<size_t>(params_.top_k) < vocab) {
    n = static_cast<size_t>(params_.top_k);
    partial_sort_best_of(scratch_, vocab, n);
    sorted = true;
  }

  // 5. Softmax (unnormalized weights exp(l - max); the max has weight 1).
  float max_l = -std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < n; ++i) max_l = std::max(max_l, scratch_[i].first);
  if (max_l == -std::numeric_limits<float>::infinity()) return argmax(logits);  // nothing drawable
  double total = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const float w = std::exp(scratch_[i].first - max_l);
    scratch_[i].first = w;
    total += w;
  }

  // 6. Top-p: the smallest best-first prefix whose mass reaches top_p (>= 1 token).
  //    Sorts only as many candidates as the nucleus needs, growing 4x per round.
  if (params_.top_p < 1.0f) {
    const double target = static_cast<double>(params_.top_p) * total;
    size_t k = sorted ? n : std::min<size_t>(n, 256);
    for (;;) {
      if (!sorted || k < n) {
        partial_sort_best_of(scratch_, n, k);
      }
      double cum = 0.0;
      size_t keep = 0;
      while (keep < k && cum < target) cum += scratch_[keep++].first;
      if (cum >= target || k == n) {
        n = std::max<size_t>(keep, 1);
        sorted = true;
        break;
      }
      k = std::min(n, k * 4);
    }
  }

  // 7. Min-p: drop weights below min_p * max weight (the max weight is 1).
  if (params_.min_p > 0.0f) {
    size_t kept = 0;  // stable compaction; the max (weight 1) always stays
    for (size_t i = 0; i < n; ++i) {
      if (scratch_[i].first >= params_.min_p) scratch_[kept++] = scratch_[i];
    }
    n = kept;
  }

  // 8. Renormalize and draw by inverse CDF, in candidate order.
  total = 0.0;
  for (size_t i = 0; i < n; ++i) total += scratch_[i].first;
  const double u = uniform01(rng_) * total;
  double cum = 0.0;
  for (size_t i = 0; i < n; ++i) {
    cum += scratch_[i].first;
    if (u < cum) return scratch_[i].second;
  }
  // Rounding left u at the very top: the last candidate with nonzero weight.
  for (size_t i = n; i-- > 0;) {
    if (scratch_[i].first > 0.0f) return scratch_[i].second;
  }
  return scratch_[0].second;
}

StopReason check_stop(const SamplingParams& p, TokenId id, TokenId eos_id, int32_t n_generated) {
  if (!p.ignore_eos && id == eos_id) return StopReason::kEos;
  if (std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), id) != p.stop_token_ids.end()) {
    return StopReason::kStopToken;
  }
  if (n_generated >= p.max_tokens) return StopReason::kLength;
  return StopReason::kNone;
}

}  // namespace pd
