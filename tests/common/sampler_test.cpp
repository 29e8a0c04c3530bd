// Tests of the sampler: greedy, temperature, top-k/top-p/min-p filters,
// penalties, seeding, the empirical distribution, validate() and check_stop().
// Every random draw is seeded, so no test can flake.
#include "sampling/sampler.h"
#include "serving/speculation.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <random>
#include <set>
#include <vector>

namespace pd {
namespace {

SamplingParams params_with(float temperature, int32_t top_k = 0, float top_p = 1.0f, float min_p = 0.0f,
                           uint64_t seed = 1) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.min_p = min_p;
  p.seed = seed;
  return p;
}

// Draws `n` tokens from fresh copies of `logits` and counts them per token.
std::vector<int> histogram(Sampler& s, const std::vector<float>& logits, int n) {
  std::vector<int> counts(logits.size(), 0);
  for (int i = 0; i < n; ++i) {
    std::vector<float> l = logits;
    ++counts[static_cast<size_t>(s.sample(l))];
  }
  return counts;
}

// Logits whose softmax is `probs`.
std::vector<float> logits_of(const std::vector<double>& probs) {
  std::vector<float> l;
  for (double p : probs) l.push_back(static_cast<float>(std::log(p)));
  return l;
}

std::vector<float> random_logits(size_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 3.0f);
  std::vector<float> l(vocab);
  for (float& x : l) x = d(rng);
  return l;
}

TEST_CASE("sampler: argmax picks the lowest index on ties", "[sampler]") {
  const std::vector<float> l = {1.0f, 3.0f, 3.0f, 2.0f};
  CHECK(argmax(l) == 1);
  const std::vector<float> one = {-5.0f};
  CHECK(argmax(one) == 0);
  const std::vector<float> neg = {-3.0f, -1.0f, -1.0f};
  CHECK(argmax(neg) == 1);
}

TEST_CASE("sampler: logit_bias moves the tokens it names before anything else, greedy or drawn", "[sampler]") {
  const std::vector<float> l = {0.5f, 2.0f, 1.0f, 1.9f};
  SamplingParams ban = params_with(0.0f);
  ban.logit_bias = {{1, -100.0f}};  // the argmax banned: the next best wins
  std::vector<float> row = l;
  CHECK(Sampler(ban).sample(row) == 3);
  SamplingParams force = params_with(1.0f);
  force.logit_bias = {{0, 100.0f}, {99, 100.0f}};  // an id past the vocabulary changes nothing
  Sampler s(force);
  CHECK(histogram(s, l, 200)[0] == 200);
  SamplingParams nudge = params_with(0.0f);
  nudge.logit_bias = {{2, 1.5f}};  // 1.0 + 1.5 passes 2.0
  row = l;
  CHECK(Sampler(nudge).sample(row) == 2);
}

TEST_CASE("sampler: logit_bias is validated: ids ascending and once, biases in [-100, 100], at most 1024", "[sampler]") {
  SamplingParams p;
  p.logit_bias = {{1, 100.0f}, {7, -100.0f}};
  CHECK(p.validate().is_ok());
  p.logit_bias = {{1, 100.5f}};
  CHECK(p.validate().message().find("[-100, 100]") != std::string::npos);
  p.logit_bias = {{7, 1.0f}, {1, 1.0f}};
  CHECK_FALSE(p.validate().is_ok());
  p.logit_bias = {{1, 1.0f}, {1, 2.0f}};
  CHECK_FALSE(p.validate().is_ok());
  p.logit_bias = {{-1, 1.0f}};
  CHECK_FALSE(p.validate().is_ok());
  p.logit_bias.clear();
  for (int i = 0; i <= static_cast<int>(kMaxLogitBias); ++i) p.logit_bias.emplace_back(i, 1.0f);
  CHECK(p.validate().message().find("at most") != std::string::npos);
}

TEST_CASE("sampler: temperature 0 and top_k 1 are greedy", "[sampler]") {
  const std::vector<float> l = {0.5f, 2.0f, 2.0f, 1.9f, -1.0f};
  for (const SamplingParams& p : {params_with(0.0f), params_with(1.0f, /*top_k=*/1), params_with(5.0f, 1)}) {
    Sampler s(p);
    const auto h = histogram(s, l, 200);
    CHECK(h[1] == 200);  // tie with index 2 -> lowest index
  }
}

TEST_CASE("sampler: a vanishing temperature converges to argmax", "[sampler]") {
  const std::vector<float> l = {1.0f, 1.5f, 1.2f, 1.49f};
  Sampler s(params_with(1e-3f));
  CHECK(histogram(s, l, 500)[1] == 500);
  // ...whereas a hot temperature spreads out.
  Sampler hot(params_with(2.0f));
  const auto h = histogram(hot, l, 500);
  for (int c : h) CHECK(c > 0);
}

TEST_CASE("sampler: a tiny top_p keeps only the most likely token", "[sampler]") {
  SECTION("small vocab") {
    Sampler s(params_with(1.0f, 0, 1e-6f));
    CHECK(histogram(s, {0.1f, 0.3f, 0.2f, 0.29f}, 300)[1] == 300);
  }
  SECTION("full vocab (bucketed selection)") {
    const auto l = random_logits(49152, 7);
    const TokenId best = argmax(l);
    Sampler s(params_with(1.0f, 0, 1e-6f));
    for (int i = 0; i < 20; ++i) {
      std::vector<float> copy = l;
      CHECK(s.sample(copy) == best);
    }
  }
}

TEST_CASE("sampler: top_k and top_p keep exactly the expected set", "[sampler]") {
  const auto l = logits_of({0.5, 0.3, 0.15, 0.05});
  SECTION("top_k 2") {
    Sampler s(params_with(1.0f, 2));
    const auto h = histogram(s, l, 2000);
    CHECK(h[0] > 0);
    CHECK(h[1] > 0);
    CHECK(h[2] == 0);
    CHECK(h[3] == 0);
  }
  SECTION("top_p 0.7: smallest set reaching 0.7 is {0, 1}") {
    Sampler s(params_with(1.0f, 0, 0.7f));
    const auto h = histogram(s, l, 2000);
    CHECK(h[0] > 0);
    CHECK(h[1] > 0);
    CHECK(h[2] == 0);
    CHECK(h[3] == 0);
  }
  SECTION("the cut falls between two tokens of nearly equal weight") {
    // Weights 0.8 and 0.78 of the max land in one selection bucket; top_p 0.6
    // needs {0, 1} (1.8 / 2.68 = 0.67), and top_k 2 keeps the same set.
    const auto close = logits_of({1.0, 0.8, 0.78, 0.1});
    for (const SamplingParams& p : {params_with(1.0f, 0, 0.6f), params_with(1.0f, 2)}) {
      Sampler s(p);
      const auto h = histogram(s, close, 2000);
      CHECK(h[0] > 0);
      CHECK(h[1] > 0);
      CHECK(h[2] == 0);
      CHECK(h[3] == 0);
    }
    // An exact tie at the cut: the lower id stays.
    Sampler s(params_with(1.0f, 2));
    const auto h = histogram(s, logits_of({1.0, 0.8, 0.8, 0.1}), 2000);
    CHECK(h[1] > 0);
    CHECK(h[2] == 0);
  }
  SECTION("top_p 0.85 keeps three") {
    Sampler s(params_with(1.0f, 0, 0.85f));
    const auto h = histogram(s, l, 4000);
    CHECK(h[2] > 0);
    CHECK(h[3] == 0);
  }
}

// The linear-time selection against a full sort: on a 2000-token vocabulary,
// every drawn token is in the reference top-k/top-p set, and every member of
// that set with probability >= 5% is drawn (300 draws: a miss has odds 2e-7).
TEST_CASE("sampler: top_k/top_p select the same set as a full sort", "[sampler]") {
  const auto logits = random_logits(2000, 21);
  struct Row {
    float temperature;
    int32_t top_k;
    float top_p;
  };
  for (const Row& r : {Row{1.0f, 20, 1.0f}, Row{1.0f, 0, 0.6f}, Row{2.0f, 0, 0.9f}, Row{0.7f, 300, 0.8f},
                       Row{1.5f, 7, 0.95f}}) {
    CAPTURE(r.temperature, r.top_k, r.top_p);
    std::vector<std::pair<double, TokenId>> ref;
    for (size_t i = 0; i < logits.size(); ++i) {
      ref.push_back({static_cast<double>(logits[i]) / r.temperature, static_cast<TokenId>(i)});
    }
    std::sort(ref.begin(), ref.end(), [](const auto& a, const auto& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    if (r.top_k > 0) ref.resize(static_cast<size_t>(r.top_k));
    const double top = ref[0].first;
    double z = 0.0;
    for (auto& e : ref) z += e.first = std::exp(e.first - top);
    size_t keep = 0;
    for (double cum = 0.0; keep < ref.size() && cum < r.top_p * z;) cum += ref[keep++].first;
    ref.resize(keep);
    double kept_mass = 0.0;
    for (const auto& e : ref) kept_mass += e.first;

    Sampler s(params_with(r.temperature, r.top_k, r.top_p, 0.0f, 77));
    std::set<TokenId> members;
    for (const auto& e : ref) members.insert(e.second);
    std::set<TokenId> drawn;
    for (int i = 0; i < 300; ++i) {
      std::vector<float> copy = logits;
      drawn.insert(s.sample(copy));
    }
    for (TokenId t : drawn) CHECK(members.count(t) == 1);
    for (const auto& e : ref) {
      if (e.first / kept_mass >= 0.05) CHECK(drawn.count(e.second) == 1);
    }
  }
}

TEST_CASE("sampler: min_p drops tokens below min_p * p_max", "[sampler]") {
  const auto l = logits_of({0.5, 0.3, 0.15, 0.05});
  SECTION("min_p 0.2: threshold 0.1 drops only the 0.05 token") {
    Sampler s(params_with(1.0f, 0, 1.0f, 0.2f));
    const auto h = histogram(s, l, 4000);
    CHECK(h[0] > 0);
    CHECK(h[1] > 0);
    CHECK(h[2] > 0);
    CHECK(h[3] == 0);
  }
  SECTION("min_p 0.7 keeps only the max") {
    Sampler s(params_with(1.0f, 0, 1.0f, 0.7f));
    CHECK(histogram(s, l, 500)[0] == 500);
  }
  SECTION("after top_k the max is still kept") {
    Sampler s(params_with(1.0f, 3, 0.9f, 1.0f));
    CHECK(histogram(s, l, 200)[0] == 200);
  }
}

TEST_CASE("sampler: presence and frequency penalties", "[sampler]") {
  const std::vector<float> base = {2.0f, 1.9f, 0.0f};
  auto greedy_after = [&](SamplingParams p, std::vector<TokenId> generated) {
    Sampler s(p);
    for (TokenId t : generated) s.accept(t);
    std::vector<float> l = base;
    return s.sample(l);
  };
  SamplingParams p = params_with(0.0f);
  CHECK(greedy_after(p, {0, 0, 0}) == 0);  // no penalties

  p.presence_penalty = 0.5f;  // 2.0 - 0.5 < 1.9
  CHECK(greedy_after(p, {0}) == 1);
  CHECK(greedy_after(p, {1}) == 0);
  CHECK(greedy_after(p, {2}) == 0);

  p = params_with(0.0f);
  p.frequency_penalty = 0.06f;  // one occurrence: 1.94 > 1.9; two: 1.88 < 1.9
  CHECK(greedy_after(p, {0}) == 0);
  CHECK(greedy_after(p, {0, 0}) == 1);
  CHECK(greedy_after(p, {0, 0, 1, 1, 1}) == 0);  // 1.88 vs 1.72

  p = params_with(0.0f);
  p.presence_penalty = -0.5f;  // negative encourages repetition
  CHECK(greedy_after(p, {1}) == 1);

  p = params_with(0.0f);
  p.presence_penalty = 2.0f;
  CHECK(greedy_after(p, {99, -1}) == 0);  // ids outside the vocab are ignored
}

TEST_CASE("sampler: repetition_penalty divides the seen tokens' positive logits and multiplies their negative ones",
          "[sampler]") {
  // Token 0 (2.0) beats 1 (1.5); seen, it becomes 2.0 / 1.5 = 1.33 and loses.
  // A seen negative logit goes further down: 3 (-1.0) vs 4 (-1.2) flips too.
  const std::vector<float> base = {2.0f, 1.5f, -50.0f, -1.0f, -1.2f};
  SamplingParams p = params_with(0.0f);
  p.repetition_penalty = 1.5f;
  auto greedy = [&](std::vector<TokenId> prompt, std::vector<TokenId> generated, std::vector<float> l) {
    Sampler s(p);
    s.resume(prompt);
    for (TokenId t : generated) s.accept(t);
    return s.sample(l);
  };
  CHECK(greedy({}, {}, base) == 0);
  CHECK(greedy({0}, {}, base) == 1);             // seen in the prompt
  CHECK(greedy({}, {0}, base) == 1);             // seen in the output
  CHECK(greedy({0, 0, 7}, {0, 0}, base) == 1);   // once per token, however often seen (1.33 < 1.5)
  CHECK(greedy({0, 1}, {}, base) == 0);          // both: 1.33 vs 1.0
  std::vector<float> negative = {-50.0f, -50.0f, -50.0f, -1.0f, -1.2f};
  CHECK(greedy({}, {}, negative) == 3);
  CHECK(greedy({3}, {}, negative) == 4);         // -1.5 < -1.2
  CHECK(greedy({99, -1}, {}, base) == 0);        // ids outside the vocabulary change nothing

  // Once per token even when the prompt and the output both hold it: the
  // same logits as a penalty of 1.5 applied once.
  Sampler once(p);
  once.resume(std::vector<TokenId>{1});
  once.accept(1);
  std::vector<float> l = base;
  (void)once.sample(l);
  CHECK(l[1] == 1.5f / 1.5f);

  p.repetition_penalty = 1.0f;  // off: the prompt is not even looked at
  CHECK(greedy({0}, {0}, base) == 0);
  p.repetition_penalty = 0.5f;  // < 1 rewards repetition
  CHECK(greedy({1}, {}, base) == 1);
}

TEST_CASE("sampler: min_tokens holds EOS and the stop tokens back, then lets them through", "[sampler]") {
  const std::vector<float> eos_first = {0.0f, 5.0f, 4.0f, 1.0f};  // token 1 is EOS, 2 a stop token
  SamplingParams p = params_with(0.0f);
  p.stop_token_ids = {2};
  p.min_tokens = 2;
  p.max_tokens = 8;
  REQUIRE(p.validate().is_ok());
  Sampler s(p);
  s.set_eos(1);
  s.resume(std::vector<TokenId>{0, 3});
  std::vector<float> l = eos_first;
  const TokenId first = s.sample(l);
  CHECK(first == 3);  // neither EOS nor the stop token before 2 tokens
  s.accept(first);
  l = eos_first;
  CHECK(s.sample(l) == 3);
  s.accept(3);
  l = eos_first;
  CHECK(s.sample(l) == 1);  // two generated: EOS may come

  // Sampled too (a drawn token never lands on a held-back one), and replayed
  // tokens count as generated (a decode rank after the prefill rank's token).
  SamplingParams q = p;
  q.temperature = 1.0f;
  q.seed = 3;
  for (int trial = 0; trial < 50; ++trial) {
    q.seed = static_cast<uint64_t>(trial);
    Sampler t(q);
    t.set_eos(1);
    std::vector<float> m = eos_first;
    const TokenId got = t.sample(m);
    CHECK(got != 1);
    CHECK(got != 2);
  }
  Sampler r(p);
  r.set_eos(1);
  r.replay(3);
  r.replay(3);
  l = eos_first;
  CHECK(r.sample(l) == 1);

  SamplingParams bad = p;
  bad.min_tokens = 9;
  CHECK_THAT(bad.validate().message(), Catch::StartsWith("min_tokens must be in [0, max_tokens = 8], got 9"));
  bad.min_tokens = -1;
  CHECK(bad.validate().is_invalid_argument());
  bad = p;
  bad.repetition_penalty = 0.0f;
  CHECK_THAT(bad.validate().message(), Catch::StartsWith("repetition_penalty must be > 0, got 0"));
  bad.repetition_penalty = std::numeric_limits<float>::infinity();
  CHECK(bad.validate().is_invalid_argument());
}

TEST_CASE("sampler: same seed same tokens, different seed different tokens", "[sampler]") {
  const auto l = random_logits(1000, 3);
  auto run = [&](uint64_t seed, int32_t top_k, float top_p, float min_p) {
    SamplingParams p = params_with(0.9f, top_k, top_p, min_p, seed);
    p.frequency_penalty = 0.3f;
    Sampler s(p);
    std::vector<TokenId> out;
    for (int i = 0; i < 150; ++i) {
      std::vector<float> copy = l;
      out.push_back(s.sample(copy));
      s.accept(out.back());
    }
    return out;
  };
  struct Filters {
    int32_t top_k;
    float top_p;
    float min_p;
  };
  for (const Filters& f : {Filters{0, 1.0f, 0.0f}, Filters{50, 1.0f, 0.0f}, Filters{0, 0.95f, 0.0f},
                           Filters{40, 0.9f, 0.05f}}) {
    CAPTURE(f.top_k, f.top_p, f.min_p);
    const auto a = run(11, f.top_k, f.top_p, f.min_p);
    CHECK(a == run(11, f.top_k, f.top_p, f.min_p));
    const auto b = run(12, f.top_k, f.top_p, f.min_p);
    int differ = 0;
    for (size_t i = 0; i < a.size(); ++i) differ += a[i] != b[i];
    CHECK(differ > 15);
  }
}

// Chi-square goodness of fit against softmax(logits / T). With 3 degrees of
// freedom the 0.1% critical value is 16.27; the draws are seeded, so the
// outcome is fixed.
TEST_CASE("sampler: empirical distribution matches softmax(logits / T)", "[sampler]") {
  const std::vector<float> l = {0.0f, 1.0f, 2.0f, 0.5f};
  const int n = 40000;
  struct Row {
    float temperature;
    int32_t top_k;
  };
  for (const Row& r : {Row{1.0f, 0}, Row{0.7f, 0}, Row{1.6f, 0}, Row{0.7f, 4}}) {
    CAPTURE(r.temperature, r.top_k);
    std::array<double, 4> expected{};
    double z = 0.0;
    for (size_t i = 0; i < 4; ++i) z += expected[i] = std::exp(l[i] / r.temperature);
    Sampler s(params_with(r.temperature, r.top_k, 1.0f, 0.0f, 2024));
    const auto h = histogram(s, l, n);
    double chi2 = 0.0;
    for (size_t i = 0; i < 4; ++i) {
      const double e = n * expected[i] / z;
      chi2 += (h[i] - e) * (h[i] - e) / e;
    }
    CHECK(chi2 < 16.27);
  }
  SECTION("top_k renormalizes over the survivors") {
    Sampler s(params_with(1.0f, 3, 1.0f, 0.0f, 99));
    const auto h = histogram(s, l, n);
    CHECK(h[0] == 0);  // the smallest logit is cut
    const double z = std::exp(1.0) + std::exp(2.0) + std::exp(0.5);
    double chi2 = 0.0;
    for (size_t i : {1u, 2u, 3u}) {
      const double e = n * std::exp(static_cast<double>(l[i])) / z;
      chi2 += (h[i] - e) * (h[i] - e) / e;
    }
    CHECK(chi2 < 13.82);  // 2 dof, 0.1%
  }
}

TEST_CASE("sampler: NaN and -inf logits are never drawn", "[sampler]") {
  const std::vector<float> l = {std::nanf(""), -INFINITY, 0.0f, 0.1f};
  Sampler s(params_with(1.0f, 0, 1.0f, 0.0f, 5));
  const auto h = histogram(s, l, 1000);
  CHECK(h[0] == 0);
  CHECK(h[1] == 0);
  CHECK(h[2] + h[3] == 1000);
}

TEST_CASE("sampler: validate names the field", "[sampler]") {
  CHECK(SamplingParams{}.validate().is_ok());
  struct Row {
    void (*mutate)(SamplingParams&);
    const char* message;
  };
  const Row rows[] = {
      {[](SamplingParams& p) { p.temperature = -0.1f; }, "temperature must be in [0, 100], got -0.1"},
      {[](SamplingParams& p) { p.temperature = 101.0f; }, "temperature must be in [0, 100], got 101"},
      {[](SamplingParams& p) { p.temperature = std::nanf(""); }, "temperature must be in [0, 100]"},
      {[](SamplingParams& p) { p.top_k = -1; }, "top_k must be >= 0, got -1"},
      {[](SamplingParams& p) { p.top_p = 1.5f; }, "top_p must be in (0, 1], got 1.5"},
      {[](SamplingParams& p) { p.top_p = 0.0f; }, "top_p must be in (0, 1], got 0"},
      {[](SamplingParams& p) { p.min_p = 1.5f; }, "min_p must be in [0, 1], got 1.5"},
      {[](SamplingParams& p) { p.min_p = -0.5f; }, "min_p must be in [0, 1], got -0.5"},
      {[](SamplingParams& p) { p.presence_penalty = 2.5f; }, "presence_penalty must be in [-2, 2], got 2.5"},
      {[](SamplingParams& p) { p.frequency_penalty = -3.0f; }, "frequency_penalty must be in [-2, 2], got -3"},
      {[](SamplingParams& p) { p.max_tokens = 0; }, "max_tokens must be >= 1, got 0"},
      {[](SamplingParams& p) { p.resumed_tokens = -1; }, "resumed_tokens must be >= 0, got -1"},
  };
  for (const Row& r : rows) {
    SamplingParams p;
    r.mutate(p);
    Status st = p.validate();
    CHECK(st.is_invalid_argument());
    CHECK_THAT(st.message(), Catch::StartsWith(r.message));
  }
  SamplingParams edge;
  edge.temperature = 100.0f;
  edge.top_p = 1.0f;
  edge.min_p = 1.0f;
  edge.presence_penalty = -2.0f;
  edge.frequency_penalty = 2.0f;
  edge.max_tokens = 1;
  CHECK(edge.validate().is_ok());
}

TEST_CASE("sampler: check_stop", "[sampler]") {
  SamplingParams p;
  p.max_tokens = 5;
  p.stop_token_ids = {7, 9};
  const TokenId eos = 2;
  struct Row {
    bool ignore_eos;
    TokenId id;
    int32_t n_generated;
    StopReason expected;
  };
  const Row rows[] = {
      {false, 3, 1, StopReason::kNone},      {false, 2, 1, StopReason::kEos},
      {true, 2, 1, StopReason::kNone},       {false, 7, 1, StopReason::kStopToken},
      {true, 9, 1, StopReason::kStopToken},  {false, 3, 5, StopReason::kLength},
      {false, 3, 6, StopReason::kLength},    {false, 2, 5, StopReason::kEos},
      {true, 2, 5, StopReason::kLength},     {false, 3, 4, StopReason::kNone},
  };
  for (const Row& r : rows) {
    CAPTURE(r.ignore_eos, r.id, r.n_generated);
    p.ignore_eos = r.ignore_eos;
    CHECK(check_stop(p, r.id, eos, r.n_generated) == r.expected);
  }
}

}  // namespace
}  // namespace pd

namespace pd {
// The prefill rank samples a request's first token and the decode rank goes
// on from there with its own Sampler: after replay() the continuation must be
// exactly what one sampler would have drawn.
// top_p 0.95 with presence and frequency penalties.
SamplingParams penalized(float temperature, uint64_t seed, float presence, float frequency) {
  SamplingParams p = params_with(temperature, 0, 0.95f, 0.0f, seed);
  p.presence_penalty = presence;
  p.frequency_penalty = frequency;
  return p;
}

// What one sampler draws for `n` tokens, token i from random_logits(64, seed0 + i).
std::vector<TokenId> one_sampler_draws(const SamplingParams& p, int n, uint64_t seed0) {
  Sampler one(p);
  std::vector<TokenId> out;
  for (int i = 0; i < n; ++i) {
    std::vector<float> l = random_logits(64, seed0 + static_cast<uint64_t>(i));
    const TokenId t = one.sample(l);
    one.accept(t);
    out.push_back(t);
  }
  return out;
}

TEST_CASE("sampler: replay continues another sampler's stream exactly", "[sampler]") {
  for (float temperature : {0.0f, 0.8f}) {
    const SamplingParams p = penalized(temperature, 1234, 0.3f, 0.2f);
    const std::vector<TokenId> expected = one_sampler_draws(p, 20, 100);
    Sampler first(p), rest(p);
    std::vector<float> l0 = random_logits(64, 100);
    const TokenId t0 = first.sample(l0);
    REQUIRE(t0 == expected[0]);
    rest.replay(t0);
    for (int i = 1; i < 20; ++i) {
      std::vector<float> l = random_logits(64, 100 + i);
      const TokenId t = rest.sample(l);
      rest.accept(t);
      INFO("temperature " << temperature << ", token " << i);
      CHECK(t == expected[static_cast<size_t>(i)]);
    }
  }
}

TEST_CASE("sampler: resume replays a migrated request's tokens from the prompt's end", "[sampler]") {
  for (float temperature : {0.0f, 0.8f}) {
    const SamplingParams p = penalized(temperature, 99, 0.5f, 0.4f);
    const std::vector<TokenId> expected = one_sampler_draws(p, 12, 300);
    for (int k : {0, 1, 5, 11}) {
      SamplingParams q = p;
      q.resumed_tokens = k;
      std::vector<TokenId> prompt = {7, 8, 9};  // the prompt's own tokens are not replayed
      prompt.insert(prompt.end(), expected.begin(), expected.begin() + k);
      Sampler moved(q);
      moved.resume(prompt);
      for (int i = k; i < 12; ++i) {
        std::vector<float> l = random_logits(64, 300 + i);
        const TokenId t = moved.sample(l);
        moved.accept(t);
        INFO("temperature " << temperature << ", resumed after " << k << ", token " << i);
        CHECK(t == expected[static_cast<size_t>(i)]);
      }
    }
  }
}

// ---- logprobs (sampling/logprobs.h)

// log_softmax of `logits` in double precision, the reference.
std::vector<double> reference_logprobs(const std::vector<float>& logits) {
  double max = -INFINITY;
  for (float l : logits) max = std::max(max, static_cast<double>(l));
  double sum = 0.0;
  for (float l : logits) sum += std::exp(l - max);
  std::vector<double> out;
  for (float l : logits) out.push_back(l - max - std::log(sum));
  return out;
}

TEST_CASE("logprobs: log_softmax of the raw logits, with the top alternatives most likely first", "[sampler]") {
  for (uint64_t seed : {1u, 2u, 3u}) {
    const std::vector<float> logits = random_logits(4096, seed);
    const std::vector<double> ref = reference_logprobs(logits);
    const TokenId token = static_cast<TokenId>(seed * 97);
    const LogprobEntry e = token_logprob(logits, token, 20);
    CHECK(e.token == token);
    CHECK(e.logprob == Approx(ref[static_cast<size_t>(token)]).margin(1e-5));
    REQUIRE(e.top.size() == 20);
    double mass = 0.0;
    for (size_t i = 0; i < e.top.size(); ++i) {
      CHECK(e.top[i].logprob == Approx(ref[static_cast<size_t>(e.top[i].id)]).margin(1e-5));
      if (i > 0) CHECK(e.top[i].logprob <= e.top[i - 1].logprob);
      mass += std::exp(static_cast<double>(e.top[i].logprob));
    }
    CHECK(mass <= 1.0 + 1e-6);
    // The best 20 by the reference are exactly these.
    std::vector<size_t> order(logits.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::partial_sort(order.begin(), order.begin() + 20, order.end(),
                      [&](size_t a, size_t b) { return logits[a] > logits[b]; });
    for (size_t i = 0; i < 20; ++i) CHECK(e.top[i].id == static_cast<TokenId>(order[i]));
    // The greedy token is the first alternative, and its logprob is the same float in both places.
    const LogprobEntry g = token_logprob(logits, argmax(logits), 3);
    CHECK(g.top[0].id == g.token);
    CHECK(g.top[0].logprob == g.logprob);
    // The whole distribution sums to 1.
    const LogprobEntry all = token_logprob(logits, 0, static_cast<int32_t>(logits.size()));
    double total = 0.0;
    for (const TokenLogprob& t : all.top) total += std::exp(static_cast<double>(t.logprob));
    CHECK(total == Approx(1.0).margin(1e-4));
  }
}

TEST_CASE("logprobs: ties, -inf and NaN logits, and out-of-range counts", "[sampler]") {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> logits = {1.0f, nan, 2.0f, -inf, 2.0f, 0.0f};
  LogprobEntry e = token_logprob(logits, 1, 6);
  CHECK(e.logprob == -inf);  // NaN is -inf
  REQUIRE(e.top.size() == 6);
  CHECK(e.top[0].id == 2);  // a tie keeps the lower id first
  CHECK(e.top[1].id == 4);
  CHECK(e.top[0].logprob == e.top[1].logprob);
  CHECK(e.top[2].id == 0);
  CHECK(e.top[3].id == 5);
  CHECK(e.top[4].logprob == -inf);
  CHECK(e.top[5].logprob == -inf);
  const double z = std::log(2 * std::exp(2.0) + std::exp(1.0) + 1.0);
  CHECK(e.top[0].logprob == Approx(2.0 - z));
  CHECK(token_logprob(logits, 3, 0).top.empty());
  CHECK(token_logprob(logits, 3, 0).logprob == -inf);
  CHECK(token_logprob(logits, 99, 2).logprob == -inf);  // not a token of this vocabulary
  CHECK(token_logprob(logits, -1, 2).logprob == -inf);
  CHECK(token_logprob(logits, 0, 1000).top.size() == 6);
  // Nothing finite: no token gets any mass.
  const std::vector<float> none = {-inf, nan};
  CHECK(token_logprob(none, 0, 2).logprob == -inf);
}

TEST_CASE("logprobs: the sampler draws each token with the probability its logprob gives", "[sampler]") {
  // Temperature 1 without truncation or penalties is the raw distribution itself.
  const std::vector<float> logits = logits_of({0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005});
  Sampler s(params_with(1.0f, 0, 1.0f, 0.0f, 42));
  constexpr int kDraws = 40000;
  const std::vector<int> counts = histogram(s, logits, kDraws);
  for (size_t i = 0; i < logits.size(); ++i) {
    const double p = std::exp(static_cast<double>(token_logprob(logits, static_cast<TokenId>(i), 0).logprob));
    const double sigma = std::sqrt(p * (1 - p) / kDraws);
    INFO("token " << i << ": p " << p << ", drawn " << counts[i]);
    CHECK(std::abs(counts[i] / static_cast<double>(kDraws) - p) < 5 * sigma + 1e-4);
  }
}

TEST_CASE("logprobs: validate() bounds logprobs and ties prompt_logprobs to it", "[sampler]") {
  SamplingParams p;
  p.logprobs = kMaxLogprobs;
  p.prompt_logprobs = true;
  CHECK(p.validate().is_ok());
  p.logprobs = kMaxLogprobs + 1;
  CHECK_FALSE(p.validate().is_ok());
  p.logprobs = -1;
  CHECK_FALSE(p.validate().is_ok());  // prompt logprobs without logprobs
  p.prompt_logprobs = false;
  CHECK(p.validate().is_ok());
  p.logprobs = -2;
  CHECK_FALSE(p.validate().is_ok());
}
}  // namespace pd

namespace pd {

TEST_CASE("speculation: prompt lookup drafts what followed the longest recent match") {
  const std::vector<TokenId> h = {1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3};
  // Suffix "2 3": its most recent earlier occurrence is at 5..6, followed by 7 8 5 2 3.
  CHECK(ngram_draft(h, 3, 3, 2) == std::vector<TokenId>{7, 8, 5});
  CHECK(ngram_draft(h, 10, 3, 2) == std::vector<TokenId>{7, 8, 5, 2, 3});  // up to the history's end
  // A longer n-gram wins over a more recent shorter one.
  const std::vector<TokenId> g = {4, 5, 6, 1, 5, 6, 2, 4, 5, 6};
  CHECK(ngram_draft(g, 2, 3, 1) == std::vector<TokenId>{1, 5});
  CHECK(ngram_draft(g, 2, 2, 1) == std::vector<TokenId>{2, 4});
  CHECK(ngram_draft(std::vector<TokenId>{1, 2, 3, 4}, 4, 3, 2).empty());  // nothing repeats
  CHECK(ngram_draft(h, 0, 3, 2).empty());
  CHECK(ngram_draft(std::vector<TokenId>{}, 4, 3, 1).empty());
  CHECK(ngram_draft(std::vector<TokenId>{5}, 4, 3, 1).empty());
}

// Every drafted token costing `c` of a plain step.
DraftCosts linear(double c) {
  DraftCosts cost;
  for (int k = 0; k <= kMaxDraft; ++k) cost[static_cast<size_t>(k)] = 1.0 + c * k;
  return cost;
}

TEST_CASE("speculation: the step cost is learned from the steps that ran") {
  StepCost c;
  CHECK(c.draft_cost(1) == Approx(StepCost::kPriorCost));  // nothing seen yet
  for (int i = 0; i < 4; ++i) c.observe(1, 1.0);
  CHECK(c.draft_cost(1) == Approx(StepCost::kPriorCost));  // every step the same size: nothing to tell apart
  // seconds = 1 + 0.5 * tokens: a drafted token costs 0.5 / 1.5 of a one-token step.
  StepCost memory;
  for (int i = 0; i < 40; ++i) memory.observe(1 + i % 5, 1.0 + 0.5 * (1 + i % 5));
  CHECK(memory.draft_cost(1) == Approx(1.0 / 3.0).epsilon(1e-6));
  CHECK(memory.draft_cost(4) == Approx(0.5 / (0.25 + 0.5)).epsilon(1e-6));  // a batch of 4: per sequence
  StepCost arithmetic;  // no fixed part: a draft costs what a token does
  for (int i = 0; i < 40; ++i) arithmetic.observe(1 + i % 5, 0.5 * (1 + i % 5));
  CHECK(arithmetic.draft_cost(1) == Approx(1.0).epsilon(1e-6));
  StepCost flat;  // steps cost the same whatever their size
  for (int i = 0; i < 40; ++i) flat.observe(1 + i % 5, 2.0);
  CHECK(flat.draft_cost(1) < 0.02);
  StepCost bad;  // non-positive times are not steps
  bad.observe(3, 0.0), bad.observe(0, 1.0), bad.observe(2, -1.0);
  CHECK(bad.draft_cost(1) == Approx(StepCost::kPriorCost));
}

TEST_CASE("speculation: each step size's own cost, where it is known, over the line through all") {
  // One sequence; a step of m tokens costs 1 + 0.2 (m - 1) up to 8 tokens, and
  // 9 tokens cost one tile more (a second pass over the weights): 3.2.
  auto seconds = [](int m) { return m <= 8 ? 1.0 + 0.2 * (m - 1) : 3.2; };
  StepCost c;
  DraftCosts before = c.draft_costs(1);  // nothing seen: the prior, per drafted token
  CHECK(before[0] == 1.0);
  CHECK(before[3] == Approx(1.0 + 3 * StepCost::kPriorCost));
  for (int round = 0; round < StepCost::kMinSeen; ++round)
    for (int m = 1; m <= 9; ++m) c.observe(m, seconds(m));
  const DraftCosts cost = c.draft_costs(1);
  for (int k = 0; k <= 8; ++k) CHECK(cost[k] == Approx(seconds(k + 1) / seconds(1)).epsilon(1e-9));
  // Past the sizes seen: the least-squares line (its slope per drafted token), never below the cost before.
  CHECK(cost[9] >= cost[8]);
  CHECK(cost[12] > cost[9]);
  // A sequence whose drafts are nearly always taken drafts 7, not 8: the 9-token step's jump.
  DraftPolicy d(8);
  for (int i = 0; i < 20; ++i) d.verified(8, 8);
  CHECK(d.next(cost) == 7);
  CHECK(d.next(linear(c.draft_cost(1))) == 8);  // the line alone does not see it

  // A batch of 4: the share of one sequence's step, 1 + 4 (T(4 + k) - T(4)) / T(4).
  const DraftCosts batch = c.draft_costs(4);
  CHECK(batch[2] == Approx(1.0 + 4 * (seconds(6) - seconds(4)) / seconds(4)).epsilon(1e-9));

  // Costs never fall with k (a noisy size that measured cheaper than a smaller one).
  StepCost noisy;
  for (int round = 0; round < StepCost::kMinSeen; ++round)
    noisy.observe(1, 1.0), noisy.observe(2, 1.5), noisy.observe(3, 1.2);
  const DraftCosts nc = noisy.draft_costs(1);
  CHECK(nc[1] == Approx(1.5));
  CHECK(nc[2] == Approx(1.5));
  // A stalled step counts as twice its size's average at most.
  StepCost stalled;
  for (int round = 0; round < StepCost::kMinSeen; ++round) stalled.observe(1, 1.0), stalled.observe(2, 1.2);
  stalled.observe(2, 100.0);
  CHECK(stalled.draft_costs(1)[1] < 1.7);  // unclamped, the 100 s step would make it ~34
}

TEST_CASE("speculation: the draft follows acceptance and cost, and a resting sequence learns from its shadow") {
  DraftPolicy d(8);
  CHECK(d.acceptance() == Approx(0.75));
  // p = 0.75: 1 + p + p^2 tokens for 1 + 2c beats every other k at c = 0.33.
  CHECK(d.next(linear(0.33)) == 2);
  CHECK(d.next(linear(1.0)) == 0);    // a draft costs what a token does: never pays at p < 1
  CHECK(d.next(linear(0.01)) == 8);   // nearly free: as many as allowed
  for (int i = 0; i < 5; ++i) d.verified(4, 4);
  CHECK(d.acceptance() > 0.95);
  CHECK(d.next(linear(0.33)) == 8);
  d.verified(0, 0);  // nothing drafted: no change
  CHECK(d.next(linear(0.33)) == 8);
  for (int i = 0; i < 10; ++i) d.verified(3, 0);
  CHECK(d.acceptance() < 0.3);
  CHECK(d.next(linear(0.33)) == 0);
  // Resting, it follows what it would have drafted: the text repeats.
  REQUIRE(d.wants_shadow());
  d.shadow({5, 6, 7});
  CHECK_FALSE(d.wants_shadow());
  const double before = d.acceptance();
  d.emitted(5), d.emitted(6);
  CHECK(d.acceptance() > before);
  d.emitted(7);
  CHECK(d.wants_shadow());  // used up
  for (int round = 0; round < 4; ++round) {
    d.shadow({1, 2, 3, 4});
    for (TokenId t : {1, 2, 3, 4}) d.emitted(t);
  }
  CHECK(d.next(linear(0.33)) > 0);  // drafting again
  // A wrong shadow token ends the shadow and counts as a miss.
  const double high = d.acceptance();
  d.shadow({9, 9});
  d.emitted(8);
  CHECK(d.acceptance() < high);
  CHECK(d.wants_shadow());
  DraftPolicy off(0);
  CHECK(off.next(linear(0.01)) == 0);
}

}  // namespace pd
