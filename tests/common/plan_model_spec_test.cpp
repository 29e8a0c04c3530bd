// Model presets against their published sizes; JSON and GGUF loading.
#include <catch2/catch.hpp>

#include "common/plan_test_presets.h"

#include <string>

#include "gguf/gguf_reader.h"
#include "gguf/gguf_writer.h"
#include "plan/model_spec.h"

using namespace pd::plan;
using pd::plan::test::preset;


TEST_CASE("plan: preset parameter counts match the published model sizes", "[plan]") {
  // Counts computed by hand from the config fields (see docs/PLANNER.md):
  // embedding V*d + layers * (Wq d*qw + Wk,Wv 2*d*kvw + Wo qw*d + MLP 3*d*ffn + 2 norms 2d)
  // + final norm d + LM head V*d when untied.
  struct Case {
    const char* name;
    int64_t params;
    double published_billions;  // the size each model is published as
  };
  const Case cases[] = {
      // 128256*4096*2 + 32*(41,943,040 + 176,160,768 + 8,192) + 4096
      {"llama-3.1-8b", 8'030'261'248, 8.03},
      // 128256*8192*2 + 80*(150,994,944 + 704,643,072 + 16,384) + 8192
      {"llama-3.1-70b", 70'553'706'496, 70.6},
      // 128256*16384*2 + 126*(570,425,344 + 2,617,245,696 + 32,768) + 16384
      {"llama-3.1-405b", 405'853'388'800, 405.9},
      // 32000*4096*2 + 32*218,112,000 + 4096
      {"mistral-7b-v0.1", 7'241'732'096, 7.24},
      // 152064*3584*2 + 28*(29,360,128 + 4,608 bias + 203,685,888 + 7,168) + 3584
      {"qwen2.5-7b", 7'615'616'512, 7.62},
      // 49152*576 (tied) + 30*(884,736 + 2,654,208 + 1,152) + 576
      {"smollm2-135m", 134'515'008, 0.1345},
      // 32000*4096*2 + 32*(67,108,864 + 135,266,304 + 8,192) + 4096
      {"llama-2-7b", 6'738'415'616, 6.74},
  };
  for (const Case& c : cases) {
    INFO(c.name);
    const ModelSpec m = preset(c.name);
    REQUIRE(validate_model(m).is_ok());
    CHECK(parameter_count(m) == c.params);
    CHECK(static_cast<double>(parameter_count(m)) / 1e9 == Approx(c.published_billions).epsilon(0.005));
  }
}

TEST_CASE("plan: preset shapes are the published configs", "[plan]") {
  const ModelSpec l70 = preset("Llama-3.1-70B");  // case-insensitive
  CHECK(l70.n_layers == 80);
  CHECK(l70.hidden == 8192);
  CHECK(l70.n_heads == 64);
  CHECK(l70.n_kv_heads == 8);
  CHECK(l70.head_dim == 128);
  CHECK(gqa_group(l70) == 8);
  const ModelSpec smol = preset("smollm2-135m");
  CHECK(smol.n_heads == 9);
  CHECK(smol.n_kv_heads == 3);
  CHECK(smol.head_dim == 64);
  CHECK(smol.tied_embeddings);
  const ModelSpec mha = preset("llama-2-7b");
  CHECK(mha.n_kv_heads == mha.n_heads);
  CHECK(gqa_group(mha) == 1);
  CHECK(preset("qwen2.5-7b").qkv_bias);
}

TEST_CASE("plan: unknown preset is an error naming it", "[plan]") {
  auto r = model_preset("llama-9-1b");
  REQUIRE_FALSE(r.is_ok());
  CHECK(r.status().is_not_found());
  CHECK(r.status().message().find("llama-9-1b") != std::string::npos);
}

TEST_CASE("plan: model from JSON, own names and Hugging Face config.json names", "[plan]") {
  const char* own = R"({"name": "toy", "n_layers": 2, "hidden_size": 64, "n_heads": 4, "n_kv_heads": 2,
                        "ffn_size": 128, "vocab_size": 100, "tied_embeddings": true})";
  auto a = model_from_json(own, "own.json");
  REQUIRE(a.is_ok());
  CHECK(a->name == "toy");
  CHECK(a->head_dim == 16);
  CHECK(a->tied_embeddings);
  // Llama-3.1-8B's config.json fields.
  const char* hf = R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
                       "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                       "vocab_size": 128256, "tie_word_embeddings": false, "max_position_embeddings": 131072,
                       "attention_bias": false, "model_type": "llama"})";
  auto b = model_from_json(hf, "config.json");
  REQUIRE(b.is_ok());
  CHECK(parameter_count(*b) == 8'030'261'248);
  CHECK(b->max_context == 131072);
  // Qwen2: no attention_bias key, but biased QKV.
  auto q = model_from_json(R"({"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
                               "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
                               "vocab_size": 152064, "tie_word_embeddings": false})",
                           "qwen.json");
  REQUIRE(q.is_ok());
  CHECK(parameter_count(*q) == 7'615'616'512);
}

TEST_CASE("plan: bad model JSON names the field", "[plan]") {
  auto missing = model_from_json(R"({"n_layers": 2, "hidden_size": 64, "n_heads": 4, "ffn_size": 128})", "m.json");
  REQUIRE_FALSE(missing.is_ok());
  CHECK(missing.status().message().find("vocab_size") != std::string::npos);
  CHECK(missing.status().message().find("m.json") != std::string::npos);

  auto negative = model_from_json(
      R"({"n_layers": -3, "hidden_size": 64, "n_heads": 4, "ffn_size": 128, "vocab_size": 10})", "neg.json");
  REQUIRE_FALSE(negative.is_ok());
  CHECK(negative.status().message().find("n_layers") != std::string::npos);

  auto zero = model_from_json(
      R"({"n_layers": 2, "hidden_size": 64, "n_heads": 4, "ffn_size": 0, "vocab_size": 10})", "zero.json");
  REQUIRE_FALSE(zero.is_ok());
  CHECK(zero.status().message().find("ffn_size") != std::string::npos);

  auto wrong_type = model_from_json(
      R"({"n_layers": "two", "hidden_size": 64, "n_heads": 4, "ffn_size": 8, "vocab_size": 10})", "t.json");
  REQUIRE_FALSE(wrong_type.is_ok());
  CHECK(wrong_type.status().message().find("n_layers") != std::string::npos);

  auto groups = model_from_json(
      R"({"n_layers": 2, "hidden_size": 64, "n_heads": 4, "n_kv_heads": 3, "ffn_size": 8, "vocab_size": 10})",
      "g.json");
  REQUIRE_FALSE(groups.is_ok());
  CHECK(groups.status().message().find("n_kv_heads") != std::string::npos);

  auto not_json = model_from_json("{nope", "bad.json");
  REQUIRE_FALSE(not_json.is_ok());
  CHECK(not_json.status().message().find("bad.json") != std::string::npos);

  auto no_file = model_from_json_file("/nonexistent/model.json");
  REQUIRE_FALSE(no_file.is_ok());
  CHECK(no_file.status().message().find("/nonexistent/model.json") != std::string::npos);
}

TEST_CASE("plan: model from GGUF metadata", "[plan]") {
  pd::TinyLlamaSpec spec;  // 2 layers, hidden 64, 4 heads, 2 KV heads, ffn 128, tied
  auto f = pd::GgufFile::from_bytes(pd::make_tiny_llama_gguf(spec), "tiny.gguf");
  REQUIRE(f.is_ok());
  auto m = model_from_gguf(**f);
  REQUIRE(m.is_ok());
  CHECK(m->n_layers == spec.n_layers);
  CHECK(m->hidden == spec.hidden);
  CHECK(m->n_heads == spec.n_heads);
  CHECK(m->n_kv_heads == spec.n_kv_heads);
  CHECK(m->head_dim == spec.hidden / spec.n_heads);
  CHECK(m->ffn == spec.ffn);
  CHECK(m->vocab == spec.vocab);
  CHECK(m->tied_embeddings == spec.tied_embeddings);
  // The tensors in the file hold exactly the parameters the fields imply.
  CHECK(m->file_params == parameter_count(*m));

  pd::GgufWriter w;
  w.set_string("general.architecture", "llama");
  w.set_u32("llama.block_count", 4);
  auto g = pd::GgufFile::from_bytes(w.to_bytes(), "partial.gguf");
  REQUIRE(g.is_ok());
  auto bad = model_from_gguf(**g);
  REQUIRE_FALSE(bad.is_ok());
  CHECK(bad.status().message().find("llama.embedding_length") != std::string::npos);
}
