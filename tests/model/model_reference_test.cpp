// The engine against Hugging Face transformers on the default model.
//
// Reference data: tests/data/reference/{logits.json, logits_*.f32, greedy.json},
// made by scripts/make_reference.py (transformers loads the same GGUF,
// dequantizes it to fp32 and runs its own Llama implementation).
//
// Both CPU matmul paths are checked. Tolerances (tests/data/reference/README.md):
//  - last-position logits: max |ours - ref| <= kLogitAbsTol (fp32 activations)
//    or kInt8LogitAbsTol plus KL <= kInt8MaxKl (int8 activations); same argmax.
//  - greedy continuations: identical token for token; where one diverges the
//    reference's top-2 logit gap at that step must be below kNearTieGap /
//    kInt8NearTieGap (a near-tie the path's rounding may legitimately flip).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "backend/backend.h"
#include "gguf/gguf_reader.h"
#include "model/generate.h"
#include "model/llama_model.h"
#include "test_support.h"
#include "tokenizer/tokenizer.h"

namespace {

// fp32-activation path (exact arithmetic up to fp32 rounding order).
constexpr float kLogitAbsTol = 1e-3f;  // measured: <= 5e-5 on the CPU backend
constexpr float kNearTieGap = 0.05f;
// int8-activation path (the default: 8 bits per 32-block as llama.cpp, with
// two 8-bit passes for Q/K/V and the LM head, CpuBackendConfig::
// int8x2_matmul_kinds) moves logits by up to ~0.6 (measured max 0.60, mean
// 0.06-0.19). Checked as a distribution instead: KL(ref || ours) of the
// next-token softmax, the same argmax, and greedy divergences only where the
// reference's top-2 gap is small.
// One position's KL moves with any rounding change upstream (an int8 rounding
// flips and propagates): the short capital_france prompt measured 5.7e-4,
// 1.2e-3 and 6.6e-3 on builds and ISA paths that differ only in the fp32
// summation order of attention, while the mean over 5,100 positions stayed
// 0.00121 (docs/ACCURACY.md). So this bound only catches a broken path; the
// path's accuracy is bounded over many positions by perplexity_test.cpp.
constexpr double kInt8MaxKl = 0.01;  // measured 5.0e-4 to 6.6e-3 (llama.cpp's p99 over the text: 0.0115)
constexpr float kInt8LogitAbsTol = 1.0f;  // measured up to 0.60 (plain int8: 1.0)
// A greedy continuation may leave the reference's only at a step whose top-2
// gap is below this. Measured: the 6 of 14 continuations that diverge do so
// at gaps 0.0002, 0.016, 0.048, 0.069, 0.082 and 0.089 (the largest,
// chat_one_word_system step 5); 0.15 is about 1.7x that. Plain 8-bit
// activations everywhere diverged at gaps up to 0.29, which this threshold
// fails: it catches a path losing its second passes
// (tests/data/reference/README.md).
constexpr float kInt8NearTieGap = 0.15f;

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  REQUIRE(in.good());
  return nlohmann::json::parse(in);
}

std::vector<float> read_f32(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<float> v(bytes.size() / sizeof(float));
  std::memcpy(v.data(), bytes.data(), v.size() * sizeof(float));
  return v;
}

struct Engine {
  std::shared_ptr<const pd::GgufFile> file;
  std::unique_ptr<pd::Backend> backend;
  std::unique_ptr<pd::LlamaModel> model;
  std::unique_ptr<pd::Tokenizer> tok;
};

// The CPU engine on one of its two matmul paths: fp32 activations against the
// weights as stored (the reference path), or 8-bit activations with integer
// dot products (the fast path, the default everywhere else).
enum class Path { kFp32, kInt8 };
const char* path_name(Path p) { return p == Path::kFp32 ? "fp32 activations" : "int8 activations"; }

Engine load_engine(Path path) {
  Engine x;
  auto f = pd::GgufFile::open(pd::test::default_model_path());
  REQUIRE(f.is_ok());
  x.file = std::move(f).value();
  pd::BackendConfig bc;
  bc.int8_activations = path == Path::kInt8;
  {
    auto b = pd::create_backend(bc);
    REQUIRE(b.is_ok());
    x.backend = std::move(b).value();
  }
  auto m = pd::LlamaModel::load(x.file, *x.backend);
  INFO(m.status().to_string());
  REQUIRE(m.is_ok());
  x.model = std::move(m).value();
  auto t = pd::Tokenizer::from_gguf(*x.file);
  REQUIRE(t.is_ok());
  x.tok = std::move(t).value();
  return x;
}

Engine& engine(Path path = Path::kInt8) {
  static Engine fp32 = load_engine(Path::kFp32);
  static Engine int8 = load_engine(Path::kInt8);
  return path == Path::kFp32 ? fp32 : int8;
}

std::vector<pd::TokenId> ids_of(const nlohmann::json& j) { return j.get<std::vector<pd::TokenId>>(); }

// Greedy generation of n tokens (EOS ignored) for each prompt; batched or one at a time.
std::vector<std::vector<pd::TokenId>> greedy(const std::vector<std::vector<pd::TokenId>>& prompts, int n,
                                             bool one_at_a_time, Path path = Path::kInt8, int speculate = 0,
                                             pd::GenerateStats* stats = nullptr, float temperature = 0.0f) {
  Engine& e = engine(path);
  const int block_size = 16;
  int64_t blocks_needed = 0;
  for (const auto& p : prompts) blocks_needed += (static_cast<int64_t>(p.size()) + n + block_size - 1) / block_size + 1;
  auto cache = pd::KvCache::create(*e.backend, e.model->config(), block_size, blocks_needed, pd::GgmlType::kF32);
  REQUIRE(cache.is_ok());
  pd::KvBlockManager blocks(pd::KvBlockManagerConfig{block_size, blocks_needed, true});
  std::vector<pd::GenerateRequest> reqs(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    reqs[i].prompt = prompts[i];
    reqs[i].sampling.max_tokens = n;
    reqs[i].sampling.ignore_eos = true;
    reqs[i].sampling.temperature = temperature;
    reqs[i].sampling.seed = 11 + i;
  }
  pd::GenerateOptions opt;
  opt.eos_id = e.tok->eos_id();
  opt.one_at_a_time = one_at_a_time;
  opt.speculation.max_draft = speculate;
  auto out = pd::generate(*e.model, *cache, blocks, reqs, opt, stats);
  INFO(out.status().to_string());
  REQUIRE(out.is_ok());
  REQUIRE(blocks.num_free_blocks() == blocks.num_blocks());
  std::vector<std::vector<pd::TokenId>> r;
  for (auto& g : *out) r.push_back(g.tokens);
  return r;
}

}  // namespace

TEST_CASE("last-position logits match transformers", "[model][reference]") {
  pd::test::require_default_model();
  const std::string dir = pd::test::test_data_dir() + "/reference/";
  const nlohmann::json ref = read_json(dir + "logits.json");
  for (Path path : {Path::kFp32, Path::kInt8}) {
    Engine& e = engine(path);
    const int vocab = e.model->config().vocab;
    REQUIRE(ref.at("vocab").get<int>() == vocab);
    REQUIRE(ref.at("cases").size() >= 3);
    for (const auto& c : ref.at("cases")) {
      const std::string name = c.at("name").get<std::string>();
      const std::vector<pd::TokenId> ids = ids_of(c.at("ids"));
      const std::vector<float> want = read_f32(dir + c.at("file").get<std::string>());
      REQUIRE(static_cast<int>(want.size()) == vocab);

      const int64_t n_blocks = (static_cast<int64_t>(ids.size()) + 15) / 16;
      auto cache = pd::KvCache::create(*e.backend, e.model->config(), 16, n_blocks, pd::GgmlType::kF32);
      REQUIRE(cache.is_ok());
      std::vector<int32_t> table(n_blocks);
      for (int64_t b = 0; b < n_blocks; ++b) table[b] = static_cast<int32_t>(n_blocks - 1 - b);  // scattered
      pd::SequenceBatch sb{ids, 0, table, true};
      std::vector<float> got;
      auto st = e.model->prefill(std::span<const pd::SequenceBatch>(&sb, 1), *cache, &got);
      INFO(st.to_string());
      REQUIRE(st.is_ok());
      REQUIRE(static_cast<int>(got.size()) == vocab);

      float max_diff = 0.0f;
      double sum_diff = 0.0;
      for (int i = 0; i < vocab; ++i) {
        const float d = std::fabs(got[i] - want[i]);
        max_diff = std::max(max_diff, d);
        sum_diff += d;
      }
      // KL(ref || ours) of the softmax distributions, in nats.
      const double mw = *std::max_element(want.begin(), want.end()), mg = *std::max_element(got.begin(), got.end());
      double zw = 0.0, zg = 0.0;
      for (int i = 0; i < vocab; ++i) zw += std::exp(want[i] - mw), zg += std::exp(got[i] - mg);
      double kl = 0.0;
      for (int i = 0; i < vocab; ++i) {
        const double lw = want[i] - mw - std::log(zw), lg = got[i] - mg - std::log(zg);
        kl += std::exp(lw) * (lw - lg);
      }
      const float tol = path == Path::kFp32 ? kLogitAbsTol : kInt8LogitAbsTol;
      std::printf("logits[%s, %s]: %zu prompt tokens, max |diff| %.5f, mean |diff| %.6f (tolerance %.3f), KL %.2e\n",
                  name.c_str(), path_name(path), ids.size(), max_diff, sum_diff / vocab, tol, kl);
      INFO("case " << name << " (" << path_name(path) << "): max |diff| " << max_diff << ", KL " << kl);
      CHECK(max_diff <= tol);
      if (path == Path::kInt8) CHECK(kl <= kInt8MaxKl);
      CHECK(pd::argmax(got) == c.at("argmax").get<pd::TokenId>());
    }
  }
}

TEST_CASE("greedy continuations match transformers token for token", "[model][reference]") {
  pd::test::require_default_model();
  const nlohmann::json ref = read_json(pd::test::test_data_dir() + "/reference/greedy.json");
  const int n = ref.at("n_tokens").get<int>();
  REQUIRE(ref.at("cases").size() >= 8);
  std::vector<std::vector<pd::TokenId>> prompts;
  for (const auto& c : ref.at("cases")) prompts.push_back(ids_of(c.at("prompt_ids")));
  for (Path path : {Path::kFp32, Path::kInt8}) {
    const auto got = greedy(prompts, n, /*one_at_a_time=*/true, path);
    const float near_tie = path == Path::kFp32 ? kNearTieGap : kInt8NearTieGap;
    int exact = 0;
    for (size_t ci = 0; ci < prompts.size(); ++ci) {
      const auto& c = ref.at("cases")[ci];
      const std::string name = c.at("name").get<std::string>();
      const std::vector<pd::TokenId> want = ids_of(c.at("output_ids"));
      const std::vector<float> gaps = c.at("top2_gap").get<std::vector<float>>();
      REQUIRE(got[ci].size() == want.size());
      // The encoded prompt must also match the reference tokenizer's.
      CHECK(engine(path).tok->encode(c.at("prompt").get<std::string>(), true) == prompts[ci]);
      size_t first_diff = want.size();
      for (size_t i = 0; i < want.size(); ++i) {
        if (got[ci][i] != want[i]) {
          first_diff = i;
          break;
        }
      }
      if (first_diff == want.size()) {
        ++exact;
        continue;
      }
      std::printf("greedy[%s, %s]: diverges at step %zu (ours %d, ref %d), ref top-2 gap there %.4f\n", name.c_str(),
                  path_name(path), first_diff, got[ci][first_diff], want[first_diff], gaps[first_diff]);
      INFO("case " << name << " (" << path_name(path) << ") diverges at step " << first_diff
                   << " where the reference's top-2 gap is " << gaps[first_diff] << " (near-tie threshold "
                   << near_tie << ")");
      CHECK(gaps[first_diff] < near_tie);
    }
    std::printf("greedy (%s): %d of %zu continuations identical to the reference over %d tokens\n", path_name(path),
                exact, prompts.size(), n);
  }
}

TEST_CASE("speculative decoding gives the tokens of plain decoding, greedy and seeded", "[model][speculation]") {
  pd::test::require_default_model();
  const nlohmann::json ref = read_json(pd::test::test_data_dir() + "/reference/greedy.json");
  std::vector<std::vector<pd::TokenId>> prompts;
  for (const auto& c : ref.at("cases")) prompts.push_back(ids_of(c.at("prompt_ids")));
  // And prompts with something to copy, so drafts are made and accepted.
  pd::Tokenizer& tok = *engine().tok;
  prompts.push_back(tok.encode("1 2 3 4 5 6 7 8 9 10 1 2 3 4 5 6 7 8 9 10 1 2 3 4 5 6 7 8 9 10 1 2 3", true));
  prompts.push_back(tok.encode("The cat sat on the mat. The dog sat on the log. The cat sat on the mat. The dog", true));
  const int n = 40;
  for (float temperature : {0.0f, 0.8f}) {
    const auto plain = greedy(prompts, n, false, Path::kInt8, 0, nullptr, temperature);
    // Batched (drafts cost nearly what a sequence's own token does there, so
    // few are made) and one sequence at a time (where drafting pays).
    for (int k : {1, 8}) {
      for (bool alone : {false, true}) {
        pd::GenerateStats stats;
        const auto spec = greedy(prompts, n, alone, Path::kInt8, k, &stats, temperature);
        for (size_t i = 0; i < prompts.size(); ++i) {
          INFO("prompt " << i << ", draft " << k << ", temperature " << temperature << (alone ? ", alone" : ""));
          CHECK(spec[i] == plain[i]);
        }
        std::printf("speculation (draft %d, temperature %.1f%s): %lld steps for %lld tokens, %lld drafted, %lld "
                    "accepted\n",
                    k, temperature, alone ? ", alone" : "", static_cast<long long>(stats.decode_steps),
                    static_cast<long long>(stats.decode_tokens), static_cast<long long>(stats.drafted_tokens),
                    static_cast<long long>(stats.accepted_tokens));
        CHECK(stats.accepted_tokens > 0);  // the copy prompts were drafted for and the drafts taken
        CHECK(stats.decode_steps < stats.decode_tokens);
        if (alone) CHECK(stats.accepted_tokens >= 20);  // at batch 1 drafting pays: many are made and taken
      }
    }
  }
}

TEST_CASE("batched prefill and decode produce the same tokens as each sequence alone", "[model][batching]") {
  pd::test::require_default_model();
  const nlohmann::json ref = read_json(pd::test::test_data_dir() + "/reference/greedy.json");
  std::vector<std::vector<pd::TokenId>> prompts;
  for (const auto& c : ref.at("cases")) prompts.push_back(ids_of(c.at("prompt_ids")));
  const int n = 24;
  const auto alone = greedy(prompts, n, true);
  const auto together = greedy(prompts, n, false);
  for (size_t i = 0; i < prompts.size(); ++i) {
    INFO("prompt " << i);
    CHECK(alone[i] == together[i]);
  }
}
