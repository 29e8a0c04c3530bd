// GGUF writer -> reader round trips, the tiny Llama model, every refusal the
// reader makes on malformed input, and (when present) the real default model.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "gguf/ggml_types.h"
#include "gguf/gguf_reader.h"
#include "gguf/gguf_writer.h"
#include "test_support.h"

namespace pd {
namespace {

using Bytes = std::vector<uint8_t>;

// Offset of the only occurrence of `needle` in `b` (fails the test otherwise).
size_t find_unique(const Bytes& b, const std::string& needle) {
  size_t found = std::string::npos;
  int count = 0;
  for (size_t i = 0; i + needle.size() <= b.size(); ++i) {
    if (std::memcmp(b.data() + i, needle.data(), needle.size()) == 0) {
      found = i;
      ++count;
    }
  }
  INFO("needle '" << needle << "'");
  REQUIRE(count == 1);
  return found;
}
void put_u32(Bytes& b, size_t at, uint32_t v) { std::memcpy(b.data() + at, &v, 4); }
void put_u64(Bytes& b, size_t at, uint64_t v) { std::memcpy(b.data() + at, &v, 8); }
uint64_t get_u64(const Bytes& b, size_t at) {
  uint64_t v;
  std::memcpy(&v, b.data() + at, 8);
  return v;
}

// Field offsets of a tensor info, located by its (unique) name.
struct InfoAt {
  size_t n_dims, ne0, type, offset;
};
InfoAt tensor_info_at(const Bytes& b, const std::string& name, uint32_t n_dims) {
  const size_t p = find_unique(b, name) + name.size();
  return InfoAt{p, p + 4, p + 4 + 8 * n_dims, p + 4 + 8 * n_dims + 4};
}
// Offset of the value (after the type tag) of a metadata key, located by its name.
size_t value_at(const Bytes& b, const std::string& key) { return find_unique(b, key) + key.size() + 4; }

Status parse_status(Bytes bytes) {
  auto r = GgufFile::from_bytes(std::move(bytes), "bad.gguf");
  return r.status();
}

// Expects a refusal whose message names the file and contains `word`.
void require_refused(const Bytes& bytes, const std::string& word) {
  const Status s = parse_status(bytes);
  INFO("status: " << s.to_string());
  REQUIRE_FALSE(s.is_ok());
  CHECK(s.message().find("bad.gguf") != std::string::npos);
  CHECK(s.message().find(word) != std::string::npos);
}

std::vector<float> ramp(int64_t n, float scale) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = scale * std::sin(0.37f * static_cast<float>(i) + 0.1f);
  return v;
}

// Two small tensors and a few keys: the base for the refusal cases.
Bytes small_file() {
  GgufWriter w;
  w.set_string("general.architecture", "llama");
  w.set_string("some.string", "hello");
  w.set_u32("dup.key1", 1);
  w.set_u32("dup.key2", 2);
  w.set_bool("some.flag", true);
  w.add_tensor("tensor_a", {32, 2}, GgmlType::kF32, ramp(64, 1.0f));
  w.add_tensor("tensor_b", {64}, GgmlType::kQ8_0, ramp(64, 2.0f));
  w.add_tensor("blk.0.attn_q.weight", {32, 4}, GgmlType::kQ4_1, ramp(128, 0.5f));
  return w.to_bytes();
}

GgufValue val(GgufValueType t, decltype(GgufValue::v) v) { return GgufValue{t, std::move(v)}; }
GgufValue arr(GgufValueType elem, std::vector<GgufValue> items) {
  auto a = std::make_shared<GgufArray>();
  a->elem_type = elem;
  a->items = std::move(items);
  return GgufValue{GgufValueType::kArray, std::move(a)};
}

std::string temp_path(const std::string& stem) {
  return (std::filesystem::temp_directory_path() / (stem + "." + std::to_string(getpid()) + ".gguf")).string();
}

}  // namespace

TEST_CASE("gguf: every metadata type round-trips", "[gguf]") {
  GgufWriter w;
  w.set("t.u8", val(GgufValueType::kUint8, uint8_t{200}));
  w.set("t.i8", val(GgufValueType::kInt8, int8_t{-100}));
  w.set("t.u16", val(GgufValueType::kUint16, uint16_t{60000}));
  w.set("t.i16", val(GgufValueType::kInt16, int16_t{-30000}));
  w.set_u32("t.u32", 4000000000u);
  w.set_i32("t.i32", -2000000000);
  w.set_f32("t.f32", 1.5f);
  w.set_bool("t.bool", true);
  w.set_string("t.str", "héllo \xF0\x9F\x98\x80 world");
  w.set_string("t.empty_str", "");
  w.set("t.u64", val(GgufValueType::kUint64, uint64_t{18000000000000000000ull}));
  w.set("t.u64_small", val(GgufValueType::kUint64, uint64_t{7}));
  w.set("t.i64", val(GgufValueType::kInt64, int64_t{-9000000000000000000ll}));
  w.set("t.f64", val(GgufValueType::kFloat64, 2.718281828459045));
  w.set_string_array("t.arr_str", {"a", "", "Ġthe"});
  w.set_i32_array("t.arr_i32", {1, -2, 3});
  w.set_f32_array("t.arr_f32", {0.5f, -1.25f});
  w.set("t.arr_u8", arr(GgufValueType::kUint8, {val(GgufValueType::kUint8, uint8_t{1}), val(GgufValueType::kUint8, uint8_t{255})}));
  w.set("t.arr_bool", arr(GgufValueType::kBool, {val(GgufValueType::kBool, false), val(GgufValueType::kBool, true)}));
  w.set("t.arr_u64", arr(GgufValueType::kUint64, {val(GgufValueType::kUint64, uint64_t{1} << 40)}));
  w.set("t.arr_f64", arr(GgufValueType::kFloat64, {val(GgufValueType::kFloat64, 0.25)}));
  w.set("t.arr_empty", arr(GgufValueType::kInt16, {}));
  w.set("t.nested",
        arr(GgufValueType::kArray,
            {arr(GgufValueType::kString, {val(GgufValueType::kString, std::string("x"))}),
             arr(GgufValueType::kInt8, {val(GgufValueType::kInt8, int8_t{-1}), val(GgufValueType::kInt8, int8_t{2})}),
             arr(GgufValueType::kArray, {arr(GgufValueType::kUint16, {val(GgufValueType::kUint16, uint16_t{9})})})}));
  w.set_u32("t.replaced", 1);
  w.set_u32("t.replaced", 2);  // replaces in place

  auto r = GgufFile::from_bytes(w.to_bytes(), "meta.gguf");
  REQUIRE(r.status().to_string() == "OK");
  const GgufFile& f = **r;
  CHECK(f.version() == 3);
  CHECK(f.alignment() == 32);
  CHECK(f.tensors().empty());
  CHECK(f.metadata().size() == 24);

  CHECK(f.find("t.u8")->type == GgufValueType::kUint8);
  CHECK(*f.get_int("t.u8") == 200);
  CHECK(*f.get_int("t.i8") == -100);
  CHECK(*f.get_int("t.u16") == 60000);
  CHECK(*f.get_int("t.i16") == -30000);
  CHECK(*f.get_int("t.u32") == 4000000000ll);
  CHECK(f.find("t.u32")->type == GgufValueType::kUint32);
  CHECK(*f.get_int("t.i32") == -2000000000);
  CHECK(*f.get_float("t.f32") == 1.5);
  CHECK(*f.get_bool("t.bool"));
  CHECK(*f.get_string("t.str") == "héllo \xF0\x9F\x98\x80 world");
  CHECK(f.get_string("t.empty_str")->empty());
  CHECK(std::get<uint64_t>(f.find("t.u64")->v) == 18000000000000000000ull);
  CHECK_FALSE(f.find("t.u64")->as_int().has_value());  // > INT64_MAX
  CHECK(f.get_int("t.u64").status().is_invalid_argument());
  CHECK(*f.get_int("t.u64_small") == 7);
  CHECK(*f.get_int("t.i64") == -9000000000000000000ll);
  CHECK(*f.get_float("t.f64") == 2.718281828459045);
  CHECK(*f.get_float("t.i32") == -2000000000.0);  // integers read as numbers
  CHECK(*f.get_string_array("t.arr_str") == std::vector<std::string>{"a", "", "Ġthe"});
  CHECK(*f.get_int_array("t.arr_i32") == std::vector<int64_t>{1, -2, 3});
  CHECK(f.find("t.arr_i32")->as_array()->elem_type == GgufValueType::kInt32);
  CHECK(*f.get_float_array("t.arr_f32") == std::vector<float>{0.5f, -1.25f});
  CHECK(*f.get_int_array("t.arr_u8") == std::vector<int64_t>{1, 255});
  const GgufArray* bools = f.find("t.arr_bool")->as_array();
  REQUIRE(bools != nullptr);
  CHECK(bools->items.size() == 2);
  CHECK(*bools->items[1].as_bool());
  CHECK(*f.get_int_array("t.arr_u64") == std::vector<int64_t>{int64_t{1} << 40});
  CHECK(*f.get_float_array("t.arr_f64") == std::vector<float>{0.25f});
  CHECK(f.get_int_array("t.arr_empty")->empty());
  CHECK(f.find("t.arr_empty")->as_array()->elem_type == GgufValueType::kInt16);
  CHECK(*f.get_int("t.replaced") == 2);

  const GgufArray* nested = f.find("t.nested")->as_array();
  REQUIRE(nested != nullptr);
  REQUIRE(nested->elem_type == GgufValueType::kArray);
  REQUIRE(nested->items.size() == 3);
  CHECK(*nested->items[0].as_array()->items[0].as_string() == "x");
  CHECK(*nested->items[1].as_array()->items[0].as_int() == -1);
  CHECK(*nested->items[2].as_array()->items[0].as_array()->items[0].as_int() == 9);

  // Typed getters: NotFound when absent, InvalidArgument naming the key on a type mismatch.
  CHECK(f.get_int("no.such.key").status().is_not_found());
  CHECK(f.get_int("no.such.key").status().message().find("no.such.key") != std::string::npos);
  const Status wrong = f.get_int("t.str").status();
  CHECK(wrong.is_invalid_argument());
  CHECK(wrong.message().find("t.str") != std::string::npos);
  CHECK(wrong.message().find("meta.gguf") != std::string::npos);
  CHECK(f.get_string("t.u8").status().is_invalid_argument());
  CHECK(f.get_bool("t.u8").status().is_invalid_argument());
  CHECK(f.get_string_array("t.arr_i32").status().is_invalid_argument());
  CHECK(f.get_int_array("t.arr_str").status().is_invalid_argument());
  CHECK(f.get_float_array("t.str").status().is_invalid_argument());
}

TEST_CASE("gguf: every tensor type round-trips", "[gguf]") {
  struct Case {
    std::string name;
    GgmlType type;
    std::vector<int64_t> ne;
  };
  const std::vector<Case> cases = {
      {"f32", GgmlType::kF32, {5, 3}},        {"f16", GgmlType::kF16, {7}},
      {"bf16", GgmlType::kBF16, {3, 2, 2}},   {"q4_0", GgmlType::kQ4_0, {64, 3}},
      {"q4_1", GgmlType::kQ4_1, {32, 2, 1, 2}}, {"q8_0", GgmlType::kQ8_0, {96, 2}},
  };
  for (uint64_t alignment : {32, 64, 1}) {
    INFO("alignment " << alignment);
    GgufWriter w(alignment);
    std::vector<std::vector<float>> values;
    for (const Case& c : cases) {
      int64_t n = 1;
      for (int64_t d : c.ne) n *= d;
      values.push_back(ramp(n, 3.0f));
      w.add_tensor(c.name, c.ne, c.type, values.back());
    }
    std::vector<uint8_t> raw(18 * 2);
    for (size_t i = 0; i < raw.size(); ++i) raw[i] = static_cast<uint8_t>(i * 7);
    w.add_tensor_raw("raw_q4_0", {64}, GgmlType::kQ4_0, raw);

    auto r = GgufFile::from_bytes(w.to_bytes(), "tensors.gguf");
    REQUIRE(r.status().to_string() == "OK");
    const GgufFile& f = **r;
    CHECK(f.alignment() == alignment);
    CHECK(f.data_offset() % alignment == 0);
    REQUIRE(f.tensors().size() == cases.size() + 1);
    for (size_t i = 0; i < cases.size(); ++i) {
      const Case& c = cases[i];
      const GgufTensorInfo* t = f.find_tensor(c.name);
      REQUIRE(t != nullptr);
      CHECK(t == &f.tensors()[i]);  // file order kept
      CHECK(t->type == c.type);
      CHECK(t->ne == c.ne);
      CHECK(t->n_elements() == static_cast<int64_t>(values[i].size()));
      CHECK(t->offset % alignment == 0);
      CHECK(t->data == f.bytes() + f.data_offset() + t->offset);
      const int64_t n = t->n_elements();
      REQUIRE(t->nbytes == ggml_row_bytes(c.type, c.ne[0]) * static_cast<size_t>(n / c.ne[0]));
      // Bytes are exactly what the quantizer produces, row by row.
      std::vector<uint8_t> expect(t->nbytes);
      const size_t rb = ggml_row_bytes(c.type, c.ne[0]);
      for (int64_t row = 0; row < n / c.ne[0]; ++row) {
        quantize_row(c.type, values[i].data() + row * c.ne[0], expect.data() + row * rb, c.ne[0]);
      }
      CHECK(std::memcmp(t->data, expect.data(), t->nbytes) == 0);
      std::vector<float> back(static_cast<size_t>(n));
      for (int64_t row = 0; row < n / c.ne[0]; ++row) {
        dequantize_row(c.type, t->data + row * rb, back.data() + row * c.ne[0], c.ne[0]);
      }
      // Values lie in [-3, 3]: Q4_0's worst case is one step (3/8), Q4_1's half a step (6/30).
      const double margin = c.type == GgmlType::kQ4_0 ? 0.38 : c.type == GgmlType::kQ4_1 ? 0.21 : 0.03;
      for (int64_t k = 0; k < n; ++k) CHECK(back[k] == Approx(values[i][k]).margin(margin));
    }
    const GgufTensorInfo* rt = f.find_tensor("raw_q4_0");
    REQUIRE(rt != nullptr);
    CHECK(std::memcmp(rt->data, raw.data(), raw.size()) == 0);
    CHECK(f.find_tensor("missing") == nullptr);
  }
}

TEST_CASE("gguf: open maps a file written by write_file", "[gguf]") {
  GgufWriter w;
  w.set_string("general.architecture", "llama");
  w.add_tensor("t", {32}, GgmlType::kF32, ramp(32, 1.0f));
  const std::string path = temp_path("pd_gguf_open");
  REQUIRE(w.write_file(path).is_ok());
  {
    auto r = GgufFile::open(path);
    REQUIRE(r.status().to_string() == "OK");
    CHECK((*r)->path() == path);
    CHECK((*r)->file_size() == std::filesystem::file_size(path));
    REQUIRE((*r)->find_tensor("t") != nullptr);
    float first;
    std::memcpy(&first, (*r)->find_tensor("t")->data, 4);
    CHECK(first == ramp(1, 1.0f)[0]);
    CHECK(check_llama_family(**r).is_ok());
  }
  std::filesystem::remove(path);

  const Status missing = GgufFile::open(path).status();
  CHECK(missing.is_io_error());
  CHECK(missing.message().find(path) != std::string::npos);
  CHECK(GgufFile::open(std::filesystem::temp_directory_path().string()).status().is_io_error());
  // An empty file is truncated, not an mmap failure.
  const std::string empty = temp_path("pd_gguf_empty");
  { std::FILE* fp = std::fopen(empty.c_str(), "wb"); REQUIRE(fp != nullptr); std::fclose(fp); }
  const Status e = GgufFile::open(empty).status();
  CHECK(e.message().find("truncated") != std::string::npos);
  std::filesystem::remove(empty);
  CHECK(w.write_file("/nonexistent-dir/x.gguf").is_io_error());
}

TEST_CASE("gguf: tiny llama model round-trips with llama.cpp metadata", "[gguf]") {
  TinyLlamaSpec spec;
  const Bytes bytes = make_tiny_llama_gguf(spec);
  CHECK(make_tiny_llama_gguf(spec) == bytes);  // deterministic
  TinyLlamaSpec other = spec;
  other.seed = 2;
  CHECK(make_tiny_llama_gguf(other) != bytes);

  auto r = GgufFile::from_bytes(bytes, "tiny.gguf");
  REQUIRE(r.status().to_string() == "OK");
  const GgufFile& f = **r;
  CHECK(check_llama_family(f).is_ok());
  CHECK(*f.get_string("general.architecture") == "llama");
  CHECK(f.get_string("general.name").is_ok());
  CHECK(*f.get_int("llama.block_count") == spec.n_layers);
  CHECK(f.find("llama.block_count")->type == GgufValueType::kUint32);
  CHECK(*f.get_int("llama.context_length") == spec.context);
  CHECK(*f.get_int("llama.embedding_length") == spec.hidden);
  CHECK(*f.get_int("llama.feed_forward_length") == spec.ffn);
  CHECK(*f.get_int("llama.attention.head_count") == spec.n_heads);
  CHECK(*f.get_int("llama.attention.head_count_kv") == spec.n_kv_heads);
  CHECK(*f.get_float("llama.rope.freq_base") == spec.rope_base);
  CHECK(f.find("llama.rope.freq_base")->type == GgufValueType::kFloat32);
  CHECK(static_cast<float>(*f.get_float("llama.attention.layer_norm_rms_epsilon")) == spec.rms_eps);
  CHECK(*f.get_int("llama.rope.dimension_count") == spec.hidden / spec.n_heads);
  CHECK(*f.get_int("llama.vocab_size") == spec.vocab);
  CHECK(*f.get_string("tokenizer.ggml.model") == "gpt2");
  CHECK(*f.get_string("tokenizer.ggml.pre") == "smollm");
  CHECK(*f.get_bool("tokenizer.ggml.add_bos_token") == false);
  CHECK(*f.get_int("tokenizer.ggml.bos_token_id") == kTinyBosId);
  CHECK(*f.get_int("tokenizer.ggml.eos_token_id") == kTinyEosId);
  CHECK(*f.get_int("tokenizer.ggml.unknown_token_id") == kTinyUnknownId);
  CHECK(*f.get_int("tokenizer.ggml.padding_token_id") == kTinyPaddingId);
  const std::string tmpl = *f.get_string("tokenizer.chat_template");
  CHECK(tmpl.find("<|im_start|>") != std::string::npos);
  CHECK(tmpl.find("add_generation_prompt") != std::string::npos);

  // Vocabulary layout.
  const std::vector<std::string> tokens = *f.get_string_array("tokenizer.ggml.tokens");
  const std::vector<int64_t> types = *f.get_int_array("tokenizer.ggml.token_type");
  const std::vector<std::string> merges = *f.get_string_array("tokenizer.ggml.merges");
  REQUIRE(tokens.size() == static_cast<size_t>(kTinyVocabSize));
  REQUIRE(spec.vocab == kTinyVocabSize);
  REQUIRE(types.size() == tokens.size());
  REQUIRE(merges.size() == static_cast<size_t>(kTinyVocabMerges));
  CHECK(tokens[0] == "<|endoftext|>");
  CHECK(tokens[1] == "<|im_start|>");
  CHECK(tokens[2] == "<|im_end|>");
  CHECK(types[0] == 3);
  CHECK(types[1] == 3);
  CHECK(types[2] == 3);
  CHECK(tokens[kTinyFirstByteId + 'a'] == "a");
  CHECK(tokens[kTinyFirstByteId + ' '] == "Ġ");   // U+0120
  CHECK(tokens[kTinyFirstByteId + '\n'] == "Ċ");  // U+010A
  CHECK(tokens[kTinyFirstByteId + 0] == "Ā");     // U+0100
  CHECK(tokens[kTinyFirstByteId + 0xAD] == "Ń");  // soft hyphen -> U+0143
  CHECK(tokens[kTinyFirstByteId + 0xFF] == "ÿ");
  CHECK(types[kTinyFirstByteId + 5] == 1);
  CHECK(merges[0] == "Ġ t");
  CHECK(tokens[kTinyVocabFirstMerge] == "Ġt");
  for (size_t i = 0; i < merges.size(); ++i) {
    const size_t sp = merges[i].find(' ');
    REQUIRE(sp != std::string::npos);
    CHECK(tokens[kTinyVocabFirstMerge + i] == merges[i].substr(0, sp) + merges[i].substr(sp + 1));
  }
  CHECK(std::find(tokens.begin(), tokens.end(), "Ġthe") != tokens.end());

  // Tensors: names, ggml-order shapes, types.
  const int64_t H = spec.hidden, hd = spec.hidden / spec.n_heads, V = spec.vocab, FF = spec.ffn;
  CHECK(f.tensors().size() == static_cast<size_t>(2 + 9 * spec.n_layers));
  auto check_tensor = [&](const std::string& name, std::vector<int64_t> ne, GgmlType type) {
    INFO("tensor " << name);
    const GgufTensorInfo* t = f.find_tensor(name);
    REQUIRE(t != nullptr);
    CHECK(t->ne == ne);
    CHECK(t->type == type);
  };
  check_tensor("token_embd.weight", {H, V}, spec.embed_type);
  check_tensor("output_norm.weight", {H}, GgmlType::kF32);
  CHECK(f.find_tensor("output.weight") == nullptr);  // tied
  for (int l = 0; l < spec.n_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    check_tensor(p + "attn_norm.weight", {H}, GgmlType::kF32);
    check_tensor(p + "attn_q.weight", {H, spec.n_heads * hd}, spec.weight_type);
    check_tensor(p + "attn_k.weight", {H, spec.n_kv_heads * hd}, spec.weight_type);
    check_tensor(p + "attn_v.weight", {H, spec.n_kv_heads * hd}, spec.weight_type);
    check_tensor(p + "attn_output.weight", {spec.n_heads * hd, H}, spec.weight_type);
    check_tensor(p + "ffn_norm.weight", {H}, GgmlType::kF32);
    check_tensor(p + "ffn_gate.weight", {H, FF}, spec.weight_type);
    check_tensor(p + "ffn_up.weight", {H, FF}, spec.weight_type);
    check_tensor(p + "ffn_down.weight", {FF, H}, spec.weight_type);
  }

  // Weights are varied and O(1)-scaled: norms near 1, matrices ~ 1/sqrt(fan_in).
  const GgufTensorInfo* norm = f.find_tensor("blk.0.attn_norm.weight");
  std::vector<float> nv(H);
  dequantize_row(GgmlType::kF32, norm->data, nv.data(), H);
  for (float x : nv) CHECK((x >= 0.9f && x <= 1.1f));
  const GgufTensorInfo* up = f.find_tensor("blk.0.ffn_up.weight");
  std::vector<float> uv(static_cast<size_t>(H * FF));
  for (int64_t row = 0; row < FF; ++row) {
    dequantize_row(up->type, up->data + row * ggml_row_bytes(up->type, H), uv.data() + row * H, H);
  }
  double sum = 0, sq = 0;
  for (float x : uv) {
    sum += x;
    sq += double(x) * x;
  }
  const double mean = sum / uv.size(), sd = std::sqrt(sq / uv.size() - mean * mean);
  CHECK(std::fabs(mean) < 0.02);
  CHECK(sd == Approx(1.0 / std::sqrt(double(H))).epsilon(0.15));

  // Untied: output.weight appears; other types and sizes work.
  TinyLlamaSpec untied;
  untied.tied_embeddings = false;
  untied.weight_type = GgmlType::kQ4_0;
  untied.embed_type = GgmlType::kF16;
  untied.vocab = 400;  // pads with two-letter merges
  auto u = GgufFile::from_bytes(make_tiny_llama_gguf(untied), "untied.gguf");
  REQUIRE(u.status().to_string() == "OK");
  REQUIRE((*u)->find_tensor("output.weight") != nullptr);
  CHECK((*u)->find_tensor("output.weight")->ne == std::vector<int64_t>{H, 400});
  CHECK((*u)->find_tensor("token_embd.weight")->type == GgmlType::kF16);
  CHECK((*u)->get_string_array("tokenizer.ggml.tokens")->size() == 400);
  CHECK((*u)->get_string_array("tokenizer.ggml.merges")->size() == 400 - kTinyVocabFirstMerge);
}

TEST_CASE("gguf: refuses bad magic and unsupported versions", "[gguf]") {
  const Bytes good = small_file();
  REQUIRE(parse_status(good).is_ok());
  Bytes b = good;
  b[0] = 'X';
  require_refused(b, "magic");
  b = good;
  put_u32(b, 4, 1);
  require_refused(b, "version 1");
  CHECK(parse_status(b).is_unsupported());
  b = good;
  put_u32(b, 4, 4);
  require_refused(b, "version 4");
  b = good;
  put_u32(b, 4, 0x03000000);
  require_refused(b, "big-endian");
  b = good;
  put_u32(b, 4, 2);  // v2 has the same layout: accepted
  CHECK(parse_status(b).is_ok());
  require_refused(Bytes{}, "truncated");
  require_refused(Bytes{'G', 'G', 'U'}, "truncated");
}

TEST_CASE("gguf: refuses a file truncated anywhere before the end of its last tensor", "[gguf]") {
  const Bytes good = small_file();
  auto r = GgufFile::from_bytes(good, "good.gguf");
  REQUIRE(r.is_ok());
  size_t end = 0;
  for (const GgufTensorInfo& t : (*r)->tensors()) {
    end = std::max(end, static_cast<size_t>(t.data - (*r)->bytes()) + t.nbytes);
  }
  for (size_t n = 0; n < end; ++n) {
    INFO("truncated to " << n << " of " << good.size() << " bytes");
    const Status s = parse_status(Bytes(good.begin(), good.begin() + n));
    REQUIRE_FALSE(s.is_ok());
    const bool says_so = s.message().find("truncated") != std::string::npos ||
                         s.message().find("end of file") != std::string::npos;
    INFO(s.to_string());
    REQUIRE(says_so);
  }
  // Trailing padding after the last tensor is optional.
  CHECK(parse_status(Bytes(good.begin(), good.begin() + end)).is_ok());
}

TEST_CASE("gguf: refuses lengths and counts past the end of the file", "[gguf]") {
  const Bytes good = small_file();
  Bytes b = good;
  const size_t len_at = value_at(b, "some.string");  // u64 length of "hello"
  REQUIRE(get_u64(b, len_at) == 5);
  put_u64(b, len_at, 1000000);
  require_refused(b, "length");
  put_u64(b, len_at, ~uint64_t{0});
  require_refused(b, "past end of file");

  b = good;
  put_u64(b, find_unique(b, "some.string") - 8, uint64_t{1} << 62);  // the key's own length
  require_refused(b, "length");

  b = good;
  put_u64(b, 8, uint64_t{1} << 40);  // tensor count
  require_refused(b, "tensor count");
  b = good;
  put_u64(b, 16, ~uint64_t{0});  // metadata count
  require_refused(b, "metadata count");

  // Array length past the end of the file.
  GgufWriter w;
  w.set_i32_array("an.array", {1, 2, 3});
  Bytes a = w.to_bytes();
  const size_t count_at = value_at(a, "an.array") + 4;
  REQUIRE(get_u64(a, count_at) == 3);
  put_u64(a, count_at, uint64_t{1} << 61);
  require_refused(a, "array length");
}

TEST_CASE("gguf: refuses unknown types and bad values", "[gguf]") {
  const Bytes good = small_file();
  // Unknown tensor type: ggml's Q2_K (10) is named.
  Bytes b = good;
  const InfoAt q = tensor_info_at(b, "blk.0.attn_q.weight", 2);
  put_u32(b, q.type, 10);
  {
    const Status s = parse_status(b);
    CHECK(s.is_unsupported());
    CHECK(s.message() == "unsupported tensor type Q2_K for tensor blk.0.attn_q.weight in bad.gguf");
  }
  put_u32(b, q.type, 1234);
  require_refused(b, "type 1234");

  // Unknown metadata value type.
  b = good;
  put_u32(b, value_at(b, "some.string") - 4, 13);
  require_refused(b, "unknown value type");
  // Bool other than 0/1.
  b = good;
  b[value_at(b, "some.flag")] = 2;
  require_refused(b, "bool");

  // Dimensions: count, zero, block multiple, overflow.
  b = good;
  const InfoAt a = tensor_info_at(b, "tensor_a", 2);
  put_u32(b, a.n_dims, 5);
  require_refused(b, "dimensions");
  b = good;
  put_u32(b, a.n_dims, 0);
  require_refused(b, "dimensions");
  b = good;
  put_u64(b, a.ne0, 0);
  require_refused(b, "dimension");
  b = good;
  put_u64(b, a.ne0 + 8, uint64_t{1} << 62);  // 32 * 2^62 elements
  require_refused(b, "overflow");
  b = good;
  put_u64(b, a.ne0, ~uint64_t{0});
  require_refused(b, "dimension");
  b = good;
  const InfoAt t = tensor_info_at(b, "tensor_b", 1);
  put_u64(b, t.ne0, 33);
  require_refused(b, "block size");
}

TEST_CASE("gguf: refuses out-of-bounds or misaligned or overlapping tensor data", "[gguf]") {
  const Bytes good = small_file();
  Bytes b = good;
  const InfoAt q = tensor_info_at(b, "blk.0.attn_q.weight", 2);
  put_u64(b, q.offset, 1 << 20);
  {
    const Status s = parse_status(b);
    INFO(s.to_string());
    CHECK(s.message().find("tensor 'blk.0.attn_q.weight' data [offset ") != std::string::npos);
    CHECK(s.message().find("extends past end of file (size " + std::to_string(b.size()) + ")") !=
          std::string::npos);
  }
  put_u64(b, q.offset, ~uint64_t{0} - 31);  // aligned, and start + size overflows
  require_refused(b, "past end of file");

  b = good;
  put_u64(b, q.offset, get_u64(b, q.offset) + 1);
  require_refused(b, "misaligned");

  b = good;
  const InfoAt t = tensor_info_at(b, "tensor_b", 1);
  put_u64(b, t.offset, 0);  // tensor_a lives at 0
  require_refused(b, "overlap");
}

TEST_CASE("gguf: refuses duplicate keys and tensor names and bad alignment", "[gguf]") {
  const Bytes good = small_file();
  Bytes b = good;
  b[find_unique(b, "dup.key2") + 7] = '1';
  require_refused(b, "duplicate metadata key 'dup.key1'");

  b = good;
  b[find_unique(b, "tensor_b") + 7] = 'a';
  require_refused(b, "duplicate tensor name 'tensor_a'");

  for (uint32_t bad : {0u, 48u, 3u}) {
    GgufWriter w;
    w.set_u32("general.alignment", bad);
    w.add_tensor("t", {32}, GgmlType::kF32, ramp(32, 1.0f));
    require_refused(w.to_bytes(), "power of two");
  }
  GgufWriter ws;
  ws.set_string("general.alignment", "32");
  require_refused(ws.to_bytes(), "integer");

  // A writer padding to 32 while the file claims 64 gives misaligned offsets.
  GgufWriter wm2;
  wm2.set_u32("general.alignment", 64);
  wm2.add_tensor("t0", {8}, GgmlType::kF32, ramp(8, 1.0f));  // 32 bytes -> t1 at offset 32
  wm2.add_tensor("t1", {8}, GgmlType::kF32, ramp(8, 1.0f));
  require_refused(wm2.to_bytes(), "misaligned");

  // Arrays nested deeper than the parser allows.
  GgufValue v = GgufValue{GgufValueType::kUint8, uint8_t{1}};
  GgufValueType elem = GgufValueType::kUint8;
  for (int i = 0; i < 12; ++i) {
    v = arr(elem, {v});
    elem = GgufValueType::kArray;
  }
  GgufWriter wn;
  wn.set("deep", v);
  require_refused(wn.to_bytes(), "nests arrays");
}

TEST_CASE("gguf: check_llama_family refuses other architectures", "[gguf]") {
  GgufWriter w;
  w.set_string("general.architecture", "gpt2");
  auto r = GgufFile::from_bytes(w.to_bytes(), "gpt2.gguf");
  REQUIRE(r.is_ok());
  const Status s = check_llama_family(**r);
  CHECK(s.is_unsupported());
  CHECK(s.message() == "unsupported architecture 'gpt2' in gpt2.gguf (supported: llama, qwen2, qwen3, gemma3)");
  for (const char* ok : {"llama", "qwen2", "qwen3", "gemma3"}) {
    GgufWriter wa;
    wa.set_string("general.architecture", ok);
    auto ra = GgufFile::from_bytes(wa.to_bytes(), "a.gguf");
    REQUIRE(ra.is_ok());
    CHECK(check_llama_family(**ra).is_ok());
  }
  GgufWriter g2;
  g2.set_string("general.architecture", "gemma2");
  auto r2 = GgufFile::from_bytes(g2.to_bytes(), "g2.gguf");
  REQUIRE(r2.is_ok());
  CHECK(check_llama_family(**r2).message().find("'gemma2'") != std::string::npos);

  GgufWriter none;
  none.set_u32("x", 1);
  auto rn = GgufFile::from_bytes(none.to_bytes(), "none.gguf");
  REQUIRE(rn.is_ok());
  const Status sn = check_llama_family(**rn);
  CHECK(sn.is_not_found());
  CHECK(sn.message().find("general.architecture") != std::string::npos);

  GgufWriter wrong;
  wrong.set_u32("general.architecture", 1);
  auto rw = GgufFile::from_bytes(wrong.to_bytes(), "wrong.gguf");
  REQUIRE(rw.is_ok());
  CHECK(check_llama_family(**rw).is_invalid_argument());
}

TEST_CASE("gguf: the real default model opens", "[gguf][model]") {
  const std::string path = std::string(PD_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!std::filesystem::exists(path)) {
    pd::test::skip("default model not found at " + path + " (run scripts/fetch_model.sh)");
  }
  auto r = GgufFile::open(path);
  REQUIRE(r.status().to_string() == "OK");
  const GgufFile& f = **r;
  CHECK(check_llama_family(f).is_ok());
  CHECK(f.version() == 3);
  CHECK(f.tensors().size() == 272);
  CHECK(*f.get_int("llama.block_count") == 30);
  CHECK(*f.get_int("llama.embedding_length") == 576);
  CHECK(*f.get_int("llama.attention.head_count") == 9);
  CHECK(*f.get_int("llama.attention.head_count_kv") == 3);
  CHECK(f.get_string_array("tokenizer.ggml.tokens")->size() == 49152);
  const GgufTensorInfo* embd = f.find_tensor("token_embd.weight");
  REQUIRE(embd != nullptr);
  CHECK(embd->type == GgmlType::kQ8_0);
  CHECK(embd->ne == std::vector<int64_t>{576, 49152});
  CHECK(f.find_tensor("output.weight") == nullptr);  // tied embeddings
  REQUIRE(f.find_tensor("blk.29.ffn_down.weight") != nullptr);
  CHECK(f.find_tensor("blk.29.ffn_down.weight")->type == GgmlType::kQ4_1);
  CHECK(f.find_tensor("blk.29.ffn_down.weight")->ne == std::vector<int64_t>{1536, 576});
  // The embedding dequantizes to finite, small values.
  std::vector<float> row(576);
  dequantize_row(embd->type, embd->data, row.data(), 576);
  for (float x : row) REQUIRE((std::isfinite(x) && std::fabs(x) < 10.0f));
}

}  // namespace pd
