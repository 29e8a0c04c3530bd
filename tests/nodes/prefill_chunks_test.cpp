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
      {"a short prompt is cut to the budget left", 600, 512, 16, {{1, 4000}, {2, 300}}, {{1, 512}, {2, 88}}},
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
    const auto got = plan_prefill_chunks(r.candidates, ChunkPolicy{r.budget, r.chunk, r.max_prompts});
    CHECK(pairs(got) == r.expected);
  }
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
    for (const PrefillChunk& c : plan_prefill_chunks(cands, ChunkPolicy{2048, 512, 16})) {
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
