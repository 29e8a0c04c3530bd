// PromptPass (worker/prompt_pass.h) against a block manager alone, no model:
// placing a prompt chunk by chunk with prefix reuse, the chunks it hands the
// model and the logits rows they return, prompt logprobs gathered over
// chunks, and token 1 with its event (cached tokens, timings).
#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <numeric>

#include "worker/prompt_pass.h"

namespace pd::test::prompt_pass {
namespace {

constexpr int kBlock = 4;
constexpr int64_t kVocab = 8;
const auto kT0 = std::chrono::steady_clock::time_point(std::chrono::hours(1));

KvBlockManager pool(int64_t blocks = 16) {
  KvBlockManagerConfig c;
  c.block_size = kBlock;
  c.num_blocks = blocks;
  c.enable_prefix_sharing = true;
  return KvBlockManager(c);
}

std::vector<int32_t> prompt_of(int n, int first = 1) {
  std::vector<int32_t> p(static_cast<size_t>(n));
  std::iota(p.begin(), p.end(), first);
  for (int32_t& t : p) t %= kVocab;
  return p;
}

// Logits rows that make token `t` the argmax of every row.
std::vector<float> rows_favouring(size_t n_rows, int32_t t) {
  std::vector<float> rows(n_rows * kVocab, 0.f);
  for (size_t r = 0; r < n_rows; ++r) rows[r * kVocab + static_cast<size_t>(t)] = 5.f;
  return rows;
}

SamplingParams greedy() {
  SamplingParams sp;
  sp.temperature = 0;
  sp.max_tokens = 4;
  sp.ignore_eos = true;
  return sp;
}

PromptPass::Options options(int64_t target, bool logprobs = false, bool publish = true) {
  return {.target = target, .first_token = true, .prompt_logprobs = logprobs, .top_logprobs = logprobs ? 1 : -1,
          .publish = publish};
}

TEST_CASE("prompt pass: chunk by chunk, each chunk starts where the last ended, token 1 after the last") {
  KvBlockManager blocks = pool();
  const std::vector<int32_t> prompt = prompt_of(10);
  PromptPass p(7, options(10));
  REQUIRE(p.place(blocks, prompt, 4).is_ok());
  CHECK(p.placed());
  CHECK(p.computed() == 0);
  CHECK(p.cached() == 0);
  p.start(kT0 + std::chrono::seconds(1));
  std::vector<int32_t> table = {0};
  SequenceBatch sb = p.chunk(prompt, 4, table);
  CHECK(sb.start_pos == 0);
  CHECK(sb.tokens.size() == 4);
  CHECK_FALSE(sb.want_logits);  // not the last chunk
  CHECK(p.rows(4) == 0);
  p.chunk_done(prompt, 4, {}, kVocab);
  CHECK(p.computed() == 4);
  CHECK_FALSE(p.done());
  REQUIRE(p.place(blocks, prompt, 10).is_ok());
  CHECK(p.placed_end() == 10);
  sb = p.chunk(prompt, 10, table);
  CHECK(sb.start_pos == 4);
  CHECK(sb.tokens.size() == 6);
  CHECK(sb.want_logits);
  CHECK_FALSE(sb.all_logits);
  REQUIRE(p.rows(10) == 1);
  std::vector<float> rows = rows_favouring(1, 3);
  p.chunk_done(prompt, 10, rows, kVocab);
  CHECK(p.done());
  Sampler sampler(greedy());
  std::vector<float> scratch;
  proto::TokenEvent ev = p.first_token(sampler, prompt, std::span<float>(rows).last(kVocab), -1, scratch);
  CHECK(ev.id == 7);
  CHECK(ev.first_index == 0);
  REQUIRE(ev.tokens.size() == 1);
  CHECK(ev.tokens[0] == 3);
  CHECK(ev.cached_tokens == 0);
  CHECK(ev.prompt_logprobs.empty());
  p.stamp(ev, kT0, kT0 + std::chrono::seconds(3));
  CHECK(ev.queue_s == Approx(1.0));
  CHECK(ev.prefill_s == Approx(2.0));
}

TEST_CASE("prompt pass: a prompt sharing a computed prefix reuses its blocks, unless prompt logprobs want every row") {
  KvBlockManager blocks = pool();
  const std::vector<int32_t> prompt = prompt_of(10);
  PromptPass first(1, options(10));
  REQUIRE(first.place(blocks, prompt, 10).is_ok());  // published as placed: the pass writes them next
  REQUIRE(blocks.free(SeqId{1}).is_ok());             // its KV stays in the prefix cache
  PromptPass reuse(2, options(10));
  REQUIRE(reuse.place(blocks, prompt, 10).is_ok());
  CHECK(reuse.cached() == 8);  // two full blocks
  CHECK(reuse.computed() == 8);
  CHECK(reuse.chunk(prompt, 10, {}).start_pos == 8);
  PromptPass every_row(3, options(10, /*logprobs=*/true));
  REQUIRE(every_row.place(blocks, prompt, 10).is_ok());
  CHECK(every_row.cached() == 0);
  CHECK(every_row.rows(10) == 10);
  CHECK(every_row.chunk(prompt, 10, {}).all_logits);
}

TEST_CASE("prompt pass: unpublished blocks are not reused until the worker publishes them") {
  KvBlockManager blocks = pool();
  const std::vector<int32_t> prompt = prompt_of(10);
  PromptPass p(1, options(10, false, /*publish=*/false));
  REQUIRE(p.place(blocks, prompt, 10).is_ok());
  CHECK(blocks.cached_prefix_tokens(prompt) == 0);
  REQUIRE(blocks.publish(SeqId{1}).is_ok());
  CHECK(blocks.cached_prefix_tokens(prompt) == 8);
}

TEST_CASE("prompt pass: prompt logprobs are gathered over the chunks and go with token 1") {
  KvBlockManager blocks = pool();
  const std::vector<int32_t> prompt = prompt_of(6);
  PromptPass p(4, options(6, /*logprobs=*/true));
  REQUIRE(p.place(blocks, prompt, 3).is_ok());
  REQUIRE(p.rows(3) == 3);
  std::vector<float> a = rows_favouring(3, 2);
  p.chunk_done(prompt, 3, a, kVocab);
  REQUIRE(p.place(blocks, prompt, 6).is_ok());
  REQUIRE(p.rows(6) == 3);
  std::vector<float> b = rows_favouring(3, 5);
  p.chunk_done(prompt, 6, b, kVocab);
  Sampler sampler(greedy());
  std::vector<float> scratch;
  proto::TokenEvent ev = p.first_token(sampler, prompt, std::span<float>(b).last(kVocab), -1, scratch);
  CHECK(ev.tokens[0] == 5);
  CHECK(ev.prompt_logprobs.size() == 5);  // every prompt token but the first
}

TEST_CASE("prompt pass: a failed placement changes nothing, a recompute wants no rows") {
  KvBlockManager blocks = pool(2);
  const std::vector<int32_t> prompt = prompt_of(12);
  PromptPass p(9, options(12));
  CHECK_FALSE(p.place(blocks, prompt, 12).is_ok());  // 3 blocks, 2 in the pool
  CHECK_FALSE(p.placed());
  CHECK(blocks.num_free_blocks() == 2);
  PromptPass again(9, {.target = 5, .first_token = false});  // a preempted sequence's KV, no token 1
  REQUIRE(again.place(blocks, prompt, 5).is_ok());
  CHECK(again.rows(5) == 0);
  CHECK_FALSE(again.chunk(prompt, 5, {}).want_logits);
}

}  // namespace
}  // namespace pd::test::prompt_pass
