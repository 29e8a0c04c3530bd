// The architecture variants of LlamaConfig/LlamaModel (Llama 3.x RoPE
// factors and linear scaling, Qwen2, Qwen3, Gemma 3): what each reads from the
// metadata, what each refuses by name, and that every variant keeps the
// engine's guarantee that a token's logits do not depend on how its sequence
// was cut into passes or what it was batched with (Gemma 3's sliding window
// included). The numbers themselves are checked against transformers in
// tests/model/ and against llama.cpp's greedy text on the real Gemma 3 file.
//
// The tiny variants are the project's tiny Llama (make_tiny_llama_gguf) with
// the keys renamed to the architecture's and the extra tensors added.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "gguf/gguf_reader.h"
#include "gguf/gguf_writer.h"
#include "model/llama_config.h"
#include "model/llama_model.h"
#include "plan/model_spec.h"
#include "test_support.h"

// Named, not anonymous: the unit tests build as unity sources beside other files' helpers.
namespace model_arch_test {

using pd::GgmlType;
using pd::TokenId;

struct Variant {
  std::string arch = "llama";
  bool rope_factors = false;   // llama: a rope_freqs.weight
  float linear_factor = 0.0f;  // > 0: rope.scaling.type linear with this factor
  int sliding_window = 0;      // gemma3
  float rope_base = 10000.0f;
  std::string drop_tensor;     // a tensor left out
  std::string extra_tensor;    // an F32 [hidden] tensor added
  std::vector<std::pair<std::string, pd::GgufValue>> extra_keys;
};

pd::GgufValue string_value(const std::string& s) {
  pd::GgufValue v;
  v.type = pd::GgufValueType::kString;
  v.v = s;
  return v;
}

pd::GgufValue f32_value(float f) {
  pd::GgufValue v;
  v.type = pd::GgufValueType::kFloat32;
  v.v = f;
  return v;
}

pd::GgufValue u32_value(uint32_t u) {
  pd::GgufValue v;
  v.type = pd::GgufValueType::kUint32;
  v.v = u;
  return v;
}

// The tiny Llama (hidden 64, 4 heads of 16, 2 KV heads, 2 layers unless the
// spec says otherwise) as `v.arch`, with the tensors that architecture needs.
std::vector<uint8_t> tiny_variant(const Variant& v, pd::TinyLlamaSpec spec = {}) {
  if (v.arch == "gemma3") spec.n_layers = 7;  // layer 5 global, the others local
  spec.rope_base = v.rope_base;
  auto base = pd::GgufFile::from_bytes(pd::make_tiny_llama_gguf(spec), "tiny.gguf");
  REQUIRE(base.is_ok());
  const pd::GgufFile& f = **base;
  pd::GgufWriter w;
  for (const auto& [key, value] : f.metadata()) {
    if (key == "general.architecture") {
      w.set(key, string_value(v.arch));
    } else if (key.rfind("llama.", 0) == 0) {
      w.set(v.arch + key.substr(5), value);
    } else {
      w.set(key, value);
    }
  }
  const std::string p = v.arch + ".";
  const int hd = spec.hidden / spec.n_heads;
  if (v.linear_factor > 0.0f) {
    w.set(p + "rope.scaling.type", string_value("linear"));
    w.set(p + "rope.scaling.factor", f32_value(v.linear_factor));
  }
  if (v.arch == "qwen3" || v.arch == "gemma3") w.set(p + "attention.key_length", u32_value(hd));
  if (v.arch == "gemma3") w.set(p + "attention.sliding_window", u32_value(v.sliding_window));
  for (const auto& [key, value] : v.extra_keys) w.set(key, value);
  for (const pd::GgufTensorInfo& t : f.tensors()) {
    if (t.name == v.drop_tensor) continue;
    w.add_tensor_raw(t.name, t.ne, t.type, std::vector<uint8_t>(t.data, t.data + t.nbytes));
  }
  uint64_t seed = 100;
  auto add = [&](const std::string& name, int64_t n, float mean, float scale) {
    if (name == v.drop_tensor) return;
    std::vector<float> x = pd::test::random_floats(static_cast<size_t>(n), seed++, scale);
    for (float& e : x) e += mean;
    w.add_tensor(name, {n}, GgmlType::kF32, x);
  };
  if (v.rope_factors) {
    std::vector<float> factors(static_cast<size_t>(hd / 2));
    for (int i = 0; i < hd / 2; ++i) factors[i] = 1.0f + 7.0f * static_cast<float>(i) / (hd / 2 - 1);
    w.add_tensor("rope_freqs.weight", {hd / 2}, GgmlType::kF32, factors);
  }
  for (int l = 0; l < spec.n_layers; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    if (v.arch == "qwen2") {
      add(b + "attn_q.bias", spec.n_heads * hd, 0.0f, 0.5f);
      add(b + "attn_k.bias", spec.n_kv_heads * hd, 0.0f, 0.5f);
      add(b + "attn_v.bias", spec.n_kv_heads * hd, 0.0f, 0.5f);
    }
    if (v.arch == "qwen3" || v.arch == "gemma3") {
      add(b + "attn_q_norm.weight", hd, 1.0f, 0.1f);
      add(b + "attn_k_norm.weight", hd, 1.0f, 0.1f);
    }
    if (v.arch == "gemma3") {
      add(b + "post_attention_norm.weight", spec.hidden, 1.0f, 0.1f);
      add(b + "post_ffw_norm.weight", spec.hidden, 1.0f, 0.1f);
    }
  }
  if (!v.extra_tensor.empty()) add(v.extra_tensor, spec.hidden, 0.0f, 1.0f);
  return w.to_bytes();
}

std::shared_ptr<const pd::GgufFile> open_variant(const Variant& v, pd::TinyLlamaSpec spec = {}) {
  auto f = pd::GgufFile::from_bytes(tiny_variant(v, spec), v.arch + ".gguf");
  INFO(f.status().to_string());
  REQUIRE(f.is_ok());
  return std::shared_ptr<const pd::GgufFile>(std::move(f).value());
}

pd::Status load_status(const Variant& v) {
  auto file = open_variant(v);
  pd::BackendConfig bc;
  bc.n_threads = 1;
  auto be = pd::create_backend(bc);
  REQUIRE(be.is_ok());
  auto m = pd::LlamaModel::load(file, **be);
  return m.status();
}

std::vector<TokenId> arch_tokens(int n, int vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<TokenId> t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<TokenId>(rng() % static_cast<uint64_t>(vocab));
  return t;
}

}  // namespace model_arch_test

using namespace model_arch_test;

TEST_CASE("architectures: each reads its variant off the metadata", "[model][arch]") {
  Variant llama3;
  llama3.rope_factors = true;
  auto c = pd::LlamaConfig::from_gguf(*open_variant(llama3));
  REQUIRE(c.is_ok());
  CHECK(c->arch == "llama");
  CHECK_FALSE(c->rope_neox);
  CHECK(c->rope_freq_factors);
  CHECK(c->rope_freq_scale == 1.0f);
  CHECK_FALSE(c->qkv_bias);
  CHECK_FALSE(c->qk_norm);
  CHECK(c->window(0) == 0);
  CHECK(c->attn_scale == 1.0f / std::sqrt(16.0f));

  Variant lin;
  lin.linear_factor = 4.0f;
  c = pd::LlamaConfig::from_gguf(*open_variant(lin));
  REQUIRE(c.is_ok());
  CHECK(c->rope_freq_scale == 0.25f);
  CHECK(c->layer_rope_scale(1) == 0.25f);

  Variant qwen2;
  qwen2.arch = "qwen2";
  c = pd::LlamaConfig::from_gguf(*open_variant(qwen2));
  REQUIRE(c.is_ok());
  CHECK(c->rope_neox);
  CHECK(c->qkv_bias);
  CHECK_FALSE(c->qk_norm);

  Variant qwen3;
  qwen3.arch = "qwen3";
  c = pd::LlamaConfig::from_gguf(*open_variant(qwen3));
  REQUIRE(c.is_ok());
  CHECK(c->rope_neox);
  CHECK_FALSE(c->qkv_bias);
  CHECK(c->qk_norm);
  CHECK_FALSE(c->post_norms);

  Variant gemma3;
  gemma3.arch = "gemma3";
  gemma3.sliding_window = 5;
  gemma3.linear_factor = 8.0f;
  gemma3.rope_base = 1e6f;
  c = pd::LlamaConfig::from_gguf(*open_variant(gemma3));
  REQUIRE(c.is_ok());
  CHECK(c->rope_neox);
  CHECK(c->qk_norm);
  CHECK(c->post_norms);
  CHECK(c->gelu_ffn);
  CHECK(c->embed_scale == std::sqrt(64.0f));
  CHECK(c->sliding_window == 5);
  // llama.cpp's pattern for gemma3: every sixth layer global.
  for (int l = 0; l < 7; ++l) {
    INFO("layer " << l);
    CHECK(c->is_swa(l) == (l != 5));
    CHECK(c->window(l) == (l == 5 ? 0 : 5));
    CHECK(c->layer_rope_base(l) == (l == 5 ? 1e6f : 10000.0f));  // llama.cpp: 10000 on local layers
    CHECK(c->layer_rope_scale(l) == (l == 5 ? 0.125f : 1.0f));       // linear scaling: global layers only
  }
  CHECK(c->describe().find("sliding window 5 on 6 of 7 layers") != std::string::npos);

  // The pattern key: an integer period, or one bool per layer.
  Variant period = gemma3;
  period.extra_keys.push_back({"gemma3.attention.sliding_window_pattern", u32_value(3)});
  c = pd::LlamaConfig::from_gguf(*open_variant(period));
  REQUIRE(c.is_ok());
  for (int l = 0; l < 7; ++l) CHECK(c->is_swa(l) == (l % 3 != 2));
  Variant bools = gemma3;
  pd::GgufValue arr;
  arr.type = pd::GgufValueType::kArray;
  auto a = std::make_shared<pd::GgufArray>();
  a->elem_type = pd::GgufValueType::kBool;
  for (int l = 0; l < 7; ++l) {
    pd::GgufValue b;
    b.type = pd::GgufValueType::kBool;
    b.v = l < 2;
    a->items.push_back(b);
  }
  arr.v = a;
  bools.extra_keys.push_back({"gemma3.attention.sliding_window_pattern", arr});
  c = pd::LlamaConfig::from_gguf(*open_variant(bools));
  REQUIRE(c.is_ok());
  for (int l = 0; l < 7; ++l) CHECK(c->is_swa(l) == (l < 2));
}

TEST_CASE("architectures: what is not implemented is refused by name", "[model][arch]") {
  auto refused = [](const Variant& v, const std::string& needle) {
    const pd::Status st = load_status(v);
    INFO(st.to_string());
    CHECK_FALSE(st.is_ok());
    CHECK(st.message().find(needle) != std::string::npos);
  };
  Variant gemma2;
  gemma2.arch = "gemma2";
  refused(gemma2, "unsupported architecture 'gemma2'");
  Variant yarn;
  yarn.arch = "qwen2";
  yarn.extra_keys.push_back({"qwen2.rope.scaling.type", string_value("yarn")});
  refused(yarn, "RoPE scaling 'yarn'");
  Variant no_bias;
  no_bias.arch = "qwen2";
  no_bias.drop_tensor = "blk.1.attn_k.bias";
  refused(no_bias, "missing tensor blk.1.attn_k.bias");
  Variant no_qnorm;
  no_qnorm.arch = "qwen3";
  no_qnorm.drop_tensor = "blk.0.attn_q_norm.weight";
  refused(no_qnorm, "missing tensor blk.0.attn_q_norm.weight");
  Variant no_post;
  no_post.arch = "gemma3";
  no_post.sliding_window = 4;
  no_post.drop_tensor = "blk.6.post_ffw_norm.weight";
  refused(no_post, "missing tensor blk.6.post_ffw_norm.weight");
  Variant no_window;
  no_window.arch = "gemma3";
  refused(no_window, "gemma3.attention.sliding_window");
  Variant softcap;
  softcap.arch = "gemma3";
  softcap.sliding_window = 4;
  softcap.extra_keys.push_back({"gemma3.final_logit_softcapping", f32_value(30.0f)});
  refused(softcap, "final_logit_softcapping");
  Variant unknown;
  unknown.extra_tensor = "blk.0.attn_output.bias";
  refused(unknown, "tensor blk.0.attn_output.bias is not part of the llama model");
  Variant stray;
  stray.arch = "qwen3";
  stray.extra_tensor = "rope_freqs.weight";  // [hidden], not [head_dim / 2]
  refused(stray, "rope_freqs.weight");
}

// Each variant's logits are the same bits computed whole, in chunks, token by
// token, and beside other sequences: Gemma 3's windows of 5 over a 40-token
// prompt in blocks of 3 (windows across blocks, whole blocks outside them),
// on both CPU matmul paths.
TEST_CASE("architectures: logits are bit-identical whole, chunked, token by token and batched", "[model][arch]") {
  std::vector<Variant> variants(5);
  variants[0].rope_factors = true;
  variants[1].linear_factor = 4.0f;
  variants[2].arch = "qwen2";
  variants[3].arch = "qwen3";
  variants[4].arch = "gemma3";
  variants[4].sliding_window = 5;
  variants[4].linear_factor = 8.0f;
  for (const Variant& v : variants)
    for (bool int8 : {false, true}) {
      INFO(v.arch << (v.rope_factors ? " rope factors" : "") << (v.linear_factor > 0 ? " linear" : "") << ", int8 "
                  << int8);
      auto file = open_variant(v);
      pd::BackendConfig bc;
      bc.n_threads = 2;
      bc.int8_activations = int8;
      auto be = pd::create_backend(bc);
      REQUIRE(be.is_ok());
      auto m = pd::LlamaModel::load(file, **be);
      INFO(m.status().to_string());
      REQUIRE(m.is_ok());
      pd::LlamaModel& model = **m;
      const int vocab = model.config().vocab, bs = 3, n = 40;
      auto cache = pd::KvCache::create(**be, model.config(), bs, 64, GgmlType::kF32);
      REQUIRE(cache.is_ok());
      const std::vector<TokenId> prompt = arch_tokens(n, vocab, 9);
      std::vector<int32_t> table(14), table2(14), other_table(14);
      std::iota(table.begin(), table.end(), 0);
      std::iota(table2.begin(), table2.end(), 14);
      std::iota(other_table.begin(), other_table.end(), 28);

      // Whole prompt, every position's logits.
      std::vector<float> whole;
      {
        pd::SequenceBatch sb{prompt, 0, table, true, true};
        REQUIRE(model.forward(std::span<const pd::SequenceBatch>(&sb, 1), *cache, &whole).is_ok());
        REQUIRE(whole.size() == static_cast<size_t>(n * vocab));
      }
      bool finite = true;
      for (float x : whole) finite = finite && std::isfinite(x);
      CHECK(finite);
      // Chunks of 7 beside another sequence's prompt, into other blocks.
      const std::vector<TokenId> other = arch_tokens(11, vocab, 10);
      std::vector<float> chunked;
      for (int p0 = 0; p0 < n; p0 += 7) {
        const int len = std::min(7, n - p0);
        std::vector<pd::SequenceBatch> b{{std::span<const TokenId>(prompt.data() + p0, len), p0, table2, true, true}};
        if (p0 == 0) b.insert(b.begin(), pd::SequenceBatch{other, 0, other_table, true, false});
        std::vector<float> out;
        REQUIRE(model.forward(b, *cache, &out).is_ok());
        chunked.insert(chunked.end(), out.end() - static_cast<ptrdiff_t>(len) * vocab, out.end());
      }
      CHECK(chunked == whole);
      // Token by token (decode steps) from position 30 on, after a prefill of 30.
      {
        pd::SequenceBatch sb{std::span<const TokenId>(prompt.data(), 30), 0, table2, false, false};
        REQUIRE(model.prefill(std::span<const pd::SequenceBatch>(&sb, 1), *cache, nullptr).is_ok());
      }
      for (int p = 30; p < n; ++p) {
        std::vector<pd::SequenceBatch> b{{std::span<const TokenId>(prompt.data() + p, 1), p, table2, true}};
        const TokenId o = static_cast<TokenId>(p % vocab);
        if (p % 2 == 0) b.push_back({std::span<const TokenId>(&o, 1), 11 + (p - 30) / 2, other_table, true});
        std::vector<float> out;
        REQUIRE(model.decode(b, *cache, &out).is_ok());
        INFO("decode at position " << p);
        CHECK(std::memcmp(out.data(), whole.data() + static_cast<size_t>(p) * vocab, vocab * sizeof(float)) == 0);
      }
    }
}

// The variants are not no-ops: with one ingredient removed (the window, the
// post-norms, ...) the logits change. Guards against a variant silently
// falling back to plain Llama.
TEST_CASE("architectures: each variant changes the logits", "[model][arch]") {
  auto last_logits = [](const Variant& v) {
    auto file = open_variant(v);
    pd::BackendConfig bc;
    bc.n_threads = 1;
    bc.int8_activations = false;
    auto be = pd::create_backend(bc);
    REQUIRE(be.is_ok());
    auto m = pd::LlamaModel::load(file, **be);
    INFO(m.status().to_string());
    REQUIRE(m.is_ok());
    auto cache = pd::KvCache::create(**be, (*m)->config(), 16, 4, GgmlType::kF32);
    REQUIRE(cache.is_ok());
    const std::vector<TokenId> prompt = arch_tokens(30, (*m)->config().vocab, 5);
    std::vector<int32_t> table{0, 1};
    pd::SequenceBatch sb{prompt, 0, table, true};
    std::vector<float> out;
    REQUIRE((*m)->forward(std::span<const pd::SequenceBatch>(&sb, 1), *cache, &out).is_ok());
    return out;
  };
  Variant plain;
  const std::vector<float> base = last_logits(plain);
  Variant factors;
  factors.rope_factors = true;
  CHECK(last_logits(factors) != base);
  Variant lin;
  lin.linear_factor = 2.0f;
  CHECK(last_logits(lin) != base);
  Variant g_small, g_wide;
  g_small.arch = g_wide.arch = "gemma3";
  g_small.sliding_window = 4;
  g_wide.sliding_window = 100;  // wider than the prompt: full attention everywhere
  CHECK(last_logits(g_small) != last_logits(g_wide));
}

// The planner's parameter count (ModelSpec from the GGUF) equals the file's
// for each variant: the Q/K norms, post-norms and biases are counted.
TEST_CASE("architectures: the planner counts each variant's parameters as the file holds them", "[model][arch]") {
  std::vector<Variant> variants(4);
  variants[1].arch = "qwen2";
  variants[2].arch = "qwen3";
  variants[3].arch = "gemma3";
  variants[3].sliding_window = 4;
  for (const Variant& v : variants) {
    INFO(v.arch);
    auto spec = pd::plan::model_from_gguf(*open_variant(v));
    INFO(spec.status().to_string());
    REQUIRE(spec.is_ok());
    CHECK(spec->file_params == pd::plan::parameter_count(*spec));
  }
  const std::string gemma = std::string(PD_SOURCE_DIR) + "/models/gemma-3-270m-q4_k_m.gguf";
  if (auto f = pd::GgufFile::open(gemma); f.is_ok()) {
    auto spec = pd::plan::model_from_gguf(**f);
    REQUIRE(spec.is_ok());
    CHECK(spec->qk_norm);
    CHECK(spec->post_norms);
    CHECK(spec->head_dim == 256);
    CHECK(spec->file_params == pd::plan::parameter_count(*spec));
  }
}
