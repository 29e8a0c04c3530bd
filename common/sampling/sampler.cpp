// Token sampling: see sampler.h for the contracts.
#include "sampling/sampler.h"

#include <algorithm>
#include <array>
#include <bit>
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

// Candidate order: larger weight first, lower token id on ties (deterministic).
bool better(const std::pair<float, TokenId>& a, const std::pair<float, TokenId>& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// exp(x) for x <= 0; 0 for x <= -87, -inf and NaN. Cody-Waite reduction
// x = n*ln2 + r (|r| <= ln2/2), degree-6 Taylor polynomial for e^r (relative
// error < 3e-7), times 2^n built in the exponent bits. No libm call (the
// result does not depend on the libm version) and no branch: the clamp and the
// zeroing are integer min/mask, because a float select here is turned into
// control flow under -ftrapping-math and the loop over the vocabulary would
// not vectorize.
inline float exp_nonpositive(float x) {
  constexpr uint32_t kFloor = 0xC2AE0000u;  // bits of -87.0f; larger bits = more negative
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t nan_sign = static_cast<uint32_t>((bits & 0x7FFFFFFFu) > 0x7F800000u) << 31;
  const uint32_t clamped = std::min(bits | nan_sign, kFloor);  // -inf, NaN, x < -87 -> -87
  const uint32_t keep = 0u - static_cast<uint32_t>(clamped != kFloor);
  const float xc = std::bit_cast<float>(clamped);
  const float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (xc * 1.44269504f + kRound) - kRound;
  float r = xc - n * 0.693359375f;  // ln2 in two parts; n * 0.693359375f is exact
  r = r + n * 2.12194440e-4f;
  const float p =
      1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
  const int32_t exponent = static_cast<int32_t>(n) + 127;  // n in [-126, 0]: a normal scale
  const float value = p * std::bit_cast<float>(static_cast<uint32_t>(exponent) << 23);
  return std::bit_cast<float>(std::bit_cast<uint32_t>(value) & keep);
}

// Max and sum over [n] floats in 8 independent lanes: a fixed order (so the
// result is deterministic) that the compiler can vectorize.
float max_of(const float* x, size_t n) {  // NaN ignored; -inf when empty or all NaN/-inf
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  float lane[8] = {kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf};
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (size_t j = 0; j < 8; ++j) lane[j] = x[i + j] > lane[j] ? x[i + j] : lane[j];
  }
  for (; i < n; ++i) lane[0] = x[i] > lane[0] ? x[i] : lane[0];
  float m = kNegInf;
  for (float v : lane) m = v > m ? v : m;
  return m;
}

// Sum of the x[i] >= floor (floor 0 sums every nonnegative weight).
double sum_at_least(const float* x, size_t n, float floor) {
  double lane[8] = {};
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (size_t j = 0; j < 8; ++j) lane[j] += x[i + j] >= floor ? x[i + j] : 0.0f;
  }
  for (; i < n; ++i) lane[0] += x[i] >= floor ? x[i] : 0.0f;
  double total = 0.0;
  for (double v : lane) total += v;
  return total;
}

// Buckets of nonnegative float weights, monotone in the weight: the exponent
// and the top 3 mantissa bits (8 buckets per octave). Weight 1 is the top key.
constexpr uint32_t kWeightKeys = (0x3F800000u >> 20) + 1;
inline uint32_t weight_key(float w) { return std::bit_cast<uint32_t>(w) >> 20; }

using Candidate = std::pair<float, TokenId>;  // (weight, token id)

// Keeps the best of the n candidates at(0), ..., at(n-1) (weights in [0, 1])
// by `better`: as many as `max_count`, or the fewest whose weight sum reaches
// `mass_target`, whichever bound comes first (always at least one). Writes
// them to out[0, kept) and resizes `out` to kept: first those above the
// boundary bucket in input order, then the boundary ones best-first. `out`
// may be the container `at` reads from (in-place compaction). Linear time:
// buckets the weights, and orders only the boundary bucket (in `edge`).
template <typename At>
void keep_best(size_t n, At at, size_t max_count, double mass_target, std::vector<Candidate>& out,
               std::vector<Candidate>& edge) {
  std::array<uint32_t, kWeightKeys> count{};
  std::array<double, kWeightKeys> mass{};
  for (size_t i = 0; i < n; ++i) {
    const float w = at(i).first;
    const uint32_t k = weight_key(w);
    ++count[k];
    mass[k] += w;
  }
  size_t above_count = 0;  // candidates in keys above the boundary
  double above_mass = 0.0;
  uint32_t boundary = kWeightKeys;  // none: every candidate stays
  for (uint32_t k = kWeightKeys; k-- > 0;) {
    if (count[k] == 0) continue;  // the boundary bucket is never empty
    if (above_count + count[k] >= max_count || above_mass + mass[k] >= mass_target) {
      boundary = k;
      break;
    }
    above_count += count[k];
    above_mass += mass[k];
  }
  const size_t most = boundary == kWeightKeys ? n : above_count + count[boundary];
  if (out.size() < most) out.resize(most);  // in place: already n >= most
  size_t kept = 0;
  edge.clear();
  for (size_t i = 0; i < n; ++i) {
    const Candidate e = at(i);  // read before the write below: kept <= i
    const uint32_t k = weight_key(e.first);
    if (k > boundary || boundary == kWeightKeys) {
      out[kept++] = e;
    } else if (k == boundary) {
      edge.push_back(e);
    }
  }
  if (boundary != kWeightKeys) {
    // Above the boundary both bounds are unmet, so at least one edge candidate is taken.
    const size_t take = std::min(max_count - above_count, edge.size());
    std::sort(edge.begin(), edge.end(), better);
    double cum = above_mass;
    for (size_t i = 0; i < take && (i == 0 || cum < mass_target); ++i) {
      cum += edge[i].first;
      out[kept++] = edge[i];
    }
  }
  out.resize(kept);
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
  if (!(repetition_penalty > 0.0f && std::isfinite(repetition_penalty))) {
    return Status::invalid_argument("repetition_penalty must be > 0, got " + fmt_float(repetition_penalty));
  }
  if (min_tokens < 0 || min_tokens > max_tokens) {
    return Status::invalid_argument("min_tokens must be in [0, max_tokens = " + std::to_string(max_tokens) + "], got " +
                                    std::to_string(min_tokens));
  }
  if (logprobs < -1 || logprobs > kMaxLogprobs) {
    return Status::invalid_argument("logprobs must be in [-1, " + std::to_string(kMaxLogprobs) + "], got " +
                                    std::to_string(logprobs));
  }
  if (prompt_logprobs && logprobs < 0) return Status::invalid_argument("prompt_logprobs needs logprobs >= 0");
  if (resumed_tokens < 0) return Status::invalid_argument("resumed_tokens must be >= 0, got " + std::to_string(resumed_tokens));
  if (logit_bias.size() > kMaxLogitBias) {
    return Status::invalid_argument("logit_bias may hold at most " + std::to_string(kMaxLogitBias) + " tokens, got " +
                                    std::to_string(logit_bias.size()));
  }
  for (size_t i = 0; i < logit_bias.size(); ++i) {
    const auto& [id, bias] = logit_bias[i];
    if (id < 0) return Status::invalid_argument("logit_bias token ids must be >= 0, got " + std::to_string(id));
    if (i > 0 && id <= logit_bias[i - 1].first) return Status::invalid_argument("logit_bias token ids must ascend, each once");
    if (!in_closed(bias, -100.0f, 100.0f)) {
      return Status::invalid_argument("logit_bias values must be in [-100, 100], got " + fmt_float(bias));
    }
  }
  const auto kind = static_cast<int32_t>(grammar.kind);
  if (kind < 0 || kind > kGrammarKindMax) return Status::invalid_argument("grammar kind " + std::to_string(kind) + " is unknown");
  if (grammar.text.size() + grammar.prefix.size() + grammar.suffix.size() > kMaxGrammarBytes) {
    return Status::invalid_argument("a grammar may hold at most " + std::to_string(kMaxGrammarBytes) + " bytes");
  }
  return Status::ok();
}

TokenId argmax(std::span<const float> logits) {
  size_t best = 0;
  while (best + 1 < logits.size() && std::isnan(logits[best])) ++best;  // NaN never wins
  for (size_t i = best + 1; i < logits.size(); ++i) {
    if (logits[i] > logits[best]) best = i;  // strict: the first maximum wins
  }
  return static_cast<TokenId>(best);
}

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {}

void Sampler::accept(TokenId id) {
  ++counts_[id];
  ++generated_;
  // A token the grammar refuses can only follow a complete output (with
  // ignore_eos): the constraint stays where it was.
  if (constraint_) (void)constraint_->accept(id);
}

void Sampler::replay(TokenId id) {
  if (!(params_.temperature <= 0.0f || params_.top_k == 1)) rng_.discard(1);  // sample()'s one draw
  accept(id);
}

void Sampler::resume(std::span<const TokenId> prompt) {
  if (params_.repetition_penalty != 1.0f) {
    prompt_seen_.assign(prompt.begin(), prompt.end());
    std::sort(prompt_seen_.begin(), prompt_seen_.end());
    prompt_seen_.erase(std::unique(prompt_seen_.begin(), prompt_seen_.end()), prompt_seen_.end());
  }
  const size_t n = std::min(prompt.size(), static_cast<size_t>(std::max(params_.resumed_tokens, 0)));
  for (TokenId id : prompt.last(n)) replay(id);
}

void Sampler::apply_repetition_penalty(std::span<float> logits) const {
  const float r = params_.repetition_penalty;
  auto penalize = [&](TokenId id) {
    if (id < 0 || static_cast<size_t>(id) >= logits.size()) return;
    float& l = logits[id];
    l = l > 0.0f ? l / r : l * r;
  };
  for (TokenId id : prompt_seen_) penalize(id);
  for (const auto& [id, count] : counts_) {
    if (count > 0 && !std::binary_search(prompt_seen_.begin(), prompt_seen_.end(), id)) penalize(id);
  }
}

TokenId Sampler::sample(std::span<float> logits) {
  const size_t vocab = logits.size();
  if (vocab == 0) return 0;

  // 0. The request's logit bias (ids past this vocabulary change nothing).
  for (const auto& [id, bias] : params_.logit_bias)
    if (id >= 0 && static_cast<size_t>(id) < vocab) logits[id] += bias;
  // 0'. The grammar: tokens it does not allow next get -inf.
  if (constraint_) constraint_->apply(logits);
  // 0''. min_tokens: the tokens that would end the request wait.
  if (generated_ < params_.min_tokens && !(constraint_ && constraint_->done())) {
    auto ban = [&](TokenId id) {
      if (id >= 0 && static_cast<size_t>(id) < vocab) logits[id] = -std::numeric_limits<float>::infinity();
    };
    ban(eos_id_);
    for (TokenId id : params_.stop_token_ids) ban(id);
  }

  // 1. Penalties: repetition (vLLM's; tokens of the prompt and the output),
  //    then presence and frequency on the tokens generated so far (OpenAI's).
  if (params_.repetition_penalty != 1.0f) apply_repetition_penalty(logits);
  if (params_.presence_penalty != 0.0f || params_.frequency_penalty != 0.0f) {
    for (const auto& [id, count] : counts_) {
      if (id < 0 || static_cast<size_t>(id) >= vocab || count <= 0) continue;
      logits[id] -= params_.frequency_penalty * static_cast<float>(count) + params_.presence_penalty;
    }
  }

  // 2. Greedy.
  if (params_.temperature <= 0.0f || params_.top_k == 1) return argmax(logits);

  // 3. Temperature and softmax weights relative to the max (the max has weight
  //    1; NaN and -inf logits weigh 0 and are never drawn).
  const float max_logit = max_of(logits.data(), vocab);
  if (!std::isfinite(max_logit)) return argmax(logits);  // nothing drawable, or a +inf logit
  const float inv_t = 1.0f / params_.temperature;
  weights_.resize(vocab);
  {
    const float* __restrict in = logits.data();
    float* __restrict out = weights_.data();
    for (size_t i = 0; i < vocab; ++i) out[i] = exp_nonpositive((in[i] - max_logit) * inv_t);
  }

  const bool top_k = params_.top_k > 0 && static_cast<size_t>(params_.top_k) < vocab;
  const bool top_p = params_.top_p < 1.0f;
  const float min_p = params_.min_p;  // weights are relative to the max: the cut is min_p itself

  if (!top_k && !top_p) {
    // 4'. No truncation but min-p: draw straight from the weights, in index order.
    const double total = sum_at_least(weights_.data(), vocab, min_p);
    const double u = uniform01(rng_) * total;
    double cum = 0.0;
    size_t last = 0;
    for (size_t i = 0; i < vocab; ++i) {
      const float w = weights_[i];
      if (w <= 0.0f || w < min_p) continue;
      cum += w;
      last = i;
      if (u < cum) return static_cast<TokenId>(i);
    }
    return static_cast<TokenId>(last);  // rounding left u at the very top
  }

  // 4. Top-k, then 5. top-p over what top-k kept (renormalized).
  auto from_weights = [this](size_t i) { return Candidate{weights_[i], static_cast<TokenId>(i)}; };
  auto from_scratch = [this](size_t i) { return scratch_[i]; };
  if (top_k) {
    keep_best(vocab, from_weights, static_cast<size_t>(params_.top_k), std::numeric_limits<double>::infinity(),
              scratch_, edge_);
  }
  if (top_p) {
    double total = 0.0;
    if (top_k) {
      for (const Candidate& c : scratch_) total += c.first;
    } else {
      total = sum_at_least(weights_.data(), vocab, 0.0f);
    }
    const double target = static_cast<double>(params_.top_p) * total;
    if (top_k) {
      keep_best(scratch_.size(), from_scratch, scratch_.size(), target, scratch_, edge_);
    } else {
      keep_best(vocab, from_weights, vocab, target, scratch_, edge_);
    }
  }

  // 6. Min-p (stable compaction; the max, weight 1, always survives top-k/top-p).
  if (min_p > 0.0f) {
    size_t kept = 0;
    for (const Candidate& c : scratch_) {
      if (c.first >= min_p) scratch_[kept++] = c;
    }
    scratch_.resize(std::max<size_t>(kept, 1));
  }

  // 7. Renormalize and draw by inverse CDF, in candidate order.
  if (scratch_.empty()) return argmax(logits);  // unreachable with validated params
  double total = 0.0;
  for (const Candidate& c : scratch_) total += c.first;
  const double u = uniform01(rng_) * total;
  double cum = 0.0;
  TokenId last = scratch_[0].second;
  for (const auto& [w, id] : scratch_) {
    if (w <= 0.0f) continue;
    cum += w;
    last = id;
    if (u < cum) return id;
  }
  return last;  // rounding left u at the very top
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
