// The chunked-prefill policy (serving/prefill_chunks.h): table-driven per pass
// (who computes how many tokens), then the starvation bound over simulated passes.
#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <vector>

#include "serving/prefill_chunks.h"

using pd::ChunkPolicy;
using pd::PrefillCandidate;
using pd::PrefillChunk;
using pd::plan_prefill_chunks;

namespace {
struct Row {
  const char* what;
  int64_t budget, chunk;
  int max_prompts;
  std::vector<PrefillCandidate> candidates;             // arrival order
  std::vector<std::pair<uint64_t, int64_t>> expected;  // id, tokens
};
std::vector<std::pair<uint64_t, int64_t>> pairs(const std::vector<PrefillChunk>& v) {
  std::vector<std::pair<uint64_t, int64_t>> out;
  for (const PrefillChunk& c : v) out.push_back({c.id, c.tokens});
  return out;
}
}  // namespace

TEST_CASE("prefill chunks: who computes how much in one pass", "[chunks]") {
  const std::vector<Row> table{
      {"nothing waits", 2048, 512, 16, {}, {}},
      {"a lone long prompt advances one chunk", 2048, 512, 16, {{1, 4000}}, {{1, 512}}},
      {"the last chunk is what is left", 2048, 512, 16, {{1, 100}}, {{1, 100}}},
      {"shorts behind a long one share the pass", 2048, 512, 16, {{1, 4000}, {2, 64}, {3, 64}},
       {{1, 512}, {2, 64}, {3, 64}}},
      {"a second long prompt waits; the short behind it overtakes", 2048, 512, 16, {{1, 4000}, {2, 3000}, {3, 64}},
       {{1, 512}, {3, 64}}},
      {"a prompt of exactly one chunk is short", 2048, 512, 16, {{1, 4000}, {2, 512}}, {{1, 512}, {2, 512}}},
      {"the long chunk leaves a short behind it its room", 600, 512, 16, {{1, 4000}, {2, 300}}, {{1, 300}, {2, 300}}},
      {"a colocated step (about one chunk): a short gets in beside the long one", 253, 256, 16,
       {{1, 4000}, {2, 65}, {3, 64}}, {{1, 124}, {2, 65}, {3, 64}}},
      {"shorts past the budget: the long one first still advances", 100, 256, 16, {{1, 4000}, {2, 90}, {3, 90}},
       {{1, 16}, {2, 84}}},
      {"the long prompt's chunk is cut to the budget", 300, 512, 16, {{1, 4000}}, {{1, 300}}},
      {"shorts first in arrival order fill the budget", 1000, 512, 16, {{1, 400}, {2, 400}, {3, 400}, {4, 5000}},
       {{1, 400}, {2, 400}, {3, 200}}},
      {"max_prompts bounds the pass", 2048, 512, 2, {{1, 10}, {2, 10}, {3, 10}}, {{1, 10}, {2, 10}}},
      {"chunking off: whole prompts while they fit, no overtaking", 2048, 0, 16, {{1, 1500}, {2, 1000}, {3, 10}},
       {{1, 1500}}},
      {"chunking off: one prompt may exceed the budget alone", 2048, 0, 16, {{1, 4000}, {2, 10}}, {{1, 4000}}},
      {"chunking off: several fit", 2048, 0, 16, {{1, 1000}, {2, 1000}, {3, 100}}, {{1, 1000}, {2, 1000}}},
  };
  for (const Row& r : table) {
    INFO(r.what);
    const auto got = plan_prefill_chunks(r.candidates, ChunkPolicy{r.budget, r.chunk, r.max_prompts, 0});
    CHECK(pairs(got) == r.expected);
  }
}

TEST_CASE("prefill chunks: a pass is budgeted in cost, a token at position p costs 1 + p/K", "[chunks]") {
  CHECK(pd::chunk_cost(0, 10, 0) == 10);
  CHECK(pd::chunk_cost(1000, 10, 0) == 10);
  CHECK(pd::chunk_cost(0, 4, 2) == Approx(4 + (0 + 1 + 2 + 3) / 2.0));
  CHECK(pd::chunk_cost(512, 256, 512) == Approx(256 + (256 * 512 + 256 * 255 / 2.0) / 512));
  const ChunkPolicy policy{2048, 256, 16, 512};
  struct Case { const char* what; std::vector<PrefillCandidate> c; std::vector<std::pair<uint64_t, int64_t>> want; };
  const std::vector<Case> table{
      // 1 + p/512 per token: from position 0, 212 tokens cost 255.7 and 213 cost 257.1.
      {"the first chunk of a long prompt", {{1, 4000, 0}}, {{1, 212}}},
      // at position 3584 a token costs 8 and more: 31 tokens cost 248.9, 32 cost 257.0
      {"late in a long prompt a chunk holds fewer tokens", {{1, 416, 3584}}, {{1, 31}}},
      {"the first prompt advances at least kMinChunkTokens", {{1, 4000, 60000}}, {{1, pd::kMinChunkTokens}}},
      {"a short prompt late in its context is long by cost", {{1, 100, 3000}, {2, 50, 0}}, {{1, 37}, {2, 50}}},
      {"a second long one waits, a short overtakes", {{1, 4000, 0}, {2, 4000, 0}, {3, 40, 0}}, {{1, 212}, {3, 40}}},
  };
  for (const Case& t : table) {
    INFO(t.what);
    CHECK(pairs(plan_prefill_chunks(t.c, policy)) == t.want);
  }
  // Every pass of a lone 8,000-token prompt costs at most the chunk (bar the
  // minimum chunk), so passes take about as long late in the prompt as early.
  int64_t done = 0, passes = 0;
  while (done < 8000) {
    const auto pass = plan_prefill_chunks(std::vector<PrefillCandidate>{{1, 8000 - done, done}}, policy);
    REQUIRE(pass.size() == 1);
    const double cost = pd::chunk_cost(done, pass[0].tokens, 512);
    if (pass[0].tokens > pd::kMinChunkTokens) CHECK(cost <= 256);
    if (8000 - done > pass[0].tokens) CHECK(cost > 256 - 20);  // not much left on the table
    done += pass[0].tokens;
    ++passes;
  }
  CHECK(passes > 8000 / 212);
}

TEST_CASE("prefill chunks: a colocated step's prompt budget", "[chunks]") {
  CHECK(pd::colocated_prompt_budget(512, 0) == 512);
  CHECK(pd::colocated_prompt_budget(512, 12) == 500);
  CHECK(pd::colocated_prompt_budget(512, 500) == 128);  // never under a quarter of the step
  CHECK(pd::colocated_prompt_budget(2, 64) == 1);
}

// Simulated passes with arrivals: every prompt finishes; a short prompt that
// arrives behind a long one finishes within two passes of arriving; long
// prompts finish in arrival order.
TEST_CASE("prefill chunks: no starvation, shorts wait about one chunk", "[chunks]") {
  struct Prompt { uint64_t id; int64_t len; int arrives; };
  std::vector<Prompt> prompts;
  uint64_t next = 1;
  for (int pass = 0; pass < 60; ++pass) {
    if (pass % 7 == 0) prompts.push_back({next++, 3000 + 97 * pass, pass});  // long
    if (pass % 2 == 1) prompts.push_back({next++, 40 + pass, pass});          // short
  }
  std::map<uint64_t, int64_t> left;
  std::map<uint64_t, int> finished;
  std::vector<uint64_t> order;  // arrival order of arrived, unfinished prompts
  for (int pass = 0; pass < 400 && finished.size() < prompts.size(); ++pass) {
    for (const Prompt& p : prompts)
      if (p.arrives == pass) {
        left[p.id] = p.len;
        order.push_back(p.id);
      }
    std::vector<PrefillCandidate> cands;
    for (uint64_t id : order) cands.push_back({id, left[id]});
    for (const PrefillChunk& c : plan_prefill_chunks(cands, ChunkPolicy{2048, 512, 16, 0})) {
      REQUIRE(c.tokens > 0);
      REQUIRE(c.tokens <= left[c.id]);
      if ((left[c.id] -= c.tokens) == 0) {
        finished[c.id] = pass;
        std::erase(order, c.id);
      }
    }
  }
  REQUIRE(finished.size() == prompts.size());
  int last_long_finish = -1;
  for (const Prompt& p : prompts) {
    INFO("prompt " << p.id << " of " << p.len << " tokens arrived at pass " << p.arrives);
    if (p.len <= 512) {
      CHECK(finished[p.id] - p.arrives <= 1);
    } else {
      CHECK(finished[p.id] > last_long_finish);  // longs finish in arrival order
      last_long_finish = finished[p.id];
    }
  }
}
