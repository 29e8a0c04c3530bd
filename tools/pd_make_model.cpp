// pd-make-model: writes a random-weight Llama GGUF of a real model's shape, for
// speed measurements of models too large to fetch or carry (an 8B model is
// 4.5 GB in Q4_0, 16 GB in BF16): the engine's speed does not depend on the
// weights' values or the vocabulary's strings.
//
//   pd-make-model --shape llama-3.1-8b|smollm2-135m|tiny [--type q4_0|q4_1|q8_0|f16|bf16|f32]
//                 [--embed-type TYPE] [--context N] [--seed S] [--tokenizer-from FILE.gguf] --out FILE
//
// Matrices (embeddings and the LM head included) are of --type (--embed-type
// for token_embd.weight alone), norm weights F32. Values are uniform with the
// tiny test models' spread (matrices 1/sqrt(fan_in), embeddings
// 2/sqrt(hidden)); quantized types get random blocks directly (a fixed scale
// per tensor, random quants). The tokenizer is the tiny models' byte-level
// vocabulary with ChatML specials (common/gguf/gguf_writer.h) grown to the
// shape's vocab size with filler tokens, or --tokenizer-from's tokenizer.*
// metadata (its vocabulary size must match the shape's).
//
// The metadata goes through the project's GgufWriter; tensors are streamed to
// the file in pieces (generated in parallel, written while the next piece is
// generated), so the whole file never sits in memory. The bytes are a pure
// function of the flags (not of the thread count). A bad flag: an error
// naming it and a non-zero exit; a write failure: exit status 1.
#include <CLI/CLI.hpp>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gguf/ggml_types.h"
#include "gguf/gguf_reader.h"
#include "gguf/gguf_writer.h"
#include "util/status.h"
#include "tool_common.h"

namespace {

using pd::tools::ToolError;

int fail(const std::string& msg, int code = 1) { return pd::tools::report_error("pd-make-model", msg, code); }
int fail(const ToolError& e) { return fail(e.message, e.exit_code); }

struct Shape {
  const char* name;
  const char* description;
  int n_layers, hidden, n_heads, n_kv_heads, ffn, vocab, context;
  float rope_base, rms_eps;
  bool tied_embeddings;
};

// Dimensions as the models' own config.json give them. Llama 3.1's 131072-token
// context needs RoPE scaling, which the engine does not implement: its shape
// defaults to Llama 3's 8192.
constexpr Shape kShapes[] = {
    {"llama-3.1-8b", "Llama-3.1-8B", 32, 4096, 32, 8, 14336, 128256, 8192, 500000.0f, 1e-5f, false},
    {"smollm2-135m", "SmolLM2-135M", 30, 576, 9, 3, 1536, 49152, 8192, 100000.0f, 1e-5f, true},
    {"tiny", "tiny test model", 2, 64, 4, 2, 128, pd::kTinyVocabSize, 512, 10000.0f, 1e-5f, true},
};

struct TypeName {
  const char* flag;
  pd::GgmlType type;
};
// Every weight type both backends run (common/backend/cpu, common/backend/cuda).
constexpr TypeName kTypes[] = {{"q4_0", pd::GgmlType::kQ4_0}, {"q4_1", pd::GgmlType::kQ4_1},
                               {"q8_0", pd::GgmlType::kQ8_0}, {"f16", pd::GgmlType::kF16},
                               {"bf16", pd::GgmlType::kBF16}, {"f32", pd::GgmlType::kF32}};

pd::Result<pd::GgmlType> parse_type(const std::string& s, const char* flag) {
  std::string names;
  for (const TypeName& t : kTypes) {
    if (s == t.flag) return t.type;
    names += std::string(names.empty() ? "" : ", ") + t.flag;
  }
  return pd::Status::invalid_argument(std::string(flag) + ": weight type '" + s +
                                      "' is not supported (the backends run " + names + ")");
}

uint32_t llama_file_type(pd::GgmlType t) {  // llama.cpp's LLAMA_FTYPE_* ("mostly" t)
  switch (t) {
    case pd::GgmlType::kF32: return 0;
    case pd::GgmlType::kF16: return 1;
    case pd::GgmlType::kQ4_0: return 2;
    case pd::GgmlType::kQ4_1: return 3;
    case pd::GgmlType::kQ8_0: return 7;
    case pd::GgmlType::kBF16: return 32;
    default: break;  // only kTypes' types are offered
  }
  return 0;
}

// SplitMix64: a fast generator with a 64-bit state, one per chunk of rows.
struct SplitMix64 {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
};
uint64_t chunk_seed(uint64_t seed, uint64_t tensor, uint64_t chunk) {
  SplitMix64 g{seed ^ (tensor * 0xD1B54A32D192ED03ull) ^ (chunk * 0x8CB92BA72F3D8DD7ull)};
  g.next();
  return g.next();
}

// One tensor to write: shape, type, how its values are drawn.
struct TensorPlan {
  std::string name;
  std::vector<int64_t> ne;  // ggml order
  pd::GgmlType type;
  double amplitude;  // values uniform in [-amplitude, amplitude]; norms: 1 +- amplitude
  bool is_norm = false;
  int64_t rows() const {
    int64_t r = 1;
    for (size_t i = 1; i < ne.size(); ++i) r *= ne[i];
    return r;
  }
  size_t row_bytes() const { return pd::ggml_row_bytes(type, ne[0]); }
  size_t bytes() const { return row_bytes() * static_cast<size_t>(rows()); }
};

// Draws a tensor's data chunk by chunk: chunk c (a fixed number of rows) has
// its own generator, so the bytes do not depend on how chunks meet threads.
class RowFiller {
 public:
  RowFiller(const TensorPlan& t, uint64_t seed, uint64_t index) : t_(t), seed_(seed), index_(index) {
    const float a = static_cast<float>(t.amplitude);
    if (t.type == pd::GgmlType::kF16 || t.type == pd::GgmlType::kBF16) {
      // 65536 evenly spaced values in [-a, a]: one 16-bit draw picks one.
      table16_.resize(65536);
      for (int i = 0; i < 65536; ++i) {
        const float x = t.is_norm ? 1.0f + a * (2.0f * (i + 0.5f) / 65536.0f - 1.0f)
                                  : a * (2.0f * (i + 0.5f) / 65536.0f - 1.0f);
        table16_[i] = t.type == pd::GgmlType::kF16 ? pd::fp32_to_fp16(x) : pd::fp32_to_bf16(x);
      }
    }
    // Block scales: the quants' range covers [-a, a].
    if (t.type == pd::GgmlType::kQ8_0) d16_ = pd::fp32_to_fp16(a / 127.0f);
    if (t.type == pd::GgmlType::kQ4_0) d16_ = pd::fp32_to_fp16(a / 8.0f);
    if (t.type == pd::GgmlType::kQ4_1) d16_ = pd::fp32_to_fp16(2.0f * a / 15.0f), m16_ = pd::fp32_to_fp16(-a);
  }

  void fill_chunk(int64_t chunk, int64_t rows, uint8_t* dst) const {
    SplitMix64 g{chunk_seed(seed_, index_, static_cast<uint64_t>(chunk))};
    const int64_t n = rows * t_.ne[0];  // elements
    const float a = static_cast<float>(t_.amplitude);
    switch (t_.type) {
      case pd::GgmlType::kF32: {
        auto* out = reinterpret_cast<float*>(dst);
        for (int64_t i = 0; i < n; ++i) {
          const float u = static_cast<float>(g.next() >> 40) * 0x1.0p-24f;  // [0, 1)
          out[i] = t_.is_norm ? 1.0f + a * (2.0f * u - 1.0f) : a * (2.0f * u - 1.0f);
        }
        return;
      }
      case pd::GgmlType::kF16:
      case pd::GgmlType::kBF16: {
        auto* out = reinterpret_cast<uint16_t*>(dst);
        int64_t i = 0;
        for (; i + 4 <= n; i += 4) {
          const uint64_t r = g.next();
          for (int k = 0; k < 4; ++k) out[i + k] = table16_[(r >> (16 * k)) & 0xFFFF];
        }
        for (; i < n; ++i) out[i] = table16_[g.next() & 0xFFFF];
        return;
      }
      case pd::GgmlType::kQ8_0: {
        auto* b = reinterpret_cast<pd::BlockQ8_0*>(dst);
        for (int64_t k = 0; k < n / 32; ++k) {
          b[k].d = d16_;
          for (int j = 0; j < 32; j += 8) {
            uint64_t r = g.next();
            for (int q = 0; q < 8; ++q, r >>= 8) {
              const int v = static_cast<int>(r & 0xFF) - 128;
              b[k].qs[j + q] = static_cast<int8_t>(v == -128 ? -127 : v);  // symmetric, as ggml's quantizer
            }
          }
        }
        return;
      }
      case pd::GgmlType::kQ4_0:
      case pd::GgmlType::kQ4_1: {
        const bool q41 = t_.type == pd::GgmlType::kQ4_1;
        const size_t bb = q41 ? sizeof(pd::BlockQ4_1) : sizeof(pd::BlockQ4_0);
        for (int64_t k = 0; k < n / 32; ++k) {
          uint8_t* blk = dst + static_cast<size_t>(k) * bb;
          uint8_t* qs = blk + (q41 ? 4 : 2);
          std::memcpy(blk, &d16_, 2);
          if (q41) std::memcpy(blk + 2, &m16_, 2);
          const uint64_t r0 = g.next(), r1 = g.next();
          std::memcpy(qs, &r0, 8);
          std::memcpy(qs + 8, &r1, 8);
        }
        return;
      }
      default:  // only kTypes' types are offered (parse_type)
        std::memset(dst, 0, static_cast<size_t>(rows) * pd::ggml_row_bytes(t_.type, t_.ne[0]));
        return;
    }
  }

 private:
  const TensorPlan& t_;
  uint64_t seed_, index_;
  std::vector<uint16_t> table16_;
  uint16_t d16_ = 0, m16_ = 0;
};

class FileOut {
 public:
  ~FileOut() {
    if (f_) std::fclose(f_);
  }
  pd::Status open(const std::string& path) {
    path_ = path;
    f_ = std::fopen(path.c_str(), "wb");
    if (!f_) return pd::Status::io_error(path + ": cannot create: " + std::strerror(errno) + " (--out)");
    return pd::Status::ok();
  }
  pd::Status write(const void* p, size_t n) {
    if (n > 0 && std::fwrite(p, 1, n, f_) != n)
      return pd::Status::io_error(path_ + ": write failed: " + std::strerror(errno));
    return pd::Status::ok();
  }
  pd::Status close() {
    FILE* f = f_;
    f_ = nullptr;
    if (std::fclose(f) != 0) return pd::Status::io_error(path_ + ": cannot close: " + std::strerror(errno));
    return pd::Status::ok();
  }

 private:
  std::string path_;
  FILE* f_ = nullptr;
};

template <typename T>
void put(std::vector<uint8_t>& v, T x) {  // little-endian host, as GgufWriter
  const auto* p = reinterpret_cast<const uint8_t*>(&x);
  v.insert(v.end(), p, p + sizeof(T));
}

// The tokenizer.* metadata of the tiny test models, at `vocab` tokens.
pd::Result<std::unique_ptr<pd::GgufFile>> tiny_tokenizer(int vocab) {
  pd::TinyLlamaSpec spec;  // smallest model that carries the vocabulary
  spec.n_layers = 1;
  spec.hidden = 32;
  spec.n_heads = 1;
  spec.n_kv_heads = 1;
  spec.ffn = 32;
  spec.vocab = vocab;
  spec.weight_type = pd::GgmlType::kF16;
  spec.embed_type = pd::GgmlType::kF16;
  return pd::GgufFile::from_bytes(pd::make_tiny_llama_gguf(spec), "tiny tokenizer");
}

constexpr uint64_t kAlignment = 32;
constexpr size_t kPieceBytes = size_t{128} << 20;  // generated, then written while the next one is generated
constexpr size_t kChunkBytes = size_t{1} << 20;    // one generator seed per chunk of rows

// ---- flags

struct MakeFlags {
  std::string shape_name, type = "q4_0", embed_type, out, tokenizer_from;
  int context = 0;
  uint64_t seed = 1;
};

// What the flags make: the shape, its weight types and context.
struct ModelPlan {
  const Shape* shape = nullptr;
  pd::GgmlType type{}, embed_type{};
  int context = 0;
};

// Parses the command line into *f. Returns the exit status when the tool
// stops here (--help, a bad flag), nothing when it goes on.
std::optional<int> parse_flags(int argc, char** argv, MakeFlags* f) {
  CLI::App app{"pd-make-model: write a random-weight Llama GGUF of a real model's shape"};
  std::vector<std::string> shape_names;
  for (const Shape& s : kShapes) shape_names.push_back(s.name);
  app.add_option("--shape", f->shape_name, "model shape: llama-3.1-8b, smollm2-135m or tiny")
      ->required()
      ->check(CLI::IsMember(shape_names));
  app.add_option("--type", f->type, "weight type of every matrix: q4_0 (default), q4_1, q8_0, f16, bf16 or f32");
  app.add_option("--embed-type", f->embed_type, "type of token_embd.weight (default: --type)");
  app.add_option("--context", f->context, "context length (default: the shape's; llama-3.1-8b: 8192)")
      ->check(CLI::Range(16, 1 << 20));
  app.add_option("--seed", f->seed, "weight seed");
  app.add_option("--tokenizer-from", f->tokenizer_from,
                 "copy the tokenizer.* metadata of this GGUF (its vocabulary must be the shape's size)");
  app.add_option("-o,--out", f->out, "output .gguf path")->required();
  if (auto code = pd::tools::parse_command_line(app, argc, argv, "pd-make-model")) return code;
  return std::nullopt;
}

// The shape and types the flags name; a type whose blocks do not divide the shape's rows is refused.
std::optional<ToolError> plan_model(const MakeFlags& f, ModelPlan* m) {
  for (const Shape& s : kShapes)
    if (f.shape_name == s.name) m->shape = &s;
  const auto type = parse_type(f.type, "--type");
  if (!type.is_ok()) return ToolError{type.status().message(), 2};
  const auto embed_type = parse_type(f.embed_type.empty() ? f.type : f.embed_type, "--embed-type");
  if (!embed_type.is_ok()) return ToolError{embed_type.status().message(), 2};
  m->type = *type;
  m->embed_type = *embed_type;
  m->context = f.context == 0 ? m->shape->context : f.context;
  const Shape& shape = *m->shape;
  const int64_t head_dim = shape.hidden / shape.n_heads;
  for (const auto& [t, flag] : {std::pair{m->type, "--type"}, std::pair{m->embed_type, "--embed-type"}}) {
    const int64_t block = pd::ggml_traits(t).block_elems;
    for (int64_t k : {int64_t{shape.hidden}, shape.n_heads * head_dim, int64_t{shape.ffn}})
      if (k % block != 0)
        return ToolError{std::string(flag) + ": " + pd::ggml_type_name(t) + " needs rows that are multiples of " +
                             std::to_string(block) + "; shape " + shape.name + " has a row of " + std::to_string(k),
                         2};
  }
  return std::nullopt;
}

// The tokenizer metadata: of --tokenizer-from (its vocabulary the shape's
// size), else the tiny test models'. Null with *err set on failure.
std::unique_ptr<pd::GgufFile> load_tokenizer(const MakeFlags& f, const Shape& shape, ToolError* err) {
  if (f.tokenizer_from.empty()) {
    auto tok = tiny_tokenizer(shape.vocab);
    if (!tok.is_ok()) *err = {tok.status().to_string()};
    return tok.is_ok() ? std::move(tok).value() : nullptr;
  }
  auto tok = pd::GgufFile::open(f.tokenizer_from);
  if (!tok.is_ok()) {
    *err = {tok.status().to_string() + " (--tokenizer-from)", 2};
    return nullptr;
  }
  const pd::GgufValue* tokens = (*tok)->find("tokenizer.ggml.tokens");
  const pd::GgufArray* arr = tokens ? tokens->as_array() : nullptr;
  if (!arr) {
    *err = {"--tokenizer-from: " + f.tokenizer_from + " has no tokenizer.ggml.tokens", 2};
    return nullptr;
  }
  if (static_cast<int64_t>(arr->items.size()) != shape.vocab) {
    *err = {"--tokenizer-from: " + f.tokenizer_from + " has a vocabulary of " + std::to_string(arr->items.size()) +
                " tokens; shape " + shape.name + " needs " + std::to_string(shape.vocab),
            2};
    return nullptr;
  }
  return std::move(tok).value();
}

// Header and metadata through the project's writer. Alignment 1 with
// general.alignment set to 32 by hand: to_bytes() is then exactly header +
// metadata, with no tensor infos and no padding; the tensor count is patched in later.
std::vector<uint8_t> metadata_bytes(const ModelPlan& m, const pd::GgufFile& tok) {
  const Shape& shape = *m.shape;
  pd::GgufWriter w(1);
  w.set_string("general.architecture", "llama");
  w.set_string("general.name", std::string("random-weight ") + shape.description + " shape");
  w.set_u32("general.alignment", static_cast<uint32_t>(kAlignment));
  w.set_u32("general.file_type", llama_file_type(m.type));
  w.set_u32("general.quantization_version", 2);
  w.set_u32("llama.block_count", static_cast<uint32_t>(shape.n_layers));
  w.set_u32("llama.context_length", static_cast<uint32_t>(m.context));
  w.set_u32("llama.embedding_length", static_cast<uint32_t>(shape.hidden));
  w.set_u32("llama.feed_forward_length", static_cast<uint32_t>(shape.ffn));
  w.set_u32("llama.attention.head_count", static_cast<uint32_t>(shape.n_heads));
  w.set_u32("llama.attention.head_count_kv", static_cast<uint32_t>(shape.n_kv_heads));
  w.set_f32("llama.rope.freq_base", shape.rope_base);
  w.set_f32("llama.attention.layer_norm_rms_epsilon", shape.rms_eps);
  w.set_u32("llama.rope.dimension_count", static_cast<uint32_t>(shape.hidden / shape.n_heads));
  w.set_u32("llama.vocab_size", static_cast<uint32_t>(shape.vocab));
  for (const auto& [key, value] : tok.metadata())
    if (key.rfind("tokenizer.", 0) == 0) w.set(key, value);
  return w.to_bytes();
}

// The tensors, in the order llama.cpp writes them.
std::vector<TensorPlan> plan_tensors(const ModelPlan& m) {
  const Shape& shape = *m.shape;
  const int64_t hidden = shape.hidden, head_dim = shape.hidden / shape.n_heads;
  const int64_t q_dim = shape.n_heads * head_dim, kv_dim = shape.n_kv_heads * head_dim, ffn = shape.ffn;
  const pd::GgmlType type = m.type;
  std::vector<TensorPlan> plan;
  const auto inv_sqrt3 = [](double fan_in) { return std::sqrt(3.0 / fan_in); };  // uniform of stddev 1/sqrt(fan_in)
  const double embed_amp = std::sqrt(3.0) * 2.0 / std::sqrt(static_cast<double>(hidden));
  plan.push_back({"token_embd.weight", {hidden, shape.vocab}, m.embed_type, embed_amp});
  for (int l = 0; l < shape.n_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    plan.push_back({p + "attn_norm.weight", {hidden}, pd::GgmlType::kF32, 0.1, true});
    plan.push_back({p + "attn_q.weight", {hidden, q_dim}, type, inv_sqrt3(hidden)});
    plan.push_back({p + "attn_k.weight", {hidden, kv_dim}, type, inv_sqrt3(hidden)});
    plan.push_back({p + "attn_v.weight", {hidden, kv_dim}, type, inv_sqrt3(hidden)});
    plan.push_back({p + "attn_output.weight", {q_dim, hidden}, type, inv_sqrt3(q_dim)});
    plan.push_back({p + "ffn_norm.weight", {hidden}, pd::GgmlType::kF32, 0.1, true});
    plan.push_back({p + "ffn_gate.weight", {hidden, ffn}, type, inv_sqrt3(hidden)});
    plan.push_back({p + "ffn_up.weight", {hidden, ffn}, type, inv_sqrt3(hidden)});
    plan.push_back({p + "ffn_down.weight", {ffn, hidden}, type, inv_sqrt3(ffn)});
  }
  plan.push_back({"output_norm.weight", {hidden}, pd::GgmlType::kF32, 0.1, true});
  if (!shape.tied_embeddings) plan.push_back({"output.weight", {hidden, shape.vocab}, type, embed_amp});
  return plan;
}

// Appends the tensor infos to the metadata in *head (patching its tensor
// count) and pads it to the alignment. *data_bytes: the tensor data's size;
// *params: the parameter count.
void append_tensor_infos(const std::vector<TensorPlan>& plan, std::vector<uint8_t>* head, uint64_t* data_bytes,
                         uint64_t* params) {
  const uint64_t n_tensors = plan.size();
  std::memcpy(head->data() + 8, &n_tensors, 8);  // magic, version, then the tensor count
  uint64_t offset = 0;
  *params = 0;
  for (const TensorPlan& t : plan) {
    put<uint64_t>(*head, t.name.size());
    head->insert(head->end(), t.name.begin(), t.name.end());
    put<uint32_t>(*head, static_cast<uint32_t>(t.ne.size()));
    for (int64_t d : t.ne) put<uint64_t>(*head, static_cast<uint64_t>(d));
    put<uint32_t>(*head, static_cast<uint32_t>(t.type));
    put<uint64_t>(*head, offset);
    offset += (t.bytes() + kAlignment - 1) / kAlignment * kAlignment;
    *params += static_cast<uint64_t>(t.rows() * t.ne[0]);
  }
  *data_bytes = offset;
  head->resize((head->size() + kAlignment - 1) / kAlignment * kAlignment, 0);
}

// Generates every tensor's data and writes it to f, in pieces: one is
// generated (rows in parallel, one seed per chunk) while the other is written.
pd::Status write_tensor_data(FileOut& f, const std::vector<TensorPlan>& plan, uint64_t seed) {
  std::vector<uint8_t> piece[2];
  std::future<pd::Status> pending;
  int cur = 0;
  auto flush = [&](std::vector<uint8_t>& buf) -> pd::Status {
    if (pending.valid()) PD_RETURN_IF_ERROR(pending.get());
    pending = std::async(std::launch::async, [&f, &buf] { return f.write(buf.data(), buf.size()); });
    return pd::Status::ok();
  };
  for (size_t ti = 0; ti < plan.size(); ++ti) {
    const TensorPlan& t = plan[ti];
    const RowFiller filler(t, seed, ti);
    const size_t rb = t.row_bytes();
    const int64_t rows = t.rows();
    const int64_t rows_per_chunk = std::max<int64_t>(1, static_cast<int64_t>(kChunkBytes / rb));
    const int64_t chunks_per_piece = std::max<int64_t>(1, static_cast<int64_t>(kPieceBytes / (rows_per_chunk * rb)));
    const int64_t n_chunks = (rows + rows_per_chunk - 1) / rows_per_chunk;
    for (int64_t c0 = 0; c0 < n_chunks; c0 += chunks_per_piece) {
      const int64_t c1 = std::min(n_chunks, c0 + chunks_per_piece);
      const int64_t r0 = c0 * rows_per_chunk, r1 = std::min(rows, c1 * rows_per_chunk);
      // The write in flight (if any) is of the other piece; this one's ended in flush().
      std::vector<uint8_t>& buf = piece[cur];
      size_t len = static_cast<size_t>(r1 - r0) * rb;
      if (r1 == rows) len = (t.bytes() + kAlignment - 1) / kAlignment * kAlignment - static_cast<size_t>(r0) * rb;
      buf.assign(len, 0);
#pragma omp parallel for schedule(dynamic, 1) if (c1 - c0 >= 4)
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t a = c * rows_per_chunk, b = std::min(rows, a + rows_per_chunk);
        filler.fill_chunk(c, b - a, buf.data() + static_cast<size_t>(a - r0) * rb);
      }
      PD_RETURN_IF_ERROR(flush(buf));
      cur ^= 1;
    }
  }
  if (pending.valid()) PD_RETURN_IF_ERROR(pending.get());
  return pd::Status::ok();
}

}  // namespace

int main(int argc, char** argv) {
  MakeFlags flags;
  if (auto code = parse_flags(argc, argv, &flags)) return *code;
  ModelPlan m;
  if (auto err = plan_model(flags, &m)) return fail(*err);
  ToolError err;
  const auto tok = load_tokenizer(flags, *m.shape, &err);
  if (!tok) return fail(err);

  const std::vector<TensorPlan> plan = plan_tensors(m);
  std::vector<uint8_t> head = metadata_bytes(m, *tok);
  uint64_t data_bytes = 0, params = 0;
  append_tensor_infos(plan, &head, &data_bytes, &params);

  const auto t0 = pd::tools::Clock::now();
  FileOut f;
  if (auto st = f.open(flags.out); !st.is_ok()) return fail(st.message(), 2);
  if (auto st = f.write(head.data(), head.size()); !st.is_ok()) return fail(st.message());
  if (auto st = write_tensor_data(f, plan, flags.seed); !st.is_ok()) return fail(st.message());
  if (auto st = f.close(); !st.is_ok()) return fail(st.message());
  const double secs = pd::tools::seconds(pd::tools::Clock::now() - t0);
  const double gb = static_cast<double>(head.size() + data_bytes) / 1e9;
  std::printf("pd-make-model: wrote %s: %s shape, %.3f M parameters, %s weights (%s embeddings), context %d, "
              "%.3f GB in %.1f s (%d threads)\n",
              flags.out.c_str(), m.shape->name, static_cast<double>(params) / 1e6, pd::ggml_type_name(m.type),
              pd::ggml_type_name(m.embed_type), m.context, gb, secs, omp_get_max_threads());
  return 0;
}
