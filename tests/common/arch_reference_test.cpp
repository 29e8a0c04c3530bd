// The forward pass of each supported architecture and weight type against
// independent implementations, on small random-weight GGUF files made by
// llama.cpp's converter and llama-quantize (tests/data/arch/, made by
// scripts/make_arch_reference.py; its README says how and why these bounds).
//
//  - Architecture files (Llama 3 with its RoPE scaling, Qwen2, Qwen3, Gemma 3;
//    Q8_0 weights that hold transformers' weights exactly): every position's
//    logits of two prompts against transformers' fp32 logits, on the fp32 path
//    (max |diff| <= kLogitAbsTol) and the default int8 path (KL bounds).
//  - Quant-type files (one plain Llama model as Q4_K_M, Q5_K_M, Q6_K, Q5_0, Q5_1):
//    the same against transformers run on the file's weights dequantized by
//    gguf-py, and both paths against llama.cpp's logits on the file.
//  - A Gemma 2 file and a Q2_K file (written here by our own GGUF writer) are
//    refused with messages naming them.
//
// These fail, not skip, where an architecture or type is not implemented yet.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "gguf/gguf_reader.h"
#include "gguf/gguf_writer.h"
#include "model/llama_model.h"
#include "test_support.h"

// Named, not anonymous: the unit tests are a unity build, and other files'
// anonymous namespaces hold helpers of the same names.
namespace archref {

// fp32 activations against the weights as stored: the same arithmetic as the
// reference up to fp32 summation order (tests/data/reference/README.md: 1e-3;
// measured here up to 8e-5).
constexpr float kLogitAbsTol = 1e-3f;

// int8 activations (the default path), per file: KL(ref || ours) of the
// next-token distribution at every position and its mean over the file, the
// largest logit difference, and the same argmax wherever the reference's top-2
// gap is clear. The floors are tests/model/model_reference_test.cpp's bounds
// (KL 0.01 at a position, max |diff| 1.0, near-tie gap 0.15) and the
// perplexity test's mean KL 0.004. These random models are harder on 8-bit
// activations than a trained one: llama.cpp's own int8 path, measured by the
// script on each file against the same exact reference (arch.json,
// "llamacpp_vs_transformers"), reaches 0.04 KL at single positions of the Q8_0
// files and 0.1 on the K-quant ones. Where it does, the bound is that
// measurement scaled (our int8 path is about half llama.cpp's error:
// docs/ACCURACY.md), so the bound says "no worse than llama.cpp on this file".
constexpr double kInt8MaxKlFloor = 0.01, kInt8MaxKlVsLlamaCpp = 2.0;
constexpr double kInt8MeanKlFloor = 0.004, kInt8MeanKlVsLlamaCpp = 1.5;
constexpr float kInt8LogitAbsTolFloor = 1.0f, kInt8LogitAbsVsLlamaCpp = 2.0f;
// argmax compared where the reference's top-2 gap is at least this, or
// llama.cpp's largest logit error on the file if larger (a gap below that is
// one llama.cpp's own rounding flips: measured flips at gaps up to 0.97).
constexpr float kInt8NearTieGapFloor = 0.15f;

// Against llama.cpp's logits on the same file (quant-type files), either path:
// the difference is mostly llama.cpp's own int8 error, so the bounds are its
// measured distance from the exact reference, doubled, plus the floors above.
// The argmax must agree where llama.cpp's top-2 gap is at least
// kVsLlamaCppNearTieGap: its own flips against the exact reference came at
// its gaps up to 0.25.
constexpr float kVsLlamaCppNearTieGap = 0.75f;

const std::string& data_dir() {
  static const std::string d = pd::test::test_data_dir() + "/arch/";
  return d;
}

const nlohmann::json& arch_index() {
  static const nlohmann::json j = [] {
    std::ifstream in(data_dir() + "arch.json");
    REQUIRE(in.good());
    return nlohmann::json::parse(in);
  }();
  return j;
}

const nlohmann::json& entry(const char* list, const std::string& name) {
  for (const auto& e : arch_index().at(list))
    if (e.at("name").get<std::string>() == name) return e;
  FAIL("no entry " << name << " in arch.json's " << list);
  throw std::logic_error("unreachable");
}

std::vector<float> read_f32(const std::string& file) {
  std::ifstream in(data_dir() + file, std::ios::binary);
  INFO(data_dir() + file);
  REQUIRE(in.good());
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<float> v(bytes.size() / sizeof(float));
  std::memcpy(v.data(), bytes.data(), v.size() * sizeof(float));
  return v;
}

enum class Path { kFp32, kInt8 };
const char* path_name(Path p) { return p == Path::kFp32 ? "fp32 activations" : "int8 activations"; }

// Loads `file` on a one-thread CPU backend; the status of the first step that
// fails (open, then model load).
struct Loaded {
  pd::Status status = pd::Status::ok();
  std::shared_ptr<const pd::GgufFile> file;
  std::unique_ptr<pd::Backend> backend;
  std::unique_ptr<pd::LlamaModel> model;
};

// The model in `f` (a file, or bytes) on a one-thread CPU backend taking `path`.
Loaded load(pd::Result<std::unique_ptr<pd::GgufFile>> f, Path path) {
  Loaded x;
  if (!f.is_ok()) {
    x.status = f.status();
    return x;
  }
  x.file = std::move(f).value();
  pd::BackendConfig bc;
  bc.n_threads = 1;
  bc.int8_activations = path == Path::kInt8;
  auto b = pd::create_backend(bc);
  REQUIRE(b.is_ok());
  x.backend = std::move(b).value();
  auto m = pd::LlamaModel::load(x.file, *x.backend);
  if (!m.is_ok()) {
    x.status = m.status();
    return x;
  }
  x.model = std::move(m).value();
  return x;
}
Loaded load(const std::string& file, Path path) { return load(pd::GgufFile::open(data_dir() + file), path); }

// Every position's logits of each prompt, prompt after prompt, each prompt a
// fresh sequence prefilled in one pass (blocks of 16, so a 36-token prompt
// spans three blocks).
std::vector<float> all_logits(pd::LlamaModel& model, pd::Backend& backend, const nlohmann::json& prompts) {
  std::vector<float> out;
  for (const auto& p : prompts) {
    const std::vector<pd::TokenId> ids = p.get<std::vector<pd::TokenId>>();
    const int64_t n_blocks = (static_cast<int64_t>(ids.size()) + 15) / 16;
    auto cache = pd::KvCache::create(backend, model.config(), 16, n_blocks, pd::GgmlType::kF32);
    INFO(cache.status().to_string());
    REQUIRE(cache.is_ok());
    std::vector<int32_t> table(n_blocks);
    for (int64_t b = 0; b < n_blocks; ++b) table[b] = static_cast<int32_t>(n_blocks - 1 - b);  // scattered
    pd::SequenceBatch sb{ids, 0, table, true, true};
    std::vector<float> got;
    const pd::Status st = model.prefill(std::span<const pd::SequenceBatch>(&sb, 1), *cache, &got);
    INFO(st.to_string());
    REQUIRE(st.is_ok());
    REQUIRE(got.size() == ids.size() * static_cast<size_t>(model.config().vocab));
    out.insert(out.end(), got.begin(), got.end());
  }
  return out;
}

// Per-position comparison of `got` with `want` (rows of `vocab`).
struct Stats {
  float max_abs = 0.0f;
  double max_kl = 0.0, mean_kl = 0.0;
  int positions = 0, argmax_checked = 0, argmax_same = 0;
  std::vector<std::string> argmax_failures;  // positions where a clear argmax differs
};

double kl_row(const float* want, const float* got, int vocab) {
  const double mw = *std::max_element(want, want + vocab), mg = *std::max_element(got, got + vocab);
  double zw = 0.0, zg = 0.0;
  for (int i = 0; i < vocab; ++i) zw += std::exp(want[i] - mw), zg += std::exp(got[i] - mg);
  double kl = 0.0;
  for (int i = 0; i < vocab; ++i) {
    const double lw = want[i] - mw - std::log(zw), lg = got[i] - mg - std::log(zg);
    kl += std::exp(lw) * (lw - lg);
  }
  return std::max(kl, 0.0);
}

Stats compare(const std::vector<float>& want, const std::vector<float>& got, int vocab, float near_tie) {
  REQUIRE(want.size() == got.size());
  Stats s;
  s.positions = static_cast<int>(want.size() / vocab);
  for (int p = 0; p < s.positions; ++p) {
    const float* w = want.data() + static_cast<size_t>(p) * vocab;
    const float* g = got.data() + static_cast<size_t>(p) * vocab;
    for (int i = 0; i < vocab; ++i) s.max_abs = std::max(s.max_abs, std::fabs(w[i] - g[i]));
    const double kl = kl_row(w, g, vocab);
    s.max_kl = std::max(s.max_kl, kl);
    s.mean_kl += kl / s.positions;
    const int aw = static_cast<int>(std::max_element(w, w + vocab) - w);
    const int ag = static_cast<int>(std::max_element(g, g + vocab) - g);
    float second = -INFINITY;
    for (int i = 0; i < vocab; ++i)
      if (i != aw) second = std::max(second, w[i]);
    if (w[aw] - second >= near_tie) {
      ++s.argmax_checked;
      if (aw == ag) {
        ++s.argmax_same;
      } else {
        s.argmax_failures.push_back("position " + std::to_string(p) + ": reference " + std::to_string(aw) +
                                    " (gap " + std::to_string(w[aw] - second) + "), ours " + std::to_string(ag));
      }
    }
  }
  return s;
}

void report(const std::string& what, const Stats& s) {
  std::printf("%s: %d positions, max |diff| %.5f, KL max %.2e mean %.2e, argmax same %d of %d checked\n",
              what.c_str(), s.positions, s.max_abs, s.max_kl, s.mean_kl, s.argmax_same, s.argmax_checked);
}

void check_argmax(const Stats& s) {
  std::string failures;
  for (const auto& f : s.argmax_failures) failures += f + "\n";
  INFO(failures);
  CHECK(s.argmax_failures.empty());
  // The check must not be vacuous: a good share of positions have a clear top token.
  CHECK(s.argmax_checked * 3 > s.positions);
}

// Our logits on `e`'s file, on `path`, against transformers' stored logits
// (and llama.cpp's where the entry has them).
void check_against_references(const nlohmann::json& e, Path path) {
  const std::string name = e.at("name").get<std::string>();
  Loaded x = load(e.at("file").get<std::string>(), path);
  INFO(name << " (" << path_name(path) << "): " << x.status.to_string());
  REQUIRE(x.status.is_ok());
  const int vocab = e.at("vocab").get<int>();
  REQUIRE(x.model->config().vocab == vocab);
  const std::vector<float> got = all_logits(*x.model, *x.backend, e.at("prompts"));

  // llama.cpp's int8 path against the same reference, measured by the script.
  const nlohmann::json& lc = e.at("llamacpp_vs_transformers");
  const double lc_max_kl = lc.at("max_kl").get<double>(), lc_mean_kl = lc.at("mean_kl").get<double>();
  const float lc_max_abs = lc.at("max_abs_diff").get<float>();

  const std::vector<float> ref = read_f32(e.at("transformers").at("file").get<std::string>());
  const bool fp32 = path == Path::kFp32;
  const float near_tie = fp32 ? 2 * kLogitAbsTol : std::max(kInt8NearTieGapFloor, lc_max_abs);
  const Stats s = compare(ref, got, vocab, near_tie);
  report(name + " vs transformers, " + path_name(path), s);
  if (fp32) {
    CHECK(s.max_abs <= kLogitAbsTol);
  } else {
    const double max_kl = std::max(kInt8MaxKlFloor, kInt8MaxKlVsLlamaCpp * lc_max_kl);
    const double mean_kl = std::max(kInt8MeanKlFloor, kInt8MeanKlVsLlamaCpp * lc_mean_kl);
    const float max_abs = std::max(kInt8LogitAbsTolFloor, kInt8LogitAbsVsLlamaCpp * lc_max_abs);
    INFO("bounds: KL max " << max_kl << ", mean " << mean_kl << ", |diff| " << max_abs << ", argmax where gap >= "
                           << near_tie << " (llama.cpp on this file: KL max " << lc_max_kl << ", mean " << lc_mean_kl
                           << ", |diff| " << lc_max_abs << ")");
    CHECK(s.max_abs <= max_abs);
    CHECK(s.max_kl <= max_kl);
    CHECK(s.mean_kl <= mean_kl);
  }
  check_argmax(s);

  if (e.contains("llamacpp")) {
    const std::vector<float> lcl = read_f32(e.at("llamacpp").at("file").get<std::string>());
    const Stats l = compare(lcl, got, vocab, kVsLlamaCppNearTieGap);
    report(name + " vs llama.cpp, " + path_name(path), l);
    const double max_kl = kInt8MaxKlFloor + 2 * lc_max_kl, mean_kl = kInt8MeanKlFloor + 2 * lc_mean_kl;
    INFO("bounds: KL max " << max_kl << ", mean " << mean_kl);
    CHECK(l.max_kl <= max_kl);
    CHECK(l.mean_kl <= mean_kl);
    check_argmax(l);
  }
}

void check_model(const std::string& name) {
  const nlohmann::json& e = entry("models", name);
  for (Path path : {Path::kFp32, Path::kInt8}) check_against_references(e, path);
}

// The quant-type file holds the tensor types it is meant to exercise (read by
// our reader: a regenerated file whose types changed fails here, not silently).
void check_quant(const std::string& name) {
  const nlohmann::json& e = entry("quant", name);
  {
    auto f = pd::GgufFile::open(data_dir() + e.at("file").get<std::string>());
    INFO(f.status().to_string());
    REQUIRE(f.is_ok());
    std::set<std::string> types;
    for (const auto& t : (*f)->tensors()) types.insert(pd::ggml_type_name(t.type));
    for (const auto& want : e.at("must_contain")) {
      INFO(name << " must hold " << want.get<std::string>() << " tensors");
      CHECK(types.count(want.get<std::string>()) == 1);
    }
  }
  for (Path path : {Path::kFp32, Path::kInt8}) check_against_references(e, path);
}

// A file that must be refused, written here by our own GGUF writer (no weights
// are read before the refusal: it is on the architecture's name, or on a
// tensor's type in the file's table): loading it fails as Unsupported, on both
// activation paths, with a message naming `must_mention`.
void check_refused(const std::string& name, const std::vector<uint8_t>& bytes, const std::string& must_mention) {
  for (Path path : {Path::kFp32, Path::kInt8}) {
    const Loaded x = load(pd::GgufFile::from_bytes(bytes, name), path);
    INFO(name << ": " << x.status.to_string());
    REQUIRE(!x.status.is_ok());
    CHECK(x.status.is_unsupported());
    CHECK(x.status.message().find(must_mention) != std::string::npos);
  }
}

}  // namespace archref

using archref::check_model;
using archref::check_quant;
using archref::check_refused;

TEST_CASE("arch reference: llama3 (RoPE scaling) matches transformers", "[arch][reference]") { check_model("llama3"); }
TEST_CASE("arch reference: qwen2 matches transformers", "[arch][reference]") { check_model("qwen2"); }
TEST_CASE("arch reference: qwen3 matches transformers", "[arch][reference]") { check_model("qwen3"); }
TEST_CASE("arch reference: gemma3 matches transformers", "[arch][reference]") { check_model("gemma3"); }

TEST_CASE("arch reference: Q4_K_M file matches transformers and llama.cpp", "[arch][reference][kquant]") {
  check_quant("llama-quant.q4_k_m");
}
TEST_CASE("arch reference: Q5_K_M file matches transformers and llama.cpp", "[arch][reference][kquant]") {
  check_quant("llama-quant.q5_k_m");
}
TEST_CASE("arch reference: Q6_K file matches transformers and llama.cpp", "[arch][reference][kquant]") {
  check_quant("llama-quant.q6_k");
}
TEST_CASE("arch reference: Q5_0 file matches transformers and llama.cpp", "[arch][reference]") {
  check_quant("llama-quant.q5_0");
}
TEST_CASE("arch reference: Q5_1 file matches transformers and llama.cpp", "[arch][reference]") {
  check_quant("llama-quant.q5_1");
}

TEST_CASE("arch reference: a gemma2 file is refused naming the architecture", "[arch][refuse]") {
  pd::GgufWriter w;
  w.set_string("general.architecture", "gemma2");
  w.add_tensor("token_embd.weight", {32, 8}, pd::GgmlType::kF32, std::vector<float>(32 * 8, 0.5f));
  check_refused("gemma2.gguf", w.to_bytes(), "gemma2");
}
TEST_CASE("arch reference: a Q2_K file is refused naming the type", "[arch][refuse]") {
  pd::GgufWriter w;
  w.set_string("general.architecture", "llama");
  const std::string name = "blk.0.attn_q.weight";
  w.add_tensor(name, {256, 2}, pd::GgmlType::kQ8_0, std::vector<float>(512, 0.25f));
  std::vector<uint8_t> bytes = w.to_bytes();
  // Its entry in the tensor table: the name, 2 dimensions (u32 count, u64 each),
  // then the u32 type, set to ggml's Q2_K (10), which our writer does not write.
  const auto at = std::search(bytes.begin(), bytes.end(), name.begin(), name.end());
  REQUIRE(at != bytes.end());
  const size_t type_at = static_cast<size_t>(at - bytes.begin()) + name.size() + 4 + 2 * 8;
  const uint32_t q2_k = 10;
  std::memcpy(bytes.data() + type_at, &q2_k, sizeof q2_k);
  check_refused("llama-q2_k.gguf", bytes, "Q2_K");
}
