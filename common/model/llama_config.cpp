#include "model/llama_config.h"

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

}  // namespace

Result<LlamaConfig> LlamaConfig::from_gguf(const GgufFile& f) {
  PD_RETURN_IF_ERROR(check_llama_family(f));
  LlamaConfig c;
  if (auto n = f.get_string("general.name"); n.is_ok()) c.name = *n;
  PD_ASSIGN_OR_RETURN(c.n_layers, get_positive(f, "llama.block_count"));
  PD_ASSIGN_OR_RETURN(c.hidden, get_positive(f, "llama.embedding_length"));
  PD_ASSIGN_OR_RETURN(c.n_heads, get_positive(f, "llama.attention.head_count"));
  PD_ASSIGN_OR_RETURN(c.ffn, get_positive(f, "llama.feed_forward_length"));
  PD_ASSIGN_OR_RETURN(c.context, get_positive(f, "llama.context_length"));
  c.n_kv_heads = c.n_heads;
  if (f.find("llama.attention.head_count_kv")) {
    PD_ASSIGN_OR_RETURN(c.n_kv_heads, get_positive(f, "llama.attention.head_count_kv"));
  }
  if (c.n_heads % c.n_kv_heads != 0)
    return Status::invalid_argument(f.path() + ": head_count " + std::to_string(c.n_heads) +
                                    " is not a multiple of head_count_kv " + std::to_string(c.n_kv_heads));
  if (c.hidden % c.n_heads != 0)
    return Status::invalid_argument(f.path() + ": embedding_length is not a multiple of head_count");
  c.head_dim = c.hidden / c.n_heads;
  if (f.find("llama.attention.key_length")) {
    PD_ASSIGN_OR_RETURN(int kl, get_positive(f, "llama.attention.key_length"));
    c.head_dim = kl;
  }
  if (f.find("llama.rope.dimension_count")) {
    PD_ASSIGN_OR_RETURN(int rd, get_positive(f, "llama.rope.dimension_count"));
    if (rd != c.head_dim)
      return Status::unsupported(f.path() + ": partial rotary embedding (rope.dimension_count " + std::to_string(rd) +
                                 " != head dim " + std::to_string(c.head_dim) + ") is not supported");
  }
  if (c.head_dim % 2 != 0 || c.head_dim > 256)
    return Status::unsupported(f.path() + ": head dim " + std::to_string(c.head_dim) + " is not supported (even, <= 256)");
  if (auto st = f.get_string("llama.rope.scaling.type"); st.is_ok() && *st != "none")
    return Status::unsupported(f.path() + ": RoPE scaling '" + *st + "' is not supported");
  if (f.find("llama.rope.freq_base")) {
    PD_ASSIGN_OR_RETURN(double b, f.get_float("llama.rope.freq_base"));
    if (!(b > 1.0)) return Status::invalid_argument(f.path() + ": llama.rope.freq_base must be > 1");
    c.rope_base = static_cast<float>(b);
  }
  if (f.find("llama.attention.layer_norm_rms_epsilon")) {
    PD_ASSIGN_OR_RETURN(double e, f.get_float("llama.attention.layer_norm_rms_epsilon"));
    if (!(e > 0.0 && e < 1.0)) return Status::invalid_argument(f.path() + ": layer_norm_rms_epsilon out of range");
    c.rms_eps = static_cast<float>(e);
  }
  if (f.find("llama.vocab_size")) {
    PD_ASSIGN_OR_RETURN(c.vocab, get_positive(f, "llama.vocab_size"));
  } else if (const GgufTensorInfo* t = f.find_tensor("token_embd.weight"); t && t->ne.size() == 2) {
    c.vocab = static_cast<int>(t->ne[1]);
  } else {
    return Status::invalid_argument(f.path() + ": cannot determine vocab size");
  }
  c.tied_embeddings = f.find_tensor("output.weight") == nullptr;
  return c;
}

std::string LlamaConfig::describe() const {
  std::ostringstream os;
  os << "llama: " << n_layers << " layers, hidden " << hidden << ", " << n_heads << " heads, " << n_kv_heads
     << " KV heads, head dim " << head_dim << ", FFN " << ffn << ", vocab " << vocab << ", context " << context
     << ", rope base " << rope_base << (tied_embeddings ? ", tied embeddings" : "");
  return os.str();
}

}  // namespace pd
