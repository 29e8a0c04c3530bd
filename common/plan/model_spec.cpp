#include "plan/model_spec.h"

#include <algorithm>
#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "gguf/gguf_reader.h"
#include "util/strings.h"

namespace pd::plan {
namespace {

ModelSpec make(const char* name, int layers, int hidden, int heads, int kv_heads, int head_dim, int ffn,
               int vocab, bool tied, bool qkv_bias, int64_t max_context) {
  ModelSpec m;
  m.name = name;
  m.n_layers = layers;
  m.hidden = hidden;
  m.n_heads = heads;
  m.n_kv_heads = kv_heads;
  m.head_dim = head_dim;
  m.ffn = ffn;
  m.vocab = vocab;
  m.tied_embeddings = tied;
  m.qkv_bias = qkv_bias;
  m.max_context = max_context;
  return m;
}

}  // namespace

ParamBreakdown parameter_breakdown(const ModelSpec& m) {
  ParamBreakdown b;
  const int64_t d = m.hidden;
  const int64_t q_width = int64_t{m.n_heads} * m.head_dim;
  const int64_t kv_width = int64_t{m.n_kv_heads} * m.head_dim;
  b.embedding = int64_t{m.vocab} * d;
  const int64_t attn_matrices = d * q_width + 2 * d * kv_width + q_width * d;  // Wq, Wk, Wv, Wo
  const int64_t mlp_matrices = 3 * d * m.ffn;                                 // gate, up, down
  b.attention = attn_matrices + (m.qkv_bias ? q_width + 2 * kv_width : 0);
  b.mlp = mlp_matrices;
  b.norms = (m.post_norms ? 4 : 2) * d + (m.qk_norm ? 2 * int64_t{m.head_dim} : 0);
  b.final_norm = d;
  b.lm_head = m.tied_embeddings ? 0 : int64_t{m.vocab} * d;
  b.linear_per_layer = attn_matrices + mlp_matrices;
  b.total = b.embedding + int64_t{m.n_layers} * b.per_layer() + b.final_norm + b.lm_head;
  return b;
}

Status validate_model(const ModelSpec& m) {
  const std::string who = "model '" + m.name + "': ";
  struct Field {
    const char* name;
    int64_t value;
    int64_t max;
  };
  const Field fields[] = {
      {"n_layers", m.n_layers, 10'000},  {"hidden_size", m.hidden, 1'000'000},
      {"n_heads", m.n_heads, 100'000},   {"n_kv_heads", m.n_kv_heads, 100'000},
      {"head_dim", m.head_dim, 100'000}, {"ffn_size", m.ffn, 10'000'000},
      {"vocab_size", m.vocab, 100'000'000},
  };
  for (const Field& f : fields) {
    if (f.value <= 0) {
      return Status::invalid_argument(who + f.name + " must be positive, got " + std::to_string(f.value));
    }
    if (f.value > f.max) {
      return Status::invalid_argument(who + f.name + " is implausibly large: " + std::to_string(f.value) +
                                      " (limit " + std::to_string(f.max) + ")");
    }
  }
  if (m.n_heads % m.n_kv_heads != 0) {
    return Status::invalid_argument(who + "n_heads (" + std::to_string(m.n_heads) +
                                    ") must be a multiple of n_kv_heads (" + std::to_string(m.n_kv_heads) + ")");
  }
  if (m.max_context < 0) {
    return Status::invalid_argument(who + "max_context must not be negative, got " +
                                    std::to_string(m.max_context));
  }
  return Status::ok();
}

const std::vector<ModelSpec>& model_presets() {
  // name, layers, hidden, heads, kv_heads, head_dim, ffn, vocab, tied, qkv_bias, max_context
  static const std::vector<ModelSpec> presets = {
      make("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256, false, false, 131072),
      make("llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256, false, false, 131072),
      make("llama-3.1-405b", 126, 16384, 128, 8, 128, 53248, 128256, false, false, 131072),
      make("mistral-7b-v0.1", 32, 4096, 32, 8, 128, 14336, 32000, false, false, 32768),
      make("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, false, true, 131072),
      make("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, true, false, 8192),
      make("llama-2-7b", 32, 4096, 32, 32, 128, 11008, 32000, false, false, 4096),
  };
  return presets;
}

Result<ModelSpec> model_preset(std::string_view name) {
  const std::string want = ascii_lower(name);
  std::string known;
  for (const ModelSpec& m : model_presets()) {
    if (m.name == want) return m;
    known += (known.empty() ? "" : ", ") + m.name;
  }
  return Status::not_found("unknown model preset '" + std::string(name) + "' (known: " + known + ")");
}

namespace {

// Looks up the first present key among `names`.
const nlohmann::json* find_field(const nlohmann::json& j, std::initializer_list<const char*> names) {
  for (const char* n : names) {
    auto it = j.find(n);
    if (it != j.end() && !it->is_null()) return &*it;
  }
  return nullptr;
}

std::string field_label(std::initializer_list<const char*> names) {
  std::string out;
  for (const char* n : names) out += out.empty() ? std::string("'") + n + "'" : std::string(" or '") + n + "'";
  return out;
}

Status read_int(const nlohmann::json& j, std::string_view source, std::initializer_list<const char*> names,
                bool required, int64_t* out) {
  const nlohmann::json* v = find_field(j, names);
  if (v == nullptr) {
    if (!required) return Status::ok();
    return Status::invalid_argument("model JSON '" + std::string(source) + "': missing field " +
                                    field_label(names));
  }
  if (!v->is_number_integer()) {
    // Accept integral floats (3.0) but nothing else.
    if (v->is_number_float() && v->get<double>() == static_cast<double>(static_cast<int64_t>(v->get<double>()))) {
      *out = static_cast<int64_t>(v->get<double>());
      return Status::ok();
    }
    return Status::invalid_argument("model JSON '" + std::string(source) + "': field " + field_label(names) +
                                    " must be an integer, got " + v->dump());
  }
  *out = v->get<int64_t>();
  return Status::ok();
}

Status read_bool(const nlohmann::json& j, std::string_view source, std::initializer_list<const char*> names,
                 bool* out) {
  const nlohmann::json* v = find_field(j, names);
  if (v == nullptr) return Status::ok();
  if (!v->is_boolean()) {
    return Status::invalid_argument("model JSON '" + std::string(source) + "': field " + field_label(names) +
                                    " must be true or false, got " + v->dump());
  }
  *out = v->get<bool>();
  return Status::ok();
}

// `where` names the input ("model JSON 'x.json'", "GGUF 'y.gguf'").
Status to_int(int64_t v, const std::string& where, const char* field, int* out) {
  if (v > std::numeric_limits<int>::max() || v < std::numeric_limits<int>::min()) {
    return Status::invalid_argument(where + ": field '" + field + "' out of range: " + std::to_string(v));
  }
  *out = static_cast<int>(v);
  return Status::ok();
}

}  // namespace

Result<ModelSpec> model_from_json(std::string_view json_text, std::string_view source) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    return Status::invalid_argument("model JSON '" + std::string(source) + "': not valid JSON: " + e.what());
  }
  if (!j.is_object()) {
    return Status::invalid_argument("model JSON '" + std::string(source) + "': top level must be an object");
  }
  ModelSpec m;
  if (const nlohmann::json* n = find_field(j, {"name", "_name_or_path"}); n != nullptr && n->is_string()) {
    m.name = n->get<std::string>();
  } else {
    m.name = std::string(source);
  }
  int64_t layers = 0, hidden = 0, heads = 0, kv_heads = -1, head_dim = -1, ffn = 0, vocab = 0, max_ctx = 0;
  PD_RETURN_IF_ERROR(read_int(j, source, {"n_layers", "num_hidden_layers"}, true, &layers));
  PD_RETURN_IF_ERROR(read_int(j, source, {"hidden_size", "hidden"}, true, &hidden));
  PD_RETURN_IF_ERROR(read_int(j, source, {"n_heads", "num_attention_heads"}, true, &heads));
  PD_RETURN_IF_ERROR(read_int(j, source, {"n_kv_heads", "num_key_value_heads"}, false, &kv_heads));
  PD_RETURN_IF_ERROR(read_int(j, source, {"head_dim"}, false, &head_dim));
  PD_RETURN_IF_ERROR(read_int(j, source, {"ffn_size", "intermediate_size"}, true, &ffn));
  PD_RETURN_IF_ERROR(read_int(j, source, {"vocab_size"}, true, &vocab));
  PD_RETURN_IF_ERROR(read_int(j, source, {"max_context", "max_position_embeddings"}, false, &max_ctx));
  if (kv_heads == -1) kv_heads = heads;
  if (head_dim == -1) {
    if (heads <= 0 || hidden % heads != 0) {
      return Status::invalid_argument("model JSON '" + std::string(source) +
                                      "': 'head_dim' missing and hidden_size (" + std::to_string(hidden) +
                                      ") is not a positive multiple of n_heads (" + std::to_string(heads) + ")");
    }
    head_dim = hidden / heads;
  }
  const std::string where = "model JSON '" + std::string(source) + "'";
  PD_RETURN_IF_ERROR(to_int(layers, where, "n_layers", &m.n_layers));
  PD_RETURN_IF_ERROR(to_int(hidden, where, "hidden_size", &m.hidden));
  PD_RETURN_IF_ERROR(to_int(heads, where, "n_heads", &m.n_heads));
  PD_RETURN_IF_ERROR(to_int(kv_heads, where, "n_kv_heads", &m.n_kv_heads));
  PD_RETURN_IF_ERROR(to_int(head_dim, where, "head_dim", &m.head_dim));
  PD_RETURN_IF_ERROR(to_int(ffn, where, "ffn_size", &m.ffn));
  PD_RETURN_IF_ERROR(to_int(vocab, where, "vocab_size", &m.vocab));
  m.max_context = max_ctx;
  // Qwen2's config.json has no attention_bias key; its Q/K/V projections carry biases.
  if (const nlohmann::json* t = find_field(j, {"model_type"}); t != nullptr && t->is_string()) {
    const std::string type = t->get<std::string>();
    if (type == "qwen2") m.qkv_bias = true;
    if (type == "qwen3" || type == "gemma3" || type == "gemma3_text") m.qk_norm = true;
    if (type == "gemma3" || type == "gemma3_text") m.post_norms = true;
  }
  PD_RETURN_IF_ERROR(read_bool(j, source, {"tied_embeddings", "tie_word_embeddings"}, &m.tied_embeddings));
  PD_RETURN_IF_ERROR(read_bool(j, source, {"qkv_bias", "attention_bias"}, &m.qkv_bias));
  Status valid = validate_model(m);
  if (!valid.is_ok()) return Status::invalid_argument(where + ": " + valid.message());
  return m;
}

Result<ModelSpec> model_from_json_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::io_error("model JSON '" + path + "': cannot open file");
  std::ostringstream ss;
  ss << in.rdbuf();
  return model_from_json(ss.str(), path);
}

namespace {

Status gguf_int(const GgufFile& f, const std::string& key, bool required, int64_t* out) {
  Result<int64_t> r = f.get_int(key);
  if (r.is_ok()) {
    *out = *r;
    return Status::ok();
  }
  if (!required && r.status().is_not_found()) return Status::ok();
  if (r.status().is_not_found()) {
    return Status::invalid_argument("GGUF '" + f.path() + "': missing metadata key '" + key + "'");
  }
  return Status::invalid_argument("GGUF '" + f.path() + "': " + r.status().message());
}

}  // namespace

Result<ModelSpec> model_from_gguf(const GgufFile& f) {
  std::string arch = "llama";
  if (Result<std::string> a = f.get_string("general.architecture"); a.is_ok()) arch = *a;
  const std::string p = arch + ".";
  int64_t layers = 0, hidden = 0, ffn = 0, heads = 0, kv_heads = -1, head_dim = -1, vocab = -1, ctx = 0;
  PD_RETURN_IF_ERROR(gguf_int(f, p + "block_count", true, &layers));
  PD_RETURN_IF_ERROR(gguf_int(f, p + "embedding_length", true, &hidden));
  PD_RETURN_IF_ERROR(gguf_int(f, p + "feed_forward_length", true, &ffn));
  PD_RETURN_IF_ERROR(gguf_int(f, p + "attention.head_count", true, &heads));
  PD_RETURN_IF_ERROR(gguf_int(f, p + "attention.head_count_kv", false, &kv_heads));
  PD_RETURN_IF_ERROR(gguf_int(f, p + "attention.key_length", false, &head_dim));
  if (head_dim == -1) PD_RETURN_IF_ERROR(gguf_int(f, p + "rope.dimension_count", false, &head_dim));
  PD_RETURN_IF_ERROR(gguf_int(f, p + "vocab_size", false, &vocab));
  PD_RETURN_IF_ERROR(gguf_int(f, p + "context_length", false, &ctx));
  if (kv_heads == -1) kv_heads = heads;
  if (head_dim == -1) {
    if (heads <= 0 || hidden % heads != 0) {
      return Status::invalid_argument("GGUF '" + f.path() + "': cannot derive head_dim: " + p +
                                      "embedding_length (" + std::to_string(hidden) + ") / " + p +
                                      "attention.head_count (" + std::to_string(heads) + ")");
    }
    head_dim = hidden / heads;
  }
  if (vocab == -1) {
    Result<std::vector<std::string>> tokens = f.get_string_array("tokenizer.ggml.tokens");
    if (!tokens.is_ok()) {
      return Status::invalid_argument("GGUF '" + f.path() + "': missing metadata key '" + p +
                                      "vocab_size' and 'tokenizer.ggml.tokens'");
    }
    vocab = static_cast<int64_t>(tokens->size());
  }
  ModelSpec m;
  m.name = f.path();
  if (Result<std::string> n = f.get_string("general.name"); n.is_ok() && !n->empty()) m.name = *n;
  const std::string src = "GGUF '" + f.path() + "'";
  PD_RETURN_IF_ERROR(to_int(layers, src, "block_count", &m.n_layers));
  PD_RETURN_IF_ERROR(to_int(hidden, src, "embedding_length", &m.hidden));
  PD_RETURN_IF_ERROR(to_int(heads, src, "attention.head_count", &m.n_heads));
  PD_RETURN_IF_ERROR(to_int(kv_heads, src, "attention.head_count_kv", &m.n_kv_heads));
  PD_RETURN_IF_ERROR(to_int(head_dim, src, "head_dim", &m.head_dim));
  PD_RETURN_IF_ERROR(to_int(ffn, src, "feed_forward_length", &m.ffn));
  PD_RETURN_IF_ERROR(to_int(vocab, src, "vocab_size", &m.vocab));
  m.max_context = ctx;
  m.qkv_bias = f.find_tensor("blk.0.attn_q.bias") != nullptr;
  m.qk_norm = f.find_tensor("blk.0.attn_q_norm.weight") != nullptr;
  m.post_norms = f.find_tensor("blk.0.post_attention_norm.weight") != nullptr;
  m.tied_embeddings = !f.tensors().empty() && f.find_tensor("output.weight") == nullptr;
  for (const GgufTensorInfo& t : f.tensors()) {
    m.file_params += t.n_elements();
    m.file_weight_bytes += static_cast<int64_t>(t.nbytes);
  }
  Status valid = validate_model(m);
  if (!valid.is_ok()) return Status::invalid_argument(src + ": " + valid.message());
  return m;
}

Result<ModelSpec> model_from_gguf_file(const std::string& path) {
  Result<std::unique_ptr<GgufFile>> f = GgufFile::open(path);
  if (!f.is_ok()) return f.status();
  return model_from_gguf(**f);
}

}  // namespace pd::plan
