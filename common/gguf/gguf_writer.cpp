#include "gguf/gguf_writer.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>

namespace pd {
namespace {

// Misuse of the writer is a bug in the calling test, not bad input: abort with
// a message in every build type.
#define PD_WRITER_CHECK(cond, msg)                                        \
  do {                                                                    \
    if (!(cond)) {                                                        \
      std::fprintf(stderr, "gguf_writer: %s (%s)\n", msg, #cond);         \
      std::abort();                                                       \
    }                                                                     \
  } while (0)

class ByteSink {
 public:
  explicit ByteSink(std::vector<uint8_t>* out) : out_(out) {}
  template <typename T>
  void put(T v) {
    const size_t at = out_->size();
    out_->resize(at + sizeof(T));
    std::memcpy(out_->data() + at, &v, sizeof(T));  // little-endian host
  }
  void put_string(const std::string& s) {
    put<uint64_t>(s.size());
    out_->insert(out_->end(), s.begin(), s.end());
  }
  void pad_to(uint64_t alignment) {
    while (out_->size() % alignment != 0) out_->push_back(0);
  }

 private:
  std::vector<uint8_t>* out_;
};

// Writes the payload of `v` (not its type tag).
void put_value(ByteSink& sink, const GgufValue& v) {
  PD_WRITER_CHECK(v.v.index() == static_cast<size_t>(v.type), "GgufValue type tag does not match its contents");
  switch (v.type) {
    case GgufValueType::kUint8: sink.put(std::get<uint8_t>(v.v)); return;
    case GgufValueType::kInt8: sink.put(std::get<int8_t>(v.v)); return;
    case GgufValueType::kUint16: sink.put(std::get<uint16_t>(v.v)); return;
    case GgufValueType::kInt16: sink.put(std::get<int16_t>(v.v)); return;
    case GgufValueType::kUint32: sink.put(std::get<uint32_t>(v.v)); return;
    case GgufValueType::kInt32: sink.put(std::get<int32_t>(v.v)); return;
    case GgufValueType::kFloat32: sink.put(std::get<float>(v.v)); return;
    case GgufValueType::kBool: sink.put<uint8_t>(std::get<bool>(v.v) ? 1 : 0); return;
    case GgufValueType::kString: sink.put_string(std::get<std::string>(v.v)); return;
    case GgufValueType::kUint64: sink.put(std::get<uint64_t>(v.v)); return;
    case GgufValueType::kInt64: sink.put(std::get<int64_t>(v.v)); return;
    case GgufValueType::kFloat64: sink.put(std::get<double>(v.v)); return;
    case GgufValueType::kArray: {
      const GgufArray* a = v.as_array();
      PD_WRITER_CHECK(a != nullptr, "array value without contents");
      sink.put<uint32_t>(static_cast<uint32_t>(a->elem_type));
      sink.put<uint64_t>(a->items.size());
      for (const GgufValue& item : a->items) {
        PD_WRITER_CHECK(item.type == a->elem_type, "array element type differs from the array's elem_type");
        put_value(sink, item);
      }
      return;
    }
  }
  PD_WRITER_CHECK(false, "unknown GgufValueType");
}

template <typename T>
GgufValue make_array(GgufValueType elem_type, const std::vector<T>& v) {
  auto arr = std::make_shared<GgufArray>();
  arr->elem_type = elem_type;
  arr->items.reserve(v.size());
  for (const T& x : v) {
    GgufValue item;
    item.type = elem_type;
    item.v = x;
    arr->items.push_back(std::move(item));
  }
  GgufValue out;
  out.type = GgufValueType::kArray;
  out.v = std::move(arr);
  return out;
}

int64_t product(const std::vector<int64_t>& ne) {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;
  return n;
}

}  // namespace

// ---- GgufWriter ----

void GgufWriter::set(const std::string& key, GgufValue value) {
  PD_WRITER_CHECK(!key.empty(), "empty metadata key");
  for (auto& kv : kv_) {
    if (kv.first == key) {
      kv.second = std::move(value);
      return;
    }
  }
  kv_.emplace_back(key, std::move(value));
}

void GgufWriter::set_u32(const std::string& key, uint32_t v) { set(key, GgufValue{GgufValueType::kUint32, v}); }
void GgufWriter::set_i32(const std::string& key, int32_t v) { set(key, GgufValue{GgufValueType::kInt32, v}); }
void GgufWriter::set_f32(const std::string& key, float v) { set(key, GgufValue{GgufValueType::kFloat32, v}); }
void GgufWriter::set_bool(const std::string& key, bool v) { set(key, GgufValue{GgufValueType::kBool, v}); }
void GgufWriter::set_string(const std::string& key, const std::string& v) {
  set(key, GgufValue{GgufValueType::kString, v});
}
void GgufWriter::set_string_array(const std::string& key, const std::vector<std::string>& v) {
  set(key, make_array(GgufValueType::kString, v));
}
void GgufWriter::set_i32_array(const std::string& key, const std::vector<int32_t>& v) {
  set(key, make_array(GgufValueType::kInt32, v));
}
void GgufWriter::set_f32_array(const std::string& key, const std::vector<float>& v) {
  set(key, make_array(GgufValueType::kFloat32, v));
}

void GgufWriter::add_tensor(const std::string& name, std::vector<int64_t> ne, GgmlType type,
                            const std::vector<float>& values) {
  PD_WRITER_CHECK(!ne.empty() && ne.size() <= 4, "tensor must have 1..4 dimensions");
  for (int64_t d : ne) PD_WRITER_CHECK(d >= 1, "tensor dimensions must be >= 1");
  PD_WRITER_CHECK(static_cast<int64_t>(values.size()) == product(ne), "values.size() != product(ne)");
  const int64_t rows = product(ne) / ne[0];
  const size_t row_bytes = ggml_row_bytes(type, ne[0]);  // aborts when ne[0] is not a block multiple
  std::vector<uint8_t> bytes(row_bytes * static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    quantize_row(type, values.data() + r * ne[0], bytes.data() + r * row_bytes, ne[0]);
  }
  add_tensor_raw(name, std::move(ne), type, std::move(bytes));
}

void GgufWriter::add_tensor_raw(const std::string& name, std::vector<int64_t> ne, GgmlType type,
                                std::vector<uint8_t> bytes) {
  PD_WRITER_CHECK(!name.empty(), "empty tensor name");
  PD_WRITER_CHECK(!ne.empty() && ne.size() <= 4, "tensor must have 1..4 dimensions");
  for (int64_t d : ne) PD_WRITER_CHECK(d >= 1, "tensor dimensions must be >= 1");
  for (const Tensor& t : tensors_) PD_WRITER_CHECK(t.name != name, "duplicate tensor name");
  PD_WRITER_CHECK(bytes.size() == ggml_row_bytes(type, ne[0]) * static_cast<size_t>(product(ne) / ne[0]),
                  "bytes.size() does not match the tensor's shape and type");
  tensors_.push_back(Tensor{name, std::move(ne), type, std::move(bytes)});
}

std::vector<uint8_t> GgufWriter::to_bytes() const {
  PD_WRITER_CHECK(alignment_ != 0 && (alignment_ & (alignment_ - 1)) == 0, "alignment must be a power of two");
  bool write_alignment = alignment_ != 32;
  for (const auto& kv : kv_) {
    if (kv.first == "general.alignment") write_alignment = false;  // the caller's value wins
  }

  std::vector<uint8_t> out;
  ByteSink sink(&out);
  sink.put<uint32_t>(0x46554747);  // "GGUF"
  sink.put<uint32_t>(3);
  sink.put<uint64_t>(tensors_.size());
  sink.put<uint64_t>(kv_.size() + (write_alignment ? 1 : 0));
  for (const auto& [key, value] : kv_) {
    sink.put_string(key);
    sink.put<uint32_t>(static_cast<uint32_t>(value.type));
    put_value(sink, value);
  }
  if (write_alignment) {
    sink.put_string("general.alignment");
    sink.put<uint32_t>(static_cast<uint32_t>(GgufValueType::kUint32));
    sink.put<uint32_t>(static_cast<uint32_t>(alignment_));
  }
  uint64_t offset = 0;
  for (const Tensor& t : tensors_) {
    sink.put_string(t.name);
    sink.put<uint32_t>(static_cast<uint32_t>(t.ne.size()));
    for (int64_t d : t.ne) sink.put<uint64_t>(static_cast<uint64_t>(d));
    sink.put<uint32_t>(static_cast<uint32_t>(t.type));
    sink.put<uint64_t>(offset);
    offset += t.bytes.size();
    offset += (alignment_ - offset % alignment_) % alignment_;
  }
  sink.pad_to(alignment_);
  const size_t data_start = out.size();
  for (const Tensor& t : tensors_) {
    out.insert(out.end(), t.bytes.begin(), t.bytes.end());
    while ((out.size() - data_start) % alignment_ != 0) out.push_back(0);
  }
  return out;
}

Status GgufWriter::write_file(const std::string& path) const {
  const std::vector<uint8_t> bytes = to_bytes();
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return Status::io_error(path + ": cannot create: " + std::strerror(errno));
  const size_t written = std::fwrite(bytes.data(), 1, bytes.size(), f);
  const int write_err = written == bytes.size() ? 0 : errno;
  if (std::fclose(f) != 0 && write_err == 0) {
    return Status::io_error(path + ": cannot close: " + std::strerror(errno));
  }
  if (write_err != 0 || written != bytes.size()) {
    return Status::io_error(path + ": short write (" + std::to_string(written) + " of " +
                            std::to_string(bytes.size()) + " bytes): " + std::strerror(write_err));
  }
  return Status::ok();
}

// ---- tiny random Llama ----

namespace {

// GPT-2's bytes_to_unicode(): printable bytes map to themselves, the others to
// U+0100 + n in increasing byte order. Returns the UTF-8 form of byte b's char.
std::string gpt2_byte_token(uint8_t b) {
  auto printable = [](int c) { return (c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF); };
  uint32_t cp = b;
  if (!printable(b)) {
    uint32_t n = 0;
    for (int c = 0; c < b; ++c) n += printable(c) ? 0 : 1;
    cp = 256 + n;
  }
  std::string s;
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else {  // cp < 0x800
    s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return s;
}

// Merges in rank order, written with "Ġ" for a space and "Ċ" for a newline.
// Each merge's two parts are byte tokens or the result of an earlier merge.
constexpr const char* kTinyMerges[] = {
    "Ġ t", "Ġ a", "i n", "h e", "Ġ Ġ", "r e", "o n", "e r", "Ġt he", "a t", "Ġ s", "Ġ o", "e n", "Ġ w",
    "o r", "Ġ c", "i s", "e s", "a n", "Ġ i", "in g", "Ġ b", "Ġ f", "o u", "l l", "Ġ p", "Ġ m", "e d",
    "Ġ d", "Ġo f", "Ġ h", "n d", "Ġa nd", "Ġi s", "Ġt o", "u s", "us er", "ĠĠ ĠĠ", "Ċ Ċ", "s t", "a s",
};
static_assert(sizeof(kTinyMerges) / sizeof(kTinyMerges[0]) == kTinyVocabMerges);

// llama.cpp token types.
constexpr int32_t kTokenNormal = 1;
constexpr int32_t kTokenControl = 3;
constexpr int32_t kTokenUnused = 5;

constexpr const char* kTinyChatTemplate =
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

struct TinyVocab {
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  std::vector<std::string> merges;
};

TinyVocab make_tiny_vocab(int vocab) {
  PD_WRITER_CHECK(vocab >= kTinyVocabFirstMerge, "TinyLlamaSpec.vocab must cover the specials and 256 byte tokens");
  TinyVocab v;
  std::set<std::string> seen;
  auto add = [&](const std::string& tok, int32_t type) {
    PD_WRITER_CHECK(seen.insert(tok).second, "duplicate token in the tiny vocabulary");
    v.tokens.push_back(tok);
    v.types.push_back(type);
  };
  add("<|endoftext|>", kTokenControl);
  add("<|im_start|>", kTokenControl);
  add("<|im_end|>", kTokenControl);
  for (int b = 0; b < 256; ++b) add(gpt2_byte_token(static_cast<uint8_t>(b)), kTokenNormal);
  auto add_merge = [&](const std::string& left, const std::string& right) {
    PD_WRITER_CHECK(seen.count(left) && seen.count(right), "merge part is not in the vocabulary");
    v.merges.push_back(left + " " + right);
    add(left + right, kTokenNormal);
  };
  for (const char* m : kTinyMerges) {
    if (static_cast<int>(v.tokens.size()) >= vocab) break;
    const std::string s = m;
    const size_t sp = s.find(' ');
    add_merge(s.substr(0, sp), s.substr(sp + 1));
  }
  // Larger vocabularies: two-letter merges, then unused filler tokens.
  for (char a = 'a'; a <= 'z'; ++a) {
    for (char b = 'a'; b <= 'z'; ++b) {
      if (static_cast<int>(v.tokens.size()) >= vocab) break;
      const std::string l(1, a), r(1, b);
      if (!seen.count(l + r)) add_merge(l, r);
    }
  }
  for (int i = 0; static_cast<int>(v.tokens.size()) < vocab; ++i) {
    add("<|unused_" + std::to_string(i) + "|>", kTokenUnused);
  }
  return v;
}

// Deterministic on every platform (std::normal_distribution is not): uniforms
// from the raw 64-bit output, normals by Irwin-Hall (sum of 12 uniforms - 6).
class TinyRng {
 public:
  explicit TinyRng(uint64_t seed) : gen_(seed) {}
  double uniform() { return static_cast<double>(gen_() >> 11) * 0x1.0p-53; }
  double normal() {
    double s = 0;
    for (int i = 0; i < 12; ++i) s += uniform();
    return s - 6.0;
  }
  std::vector<float> normal_vec(int64_t n, double stddev) {
    std::vector<float> out(static_cast<size_t>(n));
    for (float& x : out) x = static_cast<float>(normal() * stddev);
    return out;
  }
  // Norm weights: 1.0 +- 0.1, uniform.
  std::vector<float> norm_vec(int64_t n) {
    std::vector<float> out(static_cast<size_t>(n));
    for (float& x : out) x = static_cast<float>(1.0 + 0.1 * (2.0 * uniform() - 1.0));
    return out;
  }

 private:
  std::mt19937_64 gen_;
};

uint32_t llama_file_type(GgmlType t) {
  switch (t) {
    case GgmlType::kF32: return 0;
    case GgmlType::kF16: return 1;
    case GgmlType::kQ4_0: return 2;
    case GgmlType::kQ4_1: return 3;
    case GgmlType::kQ8_0: return 7;
    case GgmlType::kQ5_0: return 8;
    case GgmlType::kQ5_1: return 9;
    case GgmlType::kQ4_K: return 15;  // "Q4_K_M"
    case GgmlType::kQ5_K: return 17;  // "Q5_K_M"
    case GgmlType::kQ6_K: return 18;
    case GgmlType::kQ8_K: return 0;   // no file type of its own
    case GgmlType::kBF16: return 32;
  }
  return 0;
}

}  // namespace

std::vector<uint8_t> make_tiny_llama_gguf(const TinyLlamaSpec& spec) {
  PD_WRITER_CHECK(spec.n_layers >= 1 && spec.hidden >= 1 && spec.n_heads >= 1 && spec.n_kv_heads >= 1 &&
                      spec.ffn >= 1 && spec.context >= 1,
                  "TinyLlamaSpec sizes must be positive");
  PD_WRITER_CHECK(spec.hidden % spec.n_heads == 0, "hidden must be a multiple of n_heads");
  PD_WRITER_CHECK(spec.n_heads % spec.n_kv_heads == 0, "n_heads must be a multiple of n_kv_heads");
  const int head_dim = spec.hidden / spec.n_heads;
  const int64_t hidden = spec.hidden;
  const int64_t q_dim = int64_t{spec.n_heads} * head_dim;
  const int64_t kv_dim = int64_t{spec.n_kv_heads} * head_dim;
  const int64_t ffn = spec.ffn;
  const int64_t vocab = spec.vocab;

  const TinyVocab tv = make_tiny_vocab(spec.vocab);
  GgufWriter w;
  w.set_string("general.architecture", "llama");
  w.set_string("general.name", "tiny-random-llama");
  w.set_u32("general.file_type", llama_file_type(spec.weight_type));
  w.set_u32("general.quantization_version", 2);
  w.set_u32("llama.block_count", static_cast<uint32_t>(spec.n_layers));
  w.set_u32("llama.context_length", static_cast<uint32_t>(spec.context));
  w.set_u32("llama.embedding_length", static_cast<uint32_t>(spec.hidden));
  w.set_u32("llama.feed_forward_length", static_cast<uint32_t>(spec.ffn));
  w.set_u32("llama.attention.head_count", static_cast<uint32_t>(spec.n_heads));
  w.set_u32("llama.attention.head_count_kv", static_cast<uint32_t>(spec.n_kv_heads));
  w.set_f32("llama.rope.freq_base", spec.rope_base);
  w.set_f32("llama.attention.layer_norm_rms_epsilon", spec.rms_eps);
  w.set_u32("llama.rope.dimension_count", static_cast<uint32_t>(head_dim));
  w.set_u32("llama.vocab_size", static_cast<uint32_t>(spec.vocab));
  w.set_bool("tokenizer.ggml.add_space_prefix", false);
  w.set_bool("tokenizer.ggml.add_bos_token", false);
  w.set_string("tokenizer.ggml.model", "gpt2");
  w.set_string("tokenizer.ggml.pre", "smollm");
  w.set_string_array("tokenizer.ggml.tokens", tv.tokens);
  w.set_i32_array("tokenizer.ggml.token_type", tv.types);
  w.set_string_array("tokenizer.ggml.merges", tv.merges);
  w.set_u32("tokenizer.ggml.bos_token_id", kTinyBosId);
  w.set_u32("tokenizer.ggml.eos_token_id", kTinyEosId);
  w.set_u32("tokenizer.ggml.unknown_token_id", kTinyUnknownId);
  w.set_u32("tokenizer.ggml.padding_token_id", kTinyPaddingId);
  w.set_string("tokenizer.chat_template", kTinyChatTemplate);

  // Weights in tensor order; every draw comes from one generator, so the file
  // is a pure function of the spec.
  TinyRng rng(spec.seed);
  auto matrix = [&](const std::string& name, int64_t in, int64_t out, GgmlType type, double stddev) {
    w.add_tensor(name, {in, out}, type, rng.normal_vec(in * out, stddev));
  };
  auto norm = [&](const std::string& name) { w.add_tensor(name, {hidden}, GgmlType::kF32, rng.norm_vec(hidden)); };
  const double w_std = 1.0;  // scaled by 1/sqrt(fan_in) below
  // Embeddings at 2/sqrt(hidden): tied logits h . e then have stddev ~2 for an
  // RMS-normalized h, so the tiny model's distributions are varied, not flat.
  const double embed_std = 2.0 / std::sqrt(static_cast<double>(hidden));
  matrix("token_embd.weight", hidden, vocab, spec.embed_type, embed_std);
  for (int l = 0; l < spec.n_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    norm(p + "attn_norm.weight");
    matrix(p + "attn_q.weight", hidden, q_dim, spec.weight_type, w_std / std::sqrt(double(hidden)));
    matrix(p + "attn_k.weight", hidden, kv_dim, spec.weight_type, w_std / std::sqrt(double(hidden)));
    matrix(p + "attn_v.weight", hidden, kv_dim, spec.weight_type, w_std / std::sqrt(double(hidden)));
    matrix(p + "attn_output.weight", q_dim, hidden, spec.weight_type, w_std / std::sqrt(double(q_dim)));
    norm(p + "ffn_norm.weight");
    matrix(p + "ffn_gate.weight", hidden, ffn, spec.weight_type, w_std / std::sqrt(double(hidden)));
    matrix(p + "ffn_up.weight", hidden, ffn, spec.weight_type, w_std / std::sqrt(double(hidden)));
    matrix(p + "ffn_down.weight", ffn, hidden, spec.weight_type, w_std / std::sqrt(double(ffn)));
  }
  norm("output_norm.weight");
  if (!spec.tied_embeddings) matrix("output.weight", hidden, vocab, spec.weight_type, embed_std);
  return w.to_bytes();
}

}  // namespace pd
