#include "model/llama_config.h"

#include <cmath>
#include <sstream>

#include "gguf/gguf_reader.h"

namespace pd {
namespace {

Result<int> get_positive(const GgufFile& f, const std::string& key) {
  auto v = f.get_int(key);
  if (!v.is_ok()) {
    if (v.status().is_not_found()) return Status::invalid_argument(f.path() + ": missing metadata key " + key);
    return v.status();
  }
  if (*v <= 0 || *v > (1 << 30))
    return Status::invalid_argument(f.path() + ": metadata " + key + " = " + std::to_string(*v) + " is out of range");
  return static_cast<int>(*v);
}

// The local/global layer pattern of a sliding-window model: the
// attention.sliding_window_pattern key when present (an array of one bool per
// layer, true = local, as gguf-py writes it; or an integer n: n - 1 local
// layers, then a global one), else `default_period` (llama.cpp hard-codes 6
// for gemma3: layers 5, 11, 17, ... are global).
Result<std::vector<uint8_t>> swa_pattern(const GgufFile& f, const std::string& key, int n_layers,
                                         int default_period) {
  std::vector<uint8_t> layers(static_cast<size_t>(n_layers));
  int period = default_period;
  if (const GgufValue* v = f.find(key)) {
    if (const GgufArray* a = v->as_array()) {
      if (static_cast<int>(a->items.size()) != n_layers)
        return Status::invalid_argument(f.path() + ": metadata " + key + " has " + std::to_string(a->items.size()) +
                                        " entries for " + std::to_string(n_layers) + " layers");
      for (int l = 0; l < n_layers; ++l) {
        std::optional<bool> b = a->items[static_cast<size_t>(l)].as_bool();
        std::optional<int64_t> i = a->items[static_cast<size_t>(l)].as_int();
        if (!b && !i) return Status::invalid_argument(f.path() + ": metadata " + key + " holds a non-boolean");
        layers[static_cast<size_t>(l)] = (b ? *b : *i != 0) ? 1 : 0;
      }
      return layers;
    }
    PD_ASSIGN_OR_RETURN(period, get_positive(f, key));
  }
  for (int l = 0; l < n_layers; ++l) layers[static_cast<size_t>(l)] = l % period < period - 1 ? 1 : 0;
  return layers;
}

// Key/value head counts and the head dim (key_length, else hidden / heads),
// checked against what the kernels support. `p` is "<arch>.".
Status read_attention_heads(const GgufFile& f, const std::string& p, LlamaConfig& c) {
  c.n_kv_heads = c.n_heads;
  if (f.find(p + "attention.head_count_kv")) {
    PD_ASSIGN_OR_RETURN(c.n_kv_heads, get_positive(f, p + "attention.head_count_kv"));
  }
  if (c.n_heads % c.n_kv_heads != 0)
    return Status::invalid_argument(f.path() + ": head_count " + std::to_string(c.n_heads) +
                                    " is not a multiple of head_count_kv " + std::to_string(c.n_kv_heads));
  if (f.find(p + "attention.key_length")) {
    PD_ASSIGN_OR_RETURN(c.head_dim, get_positive(f, p + "attention.key_length"));
  } else {
    if (c.hidden % c.n_heads != 0)
      return Status::invalid_argument(f.path() + ": embedding_length is not a multiple of head_count");
    c.head_dim = c.hidden / c.n_heads;
  }
  if (f.find(p + "attention.value_length")) {
    PD_ASSIGN_OR_RETURN(int vl, get_positive(f, p + "attention.value_length"));
    if (vl != c.head_dim)
      return Status::unsupported(f.path() + ": " + p + "attention.value_length " + std::to_string(vl) +
                                 " != key_length " + std::to_string(c.head_dim) + " is not supported");
  }
  if (f.find(p + "rope.dimension_count")) {
    PD_ASSIGN_OR_RETURN(int rd, get_positive(f, p + "rope.dimension_count"));
    if (rd != c.head_dim)
      return Status::unsupported(f.path() + ": partial rotary embedding (rope.dimension_count " + std::to_string(rd) +
                                 " != head dim " + std::to_string(c.head_dim) + ") is not supported");
  }
  if (c.head_dim % 2 != 0 || c.head_dim > 256)
    return Status::unsupported(f.path() + ": head dim " + std::to_string(c.head_dim) + " is not supported (even, <= 256)");
  return Status::ok();
}

// RoPE: llama.cpp's rope type per architecture, and its reading of the
// scaling keys (a factor without a type is linear).
Status read_rope(const GgufFile& f, const std::string& p, LlamaConfig& c) {
  c.rope_neox = c.arch != "llama";
  std::string scaling = "none";
  if (f.find(p + "rope.scaling.type")) {
    PD_ASSIGN_OR_RETURN(scaling, f.get_string(p + "rope.scaling.type"));
  } else if (f.find(p + "rope.scaling.factor")) {
    scaling = "linear";
  }
  if (scaling == "linear") {
    PD_ASSIGN_OR_RETURN(double factor, f.get_float(p + "rope.scaling.factor"));
    if (!(factor > 0.0 && factor < 1e6))
      return Status::invalid_argument(f.path() + ": " + p + "rope.scaling.factor must be positive");
    c.rope_freq_scale = static_cast<float>(1.0 / factor);
  } else if (scaling != "none") {
    return Status::unsupported(f.path() + ": RoPE scaling '" + scaling + "' (" + p +
                               "rope.scaling.type) is not supported (none, linear; Llama 3's rope_freqs)");
  }
  // Llama 3.x's scaling, baked into per-pair factors by llama.cpp's converter
  // (llama only: other architectures' files never carry it).
  c.rope_freq_factors = c.arch == "llama" && f.find_tensor("rope_freqs.weight") != nullptr;
  if (f.find(p + "rope.freq_base")) {
    PD_ASSIGN_OR_RETURN(double b, f.get_float(p + "rope.freq_base"));
    if (!(b > 1.0)) return Status::invalid_argument(f.path() + ": " + p + "rope.freq_base must be > 1");
    c.rope_base = static_cast<float>(b);
  }
  return Status::ok();
}

// Gemma 3: post-norms, GeGLU, scaled embeddings and interleaved
// sliding-window (local) and global layers.
Status setup_gemma3(const GgufFile& f, const std::string& p, LlamaConfig& c) {
  c.post_norms = true;
  c.gelu_ffn = true;
  c.embed_scale = std::sqrt(static_cast<float>(c.hidden));
  // llama.cpp (llm_build_gemma3_iswa): queries scaled by 1/sqrt(key_length),
  // except Gemma 3 27B (62 layers), whose query_pre_attn_scalar is
  // hidden / heads; GGUF files carry no key for it.
  if (c.n_layers == 62) c.attn_scale = 1.0f / std::sqrt(static_cast<float>(c.hidden / c.n_heads));
  PD_ASSIGN_OR_RETURN(c.sliding_window, get_positive(f, p + "attention.sliding_window"));
  PD_ASSIGN_OR_RETURN(c.swa_layers, swa_pattern(f, p + "attention.sliding_window_pattern", c.n_layers, 6));
  c.rope_base_swa = 10000.0f;  // llama.cpp: rope_freq_base_train_swa, hard-coded for gemma3
  return Status::ok();
}

// Block structure: the architecture variants (biases, norms, FFN kind).
Status read_block_structure(const GgufFile& f, const std::string& p, LlamaConfig& c) {
  const bool gemma3 = c.arch == "gemma3";
  // Q/K/V biases wherever the file has them (qwen2 always).
  c.qkv_bias = c.arch == "qwen2" || f.find_tensor("blk.0.attn_q.bias") != nullptr;
  c.qk_norm = c.arch == "qwen3" || gemma3;
  c.attn_scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  for (const char* key : {"attn_logit_softcapping", "final_logit_softcapping"}) {
    if (f.find(p + key))
      return Status::unsupported(f.path() + ": " + p + key + " (logit soft-capping) is not supported");
  }
  if (gemma3) PD_RETURN_IF_ERROR(setup_gemma3(f, p, c));
  return Status::ok();
}

}  // namespace

Result<LlamaConfig> LlamaConfig::from_gguf(const GgufFile& f) {
  PD_RETURN_IF_ERROR(check_llama_family(f));
  LlamaConfig c;
  PD_ASSIGN_OR_RETURN(c.arch, f.get_string("general.architecture"));
  const std::string p = c.arch + ".";
  if (auto n = f.get_string("general.name"); n.is_ok()) c.name = *n;
  PD_ASSIGN_OR_RETURN(c.n_layers, get_positive(f, p + "block_count"));
  PD_ASSIGN_OR_RETURN(c.hidden, get_positive(f, p + "embedding_length"));
  PD_ASSIGN_OR_RETURN(c.n_heads, get_positive(f, p + "attention.head_count"));
  PD_ASSIGN_OR_RETURN(c.ffn, get_positive(f, p + "feed_forward_length"));
  PD_ASSIGN_OR_RETURN(c.context, get_positive(f, p + "context_length"));
  PD_RETURN_IF_ERROR(read_attention_heads(f, p, c));
  PD_RETURN_IF_ERROR(read_rope(f, p, c));
  if (f.find(p + "attention.layer_norm_rms_epsilon")) {
    PD_ASSIGN_OR_RETURN(double e, f.get_float(p + "attention.layer_norm_rms_epsilon"));
    if (!(e > 0.0 && e < 1.0)) return Status::invalid_argument(f.path() + ": layer_norm_rms_epsilon out of range");
    c.rms_eps = static_cast<float>(e);
  }
  if (f.find(p + "vocab_size")) {
    PD_ASSIGN_OR_RETURN(c.vocab, get_positive(f, p + "vocab_size"));
  } else if (const GgufTensorInfo* t = f.find_tensor("token_embd.weight"); t && t->ne.size() == 2) {
    c.vocab = static_cast<int>(t->ne[1]);
  } else {
    return Status::invalid_argument(f.path() + ": cannot determine vocab size");
  }
  c.tied_embeddings = f.find_tensor("output.weight") == nullptr;
  PD_RETURN_IF_ERROR(read_block_structure(f, p, c));
  return c;
}

std::string LlamaConfig::describe() const {
  std::ostringstream os;
  os << arch << ": " << n_layers << " layers, hidden " << hidden << ", " << n_heads << " heads, " << n_kv_heads
     << " KV heads, head dim " << head_dim << ", FFN " << ffn << (gelu_ffn ? " (GeGLU)" : "") << ", vocab " << vocab
     << ", context " << context << ", rope base " << rope_base << (rope_neox ? " (neox)" : "");
  if (rope_freq_scale != 1.0f) os << ", rope linear scale " << rope_freq_scale;
  if (rope_freq_factors) os << ", rope frequency factors";
  if (qkv_bias) os << ", QKV bias";
  if (qk_norm) os << ", QK norm";
  if (post_norms) os << ", post-norms";
  if (sliding_window > 0) {
    int local = 0;
    for (uint8_t s : swa_layers) local += s;
    os << ", sliding window " << sliding_window << " on " << local << " of " << n_layers << " layers (rope base "
       << rope_base_swa << ")";
  }
  if (tied_embeddings) os << ", tied embeddings";
  return os.str();
}

}  // namespace pd
