// GGUF writer (v3): builds a file in memory from metadata and tensors. Used by
// tests to make tiny random Llama-family models, and by the fuzz test.
//
// Metadata is written in insertion order; set() on an existing key replaces its
// value in place. Tensor data is padded to `alignment`; when alignment != 32 the
// writer adds general.alignment (u32) unless the caller set that key itself, in
// which case the caller's value is written as given (tests use this to build
// misaligned files). Misuse (a GgufValue whose tag and contents differ, a
// duplicate tensor name, sizes that don't match the shape) is a bug in the
// caller and aborts with a message.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gguf/ggml_types.h"
#include "gguf/gguf_reader.h"
#include "util/status.h"

namespace pd {

class GgufWriter {
 public:
  explicit GgufWriter(uint64_t alignment = 32) : alignment_(alignment) {}

  void set(const std::string& key, GgufValue value);
  void set_u32(const std::string& key, uint32_t v);
  void set_i32(const std::string& key, int32_t v);
  void set_f32(const std::string& key, float v);
  void set_bool(const std::string& key, bool v);
  void set_string(const std::string& key, const std::string& v);
  void set_string_array(const std::string& key, const std::vector<std::string>& v);
  void set_i32_array(const std::string& key, const std::vector<int32_t>& v);
  void set_f32_array(const std::string& key, const std::vector<float>& v);

  // Adds a tensor from fp32 values, converted/quantized to `type`.
  // ne in ggml order (ne[0] contiguous); values.size() == product(ne).
  void add_tensor(const std::string& name, std::vector<int64_t> ne, GgmlType type,
                  const std::vector<float>& values);
  // Adds a tensor from raw bytes already in `type`'s layout.
  void add_tensor_raw(const std::string& name, std::vector<int64_t> ne, GgmlType type,
                      std::vector<uint8_t> bytes);

  std::vector<uint8_t> to_bytes() const;
  Status write_file(const std::string& path) const;

 private:
  struct Tensor {
    std::string name;
    std::vector<int64_t> ne;
    GgmlType type;
    std::vector<uint8_t> bytes;
  };
  uint64_t alignment_;
  std::vector<std::pair<std::string, GgufValue>> kv_;  // insertion order
  std::vector<Tensor> tensors_;
};

// The tiny model's tokenizer vocabulary (byte-level BPE, "gpt2" model, GPT-2
// byte-to-unicode token text):
//   id 0 "<|endoftext|>" CONTROL (unknown_token_id)
//   id 1 "<|im_start|>"  CONTROL (bos_token_id)
//   id 2 "<|im_end|>"    CONTROL (eos_token_id, padding_token_id; as SmolLM2-Instruct)
//   ids 3..258: byte b is id 3 + b, token type NORMAL
//   ids 259..: one token per merge, in merge rank order ("Ġ t" -> "Ġt" is id 259, ...)
// With the default vocab (300) there are kTinyVocabMerges merges. A larger
// spec.vocab adds two-letter merges ("a b", ...) and then UNUSED filler tokens;
// a smaller one (>= 259) keeps the first merges only.
inline constexpr uint32_t kTinyUnknownId = 0;
inline constexpr uint32_t kTinyBosId = 1;
inline constexpr uint32_t kTinyEosId = 2;
inline constexpr uint32_t kTinyPaddingId = 2;
inline constexpr int kTinyFirstByteId = 3;
inline constexpr int kTinyVocabFirstMerge = 3 + 256;
inline constexpr int kTinyVocabMerges = 41;
inline constexpr int kTinyVocabSize = kTinyVocabFirstMerge + kTinyVocabMerges;  // 300

// A tiny random Llama-family model for tests. head_dim = hidden / n_heads.
// hidden, ffn and n_heads * head_dim must be multiples of weight_type's block
// size; hidden of embed_type's.
struct TinyLlamaSpec {
  int n_layers = 2;
  int hidden = 64;
  int n_heads = 4;
  int n_kv_heads = 2;
  int ffn = 128;
  int vocab = kTinyVocabSize;  // 3 specials + 256 byte tokens + 41 merges
  int context = 256;
  float rope_base = 10000.0f;
  float rms_eps = 1e-5f;
  bool tied_embeddings = true;
  GgmlType weight_type = GgmlType::kQ4_1;
  GgmlType embed_type = GgmlType::kQ8_0;
  uint64_t seed = 1;
};
// Writes metadata (general.architecture = "llama", llama.* keys, a byte-level
// gpt2 tokenizer vocabulary with ChatML specials, a ChatML chat template) and
// random weights: matrices ~ N(0, 1/fan_in), embeddings (and output.weight when
// untied) ~ N(0, 4/hidden), norm weights uniform in [0.9, 1.1]. The bytes are a
// pure function of the spec (seeded std::mt19937_64, no std distributions).
std::vector<uint8_t> make_tiny_llama_gguf(const TinyLlamaSpec& spec);

}  // namespace pd
